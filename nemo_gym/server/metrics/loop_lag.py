"""Event-loop lag: how late a periodic asyncio tick fires.

Contract
--------
* :class:`LoopLagMonitor` runs one task on the server's event loop that sleeps ``interval_s`` (100 ms)
  and observes ``actual - expected`` wake-up time (never negative) into a histogram. A handler that
  blocks the loop (a synchronous ``time.sleep``, a CPU-bound verifier) delays the tick by as long as it
  blocks, so the histogram shows it; a loop that is merely busy with many short callbacks shows a small lag.
* With ``observe_blocked`` it also observes how much of that lateness the loop was **blocked**: the lag
  less the time the loop's thread waited for a CPU over the same interval (the run-queue wait the kernel
  counts per thread, ``/proc/thread-self/schedstat``). A handler that runs or sleeps on the loop adds to
  it; a machine busy with other work (the scheduler not running the thread) does not. Where schedstat
  is not readable the blocked time is the lag itself.
* Started on app start-up and cancelled on shutdown (:func:`nemo_gym.server.metrics.install.install_metrics`
  wraps the app's lifespan); an app served without lifespan events (the head server) starts it on its
  first request. ``start`` is idempotent; ``stop`` waits for the task to end.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

DEFAULT_INTERVAL_S = 0.1


class LoopLagMonitor:
    """See the module docstring. ``observe``: called with each tick's lag in seconds."""

    def __init__(
        self,
        observe: Callable[[float], None],
        interval_s: float = DEFAULT_INTERVAL_S,
        observe_blocked: Callable[[float], None] | None = None,
    ) -> None:
        self.observe = observe
        self.observe_blocked = observe_blocked
        self.interval_s = interval_s
        self.task: asyncio.Task[None] | None = None  # the tick, while it runs

    @property
    def started(self) -> bool:
        return self.task is not None

    def start(self) -> None:
        """Start ticking on the running event loop (a no-op when already started)."""
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run(), name="nemo_gym-loop-lag")

    async def stop(self) -> None:
        """Cancel the tick and wait for it to end."""
        task, self.task = self.task, None
        if task is None or task.done():
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.interval_s
        expected = loop.time() + interval
        waited = run_queue_wait_s() if self.observe_blocked is not None else None
        while True:
            await asyncio.sleep(max(0.0, expected - loop.time()))
            now = loop.time()
            lag = max(0.0, now - expected)
            self.observe(lag)
            if self.observe_blocked is not None:
                before, waited = waited, run_queue_wait_s()
                queued = waited - before if waited is not None and before is not None else 0.0
                self.observe_blocked(max(0.0, lag - queued))
            expected = now + interval  # from now: a long block gives one late tick, not a burst of them


def run_queue_wait_s() -> float | None:
    """Seconds this thread has waited on a run queue (runnable, no CPU given), or None where unknown."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None
