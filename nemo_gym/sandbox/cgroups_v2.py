"""Per-run cgroups on cgroup v2 (the unified hierarchy): a delegated subtree, one dir per run.

Contract
--------
* :func:`open_v2` gives the v2 :class:`~nemo_gym.sandbox.cgroups.CgroupDriver` for the cgroup2 tree at
  ``root`` (default /sys/fs/cgroup), or raises :class:`CgroupV2Unavailable` naming the file that stopped
  it and what to do. It uses, in order: this process's own cgroup (``0::/path`` of /proc/self/cgroup)
  when ``memory`` and ``pids`` are delegated to it and it is writable; else, when ``systemd-run`` exists,
  a scope it starts for itself (``systemd-run [--user] --scope -p Delegate=yes``, kept alive by a
  ``tail --pid`` helper that ends with this process).
* Layout, under the delegated cgroup D::

      D/cgroup.subtree_control          +memory +pids
      D/nemo_gym_leaf/                  D's own processes (this server, its siblings), moved here
      D/nemo_gym_sandbox_<pid>/         this process's runs (subtree_control: +memory +pids)
      D/nemo_gym_sandbox_<pid>/run_<n>/ one run: memory.max, memory.swap.max, pids.max

  v2 forbids processes in a (non-root) cgroup that hands controllers to its children ("no internal
  processes"), so when enabling them in D fails with EBUSY every process of D moves into the leaf first.
  A process whose own cgroup is a ``nemo_gym_leaf`` uses that leaf's parent as D (a server started after
  another one already moved the processes).
* A run (:class:`_RunCgroupV2`) reports what v1 reports: OOM kills from ``memory.events`` (``oom_kill``),
  the pids limit from ``pids.events`` (``max``), the peak from ``pids.peak`` (kernel >= 6.1, else None),
  the tree's CPU time from ``cpu.stat`` (``usage_usec``, present without the cpu controller). No
  ``memory.oom.group``: as on v1, the OOM killer takes one process (the biggest), not the whole run.
  ``destroy`` writes ``cgroup.kill`` (kernel >= 5.14), then SIGKILLs any pid left until the dir is empty.
* Dirs of dead processes (``nemo_gym_sandbox_<pid>`` without that pid) are removed on the way, ours at exit.
* Every kernel access goes through a :class:`~nemo_gym.sandbox.cgroups.CgroupFS`: this machine has cgroup
  v1 only, so the tests run this module against a fake kernel over a tmp dir (docs/sandbox.md says so).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from nemo_gym.sandbox.cgroups import (
    _RUN_IDS,
    REAL_FS,
    CgroupFS,
    _event_count,
    _kill_and_remove,
    _pids_in,
    _remove_stale_roots,
)
from nemo_gym.sandbox.errors import SandboxError, SandboxUnavailableError
from nemo_gym.sandbox.spec import SandboxResources

LOG = logging.getLogger("nemo_gym.sandbox")

CGROUP_ROOT = Path("/sys/fs/cgroup")
LEAF = "nemo_gym_leaf"
NEEDED = ("memory", "pids")
_ENABLE = " ".join(f"+{c}" for c in NEEDED)
_SCOPE_WAIT_S = 10.0

DELEGATION_HINT = (
    "start the servers in a cgroup delegated to them: `systemd-run --user --scope -p Delegate=yes ng_run ...` "
    "(as root: `systemd-run --scope -p Delegate=yes ng_run ...`; see docs/sandbox.md, cgroup v2)"
)


class CgroupV2Unavailable(SandboxUnavailableError):
    """The cgroup v2 subtree cannot hold the sandbox's runs (the message names the file and the remedy)."""


def own_v2_path(self_cgroup: str) -> str | None:
    """The ``0::/path`` entry of a /proc/<pid>/cgroup text (the v2 hierarchy), or None."""
    for line in self_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None


def _under(root: Path, cgroup_path: str) -> Path:
    return root / cgroup_path.strip("/") if cgroup_path.strip("/") else root


