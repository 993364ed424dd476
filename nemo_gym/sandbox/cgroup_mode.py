"""Which cgroup mode the sandbox uses (v1, v2 or none), and why: read from the mount table.

Contract
--------
* :func:`pick_cgroup_mode` decides from the texts of /proc/self/mountinfo and /proc/self/cgroup alone
  (tests pass their own): ``v1`` when the ``memory`` or ``pids`` controller is mounted as a v1 hierarchy
  (v1-only hosts and systemd's "hybrid" layout, whose cgroup2 tree holds no controllers); else ``v2`` when
  a cgroup2 file system is mounted and this process has a ``0::`` cgroup inside it; else ``none``.
* :func:`open_cgroups` makes the driver for that mode (:mod:`nemo_gym.sandbox.cgroups` for v1, exactly as
  before; :mod:`nemo_gym.sandbox.cgroups_v2` for v2). A v2 subtree that cannot be used (controllers not
  delegated, files not writable, no systemd-run scope) gives ``none`` with the reason, which names the file
  and what to do: the backends then fall back to rlimits, and a root-run bubblewrap sandbox refuses to
  start, quoting it. Every driver carries ``mode`` and ``reason`` for the start-up diagnostics.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from nemo_gym.sandbox.cgroups import REAL_FS, CgroupDriver, CgroupFS, _CgroupRoots, _NoCgroups
from nemo_gym.sandbox.cgroups_v2 import CgroupV2Unavailable, open_v2, own_v2_path

_V1_CONTROLLERS = ("pids", "memory", "cpuacct")


@dataclass(frozen=True)
class CgroupChoice:
    mode: str  # "v1" | "v2" | "none"
    reason: str
    v2_mount: Path | None = None  # where the cgroup2 tree is mounted
    v2_mount_root: str = "/"  # which cgroup that mount shows as its top (a container's bind of a subtree)
    own_path: str | None = None  # this process's v2 cgroup path (the ``0::`` entry)


@dataclass(frozen=True)
class _Mount:
    root: str
    point: Path
    fstype: str
    super_options: tuple[str, ...]


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[_Mount]:
    """The cgroup and cgroup2 mounts of a /proc/<pid>/mountinfo text (see proc(5)); other lines skipped."""
    mounts = []
    for line in text.splitlines():
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not sep or len(fields) < 5 or len(tail) < 2 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        options = tuple(tail[2].split(",")) if len(tail) > 2 else ()
        mounts.append(_Mount(_unescape(fields[3]), Path(_unescape(fields[4])), tail[0], options))
    return mounts


def pick_cgroup_mode(mountinfo: str, self_cgroup: str) -> CgroupChoice:
    """v1, v2 or none from the mount table and this process's cgroups (pure: no file is touched)."""
    mounts = parse_mountinfo(mountinfo)
    v1 = {c: m.point for m in mounts if m.fstype == "cgroup" for c in m.super_options if c in _V1_CONTROLLERS}
    v2 = sorted((m for m in mounts if m.fstype == "cgroup2"), key=lambda m: len(m.point.parts))
    if "memory" in v1 or "pids" in v1:
        shown = ", ".join(f"{c} at {p}" for c, p in sorted(v1.items()))
        hybrid = f"; the cgroup2 tree at {v2[0].point} is systemd's hybrid layout, left alone" if v2 else ""
        return CgroupChoice("v1", f"cgroup v1: controllers mounted as v1 hierarchies ({shown}){hybrid}")
    if not mounts and _v1_entries(self_cgroup) & {"memory", "pids"}:
        # No cgroup mount readable, yet /proc/self/cgroup names v1 controllers: the v1 code finds its dirs
        # from that file alone (as it always did).
        return CgroupChoice("v1", "cgroup v1: /proc/self/cgroup lists v1 controllers (no cgroup mount read)")
    if v2:
        mount = v2[0]
        own = own_v2_path(self_cgroup)
        if own is None:
            return CgroupChoice(
                "none", f"cgroup2 is mounted at {mount.point}, but /proc/self/cgroup has no `0::` (v2) entry"
            )
        return CgroupChoice(
            "v2",
            f"cgroup v2 only (cgroup2 at {mount.point}, no v1 memory/pids hierarchy); this process is in {own}",
            v2_mount=mount.point,
            v2_mount_root=mount.root,
            own_path=own,
        )
    return CgroupChoice("none", "no cgroup file system is mounted (neither v1 memory/pids nor cgroup2)")


def _v1_entries(self_cgroup: str) -> set[str]:
    """The controllers named by the v1 entries (``N:ctrl,ctrl:/path``) of a /proc/<pid>/cgroup text."""
    found: set[str] = set()
    for line in self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            found.update(c for c in parts[1].split(",") if c)
    return found


def open_cgroups(
    *,
    mountinfo: str | None = None,
    self_cgroup: str | None = None,
    root: Path | None = None,
    fs: CgroupFS = REAL_FS,
    proc: Path = Path("/proc"),
    systemd_run: str | None = None,
    use_systemd_run: bool = True,
) -> CgroupDriver:
    """This process's cgroup driver, per :func:`pick_cgroup_mode` (texts read from ``proc`` unless given).

    ``root`` replaces the cgroup2 mount point (tests: a fake tree)."""
    if mountinfo is None:
        mountinfo = _read(proc / "self" / "mountinfo")
    if self_cgroup is None:
        self_cgroup = _read(proc / "self" / "cgroup")
    choice = pick_cgroup_mode(mountinfo, self_cgroup)
    if choice.mode == "v1":
        driver = _CgroupRoots()
        writable = ", ".join(sorted(driver.roots)) or "none (RLIMIT_AS / RLIMIT_NPROC stand in)"
        driver.reason = f"{choice.reason}; writable here: {writable}"
        return driver
    if choice.mode == "none" or choice.own_path is None:
        return _NoCgroups(f"{choice.reason}: RLIMIT_AS / RLIMIT_NPROC stand in for memory and processes")
    try:
        return open_v2(
            choice.own_path,
            root=root or choice.v2_mount or Path("/sys/fs/cgroup"),
            mount_root=choice.v2_mount_root,
            fs=fs,
            proc=proc,
            systemd_run=systemd_run,
            use_systemd_run=use_systemd_run,
        )
    except CgroupV2Unavailable as exc:
        return _NoCgroups(
            f"{choice.reason}, but not usable: {exc}. RLIMIT_AS / RLIMIT_NPROC stand in for memory and processes"
        )


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
