"""A total disk bound on the dirs model-run code writes to the host's disk: a one-shot run's work dir
(:mod:`nemo_gym.sandbox.backend_base`, :mod:`nemo_gym.sandbox.warm`) and a notebook kernel's work dir
(``resources_servers/aviary/notebook_app.py``). RLIMIT_FSIZE caps each file; this caps their sum.

Contract
--------
* :func:`dirs_bytes` is what the dirs hold for the quota, walked by directory fds
  (:func:`nemo_gym.sandbox.trees.tree_bytes`: any depth and path length, never through a symlink, dirs the
  code locked from their owner opened for the walk): a regular file counts what it can become (its size
  even where it is sparse), and every entry at least :data:`ENTRY_BYTES` (an inode: a flood of empty
  files fills a file system's inode table as surely as data fills its blocks). A tree moved under the walk
  three times in a row counts as past any quota (the only way left to write under it unseen).
* :func:`used_bytes` is the same, walked on the event loop when the dirs are small (a thread hop costs more
  than a few dozen ``lstat``) and in a thread otherwise.
* :func:`watch` polls every :data:`POLL_S` until the dirs hold more than ``limit`` bytes, then calls
  ``over(used)`` once and returns. The caller cancels it when the program ends and counts once more then
  (a program that wrote past the quota between two polls and exited is past it all the same).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from nemo_gym.sandbox import trees

POLL_S = 0.5
ENTRY_BYTES = 4096  # what every entry counts at least: one block (an empty file still takes an inode)
_SMALL = 64  # entries walked on the event loop


def _walk(path: Path, max_entries: int | None) -> int | None:
    for _ in range(3):
        try:
            return trees.tree_bytes(path, max_entries, min_entry_bytes=ENTRY_BYTES)
        except trees.TreeChangedError:
            continue
    return sys.maxsize


def dirs_bytes(paths: Sequence[Path]) -> int:
    """What ``paths`` hold for the quota (a missing dir holds 0)."""
    return sum(_walk(p, None) or 0 for p in paths)


async def used_bytes(paths: Sequence[Path]) -> int:
    """:func:`dirs_bytes`, on the event loop while the dirs are small, else in a thread."""
    total = 0
    for path in paths:
        small = _walk(path, _SMALL)
        total += small if small is not None else (await asyncio.to_thread(_walk, path, None) or 0)
    return total


async def watch(paths: Sequence[Path], limit: int, over: Callable[[int], None]) -> None:
    """Every :data:`POLL_S`: once ``paths`` hold more than ``limit`` bytes, ``over(used)`` and return."""
    while True:
        await asyncio.sleep(POLL_S)
        used = await used_bytes(paths)
        if used > limit:
            over(used)
            return


def note(written: int, quota: int, *, stopped: bool, where: str = "its work dir") -> str:
    """The marker line a program's stderr (or a cell's output) ends with past the quota."""
    end = "; it was stopped" if stopped else ""
    return (
        f"\n[disk quota exceeded: {written / 2**20:.1f} MiB written to {where}, past its quota of "
        f"{quota / 2**20:g} MiB{end}]\n"
    )
