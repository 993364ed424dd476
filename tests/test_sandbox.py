"""nemo_gym.sandbox through its API: results, limits, the bounded pool, refusals and infrastructure errors.

The attacks (network, files, bombs, daemons) are in test_sandbox_escape.py, through a real server.
"""

from __future__ import annotations

import asyncio
import logging
import os

import psutil
import pytest
from pydantic import ValidationError

from nemo_gym.sandbox import (
    AsyncSandbox,
    SandboxBusyError,
    SandboxError,
    SandboxProviderConfig,
    SandboxSpec,
    SandboxUnavailableError,
    bwrap,
    check_sandbox_available,
    run_in_sandbox,
)
from nemo_gym.sandbox import api as sandbox_api


async def test_stdin_files_stdout_stderr_and_exit_code() -> None:
    files = {
        "prog.py": "import sys\ndata = sys.stdin.read()\nprint(len(data))\nprint('warn', file=sys.stderr)\nexit(3)"
    }
    result = await run_in_sandbox(["python3", "-I", "prog.py"], files=files, stdin="x" * 3_000_000)
    assert result.stdout == "3000000\n" and result.stderr == "warn\n"
    assert result.return_code == 3 and result.error_type is None and not result.ok


async def test_death_by_signal_is_128_plus_the_signal_without_other_flags() -> None:
    result = await run_in_sandbox(
        ["python3", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    )
    assert result.return_code == 137
    assert not (result.oom_killed or result.timed_out or result.pids_limit_hit)


async def test_cpu_time_limit_stops_a_busy_program() -> None:
    result = await run_in_sandbox(
        ["python3", "-c", "while True: pass"], resources={"cpu_time_s": 1, "wall_time_s": 20}
    )
    assert result.timed_out and result.error_type == "timeout" and result.return_code == 152  # SIGXCPU
    # The tree's CPU time, from its cgroup. SIGXCPU (152) already says the 1 s limit stopped it; the
    # cgroup's count, read as the tree ends, ran ~0.85 s on a machine loaded by other work.
    assert result.cpu_time_s is not None and 0.5 <= result.cpu_time_s < 5


async def test_cpu_limit_holds_when_the_program_ignores_sigxcpu() -> None:
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass"
    result = await run_in_sandbox(["python3", "-c", code], resources={"cpu_time_s": 1, "wall_time_s": 20})
    assert (
        result.return_code == 137 and result.timed_out and not result.oom_killed
    )  # SIGKILL at the hard limit


async def test_wall_time_limit_stops_a_sleeping_program() -> None:
    result = await run_in_sandbox(
        ["python3", "-c", "import time; time.sleep(60)"], resources={"wall_time_s": 0.5}
    )
    assert result.timed_out and result.return_code == 137 and result.error_type == "timeout"


async def test_file_size_limit() -> None:
    code = "f = open('big', 'wb')\nf.write(b'x' * (3 << 20))\nf.close()"
    result = await run_in_sandbox(["python3", "-c", code], resources={"file_size_mib": 1})
    assert (
        result.return_code == 1 and "[Errno 27] File too large" in result.stderr
    )  # EFBIG (Python ignores SIGXFSZ)


# 1 MiB files (each under RLIMIT_FSIZE) in a loop until the run's wall time; empty files likewise.
FILL = "import time\ni = 0\nwhile True:\n    open(f'f{i}', 'wb').write(bytes(1 << 20))\n    i += 1\n    time.sleep(0.002)"
EMPTY_FILES = "i = 0\nwhile True:\n    open(f'e{i}', 'w').close()\n    i += 1"


@pytest.mark.parametrize("backend", ["bubblewrap", "unsafe_local_subprocess"])
async def test_disk_quota_bounds_what_a_run_adds_to_its_work_dir(backend: str) -> None:
    """RLIMIT_FSIZE caps each file, and nothing capped their sum: before, a run of FILL with a 3 s wall
    time wrote 826 MB into its work dir (788 files; at the default 20 s, gigabytes), and one of
    EMPTY_FILES made 148,601 files (an inode each), which counted as 0 bytes. Now the work dir is watched
    while the program runs, which is killed past ``disk_quota_mib``, and every entry counts at least a
    block. The unsafe backend runs through the one-shot launcher, bubblewrap through a started sandbox."""
    provider = {"backend": backend}
    limits = {"wall_time_s": 20, "file_size_mib": 4, "disk_quota_mib": 8}
    for code in (FILL, EMPTY_FILES):
        run = await run_in_sandbox(["python3", "-c", code], resources=limits, provider=provider)
        assert run.error_type == "disk_quota" and run.return_code == 137 and not run.timed_out, run
        assert (
            "[disk quota exceeded:" in run.stderr and "past its quota of 8 MiB; it was stopped]" in run.stderr
        )
    # Written faster than the watcher looks, and exited: counted when it ends, the same verdict.
    quick = "for i in range(3):\n    open(f'f{i}', 'wb').write(bytes(4 << 20))\nprint('wrote')"
    run = await run_in_sandbox(["python3", "-c", quick], resources=limits, provider=provider)
    assert run.error_type == "disk_quota" and not run.ok and "[disk quota exceeded:" in run.stderr, run
    # The caller's own files are not the run's: a 10 MB input under an 8 MiB quota, read and written less.
    reader = "data = open('in.bin', 'rb').read()\nopen('out.bin', 'wb').write(data[:1000])\nprint(len(data))"
    run = await run_in_sandbox(
        ["python3", "-c", reader], files={"in.bin": bytes(10 << 20)}, resources=limits, provider=provider
    )
    assert run.ok and run.stdout == f"{10 << 20}\n" and "disk quota" not in run.stderr, run


async def test_open_files_limit() -> None:
    code = "fs = []\ntry:\n    while True: fs.append(open('/dev/null'))\nexcept OSError as e:\n    print(len(fs), e.errno)"
    result = await run_in_sandbox(["python3", "-c", code], resources={"open_files": 40})
    count, err = result.stdout.split()
    assert int(count) < 40 and int(err) == 24  # EMFILE


async def test_numpy_sympy_scipy_are_importable() -> None:
    code = "import numpy, sympy, scipy.optimize\nprint(int(numpy.arange(5).sum()), sympy.factorint(360))"
    result = await run_in_sandbox(["python3", "-I", "-c", code])
    assert result.ok, result.stderr
    assert result.stdout.strip() == "10 {2: 3, 3: 2, 5: 1}"


async def test_work_dir_persists_between_execs_and_is_removed_at_stop() -> None:
    sandbox = AsyncSandbox(spec=SandboxSpec(files={"a/b.txt": "hi"}))
    await sandbox.start()
    host_dir = sandbox.host_workdir
    try:
        first = await sandbox.exec("cat a/b.txt && echo more > c.txt && pwd")
        assert first.stdout == "hi/sandbox\n"
        second = await sandbox.exec(["cat", "c.txt"])
        assert second.stdout == "more\n"
        assert await sandbox.read_file("c.txt") == b"more\n"
    finally:
        await sandbox.stop()
    assert not host_dir.exists()


async def test_missing_bubblewrap_is_refused_naming_the_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without bwrap: as on a machine without the package
    with pytest.raises(SandboxUnavailableError, match="bubblewrap") as info:
        check_sandbox_available()
    assert "apt-get install bubblewrap" in str(info.value) and "unsafe_local_subprocess" in str(info.value)
    with pytest.raises(SandboxUnavailableError):
        await run_in_sandbox(["true"])


async def test_unsafe_backend_needs_its_exact_name_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValidationError, match="unsafe_local_subprocess"):
        SandboxProviderConfig(backend="local")
    with caplog.at_level(logging.WARNING, logger="nemo_gym.sandbox"):
        result = await run_in_sandbox(
            ["python3", "-c", "import os; print(sorted(os.environ))"],
            provider={"backend": "unsafe_local_subprocess"},
        )
    assert result.ok and "SANDBOX DISABLED" in caplog.text
    assert "NEMO_GYM" not in result.stdout and "PATH" in result.stdout  # still an empty environment