@dataclass
class _RunCgroupV2:
    """One run's v2 cgroup: a single dir holding the memory and pids limits of the whole tree."""

    dir: Path
    fs: CgroupFS = field(default=REAL_FS, repr=False)
    memory_limited: bool = False

    @property
    def limits_processes(self) -> bool:
        return True

    def apply(self, limits: SandboxResources) -> None:
        """Set the process and memory limits (again: a pre-started sandbox gets its run's limits here)."""
        try:
            self.fs.write(self.dir / "pids.max", str(limits.processes))
            self.fs.write(
                self.dir / "memory.max", "max" if limits.memory_mib is None else str(limits.memory_mib << 20)
            )
            # v1's memsw limit equal to the memory limit means "no swap on top": v2 says it as swap.max 0.
            if self.fs.exists(self.dir / "memory.swap.max"):
                self.fs.write(self.dir / "memory.swap.max", "max" if limits.memory_mib is None else "0")
            self.memory_limited = limits.memory_mib is not None
        except OSError as exc:
            raise SandboxError(f"cannot set the sandbox's cgroup limits in {self.dir}: {exc}") from exc

    def procs_files(self) -> list[str]:
        return [str(self.dir / "cgroup.procs")]

    def cpu_time_s(self) -> float | None:
        if not self.fs.exists(self.dir / "cpu.stat"):
            return None
        return _event_count(self.fs, self.dir / "cpu.stat", "usage_usec") / 1e6

    def oom_killed(self) -> bool:
        return self.oom_kills() > 0

    def oom_kills(self) -> int:
        return _event_count(self.fs, self.dir / "memory.events", "oom_kill")

    def memory_bytes(self) -> int | None:
        try:
            return int(self.fs.read(self.dir / "memory.current"))
        except (OSError, ValueError):
            return None

    def peak_processes(self) -> int | None:
        try:
            return int(self.fs.read(self.dir / "pids.peak"))
        except (OSError, ValueError):
            return None

    def pids_limit_hit(self) -> bool:
        return self.pids_limit_events() > 0

    def pids_limit_events(self) -> int:
        return _event_count(self.fs, self.dir / "pids.events", "max")

    def destroy(self, remove: bool = True) -> bool:
        return _kill_and_remove(self.dir, remove=remove, fs=self.fs, kill_file=True)


class _V2Cgroups:
    """cgroup v2: this process's runs under ``D/nemo_gym_sandbox_<pid>`` in the delegated cgroup D."""

    mode = "v2"

    def __init__(
        self,
        delegated: Path,
        *,
        fs: CgroupFS = REAL_FS,
        how: str = "",
        helper: subprocess.Popen | None = None,
    ) -> None:
        self.fs = fs
        self.delegated = delegated
        self.helper: subprocess.Popen | None = helper
        moved = _delegate(fs, delegated)
        _remove_stale_roots(delegated, fs)
        self.parent = delegated / f"nemo_gym_sandbox_{os.getpid()}"
        _make_parent(fs, self.parent)
        self.roots = {c: self.parent for c in NEEDED}
        self.reason = (
            f"cgroup v2: runs in {self.parent}/run_*, with memory.max, pids.max and memory.events; "
            f"delegated cgroup {delegated} ({how})"
            + (f"; moved {moved} process(es) of it into {delegated / LEAF}" if moved else "")
        )
        atexit.register(self.remove)

    def create(self, limits: SandboxResources, always_memory: bool = False) -> _RunCgroupV2:
        """A fresh cgroup for one run (v2 has one dir for every controller: memory is always there)."""
        made = _RunCgroupV2(self.parent / f"run_{next(_RUN_IDS)}", self.fs)
        try:
            self.fs.mkdir(made.dir)
        except OSError as exc:
            raise SandboxError(f"cannot set up the sandbox's cgroups: {exc}") from exc
        try:
            made.apply(limits)
        except SandboxError as exc:
            made.destroy()
            raise SandboxError(f"cannot set up the sandbox's cgroups: {exc}") from exc
        return made

    def remove(self) -> None:
        for child in self.parent.glob("run_*"):
            _kill_and_remove(child, fs=self.fs, kill_file=True)
        with contextlib.suppress(OSError):
            self.fs.rmdir(self.parent)
        if self.helper is not None and self.helper.poll() is None:
            self.helper.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.helper.wait(5)


