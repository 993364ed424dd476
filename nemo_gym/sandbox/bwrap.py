"""Sandbox backends: bubblewrap (isolated) and unsafe_local_subprocess (explicit opt-in, NOT isolated).

Contract
--------
* ``BubblewrapBackend.run(argv, ...)`` runs ``argv`` under ``bwrap`` with: every namespace unshared (no
  network: only a down-or-empty loopback of its own; its own pid namespace, so it sees and can signal only
  its own processes), a user namespace in which it is uid/gid 65534 with no capabilities and no further
  user namespaces, ``/usr`` (and the merged-usr links, ``/etc/alternatives``, ``/etc/ld.so.cache``) bound
  READ-ONLY and nothing else of the host (no repo, no /root, no /home, no /etc/passwd), a read-only root,
  a fresh /proc and /dev, a size-capped tmpfs /tmp, the work dir bound read-write at ``spec.workdir`` (the
  only writable places), its own hostname (UTS namespace), and an environment of
  only PATH/HOME/LANG/TMPDIR/thread-count variables plus what the caller passes.
* Limits: RLIMIT_CPU (then SIGXCPU/SIGKILL), RLIMIT_FSIZE, RLIMIT_NOFILE, no core files; the process count
  and memory through per-run cgroups (v1 ``pids`` and ``memory`` hierarchies, plus ``cpuacct`` to report
  the tree's CPU time, found from
  /proc/self/cgroup; a memory cgroup OOM-kills the tree and we read ``oom_kill`` to report it). Without a
  writable cgroup: RLIMIT_AS for memory, RLIMIT_NPROC for processes; as root (where RLIMIT_NPROC does
  nothing) the bubblewrap backend then REFUSES to run (:class:`SandboxUnavailableError`).
* The whole tree dies at the end, always: the outer ``bwrap`` is SIGKILLed on wall timeout / output cap /
  cancellation, its inner init dies with it (``--die-with-parent``), and the kernel kills every process of
  the pid namespace; then every pid left in the run's cgroups is SIGKILLed and the cgroups removed.
* The program's exit status comes from bwrap's ``--json-status-fd`` (written by bwrap, not reachable from
  the sandbox). A sandbox that never started (no ``child-pid`` status, or bwrap's own ``bwrap: ...`` set-up
  error while the run's pids cgroup never held more than bwrap's two processes) raises
  :class:`SandboxError` with bwrap's message: an infrastructure failure, not the program's. A program
  printing ``bwrap: ...`` itself is still the program's failure.
* One fresh sandbox per run, started ahead (``sandbox.prestart``, default on): while a run runs, the next
  run's sandbox is started (cgroups made and joined, namespaces and mounts set up around a fresh empty
  dir) and its shim (dash, inside, as the program-to-be) blocks on stdin. A run takes an idle one, which
  leaves the pool for good; the caller's work dir is renamed into its dir; this run's limits are written
  to its cgroups; the shim reads the command (up to a random marker line), sets the rlimits and execs
  the program, which keeps the rest of stdin and has no other fd than stdin, stdout and stderr. At most one sandbox per pool slot waits idle; idle ones die
  with this process (``--die-with-parent``; stdin EOF) and are killed and removed at exit. Without an
  idle one (first run, a second run at once in one work dir, another /tmp size) the same sandbox is
  started at the run, bound to the work dir directly. Without dash (non-Debian) each run uses the
  one-shot launcher below (``prlimit``).
* ``UnsafeLocalBackend`` runs ``argv`` as this user in the work dir with an empty environment, the same
  rlimits/cgroups and process-group + cgroup kill, but NO isolation (network, files, other processes).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nemo_gym.sandbox.api import (
    SandboxError,
    SandboxExecResult,
    SandboxProviderConfig,
    SandboxResources,
    SandboxUnavailableError,
)

LOG = logging.getLogger("nemo_gym.sandbox")

SANDBOX_UID = 65534
_JOIN_FAILED = 121  # exit code of the launching shell when it cannot join the cgroups or set a limit
_RUN_IDS = itertools.count()
_READ_CHUNK = 1 << 16
# Work kept off the event loop and off a run's critical path, in threads not tied to any loop: removing a
# finished run's cgroups (an rmdir waits for the kernel: ms) and work dir; starting the next sandbox.
_CLEANUP = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nemo-gym-sandbox-cleanup")
# bwrap's --die-with-parent (PR_SET_PDEATHSIG) fires when the THREAD that started it exits: the starter
# thread lives as long as the process (executor workers are not retired), so idle sandboxes do too.
_STARTER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nemo-gym-sandbox-start")


def _new_executors_after_fork() -> None:  # a forked child has the executors but not their threads
    global _CLEANUP, _STARTER
    _CLEANUP = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nemo-gym-sandbox-cleanup")
    _STARTER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nemo-gym-sandbox-start")


os.register_at_fork(after_in_child=_new_executors_after_fork)


# ------------------------------------------------------------------------------------------------
# Per-run cgroups (v1 hierarchies).


def _own_cgroup_dirs() -> dict[str, Path]:
    dirs: dict[str, Path] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return dirs
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(","):
            if controller in ("pids", "memory", "cpuacct"):
                dirs[controller] = Path("/sys/fs/cgroup") / controller / parts[2].lstrip("/")
    return dirs


class _CgroupRoots:
    """This process's parent dirs for per-run cgroups, made on first use and removed at exit."""

    def __init__(self) -> None:
        self.roots: dict[str, Path] = {}
        for controller, own in _own_cgroup_dirs().items():
            _remove_stale_roots(own)
            root = own / f"nemo_gym_sandbox_{os.getpid()}"
            try:
                root.mkdir(exist_ok=True)
                probe = root / "probe"
                probe.mkdir(exist_ok=True)
                probe.rmdir()
            except OSError:
                continue
            self.roots[controller] = root
        atexit.register(self.remove)

    def remove(self) -> None:
        for root in self.roots.values():
            for child in root.glob("run_*"):
                _kill_and_remove(child)
            with contextlib.suppress(OSError):
                root.rmdir()


