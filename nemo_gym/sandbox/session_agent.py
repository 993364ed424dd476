"""The agent inside a session's sandbox: runs commands, file operations and a persistent Python kernel.

Contract
--------
* Runs INSIDE the bubblewrap sandbox of a :class:`nemo_gym.sandbox.session.SandboxSession`, as uid 65534,
  under the sandbox's Python (``python3 -I -S``): standard library only, nothing of nemo_gym is imported
  (the file is bound read-only into the sandbox and never imported by the host).
* Frames are a 4-byte big-endian length and a body. Requests (host to agent) are ``marshal``-ed dicts of
  plain values (the host is trusted; marshal is built in, so the agent starts without importing json's
  regular expressions); answers (agent to host) are JSON objects, bytes as base64, which the host parses
  with a real JSON parser (it never unmarshals what the sandbox wrote). First the agent sends
  ``{"hello": true, "pid": ...}``, then answers one request at a time: ``exec`` (a program, with stdin, a
  CPU limit, wall time and an output cap), ``py`` (code in the kernel), ``read`` / ``write`` / ``list``
  (paths inside the workspace only; a path whose real location is outside it, e.g. through a symlink, is
  refused).
* While user code runs it still reads stdin: ``{"op": "cancel", "reason": ...}`` stops it (the host does
  this when the workspace passes its disk quota, and when the caller of the request was cancelled), any
  other request is queued and answered next, and EOF (the server died) kills everything and exits, so
  the sandbox ends with its server.
* After every request that ran user code, every process of the sandbox except the namespace's init, the
  agent and the kernel is SIGKILLed: a background process never outlives the command that started it.
* Without cgroups (a server that is not root, where none is delegated) a request carries ``watch_mem``
  (bytes) and ``watch_tasks``: while its user code runs the agent samples its pid namespace every 0.2 s
  (and when the code returns or is stopped): the tasks (threads and unreaped zombies included: what
  RLIMIT_NPROC counts; the processes alone are counted every 0.02 s), reported as ``peak_tasks``, and
  the memory of its processes (each one's PSS, its RSS where its smaps cannot be read, and the memfds
  they hold open); past ``watch_mem`` the code is stopped (reason ``memory``; a kernel call's kernel is
  killed, as the OOM killer would) and the answer says how much was held.
* Why a separate agent process and not one bwrap per command: a command then costs one spawn inside an
  already set-up sandbox (no namespaces, mounts or cgroups to make), and the kernel can live across
  calls. Why so few imports (``os.posix_spawn`` and ``select.epoll``, not subprocess and selectors): the
  agent's start is most of a fork's cost. The agent is made non-dumpable so the user's processes (same
  uid) cannot ptrace it or open its protocol pipes through /proc.
"""

from __future__ import annotations

import binascii
import marshal
import os
import resource
import select
import signal
import stat
import sys
import time

WORKSPACE = "/workspace"
_CHUNK = 1 << 16
_SAMPLE_S = 0.2  # how often tasks and memory are sampled while user code runs without cgroups
_COUNT_S = 0.02  # ... and how often its processes are counted (a fork bomb sits at its limit for ~0.1 s)
# How long an interrupted cell has to stop (KeyboardInterrupt, then its reply) before the kernel is
# killed and restarted (1 s was short for a busy machine: load 40 on 2 cores).
_INTERRUPT_GRACE_S = 3.0
_PAGE = os.sysconf("SC_PAGE_SIZE")
_JSON_ESCAPES = {i: f"\\u{i:04x}" for i in range(32)} | {ord('"'): '\\"', ord("\\"): "\\\\"}


