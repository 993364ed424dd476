"""Sandbox sessions (``nemo_gym.sandbox.SandboxSession``): a long-lived sandbox per rollout, its kernel,
its limits, snapshots and forks, and the bad input the issue lists (real bubblewrap, real overlayfs).

These run as the suite's user (root in CI: the overlay mounted by root, cgroups for memory and processes)
and again as an unprivileged user (tests/test_sandbox_session_unprivileged.py runs this file's tests as
one: the overlay in a user namespace, rlimits and the agent's samples for the limits). Where the two
modes differ in what they can enforce, a test asserts each mode's own behaviour
(``session.enforcement``), never skips it.

Every test closes its sessions and checks that nothing is left: no process of the sandbox, no cgroup, no
session dir. Isolation is checked as the escape tests do, from inside: what one session can see of
another's files and processes, before and after a fork.
"""

from __future__ import annotations

import asyncio
import io
import os
import signal
import socket
import subprocess
import sys
import tarfile
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from nemo_gym.sandbox import (
    SandboxBusyError,
    SandboxSession,
    SessionClosedError,
    SessionLimits,
    prepare_workspace,
)
from nemo_gym.sandbox.session import _LAYERS, _OPEN

FAST = {"command_wall_time_s": 10, "command_cpu_time_s": 10, "memory_mib": 256, "processes": 64}


