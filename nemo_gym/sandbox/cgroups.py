"""Per-run cgroups: the interface every cgroup mode gives, and cgroup v1 (``pids``, ``memory``, ``cpuacct``).

Contract
--------
* :class:`CgroupDriver` is what the backends use (they do not care which mode is behind it): ``mode``
  (``v1``, ``v2``, ``none``) and ``reason`` (why, for the start-up diagnostics), ``roots`` (controller ->
  the parent dir of this process's run cgroups; ``"pids"`` present means the process count is limited),
  ``create(limits)`` -> a :class:`RunCgroup`, and ``remove()`` at exit. :mod:`nemo_gym.sandbox.cgroup_mode`
  picks the mode; :mod:`nemo_gym.sandbox.cgroups_v2` is the v2 driver.
* :class:`RunCgroup` is one run's cgroups: ``apply(limits)`` (again: a pre-started sandbox joins before it
  knows its run's limits), ``procs_files()`` (the launcher writes its pid into each: that is how a run's
  processes join), ``oom_killed()``, ``pids_limit_hit()``, ``peak_processes()``, ``cpu_time_s()``, and
  ``destroy()``: kill every process left until empty, then remove the dirs.
* :class:`CgroupFS` is the only way the cgroup code reaches the kernel (file reads and writes, mkdir,
  rmdir, kill(2)): tests of v2, which this machine lacks, give a fake kernel over a tmp dir.
* v1: :class:`_CgroupRoots` finds this process's own cgroup dirs from /proc/self/cgroup and makes one
  parent dir per controller (``nemo_gym_sandbox_<pid>``) where it may write; it removes the parents of
  dead processes (killed servers) on the way, and its own (killing what is left) at exit. Controllers it
  cannot write to are left out: the backends then fall back to rlimits. :class:`_RunCgroups` is one run's
  v1 cgroups: ``pids.max`` and the memory limit, the tree's CPU time (cpuacct), whether the memory cgroup
  OOM-killed it (``memory.oom_control``), its peak process count, whether the pids limit was hit.
* Failures to make or limit a run's cgroups raise :class:`SandboxError` (an infrastructure failure).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from nemo_gym.sandbox.errors import SandboxError
from nemo_gym.sandbox.spec import SandboxResources

LOG = logging.getLogger("nemo_gym.sandbox")

_RUN_IDS = itertools.count()


class CgroupFS:
    """The kernel as the cgroup code sees it: cgroupfs files, mkdir/rmdir, SIGKILL. One object for real;
    the v2 tests replace it with a fake kernel (this machine has no cgroup v2 to test against)."""

    def read(self, path: Path) -> str:
        return path.read_text()

    def write(self, path: Path, text: str) -> None:
        path.write_text(text)

    def exists(self, path: Path) -> bool:
        return path.exists()

    def mkdir(self, path: Path, exist_ok: bool = False) -> None:
        path.mkdir(exist_ok=exist_ok)

    def rmdir(self, path: Path) -> None:
        path.rmdir()

    def writable(self, path: Path) -> bool:
        return os.access(path, os.W_OK)

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)

    def pid_alive(self, pid: int) -> bool:
        return Path(f"/proc/{pid}").exists()


REAL_FS = CgroupFS()


class RunCgroup(Protocol):
    """One run's cgroups, whatever the mode (v1: a dir per controller; v2: one dir; none: no dir)."""

    memory_limited: bool  # a memory cgroup holds this run's limit (else RLIMIT_AS stands in)

    @property
    def limits_processes(self) -> bool: ...  # a pids cgroup holds the process count (else RLIMIT_NPROC)

    def apply(self, limits: SandboxResources) -> None: ...

    def procs_files(self) -> list[str]: ...

    def cpu_time_s(self) -> float | None: ...

    def oom_killed(self) -> bool: ...

    def oom_kills(self) -> int: ...  # processes the OOM killer killed so far (a session compares counts)

    def peak_processes(self) -> int | None: ...

    def pids_limit_hit(self) -> bool: ...

    def pids_limit_events(self) -> int: ...  # forks the pids limit refused so far

    def memory_bytes(self) -> int | None: ...  # memory the run's processes hold now (None: no memory cgroup)

    def destroy(self, remove: bool = True) -> bool: ...