def _delegate(fs: CgroupFS, d: Path) -> int:
    """Enable memory and pids for D's children, first moving D's own processes into D/nemo_gym_leaf when
    the kernel refuses (EBUSY: no internal processes). Returns how many processes moved."""
    controllers = d / "cgroup.controllers"
    try:
        available = set(fs.read(controllers).split())
    except OSError as exc:
        raise CgroupV2Unavailable(
            f"{controllers} cannot be read ({exc}): {d} is not a cgroup v2 dir"
        ) from exc
    missing = [c for c in NEEDED if c not in available]
    if missing:
        raise CgroupV2Unavailable(
            f"the cgroup v2 controller(s) {', '.join(missing)} are not delegated to {d}: {controllers} lists "
            f"{' '.join(sorted(available)) or 'nothing'}; {DELEGATION_HINT}"
        )
    for path in (d, d / "cgroup.subtree_control", d / "cgroup.procs"):
        if not fs.writable(path):
            raise CgroupV2Unavailable(
                f"{path} is not writable by this process (uid {os.geteuid()}): {d} is not delegated to it; "
                f"{DELEGATION_HINT}"
            )
    subtree = d / "cgroup.subtree_control"
    moved: set[int] = set()
    for _ in range(50):  # processes forked into D by a process not yet moved: a few rounds at most
        with contextlib.suppress(OSError):
            if set(NEEDED) <= set(fs.read(subtree).split()):
                return len(moved)
        try:
            fs.write(subtree, _ENABLE)
            return len(moved)
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise CgroupV2Unavailable(
                    f"cannot enable {_ENABLE} in {subtree}: {exc}; {DELEGATION_HINT}"
                ) from exc
        leaf = d / LEAF
        try:
            fs.mkdir(leaf, exist_ok=True)
        except OSError as exc:
            raise CgroupV2Unavailable(f"cannot make {leaf} (for the processes of {d}): {exc}") from exc
        for pid in _pids_in(d, fs):
            try:
                fs.write(leaf / "cgroup.procs", str(pid))
                moved.add(pid)
            except ProcessLookupError:
                continue  # exited meanwhile
            except OSError as exc:
                raise CgroupV2Unavailable(
                    f"cannot move process {pid} of {d} into {leaf / 'cgroup.procs'} (cgroup v2 allows no "
                    f"processes in a cgroup that hands controllers to its children): {exc}; {DELEGATION_HINT}"
                ) from exc
        time.sleep(0.01)
    raise CgroupV2Unavailable(f"{subtree}: still busy after moving {d}'s processes into {d / LEAF}")


def _make_parent(fs: CgroupFS, parent: Path) -> None:
    """This process's dir for its runs, with memory and pids for the runs; a probe run dir proves it."""
    try:
        fs.mkdir(parent, exist_ok=True)
        fs.write(parent / "cgroup.subtree_control", _ENABLE)
        probe = parent / "probe"
        fs.mkdir(probe, exist_ok=True)
        try:
            absent = [f for f in ("memory.max", "pids.max") if not fs.exists(probe / f)]
        finally:
            fs.rmdir(probe)
    except OSError as exc:
        raise CgroupV2Unavailable(
            f"cannot set up {parent} for the sandbox's runs: {exc}; {DELEGATION_HINT}"
        ) from exc
    if absent:
        raise CgroupV2Unavailable(
            f"a run cgroup under {parent} lacks {', '.join(absent)} although {parent / 'cgroup.subtree_control'} "
            f"enabled {_ENABLE}; {DELEGATION_HINT}"
        )


def _common_ancestor(a: Path, b: Path) -> Path:
    parts = []
    for x, y in zip(a.parts, b.parts, strict=False):
        if x != y:
            break
        parts.append(x)
    return Path(*parts)