def _tree(session: SandboxSession) -> list[psutil.Process]:
    """The session's sandbox processes on the host (its outer process and descendants)."""
    assert session._sandbox is not None
    try:
        outer = psutil.Process(session._sandbox.proc.pid)
        return [outer, *outer.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


async def _gone(procs: list[psutil.Process], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in _alive(procs)):
            return True
        await asyncio.sleep(0.05)
    return False


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


async def _close_and_check(*sessions: SandboxSession) -> None:
    for session in sessions:
        if session._sandbox is None:
            continue
        procs = _tree(session)
        dirs = session._sandbox.dirs
        cgroups = [d for d in session._sandbox.cgroups._dirs() if d is not None]
        await session.close()
        assert await _gone(procs), f"processes left: {_alive(procs)}"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (dirs.exists() or any(c.exists() for c in cgroups)):
            await asyncio.sleep(0.05)
        assert not dirs.exists(), f"session dir left: {dirs}"
        assert not any(c.exists() for c in cgroups), "session cgroups left"


async def test_commands_files_and_a_persistent_kernel() -> None:
    session = await SandboxSession.start(files={"data/in.txt": "3 4\n"}, limits=FAST)
    try:
        r = await session.exec("id -u; pwd; cat data/in.txt")
        assert r.ok and r.stdout == "65534\n/workspace\n3 4\n"
        r = await session.exec(
            ["python3", "-c", "import sys; a, b = map(int, sys.stdin.read().split()); print(a * b)"],
            stdin="6 7",
        )
        assert r.stdout == "42\n"
        assert (await session.exec("echo made > new.txt")).ok
        assert await session.read_file("new.txt") == b"made\n"  # files persist across commands
        await session.write_file("sub/w.txt", "written")
        assert (await session.exec("cat sub/w.txt")).stdout == "written"
        names = {e.name: e.kind for e in await session.list_dir()}
        assert names == {"data": "dir", "new.txt": "file", "sub": "dir"}
        # The kernel keeps its variables; a last expression is printed; an exception is rc 1.
        assert (await session.run_python("import math\nx = 41")).ok
        assert (await session.run_python("x + 1")).stdout == "42\n"
        bad = await session.run_python("1 / 0")
        assert bad.return_code == 1 and "ZeroDivisionError" in bad.stderr
        assert (await session.run_python("print(x, open('new.txt').read().strip())")).stdout == "41 made\n"
        # Past its wall time a call is interrupted: the variables survive.
        slow = await session.run_python("import time\nwhile True: time.sleep(0.01)", timeout=1)
        assert slow.timed_out and slow.return_code == 130
        assert (await session.run_python("x")).stdout == "41\n"
    finally:
        await _close_and_check(session)
    with pytest.raises(SessionClosedError, match="close\\(\\) was called"):
        await session.exec("true")


async def test_a_session_started_with_sigint_ignored_and_blocked_still_interrupts_its_cells() -> None:
    """Dispositions and the signal mask pass through fork and exec: a server started as a shell's
    background job (``ng_run ... &`` ignores SIGINT) or from a thread that blocks it handed both to the
    kernel, whose cells then could not be interrupted: every timeout lost its variables."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    try:
        session = await SandboxSession.start(limits=FAST)
        first = await session.run_python("x = 41")  # the kernel starts now, with what this thread has
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        signal.signal(signal.SIGINT, previous)
    try:
        assert first.ok, first
        slow = await session.run_python("import time\nwhile True: time.sleep(0.01)", timeout=1)
        assert slow.timed_out and slow.return_code == 130 and "KeyboardInterrupt" in slow.stderr, slow
        assert (await session.run_python("x")).stdout == "41\n"  # interrupted, not restarted
    finally:
        await _close_and_check(session)


async def test_bad_commands_are_contained_and_the_session_goes_on() -> None:
    session = await SandboxSession.start(limits={**FAST, "output_limit_bytes": 100_000})
    other = await SandboxSession.start(limits=FAST)
    try:
        # Gigabytes of output: capped, with a marker, the command stopped.
        flood = await session.exec("yes 0123456789abcdef", timeout=10)
        assert flood.stdout_truncated and flood.error_type == "output_limit"
        assert "[output truncated: more than 100000 bytes" in flood.stdout
        assert flood.wall_time_s < 5
        # A fork bomb hits the session's pids limit and is killed with the command.
        bomb = await session.exec("b() { b | b & }; b; sleep 2", timeout=4)
        if session.enforcement.processes == "cgroup":
            assert bomb.pids_limit_hit, bomb  # the pids cgroup counts every fork it refused
        else:
            # RLIMIT_NPROC (in the session's user namespace) refuses the forks just the same; that the limit
            # was reached is known from the agent's samples of the sandbox's tasks (every 0.02 s), which a
            # bomb that collapses between two may slip. One that holds its processes is always seen.
            assert "Cannot fork" in bomb.stderr, bomb
            held = await session.exec("for i in $(seq 100); do sleep 5 & done; wait", timeout=8)
            assert held.pids_limit_hit and "Cannot fork" in held.stderr, held
        # A command past its wall time is killed.
        slow = await session.exec("sleep 30", timeout=1)
        assert slow.timed_out and slow.error_type == "timeout"
        # A memory bomb is OOM-killed by the session's memory cgroup; without one, RLIMIT_AS refuses the
        # allocation in the process itself (its own error, here Python's MemoryError).
        oom = await session.exec(["python3", "-c", "x = bytearray(600 << 20); print(len(x))"])
        if session.enforcement.memory == "cgroup":
            assert oom.oom_killed and oom.error_type == "oom", oom
        else:
            assert oom.return_code == 1 and "MemoryError" in oom.stderr and not oom.stdout, oom
        # Nothing outside /workspace (and /tmp) is writable.
        for target in ("/usr/evil", "/etc/evil", "/evil", "/opt/nemo_gym/session_agent.py"):
            r = await session.exec(f"echo x > {target}")
            assert r.return_code != 0 and ("Read-only" in r.stderr or "Permission" in r.stderr), r
        # After all that the session still works, and so does the other one.
        assert (await session.exec("echo fine")).stdout == "fine\n"
        assert (await session.run_python("1 + 1")).stdout == "2\n"
        assert (await other.exec("echo other")).stdout == "other\n"
    finally:
        await _close_and_check(session, other)


async def test_a_session_reaches_no_network_no_host_process_and_no_new_namespace() -> None:
    """From inside, as the model would try: our own servers on 127.0.0.1, the host's processes, the repo,
    capabilities, a new user namespace, a mount. Root's sessions and a user's (whose sandbox sits in a user
    namespace where that user is root, one level up) must refuse them all alike."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    repo = Path(__file__).resolve().parents[1]
    session = await SandboxSession.start(limits=FAST)
    try:
        probe = (
            f"python3 -c \"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('connected')\nexcept OSError as e:\n    print('refused', e.errno)\"; "
            "ls /proc | grep -c '^[0-9]'; grep CapEff /proc/self/status; "
            f"test -e {repo}/pyproject.toml && echo repo-visible; "
            "unshare --user true 2>/dev/null && echo userns-made; "
            "mkdir -p /tmp/m && mount -t tmpfs x /tmp/m 2>/dev/null && echo mounted; echo end"
        )
        r = await session.exec(probe)
        lines = r.stdout.splitlines()
        assert lines[0].startswith("refused") and int(lines[1]) < 10, r
        assert lines[2].split() == ["CapEff:", "0000000000000000"] and lines[3:] == ["end"], r
    finally:
        listener.close()
        await _close_and_check(session)


async def test_the_mount_table_inside_names_no_host_path_of_the_session() -> None:
    """What the sandbox reads of its own mounts (/proc/self/mountinfo, /proc/mounts) names none of the
    host's paths behind the session: before, the workspace's line carried the overlay's options with the
    host paths of its layer, upper and work dirs (``/tmp/nemo-gym-sessions-<server pid>-.../sessions/
    <session id>-.../upper``), and the agent's line the host path of its file. Now the overlay is mounted
    with names relative to the session's dir and the agent is a file of the sandbox's own root (read
    from an fd). A fork (its layer a snapshot, ``layers/ws-...``) is checked too."""
    session = await SandboxSession.start(files={"a.txt": "a"}, limits=FAST)
    fork = None
    try:
        snap = await session.snapshot()
        fork = await session.fork(snap)
        read = "cat /proc/self/mountinfo /proc/mounts; ls -l /proc/self/fd/; cat /proc/self/cgroup"
        for one in (session, fork):
            assert one._sandbox is not None
            seen = await one.exec(read)
            assert seen.ok, seen
            host_paths = [
                str(one._sandbox.dirs),  # the session's own dir on the host (its id, the server's pid)
                str(one._sandbox.dirs.parent.parent),  # this process's sessions dir
                str(one._layer.path),  # the layer it started from (a snapshot's id)
                "nemo-gym-sessions-",
                snap,
            ]
            for path in host_paths:
                assert path not in seen.stdout, (path, seen.stdout)
            workspace = next(line for line in seen.stdout.splitlines() if " /workspace " in line)
            assert "lowerdir=lower,upperdir=upper,workdir=work" in workspace or "fuse" in workspace, workspace
            assert "/opt/nemo_gym" not in seen.stdout  # the agent: a file of the root, no mount of its own
            assert (await one.exec("head -c 40 /opt/nemo_gym/session_agent.py")).ok
            refused = await one.exec("echo x >> /opt/nemo_gym/session_agent.py")
            assert refused.return_code != 0 and "Read-only file system" in refused.stderr, refused
    finally:
        await _close_and_check(*([fork] if fork else []), session)


async def test_memory_held_by_many_processes_together_is_bounded() -> None:
    """Three processes of 120 MiB each under a 256 MiB session: the memory cgroup OOM-kills one; without
    one (not root) no process passes its own RLIMIT_AS, and the agent's samples of the sandbox's total stop
    the command. Either way the result says oom, and the session goes on."""
    session = await SandboxSession.start(limits={**FAST, "memory_mib": 256})
    try:
        hog = "python3 -c 'import time; x = bytearray(120 << 20); time.sleep(2)'"
        r = await session.exec(f"{hog} & {hog} & {hog} & wait; echo waited", timeout=8)
        assert r.oom_killed and r.error_type == "oom" and not r.timed_out, r
        if session.enforcement.memory == "rlimit":
            assert "[out of memory: the sandbox's processes held" in r.stderr and "waited" not in r.stdout
        assert (await session.exec("echo fine")).stdout == "fine\n"
    finally:
        await _close_and_check(session)


_MEMFDS = """python3 -c "
import os, time
fds = [os.memfd_create('held') for _ in range(3)]
for fd in fds:
    with os.fdopen(fd, 'wb', closefd=False) as f:
        for _ in range(100):
            f.write(bytes(1 << 20))
print('held', flush=True)
time.sleep(3)
" """


async def test_memory_no_process_maps_is_bounded_too() -> None:
    """Memory a process holds without mapping it: files in /dev (bubblewrap's /dev is an unbounded tmpfs)
    and memfds written with write(2). A memory cgroup charges both; rlimits see neither. Before: as a user
    (no cgroup) 430 MB went into /dev/shm and 450 MiB into three memfds under a 256 MiB session, unseen.
    Now /dev is read-only and /dev/shm a tmpfs capped like /tmp, and the agent counts the memfds that the
    sandbox's processes hold."""
    session = await SandboxSession.start(limits={**FAST, "memory_mib": 256, "tmp_size_mib": 16})
    try:
        shm = await session.exec("echo x > /dev/evil; head -c 20000000 /dev/zero > /dev/shm/big; echo done")
        assert "Read-only file system" in shm.stderr and "No space left on device" in shm.stderr, shm
        assert (await session.exec("rm /dev/shm/big && echo gone")).stdout == "gone\n"
        memory = session.enforcement.memory
        try:
            held = await session.exec(_MEMFDS, timeout=8)
        except SessionClosedError as exc:  # a memory cgroup's OOM killer may take the agent itself
            assert memory == "cgroup" and "OOM" in str(exc), exc
            return
        assert held.oom_killed and held.error_type == "oom", held
        assert (await session.exec("echo fine")).stdout == "fine\n"
    finally:
        if session.closed is None:
            await _close_and_check(session)


async def test_a_cancelled_call_stops_its_command_and_the_next_call_gets_its_own_answer() -> None:
    session = await SandboxSession.start(limits=FAST)
    try:
        for slow in (session.exec("sleep 20; echo late"), session.run_python("import time; time.sleep(20)")):
            task = asyncio.ensure_future(slow)
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            t0 = time.monotonic()
            r = await session.exec("echo after; ls /proc | grep -c '^[0-9]'")
            assert r.stdout.startswith("after\n") and time.monotonic() - t0 < 5, r
        assert (await session.run_python("21 * 2")).stdout == "42\n"  # the kernel survived its interrupt
    finally:
        await _close_and_check(session)


async def test_background_processes_die_when_their_command_returns() -> None:
    session = await SandboxSession.start(limits=FAST)
    marker = "bg-" + uuid.uuid4().hex[:8]
    try:
        r = await session.exec(
            f"sleep 300 & setsid sh -c 'trap \"\" TERM HUP; exec -a {marker} sleep 300' & "
            f"nohup sh -c 'sleep 300' >/dev/null 2>&1 & echo started"
        )
        assert r.stdout == "started\n" and r.wall_time_s < 5  # did not wait for the background ones
        ps = await session.exec("for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done")
        assert "sleep 300" not in ps.stdout and marker not in ps.stdout, ps.stdout
        assert not [
            p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])
        ]
        # A kernel call's subprocesses go the same way; the kernel stays.
        k = await session.run_python("import subprocess\np = subprocess.Popen(['sleep', '300'])\np.pid")
        assert k.ok
        ps = await session.exec("for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done")
        assert "sleep 300" not in ps.stdout and "session_agent.py kernel" in ps.stdout
    finally:
        await _close_and_check(session)


