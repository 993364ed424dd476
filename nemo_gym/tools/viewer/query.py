"""Filters, sort orders and paging of the viewer's queries, and the numbers its summaries show.

Contract
--------
* :class:`Filters` is one query's filter set (parsed from the request by the app); a bad value raises
  :class:`QueryError` naming the parameter and why (the app answers 400 with it).
* Pages are bounded (``MAX_PAGE`` rows); sorts take only the listed keys; :func:`histogram` is at most
  ``HIST_BINS`` bins (or the distinct values, when there are few).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_PAGE = 1000
HIST_MAX_DISTINCT = 12
HIST_BINS = 20
EPS = 1e-9

ROW_SORT_KEYS = (
    "row",
    "line_no",
    "reward",
    "task",
    "rollout",
    "agent",
    "turns",
    "tool_calls",
    "tool_errors",
    "input_tokens",
    "output_tokens",
    "total_tokens",
)
TASK_SORT_KEYS = (
    "task",
    "rollouts",
    "passed",
    "pass_rate",
    "mean_reward",
    "std_reward",
    "mean_turns",
    "mean_tool_calls",
    "mean_tokens",
    "error_rollouts",
)
COMPARE_SORT_KEYS = ("task", "n_a", "mean_a", "pass_a", "n_b", "mean_b", "pass_b", "delta", "delta_pass")


class QueryError(ValueError):
    """A filter or sort parameter is not valid; the message says which and why."""


# ------------------------------------------------------------------------------------------------
# Filters.


def parse_task_spec(spec: str) -> tuple[tuple[int, int], ...]:
    """``"3, 5, 10-20"`` -> inclusive ranges ((3, 3), (5, 5), (10, 20))."""
    ranges: list[tuple[int, int]] = []
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        lo_s, sep, hi_s = part.partition("-")
        try:
            lo = int(lo_s)
            hi = int(hi_s) if sep else lo
        except ValueError:
            raise QueryError(
                f"task filter {spec!r}: {part!r} is not a task index or a range like 10-20"
            ) from None
        if hi < lo:
            raise QueryError(f"task filter {spec!r}: range {part!r} is empty")
        ranges.append((lo, hi))
    return tuple(ranges)


@dataclass(frozen=True)
class Filters:
    """What the run list is narrowed to; every field optional."""

    reward_min: float | None = None
    reward_max: float | None = None
    tasks: tuple[tuple[int, int], ...] | None = None
    agent: str | None = None
    errors_only: bool = False
    text: str = ""

    def structural(self) -> tuple[Any, ...]:
        """The filters other than the text search (a cache key)."""
        return (self.reward_min, self.reward_max, self.tasks, self.agent, self.errors_only)


# ------------------------------------------------------------------------------------------------
# Small numeric helpers.


def finite(x: float) -> bool:
    return not math.isnan(x)


def mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    m = math.fsum(values) / len(values)
    return m, math.sqrt(math.fsum((v - m) ** 2 for v in values) / len(values))


def histogram(values: Sequence[float]) -> dict[str, Any]:
    """Bars for the reward histogram: one per distinct value when there are few, else equal-width bins."""
    if not values:
        return {"kind": "empty", "bins": []}
    distinct = Counter(values)
    if len(distinct) <= HIST_MAX_DISTINCT:
        return {
            "kind": "values",
            "bins": [{"lo": v, "hi": v, "label": f"{v:g}", "count": c} for v, c in sorted(distinct.items())],
        }
    lo, hi = min(values), max(values)
    width = (hi - lo) / HIST_BINS
    counts = [0] * HIST_BINS
    for v in values:
        k = min(HIST_BINS - 1, int((v - lo) / width))
        counts[k] += 1
    return {
        "kind": "bins",
        "bins": [
            {
                "lo": lo + k * width,
                "hi": lo + (k + 1) * width,
                "label": f"{lo + k * width:.3g}–{lo + (k + 1) * width:.3g}",
                "count": c,
            }
            for k, c in enumerate(counts)
        ],
    }


def sort_page(
    rows: list[dict[str, Any]], sort: str, desc: bool, offset: int, limit: int
) -> list[dict[str, Any]]:
    """Sort rows by the numeric field ``sort`` (missing values last in either direction); cut one page."""

    def key(r: dict[str, Any]) -> tuple[int, float]:
        v = r.get(sort)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return (1, 0.0)
        return (0, -float(v) if desc else float(v))

    return sorted(rows, key=key)[offset : offset + limit]


def check_page(offset: int, limit: int) -> None:
    if offset < 0:
        raise QueryError("offset must be >= 0")
    if not 1 <= limit <= MAX_PAGE:
        raise QueryError(f"limit must be between 1 and {MAX_PAGE}")
