"""A stop request that a signal handler may raise.

Contract
--------
:class:`StopFlag` has the part of ``threading.Event``'s interface the launchers use (``set``,
``is_set``, ``wait``), and ``set`` takes no lock. ``threading.Event.set`` acquires the event's
condition lock; a signal handler runs on the main thread between two bytecodes, so a SIGINT arriving
while the main thread itself holds that lock (entering or leaving ``Event.wait``) makes the handler
wait for a lock its own thread holds: ``ng_run`` then never stops. ``wait`` polls in short sleeps
(``time.sleep`` resumes after a handler runs), so a stop is seen within :data:`POLL_S`.
"""

from __future__ import annotations

import time

POLL_S = 0.05


class StopFlag:
    """See the module docstring."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True  # one store: no lock, safe in a signal handler

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """Return once set (True) or after ``timeout`` seconds (False)."""
        deadline = time.monotonic() + timeout
        while not self._set:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, POLL_S))
        return True
