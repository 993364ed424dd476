"""The agent inside a session's sandbox: runs commands, file operations and a persistent Python kernel.

Contract
--------
* Runs INSIDE the bubblewrap sandbox of a :class:`nemo_gym.sandbox.session.SandboxSession`, as uid 65534,
  under the sandbox's Python (``python3 -I -S``): standard library only, nothing of nemo_gym is imported
  (the file is bound read-only into the sandbox and never imported by the host).
* It speaks framed JSON on stdin/stdout (4-byte big-endian length, then a UTF-8 JSON object; bytes as
  base64): first it sends ``{"hello": true, "pid": ...}``, then answers one request at a time:
  ``exec`` (a program, with stdin, per-command rlimits, wall time and an output cap), ``py`` (code in the
  kernel), ``read`` / ``write`` / ``list`` (paths inside the workspace only; a path whose real location is
  outside it, e.g. through a symlink, is refused).
* While a command runs it still reads stdin: ``{"op": "cancel", "reason": ...}`` kills the command (the
  host does this when the workspace passes its disk quota), and EOF (the server died) kills everything
  and exits, so the sandbox ends with its server.
* After every request that ran user code, every process of the sandbox except the namespace's init, the
  agent and the kernel is SIGKILLed: a background process never outlives the command that started it.
* Why a separate agent process and not one bwrap per command: a command then costs one fork+exec inside
  an already set-up sandbox (no namespaces, mounts or cgroups to make), and the kernel can live across
  calls. The agent is made non-dumpable so the user's processes (same uid) cannot ptrace it or open its
  protocol pipes through /proc.
"""

from __future__ import annotations

import base64
import json
import os
import resource
import selectors
import signal
import stat
import struct
import subprocess
import sys
import time

WORKSPACE = "/workspace"
_CHUNK = 1 << 16


def _send(fd: int, message: dict) -> None:
    data = json.dumps(message).encode()
    data = struct.pack(">I", len(data)) + data
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


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
    body = _read_exact(fd, struct.unpack(">I", head)[0])
    return None if body is None else json.loads(body)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _inside(path: str) -> str:
    """The real path of ``path`` (relative to the workspace, or absolute under it); ValueError if it is
    outside the workspace once symlinks are resolved."""
    full = os.path.realpath(os.path.join(WORKSPACE, path))
    if full != WORKSPACE and not full.startswith(WORKSPACE + "/"):
        raise ValueError(f"{path!r} is outside the workspace (it resolves to {full!r})")
    return full


