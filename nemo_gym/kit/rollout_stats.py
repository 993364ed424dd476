"""Statistics over a rollouts JSONL file: aggregate metrics, per-task pass@k, reward profiling.

Contract
--------
Everything here reads a rollouts file as a stream (one JSON object per line, as written by
``ng_collect_rollouts``) and never needs the servers. A line that does not parse is counted and
skipped, never fatal. A rollout "passes" when its reward is at least ``pass_threshold``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from nemo_gym.kit.spill import DiskTable, SortedSpill

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


class TaskFields:
    """:func:`task_row_fields` looked up from disk: memory O(distinct row shapes), not O(tasks).

    Each task's shape (its set of field names; one per distinct set) is numbered, and the number is
    kept per task index in a :class:`~nemo_gym.kit.spill.DiskTable`. :meth:`close` removes the table."""

    def __init__(self, path: Path) -> None:
        self._shapes: list[frozenset[str]] = [frozenset()]  # number 0: no task row
        numbers: dict[frozenset[str], int] = {}
        self._table = DiskTable()
        last = None
        try:
            for _, row in iter_jsonl(path):
                if not isinstance(row, dict):
                    continue
                task = _task_index(row)
                if task is None or task < 0 or task == last:  # a repeat in place: its task is recorded
                    continue
                last = task
                names = frozenset(row)
                number = numbers.get(names)
                if number is None:
                    number = numbers[names] = len(self._shapes)
                    self._shapes.append(names)
                self._table.set_first(task, number)
        except BaseException:
            self._table.close()
            raise

    def get(self, task: int) -> frozenset[str]:
        """The field names of task ``task``'s row (empty when the file has none)."""
        return self._shapes[self._table.get(task)] if task >= 0 else self._shapes[0]

    def close(self) -> None:
        self._table.close()


def _task_groups(by_task: SortedSpill) -> Iterator[tuple[int, list[float]]]:
    """(task, its rewards in file order) from ``(task, line order, reward)`` records, by task."""
    for task, records in itertools.groupby(by_task, key=lambda r: r[0]):
        yield task, [reward for _, _, reward in records]


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

    Memory does not grow with the file: the means are running (Welford), the rewards are grouped by
    task through a :class:`~nemo_gym.kit.spill.SortedSpill` (each task's own rewards are then held
    at once, as pass@k and the task's std need them), the task rows' fields are looked up from disk
    (:class:`TaskFields`), ``per_task`` is kept only while it may still be listed
    (``MAX_PER_TASK_IN_METRICS``), and the per-task pass@k values are summed, in task order, from a
    spill too. The results are those of holding everything in memory, to the last bit.
    """
    stats: dict[str, RunningStat] = defaultdict(RunningStat)
    tokens = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
    task_fields = (
        TaskFields(task_rows_path) if task_rows_path is not None and task_rows_path.is_file() else None
    )
    no_fields: frozenset[str] = frozenset()
    rows = ScoredRows(path)
    with contextlib.ExitStack() as cleanup:
        if task_fields is not None:
            cleanup.callback(task_fields.close)
        by_task = cleanup.enter_context(SortedSpill())
        for seq, (task, reward, row) in enumerate(rows):
            data_fields = task_fields.get(task) if task_fields is not None else no_fields
            for key, value in row.items():
                if key in INDEX_FIELDS or (key in data_fields and key != "reward"):
                    continue
                x = _numeric(value)
                if x is not None:
                    stats[key].add(x)
            by_task.add((task, seq, reward))
            usage = _usage(row)
            for key in tokens:
                count = usage.get(key)
                tokens[key] += count if isinstance(count, int) and not isinstance(count, bool) else 0
        k_max = max_k or max((len(r) for _, r in _task_groups(by_task)), default=1)
        ks = k_values(k_max)
        num_tasks = 0
        per_task: dict[str, Any] | None = {}
        incomplete: set[int] = set()  # the k some task has fewer rollouts than
        pass_values = cleanup.enter_context(SortedSpill())  # (k's position, task's position, pass@k)
        for task, rewards in _task_groups(by_task):
            profile = task_profile(rewards, k_max, pass_threshold)
            if per_task is not None:
                per_task = None if len(per_task) >= MAX_PER_TASK_IN_METRICS else per_task
            if per_task is not None:
                per_task[str(task)] = profile
            for position, k in enumerate(ks):
                value = profile.get(f"pass@{k}")
                if value is None:
                    incomplete.add(k)
                elif k not in incomplete:
                    pass_values.add((position, num_tasks, value))
            num_tasks += 1
        metrics: dict[str, Any] = {
            "num_rollouts": stats["reward"].n if "reward" in stats else 0,
            "malformed_lines": rows.malformed,
        }
        for key, st in sorted(stats.items()):
            metrics[f"mean/{key}"] = st.mean
            metrics[f"std/{key}"] = st.std
        metrics["tokens"] = tokens
        metrics["num_tasks"] = num_tasks
        # The mean over tasks is reported only for the k every task reaches: a mean over the tasks that
        # happen to have more rollouts (an interrupted run) would not be comparable with the others.
        sums = {
            ks[position]: sum(value for _, _, value in records)  # in task order, as a list would be summed
            for position, records in itertools.groupby(pass_values, key=lambda r: r[0])
            if ks[position] not in incomplete
        }
        for k in ks:
            if num_tasks and k not in incomplete:
                metrics[f"pass@{k}"] = sums[k] / num_tasks
    if per_task is not None:
        metrics["per_task"] = per_task
    else:
        metrics["per_task"] = (
            f"{num_tasks} tasks: too many to list here; run ng_reward_profile for the per-task file"
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
