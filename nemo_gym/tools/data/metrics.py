"""Per-dataset aggregate metrics in upstream NeMo Gym's ``*_metrics.json`` shape.

Contract
--------
* :class:`Stat` is a running numeric summary, serialised as ``{"Total # non-null values", "Average",
  "Min", "Max", "Standard deviation"}`` (sample standard deviation, 0 when fewer than two values;
  floats rounded to 2 decimals when ``|x| >= 1`` else 3; no values: everything 0). Two stats merge
  exactly (parallel mean/M2 update), so a dataset type's aggregate equals one pass over all its rows.
* :class:`DatasetMetrics` observes validated rows: ``Number of examples``, ``Number of tools`` (rows
  with ``tools``), ``Json-dumped number of words (proxy for token count)`` (whitespace-split words of
  the JSON of ``responses_create_params``), ``Number of turns`` (user messages; a string input is one),
  ``Temperature`` (when set); every other top-level field except ``responses_create_params`` and
  ``response``: numbers and booleans (and lists of them) as a :class:`Stat` under the field name,
  strings as ``{"unique_count", "total_count"}``.
* :func:`same_metrics` is upstream's conflict rule: every old key still present, numbers equal within
  5e-3 (``|x| >= 1``) or 5e-4, lists equal as multisets; new keys are allowed.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

EXAMPLES_KEY = "Number of examples"
TOOLS_KEY = "Number of tools"
WORDS_KEY = "Json-dumped number of words (proxy for token count)"
TURNS_KEY = "Number of turns"
TEMPERATURE_KEY = "Temperature"
SKIPPED_FIELDS = ("responses_create_params", "response")


def _round(x: float) -> float:
    return round(x, 2) if abs(x) >= 1 else round(x, 3)


class Stat:
    """Running count / mean / M2 / min / max of numbers."""

    __slots__ = ("n", "mean", "m2", "lo", "hi")

    def __init__(self) -> None:
        self.n = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.lo = math.inf
        self.hi = -math.inf

    def observe(self, x: float) -> None:
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)
        self.lo, self.hi = min(self.lo, x), max(self.hi, x)

    def merge(self, other: Stat) -> None:
        if other.n == 0:
            return
        n = self.n + other.n
        delta = other.mean - self.mean
        self.m2 += other.m2 + delta * delta * self.n * other.n / n
        self.mean += delta * other.n / n
        self.n = n
        self.lo, self.hi = min(self.lo, other.lo), max(self.hi, other.hi)

    def to_json(self) -> dict[str, Any]:
        if self.n == 0:
            zero = {"Average": 0.0, "Min": 0.0, "Max": 0.0, "Standard deviation": 0.0}
            return {"Total # non-null values": 0, **zero}
        std = math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else 0.0
        return {
            "Total # non-null values": self.n,
            "Average": _round(self.mean),
            "Min": _round(float(self.lo)),
            "Max": _round(float(self.hi)),
            "Standard deviation": _round(std),
        }


class DatasetMetrics:
    """Metrics of the rows of one dataset (or, merged, of every dataset of one type)."""

    def __init__(self) -> None:
        self.examples = 0
        self.fixed = {key: Stat() for key in (TOOLS_KEY, WORDS_KEY, TURNS_KEY, TEMPERATURE_KEY)}
        self.other: dict[str, Stat | Counter[str]] = {}

    def observe(self, row: dict[str, Any]) -> None:
        """Add one (already validated) row."""
        self.examples += 1
        params = row.get("responses_create_params") or {}
        if params.get("tools") is not None:
            self.fixed[TOOLS_KEY].observe(len(params["tools"]))
        self.fixed[WORDS_KEY].observe(len(json.dumps(params).split()))
        raw = params.get("input")
        items = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw or []
        turns = sum(1 for item in items if isinstance(item, dict) and item.get("role") == "user")
        if turns:
            self.fixed[TURNS_KEY].observe(turns)
        if params.get("temperature") is not None:
            self.fixed[TEMPERATURE_KEY].observe(float(params["temperature"]))
        for key, value in row.items():
            if key in SKIPPED_FIELDS:
                continue
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, bool):
                    item = int(item)
                if isinstance(item, int | float):
                    stat = self.other.setdefault(key, Stat())
                    if isinstance(stat, Stat):
                        stat.observe(float(item))
                elif isinstance(item, str):
                    counts = self.other.setdefault(key, Counter())
                    if isinstance(counts, Counter):
                        counts[item] += 1

    def merge(self, other: DatasetMetrics) -> None:
        self.examples += other.examples
        for key, stat in other.fixed.items():
            self.fixed[key].merge(stat)
        for key, value in other.other.items():
            mine = self.other.get(key)
            if mine is None:
                mine = self.other[key] = Stat() if isinstance(value, Stat) else Counter()
            if isinstance(mine, Stat) and isinstance(value, Stat):
                mine.merge(value)
            elif isinstance(mine, Counter) and isinstance(value, Counter):
                mine.update(value)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {EXAMPLES_KEY: self.examples}
        out.update({key: stat.to_json() for key, stat in self.fixed.items()})
        for key, value in self.other.items():
            if isinstance(value, Stat):
                out[key] = value.to_json()
            else:
                out[key] = {"unique_count": len(value), "total_count": sum(value.values())}
        return out


def _same(old: Any, new: Any) -> bool:
    if isinstance(old, bool) or isinstance(new, bool):
        return old == new
    if isinstance(old, int | float) and isinstance(new, int | float):
        tolerance = 5e-3 if abs(old) >= 1 else 5e-4
        return abs(old - new) <= tolerance
    if isinstance(old, dict) and isinstance(new, dict):
        return all(key in new and _same(value, new[key]) for key, value in old.items())
    if isinstance(old, list) and isinstance(new, list):
        dump = lambda v: json.dumps(v, sort_keys=True)  # noqa: E731
        return Counter(map(dump, old)) == Counter(map(dump, new))
    return old == new


def same_metrics(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Upstream's rule for "the metrics did not change" (see the module docstring)."""
    return _same(old, new)