def _json(value: object) -> str:
    """A JSON text of plain values (the json module would import re, enum, ... on every agent start)."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        text = value.encode("utf-8", "replace").decode("utf-8")  # lone surrogates (odd file names)
        return '"' + text.translate(_JSON_ESCAPES) + '"'
    if isinstance(value, dict):
        return "{" + ",".join(_json(str(k)) + ":" + _json(v) for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_json(v) for v in value) + "]"
    raise TypeError(f"cannot encode {type(value).__name__}")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _send_json(fd: int, message: dict) -> None:
    data = _json(message).encode()
    _write_all(fd, len(data).to_bytes(4, "big") + data)


def _send_marshal(fd: int, message: dict) -> None:
    data = marshal.dumps(message)
    _write_all(fd, len(data).to_bytes(4, "big") + data)


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv(fd: int) -> dict | None:
    head = _read_exact(fd, 4)
    if head is None:
        return None
    body = _read_exact(fd, int.from_bytes(head, "big"))
    if body is None:
        return None
    message = marshal.loads(body)
    if not isinstance(message, dict):
        raise ValueError("a request must be a dict")
    return message


def _b64(data: bytes) -> str:
    return binascii.b2a_base64(data, newline=False).decode()


def _inside(path: str) -> str:
    """The real path of ``path`` (relative to the workspace, or absolute under it); ValueError if it is
    outside the workspace once symlinks are resolved."""
    full = os.path.realpath(os.path.join(WORKSPACE, path))
    if full != WORKSPACE and not full.startswith(WORKSPACE + "/"):
        raise ValueError(f"{path!r} is outside the workspace (it resolves to {full!r})")
    return full


def _others(keep: set[int]) -> tuple[list[int], int]:
    """Live processes of this sandbox's pid namespace not in ``keep``, and how many zombies wait for the
    namespace's init to reap them (orphans: until then each still counts against the process limit)."""
    pids, orphans = [], 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in keep:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in (b"Z", b"X"):
            pids.append(int(name))
        elif fields[1] == b"1":
            orphans += 1
    return pids, orphans


def _pss(pid: str) -> int | None:
    """A process's proportional share of the memory it maps (its own pages, shared ones divided)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _memfds(pid: str, seen: set[tuple[int, int]]) -> int:
    """What the memfds a process holds open contain (shared memory of no file system and, unmapped, of no
    process's RSS: written with write(2), it would pass any rlimit). Each one counted once (``seen``); a
    process whose fds cannot be read (it made itself non-dumpable) is not counted here."""
    total = 0
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0
    for fd in fds:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if not os.readlink(path).startswith("/memfd:"):
                continue
            st = os.stat(path)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def _tasks_and_memory(want_memory: bool) -> tuple[int, int]:
    """The tasks of this sandbox's pid namespace (threads and unreaped zombies included: what RLIMIT_NPROC
    counts) and, if wanted, the memory its processes hold (PSS, RSS where smaps cannot be read, and the
    memfds they hold open)."""
    tasks = memory = 0
    memfds: set[tuple[int, int]] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            threads, rss = int(fields[17]), int(fields[21])
        except (OSError, IndexError, ValueError):
            continue
        tasks += max(1, threads)
        if want_memory:
            pss = _pss(name)
            memory += (pss if pss is not None else rss * _PAGE) + _memfds(name, memfds)
    return tasks, memory


def _exit_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _spawn(argv: list[str], env: dict[str, str], fds: dict[int, int]) -> int:
    """Start ``argv`` in its own session with ``fds`` (child fd -> our fd) as its only open files
    besides what it inherits on purpose, every signal at its default and none blocked (as from a fresh
    login: an ignored or blocked SIGINT passes through fork and exec, from whatever started the server,
    and a kernel that inherited one could not be interrupted); returns its pid."""
    actions = [(os.POSIX_SPAWN_DUP2, ours, theirs) for theirs, ours in fds.items()]
    return os.posix_spawnp(
        argv[0], argv, env, file_actions=actions, setsid=True, setsigmask=(), setsigdef=_CATCHABLE
    )


_CATCHABLE = tuple(s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP))


class _Child:
    """A spawned process: its pid, a pidfd to wait on, its exit status once reaped."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.returncode
            if pid:
                self.returncode = _exit_code(status)
                os.close(self.pidfd)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = _exit_code(status)
            os.close(self.pidfd)
        return self.returncode

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