def _remove_stale_roots(parent: Path) -> None:
    """Remove the per-process cgroup dirs of processes that died without cleaning up (killed servers)."""
    for root in parent.glob("nemo_gym_sandbox_*"):
        pid = root.name.rsplit("_", 1)[1]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        for child in root.glob("run_*"):
            _kill_and_remove(child, within=1.0)
        with contextlib.suppress(OSError):
            root.rmdir()


def _pids_in(cgroup: Path) -> list[int]:
    try:
        return [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _kill_and_remove(cgroup: Path, within: float = 5.0, remove: bool = True) -> bool:
    """SIGKILL everything in ``cgroup`` until it is empty, then (``remove``) rmdir it. True when it got empty."""
    deadline = time.monotonic() + within
    while True:
        pids = _pids_in(cgroup)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            LOG.error("sandbox cgroup %s still has processes %s after SIGKILL", cgroup, pids)
            return False
        time.sleep(0.005)
    if not remove:
        return True
    for _ in range(200):
        try:
            cgroup.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:  # a just-killed task is still leaving
            time.sleep(0.005)
    return True


@dataclass
class _RunCgroups:
    pids: Path | None
    memory: Path | None
    cpuacct: Path | None = None

    memory_limited: bool = False  # the memory cgroup holds a limit (not just an unlimited cgroup)

    @classmethod
    def create(
        cls, roots: dict[str, Path], limits: SandboxResources, always_memory: bool = False
    ) -> _RunCgroups:
        """Fresh cgroups for one run. ``always_memory``: make the memory cgroup even without a memory
        limit (a pre-started sandbox joins its cgroups before it knows its run's limits)."""
        name = f"run_{next(_RUN_IDS)}"
        made = cls(pids=None, memory=None)
        try:
            if "pids" in roots:
                made.pids = roots["pids"] / name
                made.pids.mkdir()
            if "memory" in roots and (limits.memory_mib is not None or always_memory):
                made.memory = roots["memory"] / name
                made.memory.mkdir()
            if "cpuacct" in roots:
                made.cpuacct = roots["cpuacct"] / name
                made.cpuacct.mkdir()
            made.apply(limits)
        except (OSError, SandboxError) as exc:
            made.destroy()
            raise SandboxError(f"cannot set up the sandbox's cgroups: {exc}") from exc
        return made

    def apply(self, limits: SandboxResources) -> None:
        """Set the process and memory limits (again: a pre-started sandbox gets its run's limits here)."""
        try:
            if self.pids is not None:
                (self.pids / "pids.max").write_text(str(limits.processes))
            if self.memory is not None:
                limit = "-1" if limits.memory_mib is None else str(limits.memory_mib << 20)
                # memsw (only with swap accounting) must stay >= the limit: raise it before, lower it after.
                with contextlib.suppress(OSError):
                    (self.memory / "memory.memsw.limit_in_bytes").write_text(limit)
                (self.memory / "memory.limit_in_bytes").write_text(limit)
                with contextlib.suppress(OSError):
                    (self.memory / "memory.memsw.limit_in_bytes").write_text(limit)
                self.memory_limited = limits.memory_mib is not None
        except OSError as exc:
            raise SandboxError(f"cannot set the sandbox's cgroup limits: {exc}") from exc

    def _dirs(self) -> tuple[Path | None, ...]:
        return (self.pids, self.memory, self.cpuacct)

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self._dirs() if d is not None]

    def cpu_time_s(self) -> float | None:
        """CPU seconds used by every process of the run (cpuacct), or None without that cgroup."""
        if self.cpuacct is None:
            return None
        try:
            return int((self.cpuacct / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return None

    def oom_killed(self) -> bool:
        if self.memory is None:
            return False
        with contextlib.suppress(OSError, ValueError):
            for line in (self.memory / "memory.oom_control").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value) > 0
        return False

    def peak_processes(self) -> int | None:
        if self.pids is None:
            return None
        try:
            return int((self.pids / "pids.peak").read_text())
        except (OSError, ValueError):
            return None

    def pids_limit_hit(self) -> bool:
        if self.pids is None:
            return False
        with contextlib.suppress(OSError, ValueError):
            for line in (self.pids / "pids.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "max":
                    return int(value) > 0
        return False

    def destroy(self, remove: bool = True) -> bool:
        ok = True
        for d in self._dirs():
            if d is not None:
                ok = _kill_and_remove(d, remove=remove) and ok
        return ok


# ------------------------------------------------------------------------------------------------
# Running one process with caps, limits and a guaranteed kill.


DASH = "/bin/dash"


def _launcher_args(
    limits: SandboxResources, procs_files: list[str], *, memory_by_cgroup: bool, pids_by_cgroup: bool
) -> list[str]:
    """argv prefix that joins the run's cgroups, sets the rlimits, then execs the rest.

    With dash (Debian's /bin/sh) one shell does both (``ulimit``: -f counts 512-byte blocks, -v KiB);
    elsewhere the shell joins the cgroups and util-linux ``prlimit`` sets the limits (one exec more)."""
    cpu = max(1, math.ceil(limits.cpu_time_s))
    join = f'for f in {" ".join(_sh_quote(p) for p in procs_files)}; do echo $$ > "$f" || exit {_JOIN_FAILED}; done; '
    if not procs_files:
        join = ""
    if os.path.exists(DASH):
        ulimits = _dash_ulimits(limits, memory_by_cgroup=memory_by_cgroup, pids_by_cgroup=pids_by_cgroup)
        script = join + " && ".join(ulimits) + f' || exit {_JOIN_FAILED}; exec "$@"'
        return [DASH, "-c", script, "sandbox-launch"]
    prlimit = [
        "prlimit",
        f"--cpu={cpu}:{cpu + 1}",
        f"--fsize={limits.file_size_bytes}",
        f"--nofile={limits.open_files}",
        "--core=0",
    ]
    if not memory_by_cgroup and limits.memory_mib is not None:
        prlimit.append(f"--as={limits.memory_mib << 20}")
    if not pids_by_cgroup:
        prlimit.append(f"--nproc={limits.processes}")
    return ["/bin/sh", "-c", join + 'exec "$@"', "sandbox-launch", *prlimit, "--"]


def _dash_ulimits(limits: SandboxResources, *, memory_by_cgroup: bool, pids_by_cgroup: bool) -> list[str]:
    """dash ``ulimit`` commands for the rlimits (-f counts 512-byte blocks, -v KiB)."""
    cpu = max(1, math.ceil(limits.cpu_time_s))
    ulimits = [
        f"ulimit -S -t {cpu}",
        f"ulimit -H -t {cpu + 1}",
        f"ulimit -f {-(-limits.file_size_bytes // 512)}",
        f"ulimit -n {limits.open_files}",
        "ulimit -c 0",
    ]
    if not memory_by_cgroup and limits.memory_mib is not None:
        ulimits.append(f"ulimit -v {limits.memory_mib << 10}")
    if not pids_by_cgroup:
        ulimits.append(f"ulimit -p {limits.processes}")
    return ulimits


def _sh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


async def _read_capped(
    stream: asyncio.StreamReader, cap: int, overflow: Callable[[], None]
) -> tuple[bytes, bool]:
    buf = bytearray()
    while True:
        chunk = await stream.read(_READ_CHUNK)
        if not chunk:
            return bytes(buf), False
        room = cap - len(buf)
        if len(chunk) > room:
            buf += chunk[:room]
            overflow()
            return bytes(buf), True
        buf += chunk


def _parse_status(raw: bytes) -> dict[str, int]:
    out: dict[str, int] = {}
    text = raw.decode(errors="replace")
    decoder, pos = json.JSONDecoder(), 0
    while pos < len(text):
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            break
        try:
            doc, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        if isinstance(doc, dict):
            out.update({k: v for k, v in doc.items() if isinstance(v, int)})
    return out


class _BackendBase:
    _shared: dict[tuple, _BackendBase] = {}
    _cgroup_roots: _CgroupRoots | None = None

    def __init__(self, config: SandboxProviderConfig) -> None:
        self.config = config

    @classmethod
    def shared(cls, config: SandboxProviderConfig) -> _BackendBase:
        key = (cls.__name__, config.model_dump_json())
        if key not in _BackendBase._shared:
            _BackendBase._shared[key] = cls(config)
        return _BackendBase._shared[key]

    @classmethod
    def cgroup_roots(cls) -> dict[str, Path]:
        if _BackendBase._cgroup_roots is None:
            _BackendBase._cgroup_roots = _CgroupRoots()
            roots = _BackendBase._cgroup_roots.roots
            if "pids" not in roots and os.geteuid() == 0:
                LOG.warning(
                    "sandbox: no writable pids cgroup, and RLIMIT_NPROC does not apply to root: "
                    "the process-count limit is NOT enforced"
                )
        return _BackendBase._cgroup_roots.roots

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
        roots = self.cgroup_roots()
        cgroups = _RunCgroups.create(roots, limits)  # a few cgroupfs writes: microseconds
        status_r, status_w = os.pipe()
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
                    memory_by_cgroup=cgroups.memory is not None,
                    pids_by_cgroup=cgroups.pids is not None,
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
            try:
                await asyncio.wait_for(asyncio.shield(everything), limits.wall_time_s)
            except TimeoutError:
                kill("timeout")
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
            )
        finally:
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            if status_w >= 0:
                os.close(status_w)
            os.close(status_r)
            # The tree is dead or dying; its last tasks may still be exiting. Sweep and remove the cgroups
            # in the clean-up thread (an rmdir takes milliseconds): the result is ready.
            try:
                _CLEANUP.submit(cgroups.destroy)
            except RuntimeError:  # interpreter shutting down
                cgroups.destroy()
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.wait(), 5)

    def _program_rc(
        self, status: dict[str, int], outer_rc: int, stderr: bytes, kill_reason: str | None
    ) -> int:
        raise NotImplementedError

    def _check_started(self, rc: int, stderr: bytes, cgroups: _RunCgroups, kill_reason: str | None) -> None:
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
        cgroups: _RunCgroups,
        limits_cpu: float,
    ) -> SandboxExecResult:
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
        error_type = None
        if timed_out:
            error_type = "timeout"
        elif oom:
            error_type = "oom"
        elif kill_reason == "output_limit":
            error_type = "output_limit"
        return SandboxExecResult(
            stdout=stdout.decode(errors="replace"),
            stderr=stderr.decode(errors="replace"),
            return_code=rc,
            error_type=error_type,
            timed_out=timed_out,
            oom_killed=oom,
            pids_limit_hit=cgroups.pids_limit_hit(),
            stdout_truncated=out_trunc,
            stderr_truncated=err_trunc,
            cpu_time_s=cpu_used,
        )


