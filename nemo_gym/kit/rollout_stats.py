"""Statistics over a rollouts JSONL file: aggregate metrics, per-task pass@k, reward profiling.

Contract
--------
Everything here reads a rollouts file as a stream (one JSON object per line, as written by
``ng_collect_rollouts``) and never needs the servers. A line that does not parse is counted and
skipped, never fatal. A rollout "passes" when its reward is at least ``pass_threshold``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

INDEX_FIELDS = {"_ng_task_index", "_ng_rollout_index"}
MAX_PER_TASK_IN_METRICS = 10_000


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object or None when the line is malformed) for each non-empty line."""
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield line_no, orjson.loads(line)
            except orjson.JSONDecodeError:
                yield line_no, None


class RunningStat:
    """Count, mean and standard deviation without keeping the values (Welford)."""

    __slots__ = ("n", "mean", "_m2")

    def __init__(self) -> None:
        self.n, self.mean, self._m2 = 0, 0.0, 0.0

    def add(self, x: float) -> None:
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self._m2 += delta * (x - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self._m2 / self.n) if self.n else 0.0


def k_values(max_k: int) -> list[int]:
    """The k reported for pass@k: powers of two below ``max_k``, then ``max_k`` (1, 2, 4, ..., max_k)."""
    out, k = [], 1
    while k < max_k:
        out.append(k)
        k *= 2
    if max_k >= 1:
        out.append(max_k)
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c passing: 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        return float("nan")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _numeric(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _task_index(row: dict[str, Any]) -> int | None:
    """The row's ``_ng_task_index`` (-1 when absent), or None when it is present but not an integer."""
    value = row.get("_ng_task_index", -1)
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def _usage(row: dict[str, Any]) -> dict[str, Any]:
    response = row.get("response")
    usage = response.get("usage") if isinstance(response, dict) else None
    return usage if isinstance(usage, dict) else {}


class ScoredRows:
    """The rows of a rollouts file that have a task index and a numeric reward; counts the others.

    Iterate once: yields ``(task_index, reward, row)``; ``malformed`` holds the count afterwards.
    """

    def __init__(self, path: Path):
        self.path = path
        self.malformed = 0

    def __iter__(self) -> Iterator[tuple[int, float, dict[str, Any]]]:
        for _, row in iter_jsonl(self.path):
            task = _task_index(row) if isinstance(row, dict) else None
            reward = _numeric(row.get("reward")) if isinstance(row, dict) else None
            if task is None or reward is None:
                self.malformed += 1
                continue
            yield task, reward, row


def per_task_rewards(path: Path) -> tuple[dict[int, list[float]], int]:
    """Rewards grouped by ``_ng_task_index`` (rollout order), and the count of malformed lines."""
    tasks: dict[int, list[float]] = defaultdict(list)
    rows = ScoredRows(path)
    for task, reward, _ in rows:
        tasks[task].append(reward)
    return tasks, rows.malformed


def task_profile(rewards: list[float], max_k: int, pass_threshold: float) -> dict[str, Any]:
    """Count, passes, mean/std reward and pass@k (k in :func:`k_values`, k <= count) of one task."""
    n = len(rewards)
    c = sum(r >= pass_threshold for r in rewards)
    mean = sum(rewards) / n if n else 0.0
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n) if n else 0.0
    out: dict[str, Any] = {"num_rollouts": n, "num_passed": c, "mean_reward": mean, "std_reward": std}
    for k in k_values(max_k):
        if k <= n:
            out[f"pass@{k}"] = pass_at_k(n, c, k)
    return out


def task_row_fields(path: Path) -> dict[int, frozenset[str]]:
    """The top-level field names of each task row of a materialized-inputs file, by ``_ng_task_index``.

    Lines that do not parse or carry no integer task index are skipped (the collector wrote the file).
    """
    fields: dict[int, frozenset[str]] = {}
    shared: dict[frozenset[str], frozenset[str]] = {}  # one set per distinct shape, not per row
    for _, row in iter_jsonl(path):
        if not isinstance(row, dict):
            continue
        task = _task_index(row)
        if task is None or task < 0 or task in fields:
            continue
        names = frozenset(row)
        fields[task] = shared.setdefault(names, names)
    return fields