def _set_cpu(pid: int, seconds: int) -> None:
    """The command's CPU limit, set right after the start (no preexec hook: posix_spawn has none)."""
    try:
        resource.prlimit(pid, resource.RLIMIT_CPU, (seconds, seconds + 1))
    except OSError:
        pass


class Agent:
    def __init__(self) -> None:
        self.inp, self.out = 0, 1
        self.kernel: _Child | None = None
        # The kernel's pipes: request (write end), reply, stdout, stderr (read ends).
        self.kernel_fds: tuple[int, int, int, int] = (-1, -1, -1, -1)
        self.queued: list[dict] = []  # requests that arrived while user code ran
        # Without cgroups (watch_mem / watch_tasks in the request): what the samples saw.
        self.watch_mem = 0
        self.watch_tasks = False
        self.peak_tasks = 0
        self.peak_memory = 0

    # -- processes ------------------------------------------------------------------------------

    def keep(self) -> set[int]:
        keep = {1, os.getpid()}
        if self.kernel is not None and self.kernel.poll() is None:
            keep.add(self.kernel.pid)
        return keep

    def kill_others(self) -> int:
        """SIGKILL every process but init, the agent and the kernel, until none is left (a fork bomb's
        children appear while its parents die: repeat), and until init has reaped them (a killed process
        counts against the process limit until then: the next command could not start one). Returns how
        many were killed."""
        killed = 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            pids, orphans = _others(self.keep())
            if not pids and not orphans:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.001)
        return killed

    def host_event(self) -> str | None:
        """A message from the host while user code runs: 'eof' (the host is gone), a cancel reason, or None."""
        try:
            message = _recv(self.inp)
        except (OSError, ValueError, EOFError, TypeError):
            return "eof"
        if message is None:
            return "eof"
        if message.get("op") == "cancel":
            return str(message.get("reason", "cancelled"))
        self.queued.append(message)  # the next request (its caller gave up on this one): answered next
        return None

    def watch(self, req: dict) -> bool:
        """Start watching for this request (without cgroups): True if there is anything to watch."""
        self.watch_mem = int(req.get("watch_mem") or 0)
        self.watch_tasks = bool(req.get("watch_tasks"))
        self.peak_tasks = self.peak_memory = 0
        return self.watch_mem > 0 or self.watch_tasks

    def count(self) -> None:
        """A cheap sample between full ones: the processes alone (one listing of /proc)."""
        if self.watch_tasks:
            self.peak_tasks = max(self.peak_tasks, sum(name.isdigit() for name in os.listdir("/proc")))

    def sample(self) -> bool:
        """One sample of the sandbox's tasks and memory; True when the memory is past ``watch_mem``."""
        if not (self.watch_mem or self.watch_tasks):
            return False
        tasks, memory = _tasks_and_memory(self.watch_mem > 0)
        self.peak_tasks = max(self.peak_tasks, tasks)
        self.peak_memory = max(self.peak_memory, memory)
        return self.watch_mem > 0 and memory > self.watch_mem

    def watched(self) -> dict:
        """What the samples saw, for the answer (nothing when nothing was watched)."""
        out: dict = {}
        if self.watch_tasks:
            out["peak_tasks"] = self.peak_tasks
        if self.watch_mem:
            out["memory"] = self.peak_memory
        return out

    def die(self) -> None:
        if self.kernel is not None:
            self.kernel.kill()
        self.kill_others()
        os._exit(0)

    # -- requests -------------------------------------------------------------------------------

    def handle(self, req: dict) -> dict:
        op = req.get("op")
        try:
            if op == "exec":
                return self.exec(req)
            if op == "py":
                return self.py(req)
            if op == "read":
                path = _inside(req["path"])
                if not os.path.isfile(path):
                    raise ValueError(f"{req['path']!r} is not a file in the workspace")
                with open(path, "rb") as f:
                    data = f.read(int(req["max"]) + 1)
                return {"data": _b64(data[: int(req["max"])]), "truncated": len(data) > int(req["max"])}
            if op == "write":
                path = _inside(req["path"])
                if os.path.lexists(path) and not os.path.isfile(path):
                    raise ValueError(f"{req['path']!r} exists and is not a regular file")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(req["data"])
                return {}
            if op == "list":
                path = _inside(req["path"])
                entries = []
                with os.scandir(path) as it:
                    for e in it:
                        st = e.stat(follow_symlinks=False)
                        if stat.S_ISLNK(st.st_mode):
                            kind = "symlink"
                        elif stat.S_ISDIR(st.st_mode):
                            kind = "dir"
                        elif stat.S_ISREG(st.st_mode):
                            kind = "file"
                        else:
                            kind = "other"
                        entries.append({"name": e.name, "kind": kind, "size": st.st_size})
                return {"entries": sorted(entries, key=lambda e: e["name"])}
            return {"error": f"unknown op {op!r}"}
        except (OSError, ValueError, KeyError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    def exec(self, req: dict) -> dict:
        stdin = req.get("stdin")
        env = {**_BASE_ENV, **req.get("env", {})}
        start = time.monotonic()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_r, in_w = os.pipe() if stdin is not None else (os.open(os.devnull, os.O_RDONLY), -1)
        try:
            child = _Child(_spawn(req["argv"], env, {0: in_r, 1: out_w, 2: err_w}))
        except OSError as exc:
            for fd in (out_r, out_w, err_r, err_w, in_r, in_w):
                if fd >= 0:
                    os.close(fd)
            return {"rc": 127, "stdout": "", "stderr": _b64(f"{exc}\n".encode()), "wall": 0.0}
        finally:
            for fd in (out_w, err_w, in_r):
                try:
                    os.close(fd)
                except OSError:
                    pass
        _set_cpu(child.pid, int(req["cpu"]))
        bufs = {out_r: bytearray(), err_r: bytearray()}
        trunc = {out_r: False, err_r: False}
        reason: str | None = None
        cap, deadline = int(req["cap"]), start + float(req["timeout"])
        watching = self.watch(req)
        next_sample = next_count = start
        poller = select.epoll()
        poller.register(out_r, select.EPOLLIN)
        poller.register(err_r, select.EPOLLIN)
        poller.register(self.inp, select.EPOLLIN)
        poller.register(child.pidfd, select.EPOLLIN)
        pending = memoryview(stdin or b"")
        if in_w >= 0:
            os.set_blocking(in_w, False)
            poller.register(in_w, select.EPOLLOUT)
        open_streams = {out_r, err_r}
        exited = False
        killed_at = 0.0

        def kill(why: str) -> None:
            nonlocal reason, killed_at
            if reason is None:
                reason, killed_at = why, time.monotonic()
                self.sample()  # what it held when it was stopped (a fork bomb at its limit)
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.kill_others()

        while open_streams or not exited:
            now = time.monotonic()
            if not exited and child.poll() is not None:
                # The command returned: anything it left in the background dies now (it may hold the
                # pipes open), then the pipes are drained to EOF.
                exited = True
                if reason is None:
                    self.sample()
                self.kill_others()
            if exited and not open_streams:
                break
            if reason is None and now > deadline:
                kill("timeout")
            if reason is not None and now > killed_at + 5:
                break  # killed, but something still holds the pipes: give up on them
            if watching and reason is None and not exited:
                if now >= next_sample:
                    next_sample = now + _SAMPLE_S
                    if self.sample():
                        kill("memory")
                elif now >= next_count:
                    self.count()
                next_count = now + _COUNT_S
            wait = 0.5 if (reason is not None or exited) else max(0.0, deadline - now)
            if watching and reason is None and not exited:
                wait = min(wait, max(0.0, min(next_sample, next_count) - now))
            for fd, _ in poller.poll(wait):
                if fd == child.pidfd:
                    poller.unregister(fd)  # handled at the top of the loop
                elif fd == self.inp:
                    event = self.host_event()
                    if event == "eof":
                        self.die()
                    if event is not None:
                        kill(event)
                elif fd == in_w:
                    try:
                        pending = pending[os.write(fd, pending) :]
                    except OSError:
                        pending = memoryview(b"")
                    if not pending:
                        poller.unregister(fd)
                        os.close(fd)
                        in_w = -1
                else:
                    chunk = os.read(fd, _CHUNK)
                    if not chunk:
                        poller.unregister(fd)
                        open_streams.discard(fd)
                        continue
                    room = cap - len(bufs[fd])
                    bufs[fd] += chunk[: max(room, 0)]
                    if len(chunk) > room and not trunc[fd]:
                        trunc[fd] = True
                        kill("output_limit")
        poller.close()
        rc = child.wait()
        for fd in (out_r, err_r, in_w):
            if fd >= 0:
                os.close(fd)
        self.kill_others()
        return {
            "rc": rc,
            "stdout": _b64(bytes(bufs[out_r])),
            "stderr": _b64(bytes(bufs[err_r])),
            "out_trunc": trunc[out_r],
            "err_trunc": trunc[err_r],
            "reason": reason,
            "wall": time.monotonic() - start,
            **self.watched(),
        }

    # -- the kernel -----------------------------------------------------------------------------

    def start_kernel(self, req: dict) -> None:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        os.set_inheritable(req_r, True)
        os.set_inheritable(rep_w, True)
        try:
            argv = [sys.executable, "-I", os.path.abspath(__file__), "kernel", str(req_r), str(rep_w)]
            self.kernel = _Child(_spawn(argv, _BASE_ENV, {0: null, 1: out_w, 2: err_w}))
        finally:
            for fd in (req_r, rep_w, out_w, err_w, null):
                os.close(fd)
        _set_cpu(self.kernel.pid, int(req["session_cpu"]))
        self.kernel_fds = (req_w, rep_r, out_r, err_r)

    def stop_kernel(self) -> None:
        if self.kernel is not None:
            self.kernel.kill()
            self.kernel.wait()
            for fd in self.kernel_fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.kernel, self.kernel_fds = None, (-1, -1, -1, -1)

    def py(self, req: dict) -> dict:
        start = time.monotonic()
        restarted = False
        if self.kernel is None or self.kernel.poll() is not None:
            restarted = self.kernel is not None
            self.stop_kernel()
            self.start_kernel(req)
        kernel = self.kernel
        assert kernel is not None
        req_w, rep_r, out_r, err_r = self.kernel_fds
        _send_marshal(req_w, {"code": req["code"]})
        bufs = {out_r: bytearray(), err_r: bytearray()}
        trunc = {out_r: False, err_r: False}
        cap, deadline = int(req["cap"]), start + float(req["timeout"])
        watching = self.watch(req)
        next_sample = start
        poller = select.epoll()
        for fd in (out_r, err_r, rep_r, self.inp):
            poller.register(fd, select.EPOLLIN)
        reply: dict | None = None
        reason: str | None = None
        interrupted_at = 0.0

        def read(fd: int) -> bool:
            try:
                chunk = os.read(fd, _CHUNK)
            except BlockingIOError:
                return False
            if not chunk:
                return False
            room = cap - len(bufs[fd])
            bufs[fd] += chunk[: max(room, 0)]
            if len(chunk) > room:
                trunc[fd] = True  # past the cap: read and dropped, so the kernel never blocks
            return True

        while reply is None:
            now = time.monotonic()
            if watching and reason is None and now >= next_sample:
                next_sample = now + _SAMPLE_S
                if self.sample():
                    # Past the memory limit: the kernel is killed (as the OOM killer would), its cell with it.
                    reason, interrupted_at = "memory", now
                    kernel.kill()
                    self.kill_others()
            elif watching and reason is None:
                self.count()
            if now > deadline and reason is None:
                reason, interrupted_at = "timeout", now
                kernel.kill(signal.SIGINT)  # KeyboardInterrupt: the state survives if it stops
            if reason is not None and now > interrupted_at + _INTERRUPT_GRACE_S:
                break  # it did not stop: killed below
            if kernel.poll() is not None:
                break
            for fd, _ in poller.poll(_COUNT_S if self.watch_tasks else _SAMPLE_S if watching else 0.25):
                if fd == self.inp:
                    event = self.host_event()
                    if event == "eof":
                        self.die()
                    if event is not None and reason is None:
                        reason, interrupted_at = event, time.monotonic()
                        kernel.kill(signal.SIGINT)
                elif fd == rep_r:
                    try:
                        reply = _recv(rep_r)
                    except (ValueError, EOFError, TypeError):
                        reply = None  # the kernel's user code wrote garbage there
                    if reply is None:
                        break
                else:
                    read(fd)
        poller.close()
        if reason is None:
            self.sample()
        lost = reply is None
        if lost:
            self.stop_kernel()
        else:
            for fd in (out_r, err_r):
                os.set_blocking(fd, False)
                while read(fd):
                    pass
                os.set_blocking(fd, True)
        self.kill_others()
        rc = 137
        if reply is not None:
            try:
                rc = int(reply["rc"])
            except (KeyError, TypeError, ValueError):
                rc = 1
        return {
            "rc": rc,
            "stdout": _b64(bytes(bufs[out_r])),
            "stderr": _b64(bytes(bufs[err_r])),
            "out_trunc": trunc[out_r],
            "err_trunc": trunc[err_r],
            "reason": reason,
            "kernel_lost": lost,
            "kernel_restarted": restarted,
            "wall": time.monotonic() - start,
            **self.watched(),
        }

    def serve(self) -> None:
        _send_json(self.out, {"hello": True, "pid": os.getpid()})
        while True:
            req = self.queued.pop(0) if self.queued else _recv(self.inp)
            if req is None:
                self.die()
            if req.get("op") == "cancel":  # for a command that already returned: nothing to answer
                continue
            _send_json(self.out, self.handle(req))


_BASE_ENV: dict[str, str] = {}


def _kernel(req_fd: int, rep_fd: int) -> None:
    """The persistent Python kernel: runs each request's code in one namespace (a REPL's: a last
    expression's value is printed), replies with the status; output goes to its stdout/stderr."""
    import ast
    import traceback

    namespace: dict = {"__name__": "__main__"}
    while True:
        req = _recv(req_fd)
        if req is None:
            os._exit(0)
        _reap_children()
        rc = 0
        try:
            tree = ast.parse(req["code"], "<cell>")
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            exec(compile(tree, "<cell>", "exec"), namespace)
            if last is not None:
                value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), namespace)
                if value is not None:
                    print(repr(value))
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except KeyboardInterrupt:
            traceback.print_exc()
            rc = 130
        except BaseException:
            traceback.print_exc()
            rc = 1
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        _send_marshal(rep_fd, {"rc": rc})


def _reap_children() -> None:
    """Wait for the kernel's children that have ended (the agent kills what a cell left running when the
    cell returns): unreaped, each would hold a slot of the sandbox's process limit as a zombie, and a few
    cells of forks would leave the next cell unable to start any process."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _not_dumpable() -> None:
    """PR_SET_DUMPABLE 0: processes of the same uid cannot ptrace the agent or open /proc/<agent>/fd."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def main() -> None:
    if len(sys.argv) >= 4 and sys.argv[1] == "kernel":
        _kernel(int(sys.argv[2]), int(sys.argv[3]))
        return
    _not_dumpable()
    _BASE_ENV.update(os.environ)
    Agent().serve()


if __name__ == "__main__":
    main()