class BubblewrapBackend(_BackendBase):
    _binds_cache: list[str] | None = None
    _checked_for_path: str | None = None  # the PATH under which check() last passed

    def check(self) -> None:
        if self._checked_for_path is not None and self._checked_for_path == os.environ.get("PATH", ""):
            return
        self._check()
        self._checked_for_path = os.environ.get("PATH", "")

    def _check(self) -> None:
        if shutil.which("bwrap") is None:
            raise SandboxUnavailableError(
                "the sandbox needs bubblewrap, which is not installed: install the Debian package `bubblewrap` "
                "(apt-get install bubblewrap; .ci/run does it). Running model code WITHOUT a sandbox needs the "
                "explicit opt-in `sandbox: {backend: unsafe_local_subprocess}`."
            )
        super().check()
        if not Path(self.config.python).exists():
            raise SandboxUnavailableError(
                f"the sandbox's Python {self.config.python!r} does not exist: install Debian's python3 with "
                "apt-get install python3 python3-numpy python3-sympy python3-scipy, or set sandbox.python"
            )
        if os.geteuid() == 0 and "pids" not in self.cgroup_roots():
            # A root-run sandbox without a pids cgroup has no process limit at all (RLIMIT_NPROC does not
            # apply to root): a fork bomb would take the machine. Refuse rather than run unbounded.
            raise SandboxUnavailableError(
                "the sandbox cannot limit processes here: it runs as root and found no writable pids cgroup "
                "(cgroup v1 /sys/fs/cgroup/pids/...), and RLIMIT_NPROC does not apply to root. Make that "
                "hierarchy writable, or run the servers as a non-root user"
            )

    @classmethod
    def _system_binds(cls) -> list[str]:
        if cls._binds_cache is None:
            args = ["--ro-bind", "/usr", "/usr"]
            for top in ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"):
                p = Path(top)
                if p.is_symlink():
                    args += ["--symlink", os.readlink(p), top]
                elif p.is_dir():
                    args += ["--ro-bind", top, top]
            for etc in ("/etc/alternatives", "/etc/ld.so.cache", "/etc/localtime"):
                if Path(etc).exists():
                    args += ["--ro-bind", etc, etc]
            cls._binds_cache = args
        return cls._binds_cache

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
    ) -> list[str]:
        setenv: list[str] = []
        for key, value in {**self._base_env(workdir), **env}.items():
            setenv += ["--setenv", key, value]
        extra: list[str] = []
        for path in self.config.ro_binds:
            extra += ["--ro-bind", path, path]
        return [
            "bwrap",
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--uid",
            str(SANDBOX_UID),
            "--gid",
            str(SANDBOX_UID),
            "--die-with-parent",
            "--new-session",
            "--cap-drop",
            "ALL",
            "--hostname",
            "sandbox",
            *self._system_binds(),
            *extra,
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(tmp_bytes),
            "--tmpfs",
            "/tmp",
            "--bind",
            str(bind_dir),
            workdir,
            "--remount-ro",
            "/",
            "--chdir",
            chdir,
            "--clearenv",
            *setenv,
            "--json-status-fd",
            str(status_fd),
            "--",
            *program,
        ]

    def _program_argv(self, argv: list[str]) -> list[str]:
        program = list(argv)
        if program[0] in ("python", "python3"):
            program[0] = self.config.python
        return program

    def _command(self, argv, *, host_dir, workdir, cwd, env, status_fd):
        command = self._bwrap_argv(
            self._program_argv(argv),
            bind_dir=host_dir,
            workdir=workdir,
            chdir=cwd or workdir,
            env=env,
            status_fd=status_fd,
            tmp_bytes=self._tmp_bytes,
        )
        return command, None, "/"

    _tmp_bytes = 64 << 20

    # -- pre-started sandboxes -------------------------------------------------------------------

    _idle_lock = threading.Lock()  # the idle list is filled from the starter thread

    def _idle_list(self) -> list[_WarmSandbox]:
        idle = self.__dict__.setdefault("_idle", [])
        if idle and idle[0].owner_pid != os.getpid():  # a forked child: those are its parent's
            idle.clear()
        return idle

    def take_warm(self, workdir: str, limits: SandboxResources) -> _WarmSandbox | None:
        """An idle pre-started sandbox for ``workdir`` and these limits' /tmp size, removed from the pool
        (it serves exactly one run), or None. Its fresh, empty ``bind_dir`` is to become the run's work dir."""
        if not self.config.prestart or not os.path.exists(DASH):
            return None
        key = (workdir, limits.tmp_size_mib << 20)
        while True:
            with self._idle_lock:
                idle = self._idle_list()
                warm = next((w for w in idle if w.key == key), None)
                if warm is None:
                    return None
                idle.remove(warm)
            if warm.alive():
                return warm
            warm.discard()  # died while idle (killed from outside): never hand it a run

    def refill(self, workdir: str, limits: SandboxResources) -> None:
        """Start one sandbox ahead for a next run, unless as many are idle as the pool has slots."""
        from nemo_gym.sandbox.api import sandbox_pool_size

        if not self.config.prestart or not os.path.exists(DASH):
            return
        key = (workdir, limits.tmp_size_mib << 20)
        with self._idle_lock:
            idle = self._idle_list()
            other = None
            if len(idle) >= sandbox_pool_size():
                other = next((w for w in idle if w.key != key), None)
                if other is None:
                    return
                idle.remove(other)  # make room: the oldest idle sandbox of another shape goes
        if other is not None:
            other.discard()
        if time.monotonic() < self.__dict__.get("_prestart_paused_until", 0.0):
            return
        root = Path(self.config.workdir_root or tempfile.gettempdir())
        if root not in _SWEPT:
            _SWEPT.add(root)
            _sweep_dead_owners_dirs(root)
        try:
            bind_dir = Path(tempfile.mkdtemp(prefix=f"{_PRESTART_PREFIX}{os.getpid()}-", dir=root))
            try:
                warm = _WarmSandbox(self, bind_dir, workdir, limits, owns_dir=True)
            except BaseException:
                shutil.rmtree(bind_dir, ignore_errors=True)
                raise
        except (OSError, SandboxError) as exc:
            # Runs still work (each starts its own sandbox, and reports a real failure); retry in a minute.
            self._prestart_paused_until = time.monotonic() + 60
            LOG.warning("sandbox: cannot pre-start a sandbox under %s (retrying in 60 s): %s", root, exc)
            return
        with self._idle_lock:
            self._idle_list().append(warm)
        if not _WarmSandbox.atexit_registered:
            _WarmSandbox.atexit_registered = True
            atexit.register(_close_all_idle)

    def _schedule_refill(self, workdir: str, limits: SandboxResources) -> None:
        if self.config.prestart:  # refill() itself keeps the idle count within the pool's slots
            with contextlib.suppress(RuntimeError):  # RuntimeError: the interpreter is shutting down
                _STARTER.submit(self.refill, workdir, limits)

    def close_idle(self) -> None:
        """Kill every idle pre-started sandbox of this backend (at exit; tests)."""
        with self._idle_lock:
            idle = self._idle_list()
            gone, idle[:] = list(idle), []
        for warm in gone:
            warm.discard()

    async def run(self, argv, *, host_dir, workdir, cwd, env, stdin, limits, warm=None):
        self._tmp_bytes = limits.tmp_size_mib << 20
        if not os.path.exists(DASH):  # no dash: the one-shot launcher (util-linux prlimit)
            return await super().run(
                argv, host_dir=host_dir, workdir=workdir, cwd=cwd, env=env, stdin=stdin, limits=limits
            )
        if warm is None or warm.key != (workdir, self._tmp_bytes) or warm.bind_dir != host_dir:
            if warm is not None:
                warm.discard()
            warm = _WarmSandbox(self, host_dir, workdir, limits, owns_dir=False)  # started now
        warm.owns_dir = False  # its dir is the caller's work dir from now on
        # The next run's sandbox starts while this one runs (after this run's hand-over has begun).
        self._schedule_refill(workdir, limits)
        try:
            return await warm.run(argv, cwd=cwd, env=env, stdin=stdin, limits=limits)
        finally:
            warm.release()

    def _check_started(self, rc, stderr, cgroups, kill_reason):
        # bwrap reports a set-up failure (e.g. a bind source missing) as exit code 1 with "bwrap: ..." on
        # stderr, which a program could print too. Only bwrap's two processes ever existed in the run's
        # pids cgroup if the program never started (outer bwrap + namespace init; the program is a third).
        if rc != 1 or not stderr.startswith(b"bwrap: ") or kill_reason is not None:
            return
        peak = cgroups.peak_processes()
        if peak is None or peak <= 2:
            raise SandboxError(
                f"bubblewrap could not start the sandbox: {stderr.decode(errors='replace')[:800]}"
            )

    def _program_rc(self, status, outer_rc, stderr, kill_reason):
        if "exit-code" in status:
            return status["exit-code"]
        if kill_reason is not None:
            return 128 + signal.SIGKILL  # we killed it (timeout / output cap)
        if "child-pid" not in status:
            raise SandboxError(
                f"bubblewrap could not start the sandbox (exit {outer_rc}): {stderr.decode(errors='replace')[-800:]}"
            )
        # bwrap itself died without reporting: the memory cgroup's OOM killer or the CPU limit got it.
        return 128 - outer_rc if outer_rc < 0 else outer_rc