async def test_disk_quota_stops_a_filling_command_with_a_clear_result() -> None:
    session = await SandboxSession.start(limits={**FAST, "disk_quota_mib": 8, "file_size_mib": 4})
    try:
        fill = await session.exec(
            "i=0; while true; do head -c 1000000 /dev/zero > f$i || exit 9; i=$((i+1)); done"
        )
        assert fill.error_type == "disk_quota", fill
        assert "over its disk quota" in fill.stderr
        with pytest.raises(ValueError, match="disk quota"):
            await session.write_file("more.bin", b"x" * (1 << 20))
        # Over the quota, a command that adds to it is stopped, one that deletes runs to its end (however
        # slow: the watcher polls every 0.5 s, and it used to stop a cleaning command that began over it).
        more = await session.exec("head -c 1000000 /dev/zero > g; sleep 3; echo done")
        assert more.error_type == "disk_quota" and "done" not in more.stdout, more
        cleaned = await session.exec("sleep 1.5; rm -f f* g; echo ok")
        assert cleaned.stdout == "ok\n" and cleaned.error_type is None, cleaned
        again = await session.exec("head -c 1000 /dev/zero > small; echo fine")
        assert again.ok and again.error_type is None  # back under the quota: goes on
        big = await session.exec("head -c 5000000 /dev/zero > one")  # past file_size_mib: EFBIG
        assert big.return_code != 0
    finally:
        await _close_and_check(session)


