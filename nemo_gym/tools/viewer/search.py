"""Full-text search over a rollouts file: a bounded scan on its own thread, published as it goes.

Contract
--------
* :class:`SearchJob` scans the file's bytes in row-aligned blocks (``SEARCH_BLOCK_BYTES``) on its own
  worker thread and publishes matches as it goes; callers wait for it with a bound and get the matches
  found so far plus the progress. Matching is ASCII case-insensitive on the raw JSON line, also trying
  the text's JSON-escaped (and doubly escaped, as inside tool-call ``arguments``) forms
  (:func:`search_patterns`), so a search for ``"city": "Paris"`` or for text with quotes finds it.
"""

from __future__ import annotations

import bisect
import json
import os
import threading
import time
from typing import Any

import orjson

from nemo_gym.tools.viewer.index import RolloutIndex

SEARCH_BLOCK_BYTES = 4 << 20


# ------------------------------------------------------------------------------------------------
# Full-text search.


def search_patterns(text: str) -> list[bytes]:
    """Byte patterns (ASCII-lowercased) that find ``text`` in a raw JSON line: plain, escaped, doubly escaped."""
    out: list[bytes] = []
    forms = [text, orjson.dumps(text).decode()[1:-1], json.dumps(text)[1:-1]]
    forms.append(json.dumps(forms[1])[1:-1])  # as it appears inside a JSON string inside a JSON string
    for form in forms:
        b = form.encode("utf-8").lower()
        if b and b not in out:
            out.append(b)
    return out


class SearchJob:
    """A scan of one file for one text, on its own thread, publishing per-row matches as it goes."""

    def __init__(self, index: RolloutIndex, text: str) -> None:
        self.index = index
        self.text = text
        self.patterns = search_patterns(text)
        self.n_rows = len(index)
        self.generation = index.generation
        self.matches = bytearray(self.n_rows)
        self.scanned = 0  # rows [0, scanned) are decided
        self.n_matches = 0
        self.error: str | None = None
        self.done = threading.Event()
        self._cancel = threading.Event()
        self.started = time.monotonic()
        self.finished: float | None = None
        self.last_used = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"ng_viewer-search-{text[:20]}", daemon=True)

    def start(self) -> SearchJob:
        """Start the scan thread; returns self."""
        self._thread.start()
        return self

    def cancel(self) -> None:
        """Ask the scan to stop at the next block."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        """Whether the scan was asked to stop."""
        return self._cancel.is_set()

    def wait(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the scan to end; True when it has."""
        return self.done.wait(timeout)

    def status(self) -> dict[str, Any]:
        """Progress for the page."""
        return {
            "text": self.text,
            "done": self.done.is_set() and not self.cancelled,
            "scanned": self.scanned,
            "total": self.n_rows,
            "matches": self.n_matches,
            "error": self.error,
            "seconds": round((self.finished or time.monotonic()) - self.started, 3),
        }

    def _run(self) -> None:
        try:
            self._scan()
        except OSError as e:
            self.error = f"search stopped: cannot read {self.index.path}: {e.strerror or e}"
        finally:
            self.finished = time.monotonic()
            self.done.set()

    def _scan(self) -> None:
        offsets, lengths = self.index.columns["offset"], self.index.columns["length"]
        n = self.n_rows
        fd = os.open(self.index.path, os.O_RDONLY)
        try:
            i = 0
            while i < n:
                if self._cancel.is_set():
                    return
                j = i + 1
                start = offsets[i]
                while j < n and offsets[j] + lengths[j] - start <= SEARCH_BLOCK_BYTES:
                    j += 1
                end = offsets[j - 1] + lengths[j - 1]
                block = os.pread(fd, end - start, start).lower()
                found = 0
                for pat in self.patterns:
                    pos = block.find(pat)
                    while pos >= 0:
                        r = bisect.bisect_right(offsets, start + pos, i, j) - 1
                        row_end = offsets[r] + lengths[r] - start
                        if start + pos + len(pat) <= offsets[r] + lengths[r]:
                            if not self.matches[r]:
                                self.matches[r] = 1
                                found += 1
                            pos = block.find(pat, row_end)
                        else:  # between rows (a malformed or blank line): keep looking
                            pos = block.find(pat, pos + 1)
                self.n_matches += found
                self.scanned = j
                i = j
        finally:
            os.close(fd)
