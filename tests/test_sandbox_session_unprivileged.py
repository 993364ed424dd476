"""Sandbox sessions for a user that is not root: the session tests again, as a dedicated unprivileged user.

CI runs as root, where sessions mount their overlay as root and limit memory and processes with cgroups.
A user on a laptop or a cluster without root gets the other mode (docs/sandbox.md, "Sessions without
root"): the overlay mounted in a user namespace of the session's own (the kernel's overlayfs, or
fuse-overlayfs where the kernel refuses), RLIMIT_NPROC set inside it and the agent's samples where no
cgroup is writable. Here root makes (or reuses) the system user ``nemo-gym-sandbox-test`` and runs
tests/sandbox_sessions_as_user.py, which drops to it and runs every test of tests/test_sandbox_session.py
(each asserts what its mode enforces), a SIGKILLed holder leaving nothing, workspace_tasks' hidden-test
runner on every task and math_with_code's kernel cells; then once more with fuse-overlayfs forced, on the
tests of the workspace's copy-on-write. Not root: the same runs as the current user.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

USER = "nemo-gym-sandbox-test"
RUNNER = Path(__file__).with_name("sandbox_sessions_as_user.py")
# With fuse-overlayfs forced: what depends on the workspace's file system (copy-up, whiteouts and opaque
# dirs in snapshots, the quota's count, locked dirs, deep trees, clean-up), plus commands and the kernel.
FUSE_CHECKS = (
    "test_commands_files_and_a_persistent_kernel",
    "test_disk_quota_stops_a_filling_command_with_a_clear_result",
    "test_dirs_the_sandbox_locked_are_still_counted_snapshotted_and_removed",
    "test_a_write_in_a_fork_never_changes_the_snapshot_or_a_sibling",
    "test_restore_rolls_back_and_other_sessions_snapshots_are_refused",
    "test_a_tree_past_any_recursion_and_path_max_is_snapshotted_counted_and_removed",
    "test_sessions_cannot_see_each_other_before_or_after_a_fork",
    "test_opaque_dirs_and_whiteouts_reach_a_snapshot",
    "test_a_session_reaches_no_network_no_host_process_and_no_new_namespace",
    "test_the_mount_table_inside_names_no_host_path_of_the_session",
    "changes::test_a_sessions_changes_make_another_session_on_the_same_workspace_the_same",
)


def _user() -> pwd.struct_passwd | None:
    """The dedicated user (made when root and missing); None when not root (the tests run as this user)."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        pass
    useradd = shutil.which("useradd", path="/usr/sbin:/usr/bin:/sbin:/bin")
    if useradd is None:
        pytest.fail(f"`useradd` (Debian package passwd) is needed to make the unprivileged user {USER}")
    subprocess.run(
        [
            useradd,
            "--system",
            "--no-create-home",
            "--home-dir",
            "/nonexistent",
            "--shell",
            "/usr/sbin/nologin",
            USER,
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return pwd.getpwnam(USER)


@pytest.fixture()
def user_home() -> Iterator[tuple[pwd.struct_passwd | None, Path]]:
    user = _user()
    home = Path(tempfile.mkdtemp(prefix="nemo-gym-unprivileged-"))
    if user is not None:
        os.chown(home, user.pw_uid, user.pw_gid)
    try:
        yield user, home
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _run(
    user: pwd.struct_passwd | None, home: Path, only: tuple[str, ...] = (), mount: str = ""
) -> list[dict]:
    argv = [sys.executable, str(RUNNER), "--home", str(home)]
    if user is not None:
        argv += ["--user", user.pw_name]
    if only:
        argv += ["--only", ",".join(only)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEMO_GYM_SANDBOX_SESSION_MOUNT")}
    if mount:
        env["NEMO_GYM_SANDBOX_SESSION_MOUNT"] = mount
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=str(home))
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, f"runner exit {done.returncode}: {done.stderr[-3000:]}"
    return lines


def _assert_all_passed(lines: list[dict], expected: int) -> dict:
    checks = [line for line in lines if "check" in line]
    failed = {c["check"]: c.get("error", "") for c in checks if not c["ok"]}
    assert not failed, "\n\n".join(f"{name}:\n{error}" for name, error in failed.items())
    assert len(checks) >= expected, [c["check"] for c in checks]
    modes = [line["mode"] for line in lines if "mode" in line]
    assert len(modes) == 1
    return modes[0]


def _nothing_left(user: pwd.struct_passwd | None, home: Path) -> None:
    """No process of the user's left running (root runs: the dedicated user has no other; a zombie is dead,
    reaping it is the host's init's job), no session dir left."""
    if user is not None:
        deadline = time.monotonic() + 10
        while True:
            left = [
                p.info for p in psutil.process_iter(["pid", "uids", "status", "cmdline"]) if _runs_as(p, user)
            ]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not left, f"processes of {USER} left: {left}"
    assert not list(home.rglob("nemo-gym-sessions-*")), list(home.rglob("nemo-gym-sessions-*"))


def _runs_as(proc: psutil.Process, user: pwd.struct_passwd) -> bool:
    uids, status = proc.info["uids"], proc.info["status"]
    return uids is not None and uids.real == user.pw_uid and status != psutil.STATUS_ZOMBIE


@pytest.mark.slow
def test_sessions_work_for_an_unprivileged_user(user_home: tuple[pwd.struct_passwd | None, Path]) -> None:
    """Every session test, the killed holder, workspace_tasks and math_with_code, as the unprivileged user:
    the workspace in a user namespace of the session's own (the kernel's overlayfs here)."""
    user, home = user_home
    lines = _run(user, home)
    mode = _assert_all_passed(lines, expected=25)
    if user is not None:
        assert mode["uid"] == user.pw_uid and mode["mount"] in ("userns", "fuse"), mode
    _nothing_left(user, home)


def test_sessions_work_for_an_unprivileged_user_on_fuse_overlayfs(
    user_home: tuple[pwd.struct_passwd | None, Path],
) -> None:
    """The same user with fuse-overlayfs forced (what a kernel older than 5.11 gets): the tests of the
    workspace's file system."""
    if shutil.which("fuse-overlayfs") is None:
        pytest.skip("fuse-overlayfs is not installed (apt-get install fuse-overlayfs; .ci/run does it)")
    user, home = user_home
    lines = _run(user, home, FUSE_CHECKS, mount="fuse")
    mode = _assert_all_passed(lines, expected=len(FUSE_CHECKS))
    assert mode["mount"] == "fuse", mode
    _nothing_left(user, home)
