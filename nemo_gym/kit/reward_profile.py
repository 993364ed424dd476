"""Reward statistics: upstream NeMo Gym's metric helpers, and the ``ng_reward_profile`` command.

Contract
--------
* :func:`compute_pass_majority_metrics`, :func:`add_avg_sample_std_dev`, :func:`compute_subset_metrics`,
  :func:`highest_k_metrics`, :func:`compute_aggregate_metrics` and :class:`AggregateMetricsMixin` keep
  upstream's names, arguments and results (environments import them for their ``compute_metrics``
  hook). Accuracy-like values are percentages (0-100); standard deviations are sample ones (n - 1).
  Plain Python: no pandas or wandb.
* ``ng_reward_profile`` (:func:`main`) writes ``<stem>_reward_profiling.jsonl`` (one line per task:
  mean/std reward, pass@k, and whether the task is always, never or sometimes solved) and prints a
  summary. The "mixed" tasks are the ones that carry signal for GRPO-style training (a group with
  equal rewards has zero advantage).
"""

from __future__ import annotations

import asyncio
import math
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from nemo_gym.config.command import command
from nemo_gym.config.problems import ConfigError
from nemo_gym.config.types import AggregateMetrics, AggregateMetricsRequest
from nemo_gym.kit.rollout_stats import reward_profile

TASK_INDEX_KEY_NAME = "_ng_task_index"
ROLLOUT_INDEX_KEY_NAME = "_ng_rollout_index"
_STAT_SUFFIXES = ("std_dev_across_runs", "std_err_across_runs", "avg_sample_std_dev")

ScoreFn = Callable[[dict[str, Any]], dict[str, Any]]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _sample_std(values: list[float]) -> float:
    """Sample standard deviation (n - 1); NaN for fewer than two values."""
    n = len(values)
    if n < 2:
        return math.nan
    m = sum(values) / n
    return math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))


def _pass_at_k(values: list[float], k: int) -> float:
    """Unbiased pass@k when every value is 0/1 (1 - C(failures, k) / C(n, k)); else the best of the first k."""
    if all(v in (0, 1) for v in values):
        failures = sum(1 for v in values if not v)
        return 1.0 if failures < k else 1.0 - math.comb(failures, k) / math.comb(len(values), k)
    return max(values[:k])


def _majority_at_k(answers: list[Any], scores: list[dict[str, Any]], name: str, k: int) -> float:
    """Score of the most frequent (answer, score) pair among the first k answered rollouts (ties averaged)."""
    pairs = [
        (a, s[name]) for a, s in zip(answers[:k], scores[:k], strict=False) if a is not None and name in s
    ]
    if not pairs:
        return 0.0
    counts = Counter(pairs)
    top = max(counts.values())
    winners = [score for (_, score), c in counts.items() if c == top]
    return sum(winners) / len(winners)


def compute_pass_majority_metrics(
    tasks: list[list[dict[str, Any]]],
    score_fn: ScoreFn | None = None,
    answer_key: str | None = None,
) -> tuple[dict[str, Any], list[list[dict[str, float]]], list[str], int]:
    """pass@k, pass@1[avg-of-k], majority@k and across-run spread, for k = 1 .. the most rollouts of a task.

    ``tasks[i]`` holds the rollout dicts of task i. ``score_fn(rollout)`` gives ``{score name: number or
    bool}`` (default ``{"accuracy": rollout["reward"]}``). With ``answer_key``, each rollout's answer is
    ``rollout.get(answer_key)``: majority@k is computed and a ``no_answer`` score (1 when the answer is
    None) is added. Returns ``(metrics, per-task score dicts, score names, max k)``; ``metrics`` holds
    ``pass@{k}/{name}``, ``pass@1[avg-of-{k}]/{name}``, ``majority@{k}/{name}`` (percentages),
    ``per_sample_aggregate`` ({name: [percent over tasks of rollout i's score]}) and, for k >= 2,
    ``pass@1[avg-of-{k}]/{name}/std_dev_across_runs`` and ``.../std_err_across_runs``.
    """
    if not tasks:
        return {}, [], [], 0
    score = score_fn or (lambda r: {"accuracy": r["reward"]})
    scores: list[list[dict[str, float]]] = []
    answers: list[list[Any]] = []
    for rollouts in tasks:
        task_scores, task_answers = [], []
        for rollout in rollouts:
            s = {name: int(v) if isinstance(v, bool) else v for name, v in score(rollout).items()}
            if answer_key is not None:
                answer = rollout.get(answer_key)
                task_answers.append(answer)
                s["no_answer"] = int(answer is None)
            task_scores.append(s)
        scores.append(task_scores)
        answers.append(task_answers)
    names = sorted({name for task_scores in scores for s in task_scores for name in s})
    max_k = max(len(rollouts) for rollouts in tasks)

    metrics: dict[str, Any] = {}
    for k in range(1, max_k + 1):
        for name in names:
            per_task = [[s[name] for s in task_scores if name in s] for task_scores in scores]
            passes = [_pass_at_k(vals, k) for vals in per_task if len(vals) >= k]
            if passes:
                metrics[f"pass@{k}/{name}"] = 100.0 * _mean(passes)
            firsts = [[s[name] for s in task_scores[:k] if name in s] for task_scores in scores]
            averages = [_mean(vals) for vals in firsts if vals]
            if averages:
                metrics[f"pass@1[avg-of-{k}]/{name}"] = 100.0 * _mean(averages)
            if answer_key is not None:
                majority = [_majority_at_k(a, s, name, k) for a, s in zip(answers, scores, strict=True)]
                metrics[f"majority@{k}/{name}"] = 100.0 * _mean(majority)

    per_sample: dict[str, list[float]] = {}
    for name in names:
        series = []
        for i in range(max_k):
            vals = [t[i][name] for t in scores if i < len(t) and name in t[i]]
            if vals:
                series.append(100.0 * _mean(vals))
        if series:
            per_sample[name] = series
    metrics["per_sample_aggregate"] = per_sample
    for k in range(2, max_k + 1):
        for name in names:
            runs = per_sample.get(name, [])[:k]
            if len(runs) >= 2:
                std = _sample_std(runs)
                metrics[f"pass@1[avg-of-{k}]/{name}/std_dev_across_runs"] = std
                metrics[f"pass@1[avg-of-{k}]/{name}/std_err_across_runs"] = std / math.sqrt(len(runs))
    return metrics, scores, names, max_k