def _systemd_scope(
    systemd_run: str, root: Path, proc: Path, mount_root: str, own: Path, fs: CgroupFS
) -> tuple[Path, subprocess.Popen]:
    """Start a delegated scope whose only process is a helper that lives as long as this process; its cgroup.

    A process can move a pid between two cgroups only if it may write the ``cgroup.procs`` of their common
    ancestor: checked here, since the launcher (in this process's cgroup) joins runs in the scope."""
    unit = f"nemo-gym-sandbox-{os.getpid()}-{secrets.token_hex(3)}"
    argv = [
        systemd_run,
        *([] if os.geteuid() == 0 else ["--user"]),
        "--scope",
        "-p",
        "Delegate=yes",
        "--quiet",
        "--collect",
        f"--unit={unit}",
        "--",
        "tail",
        f"--pid={os.getpid()}",
        "-f",
        "/dev/null",
    ]
    shown = " ".join(argv[:5])
    try:
        helper = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        raise CgroupV2Unavailable(f"`{shown}` cannot start: {exc}") from exc
    deadline = time.monotonic() + _SCOPE_WAIT_S
    try:
        while True:
            with contextlib.suppress(OSError):
                path = own_v2_path((proc / str(helper.pid) / "cgroup").read_text())
                if path is not None and path.endswith(f"/{unit}.scope"):
                    break
            if helper.poll() is not None:
                err = helper.stderr.read().decode(errors="replace").strip() if helper.stderr else ""
                raise CgroupV2Unavailable(f"`{shown}` failed (exit {helper.returncode}): {err[-300:]}")
            if time.monotonic() > deadline:
                raise CgroupV2Unavailable(
                    f"`{shown}` did not put its process in a scope within {_SCOPE_WAIT_S:.0f} s"
                )
            time.sleep(0.02)
        scope = _under(root, _relative(path, mount_root))
        ancestor = _common_ancestor(own, scope)
        if not fs.writable(ancestor / "cgroup.procs"):
            raise CgroupV2Unavailable(
                f"systemd-run made {scope}, but this process (in {own}) cannot move processes into it: "
                f"{ancestor / 'cgroup.procs'} (their common ancestor) is not writable; {DELEGATION_HINT}"
            )
    except BaseException:
        helper.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            helper.wait(5)
        raise
    if helper.stderr is not None:
        helper.stderr.close()
    return scope, helper


def _relative(cgroup_path: str, mount_root: str) -> str:
    """A /proc/<pid>/cgroup path as seen under a cgroup2 mount whose root is ``mount_root`` (a container's
    bind of a subtree; "/" for the whole tree or a cgroup namespace's own)."""
    if mount_root in ("", "/"):
        return cgroup_path
    if cgroup_path == mount_root or cgroup_path.startswith(mount_root.rstrip("/") + "/"):
        return cgroup_path[len(mount_root.rstrip("/")) :] or "/"
    raise CgroupV2Unavailable(
        f"this process's cgroup {cgroup_path} is outside the mounted cgroup2 tree (its root is {mount_root})"
    )


def open_v2(
    own_path: str,
    *,
    root: Path = CGROUP_ROOT,
    mount_root: str = "/",
    fs: CgroupFS = REAL_FS,
    proc: Path = Path("/proc"),
    systemd_run: str | None = None,
    use_systemd_run: bool = True,
) -> _V2Cgroups:
    """The v2 driver: this process's own cgroup if delegated to it, else a systemd-run scope, else raise.

    ``own_path`` is this process's ``0::`` path; ``systemd_run`` the binary (default: found on PATH)."""
    own = _under(root, _relative(own_path, mount_root))
    delegated = own.parent if own.name == LEAF else own
    try:
        return _V2Cgroups(delegated, fs=fs, how=f"this process's own cgroup, from {proc / 'self' / 'cgroup'}")
    except CgroupV2Unavailable as own_failure:
        binary = systemd_run or shutil.which("systemd-run")
        if not use_systemd_run or binary is None:
            raise
        try:
            scope, helper = _systemd_scope(binary, root, proc, mount_root, own, fs)
        except CgroupV2Unavailable as scope_failure:
            raise CgroupV2Unavailable(
                f"{own_failure}. A scope of its own failed too: {scope_failure}"
            ) from None
        try:
            return _V2Cgroups(
                scope, fs=fs, how=f"a scope started by `{binary} --scope -p Delegate=yes`", helper=helper
            )
        except CgroupV2Unavailable as scope_failure:
            helper.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                helper.wait(5)
            raise CgroupV2Unavailable(
                f"{own_failure}. The scope {scope} of its own is not usable either: {scope_failure}"
            ) from None
