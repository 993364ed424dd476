"""What every sandbox backend shares: one-shot runs with limits and a guaranteed kill, and the result.

Contract
--------
* :meth:`_BackendBase.shared` gives one backend object per (class, provider config) in this process;
  :meth:`_BackendBase.cgroup_driver` picks the cgroup mode (v1, v2 or none:
  :mod:`nemo_gym.sandbox.cgroup_mode`) and makes this process's cgroup parents once, logging the mode and
  why (and warning when, as root, no pids cgroup exists: RLIMIT_NPROC does not apply to root);
  :meth:`_BackendBase.cgroup_roots` is its controller -> parent dir map. Nothing else here knows the mode.
* :meth:`_BackendBase.run` runs one program through the one-shot launcher (:mod:`nemo_gym.sandbox.launch`)
  in fresh per-run cgroups: stdin fed, stdout/stderr each capped at ``output_limit_bytes`` (past it, the
  process group is SIGKILLed), SIGKILL at the wall-clock limit or on cancellation, then every pid left in
  the run's cgroups is killed and the cgroups removed (in the clean-up thread). Subclasses give the argv
  (``_command``), the program's exit code (``_program_rc``) and their start-failure check.
* A run's work dir has a total disk bound (``limits.disk_quota_mib``, :mod:`nemo_gym.sandbox.disk_quota`):
  what it holds beyond what it held when the run started is watched while the program runs (past the
  quota the tree is SIGKILLed) and counted once more when it ends.
* :meth:`_BackendBase._result` turns a finished run into a :class:`SandboxExecResult` (timeout: wall clock
  or CPU time; oom; output cap; disk quota, with a marker line on stderr; pids limit hit; the tree's CPU
  seconds) or raises :class:`SandboxError`
  when the sandbox, not the program, failed (it could not join its cgroups or set its limits).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import signal
from pathlib import Path

from nemo_gym.sandbox import disk_quota, workers
from nemo_gym.sandbox.cgroup_mode import open_cgroups
from nemo_gym.sandbox.cgroups import CgroupDriver, RunCgroup
from nemo_gym.sandbox.errors import SandboxError, SandboxUnavailableError
from nemo_gym.sandbox.launch import _JOIN_FAILED, DASH, _launcher_args, _parse_status, _read_capped
from nemo_gym.sandbox.spec import SandboxExecResult, SandboxProviderConfig, SandboxResources

LOG = logging.getLogger("nemo_gym.sandbox")


class _BackendBase:
    _shared: dict[tuple, _BackendBase] = {}
    _cgroup_roots: CgroupDriver | None = None

    def __init__(self, config: SandboxProviderConfig) -> None:
        self.config = config

    @classmethod
    def shared(cls, config: SandboxProviderConfig) -> _BackendBase:
        key = (cls.__name__, config.model_dump_json())
        if key not in _BackendBase._shared:
            _BackendBase._shared[key] = cls(config)
        return _BackendBase._shared[key]

    @classmethod
    def cgroup_driver(cls) -> CgroupDriver:
        """This process's cgroup mode and its runs' cgroups (picked once, on first use: the start-up check)."""
        if _BackendBase._cgroup_roots is None:
            driver = _BackendBase._cgroup_roots = open_cgroups()
            if driver.mode == "none":
                LOG.warning("sandbox: cgroup mode none: %s", driver.reason)
            else:
                LOG.info("sandbox: cgroup mode %s: %s", driver.mode, driver.reason)
            if "pids" not in driver.roots and os.geteuid() == 0:
                LOG.warning(
                    "sandbox: no writable pids cgroup, and RLIMIT_NPROC does not apply to root: "
                    "the process-count limit is NOT enforced"
                )
        return _BackendBase._cgroup_roots

    @classmethod
    def cgroup_roots(cls) -> dict[str, Path]:
        """Controller -> the parent dir of this process's run cgroups (``"pids"`` in it: processes limited)."""
        return cls.cgroup_driver().roots

    def check(self) -> None:
        if not os.path.exists(DASH) and shutil.which("prlimit") is None:
            raise SandboxUnavailableError(
                "the sandbox needs `prlimit` (Debian package util-linux): apt-get install util-linux"
            )

    def _command(
        self,
        argv: list[str],
        *,
        host_dir: Path,
        workdir: str,
        cwd: str | None,
        env: dict[str, str],
        status_fd: int,
    ) -> tuple[list[str], dict[str, str] | None, str | None]:
        raise NotImplementedError

    def _base_env(self, home: str) -> dict[str, str]:
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": home,
            "LANG": "C.UTF-8",
            "TMPDIR": "/tmp",
            "PYTHONDONTWRITEBYTECODE": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }

    async def run(
        self,
        argv: list[str],
        *,
        host_dir: Path,
        workdir: str,
        cwd: str | None,
        env: dict[str, str],
        stdin: bytes | None,
        limits: SandboxResources,
    ) -> SandboxExecResult:
        baseline = await disk_quota.used_bytes([host_dir])  # what the run adds is what counts
        cgroups = self.cgroup_driver().create(limits)  # a few cgroupfs writes: microseconds
        status_r, status_w = os.pipe()
        watcher: asyncio.Future | None = None
        os.set_blocking(status_r, False)
        proc: asyncio.subprocess.Process | None = None
        kill_reason: list[str] = []
        try:
            inner, proc_env, proc_cwd = self._command(
                argv, host_dir=host_dir, workdir=workdir, cwd=cwd, env=env, status_fd=status_w
            )
            full = [
                *_launcher_args(
                    limits,
                    cgroups.procs_files(),
                    memory_by_cgroup=cgroups.memory_limited,
                    pids_by_cgroup=cgroups.limits_processes,
                ),
                *inner,
            ]
            try:
                proc = await asyncio.create_subprocess_exec(
                    *full,
                    stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    env=proc_env if proc_env is not None else {"PATH": "/usr/bin:/bin"},
                    cwd=proc_cwd,
                    pass_fds=(status_w,),
                    start_new_session=True,
                )
            except OSError as exc:
                raise SandboxError(f"cannot start the sandbox ({full[0]}): {exc}") from exc
            finally:
                os.close(status_w)
                status_w = -1

            def kill(reason: str) -> None:
                if not kill_reason:
                    kill_reason.append(reason)
                if proc is not None and proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)

            async def feed() -> None:
                if stdin is None or proc is None or proc.stdin is None:
                    return
                try:
                    proc.stdin.write(stdin)
                    await proc.stdin.drain()
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    with contextlib.suppress(Exception):
                        proc.stdin.close()

            cap = limits.output_limit_bytes
            assert proc.stdout is not None and proc.stderr is not None
            out_task = asyncio.ensure_future(_read_capped(proc.stdout, cap, lambda: kill("output_limit")))
            err_task = asyncio.ensure_future(_read_capped(proc.stderr, cap, lambda: kill("output_limit")))
            everything = asyncio.gather(out_task, err_task, feed(), proc.wait())
            quota = limits.disk_quota_bytes
            watcher = asyncio.ensure_future(
                disk_quota.watch([host_dir], baseline + quota, lambda _used: kill("disk_quota"))
            )
            try:
                await asyncio.wait_for(asyncio.shield(everything), limits.wall_time_s)
            except TimeoutError:
                kill("timeout")
            watcher.cancel()
            if proc.returncode is None or not everything.done():
                # Killed: the pid namespace goes with bwrap; the cgroup sweep gets anything else.
                await asyncio.to_thread(cgroups.destroy, False)
                try:
                    await asyncio.wait_for(asyncio.shield(everything), 10)
                except TimeoutError:
                    everything.cancel()
                    raise SandboxError(
                        "the sandboxed program's output pipes stayed open after it was killed"
                    ) from None
            (stdout, out_trunc), (stderr, err_trunc), _, outer_rc = everything.result()
            status = b""
            with contextlib.suppress(BlockingIOError, OSError):
                while chunk := os.read(status_r, 65536):
                    status += chunk
            written = await disk_quota.used_bytes([host_dir]) - baseline
            return self._result(
                status=_parse_status(status),
                outer_rc=outer_rc,
                stdout=stdout,
                stderr=stderr,
                out_trunc=out_trunc,
                err_trunc=err_trunc,
                kill_reason=kill_reason[0] if kill_reason else None,
                cgroups=cgroups,
                limits_cpu=math.ceil(limits.cpu_time_s),
                disk=(written, quota),
            )
        finally:
            if watcher is not None:
                watcher.cancel()
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            if status_w >= 0:
                os.close(status_w)
            os.close(status_r)
            # The tree is dead or dying; its last tasks may still be exiting. Sweep and remove the cgroups
            # in the clean-up thread (an rmdir takes milliseconds): the result is ready.
            try:
                workers._CLEANUP.submit(cgroups.destroy)
            except RuntimeError:  # interpreter shutting down
                cgroups.destroy()
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.wait(), 5)

    def _program_rc(
        self, status: dict[str, int], outer_rc: int, stderr: bytes, kill_reason: str | None
    ) -> int:
        raise NotImplementedError

    def _check_started(self, rc: int, stderr: bytes, cgroups: RunCgroup, kill_reason: str | None) -> None:
        """Raise SandboxError if the sandbox failed before the program started (backend-specific)."""

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
    ) -> SandboxExecResult:
        """``disk``: (bytes the run added to its work dir, its quota), when counted."""
        if outer_rc == _JOIN_FAILED and "child-pid" not in status and kill_reason is None:
            raise SandboxError(
                f"the sandbox could not join its cgroups or set its limits: {stderr.decode(errors='replace')[-500:]}"
            )
        rc = self._program_rc(status, outer_rc, stderr, kill_reason)
        self._check_started(rc, stderr, cgroups, kill_reason)
        oom = cgroups.oom_killed() or (
            not cgroups.memory_limited and b"MemoryError" in stderr[-4000:] and rc != 0
        )
        cpu_used = cgroups.cpu_time_s()
        # SIGXCPU at the soft CPU limit; SIGKILL at the hard one (soft + 1 s) if the program handled SIGXCPU.
        cpu_out = rc == 128 + signal.SIGXCPU or (
            rc == 128 + signal.SIGKILL and not oom and cpu_used is not None and cpu_used >= limits_cpu
        )
        timed_out = kill_reason == "timeout" or cpu_out
        over_quota = kill_reason == "disk_quota" or (disk is not None and disk[0] > disk[1])
        error_type = None
        if timed_out:
            error_type = "timeout"
        elif oom:
            error_type = "oom"
        elif kill_reason == "output_limit":
            error_type = "output_limit"
        elif over_quota:
            error_type = "disk_quota"
        stderr_text = stderr.decode(errors="replace")
        if over_quota and disk is not None:
            stderr_text += disk_quota.note(disk[0], disk[1], stopped=kill_reason == "disk_quota")
        return SandboxExecResult(
            stdout=stdout.decode(errors="replace"),
            stderr=stderr_text,
            return_code=rc,
            error_type=error_type,
            timed_out=timed_out,
            oom_killed=oom,
            pids_limit_hit=cgroups.pids_limit_hit(),
            stdout_truncated=out_trunc,
            stderr_truncated=err_trunc,
            cpu_time_s=cpu_used,
        )
