"""The sandbox's cgroup v2 path, against a fake kernel over a tmp dir, and the choice of cgroup mode.

This machine has memory and pids on cgroup v1 only (its cgroup2 tree holds only hugetlb), so nothing
here touches a real cgroup2 tree: :class:`FakeKernel` is a
small cgroupfs with the rules the v2 code must respect (interface files appear in a new dir per the
parent's ``cgroup.subtree_control``; a non-root cgroup holding processes cannot enable controllers for
its children and one handing controllers down cannot take processes (EBUSY); a controller must be in
``cgroup.controllers`` to be enabled; ``cgroup.kill`` kills the subtree; rmdir of a populated cgroup is
EBUSY; a read-only file is EACCES). Processes are pids listed in ``cgroup.procs`` files (no real process
is signalled); the tests play the kernel's part for OOM kills and the pids limit. The v1 path runs for
real in test_sandbox.py, test_sandbox_prestart.py and test_sandbox_escape.py.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import signal
from pathlib import Path

import pytest

from nemo_gym.sandbox import (
    SandboxProviderConfig,
    SandboxUnavailableError,
    backend_base,
    bwrap,
    run_in_sandbox,
    workers,
)
from nemo_gym.sandbox.cgroup_mode import open_cgroups, pick_cgroup_mode
from nemo_gym.sandbox.cgroups import CgroupFS, _RunCgroups
from nemo_gym.sandbox.cgroups_v2 import LEAF, CgroupV2Unavailable, _RunCgroupV2, _V2Cgroups, open_v2
from nemo_gym.sandbox.spec import SandboxResources

SCOPE = "/user.slice/user-1000.slice/user@1000.service/app.slice/ng.scope"
ALL_CONTROLLERS = "cpuset cpu io memory hugetlb pids rdma misc"

# /proc/self/mountinfo of the three kinds of host (trimmed to the cgroup lines and one other).
V1_ONLY = """\
22 1 0:21 / / rw,relatime - overlay overlay rw,lowerdir=/l
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
"""
HYBRID = """\
22 1 0:21 / / rw,relatime - ext4 /dev/sda1 rw
25 24 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
27 25 0:24 / /sys/fs/cgroup/systemd rw,nosuid shared:11 - cgroup cgroup rw,xattr,name=systemd
30 25 0:27 / /sys/fs/cgroup/memory rw,nosuid shared:14 - cgroup cgroup rw,memory
34 25 0:31 / /sys/fs/cgroup/pids rw,nosuid shared:18 - cgroup cgroup rw,pids
"""
UNIFIED = """\
22 1 0:21 / / rw,relatime - ext4 /dev/sda1 rw
30 24 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
"""
NO_CGROUPS = "22 1 0:21 / / rw,relatime - ext4 /dev/sda1 rw\n"
V1_SELF = "4:memory:/a\n9:pids:/a\n0::/\n"
V2_SELF = f"0::{SCOPE}\n"


class FakeKernel(CgroupFS):
    """cgroupfs over a tmp dir, with the v2 rules the sandbox's v2 code depends on."""

    def __init__(self, root: Path, *, swap: bool = True, peak: bool = True, kill_file: bool = True) -> None:
        self.root = root
        self.swap, self.peak, self.kill_file = swap, peak, kill_file
        self.read_only: set[Path] = set()
        self.killed: list[int] = []
        self.writes: list[tuple[Path, str]] = []
        root.mkdir(parents=True, exist_ok=True)
        self._interface(root, ALL_CONTROLLERS)

    # -- the test's side: make a tree, run processes, be the OOM killer ---------------------------

    def make(self, path: str, controllers: str = "memory pids", procs: tuple[int, ...] = ()) -> Path:
        """A cgroup at ``path`` (as /proc/self/cgroup names it) whose parent hands it ``controllers``."""
        d = self.root / path.strip("/")
        d.parent.mkdir(parents=True, exist_ok=True)
        d.mkdir()
        self._interface(d, controllers)
        (d / "cgroup.procs").write_text("".join(f"{p}\n" for p in procs))
        return d

    def join(self, cgroup: Path, pid: int) -> None:
        """What the launcher's ``echo $$ > cgroup.procs`` does (a pid new to the tree: forked in there)."""
        if self._where(pid) is None:
            self._set_procs(cgroup, [*self._procs(cgroup), pid])
        else:
            self.write(cgroup / "cgroup.procs", str(pid))

    def oom_kill(self, cgroup: Path) -> None:
        """The memory controller's OOM killer took a process of ``cgroup``."""
        self._bump(cgroup / "memory.events", "oom_kill")
        self._bump(cgroup / "memory.events", "oom")
        pids = self._procs(cgroup)
        if pids:
            self.kill(pids[-1])

    def fork_bomb(self, cgroup: Path) -> None:
        """A fork failed at pids.max."""
        self._bump(cgroup / "pids.events", "max")

    def procs(self, cgroup: Path) -> list[int]:
        return self._procs(cgroup)

    # -- CgroupFS ---------------------------------------------------------------------------------

    def read(self, path: Path) -> str:
        return path.read_text()

    def write(self, path: Path, text: str) -> None:
        self.writes.append((path, text))
        if path in self.read_only:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        if not path.is_file():
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
        cgroup, name = path.parent, path.name
        if name == "cgroup.subtree_control":
            available = set(self.read(cgroup / "cgroup.controllers").split())
            enabled = set(self.read(path).split())
            for word in text.split():
                if word[1:] not in available:
                    raise OSError(errno.ENOENT, "No such file or directory", str(path))
                if word[0] == "+" and cgroup != self.root and self._procs(cgroup):
                    raise OSError(errno.EBUSY, "Device or resource busy", str(path))
                enabled = enabled | {word[1:]} if word[0] == "+" else enabled - {word[1:]}
            path.write_text(" ".join(sorted(enabled)) + "\n")
        elif name == "cgroup.procs":
            pid = int(text)
            source = self._where(pid)
            if source is None:
                raise ProcessLookupError(errno.ESRCH, "No such process")
            if cgroup != self.root and self.read(cgroup / "cgroup.subtree_control").split():
                raise OSError(errno.EBUSY, "Device or resource busy", str(path))
            self._set_procs(source, [p for p in self._procs(source) if p != pid])
            self._set_procs(cgroup, [*self._procs(cgroup), pid])
        elif name == "cgroup.kill":
            for d in [cgroup, *(p for p in cgroup.rglob("*") if p.is_dir())]:
                for pid in self._procs(d):
                    self.kill(pid)
        else:
            path.write_text(text)

    def exists(self, path: Path) -> bool:
        return path.exists()

    def mkdir(self, path: Path, exist_ok: bool = False) -> None:
        if path.is_dir():
            if exist_ok:
                return
            raise FileExistsError(errno.EEXIST, "File exists", str(path))
        if path.parent in self.read_only:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        path.mkdir()
        self._interface(path, self.read(path.parent / "cgroup.subtree_control"))

    def rmdir(self, path: Path) -> None:
        if not path.is_dir():
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
        if self._procs(path) or any(p.is_dir() for p in path.iterdir()):
            raise OSError(errno.EBUSY, "Device or resource busy", str(path))
        shutil.rmtree(path)

    def writable(self, path: Path) -> bool:
        return path not in self.read_only

    def kill(self, pid: int) -> None:
        where = self._where(pid)
        if where is None:
            raise ProcessLookupError(errno.ESRCH, "No such process")
        self.killed.append(pid)
        self._set_procs(where, [p for p in self._procs(where) if p != pid])

    def pid_alive(self, pid: int) -> bool:
        return self._where(pid) is not None

    # -- the kernel's own bookkeeping -------------------------------------------------------------

    def _interface(self, d: Path, controllers: str) -> None:
        files = {
            "cgroup.controllers": " ".join(sorted(controllers.split())) + "\n",
            "cgroup.subtree_control": "\n",
            "cgroup.procs": "",
            "cgroup.events": "populated 0\nfrozen 0\n",
            "cpu.stat": "usage_usec 0\nuser_usec 0\nsystem_usec 0\n",
        }
        if self.kill_file:
            files["cgroup.kill"] = ""
        if "memory" in controllers.split():
            files |= {"memory.max": "max\n", "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n"}
            if self.swap:
                files["memory.swap.max"] = "max\n"
        if "pids" in controllers.split():
            files |= {"pids.max": "max\n", "pids.events": "max 0\n", "pids.current": "0\n"}
            if self.peak:
                files["pids.peak"] = "0\n"
        for name, text in files.items():
            (d / name).write_text(text)

    def _procs(self, d: Path) -> list[int]:
        try:
            return [int(p) for p in (d / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def _set_procs(self, d: Path, pids: list[int]) -> None:
        (d / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
        if (d / "pids.peak").exists():
            (d / "pids.peak").write_text(f"{max(int((d / 'pids.peak').read_text()), len(pids))}\n")

    def _where(self, pid: int) -> Path | None:
        for procs in self.root.rglob("cgroup.procs"):
            if pid in self._procs(procs.parent):
                return procs.parent
        return None

    def _bump(self, path: Path, key: str) -> None:
        lines = [line.split() for line in path.read_text().splitlines()]
        path.write_text("".join(f"{k} {int(v) + (k == key)}\n" for k, v in lines))


@pytest.fixture
def kernel(tmp_path: Path) -> FakeKernel:
    return FakeKernel(tmp_path / "cgroup")


def _v2(kernel: FakeKernel, self_cgroup: str = V2_SELF, **kw) -> object:
    return open_cgroups(
        mountinfo=UNIFIED, self_cgroup=self_cgroup, root=kernel.root, fs=kernel, use_systemd_run=False, **kw
    )


def _close(driver: object) -> None:
    if isinstance(driver, _V2Cgroups):
        driver.remove()


ME = os.getpid()
SIBLING = 4_000_001  # another process of the same delegated cgroup (ng_run, another server)


# -- the choice of mode ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mountinfo", "self_cgroup", "mode", "says"),
    [
        (V1_ONLY, V1_SELF, "v1", "memory at /sys/fs/cgroup/memory"),
        (HYBRID, V1_SELF, "v1", "hybrid layout"),
        (UNIFIED, V2_SELF, "v2", f"this process is in {SCOPE}"),
        (UNIFIED, "", "none", "no `0::` (v2) entry"),
        (NO_CGROUPS, "", "none", "no cgroup file system is mounted"),
        ("", V1_SELF, "v1", "no cgroup mount read"),  # mountinfo unreadable: v1 as before
    ],
    ids=["v1-only", "hybrid", "v2-only", "v2-without-own-cgroup", "no-cgroups", "no-mount-table"],
)
def test_the_mode_is_read_from_the_mount_table(
    mountinfo: str, self_cgroup: str, mode: str, says: str
) -> None:
    choice = pick_cgroup_mode(mountinfo, self_cgroup)
    assert choice.mode == mode and says in choice.reason, choice


def test_a_containers_cgroup2_bind_is_read_relative_to_its_root() -> None:
    mountinfo = "30 24 0:26 /docker/abc /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw\n"
    choice = pick_cgroup_mode(mountinfo, "0::/docker/abc/inner\n")
    assert (choice.mode, choice.v2_mount_root, choice.own_path) == ("v2", "/docker/abc", "/docker/abc/inner")


def test_this_machine_is_v1_and_stays_on_the_v1_code() -> None:
    """The machine these tests run on: memory and pids on v1, so the sandbox's real runs take the v1 path."""
    choice = pick_cgroup_mode(Path("/proc/self/mountinfo").read_text(), Path("/proc/self/cgroup").read_text())
    assert choice.mode == "v1", choice


def test_the_start_up_log_says_which_mode_and_why(
    kernel: FakeKernel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    kernel.make(SCOPE, procs=(ME,))
    driver = _v2(kernel)
    monkeypatch.setattr(backend_base._BackendBase, "_cgroup_roots", None)
    monkeypatch.setattr(backend_base, "open_cgroups", lambda: driver)
    with caplog.at_level(logging.INFO, logger="nemo_gym.sandbox"):
        assert backend_base._BackendBase.cgroup_driver() is driver
    _close(driver)
    assert (
        f"sandbox: cgroup mode v2: cgroup v2: runs in {kernel.root}{SCOPE}/nemo_gym_sandbox_{ME}"
        in caplog.text
    )


# -- set-up: the delegated subtree -----------------------------------------------------------------


def test_setup_moves_the_delegated_cgroups_processes_into_a_leaf_then_enables_memory_and_pids(
    kernel: FakeKernel,
) -> None:
    d = kernel.make(SCOPE, procs=(ME, SIBLING))
    driver = _v2(kernel)
    try:
        assert driver.mode == "v2" and isinstance(driver, _V2Cgroups)
        assert kernel.procs(d) == [] and kernel.procs(d / LEAF) == [ME, SIBLING]
        assert (d / "cgroup.subtree_control").read_text().split() == ["memory", "pids"]
        parent = d / f"nemo_gym_sandbox_{ME}"
        assert (parent / "cgroup.subtree_control").read_text().split() == ["memory", "pids"]
        assert driver.roots == {"memory": parent, "pids": parent}
        assert "moved 2 process(es)" in driver.reason and str(d) in driver.reason
        # A server started later (forked by a process now in the leaf) finds itself in the leaf: it uses
        # the same delegated cgroup, not the leaf (which holds processes, so cannot hand controllers down).
        again = open_v2(f"{SCOPE}/{LEAF}", root=kernel.root, fs=kernel, use_systemd_run=False)
        assert again.delegated == d and again.parent == parent
    finally:
        _close(driver)
    assert not (d / f"nemo_gym_sandbox_{ME}").exists() and kernel.procs(d / LEAF) == [ME, SIBLING]


def test_an_already_delegated_empty_cgroup_is_used_as_it_is(kernel: FakeKernel) -> None:
    d = kernel.make(SCOPE)
    (d / "cgroup.subtree_control").write_text("memory pids\n")
    driver = _v2(kernel)
    try:
        assert driver.mode == "v2" and not (d / LEAF).exists() and "moved" not in driver.reason
    finally:
        _close(driver)


def test_dirs_of_dead_processes_are_removed_and_their_leftovers_killed(kernel: FakeKernel) -> None:
    d = kernel.make(SCOPE)  # as a server killed earlier left it: processes in the leaf, its dir behind
    (d / "cgroup.subtree_control").write_text("memory pids\n")
    kernel.make(f"{SCOPE}/{LEAF}", procs=(ME,))
    dead = d / "nemo_gym_sandbox_3999999"
    kernel.mkdir(dead)
    kernel.write(dead / "cgroup.subtree_control", "+memory +pids")
    kernel.mkdir(dead / "run_7")
    kernel.join(dead / "run_7", 3999998)  # a daemon the dead server's run left
    driver = _v2(kernel, self_cgroup=f"0::{SCOPE}/{LEAF}\n")
    try:
        assert not dead.exists() and kernel.killed == [3999998]
    finally:
        _close(driver)


# -- a run: limits, joining, OOM, pids, CPU, the end ------------------------------------------------


def test_a_run_gets_memory_max_pids_max_no_swap_and_reports_oom_kills(kernel: FakeKernel) -> None:
    kernel.make(SCOPE, procs=(ME,))
    driver = _v2(kernel)
    try:
        run = driver.create(SandboxResources(memory_mib=100, processes=20))
        assert isinstance(run, _RunCgroupV2) and run.memory_limited and run.limits_processes
        assert (run.dir / "memory.max").read_text() == str(100 << 20)
        assert (run.dir / "memory.swap.max").read_text() == "0"
        assert (run.dir / "pids.max").read_text() == "20"
        assert run.procs_files() == [str(run.dir / "cgroup.procs")]
        kernel.join(run.dir, 5_000_001)  # bwrap
        kernel.join(run.dir, 5_000_002)  # the program
        assert not run.oom_killed() and not run.pids_limit_hit() and run.peak_processes() == 2
        kernel.oom_kill(run.dir)
        kernel.fork_bomb(run.dir)
        (run.dir / "cpu.stat").write_text("usage_usec 1250000\nuser_usec 1000000\nsystem_usec 250000\n")
        assert run.oom_killed() and run.pids_limit_hit() and run.cpu_time_s() == 1.25
        assert run.destroy()
        assert kernel.killed == [5_000_002, 5_000_001] and not run.dir.exists()
        assert (run.dir / "cgroup.kill", "1") in kernel.writes  # the subtree at once, then the pid sweep
    finally:
        _close(driver)


def test_a_prestarted_run_joins_unlimited_then_gets_its_limits(kernel: FakeKernel) -> None:
    kernel.make(SCOPE, procs=(ME,))
    driver = _v2(kernel)
    try:
        run = driver.create(SandboxResources(memory_mib=None), always_memory=True)
        assert not run.memory_limited and (run.dir / "memory.max").read_text() == "max"
        assert (run.dir / "memory.swap.max").read_text() == "max"
        run.apply(SandboxResources(memory_mib=64, processes=8))
        assert run.memory_limited and (run.dir / "memory.max").read_text() == str(64 << 20)
        run.destroy()
    finally:
        _close(driver)


def test_without_cgroup_kill_swap_or_peak_the_pid_sweep_and_none_stand_in(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path / "cgroup", swap=False, peak=False, kill_file=False)  # an older kernel
    kernel.make(SCOPE, procs=(ME,))
    driver = _v2(kernel)
    try:
        run = driver.create(SandboxResources(memory_mib=10))
        assert not (run.dir / "memory.swap.max").exists() and run.peak_processes() is None
        kernel.join(run.dir, 5_000_003)
        assert run.destroy() and kernel.killed == [5_000_003] and not run.dir.exists()
    finally:
        _close(driver)


def test_at_exit_every_run_left_is_killed_and_removed(kernel: FakeKernel) -> None:
    d = kernel.make(SCOPE, procs=(ME,))
    driver = _v2(kernel)
    run = driver.create(SandboxResources())
    kernel.join(run.dir, 5_000_004)
    driver.remove()
    assert kernel.killed == [5_000_004] and not (d / f"nemo_gym_sandbox_{ME}").exists()


@pytest.mark.parametrize("prestart", [False, True], ids=["started-at-the-run", "prestarted"])
async def test_a_real_sandboxed_run_goes_through_the_v2_driver_unchanged(
    kernel: FakeKernel, monkeypatch: pytest.MonkeyPatch, prestart: bool
) -> None:
    """The backends only see the interface: a real bwrap run (and a pre-started one) joins the run's
    cgroup through ``procs_files`` (here a file of the fake tree: no real limit applies), reads its CPU
    time from ``cpu.stat`` and has it killed and removed through the v2 handle."""
    d = kernel.make(SCOPE, procs=(ME,))
    driver = _v2(kernel)
    monkeypatch.setattr(backend_base._BackendBase, "_cgroup_roots", driver)
    provider = {"prestart": prestart, "queue_timeout_s": 599}  # a backend of its own: no idle v1 sandbox
    backend = bwrap.BubblewrapBackend.shared(SandboxProviderConfig.model_validate(provider))
    try:
        for _ in range(2):  # with prestart, the second run takes the sandbox started during the first
            result = await run_in_sandbox(["python3", "-c", "print(6 * 7)"], provider=provider)
            assert result.ok and result.stdout == "42\n", result
            assert result.cpu_time_s == 0.0  # the fake cpu.stat's, not a v1 cpuacct count
            await asyncio.to_thread(workers._STARTER.submit(lambda: None).result, 30)
            await asyncio.to_thread(workers._CLEANUP.submit(lambda: None).result, 30)
            idle = backend._idle_list()
            assert len(idle) == int(prestart) and all(isinstance(w.cgroups, _RunCgroupV2) for w in idle)
        assert len(kernel.killed) >= 2  # each run's launcher wrote its pid into its run's cgroup.procs
    finally:
        backend.close_idle()
        await asyncio.to_thread(workers._CLEANUP.submit(lambda: None).result, 30)
        _close(driver)
    assert not (d / f"nemo_gym_sandbox_{ME}").exists()


# -- the same results as v1 on the same probes -----------------------------------------------------


def _v1_run(tmp_path: Path, *, oom: bool, pids_hit: bool, peak: int, cpu_ns: int) -> _RunCgroups:
    """v1 run cgroups as the v1 kernel leaves them after a probe (plain files: v1 reads them directly)."""
    dirs = {c: tmp_path / "v1" / c for c in ("pids", "memory", "cpuacct")}
    for d in dirs.values():
        d.mkdir(parents=True)
    (dirs["memory"] / "memory.oom_control").write_text(
        f"oom_kill_disable 0\nunder_oom 0\noom_kill {int(oom)}\n"
    )
    (dirs["pids"] / "pids.events").write_text(f"max {int(pids_hit)}\n")
    (dirs["pids"] / "pids.peak").write_text(f"{peak}\n")
    (dirs["cpuacct"] / "cpuacct.usage").write_text(f"{cpu_ns}\n")
    return _RunCgroups(pids=dirs["pids"], memory=dirs["memory"], cpuacct=dirs["cpuacct"], memory_limited=True)


# (probe, bwrap's status, outer exit code, stderr, oom, pids limit hit, peak processes, CPU ns)
PROBES = [
    ("memory hog", {"child-pid": 3}, -signal.SIGKILL, b"", True, False, 3, 400_000_000),
    ("fork bomb", {"child-pid": 3, "exit-code": 1}, 1, b"BlockingIOError", False, True, 20, 900_000_000),
    (
        "busy loop",
        {"child-pid": 3, "exit-code": 128 + signal.SIGXCPU},
        0,
        b"",
        False,
        False,
        3,
        1_100_000_000,
    ),
    ("clean exit", {"child-pid": 3, "exit-code": 0}, 0, b"", False, False, 3, 50_000_000),
    (
        "bwrap set-up error",
        {"child-pid": 3, "exit-code": 1},
        1,
        b"bwrap: Can't find /x",
        False,
        False,
        2,
        10**6,
    ),
    ("program prints bwrap:", {"child-pid": 3, "exit-code": 1}, 1, b"bwrap: mine", False, False, 3, 10**6),
]


@pytest.mark.parametrize("probe", PROBES, ids=[p[0] for p in PROBES])
def test_v2_gives_the_same_result_as_v1_on_the_same_probe(
    probe: tuple, kernel: FakeKernel, tmp_path: Path
) -> None:
    name, status, outer_rc, stderr, oom, pids_hit, peak, cpu_ns = probe
    backend = bwrap.BubblewrapBackend(SandboxProviderConfig())
    kernel.make(SCOPE, procs=(ME,))
    driver = _v2(kernel)
    run = driver.create(SandboxResources(memory_mib=100, processes=20))
    for pid in range(peak):
        kernel.join(run.dir, 6_000_000 + pid)
    if oom:
        kernel.oom_kill(run.dir)
    if pids_hit:
        kernel.fork_bomb(run.dir)
    (run.dir / "cpu.stat").write_text(f"usage_usec {cpu_ns // 1000}\n")

    def result(cgroups: object) -> object:
        try:
            return backend._result(
                status=status,
                outer_rc=outer_rc,
                stdout=b"",
                stderr=stderr,
                out_trunc=False,
                err_trunc=False,
                kill_reason=None,
                cgroups=cgroups,
                limits_cpu=1,
            )
        except Exception as exc:  # the set-up failure: an infrastructure error on both
            return (type(exc), str(exc))

    try:
        v1 = result(_v1_run(tmp_path, oom=oom, pids_hit=pids_hit, peak=peak, cpu_ns=cpu_ns))
        v2 = result(run)
    finally:
        run.destroy()
        _close(driver)
    assert v2 == v1, name
    if name == "memory hog":
        assert v2.oom_killed and v2.error_type == "oom" and v2.return_code == 137
    if name == "fork bomb":
        assert v2.pids_limit_hit


# -- refusals: a clear reason naming the file and what to do ---------------------------------------


def test_controllers_not_delegated_give_no_cgroups_naming_the_file_and_systemd_run(
    kernel: FakeKernel,
) -> None:
    d = kernel.make(SCOPE, controllers="cpu io", procs=(ME,))
    driver = _v2(kernel)
    assert driver.mode == "none" and driver.roots == {}
    assert f"{d}/cgroup.controllers lists cpu io" in driver.reason
    assert "systemd-run --user --scope -p Delegate=yes" in driver.reason
    assert kernel.procs(d) == [ME]  # nothing moved, nothing made
    run = driver.create(SandboxResources(memory_mib=10))
    assert run.procs_files() == [] and not run.limits_processes and not run.memory_limited  # rlimits


@pytest.mark.parametrize("name", ["cgroup.subtree_control", "cgroup.procs", ""])
def test_a_cgroup_not_writable_is_refused_naming_the_file(kernel: FakeKernel, name: str) -> None:
    d = kernel.make(SCOPE, procs=(ME,))
    kernel.read_only.add(d / name if name else d)
    with pytest.raises(CgroupV2Unavailable) as info:
        open_v2(SCOPE, root=kernel.root, fs=kernel, use_systemd_run=False)
    assert f"{d / name if name else d} is not writable" in str(info.value)
    assert "Delegate=yes" in str(info.value) and isinstance(info.value, SandboxUnavailableError)
    assert kernel.procs(d) == [ME]


def test_a_process_that_cannot_be_moved_into_the_leaf_is_refused(kernel: FakeKernel) -> None:
    d = kernel.make(SCOPE, procs=(ME,))
    kernel.make(f"{SCOPE}/{LEAF}")
    kernel.read_only.add(d / LEAF / "cgroup.procs")
    with pytest.raises(
        CgroupV2Unavailable, match=f"cannot move process {ME} of .* into .*{LEAF}/cgroup.procs"
    ):
        open_v2(SCOPE, root=kernel.root, fs=kernel, use_systemd_run=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="the refusal applies to root only")
def test_root_on_an_undelegated_v2_host_is_refused_with_the_reason(
    kernel: FakeKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel.make(SCOPE, controllers="cpu", procs=(ME,))
    monkeypatch.setattr(backend_base._BackendBase, "_cgroup_roots", _v2(kernel))
    with pytest.raises(SandboxUnavailableError) as info:
        bwrap.BubblewrapBackend(SandboxProviderConfig()).check()
    text = str(info.value)
    assert "cannot limit processes" in text and "cgroup mode none" in text
    assert "cgroup.controllers lists cpu" in text and "systemd-run --scope -p Delegate=yes" in text


# -- a scope of its own through systemd-run ---------------------------------------------------------

FAKE_SYSTEMD_RUN = r"""#!/bin/sh
# Records its argv, makes the scope's cgroup in the fake tree with itself in it, then runs the command.
echo "$@" > "$FAKE_ROOT/../systemd-run.argv"
for a; do case $a in --unit=*) unit=${a#--unit=} ;; esac; done
scope="/user.slice/user-1000.slice/user@1000.service/app.slice/$unit.scope"
d="$FAKE_ROOT$scope"
mkdir -p "$d" "$FAKE_PROC/$$"
echo "memory pids" > "$d/cgroup.controllers"; echo > "$d/cgroup.subtree_control"; echo $$ > "$d/cgroup.procs"
echo "usage_usec 0" > "$d/cpu.stat"
echo "0::$scope" > "$FAKE_PROC/$$/cgroup"
while [ "$1" != "--" ]; do shift; done; shift
exec "$@"
"""


def test_a_systemd_run_scope_is_used_when_the_own_cgroup_is_not_delegated(
    kernel: FakeKernel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = kernel.make("/user.slice/user-1000.slice/user@1000.service/app.slice/term.scope", "cpu", (ME,))
    script = tmp_path / "systemd-run"
    script.write_text(FAKE_SYSTEMD_RUN)
    script.chmod(0o755)
    monkeypatch.setenv("FAKE_ROOT", str(kernel.root))
    monkeypatch.setenv("FAKE_PROC", str(tmp_path / "proc"))
    driver = open_cgroups(
        mountinfo=UNIFIED,
        self_cgroup=f"0::/{own.relative_to(kernel.root)}",
        root=kernel.root,
        fs=kernel,
        proc=tmp_path / "proc",
        systemd_run=str(script),
    )
    assert isinstance(driver, _V2Cgroups), driver.reason
    helper = driver.helper
    assert helper is not None and helper.poll() is None
    try:
        argv = (tmp_path / "systemd-run.argv").read_text().split()
        expected = [*([] if os.geteuid() == 0 else ["--user"]), "--scope", "-p", "Delegate=yes"]
        assert argv[: len(expected)] == expected
        assert argv[-4:] == ["tail", f"--pid={ME}", "-f", "/dev/null"]  # the helper ends with this process
        scope = driver.delegated
        assert scope.name.startswith(f"nemo-gym-sandbox-{ME}-") and scope.name.endswith(".scope")
        assert kernel.procs(scope / LEAF) == [helper.pid] and kernel.procs(own) == [ME]
        assert "a scope started by" in driver.reason
        run = driver.create(SandboxResources(memory_mib=10))
        assert run.dir.parent == scope / f"nemo_gym_sandbox_{ME}"
        run.destroy()
    finally:
        driver.remove()
    assert helper.poll() is not None


def test_a_failing_systemd_run_adds_its_error_to_the_reason(kernel: FakeKernel, tmp_path: Path) -> None:
    kernel.make(SCOPE, controllers="cpu", procs=(ME,))
    script = tmp_path / "systemd-run"
    script.write_text("#!/bin/sh\necho 'Failed to connect to bus: No medium found' >&2\nexit 1\n")
    script.chmod(0o755)
    driver = open_cgroups(
        mountinfo=UNIFIED, self_cgroup=V2_SELF, root=kernel.root, fs=kernel, systemd_run=str(script)
    )
    assert driver.mode == "none"
    assert "cgroup.controllers lists cpu" in driver.reason and "Failed to connect to bus" in driver.reason
