"""Pre-started sandboxes (``sandbox.prestart``): started ahead, one run each, nothing carried between runs.

Each test goes through the public API (``run_in_sandbox`` / ``AsyncSandbox``) with real bubblewrap and
looks at the backend's idle pool only to name the sandbox that is to serve the next run.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from nemo_gym.sandbox import AsyncSandbox, SandboxProviderConfig, SandboxSpec, run_in_sandbox
from nemo_gym.sandbox.api import _backend_for

PROBE = textwrap.dedent(
    """
    import os, sys
    print("SAW_MARK", os.path.exists("/tmp/mark"), os.path.exists("leftover.txt"))
    print("PROCS", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
    print("FDS", sorted(int(f) for f in os.listdir("/proc/self/fd")))  # 3: the listing itself
    open("/tmp/mark", "w").write("x")
    if len(sys.argv) > 1:  # leave a daemon behind (own session, ignores SIGTERM)
        import subprocess
        subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"], start_new_session=True)
    """
)


def _cmdline(p: psutil.Process) -> list[str]:
    """A process's command line; [] for one that exited or is a zombie (an earlier test's unreaped child)."""
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _backend():
    return _backend_for(SandboxProviderConfig())


def _idle():
    return list(_backend()._idle_list())


async def _wait_idle(timeout_s: float = 30.0) -> list:
    """The idle pool once the starter thread has filled it (it starts the next sandbox after a run
    begins, so right after a short run it may still be on its way); empty if it never comes."""
    deadline = time.monotonic() + timeout_s
    while not (idle := _idle()) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return idle


async def test_each_run_gets_its_own_prestarted_sandbox_and_sees_nothing_of_the_last() -> None:
    first = await run_in_sandbox(["python3", "-I", "probe.py", "daemon"], files={"probe.py": PROBE})
    assert first.ok, first
    assert "SAW_MARK False False" in first.stdout
    idle = await _wait_idle()
    assert idle, "a run pre-starts the next run's sandbox"
    nxt = idle[0]
    assert nxt.alive()
    sandbox = AsyncSandbox(spec=SandboxSpec(files={"probe.py": PROBE}))
    async with sandbox:
        second = await sandbox.exec(["python3", "-I", "probe.py"])
        # It ran in the pre-started sandbox: that sandbox's fresh dir became the work dir...
        assert sandbox.host_workdir == nxt.bind_dir
        assert (sandbox.host_workdir / "probe.py").exists()
        # ...and that sandbox served this one run and is gone.
        assert nxt.finished and nxt.proc.poll() is not None and nxt not in _idle()
        third = await sandbox.exec(["python3", "-I", "probe.py"])  # same work dir, new sandbox again
    assert second.ok and third.ok, (second, third)
    # No /tmp of the last run, no daemon of the last run: its own pid namespace holds init and itself.
    assert "SAW_MARK False False" in second.stdout and "PROCS [1, 2]" in second.stdout
    # Nothing of the hand-over reaches the program: no shim pipe, no bwrap status fd, stdin /dev/null.
    assert "FDS [0, 1, 2, 3]" in second.stdout, second.stdout
    assert "SAW_MARK False False" in third.stdout and "PROCS [1, 2]" in third.stdout
    assert not any("time.sleep(600)" in " ".join(_cmdline(p)) for p in psutil.Process().children(True))


async def test_a_run_gets_its_own_limits_and_fresh_cgroup_counters_in_a_prestarted_sandbox() -> None:
    fork = "import os, time\nfor _ in range(40):\n    os.fork() or (time.sleep(2), os._exit(0))\n"
    # The next sandbox is pre-started with the default limits (512 MiB, 64 processes) ...
    await run_in_sandbox(["true"])
    assert await _wait_idle()
    # ... and this run's tighter limits are what hold in it.
    bomb = await run_in_sandbox(["python3", "-c", fork], resources={"processes": 8})
    assert bomb.pids_limit_hit and bomb.return_code != 0, bomb
    hog = "x = bytearray(300 << 20)\nprint(len(x))"
    assert await _wait_idle()
    oom = await run_in_sandbox(["python3", "-c", hog], resources={"memory_mib": 100})
    assert oom.oom_killed and oom.error_type == "oom", oom
    busy = await run_in_sandbox(["python3", "-c", "while True: pass"], resources={"cpu_time_s": 1})
    # RLIMIT_CPU counts scheduler ticks, the cgroup counts nanoseconds: on a loaded machine the cgroup read
    # 0.89 s for a 1 s limit, so the kill itself is checked exactly and the counter with room for ticks.
    assert busy.timed_out and busy.return_code == 128 + signal.SIGXCPU, busy
    assert busy.cpu_time_s is not None and busy.cpu_time_s >= 0.75, busy
    # The next run starts from zero: no process-limit event, no OOM kill, no CPU time of the last runs.
    after = await run_in_sandbox(["python3", "-c", hog], resources={"memory_mib": 400})
    assert after.ok and after.stdout == f"{300 << 20}\n", after
    assert not after.pids_limit_hit and not after.oom_killed, after
    # CPU time is read from a fresh counter (the busy run above left >= 0.75 s in its own): a program that
    # does nothing reads far less (a 300 MiB allocation may itself take ~1 s of CPU on a loaded machine).
    idle = await run_in_sandbox(["python3", "-c", "pass"])
    assert idle.ok and idle.cpu_time_s is not None and idle.cpu_time_s < 0.5, idle


async def test_stdin_env_and_cwd_reach_the_program_of_a_prestarted_sandbox() -> None:
    await run_in_sandbox(["true"])
    code = (
        "import os, sys; print(repr(sys.stdin.read()), os.environ.get('A-B'), os.environ['X'], os.getcwd())"
    )
    sandbox = AsyncSandbox(spec=SandboxSpec(files={"sub/p.py": code}))
    async with sandbox:
        env = {"X": "line1\nline2 'q' $HOME", "A-B": "odd name"}
        no_stdin = await sandbox.exec(["python3", "/sandbox/sub/p.py"], env=env, cwd="/sandbox/sub")
        with_stdin = await sandbox.exec(["python3", "sub/p.py"], stdin="in\nput\n", env={"X": "y"})
    assert no_stdin.stdout == "'' odd name line1\nline2 'q' $HOME /sandbox/sub\n", no_stdin
    assert with_stdin.stdout == "'in\\nput\\n' None y /sandbox\n", with_stdin
    argv = ["/bin/sh", "-c", 'printf "%s|" "$@"', "sh", "a b", "c\nd", "", "'$(x)'"]
    quoted = await run_in_sandbox(argv)
    assert quoted.stdout == "a b|c\nd||'$(x)'|", quoted
    # A long command (sent length-prefixed) leaves the program's stdin whole, to the byte.
    data = "".join(f"{i}\n" for i in range(50_000))
    for n in (100, 100_000):
        long = await run_in_sandbox(
            ["/bin/sh", "-c", f"x='{'+' * n}'; echo ${{#x}}; wc -c", "sh"], stdin=data
        )
        assert long.stdout == f"{n}\n{len(data)}\n", (n, long)


def test_idle_sandboxes_die_with_their_process_on_exit_and_on_sigkill(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import asyncio, os, sys, time
        from nemo_gym.sandbox import run_in_sandbox
        from nemo_gym.sandbox.api import _backend_for, SandboxProviderConfig
        backend = _backend_for(SandboxProviderConfig())

        async def run_then_wait_for_the_prestart():
            await run_in_sandbox(["true"])
            for _ in range(200):  # the next sandbox is pre-started in the background: wait for it (bounded)
                if backend._idle_list():
                    return
                await asyncio.sleep(0.05)

        asyncio.run(run_then_wait_for_the_prestart())
        idle = backend._idle_list()
        print(" ".join(str(w.proc.pid) for w in idle), " ".join(str(w.bind_dir) for w in idle), flush=True)
        if sys.argv[1] == "hang":
            time.sleep(600)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for mode in ("exit", "hang"):
        proc = subprocess.Popen(
            [sys.executable, "-c", script, mode], stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path
        )
        try:
            line = proc.stdout.readline().split()
            assert len(line) == 2, line  # one idle sandbox: its outer bwrap's pid and its fresh dir
            pid, bind_dir = int(line[0]), Path(line[1])
            tree: list[int] = []
            if mode == "hang":
                deadline = time.monotonic() + 10
                while len(tree) < 3:  # outer bwrap, the namespace's init, the waiting shim
                    assert time.monotonic() < deadline, tree
                    time.sleep(0.02)
                    tree = [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
                proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            proc.kill()
            proc.wait()
        deadline = time.monotonic() + 10
        while any(
            psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in [pid, *tree]
        ):
            assert time.monotonic() < deadline, f"{mode}: pre-started sandbox outlived its process"
            time.sleep(0.05)
        if mode == "exit":  # a clean exit also removes its dir (a SIGKILLed process cannot)
            assert not bind_dir.exists()


async def test_prestart_false_starts_each_sandbox_at_its_exec() -> None:
    provider = {"prestart": False}
    backend = _backend_for(SandboxProviderConfig(prestart=False))
    result = await run_in_sandbox(["python3", "-c", "print(6 * 7)"], provider=provider)
    await asyncio.sleep(0)  # a refill would be scheduled by now
    assert result.stdout == "42\n" and backend._idle_list() == []


async def test_dirs_left_by_a_killed_process_are_swept_by_the_next(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs
    dead = tmp_path / f"nemo-gym-sandbox-prestart-{gone.pid}-abc"
    dead_trash = tmp_path / f".nemo-gym-sandbox-prestart-{gone.pid}-def.removed"
    live = tmp_path / f"nemo-gym-sandbox-prestart-{os.getppid()}-ghi"  # a running process's: kept
    for d in (dead, dead_trash, live):
        (d / "sub").mkdir(parents=True)
    result = await run_in_sandbox(["true"], provider={"workdir_root": str(tmp_path)})
    assert result.ok
    deadline = time.monotonic() + 10
    while dead.exists() or dead_trash.exists():
        assert time.monotonic() < deadline, sorted(p.name for p in tmp_path.iterdir())
        await asyncio.sleep(0.05)
    assert live.exists()
    backend = _backend_for(SandboxProviderConfig(workdir_root=str(tmp_path)))
    backend.close_idle()