def add_avg_sample_std_dev(
    metrics: dict[str, Any], all_score_dicts: list[list[dict[str, float]]], score_names: list[str], max_k: int
) -> None:
    """Add ``pass@1[avg-of-{k}]/{name}/avg_sample_std_dev`` (mean over tasks of the sample std of their
    first k scores) to ``metrics`` in place, for k >= 2."""
    for k in range(2, max_k + 1):
        for name in score_names:
            stds = []
            for task_scores in all_score_dicts:
                vals = [s[name] for s in task_scores[:k] if name in s]
                if len(vals) >= 2:
                    stds.append(_sample_std(vals))
            if stds:
                metrics[f"pass@1[avg-of-{k}]/{name}/avg_sample_std_dev"] = _mean(stds)


def compute_subset_metrics(
    tasks: list[list[dict[str, Any]]],
    subset_key: str,
    score_fn: ScoreFn | None = None,
    answer_key: str | None = None,
) -> dict[str, Any]:
    """:func:`compute_pass_majority_metrics` per value of ``subset_key`` (read from each task's first
    rollout; tasks with an empty value are left out), keys prefixed ``"<value>/"``, without
    ``per_sample_aggregate``."""
    groups: dict[Any, list[list[dict[str, Any]]]] = {}
    for rollouts in tasks:
        value = rollouts[0].get(subset_key) if rollouts else None
        if value:
            groups.setdefault(value, []).append(rollouts)
    out: dict[str, Any] = {}
    for value, group in groups.items():
        metrics = compute_pass_majority_metrics(group, score_fn=score_fn, answer_key=answer_key)[0]
        out.update({f"{value}/{key}": v for key, v in metrics.items() if key != "per_sample_aggregate"})
    return out


def highest_k_metrics(
    agent_metrics: dict[str, Any],
    pattern: str,
    score_names: list[str] | None = None,
    exclude_names: list[str] | None = None,
) -> dict[str, Any]:
    """The entries of ``agent_metrics`` matching ``pattern`` (``{k}`` stands for the number, e.g.
    ``"pass@{k}"`` or ``"pass@1[avg-of-{k}]"``) at the largest k, without the spread statistics;
    optionally only the ``score_names``, minus the ``exclude_names``."""
    regex = re.compile("^" + re.escape(pattern).replace(re.escape("{k}"), r"(\d+)") + "/(.+)$")
    by_k: dict[int, dict[str, Any]] = defaultdict(dict)
    for key, value in agent_metrics.items():
        m = regex.match(key)
        if m is None:
            continue
        name = m.group(2)
        if name.endswith(_STAT_SUFFIXES):
            continue
        if score_names is not None and name not in score_names:
            continue
        if exclude_names is not None and name in exclude_names:
            continue
        by_k[int(m.group(1))][key] = value
    return by_k[max(by_k)] if by_k else {}


