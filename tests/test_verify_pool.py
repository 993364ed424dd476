"""nemo_gym.kit.verify_pool: results, errors, timeouts, crashes, the bound, the main thread, parent death.

The functions sent to the pool are standard-library ones so the spawned workers can import them.
"""

from __future__ import annotations

import asyncio
import math
import operator
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from nemo_gym.kit.verify_pool import (
    VerifyPool,
    VerifyPoolError,
    VerifyTimeoutError,
    VerifyWorkerCrashedError,
    machine_cpu_count,
)


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


async def test_result_and_reuse() -> None:
    pool = VerifyPool(max_workers=1)
    try:
        assert await pool.run(math.factorial, 20, timeout=30) == 2432902008176640000
        pid1 = await pool.run(os.getpid, timeout=30)
        pid2 = await pool.run(os.getpid, timeout=30)
        assert pid1 == pid2 != os.getpid()  # one worker, reused, not this process
    finally:
        pool.close()
    assert _gone(pid1)


async def test_runs_on_the_workers_main_thread() -> None:
    # signal.signal raises ValueError off the main thread: this is what math-verify's alarm needs.
    pool = VerifyPool(max_workers=1)
    try:
        previous = await pool.run(signal.signal, signal.SIGALRM, signal.SIG_IGN, timeout=30)
        assert previous == signal.SIG_DFL
    finally:
        pool.close()


async def test_function_exception_is_reraised_with_worker_traceback() -> None:
    pool = VerifyPool(max_workers=1)
    try:
        with pytest.raises(ValueError, match="invalid literal") as info:
            await pool.run(int, "not a number", timeout=30)
        assert any("in the verify worker" in note for note in getattr(info.value, "__notes__", []))
        assert await pool.run(abs, -3, timeout=30) == 3  # the worker survives an exception
    finally:
        pool.close()


async def test_timeout_kills_the_worker_and_pool_recovers() -> None:
    pool = VerifyPool(max_workers=1)
    try:
        pid = await pool.run(os.getpid, timeout=30)
        with pytest.raises(VerifyTimeoutError, match="timeout"):
            await pool.run(time.sleep, 60, timeout=0.5)
        assert _gone(pid)
        assert await pool.run(os.getpid, timeout=30) != pid  # a fresh worker
    finally:
        pool.close()


async def test_worker_crash_is_an_error_naming_the_status() -> None:
    pool = VerifyPool(max_workers=1)
    try:
        with pytest.raises(VerifyWorkerCrashedError, match="exit code 7"):
            await pool.run(os._exit, 7, timeout=30)
        with pytest.raises(VerifyWorkerCrashedError, match="SIGABRT"):
            await pool.run(os.abort, timeout=30)
        assert await pool.run(math.gcd, 12, 18, timeout=30) == 6
    finally:
        pool.close()


async def test_unpicklable_call_is_a_clear_error() -> None:
    pool = VerifyPool(max_workers=1)
    try:
        with pytest.raises(VerifyPoolError, match="not picklable"):
            await pool.run(lambda: 1, timeout=30)
        assert await pool.run(abs, -1, timeout=30) == 1
    finally:
        pool.close()


async def test_pool_is_bounded() -> None:
    pool = VerifyPool(max_workers=2)
    try:
        pids = await asyncio.gather(*(pool.run(os.getpid, timeout=60) for _ in range(12)))
        assert 1 <= len(set(pids)) <= 2
        assert len(pool.worker_pids()) <= 2
    finally:
        pool.close()
    assert VerifyPool().max_workers == machine_cpu_count()


async def test_cancelled_call_kills_its_worker() -> None:
    pool = VerifyPool(max_workers=1)
    try:
        pid = await pool.run(os.getpid, timeout=30)
        task = asyncio.ensure_future(pool.run(time.sleep, 60, timeout=120))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert _gone(pid)
    finally:
        pool.close()


def test_workers_die_with_their_parent() -> None:
    script = textwrap.dedent(
        """
        import asyncio, os, sys, time
        from nemo_gym.kit.verify_pool import VerifyPool
        async def main():
            pool = VerifyPool(max_workers=1)
            print(await pool.run(os.getpid, timeout=60), flush=True)
            await pool.run(time.sleep, 600, timeout=600)
        asyncio.run(main())
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(proc.stdout.readline())
        assert psutil.pid_exists(worker_pid)
        time.sleep(0.3)  # the worker is now sleeping inside the call
        proc.kill()  # no cleanup code runs in the parent
        proc.wait(timeout=10)
        assert _gone(worker_pid)
    finally:
        proc.kill()
        proc.wait(timeout=10)


async def test_warm_up_runs_once_per_worker_and_a_failing_one_is_only_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Servers warm every worker at start-up (math-verify, reasoning_gym import for seconds); the pool
    does it for them, keeping the tasks referenced and their failures out of the event loop's way."""
    pool = VerifyPool(max_workers=2)
    try:
        pids = await asyncio.gather(*pool.warm_up(os.getpid, timeout=30))
        assert len(pids) == 2 and os.getpid() not in pids
        assert set(pids) <= set(pool.worker_pids())  # the warmed workers stay, for the real checks
        failures = await asyncio.gather(*pool.warm_up(math.sqrt, -1.0, timeout=30), return_exceptions=True)
        assert all(isinstance(f, ValueError) for f in failures)
        await asyncio.sleep(0)  # done callbacks run
        assert "verify pool warm-up failed" in caplog.text
    finally:
        pool.close()


def test_a_large_argument_or_result_passes_after_the_first_call_under_uvloop() -> None:
    # The servers run on uvloop, whose add_reader leaves the worker's pipe non-blocking: a call or a result
    # larger than the pipe's buffer then failed with EAGAIN (a 503 for a model's 10 MB answer).
    uvloop = pytest.importorskip("uvloop")

    async def calls() -> None:
        pool = VerifyPool(max_workers=1)
        try:
            assert await pool.run(len, "a", timeout=30) == 1  # the worker's pipe has been polled once
            assert await pool.run(len, "C" * 10_000_000, timeout=30) == 10_000_000
            assert len(await pool.run(operator.mul, "x", 10_000_000, timeout=30)) == 10_000_000
            assert await pool.run(len, "b", timeout=30) == 1  # and the worker is still the pool's
        finally:
            pool.close()

    uvloop.run(calls())