async def test_bubblewrap_setup_failure_is_an_error_not_a_result() -> None:
    with pytest.raises(SandboxError, match="bubblewrap could not start.*nonexistent"):
        await run_in_sandbox(["true"], provider={"ro_binds": ["/nonexistent/nemo-gym-path"]})
    # A program that prints bwrap's words and exits 1 is still just a failing program.
    fake = "import sys; sys.stderr.write('bwrap: Can\\'t find source path'); sys.exit(1)"
    result = await run_in_sandbox(["python3", "-c", fake])
    assert result.return_code == 1 and result.stderr.startswith("bwrap: ")


async def test_pool_bounds_programs_at_once_and_queue_wait_is_bounded() -> None:
    me = psutil.Process()
    old = sandbox_api._SLOTS.limit
    sandbox_api._SLOTS.set_limit(2)
    bwrap._close_all_idle()  # idle sandboxes pre-started under an earlier pool size
    peak = peak_sandboxes = 0
    stop = asyncio.Event()

    async def watch() -> None:
        nonlocal peak, peak_sandboxes
        while not stop.is_set():
            running = sandboxes = 0
            for child in me.children():  # our direct children: each sandbox's outer bwrap
                try:
                    if child.name() == "bwrap":
                        sandboxes += 1
                        running += any("time.sleep" in " ".join(p.cmdline()) for p in child.children(True))
                except psutil.Error:  # exited meanwhile
                    pass
            peak, peak_sandboxes = max(peak, running), max(peak_sandboxes, sandboxes)
            await asyncio.sleep(0.02)

    try:
        watcher = asyncio.ensure_future(watch())
        results = await asyncio.gather(
            *(run_in_sandbox(["python3", "-c", "import time; time.sleep(0.4)"]) for _ in range(6))
        )
        stop.set()
        await watcher
        assert all(r.ok for r in results)
        assert 1 <= peak <= 2
        assert peak_sandboxes <= 4  # 2 running + at most 1 pre-started (idle) per slot
        busy = {"queue_timeout_s": 0.2}
        outcomes = await asyncio.gather(
            *(run_in_sandbox(["sleep", "2"], provider=busy) for _ in range(3)), return_exceptions=True
        )
        assert sum(isinstance(o, SandboxBusyError) for o in outcomes) == 1
        assert sum(not isinstance(o, BaseException) and o.ok for o in outcomes) == 2
    finally:
        stop.set()
        sandbox_api._SLOTS.set_limit(old)


