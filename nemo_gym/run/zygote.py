"""The fork server ("zygote"): one process that imports what every server shares, then forks the servers.

Why: each server process used to import FastAPI, Starlette, pydantic, uvicorn, orjson and nemo_gym's
server bases from scratch (about 1.1 CPU-seconds each, three times for the README's example), which was
most of ``ng_run``'s time to "servers ready" on 2 cores and most of the servers' memory. The zygote
imports them once, while the launcher composes the config, and every server forked from it shares
those pages copy-on-write (docs/performance.md, "Start-up").

Contract
--------
* :class:`Zygote` is the launcher's handle. :meth:`Zygote.start` starts ``python -c ...zygote_main()``
  in its own session, with the launcher's environment *without* any secret-looking variable
  (:func:`nemo_gym.redaction.child_environ`), the import path a server gets (``PYTHONPATH`` = the run's
  root, then the launcher's) and the run's root as its working directory. It dies with the launcher
  (parent-death signal, and the end of its control socket). ``ng_run`` starts it before it composes
  the config; a supervisor without one starts its own on its spawner thread. The supervisor stops it
  once every server is started: servers are not started again within a run (unless the process keeps
  fork servers between runs: :func:`nemo_gym.run.supervision.spawning.keep_fork_servers`).
* The zygote imports :data:`PRELOAD_MODULES` (never an environment's code), freezes them out of the
  garbage collector (fewer pages copied after a fork) and answers requests on a ``SOCK_SEQPACKET``
  control socket. It runs no thread and no event loop; before each fork it checks that it is still
  single-threaded, and refuses otherwise.
* :meth:`Zygote.spawn` sends the descriptors a server needs (its output pipe, its listening socket and
  config-verdict pipes, and a private spec pipe). The zygote forks twice (the middle process exits at
  once) so that the server is re-parented to the launcher, which is a child subreaper for that
  moment only: the server is the launcher's own child, as a ``Popen`` one is (its parent pid, its exit
  status, ``NEMO_GYM_PARENT_PID`` and :func:`nemo_gym.server.startup.die_with_parent` unchanged), and
  does not depend on the zygote once started. The zygote closes its copies of the descriptors and
  answers with the pid; only then does the launcher write the server's spec (its environment with its
  secrets, working directory and script) into the spec pipe, which only the server holds. The zygote
  never sees any server's secrets.
* The server, once re-parented, asks for SIGTERM when the launcher dies, puts itself in its own process
  group, resets every signal handler and the signal mask to the zygote's start-up state (a fresh
  interpreter's), closes every descriptor it was not given, points stdin at ``/dev/null`` and
  stdout/stderr at its output pipe, re-seeds ``random``, takes the environment, working directory,
  ``sys.argv`` and ``sys.path[0]`` that ``python <script>`` would have, shows that command line and
  environment where ``ps`` and ``/proc/<pid>/{cmdline,environ}`` read them (:func:`_set_title`,
  :func:`_show_environ`), and runs the script as ``__main__``. Its start-up trace gets a ``forked``
  mark.
* :class:`ForkedChild` is the launcher's ``subprocess.Popen``-like view of such a server (``pid``,
  ``stdout``, ``poll``, ``wait``, ``returncode``), reaped by the launcher like a ``Popen`` child.
* :meth:`Zygote.compatible` tells whether a server would start on the same interpreter, import path and
  interpreter-start environment as the zygote; any other (a server venv, another ``PYTHONPATH``, an
  environment too large for the space the zygote reserved), or any the zygote fails to start, is
  started by ``Popen`` as before (:class:`ZygoteUnavailable`).
* What a forked server shares with its siblings, unlike fresh interpreters: the hash seed of
  ``str``/``bytes`` (chosen at interpreter start) and what the preloaded modules computed at import.
  Those modules read no environment variable at import (their config, secrets and tokens are read
  lazily, in the server).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, NoReturn

from nemo_gym.config.flags import flag
from nemo_gym.config.keys import FORK_SERVER_KEY_NAME

# What every server imports before its own code: the web stack and nemo_gym's server bases, plus what
# uvicorn imports only when it starts serving. Never an environment's or a model's own code.
PRELOAD_MODULES = (
    "orjson",
    "yaml",
    "omegaconf",
    "pydantic",
    "starlette.applications",
    "fastapi",
    "fastapi.responses",
    "uvicorn",
    "uvicorn.config",
    "uvicorn.server",
    "uvicorn.main",
    "uvicorn.lifespan.on",
    "uvicorn.loops.auto",
    "uvicorn.loops.uvloop",
    "uvicorn.protocols.http.auto",
    "uvicorn.protocols.http.httptools_impl",
    "uvicorn.protocols.websockets.auto",
    "uvloop",
    "httptools",
    "nemo_gym.server.base",
    "nemo_gym.base_resources_server",
    "nemo_gym.base_responses_api_agent",
    "nemo_gym.base_responses_api_model",
    "nemo_gym.openai_utils",
    "nemo_gym.server.agent",
    "nemo_gym.server.model",
    "nemo_gym.server.resources",
    "nemo_gym.server.disconnect",
    "nemo_gym.client.fd_limits",
    "nemo_gym.config.ports",
    "nemo_gym.config.problems",
)
# Environment variables that shape an interpreter at its start (import path, hashing, warnings, C
# libraries): a server goes through the zygote only if its own values equal the zygote's.
_START_ENV_PREFIXES = ("PYTHON", "LD_")
# Room for a server's environment where /proc/<pid>/environ reads it (see _show_environ): variables
# of the zygote's own environment, each under the kernel's 128 KiB limit of one string.
_ENV_SPACE_VAR = "NEMO_GYM_ZYGOTE_ENV_SPACE_"
_ENV_SPACE_CHUNK = 120 * 1024
_ENV_SPACE_MAX = 1 << 20
_TITLE_SPACE = 4096
_MSG_MAX = 1 << 16
HELLO_TIMEOUT_S = 60.0  # the most a spawn waits for the zygote to finish importing (then: Popen)
REPARENT_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 2.0
KILLED_REAP_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
_MADV_DONTNEED = 4


def wanted_by_argv(argv: Sequence[str]) -> bool:
    """False when ``argv`` switches the fork server off (``+fork_server=false``): ``ng_run`` starts the
    zygote before it reads its config, so it looks at its own command line first (a config file that
    turns it off stops it again)."""
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if sep and key == FORK_SERVER_KEY_NAME and not flag(value, True):
            return False
    return True


class ZygoteUnavailable(RuntimeError):
    """The zygote cannot start this server (gone, failed to import, refused to fork): use Popen."""


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, arg: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return _libc().prctl(option, ctypes.c_ulong(arg), 0, 0, 0) == 0
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------
# The launcher's side.

# The child-subreaper flag is the process's: one spawn at a time sets it, and puts back what it was.
_SUBREAPER_LOCK = threading.Lock()


def _is_subreaper() -> bool:
    value = ctypes.c_int(0)
    try:
        _libc().prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0)
    except OSError:
        return False
    return bool(value.value)


def _env_block_size(env: Mapping[str, str] | Mapping[bytes, bytes]) -> int:
    """Bytes of ``env`` as the kernel stores an environment: ``KEY=VALUE\\0`` each, then one ``\\0``."""
    return sum(len(os.fsencode(k)) + len(os.fsencode(v)) + 2 for k, v in env.items()) + 1


def zygote_environ(root: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The zygote's environment: the launcher's without secrets, with a server's ``PYTHONPATH`` (the
    space reserved for the servers' environments is added by :meth:`Zygote.start`)."""
    from nemo_gym.redaction import child_environ

    env = child_environ(os.environ if environ is None else environ, ())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _env_space_vars() -> dict[str, str]:
    """Variables that reserve room for a server's environment: up to 1 MiB, and at most an eighth of the
    stack limit (the kernel takes a quarter of it for arguments and environment together)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    space = _ENV_SPACE_MAX if soft == resource.RLIM_INFINITY else min(_ENV_SPACE_MAX, soft // 8)
    chunks = max(1, space // _ENV_SPACE_CHUNK)
    return {f"{_ENV_SPACE_VAR}{i}": "x" * _ENV_SPACE_CHUNK for i in range(chunks)}


class ForkedChild:
    """A server forked by the zygote and re-parented to this process, seen like a ``subprocess.Popen``."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.stdout: IO[bytes] | None = None
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        """The exit code once the child exited (negative: killed by that signal), else None."""
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped by someone else's waitpid(-1): Popen says 0 too
                    self.returncode = 0
                else:
                    if pid == self.pid:
                        self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit (``subprocess.TimeoutExpired`` after ``timeout`` seconds, like Popen)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.0005
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(pause if deadline is None else min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.05)
        assert self.returncode is not None
        return self.returncode