def aggregate_metrics(
    path: Path,
    pass_threshold: float = 1.0,
    max_k: int | None = None,
    task_rows_path: Path | None = None,
) -> dict[str, Any]:
    """Mean/std (``mean/<field>``, ``std/<field>``) of each metric, token totals, per-task pass@k.

    The metrics are ``reward`` and every other numeric top-level field the verifier added: a field of
    the rollout's own task row (an id, an index, a ground-truth number copied through ``/run``) is
    data, not a metric, and is not averaged. The task rows are read from ``task_rows_path`` (the
    collector's ``<stem>_materialized_inputs.jsonl``); without it every numeric top-level field counts.
    A line that is not a JSON object, or whose ``reward`` is not a number, counts as malformed.
    """
    stats: dict[str, RunningStat] = defaultdict(RunningStat)
    tokens = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
    tasks: dict[int, list[float]] = defaultdict(list)
    task_fields = (
        task_row_fields(task_rows_path) if task_rows_path is not None and task_rows_path.is_file() else {}
    )
    no_fields: frozenset[str] = frozenset()
    rows = ScoredRows(path)
    for task, reward, row in rows:
        data_fields = task_fields.get(task, no_fields)
        for key, value in row.items():
            if key in INDEX_FIELDS or (key in data_fields and key != "reward"):
                continue
            x = _numeric(value)
            if x is not None:
                stats[key].add(x)
        tasks[task].append(reward)
        usage = _usage(row)
        for key in tokens:
            count = usage.get(key)
            tokens[key] += count if isinstance(count, int) and not isinstance(count, bool) else 0
    k_max = max_k or max((len(v) for v in tasks.values()), default=1)
    per_task = {str(t): task_profile(r, k_max, pass_threshold) for t, r in sorted(tasks.items())}
    metrics: dict[str, Any] = {
        "num_rollouts": stats["reward"].n if "reward" in stats else 0,
        "malformed_lines": rows.malformed,
    }
    for key, st in sorted(stats.items()):
        metrics[f"mean/{key}"] = st.mean
        metrics[f"std/{key}"] = st.std
    metrics["tokens"] = tokens
    metrics["num_tasks"] = len(per_task)
    # The mean over tasks is reported only for the k every task reaches: a mean over the tasks that
    # happen to have more rollouts (an interrupted run) would not be comparable with the others.
    for k in k_values(k_max):
        values = [p.get(f"pass@{k}") for p in per_task.values()]
        if values and None not in values:
            metrics[f"pass@{k}"] = sum(values) / len(values)
    if len(per_task) <= MAX_PER_TASK_IN_METRICS:
        metrics["per_task"] = per_task
    else:
        metrics["per_task"] = (
            f"{len(per_task)} tasks: too many to list here; run ng_reward_profile for the per-task file"
        )
    return metrics


def reward_profile(path: Path, pass_threshold: float = 1.0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per-task rows and a summary: shares of tasks always / never / sometimes solved."""
    tasks, bad = per_task_rewards(path)
    k_max = max((len(v) for v in tasks.values()), default=1)
    rows = []
    always = never = mixed = 0
    for task, rewards in sorted(tasks.items()):
        profile = task_profile(rewards, k_max, pass_threshold)
        passed = profile["num_passed"]
        category = "always" if passed == len(rewards) else "never" if passed == 0 else "mixed"
        always += category == "always"
        never += category == "never"
        mixed += category == "mixed"
        rows.append({"_ng_task_index": task, **profile, "solved": category})
    n = len(rows) or 1
    summary = {
        "num_tasks": len(rows),
        "num_rollouts": sum(len(v) for v in tasks.values()),
        "malformed_lines": bad,
        "pass_threshold": pass_threshold,
        "share_always_solved": always / n,
        "share_never_solved": never / n,
        "share_mixed": mixed / n,
        "num_mixed_tasks": mixed,
        "mean_reward": (sum(sum(v) for v in tasks.values()) / max(1, sum(len(v) for v in tasks.values()))),
    }
    return rows, summary
