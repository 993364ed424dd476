"""Event-loop lag: how late a periodic asyncio tick fires.

Contract
--------
* :class:`LoopLagMonitor` runs one task on the server's event loop that sleeps ``interval_s`` (100 ms)
  and observes ``actual - expected`` wake-up time (never negative) into a histogram. A handler that
  blocks the loop (a synchronous ``time.sleep``, a CPU-bound verifier) delays the tick by as long as it
  blocks, so the histogram shows it; a loop that is merely busy with many short callbacks shows a small lag.
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

    def __init__(self, observe: Callable[[float], None], interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.observe = observe
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
        while True:
            await asyncio.sleep(max(0.0, expected - loop.time()))
            now = loop.time()
            self.observe(max(0.0, now - expected))
            expected = now + interval  # from now: a long block gives one late tick, not a burst of them
