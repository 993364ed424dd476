"""What the process's worker pools are doing, counted where they do it and read by the metrics.

Contract
--------
* :data:`VERIFY_POOL` (the verify pool, :mod:`nemo_gym.kit.verify_pool`: local worker processes or Ray
  tasks) and :data:`SANDBOX_POOL` (the sandbox's slots, :mod:`nemo_gym.sandbox`) are process-wide
  :class:`PoolStats`: plain integers the pools update on their own event loop (no lock, no import of
  anything), read at scrape time by :mod:`nemo_gym.server.metrics` (``nemo_gym_pool_*{pool=...}``).
* ``size``: calls that may run at once (0 until the pool is first used, or on Ray where the cluster
  decides); ``busy``: calls running; ``queued``: calls waiting for a free worker or slot; ``calls``:
  calls finished, however; ``timeouts``: calls past their time bound (the verify pool's ``timeout``; a
  sandboxed program's wall or CPU limit); ``failures``: infrastructure failures (a worker that died, a
  sandbox that could not run the program); ``refused``: calls given up while queued (the sandbox's
  ``queue_timeout_s``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class PoolStats:
    """Counters and gauges of one pool (see the module docstring)."""

    size: int = 0
    busy: int = 0
    queued: int = 0
    calls: int = 0
    timeouts: int = 0
    failures: int = 0
    refused: int = 0

    def snapshot(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


VERIFY_POOL = PoolStats()
SANDBOX_POOL = PoolStats()
POOLS = {"verify": VERIFY_POOL, "sandbox": SANDBOX_POOL}