class Zygote:
    """The launcher's handle on one zygote process (see the module docstring)."""

    def __init__(self, root: str, env: dict[str, str]) -> None:
        self.root = root
        self.env = env
        self.process: subprocess.Popen | None = None
        self.failure: str | None = None  # why it cannot start servers, once known
        self.env_space = 0  # the largest server environment it can show in /proc (from its hello)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()  # one request at a time
        self._stopped = False
        self._hello_done = False

    @classmethod
    def start(
        cls, root: str | None = None, spawn: Callable[[Callable[[], Any]], Any] | None = None
    ) -> Zygote:
        """Start a zygote for servers whose root (working directory, first import path) is ``root``;
        ``spawn`` runs the ``Popen`` (a supervisor's spawner thread: the parent-death signal follows the
        thread that forked)."""
        root = os.path.abspath(root or os.getcwd())
        zygote = cls(root, zygote_environ(root))
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        code = "from nemo_gym.run.zygote import zygote_main; zygote_main()"
        # The last argument is room for a server's command line (see _set_title).
        cmd = [sys.executable, "-c", code, str(theirs.fileno()), str(os.getpid()), "." * _TITLE_SPACE]
        env = {**zygote.env, **_env_space_vars()}  # last: the servers' variables overwrite these

        def popen() -> subprocess.Popen:
            return subprocess.Popen(
                cmd,
                cwd=root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )

        try:
            zygote.process = spawn(popen) if spawn is not None else popen()
        except OSError as e:
            ours.close()
            zygote.failure = f"it could not start: {e}"
            return zygote
        finally:
            theirs.close()
        zygote._sock = ours
        atexit.register(zygote.stop)
        return zygote

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def compatible(self, python: str, env: Mapping[str, str], cwd: str) -> bool:
        """Whether a server run as ``python <script>`` with ``env`` in ``cwd`` can be forked from here:
        same interpreter, working directory and interpreter-start variables (:data:`_START_ENV_PREFIXES`).
        The size of ``env`` is checked against the zygote's reserved space when it spawns."""
        if self.failure is not None or self._stopped or self.process is None:
            return False
        if python != sys.executable:  # a venv's python may resolve to this one, with other packages
            return False
        if os.path.realpath(self.root) != os.path.realpath(cwd):
            return False

        def start_vars(e: Mapping[str, str]) -> dict[str, str]:
            return {k: v for k, v in e.items() if k.startswith(_START_ENV_PREFIXES)}

        return start_vars(self.env) == start_vars(env)

    def wait_ready(self, timeout: float = HELLO_TIMEOUT_S) -> None:
        """Wait until the zygote has imported its modules; :class:`ZygoteUnavailable` if it cannot serve."""
        with self._lock:
            self._await_hello(timeout)

    def spawn(
        self,
        script: str,
        cwd: str,
        env: dict[str, str],
        pass_fds: Sequence[int],
        fd_env: Callable[[Sequence[int]], Mapping[str, str]],
        label: str,
        timeout: float = HELLO_TIMEOUT_S,
    ) -> ForkedChild:
        """Fork a server that runs ``script`` as ``python <script>`` would, with ``env`` plus
        ``fd_env(numbers)`` (the numbers ``pass_fds`` have in the server). Raise :class:`ZygoteUnavailable`
        when it cannot (then nothing runs; the caller's descriptors are untouched)."""
        with self._lock:
            self._await_hello(timeout)
            full_env = dict(env)
            full_env.update(fd_env([9999] * len(pass_fds)))  # a bound: the zygote holds few descriptors
            if _env_block_size(full_env) > self.env_space:
                raise ZygoteUnavailable(
                    f"the environment of '{label}' ({_env_block_size(full_env)} bytes) exceeds the "
                    f"{self.env_space} bytes it reserved"
                )
            out_r, out_w = os.pipe()
            spec_r, spec_w = os.pipe()
            try:
                pid, numbers = self._request(label, [out_w, spec_r, *pass_fds], timeout)
            except BaseException:
                os.close(out_r)
                os.close(spec_w)
                raise
            finally:
                os.close(out_w)
                os.close(spec_r)
        child = ForkedChild(pid, [label])
        child.stdout = os.fdopen(out_r, "rb")
        full_env = dict(env)
        full_env.update(fd_env(numbers[2:]))
        spec = {"env": full_env, "cwd": cwd, "script": script}
        try:
            view = memoryview(json.dumps(spec).encode())
            while view:
                view = view[os.write(spec_w, view) :]
        except BrokenPipeError:
            pass  # it died before reading its spec: its exit is seen like any other
        finally:
            os.close(spec_w)
        return child

    def _await_hello(self, timeout: float) -> None:
        if self._hello_done:
            if self.failure is not None:
                raise ZygoteUnavailable(self.failure)
            return
        if self._sock is None or self.failure is not None:
            raise ZygoteUnavailable(self.failure or "it is not running")
        msg = self._recv(timeout, "finish importing")
        self._hello_done = True
        if msg.get("refuse"):
            self.failure = str(msg["refuse"])
            self.stop()
            raise ZygoteUnavailable(self.failure)
        self.env_space = int(msg.get("env_space") or 0)

    def _recv(self, timeout: float, what: str) -> dict[str, Any]:
        assert self._sock is not None
        self._sock.settimeout(timeout)
        try:
            data = self._sock.recv(_MSG_MAX)
        except TimeoutError:
            self._give_up(f"it did not {what} within {timeout:g} s")
        except OSError as e:
            self._give_up(f"its socket failed ({e})")
        if not data:
            self._give_up("it exited")
        return json.loads(data)

    def _request(self, label: str, fds: list[int], timeout: float) -> tuple[int, list[int]]:
        assert self._sock is not None
        with _SUBREAPER_LOCK:
            was_subreaper = _is_subreaper()
            if not was_subreaper and not _prctl(_PR_SET_CHILD_SUBREAPER, 1):
                raise ZygoteUnavailable("this process cannot be a child subreaper")
            try:
                try:
                    socket.send_fds(self._sock, [json.dumps({"spawn": label}).encode()], fds)
                except OSError as e:
                    self._give_up(f"it does not take requests ({e})")
                msg = self._recv(timeout, "answer")
            finally:
                if not was_subreaper:
                    _prctl(_PR_SET_CHILD_SUBREAPER, 0)
        if "pid" not in msg:
            raise ZygoteUnavailable(str(msg.get("error") or "it refused"))
        pid = int(msg["pid"])
        try:  # ours only if it was re-parented to this process (WNOWAIT: its status stays to be reaped)
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._give_up("its server was not re-parented to this process")
        return pid, [int(n) for n in msg["fds"]]

    def _give_up(self, why: str) -> NoReturn:
        """Stop a zygote that failed (a late fork must not run a second copy of a server the launcher
        then starts with Popen) and raise :class:`ZygoteUnavailable`."""
        self.failure = why
        self.stop()
        raise ZygoteUnavailable(why)

    def stop(self) -> None:
        """Stop the zygote (the servers it forked are this process's children, stopped by the
        supervisor); idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._sock is not None:
            self._sock.close()  # it exits at the end of its socket...
            self._sock = None
        if self.process is not None:
            if not self._hello_done or self.failure is not None:
                self.process.kill()  # ...unless it is still importing, or broken
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                # A killed process always ends, but on a busy machine its exit (tearing down its memory
                # and the fork server's copy-on-write pages) can take longer than the polite bound.
                self.process.wait(timeout=KILLED_REAP_TIMEOUT_S)


# ------------------------------------------------------------------------------------------------
# The zygote's side (its own process; single-threaded, no event loop).


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _mm_regions(env_size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Where the kernel keeps this process's command line and initial environment (``arg_start``,
    ``arg_end``, ``env_start``, ``env_end`` of ``/proc/self/stat``); ``env_size`` (the bytes of the
    environment it was started with) must fit."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    arg_start, arg_end, start, end = (int(x) for x in fields[45:49])  # after the command name
    if not 0 < arg_start < arg_end <= start < end or end - start < env_size:
        raise ValueError(f"no environment region in /proc/self/stat ({start:#x}-{end:#x})")
    return (arg_start, arg_end), (start, end)


def _set_title(region: tuple[int, int], title: str) -> None:
    """Show ``title`` as this process's command line (``ps``, ``/proc/<pid>/cmdline``), as setproctitle
    does: the title and a NUL, then no NUL up to the region's last byte (the kernel then reads the
    command line up to the first NUL). A forked server shows ``<python> <script>``, as a spawned one."""
    start, end = region
    data = title.encode()[: end - start - 2] + b"\0"
    data += b" " * (end - start - len(data))
    ctypes.memmove(start, data, len(data))


def _zero(start: int, end: int) -> None:
    """Zero [start, end) of this process's memory: whole pages are given back (MADV_DONTNEED reads as
    zeros afterwards, and costs no memory), the partial pages at the edges are cleared."""
    page = resource.getpagesize()
    first, last = -(-start // page) * page, end // page * page
    if first >= last:
        ctypes.memset(start, 0, end - start)
        return
    ctypes.memset(start, 0, first - start)
    ctypes.memset(last, 0, end - last)
    _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.send(json.dumps(msg).encode())


def zygote_main() -> None:
    """The zygote process: preload, then fork servers on request (returns only in a server, once its
    script has run as ``__main__``; see the module docstring)."""
    control_fd, launcher_pid = int(sys.argv[1]), int(sys.argv[2])
    handlers = {
        s: signal.getsignal(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)
    }
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # nothing to clean up here
    if os.getppid() != launcher_pid:
        os._exit(1)
    sock = socket.socket(fileno=control_fd)
    if sys.path and sys.path[0] == "":  # python -c's entry; a server's first entry is its script's folder
        sys.path.pop(0)
    # The reserved space: out of this process's variables (first: the C library's environ must not
    # point into it), then out of its memory (it reads as zeros, and costs nothing in the servers).
    own = {k: v for k, v in os.environb.items() if not k.startswith(_ENV_SPACE_VAR.encode())}
    total = _env_block_size(os.environb)
    for key in [k for k in os.environ if k.startswith(_ENV_SPACE_VAR)]:
        del os.environ[key]
    try:
        arg_region, (env_start, env_end) = _mm_regions(total - 1)
        _zero(env_start + _env_block_size(own) - 1, env_end)
        _set_title(
            arg_region, f"{sys.executable} -m nemo_gym.run.zygote (fork server of ng_run {launcher_pid})"
        )
    except (OSError, ValueError, IndexError):
        arg_region, env_start, env_end = (0, 0), 0, 0
    from nemo_gym.server.startup import startup_mark

    startup_mark("zygote_started", "zygote")
    failed = {}
    for name in PRELOAD_MODULES:
        try:
            importlib.import_module(name)
        except Exception as e:  # not installed here: its servers import it themselves, or fail as before
            failed[name] = f"{type(e).__name__}: {e}"
    gc.collect()
    gc.freeze()  # the collector never touches these again: fewer pages copied in each server
    threads = _threads()
    refuse = None
    if threads != 1:
        refuse = f"importing its modules started {threads - 1} thread(s): it cannot fork safely"
    elif env_end <= env_start:
        refuse = "it cannot find its environment in /proc/self/stat"
    startup_mark("zygote_preloaded", "zygote")
    hello = {"hello": True, "failed": failed, "threads": threads, "refuse": refuse}
    hello["env_space"] = env_end - env_start
    _send(sock, hello)
    if refuse:
        return
    spec = _serve(sock, handlers, launcher_pid)
    _run_script(spec, arg_region, (env_start, env_end))


def _serve(sock: socket.socket, handlers: dict[int, Any], launcher_pid: int) -> dict[str, Any]:
    """Answer spawn requests until the launcher closes the socket (then exit). In a forked server,
    return its spec."""
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, _MSG_MAX, 64)
        except OSError:
            data, fds = b"", []
        if not data:  # the launcher is done with it (or gone): nothing to clean up, no finalization
            os._exit(0)
        msg = json.loads(data)
        try:
            if _threads() != 1:
                raise OSError("the fork server is no longer single-threaded")
            pid_r, pid_w = os.pipe()
            middle = os.fork()
        except OSError as e:
            for fd in fds:
                os.close(fd)
            _send(sock, {"error": f"cannot fork '{msg.get('spawn')}': {e}"})
            continue
        if middle == 0:
            # The middle process: fork the server and exit, so that it is re-parented to the launcher.
            try:
                server = os.fork()
            except OSError:
                os._exit(1)
            if server == 0:
                os.close(pid_r)
                os.close(pid_w)
                return _server_setup(sock, fds, handlers, launcher_pid)
            try:
                os.setpgid(server, server)  # also done by the server: whichever runs first
            except OSError:
                pass
            os.write(pid_w, str(server).encode())
            os._exit(0)
        os.close(pid_w)
        for fd in fds:
            os.close(fd)  # the server's now: its verdict pipe and its port must end with it
        answer = os.read(pid_r, 32)
        os.close(pid_r)
        os.waitpid(middle, 0)  # once it is reaped, the server's parent is the launcher
        if not answer:
            _send(sock, {"error": f"cannot fork '{msg.get('spawn')}'"})
            continue
        _send(sock, {"pid": int(answer), "fds": fds})


def _server_setup(
    sock: socket.socket, fds: list[int], handlers: dict[int, Any], launcher_pid: int
) -> dict[str, Any]:
    """In a forked server: become what ``python <script>`` would be, then return the spec."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() != launcher_pid:  # the middle process is exiting
        if time.monotonic() > deadline:
            _die_before_start(
                fds[0],
                f"its parent is pid {os.getppid()}, not the launcher {launcher_pid}, after {REPARENT_TIMEOUT_S:g} s",
            )
        time.sleep(0.0005)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != launcher_pid:  # the launcher died before the signal was asked for
        _die_before_start(fds[0], f"the launcher {launcher_pid} exited")
    for sig, handler in handlers.items():
        if handler is None:  # set outside Python: left as it is
            continue
        try:
            signal.signal(sig, handler)
        except (OSError, ValueError, TypeError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    sock.close()
    out_w, spec_r = fds[0], fds[1]
    keep = {0, 1, 2, spec_r, *fds[2:]}
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(out_w, 1)
    os.dup2(out_w, 2)
    os.close(out_w)
    low = 3
    for fd in sorted(keep | {os.sysconf("SC_OPEN_MAX")}):
        if fd >= low:
            os.closerange(low, fd)  # close_range(2) on Linux: cheap however high the limit
            low = fd + 1
    chunks = []
    while True:
        chunk = os.read(spec_r, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(spec_r)
    spec = json.loads(b"".join(chunks) or b"null")
    if not spec:
        _die_before_start(1, "the launcher sent no spec (it gave up on this server)")
    return spec


def _die_before_start(out_fd: int, why: str) -> NoReturn:
    """Exit a forked server that cannot start, saying why on its output (its log: a bare exit code
    would leave the launcher's error without a cause)."""
    try:
        os.write(out_fd, f"nemo_gym fork server: this server was not started: {why}\n".encode())
    except OSError:
        pass
    os._exit(1)


def _show_environ(env: Mapping[str, str], region: tuple[int, int]) -> None:
    """Write ``env`` where ``/proc/<pid>/environ`` reads a process's environment (the region the kernel
    filled at exec: the zygote's variables and the space it reserved), the rest zeroed. Tools and
    tests read a server's environment there; a forked process would otherwise show the zygote's.
    Nothing reads that memory any more (the C library's ``environ`` was rebuilt by ``os.environ``)."""
    start, end = region
    block = b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0" for k, v in env.items())
    if len(block) >= end - start:  # the launcher checked it fits: never here
        return
    ctypes.memmove(start, block, len(block))
    _zero(start + len(block), end)


def _run_script(spec: dict[str, Any], arg_region: tuple[int, int], env_region: tuple[int, int]) -> None:
    """Run the server's script as ``__main__``, with what ``python <script>`` would have set up."""
    import types
    from importlib.machinery import SourceFileLoader

    os.environ.clear()  # unsetenv each: the C library's environ no longer points into the region
    os.environ.update(spec["env"])
    _show_environ(spec["env"], env_region)
    os.chdir(spec["cwd"])
    random.seed()  # also done by random's own fork hook
    script = spec["script"]
    _set_title(arg_region, f"{sys.executable} {script}")
    sys.argv = [script]
    sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
    from nemo_gym.server.startup import startup_mark

    startup_mark("forked")
    main = types.ModuleType("__main__")
    main.__file__ = script
    main.__loader__ = SourceFileLoader("__main__", script)
    sys.modules["__main__"] = main
    # multiprocessing aliased __mp_main__ to the zygote's own __main__ when the preload imported it; a
    # spawned worker pickles the script's names under __mp_main__, so the alias must name the script too.
    sys.modules["__mp_main__"] = main
    with open(script, "rb") as f:
        code = compile(f.read(), script, "exec")
    exec(code, main.__dict__)