async def test_sparse_files_count_what_they_can_become_and_a_snapshot_keeps_their_holes() -> None:
    """Before: the quota summed allocated blocks, so eight sparse 255 MB files passed a 256 MiB quota
    (16 KB used), and snapshot() copied them with their holes filled (2,041 MiB written to the host)."""
    sparse = "import sys\nwith open(sys.argv[1], 'wb') as f:\n    f.seek({size} - 1)\n    f.write(b'x')\n"
    session = await SandboxSession.start(limits={**FAST, "disk_quota_mib": 64, "file_size_mib": 48})
    try:
        await session.write_file("sparse.py", sparse.format(size=40 << 20))
        made = await session.exec("python3 sparse.py s1 && du -k s1 && ls -l s1")
        assert made.ok and made.error_type is None, made
        allocated_kib = int(made.stdout.split()[0])
        assert allocated_kib < 1024  # sparse indeed: 40 MB of size, a few KiB on disk
        usage = await session.usage()
        assert usage.workspace_bytes >= 40 << 20  # what it can become counts
        snapshot = await session.snapshot()
        copied = _LAYERS[snapshot].path / "s1"
        assert copied.stat().st_size == 40 << 20 and copied.stat().st_blocks * 512 < 1 << 20  # holes kept
        assert copied.read_bytes()[-1:] == b"x"
        over = await session.exec("python3 sparse.py s2")  # 80 MB of files against a 64 MiB quota
        assert over.error_type == "disk_quota", over
    finally:
        await _close_and_check(session)


async def test_a_kernel_recovers_after_cells_that_fork_loop_and_leave_processes_behind() -> None:
    """The same session's next cell works after the model's own forks, endless loop and stray processes:
    what a cell left running is killed when it returns, and the kernel reaps it (unreaped, 40 zombies a
    cell filled the 64-process limit after two cells, and the next cell could start nothing)."""
    session = await SandboxSession.start(limits={**FAST, "command_wall_time_s": 3, "processes": 64})
    try:
        spawn = "import os\nfor _ in range(40):\n    if os.fork() == 0:\n        while True: pass\nprint('forked')"
        for _ in range(3):
            assert (await session.run_python(spawn)).stdout == "forked\n"
        looped = await session.run_python("while True: pass")
        assert looped.error_type == "timeout" and looped.return_code == 130
        ran = await session.run_python(
            "import subprocess\nprint(subprocess.run(['echo', 'hi'], capture_output=True).stdout)"
        )
        assert ran.ok and ran.stdout == "b'hi\\n'\n", ran
        assert (await session.run_python("print(1 + 1)")).stdout == "2\n"
    finally:
        await _close_and_check(session)


