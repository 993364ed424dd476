"""The process-wide bound on sandboxed programs running at once (the pool's slots).

Contract
--------
* :data:`_SLOTS` holds the limit (default: the machine's CPUs; ``sandbox.max_concurrent`` sets it) and
  one ``asyncio.Semaphore`` per event loop; :func:`sandbox_pool_size` reads the limit. The API takes a
  slot per ``exec``; the bubblewrap backend keeps at most one idle pre-started sandbox per slot.
"""

from __future__ import annotations

import asyncio

from nemo_gym.kit.verify_pool.local import machine_cpu_count


class _Slots:
    """The process-wide bound on programs running at once (one semaphore per event loop)."""

    def __init__(self) -> None:
        self.limit = machine_cpu_count()
        self._sems: dict[int, asyncio.Semaphore] = {}

    def set_limit(self, limit: int) -> None:
        if limit != self.limit:
            self.limit = limit
            self._sems.clear()

    def semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        sem = self._sems.get(id(loop))
        if sem is None:
            self._sems = {id(loop): asyncio.Semaphore(self.limit)}
            sem = self._sems[id(loop)]
        return sem


_SLOTS = _Slots()


def sandbox_pool_size() -> int:
    return _SLOTS.limit