class AggregateMetricsMixin:
    """The aggregate-metrics hooks a resources server or agent may override (upstream's names)."""

    def compute_metrics(self, tasks: list[list[dict[str, Any]]]) -> dict[str, Any]:
        """Metrics over all verify responses, grouped by task (``tasks[i]``: the rollouts of task i).

        Merged into ``agent_metrics``; a ``per_task_metrics`` list of ``{"_ng_task_index": i, ...}``
        entries is merged into the matching per-task entries instead. Default: none."""
        return {}

    def get_key_metrics(self, agent_metrics: dict[str, Any]) -> dict[str, Any]:
        """The headline metrics. Default: every ``mean/*`` entry."""
        return {k: v for k, v in agent_metrics.items() if k.startswith("mean/")}

    async def aggregate_metrics(self, body: AggregateMetricsRequest) -> AggregateMetrics:
        """``POST /aggregate_metrics``: :func:`compute_aggregate_metrics` over a run's verify responses with
        this server's hooks, computed off the event loop."""
        return await asyncio.to_thread(
            compute_aggregate_metrics,
            body.verify_responses,
            compute_metrics_fn=self.compute_metrics,
            get_key_metrics_fn=self.get_key_metrics,
        )


def _numeric_fields(d: dict[str, Any], skip: tuple[str, ...] = ()) -> dict[str, float]:
    return {
        k: int(v) if isinstance(v, bool) else v
        for k, v in d.items()
        if isinstance(v, (int, float)) and k not in skip
    }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _describe(records: list[dict[str, float]], skip: tuple[str, ...]) -> dict[str, float]:
    """``mean|max|min|median|std/<column>`` over the records' numeric columns (missing values left out).

    As upstream: std is the sample std; when it is undefined for every column (one record), it is 0
    for the columns every record has. Undefined values are omitted.
    """
    columns: dict[str, list[float]] = {}
    for record in records:
        for k, v in record.items():
            if k not in skip:
                columns.setdefault(k, []).append(v)
    stats: dict[str, dict[str, float]] = {"mean": {}, "max": {}, "min": {}, "median": {}, "std": {}}
    for col, values in columns.items():
        values = [v for v in values if not (isinstance(v, float) and math.isnan(v))]
        if not values:
            continue
        stats["mean"][col] = sum(values) / len(values)
        stats["max"][col] = max(values)
        stats["min"][col] = min(values)
        stats["median"][col] = _median(values)
        std = _sample_std(values)
        if not math.isnan(std):
            stats["std"][col] = std
    if not stats["std"]:
        for col, values in columns.items():
            if col in stats["mean"] and len(values) == len(records):
                stats["std"][col] = 0.0
    return {f"{stat}/{col}": v for stat, by_col in stats.items() for col, v in by_col.items()}


def _rollout_info(result: dict[str, Any]) -> dict[str, Any]:
    task, rollout = result.get(TASK_INDEX_KEY_NAME, 0), result.get(ROLLOUT_INDEX_KEY_NAME, 0)
    info: dict[str, Any] = {
        "rollout_id": f"{task}:{rollout}",
        TASK_INDEX_KEY_NAME: task,
        ROLLOUT_INDEX_KEY_NAME: rollout,
    }
    if "reward" in result:
        info["reward"] = result["reward"]
    info.update(_numeric_fields((result.get("response") or {}).get("usage") or {}))
    info.update(
        _numeric_fields(result, skip=(TASK_INDEX_KEY_NAME, ROLLOUT_INDEX_KEY_NAME, "reward", "response"))
    )
    return info


