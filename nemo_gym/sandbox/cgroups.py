"""Per-run cgroups (v1 ``pids``, ``memory``, ``cpuacct`` hierarchies): limits, accounting, the final kill.

Contract
--------
* :class:`_CgroupRoots` finds this process's own cgroup dirs from /proc/self/cgroup and makes one parent
  dir per controller (``nemo_gym_sandbox_<pid>``) where it may write; it removes the parents of dead
  processes (killed servers) on the way, and its own (killing what is left) at exit. Controllers it
  cannot write to are left out: the backends then fall back to rlimits.
* :class:`_RunCgroups` is one run's cgroups: ``pids.max`` and the memory limit (``apply`` may be called
  again: a pre-started sandbox joins before it knows its run's limits), the tree's CPU time (cpuacct),
  whether the memory cgroup OOM-killed it, its peak process count, whether the pids limit was hit, and
  :meth:`_RunCgroups.destroy`: SIGKILL every pid left until empty, then remove the dirs.
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

from nemo_gym.sandbox.errors import SandboxError
from nemo_gym.sandbox.spec import SandboxResources

LOG = logging.getLogger("nemo_gym.sandbox")

_RUN_IDS = itertools.count()


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
        return self.oom_kills() > 0

    def oom_kills(self) -> int:
        """How many processes the memory cgroup's OOM killer has killed (a session compares counts)."""
        if self.memory is None:
            return 0
        with contextlib.suppress(OSError, ValueError):
            for line in (self.memory / "memory.oom_control").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

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
        with contextlib.suppress(OSError, ValueError):
            for line in (self.pids / "pids.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "max":
                    return int(value)
        return 0

    def destroy(self, remove: bool = True) -> bool:
        ok = True
        for d in self._dirs():
            if d is not None:
                ok = _kill_and_remove(d, remove=remove) and ok
        return ok