async def test_cancelled_exec_leaves_nothing_running() -> None:
    me = psutil.Process()
    task = asyncio.ensure_future(run_in_sandbox(["sleep", "600"], resources={"wall_time_s": 600}))
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    def left() -> list[list[str]]:
        # The pre-started sandboxes for next runs are closed first (the starter thread may still be
        # adding one after the cancellation, so on every look): any bwrap left then is the run's.
        bwrap._close_all_idle()
        found = []
        for c in me.children(recursive=True):
            try:  # a zombie (an earlier test's unreaped child) has no command line: not running
                if c.status() != psutil.STATUS_ZOMBIE and c.name() in ("bwrap", "dash", "sleep"):
                    found.append(c.cmdline())
            except psutil.Error:
                pass
        return found

    for _ in range(100):
        if not left():
            break
        await asyncio.sleep(0.1)
    assert not left()
    assert os.getpid() == me.pid


def test_a_sandboxed_environment_refuses_to_start_without_bubblewrap(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    from nemo_gym.run.supervision.children import StartupError
    from nemo_gym.tools.testing import running_servers

    bin_dir = tmp_path / "bin"  # this machine's PATH minus bwrap
    bin_dir.mkdir()
    for directory in os.environ["PATH"].split(os.pathsep):
        if os.path.isdir(directory):
            for name in os.listdir(directory):
                if name != "bwrap" and not (bin_dir / name).exists():
                    (bin_dir / name).symlink_to(os.path.join(directory, name))
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(StartupError) as info:
        with running_servers(["resources_servers/code_gen/configs/code_gen.yaml"]):
            pass
    assert "'code_gen'" in str(info.value) and "apt-get install bubblewrap" in str(info.value), str(
        info.value
    )


async def test_root_without_a_pids_cgroup_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from nemo_gym.sandbox import backend_base, bwrap

    if os.geteuid() != 0:
        pytest.skip("the refusal applies to root only (RLIMIT_NPROC limits other users)")
    roots = {
        k: v for k, v in backend_base._BackendBase.cgroup_roots().items() if k != "pids"
    }  # as on a v2-only host
    monkeypatch.setattr(backend_base._BackendBase, "cgroup_roots", classmethod(lambda cls: roots))
    backend = bwrap.BubblewrapBackend(SandboxProviderConfig())
    with pytest.raises(SandboxUnavailableError, match="cannot limit processes"):
        backend.check()