class CgroupDriver(Protocol):
    """This process's cgroup mode: makes the runs' cgroups; removed at exit."""

    mode: str  # "v1" | "v2" | "none"
    reason: str  # why this mode, in words (the start-up diagnostics say it)

    @property
    def roots(self) -> dict[str, Path]: ...

    def create(self, limits: SandboxResources, always_memory: bool = False) -> RunCgroup: ...

    def remove(self) -> None: ...


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
    """cgroup v1: this process's parent dirs for per-run cgroups, made on first use and removed at exit."""

    mode = "v1"

    def __init__(self) -> None:
        self.roots: dict[str, Path] = {}
        self.reason = ""
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

    def create(self, limits: SandboxResources, always_memory: bool = False) -> _RunCgroups:
        return _RunCgroups.create(self.roots, limits, always_memory=always_memory)

    def remove(self) -> None:
        for root in self.roots.values():
            for child in root.glob("run_*"):
                _kill_and_remove(child)
            with contextlib.suppress(OSError):
                root.rmdir()


def _remove_stale_roots(parent: Path, fs: CgroupFS = REAL_FS) -> None:
    """Remove the per-process cgroup dirs of processes that died without cleaning up (killed servers)."""
    for root in parent.glob("nemo_gym_sandbox_*"):
        pid = root.name.rsplit("_", 1)[1]
        if not pid.isdigit() or fs.pid_alive(int(pid)):
            continue
        for child in root.glob("run_*"):
            _kill_and_remove(child, within=1.0, fs=fs)
        with contextlib.suppress(OSError):
            fs.rmdir(root)


def _pids_in(cgroup: Path, fs: CgroupFS = REAL_FS) -> list[int]:
    try:
        return [int(p) for p in fs.read(cgroup / "cgroup.procs").split()]
    except (OSError, ValueError):
        return []


def _event_count(fs: CgroupFS, path: Path, key: str) -> int:
    """The ``key N`` line's N of a flat-keyed cgroup file (memory.events, pids.events, ...); 0 without it."""
    with contextlib.suppress(OSError, ValueError):
        for line in fs.read(path).splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


def _kill_and_remove(
    cgroup: Path, within: float = 5.0, remove: bool = True, fs: CgroupFS = REAL_FS, kill_file: bool = False
) -> bool:
    """SIGKILL everything in ``cgroup`` until it is empty, then (``remove``) rmdir it. True when it got empty.

    ``kill_file`` (v2, kernel >= 5.14): first write ``cgroup.kill``, which kills the whole subtree at
    once, forks racing the kill included; the pid loop then only waits (and covers older kernels)."""
    deadline = time.monotonic() + within
    if kill_file and fs.exists(cgroup / "cgroup.kill"):
        with contextlib.suppress(OSError):
            fs.write(cgroup / "cgroup.kill", "1")
    while True:
        pids = _pids_in(cgroup, fs)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                fs.kill(pid)
        if time.monotonic() > deadline:
            LOG.error("sandbox cgroup %s still has processes %s after SIGKILL", cgroup, pids)
            return False
        time.sleep(0.005)
    if not remove:
        return True
    for _ in range(200):
        try:
            fs.rmdir(cgroup)
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

    @property
    def limits_processes(self) -> bool:
        return self.pids is not None

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
        return self.oom_kills() > 0

    def oom_kills(self) -> int:
        """How many processes the memory cgroup's OOM killer has killed (a session compares counts)."""
        if self.memory is None:
            return 0
        return _event_count(REAL_FS, self.memory / "memory.oom_control", "oom_kill")

    def memory_bytes(self) -> int | None:
        if self.memory is None:
            return None
        with contextlib.suppress(OSError, ValueError):
            return int((self.memory / "memory.usage_in_bytes").read_text())
        return None

    def peak_processes(self) -> int | None:
        if self.pids is None:
            return None
        try:
            return int((self.pids / "pids.peak").read_text())
        except (OSError, ValueError):
            return None

    def pids_limit_hit(self) -> bool:
        return self.pids_limit_events() > 0

    def pids_limit_events(self) -> int:
        """How many forks the pids limit has refused (a session compares counts before and after)."""
        if self.pids is None:
            return 0
        return _event_count(REAL_FS, self.pids / "pids.events", "max")

    def destroy(self, remove: bool = True) -> bool:
        ok = True
        for d in self._dirs():
            if d is not None:
                ok = _kill_and_remove(d, remove=remove) and ok
        return ok


class _NoCgroups:
    """No usable cgroup: every run's "cgroups" are none, so the launcher sets RLIMIT_AS / RLIMIT_NPROC."""

    mode = "none"

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.roots: dict[str, Path] = {}

    def create(self, limits: SandboxResources, always_memory: bool = False) -> _RunCgroups:
        return _RunCgroups(pids=None, memory=None)

    def remove(self) -> None:
        pass