def _others(keep: set[int]) -> list[int]:
    """Live processes of this sandbox's pid namespace not in ``keep`` (zombies left out: init reaps them)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in keep:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in (b"Z", b"X"):
            pids.append(int(name))
    return pids


class Agent:
    def __init__(self) -> None:
        self.inp, self.out = 0, 1
        self.kernel: subprocess.Popen | None = None
        self.kernel_fds: tuple[int, int] = (-1, -1)
        self.selector = selectors.DefaultSelector()

    # -- processes ------------------------------------------------------------------------------

    def keep(self) -> set[int]:
        keep = {1, os.getpid()}
        if self.kernel is not None and self.kernel.poll() is None:
            keep.add(self.kernel.pid)
        return keep

    def kill_others(self) -> int:
        """SIGKILL every process but init, the agent and the kernel, until none is left (a fork bomb's
        children appear while its parents die: repeat). Returns how many were killed."""
        killed = 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            pids = _others(self.keep())
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.001)
        return killed

    def stdin_event(self) -> str | None:
        """A message from the host while user code runs: 'eof' (the host is gone), a cancel reason, or None."""
        try:
            message = _recv(self.inp)
        except (OSError, ValueError):
            return "eof"
        if message is None:
            return "eof"
        if message.get("op") == "cancel":
            return str(message.get("reason", "cancelled"))
        return None

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
                    f.write(base64.b64decode(req["data"]))
                return {}
            if op == "list":
                path = _inside(req["path"])
                entries = []
                with os.scandir(path) as it:
                    for e in it:
                        st = e.stat(follow_symlinks=False)
                        kind = (
                            "symlink"
                            if stat.S_ISLNK(st.st_mode)
                            else "dir"
                            if stat.S_ISDIR(st.st_mode)
                            else "file"
                            if stat.S_ISREG(st.st_mode)
                            else "other"
                        )
                        entries.append({"name": e.name, "kind": kind, "size": st.st_size})
                return {"entries": sorted(entries, key=lambda e: e["name"])}
            return {"error": f"unknown op {op!r}"}
        except (OSError, ValueError, KeyError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _limits(self, cpu: int):
        def apply() -> None:
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))

        return apply

    def exec(self, req: dict) -> dict:
        stdin = base64.b64decode(req["stdin"]) if req.get("stdin") is not None else None
        env = {**_BASE_ENV, **req.get("env", {})}
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                req["argv"],
                cwd=WORKSPACE,
                env=env,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            return {"rc": 127, "stdout": "", "stderr": _b64(f"{exc}\n".encode()), "wall": 0.0}
        # The command's CPU limit, set right after the start (no preexec_fn: it would cost a full fork
        # instead of vfork on every command). File size and open files are the session's, inherited.
        cpu = int(req["cpu"])
        try:
            resource.prlimit(proc.pid, resource.RLIMIT_CPU, (cpu, cpu + 1))
        except (ProcessLookupError, PermissionError, OSError):
            pass
        bufs = {"stdout": bytearray(), "stderr": bytearray()}
        trunc = {"stdout": False, "stderr": False}
        reason: str | None = None
        cap, deadline = int(req["cap"]), start + float(req["timeout"])
        sel = selectors.DefaultSelector()
        assert proc.stdout is not None and proc.stderr is not None
        sel.register(proc.stdout.fileno(), selectors.EVENT_READ, "stdout")
        sel.register(proc.stderr.fileno(), selectors.EVENT_READ, "stderr")
        sel.register(self.inp, selectors.EVENT_READ, "host")
        pending = memoryview(stdin or b"")
        if stdin is not None:
            assert proc.stdin is not None
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "stdin")
        open_streams = 2
        pidfd = os.pidfd_open(proc.pid)
        sel.register(pidfd, selectors.EVENT_READ, "exit")
        exited = False
        killed_at = 0.0

        def kill(why: str) -> None:
            nonlocal reason, killed_at
            if reason is None:
                reason, killed_at = why, time.monotonic()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.kill_others()

        while open_streams or not exited:
            now = time.monotonic()
            if not exited and proc.poll() is not None:
                # The command returned: anything it left in the background dies now (it may hold the
                # pipes open), then the pipes are drained to EOF.
                exited = True
                sel.unregister(pidfd)
                self.kill_others()
            if exited and not open_streams:
                break
            if reason is None and now > deadline:
                kill("timeout")
            if reason is not None and now > killed_at + 5:
                break  # killed, but something still holds the pipes: give up on them
            wait = 0.5 if reason is not None else max(0.0, deadline - now)
            for key, _ in sel.select(min(wait, 0.5) if exited else wait):
                name = key.data
                if name == "exit":
                    continue  # handled at the top of the loop
                if name == "host":
                    event = self.stdin_event()
                    if event == "eof":
                        self.die()
                    if event is not None:
                        kill(event)
                elif name == "stdin":
                    try:
                        pending = pending[os.write(key.fd, pending) :]
                    except OSError:
                        pending = memoryview(b"")
                    if not pending:
                        sel.unregister(key.fd)
                        assert proc.stdin is not None
                        proc.stdin.close()
                else:
                    chunk = os.read(key.fd, _CHUNK)
                    if not chunk:
                        sel.unregister(key.fd)
                        open_streams -= 1
                        continue
                    room = cap - len(bufs[name])
                    bufs[name] += chunk[: max(room, 0)]
                    if len(chunk) > room and not trunc[name]:
                        trunc[name] = True
                        kill("output_limit")
        os.close(pidfd)
        proc.wait()
        sel.close()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        self.kill_others()
        return {
            "rc": proc.returncode if proc.returncode >= 0 else 128 - proc.returncode,
            "stdout": _b64(bytes(bufs["stdout"])),
            "stderr": _b64(bytes(bufs["stderr"])),
            "out_trunc": trunc["stdout"],
            "err_trunc": trunc["stderr"],
            "reason": reason,
            "wall": time.monotonic() - start,
        }

    # -- the kernel -----------------------------------------------------------------------------

    def start_kernel(self, req: dict) -> None:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        self.kernel = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), "kernel", str(req_r), str(rep_w)],
            cwd=WORKSPACE,
            env=_BASE_ENV,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(req_r, rep_w),
            start_new_session=True,
            preexec_fn=self._limits(int(req["session_cpu"])),
        )
        os.close(req_r)
        os.close(rep_w)
        self.kernel_fds = (req_w, rep_r)

    def stop_kernel(self) -> None:
        if self.kernel is not None:
            self.kernel.kill()
            self.kernel.wait()
            for f in (self.kernel.stdout, self.kernel.stderr):
                if f is not None:
                    f.close()
            for fd in self.kernel_fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.kernel, self.kernel_fds = None, (-1, -1)

    def py(self, req: dict) -> dict:
        start = time.monotonic()
        restarted = False
        if self.kernel is None or self.kernel.poll() is not None:
            restarted = self.kernel is not None
            self.stop_kernel()
            self.start_kernel(req)
        kernel = self.kernel
        assert kernel is not None and kernel.stdout is not None and kernel.stderr is not None
        req_w, rep_r = self.kernel_fds
        _send(req_w, {"code": req["code"]})
        bufs = {"stdout": bytearray(), "stderr": bytearray()}
        trunc = {"stdout": False, "stderr": False}
        cap, deadline = int(req["cap"]), start + float(req["timeout"])
        sel = selectors.DefaultSelector()
        sel.register(kernel.stdout.fileno(), selectors.EVENT_READ, "stdout")
        sel.register(kernel.stderr.fileno(), selectors.EVENT_READ, "stderr")
        sel.register(rep_r, selectors.EVENT_READ, "reply")
        sel.register(self.inp, selectors.EVENT_READ, "host")
        reply: dict | None = None
        reason: str | None = None
        interrupted_at = 0.0

        def read(fd: int, name: str) -> bool:
            try:
                chunk = os.read(fd, _CHUNK)
            except BlockingIOError:
                return False
            if not chunk:
                return False
            room = cap - len(bufs[name])
            bufs[name] += chunk[: max(room, 0)]
            if len(chunk) > room:
                trunc[name] = True  # past the cap: read and dropped, so the kernel never blocks
            return True

        while reply is None:
            now = time.monotonic()
            if now > deadline and reason is None:
                reason = "timeout"
                interrupted_at = now
                kernel.send_signal(signal.SIGINT)  # KeyboardInterrupt: the state survives if it stops
            if reason is not None and now > interrupted_at + 1.0:
                break  # it did not stop: killed below
            if kernel.poll() is not None:
                break
            for key, _ in sel.select(0.25):
                if key.data == "host":
                    event = self.stdin_event()
                    if event == "eof":
                        self.die()
                    if event is not None and reason is None:
                        reason, interrupted_at = event, time.monotonic()
                        kernel.send_signal(signal.SIGINT)
                elif key.data == "reply":
                    reply = _recv(rep_r)
                    if reply is None:
                        break
                else:
                    read(key.fd, key.data)
        lost = reply is None
        if lost:
            self.stop_kernel()
        else:
            for fd, name in ((kernel.stdout.fileno(), "stdout"), (kernel.stderr.fileno(), "stderr")):
                os.set_blocking(fd, False)
                while read(fd, name):
                    pass
                os.set_blocking(fd, True)
        sel.close()
        self.kill_others()
        rc = int(reply["rc"]) if reply is not None else 137
        return {
            "rc": rc,
            "stdout": _b64(bytes(bufs["stdout"])),
            "stderr": _b64(bytes(bufs["stderr"])),
            "out_trunc": trunc["stdout"],
            "err_trunc": trunc["stderr"],
            "reason": reason,
            "kernel_lost": lost,
            "kernel_restarted": restarted,
            "wall": time.monotonic() - start,
        }

    def serve(self) -> None:
        _send(self.out, {"hello": True, "pid": os.getpid()})
        while True:
            req = _recv(self.inp)
            if req is None:
                self.die()
            if req.get("op") == "cancel":  # for a command that already returned: nothing to answer
                continue
            _send(self.out, self.handle(req))


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
        _send(rep_fd, {"rc": rc})


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
