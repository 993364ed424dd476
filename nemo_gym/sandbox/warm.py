"""Pre-started (warm) bubblewrap sandboxes: started before their run, each serving exactly one run.

Contract
--------
* :class:`_WarmSandbox` makes its cgroups and joins them, sets up the namespaces and mounts around its
  ``bind_dir`` and starts a shim (dash, inside, as the program-to-be) that blocks on stdin. :meth:`run`
  writes the run's limits to its cgroups and sends the command (up to a random marker line, or as
  ``+N`` and N bytes past :data:`_LONG_COMMAND`), which sets the rlimits and execs the program; the
  program keeps the rest of stdin and has no fd but stdin, stdout and stderr. Output is capped, the
  wall-clock limit, the work dir's disk quota (:mod:`nemo_gym.sandbox.disk_quota`) and cancellation
  SIGKILL the tree, and the result is classified by the backend.
* It is never reused: :meth:`release` (after the run) and :meth:`discard` (idle, unused) kill what is
  left, close its fds and remove its cgroups (and its own dir unless a work dir adopted it). An idle
  one dies with this process (``--die-with-parent``; stdin EOF).
* :func:`_sweep_dead_owners_dirs` removes the fresh dirs (``_PRESTART_PREFIX`` + owner pid) and
  renamed-away work dirs of processes that died without cleaning up.
* The pool of idle ones (at most one per slot, refilled by the starter thread) is the bubblewrap
  backend's (:mod:`nemo_gym.sandbox.bwrap`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import secrets
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from nemo_gym.sandbox import disk_quota, workers
from nemo_gym.sandbox.cgroups import CgroupDriver, RunCgroup
from nemo_gym.sandbox.errors import SandboxError
from nemo_gym.sandbox.launch import _JOIN_FAILED, _READ_CHUNK, DASH, _dash_ulimits, _parse_status, _sh_quote
from nemo_gym.sandbox.spec import SandboxExecResult, SandboxResources
from nemo_gym.sandbox.trees import remove_tree
from nemo_gym.sandbox.workers import remove_dir_later


class _WarmBackend(Protocol):
    """What a pre-started sandbox needs of its backend (the bubblewrap backend; named structurally so
    this module does not import the backend module that imports it)."""

    def cgroup_driver(self) -> CgroupDriver: ...

    def _bwrap_argv(
        self,
        program: list[str],
        *,
        bind_dir: Path,
        workdir: str,
        chdir: str,
        env: dict[str, str],
        status_fd: int,
        tmp_bytes: int,
    ) -> list[str]: ...

    def _program_argv(self, argv: list[str]) -> list[str]: ...

    def _result(
        self,
        *,
        status: dict[str, int],
        outer_rc: int,
        stdout: bytes,
        stderr: bytes,
        out_trunc: bool,
        err_trunc: bool,
        kill_reason: str | None,
        cgroups: RunCgroup,
        limits_cpu: float,
        disk: tuple[int, int] | None = None,
    ) -> SandboxExecResult: ...


# ------------------------------------------------------------------------------------------------
# One sandbox, started before its run: namespaces, mounts and cgroups are made while it waits for its
# program. It serves exactly one run and is then finished (killed, cgroups swept); never reused.

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# The shim (dash, inside the sandbox, as the program-to-be) reads a command from stdin and evals it; the
# command sets the rlimits and execs the program, which keeps the rest of stdin. Nothing past the command
# is consumed: dash's `read` takes one byte at a time from a pipe (short commands: lines up to the marker
# line), and `head -c N` never asks for more than N bytes (long commands, sent as "+N" then N bytes: one
# fork more, but not a syscall per byte).
_LONG_COMMAND = 2048
_SHIM = (
    "m={marker}; IFS= read -r l || exit {code}; "
    'case $l in +*) s=$(head -c "${{l#+}}") || exit {code} ;; '
    '*) s=; while [ "$l" != "$m" ]; do s="$s$l\n"; IFS= read -r l || exit {code}; done ;; esac; '
    'unset l m; eval "$s"'
)


_PRESTART_PREFIX = "nemo-gym-sandbox-prestart-"  # + owner pid + "-": a pre-started sandbox's fresh dir
_SWEPT: set[Path] = set()


def _sweep_dead_owners_dirs(root: Path, prefix: str = _PRESTART_PREFIX) -> None:
    """Remove the pre-started sandboxes' dirs (and renamed-away work dirs) of processes that died without
    cleaning up (a server stopped by a signal runs no exit handlers; its idle sandboxes died with it).
    ``prefix``: another kind of dir named ``<prefix><owner pid>-...`` (sessions' dirs)."""
    for pattern in (f"{prefix}*", f".{prefix}*.removed"):
        for path in root.glob(pattern):
            pid = path.name.lstrip(".").removeprefix(prefix).split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                remove_dir_later(path)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed and not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


class _WarmSandbox:
    """A bubblewrap sandbox started ahead: bound to ``bind_dir``, its shim blocked on stdin until
    :meth:`run` sends the program. Dies with this process (``--die-with-parent``, stdin EOF), is killed
    by :meth:`discard` / :meth:`release`, and at exit while idle."""

    atexit_registered = False

    def __init__(
        self,
        backend: _WarmBackend,
        bind_dir: Path,
        workdir: str,
        limits: SandboxResources,
        *,
        owns_dir: bool,
    ) -> None:
        tmp_bytes = limits.tmp_size_mib << 20
        self.key = (workdir, tmp_bytes)
        self.bind_dir = bind_dir
        self.workdir = workdir
        self.owns_dir = owns_dir  # an idle sandbox's own fresh dir: removed with it unless adopted
        self.owner_pid = os.getpid()
        self.backend = backend
        self.proc: subprocess.Popen | None = None
        self.finished = False
        self._marker = secrets.token_hex(16)
        self._fds: dict[str, int] = {}
        self._pidfd = -1
        self.cgroups = backend.cgroup_driver().create(limits, always_memory=True)
        child: list[int] = []
        try:
            for name in ("status", "stdin", "stdout", "stderr"):
                r, w = os.pipe()
                mine, theirs = (w, r) if name == "stdin" else (r, w)
                self._fds[name] = mine
                child.append(theirs)
            status_w, in_r, out_w, err_w = child
            shim = _SHIM.format(marker=self._marker, code=_JOIN_FAILED)
            inner = backend._bwrap_argv(
                [DASH, "-c", shim, "sandbox"],
                bind_dir=bind_dir,
                workdir=workdir,
                chdir=workdir,
                env={},
                status_fd=status_w,
                tmp_bytes=tmp_bytes,
            )
            join = "".join(
                f"echo $$ > {_sh_quote(f)} || exit {_JOIN_FAILED}; " for f in self.cgroups.procs_files()
            )
            launch = [DASH, "-c", join + f'ulimit -c 0 || exit {_JOIN_FAILED}; exec "$@"', "sandbox-launch"]
            self.proc = subprocess.Popen(
                [*launch, *inner],
                stdin=in_r,
                stdout=out_w,
                stderr=err_w,
                pass_fds=(status_w,),
                env={"PATH": "/usr/bin:/bin"},
                cwd="/",
                close_fds=True,
                start_new_session=True,
            )
        except OSError as exc:
            self._finish(sync=True)
            raise SandboxError(f"cannot start the sandbox (bwrap): {exc}") from exc
        finally:
            for fd in child:
                os.close(fd)
        for fd in self._fds.values():
            os.set_blocking(fd, False)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and not self.finished

    # -- the run ---------------------------------------------------------------------------------

    def _script(
        self, argv: list[str], *, cwd: str | None, env: dict[str, str], limits: SandboxResources, stdin: bool
    ) -> str:
        lines = [] if stdin else ["exec 0</dev/null"]
        ulimits = _dash_ulimits(
            limits,
            memory_by_cgroup=self.cgroups.memory_limited,
            pids_by_cgroup=self.cgroups.limits_processes,
        )
        lines.append(" && ".join(ulimits) + f" || exit {_JOIN_FAILED}")
        if cwd and cwd != self.workdir:
            lines.append(f"cd -- {_sh_quote(cwd)} || exit 1")
        program = [_sh_quote(a) for a in self.backend._program_argv(argv)]
        odd = {k: v for k, v in env.items() if not _ENV_NAME.match(k)}
        for key, value in env.items():
            if key not in odd:
                lines.append(f"export {key}={_sh_quote(value)}")
        if odd:  # names a shell cannot export: env(1) sets them (one exec more)
            program = ["/usr/bin/env", *(_sh_quote(f"{k}={v}") for k, v in odd.items()), *program]
        lines.append("exec " + " ".join(program))
        return "\n".join(lines)

    async def run(
        self,
        argv: list[str],
        *,
        cwd: str | None,
        env: dict[str, str],
        stdin: bytes | None,
        limits: SandboxResources,
    ) -> SandboxExecResult:
        proc = self.proc
        assert proc is not None and not self.finished
        baseline = await disk_quota.used_bytes([self.bind_dir])  # what the run adds is what counts
        self.cgroups.apply(limits)
        script = self._script(argv, cwd=cwd, env=env, limits=limits, stdin=stdin is not None)
        if self._marker in script:  # 128 random bits: only if someone knew them
            raise SandboxError("the sandbox's command contains its start marker")
        command = script.encode()
        if len(command) > _LONG_COMMAND:
            payload = b"".join((b"+%d\n" % len(command), command, stdin or b""))
        else:
            payload = b"".join((command, b"\n", self._marker.encode(), b"\n", stdin or b""))
        kill_reason: list[str] = []

        def kill(reason: str) -> None:
            if not kill_reason:
                kill_reason.append(reason)
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)

        cap = limits.output_limit_bytes
        everything = asyncio.gather(
            self._read_capped("stdout", cap, lambda: kill("output_limit")),
            self._read_capped("stderr", cap, lambda: kill("output_limit")),
            self._write_all(payload),
            self._wait_exit(),
        )
        quota = limits.disk_quota_bytes
        watcher = asyncio.ensure_future(
            disk_quota.watch([self.bind_dir], baseline + quota, lambda _used: kill("disk_quota"))
        )
        try:
            try:
                await asyncio.wait_for(asyncio.shield(everything), limits.wall_time_s)
            except TimeoutError:
                kill("timeout")
            watcher.cancel()
            if proc.returncode is None or not everything.done():
                # Killed: the pid namespace goes with bwrap; the cgroup sweep gets anything else.
                await asyncio.to_thread(self.cgroups.destroy, False)
                try:
                    await asyncio.wait_for(asyncio.shield(everything), 10)
                except TimeoutError:
                    raise SandboxError(
                        "the sandboxed program's output pipes stayed open after it was killed"
                    ) from None
        finally:
            watcher.cancel()
            if not everything.done():
                kill("cancelled")
                everything.cancel()
                # It finishes later (with the readers' CancelledError): retrieve that then, so asyncio
                # does not log "exception was never retrieved" for a cancellation we asked for.
                everything.add_done_callback(_retrieve)
        (stdout, out_trunc), (stderr, err_trunc), _, outer_rc = everything.result()
        status = b""
        with contextlib.suppress(BlockingIOError, OSError):
            while chunk := os.read(self._fds["status"], 65536):
                status += chunk
        written = await disk_quota.used_bytes([self.bind_dir]) - baseline
        return self.backend._result(
            status=_parse_status(status),
            outer_rc=outer_rc,
            stdout=stdout,
            stderr=stderr,
            out_trunc=out_trunc,
            err_trunc=err_trunc,
            kill_reason=kill_reason[0] if kill_reason else None,
            cgroups=self.cgroups,
            limits_cpu=math.ceil(limits.cpu_time_s),
            disk=(written, quota),
        )

    async def _readable(self, fd: int, writer: bool = False) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        add, remove = (
            (loop.add_writer, loop.remove_writer) if writer else (loop.add_reader, loop.remove_reader)
        )
        add(fd, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            if not self.finished:  # finished: already removed and closed (the number may be reused)
                remove(fd)

    async def _read_capped(self, name: str, cap: int, overflow: Callable[[], None]) -> tuple[bytes, bool]:
        fd = self._fds[name]
        buf = bytearray()
        while True:
            try:
                chunk = os.read(fd, _READ_CHUNK)
            except BlockingIOError:
                await self._readable(fd)
                continue
            if not chunk:
                return bytes(buf), False
            room = cap - len(buf)
            if len(chunk) > room:
                buf += chunk[:room]
                overflow()
                return bytes(buf), True
            buf += chunk

    async def _write_all(self, data: bytes) -> None:
        fd = self._fds.pop("stdin")
        view = memoryview(data)
        try:
            while view:
                try:
                    view = view[os.write(fd, view) :]
                except BlockingIOError:
                    self._fds["stdin_busy"] = fd  # registered with the loop: finish() unregisters it
                    await self._readable(fd, writer=True)
                    del self._fds["stdin_busy"]
                except (BrokenPipeError, ConnectionResetError):  # the program stopped reading: its business
                    return
        finally:
            self._fds.pop("stdin_busy", None)
            if not self.finished:
                os.close(fd)

    async def _wait_exit(self) -> int:
        proc = self.proc
        assert proc is not None
        if proc.poll() is not None:
            return proc.returncode
        try:
            self._pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # no pidfd (old kernel): a thread waits
            return await asyncio.to_thread(proc.wait)
        await self._readable(self._pidfd)
        return proc.wait()  # exited: reaps at once

    # -- the end ---------------------------------------------------------------------------------

    def release(self) -> None:
        """After its run (or a failed hand-over): kill what is left, close, sweep the cgroups."""
        self._finish(sync=False)

    def discard(self) -> None:
        """An idle sandbox that will not run anything: kill it and remove its dir (blocking, brief)."""
        self._finish(sync=True)

    def _finish(self, *, sync: bool) -> None:
        if self.finished:
            return
        self.finished = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        fds = [*self._fds.values(), *([self._pidfd] if self._pidfd >= 0 else [])]
        if loop is not None:
            for fd in fds:
                loop.remove_reader(fd)
                loop.remove_writer(fd)
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        cgroups, bind_dir = self.cgroups, self.bind_dir if self.owns_dir else None

        def clean_up() -> None:
            # The tree is dead or dying (bwrap is gone, so is its pid namespace); its last tasks may still
            # be exiting: sweep, then remove the cgroups (and an idle sandbox's own dir).
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
            cgroups.destroy()
            if bind_dir is not None:
                remove_tree(bind_dir)

        if sync:
            clean_up()
            return
        try:
            workers._CLEANUP.submit(clean_up)  # the run's result is ready: nobody waits for this
        except RuntimeError:  # interpreter shutting down
            clean_up()
