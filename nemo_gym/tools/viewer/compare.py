"""Two rollouts files side by side: per-task reward and pass rate, and their difference."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from nemo_gym.tools.viewer.dataset import Dataset
from nemo_gym.tools.viewer.query import COMPARE_SORT_KEYS, EPS, QueryError, check_page, sort_page
from nemo_gym.tools.viewer.row_facts import NO_INDEX

# ------------------------------------------------------------------------------------------------
# Comparing two files.


def compare(
    a: Dataset, b: Dataset, sort: str, desc: bool, offset: int, limit: int, only: str = "all"
) -> dict[str, Any]:
    """Per-task reward of ``a`` and ``b`` side by side (delta = b - a), with totals; one sorted page."""
    if sort not in COMPARE_SORT_KEYS:
        raise QueryError(
            f"cannot sort the comparison by {sort!r}; choose one of {', '.join(COMPARE_SORT_KEYS)}"
        )
    if only not in ("all", "changed", "improved", "regressed", "only_a", "only_b"):
        raise QueryError("only must be one of all, changed, improved, regressed, only_a, only_b")
    check_page(offset, limit)
    ta, tb = a.task_stats(), b.task_stats()
    rows: list[dict[str, Any]] = []
    improved = regressed = same = prompt_mismatch = 0
    common_a: list[float] = []
    common_b: list[float] = []
    for t in sorted(set(ta) | set(tb)):
        x, y = ta.get(t), tb.get(t)
        delta = delta_pass = None
        mismatch = False
        if x is not None and y is not None:
            if x["mean_reward"] is not None and y["mean_reward"] is not None:
                delta = y["mean_reward"] - x["mean_reward"]
                common_a.append(x["mean_reward"])
                common_b.append(y["mean_reward"])
                if delta > EPS:
                    improved += 1
                elif delta < -EPS:
                    regressed += 1
                else:
                    same += 1
            if x["pass_rate"] is not None and y["pass_rate"] is not None:
                delta_pass = y["pass_rate"] - x["pass_rate"]
            mismatch = x["preview"] != y["preview"]
            prompt_mismatch += mismatch
        rows.append(
            {
                "task": t if t != NO_INDEX else None,
                "n_a": x["rollouts"] if x else None,
                "mean_a": x["mean_reward"] if x else None,
                "pass_a": x["pass_rate"] if x else None,
                "n_b": y["rollouts"] if y else None,
                "mean_b": y["mean_reward"] if y else None,
                "pass_b": y["pass_rate"] if y else None,
                "delta": delta,
                "delta_pass": delta_pass,
                "prompt_differs": mismatch,
                "preview": (x or y or {}).get("preview", ""),
                "preview_b": y["preview"] if (y and mismatch) else None,
            }
        )
    in_a = set(ta) - set(tb)
    in_b = set(tb) - set(ta)
    filters: dict[str, Callable[[dict[str, Any]], bool]] = {
        "all": lambda r: True,
        "changed": lambda r: r["delta"] is not None and abs(r["delta"]) > EPS,
        "improved": lambda r: r["delta"] is not None and r["delta"] > EPS,
        "regressed": lambda r: r["delta"] is not None and r["delta"] < -EPS,
        "only_a": lambda r: r["n_b"] is None,
        "only_b": lambda r: r["n_a"] is None,
    }
    chosen = [r for r in rows if filters[only](r)]
    mean_a = math.fsum(common_a) / len(common_a) if common_a else None
    mean_b = math.fsum(common_b) / len(common_b) if common_b else None
    return {
        "a": a.status(),
        "b": b.status(),
        "tasks_both": len(common_a),
        "tasks_only_a": len(in_a),
        "tasks_only_b": len(in_b),
        "mean_a": mean_a,
        "mean_b": mean_b,
        "mean_delta": (mean_b - mean_a) if mean_a is not None and mean_b is not None else None,
        "improved": improved,
        "regressed": regressed,
        "unchanged": same,
        "prompt_mismatches": prompt_mismatch,
        "total": len(chosen),
        "offset": offset,
        "rows": sort_page(chosen, sort, desc, offset, limit),
    }
