"""A per-process memo for functions that run in verify-pool workers or as Ray tasks.

Contract
--------
* ``ProcessCache(fn, maxsize)`` calls ``fn(*args)`` once per distinct (hashable) ``args`` in this process
  and keeps the last ``maxsize`` results; an exception is not cached (raised each time). ``hits``,
  ``misses``, ``len()`` and ``cache_clear()`` are there for tests.
* Pickled, it is the bare function: the process that unpickles it starts with an empty cache. Ray sends
  a function of a server run as a script by value, with the globals it uses; a ``functools.cache``
  wrapper among them would be pickled as a name of ``__main__`` that the Ray worker cannot import.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class ProcessCache(Generic[T]):
    """See the module docstring."""

    def __init__(self, fn: Callable[..., T], maxsize: int = 1024) -> None:
        self.fn = fn
        self.maxsize = maxsize
        self._items: OrderedDict[tuple[Hashable, ...], T] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __call__(self, *args: Hashable) -> T:
        try:
            value = self._items[args]
        except KeyError:
            self.misses += 1
            value = self.fn(*args)
            self._items[args] = value
            if len(self._items) > self.maxsize:
                self._items.popitem(last=False)
            return value
        self._items.move_to_end(args)
        self.hits += 1
        return value

    def cache_clear(self) -> None:
        self._items.clear()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    def __reduce__(self) -> tuple[Any, ...]:
        return (ProcessCache, (self.fn, self.maxsize))