def compute_aggregate_metrics(
    verify_responses: list[dict[str, Any]],
    compute_metrics_fn: Callable[[list[list[dict[str, Any]]]], dict[str, Any]] | None = None,
    get_key_metrics_fn: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> AggregateMetrics:
    """Statistics of a run's verify responses, as upstream's ``/aggregate_metrics`` computes them.

    Each response contributes its numeric top-level fields (bools as 0/1) and the numeric fields of
    ``response.usage``. ``agent_metrics``: ``mean|max|min|median|std/<field>`` over every rollout;
    ``group_level_metrics``: the same per task (sorted by ``_ng_task_index``) with ``num_rollouts``,
    ``rollout_infos`` and completion counts; then ``compute_metrics_fn(tasks)`` is merged in (its
    ``per_task_metrics`` into the per-task entries) and ``key_metrics`` = ``get_key_metrics_fn`` of the
    agent metrics (default: every ``mean/*``).
    """
    if not verify_responses:
        return AggregateMetrics()
    by_task: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    records: list[dict[str, float]] = []
    task_records: dict[Any, list[dict[str, float]]] = defaultdict(list)
    for vr in verify_responses:
        task = vr.get(TASK_INDEX_KEY_NAME, 0)
        by_task[task].append(vr)
        record = {**_numeric_fields(vr), **_numeric_fields((vr.get("response") or {}).get("usage") or {})}
        records.append(record)
        task_records[task].append(record)

    index_columns = (TASK_INDEX_KEY_NAME, ROLLOUT_INDEX_KEY_NAME)
    agent_metrics = _describe(records, skip=index_columns)
    groups: list[dict[str, Any]] = []
    for task in sorted(by_task):
        n = len(by_task[task])
        groups.append(
            {
                TASK_INDEX_KEY_NAME: task,
                **_describe(task_records[task], skip=index_columns),
                "sample": {"agent_ref": {"name": "agent"}},
                "num_rollouts": n,
                "expected_num_rollouts": n,
                "missing_num_rollouts": 0,
                "reward_profile_completion_pct": 100.0,
                "rollout_infos": sorted(
                    (_rollout_info(vr) for vr in by_task[task]), key=lambda r: r[ROLLOUT_INDEX_KEY_NAME]
                ),
            }
        )
    if compute_metrics_fn is not None:
        custom = dict(compute_metrics_fn([by_task[t] for t in sorted(by_task)]))
        per_task = {m[TASK_INDEX_KEY_NAME]: m for m in custom.pop("per_task_metrics", None) or []}
        for group in groups:
            extra = per_task.get(group[TASK_INDEX_KEY_NAME])
            if extra:
                group.update({k: v for k, v in extra.items() if k != TASK_INDEX_KEY_NAME})
        agent_metrics.update(custom)
    if get_key_metrics_fn is not None:
        key_metrics = get_key_metrics_fn(agent_metrics)
    else:
        key_metrics = {k: v for k, v in agent_metrics.items() if k.startswith("mean/")}
    return AggregateMetrics(group_level_metrics=groups, agent_metrics=agent_metrics, key_metrics=key_metrics)


# ------------------------------------------------------------------------------------------------
# ng_reward_profile


@command("ng_reward_profile")
def main(argv: list[str] | None = None) -> None:
    """``ng_reward_profile +jsonl_fpath=<rollouts.jsonl>``; exit status 2 on a missing file or bad option."""
    # The config loader only here: servers import this module for its metric helpers, not the command.
    from nemo_gym.config.loading import load_global_config
    from nemo_gym.config.options import check_options

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print("usage: ng_reward_profile +jsonl_fpath=<rollouts.jsonl> [+pass_threshold=1.0]")
        return
    try:
        loaded = load_global_config(argv, load_env_yaml=False)
        check_options(loaded, "ng_reward_profile", strict_cli=True)
        cfg = loaded.config
    except ConfigError as e:
        sys.stderr.write(str(e) + "\n")
        sys.exit(2)
    path_value = cfg.get("jsonl_fpath") or cfg.get("input_jsonl_fpath")
    if not path_value:
        sys.stderr.write("ng_reward_profile: pass +jsonl_fpath=<rollouts.jsonl>\n")
        sys.exit(2)
    path = Path(str(path_value))
    if not path.is_file():
        sys.stderr.write(f"ng_reward_profile: {path} is not a file (+jsonl_fpath)\n")
        sys.exit(2)
    try:
        pass_threshold = float(cfg.get("pass_threshold", 1.0))
    except (TypeError, ValueError):
        sys.stderr.write(
            f"ng_reward_profile: +pass_threshold must be a number, got {cfg.get('pass_threshold')!r}\n"
        )
        sys.exit(2)
    rows, summary = reward_profile(path, pass_threshold=pass_threshold)
    stem = path.with_suffix("") if path.suffix == ".jsonl" else path
    out = Path(f"{stem}_reward_profiling.jsonl")
    with open(out, "wb") as f:
        for row in rows:
            f.write(orjson.dumps(row) + b"\n")
    print(
        f"{summary['num_tasks']} tasks, {summary['num_rollouts']} rollouts, mean reward {summary['mean_reward']:.4f}"
    )
    print(
        f"always solved {summary['share_always_solved']:.1%}  never solved {summary['share_never_solved']:.1%}  "
        f"mixed {summary['share_mixed']:.1%} ({summary['num_mixed_tasks']} tasks useful for GRPO)"
    )
    if summary["malformed_lines"]:
        print(f"{summary['malformed_lines']} malformed line(s) skipped")
    worst = sorted(rows, key=lambda r: r["mean_reward"])[:5]
    if worst:
        print(
            "lowest mean reward: "
            + ", ".join(f"task {r['_ng_task_index']}={r['mean_reward']:.2f}" for r in worst)
        )
    print(f"Wrote {out}")