class UnsafeLocalBackend(_BackendBase):
    """NO ISOLATION. Only for machines without bubblewrap, by explicit opt-in."""

    def _command(self, argv, *, host_dir, workdir, cwd, env, status_fd):
        program = list(argv)
        if program[0] in ("python", "python3"):
            program[0] = self.config.python
        run_cwd = str(host_dir / cwd.removeprefix(workdir).lstrip("/")) if cwd else str(host_dir)
        return program, {**self._base_env(str(host_dir)), "TMPDIR": str(host_dir), **env}, run_cwd

    def _program_rc(self, status, outer_rc, stderr, kill_reason):
        if kill_reason is not None and outer_rc < 0:
            return 128 - outer_rc
        return 128 - outer_rc if outer_rc < 0 else outer_rc


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


def _sweep_dead_owners_dirs(root: Path) -> None:
    """Remove the pre-started sandboxes' dirs (and renamed-away work dirs) of processes that died without
    cleaning up (a server stopped by a signal runs no exit handlers; its idle sandboxes died with it)."""
    for pattern in (f"{_PRESTART_PREFIX}*", f".{_PRESTART_PREFIX}*.removed"):
        for path in root.glob(pattern):
            pid = path.name.lstrip(".").removeprefix(_PRESTART_PREFIX).split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
                remove_dir_later(path)