async def test_dirs_the_sandbox_locked_are_still_counted_snapshotted_and_removed() -> None:
    """Not root, the sandbox's files are the host user's own, and ``chmod 000`` takes that user's access
    away (root's DAC override ignores it). Before the walks opened such dirs for themselves (as that
    user): the quota counted 4 KiB of a 12 MB file in a locked dir, a snapshot failed with
    PermissionError (a verifier's 503) and closing left the files on the host. Modes are put back."""
    session = await SandboxSession.start(limits={**FAST, "disk_quota_mib": 8, "file_size_mib": 16})
    assert session._sandbox is not None
    dirs = session._sandbox.dirs
    try:
        lock = (
            "mkdir -p locked/inner && echo secret > locked/inner/s.txt && chmod 000 locked/inner/s.txt "
            "&& chmod 000 locked/inner && chmod 100 locked && echo locked"
        )
        assert (await session.exec(lock)).stdout == "locked\n"
        snap = await session.snapshot()
        fork = await session.fork(snap)
        try:
            read = await fork.exec(
                "stat -c %a locked locked/inner; chmod 700 locked locked/inner; chmod 600 locked/inner/s.txt; "
                "cat locked/inner/s.txt"
            )
            assert read.stdout == "100\n0\nsecret\n", read
        finally:
            await _close_and_check(fork)
        modes = await session.exec("stat -c %a locked; chmod 700 locked; stat -c %a locked/inner")
        assert modes.stdout == "100\n0\n", modes  # the session's own modes: as it set them
        # 12 MB in a dir locked at once (before the 0.5 s poll): counted after the command, past 8 MiB.
        hidden = await session.exec("mkdir hide && head -c 12000000 /dev/zero > hide/big && chmod 000 hide")
        assert hidden.error_type == "disk_quota", hidden
        with pytest.raises(ValueError, match="disk quota"):
            await session.write_file("more.txt", "x")
        # The workspace's own top, locked: still counted.
        top = await session.exec("chmod 000 /workspace")
        assert top.error_type == "disk_quota", top
        assert (await session.usage()).workspace_bytes >= 12_000_000
    finally:
        await _close_and_check(session)
    left = [dirs, dirs.with_name(f".{dirs.name}.removed")]  # a session's dir: renamed, then removed
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(p.exists() for p in left):
        await asyncio.sleep(0.05)
    assert not any(p.exists() for p in left), f"left on the host: {[p for p in left if p.exists()]}"


async def test_file_operations_stay_inside_the_workspace() -> None:
    session = await SandboxSession.start(limits=FAST)
    try:
        assert (
            await session.exec(
                "ln -s /etc/passwd out; ln -s ../../usr/bin/env up; ln -s in.txt ok; echo hi > in.txt"
            )
        ).ok
        for path in ("out", "up", "/etc/passwd", "../etc/passwd", "/workspace/../usr/bin/env"):
            with pytest.raises(ValueError, match="outside the workspace"):
                await session.read_file(path)
        assert await session.read_file("ok") == b"hi\n"  # a symlink inside is fine
        with pytest.raises(ValueError, match="outside the workspace"):
            await session.write_file("out", "x")
        with pytest.raises(ValueError, match="outside the workspace"):
            await session.list_dir("/usr")
        with pytest.raises(ValueError, match="not a file"):
            await session.read_file("missing.txt")
    finally:
        await _close_and_check(session)


async def test_sessions_cannot_see_each_other_before_or_after_a_fork() -> None:
    secret = "secret-" + uuid.uuid4().hex
    a = await SandboxSession.start(files={"a_only.txt": secret}, limits=FAST)
    b = await SandboxSession.start(limits=FAST)
    forks: list[SandboxSession] = []
    try:
        # Every file B can see outside /usr (read-only, the host's) and /proc, by name and by content.
        look = (
            f"find / -path /proc -prune -o -path /usr -prune -o -print 2>/dev/null | grep -c . ; "
            "find / -path /proc -prune -o -path /usr -prune -o -name 'a_only*' -print 2>/dev/null; "
            f"grep -rl {secret} /workspace /tmp /opt /etc /dev 2>/dev/null; "
            "ls -a /workspace"
        )
        seen = await b.exec(look)
        assert seen.ok and not seen.timed_out, seen
        assert secret not in seen.stdout and "a_only.txt" not in seen.stdout
        # A's long command runs while B lists every process it can see: A's is not among them.
        marker = "proc-" + uuid.uuid4().hex[:8]
        running = asyncio.ensure_future(a.exec(f"exec -a {marker} sleep 3"))
        await asyncio.sleep(1)
        ps = await b.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
        assert marker not in ps.stdout and "sleep" not in ps.stdout
        await running
        # A fork sees the snapshot, not A's later files; A and B do not see the fork's.
        snap = await a.snapshot()
        assert (await a.exec("echo later > a_later.txt")).ok
        fork = await a.fork(snap)
        forks.append(fork)
        listing = await fork.exec("ls; cat a_only.txt")
        assert (
            "a_only.txt" in listing.stdout
            and secret in listing.stdout
            and "a_later.txt" not in listing.stdout
        )
        assert (await fork.exec("echo fork-secret > fork_only.txt")).ok
        assert "fork_only.txt" not in (await a.exec("ls")).stdout
        seen = await b.exec(
            "find / -path /proc -prune -o -path /usr -prune -o -name 'fork_only*' -print 2>/dev/null; "
            "grep -rl fork-secret /workspace /tmp; ls"
        )
        assert not seen.timed_out and "fork_only" not in seen.stdout
        running = asyncio.ensure_future(fork.exec(f"exec -a {marker} sleep 3"))
        await asyncio.sleep(1)
        for other in (a, b):
            ps = await other.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
            assert marker not in ps.stdout
        await running
    finally:
        await _close_and_check(*forks, a, b)


