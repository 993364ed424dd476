"""More records than memory should hold: an external merge sort, and a lookup table kept on disk.

Contract
--------
* :class:`SortedSpill` collects records (tuples of ints, floats, strings, bytes, bools and None: what
  :mod:`marshal` writes back exactly) and yields them in sorted order, as often as asked. At most
  ``max_in_memory`` records are held; beyond that, sorted runs go to temporary files and are merged
  ``fan_in`` at a time (a level at a time, so every record is rewritten O(log runs) times), so memory
  is O(``max_in_memory`` + ``fan_in`` x ``block``) whatever the number of records. Files live in a
  temporary directory (``TMPDIR``) created on the first spill and removed by :meth:`SortedSpill.close`
  (it is a context manager).
* :class:`DiskTable` maps non-negative integer keys to small non-negative integers (0: absent) in a
  sparse temporary file, read back through a bounded block cache: a lookup table as large as the
  keys, with memory O(cache). The first value set for a key stays (:meth:`DiskTable.set_first`).

Both exist so that the collector's bookkeeping and the aggregate metrics of a rollouts file stay
O(in flight) + O(distinct metric keys) in memory, not O(rows) (docs/concepts.md, "Memory at scale").
"""

from __future__ import annotations

import heapq
import marshal
import os
import shutil
import struct
import tempfile
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

DEFAULT_MAX_IN_MEMORY = 65_536
DEFAULT_FAN_IN = 64
DEFAULT_BLOCK = 256


class SortedSpill:
    """Records in, the same records sorted out; memory bounded (see the module docstring)."""

    def __init__(
        self, max_in_memory: int | None = None, fan_in: int | None = None, block: int | None = None
    ) -> None:
        # The module's defaults are read now (not when this was defined), so a test can make them small.
        self.max_in_memory = DEFAULT_MAX_IN_MEMORY if max_in_memory is None else max_in_memory
        self.fan_in = DEFAULT_FAN_IN if fan_in is None else fan_in
        self.block = DEFAULT_BLOCK if block is None else block
        if self.max_in_memory < 1 or self.fan_in < 2 or self.block < 1:
            raise ValueError("max_in_memory >= 1, fan_in >= 2 and block >= 1 are needed")
        self.count = 0
        self._buffer: list[tuple[Any, ...]] = []
        self._sorted = True
        self._levels: list[list[Path]] = []  # runs per merge level; level i+1 holds merges of level i
        self._dir: Path | None = None
        self._n_files = 0

    # -- writing ---------------------------------------------------------------------------------------
    def add(self, record: tuple[Any, ...]) -> None:
        """Add one record (a tuple that compares with the others)."""
        self._buffer.append(record)
        self._sorted = False
        self.count += 1
        if len(self._buffer) >= self.max_in_memory:
            self._spill()

    def _new_path(self) -> Path:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="ng_spill_"))
        self._n_files += 1
        return self._dir / f"run{self._n_files}"

    def _write(self, records: Iterable[tuple[Any, ...]]) -> Path:
        path = self._new_path()
        with open(path, "wb", buffering=1 << 16) as f:
            chunk: list[tuple[Any, ...]] = []
            for record in records:
                chunk.append(record)
                if len(chunk) >= self.block:
                    marshal.dump(chunk, f)
                    chunk = []
            if chunk:
                marshal.dump(chunk, f)
        return path

    @staticmethod
    def _read(path: Path) -> Iterator[tuple[Any, ...]]:
        with open(path, "rb", buffering=1 << 16) as f:
            while True:
                try:
                    chunk = marshal.load(f)
                except EOFError:
                    return
                yield from chunk

    def _spill(self) -> None:
        self._buffer.sort()
        run = self._write(self._buffer)
        self._buffer = []
        self._sorted = True
        level = 0
        while True:
            if len(self._levels) == level:
                self._levels.append([])
            self._levels[level].append(run)
            if len(self._levels[level]) < self.fan_in:
                return
            runs, self._levels[level] = self._levels[level], []
            run = self._write(heapq.merge(*(self._read(p) for p in runs)))
            for p in runs:
                p.unlink()
            level += 1

    # -- reading ---------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        """Every record, sorted (no record may be added while this runs)."""
        if not self._sorted:
            self._buffer.sort()
            self._sorted = True
        runs = [p for level in self._levels for p in level]  # the smaller runs first
        if not runs:
            return iter(self._buffer)
        while len(runs) >= self.fan_in:  # never more than fan_in files open at once: merge down first
            group, runs = runs[: self.fan_in], runs[self.fan_in :]
            runs.append(self._write(heapq.merge(*(self._read(p) for p in group))))
            for p in group:
                p.unlink()
        self._levels = [runs]
        return heapq.merge(*(self._read(p) for p in runs), iter(self._buffer))

    # -- the end ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove the temporary files (idempotent); the spill is empty afterwards."""
        self._buffer = []
        self._levels = []
        self.count = 0
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> SortedSpill:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DiskTable:
    """Small non-negative integers by non-negative integer key, on disk (see the module docstring).

    Keys at or above ``max_key`` (far beyond any row count) are kept in a dict instead, so a stray
    huge index cannot make a huge file."""

    _ENTRY = struct.Struct("<I")

    def __init__(self, block_entries: int = 16_384, cache_blocks: int = 32, max_key: int = 1 << 34) -> None:
        fd, name = tempfile.mkstemp(prefix="ng_table_")
        self._fd = fd
        os.unlink(name)  # gone when closed, also if this process dies
        self._block_entries = block_entries
        self._block_bytes = block_entries * self._ENTRY.size
        self._cache: OrderedDict[int, list[Any]] = OrderedDict()  # index -> [block, dirty]
        self._cache_blocks = cache_blocks
        self._max_key = max_key
        self._far: dict[int, int] = {}

    def _block(self, index: int, dirty: bool = False) -> bytearray:
        entry = self._cache.get(index)
        if entry is not None:
            self._cache.move_to_end(index)
        else:
            data = os.pread(self._fd, self._block_bytes, index * self._block_bytes)
            entry = self._cache[index] = [bytearray(data) + bytearray(self._block_bytes - len(data)), False]
            if len(self._cache) > self._cache_blocks:
                old, (old_block, old_dirty) = self._cache.popitem(last=False)
                if old_dirty:
                    os.pwrite(self._fd, old_block, old * self._block_bytes)
        if dirty:
            entry[1] = True
        return entry[0]

    def get(self, key: int) -> int:
        """The value of ``key``, 0 when none was set."""
        if key >= self._max_key:
            return self._far.get(key, 0)
        index, slot = divmod(key, self._block_entries)
        return self._ENTRY.unpack_from(self._block(index), slot * self._ENTRY.size)[0]

    def set_first(self, key: int, value: int) -> None:
        """Set ``key`` to ``value`` (1 .. 2**32-1) unless it already has a value."""
        if key < 0 or not 0 < value < 1 << 32:
            raise ValueError(f"key {key} must be >= 0 and value {value} in 1 .. 2**32-1")
        if key >= self._max_key:
            self._far.setdefault(key, value)
            return
        index, slot = divmod(key, self._block_entries)
        block = self._block(index)
        if not self._ENTRY.unpack_from(block, slot * self._ENTRY.size)[0]:
            self._block(index, dirty=True)
            self._ENTRY.pack_into(block, slot * self._ENTRY.size, value)

    def close(self) -> None:
        """Close (and so remove) the file (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._cache.clear()

    def __enter__(self) -> DiskTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