def remove_dir_later(path: Path) -> None:
    """Remove a dir nobody uses any more in the clean-up thread (an rmdir can take milliseconds)."""
    try:
        _CLEANUP.submit(shutil.rmtree, path, True)
    except RuntimeError:  # interpreter shutting down
        shutil.rmtree(path, ignore_errors=True)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _close_all_idle() -> None:
    for backend in list(_BackendBase._shared.values()):
        if isinstance(backend, BubblewrapBackend):
            backend.close_idle()


class _WarmSandbox:
    """A bubblewrap sandbox started ahead: bound to ``bind_dir``, its shim blocked on stdin until
    :meth:`run` sends the program. Dies with this process (``--die-with-parent``, stdin EOF), is killed
    by :meth:`discard` / :meth:`release`, and at exit while idle."""

    atexit_registered = False

    def __init__(
        self,
        backend: BubblewrapBackend,
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
        self.cgroups = _RunCgroups.create(backend.cgroup_roots(), limits, always_memory=True)
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
            pids_by_cgroup=self.cgroups.pids is not None,
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
        try:
            try:
                await asyncio.wait_for(asyncio.shield(everything), limits.wall_time_s)
            except TimeoutError:
                kill("timeout")
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
                shutil.rmtree(bind_dir, ignore_errors=True)

        if sync:
            clean_up()
            return
        try:
            _CLEANUP.submit(clean_up)  # the run's result is ready: nobody waits for this
        except RuntimeError:  # interpreter shutting down
            clean_up()