async def test_a_write_in_a_fork_never_changes_the_snapshot_or_a_sibling() -> None:
    files = {f"f{i}.txt": f"original {i}\n" for i in range(6)}
    base = await SandboxSession.start(files=files, limits=FAST)
    sessions = [base]
    try:
        snap = await base.snapshot()
        layer = _LAYERS[snap].path
        first, sibling = await base.fork(snap), await base.fork(snap)
        sessions += [first, sibling]
        writes = [
            "echo appended >> f0.txt",
            "sed -i 's/original/edited/' f1.txt",
            "python3 -c \"f = open('f2.txt', 'r+'); f.write('XXXX'); f.close()\"",
            "truncate -s 0 f3.txt",
            "chmod 600 f4.txt && echo perm >> f4.txt",
            "rm f5.txt",
        ]
        for cmd in writes:
            r = await first.exec(cmd)
            assert r.ok, (cmd, r)
        changed = await first.exec("cat f0.txt f1.txt f2.txt f3.txt f4.txt; ls f5.txt 2>&1")
        assert (
            "appended" in changed.stdout and "edited 1" in changed.stdout and "XXXXinal 2" in changed.stdout
        )
        assert "No such file" in changed.stdout
        # The sibling, a new fork, the session that took the snapshot, and the layer on disk: unchanged.
        expected = "".join(files[f"f{i}.txt"] for i in range(6))
        late = await base.fork(snap)
        sessions.append(late)
        for s in (sibling, late, base):
            assert (await s.exec("cat f0.txt f1.txt f2.txt f3.txt f4.txt f5.txt")).stdout == expected
        for i in range(6):
            assert (layer / f"f{i}.txt").read_text() == files[f"f{i}.txt"]
        # The kernel writes through the same copy-up.
        assert (await sibling.run_python("open('f0.txt', 'a').write('k')")).ok
        assert (layer / "f0.txt").read_text() == files["f0.txt"]
        assert (await late.exec("cat f0.txt")).stdout == files["f0.txt"]
    finally:
        await _close_and_check(*reversed(sessions))


async def test_opaque_dirs_and_whiteouts_reach_a_snapshot() -> None:
    """What a session deleted and replaced is what its snapshot holds, whichever way its overlay marks that
    in the upper dir: a deleted file or dir (a whiteout), a dir deleted and made again (opaque: none of
    the layer's entries come back), a file replaced by a dir. Root's overlay marks an opaque dir with a
    trusted.* xattr, a user namespace's with a user.* one, fuse-overlayfs with its own xattr and file."""
    files = {"gone.txt": "g", "d/a.txt": "a", "d/b.txt": "b", "keep/k.txt": "k", "swap": "file"}
    base = await SandboxSession.start(files=files, limits=FAST)
    sessions = [base]
    try:
        first = await base.snapshot()
        work = await base.fork(first)
        sessions.append(work)
        changed = "rm gone.txt && rm -r d && mkdir d && echo c > d/c.txt && rm swap && mkdir swap && echo s > swap/in"
        assert (await work.exec(changed)).ok
        second = await work.snapshot()
        check = await work.fork(second)
        sessions.append(check)
        seen = await check.exec("find . | sort; cat d/c.txt swap/in")
        listing = [".", "./d", "./d/c.txt", "./keep", "./keep/k.txt", "./swap", "./swap/in", "c", "s"]
        assert seen.stdout.splitlines() == listing, seen
        layer = _LAYERS[second].path
        assert sorted(p.name for p in layer.iterdir()) == ["d", "keep", "swap"]
        assert not any(p.name.startswith(".wh.") for p in layer.rglob("*"))  # no marker copied
    finally:
        await _close_and_check(*reversed(sessions))


async def test_restore_rolls_back_and_other_sessions_snapshots_are_refused() -> None:
    a = await SandboxSession.start(files={"state.txt": "v1\n"}, limits=FAST)
    b = await SandboxSession.start(limits=FAST)
    try:
        snap = await a.snapshot()
        assert (await a.exec("echo v2 > state.txt; echo extra > extra.txt")).ok
        await a.run_python("kept = 1")
        await a.restore(snap)
        assert (await a.exec("cat state.txt; ls")).stdout == "v1\nstate.txt\n"
        assert "NameError" in (await a.run_python("kept")).stderr  # kernels are not snapshotted
        for call in (b.fork(snap), b.restore(snap), b.restore("ws-0000"), a.fork("ws-nonexistent")):
            with pytest.raises(ValueError, match="not one of session"):
                await call
        with pytest.raises(ValueError, match="fork\\(\\), not start\\(\\)"):
            await SandboxSession.start(workspace=snap)
    finally:
        await _close_and_check(a, b)


async def test_prepared_workspaces_are_unpacked_once_and_forked_per_rollout(tmp_path: Path) -> None:
    src = tmp_path / "repo"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    base = await prepare_workspace(src)
    assert await prepare_workspace(src) == base  # unchanged source: the same base
    tar_path = tmp_path / "repo.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tar:
        tar.add(src / "pkg", arcname="pkg")
    from_tar = await prepare_workspace(tar_path)
    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ValueError, match="refused member"):
        await prepare_workspace(evil)
    with pytest.raises(ValueError, match="neither a directory nor a tar"):
        (tmp_path / "plain.txt").write_text("x")
        await prepare_workspace(tmp_path / "plain.txt")
    group = [await SandboxSession.start(workspace=w, limits=FAST) for w in (base, base, from_tar, str(src))]
    try:
        for i, s in enumerate(group):
            assert (await s.exec(f"sed -i 's/1/{i + 10}/' pkg/mod.py")).ok
        for i, s in enumerate(group):
            assert (await s.exec("python3 -c 'from pkg.mod import f; print(f())'")).stdout == f"{i + 10}\n"
        assert (src / "pkg" / "mod.py").read_text() == "def f():\n    return 1\n"
        assert (_LAYERS[base].path / "pkg" / "mod.py").read_text() == "def f():\n    return 1\n"
    finally:
        await _close_and_check(*group)


async def test_a_fork_copies_nothing(tmp_path: Path) -> None:
    """A fork of a 2,000-file workspace shares its files (hard links in the layer, the overlay's lower
    dir): the fork's own dir stays empty until it writes. (Timing: ng_bench_sandbox +mode=session.)"""
    src = tmp_path / "big"
    for d in range(20):
        (src / f"d{d}").mkdir(parents=True)
        for i in range(100):
            (src / f"d{d}" / f"f{i}.txt").write_bytes(os.urandom(2000))
    base = await SandboxSession.start(workspace=src, limits=FAST)
    try:
        assert (await base.exec("echo changed > d0/f0.txt; cp /bin/true suid; chmod 4755 suid")).ok
        snap = await base.snapshot()
        layer = _LAYERS[snap].path
        # The sandbox's uid is root's on the host (the server's user's, not root): a set-uid bit it set
        # never reaches a layer.
        assert not os.stat(layer / "suid").st_mode & 0o6000
        assert oct(os.stat(_LAYERS[snap].path.parents[1]).st_mode & 0o777) == "0o700"
        assert os.stat(layer / "d1" / "f1.txt").st_nlink >= 2  # linked from the base, not copied
        assert os.stat(layer / "d0" / "f0.txt").st_nlink == 1  # the changed file: copied
        fork = await base.fork(snap)
        try:
            assert fork._sandbox is not None
            upper = fork._sandbox.upper
            assert (await fork.exec("find . -type f | wc -l; cat d0/f0.txt")).stdout == "2001\nchanged\n"
            assert list(upper.iterdir()) == []
        finally:
            await _close_and_check(fork)
    finally:
        await _close_and_check(base)


# Built in the sandbox with relative names (os.mkdir + os.chdir): 1,500 nested dirs (deeper than any
# recursive walk: os.walk and shutil.rmtree raise RecursionError in Python 3.11), 30 dirs of 200-byte
# names (paths of 6,000 bytes, past PATH_MAX: full-path calls fail with ENAMETOOLONG).
_WILD_TREE = """python3 -c "
import os
top = os.getcwd()
for _ in range(1500):
    os.mkdir('d'); os.chdir('d')
open('deep.txt', 'w').write('deep')
os.chdir(top)
for _ in range(30):
    os.mkdir('L' * 200); os.chdir('L' * 200)
open('far.txt', 'w').write('far')
print('built')
" """
_READ_BACK = """python3 -c "
import os
top = os.getcwd()
for _ in range(30):
    os.chdir('L' * 200)
far = open('far.txt').read()
os.chdir(top)
print(open('d/' * 1500 + 'deep.txt').read() + far)
" """


async def test_a_tree_past_any_recursion_and_path_max_is_snapshotted_counted_and_removed() -> None:
    """What the sandbox's code can build, the host walks by directory fds: the snapshot copies it, the
    disk quota counts what is written under a path past PATH_MAX, and closing removes it all. The walks
    these replaced raised RecursionError (a 500 from a verifier that snapshots) and ENAMETOOLONG (a 503),
    skipped the deep data (50 MB under a 10 MiB quota) and left the deep dirs on the host."""
    limits = {**FAST, "disk_quota_mib": 8, "file_size_mib": 256}
    session = await SandboxSession.start(limits=limits)
    assert session._sandbox is not None
    dirs = session._sandbox.dirs
    try:
        built = await session.exec(_WILD_TREE)
        # fuse-overlayfs (not root, a kernel without its own overlay for users) works on full paths: past
        # PATH_MAX it refuses (ENAMETOOLONG), so there no such path can be built; 1,500 nested dirs can.
        fuse = session.enforcement.mount == "fuse"
        if fuse:
            assert built.return_code == 1 and "File name too long" in built.stderr, built
        else:
            assert built.stdout == "built\n", built
        snap = await session.snapshot()
        layer = _LAYERS[snap].path
        fork = await session.fork(snap)
        try:
            found = await fork.exec(_READ_BACK)
            if fuse:
                assert (await fork.exec(f"cat {'d/' * 1500}deep.txt")).stdout == "deep", found
            else:
                assert found.stdout == "deepfar\n", found
        finally:
            await _close_and_check(fork)
        # 12 MB under a path past PATH_MAX (fuse: 1,500 dirs down): counted, so the command is stopped at
        # the 8 MiB quota.
        down = "os.chdir('d/' * 1500)" if fuse else "for _ in range(30):\n    os.chdir('L' * 200)"
        deep_write = (
            f"python3 -c \"import os\n{down}\nopen('big', 'wb').write(bytes(12000000))\"; sleep 3; echo done"
        )
        over = await session.exec(deep_write)
        assert over.error_type == "disk_quota", over
    finally:
        await _close_and_check(session)
    left = [layer, dirs, dirs.with_name(f".{dirs.name}.removed")]  # a session's dir: renamed, then removed
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(p.exists() for p in left):
        await asyncio.sleep(0.05)
    assert not any(p.exists() for p in left), f"left on the host: {[p for p in left if p.exists()]}"


async def test_a_bounded_number_of_sessions_with_a_queue() -> None:
    limits = {**FAST, "max_sessions": 2, "queue_timeout_s": 0.5}
    first = await SandboxSession.start(limits=limits)
    second = await SandboxSession.start(limits=limits)
    try:
        with pytest.raises(SandboxBusyError, match="max_sessions"):
            await SandboxSession.start(limits=limits)
        waiting = asyncio.ensure_future(SandboxSession.start(limits={**limits, "queue_timeout_s": 10}))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await first.close()
        third = await asyncio.wait_for(waiting, 10)  # queued, then started when a slot freed
        assert (await third.exec("echo three")).stdout == "three\n"
        await _close_and_check(third)
    finally:
        await _close_and_check(second)


async def test_idle_timeout_and_lifetime_close_the_session() -> None:
    idle = await SandboxSession.start(limits={**FAST, "idle_timeout_s": 0.5})
    short = await SandboxSession.start(limits={**FAST, "lifetime_s": 1.5})
    procs = _tree(idle) + _tree(short)
    assert (await short.exec("sleep 0.2; echo alive")).stdout == "alive\n"
    running = asyncio.ensure_future(short.exec("sleep 30"))
    with pytest.raises(SessionClosedError, match="lifetime of 1.5 s"):
        await asyncio.wait_for(running, 10)
    await asyncio.sleep(0.5)
    assert idle.closed is not None and "idle for 0.5 s" in idle.closed
    with pytest.raises(SessionClosedError, match="idle"):
        await idle.exec("true")
    assert await _gone(procs)


def test_nothing_outlives_a_killed_server(tmp_path: Path) -> None:
    """A process holding sessions (one running a command, one idle with a kernel) is SIGKILLed: every
    process of their sandboxes dies; the next process removes their dirs."""
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        from nemo_gym.sandbox import SandboxSession

        async def main():
            a = await SandboxSession.start(provider={{"workdir_root": {str(tmp_path)!r}}})
            b = await SandboxSession.start(provider={{"workdir_root": {str(tmp_path)!r}}})
            await b.run_python("x = 1")
            print(a._sandbox.proc.pid, b._sandbox.proc.pid, flush=True)
            await a.exec("sleep 300")

        asyncio.run(main())
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        outers = [psutil.Process(int(p)) for p in line.split()]
        tree = [q for o in outers for q in [o, *o.children(recursive=True)]]
        assert len(tree) >= 7, tree  # outer bwrap, init, agent (x2), sleep's shell, the kernel
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert asyncio.run(_gone(tree)), f"left: {_alive(tree)}"
    assert list(tmp_path.glob("nemo-gym-sessions-*"))  # no exit handler ran
    script2 = (
        "import asyncio\nfrom nemo_gym.sandbox import SandboxSession\n"
        f"async def main():\n    s = await SandboxSession.start(provider={{'workdir_root': {str(tmp_path)!r}}})\n"
        "    await s.close()\nasyncio.run(main())\n"
    )
    subprocess.run([sys.executable, "-c", script2], env=env, check=True, timeout=60)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and [p for p in tmp_path.iterdir() if str(proc.pid) in p.name]:
        time.sleep(0.1)
    assert not [p for p in tmp_path.iterdir() if str(proc.pid) in p.name]


def test_no_session_left_open() -> None:
    assert not _OPEN


async def test_bad_limits_and_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="SessionLimits.memory_mib"):
        SessionLimits(memory_mib=0)
    with pytest.raises(ValueError, match="Unknown session limit keys: \\['memory'\\]"):
        await SandboxSession.start(limits={"memory": 5})
    with pytest.raises(ValueError, match="prepared workspace '/no/such/dir'"):
        await SandboxSession.start(workspace="/no/such/dir")
    from nemo_gym.sandbox import SandboxUnavailableError

    with pytest.raises(SandboxUnavailableError, match="bubblewrap backend"):
        await SandboxSession.start(provider={"backend": "unsafe_local_subprocess"})
