"""Experiment tracking: a finished collection's metrics, reward histogram and sample trajectories.

Contract
--------
* ``+tracker=mlflow`` or ``+tracker=wandb`` on ``ng_collect_rollouts`` / ``ng_e2e_collect_rollouts``;
  without it nothing here runs and neither package is imported.
* What is exported: every numeric aggregate metric (flattened: ``mean/reward``, ``pass_at_1``,
  ``tokens/output_tokens``; with e2e also ``<agent>/mean/reward``), the command's options as
  parameters (never the server configs: no secrets), a reward histogram, and a sample of
  ``tracker_num_trajectories`` (default 20) trajectories spread over the file (task, rollout, agent,
  reward, prompt, final output). The rewards are streamed from the rollouts file, never held
  (:class:`RewardScan`).
* Where the tracker writes, by default: beside the rollouts file, never the working directory (which
  may be a source tree): ``<output dir>/mlruns`` for MLflow, ``<output dir>/wandb`` for W&B (for
  ``results/rollouts.jsonl``: ``results/mlruns``, ``results/wandb``). An explicit setting wins: the
  option (``+mlflow_tracking_uri``, ``+wandb_dir``), else the tracker's own environment variable
  (``MLFLOW_TRACKING_URI``, ``WANDB_DIR``).
* MLflow (upstream's keys): ``mlflow_tracking_uri`` (default above, a local file store: no
  server), ``mlflow_experiment_name`` (default ``nemo_gym``), ``mlflow_run_name`` (default the output
  file's stem). A ``file:`` store is MLflow's file backend, which MLflow 3 keeps behind
  ``MLFLOW_ALLOW_FILE_STORE=true``: set for it when the URI is a local path. The histogram is the
  artifact ``reward_histogram.json``, the sample ``trajectories_sample.jsonl``.
* Weights & Biases (upstream's keys): ``wandb_project`` (default ``nemo_gym``), ``wandb_name``,
  ``wandb_mode`` (default ``offline``: no network; ``wandb sync`` uploads later), ``wandb_dir``. The
  histogram is a ``wandb.Histogram``, the sample a ``wandb.Table``.
* The packages are optional extras (``pip install "nemo-gym[tracking]"``). A tracker whose package is
  absent is off, with one clear line on stderr — never an import error. A tracker that fails is a
  warning: the rollouts and metrics files are already written and the exit status is unchanged.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson

TRACKERS = ("mlflow", "wandb")
# Top-level option keys read here (registered in nemo_gym.config.process as TRACKER_OPTIONS).
OPTION_KEYS = (
    "tracker",
    "tracker_num_trajectories",
    "mlflow_tracking_uri",
    "mlflow_experiment_name",
    "mlflow_run_name",
    "wandb_project",
    "wandb_name",
    "wandb_mode",
    "wandb_dir",
)
DEFAULT_NUM_TRAJECTORIES = 20
HISTOGRAM_BINS = 10
TEXT_LIMIT = 4000
PARAM_KEYS = (
    "split",
    "agent_name",
    "input_jsonl_fpath",
    "output_jsonl_fpath",
    "num_repeats",
    "agent_num_repeats",
    "limit",
    "num_samples_in_parallel",
    "responses_create_params",
    "num_repeats_add_seed",
    "pass_threshold",
)


def flat_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Every finite number in ``metrics`` under a slash-joined name (``@`` spelled ``_at_``), skipping
    per-task detail and file names."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key in ("per_task", "files", "failure_kinds", "down_servers", "first_changes"):
            continue
        name = re.sub(r"[^0-9A-Za-z_\-. :/]", "_", f"{prefix}{key}".replace("@", "_at_"))
        if isinstance(value, Mapping):
            out.update(flat_metrics(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


def e2e_flat_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """ng_e2e_collect_rollouts' metrics: the overall ones unprefixed, each agent's under ``<agent>/``."""
    out = flat_metrics(metrics.get("overall", {}))
    for agent, values in (metrics.get("per_agent") or {}).items():
        out.update(flat_metrics(values, f"{agent}/"))
    return out


def _rollouts(path: Path) -> Iterator[dict[str, Any]]:
    if not path.is_file():
        return
    with open(path, "rb") as f:
        for line in f:
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(row, dict):
                yield row


def _reward(row: Mapping[str, Any]) -> float | None:
    r = row.get("reward")
    return float(r) if isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) else None


def reward_histogram(rewards: list[float], bins: int = HISTOGRAM_BINS) -> dict[str, Any]:
    """Counts of rewards in ``bins`` equal bins over [min, max] (one bin when all are equal)."""
    if not rewards:
        return {"edges": [], "counts": [], "n": 0}
    lo, hi = min(rewards), max(rewards)
    if hi == lo:
        return {"edges": [lo, hi], "counts": [len(rewards)], "n": len(rewards)}
    width = (hi - lo) / bins
    counts = [0] * bins
    for r in rewards:
        counts[min(bins - 1, int((r - lo) / width))] += 1
    return {"edges": [lo + i * width for i in range(bins)] + [hi], "counts": counts, "n": len(rewards)}


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else orjson.dumps(value).decode()
    return text if len(text) <= TEXT_LIMIT else text[:TEXT_LIMIT] + " ..."


def trajectory_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """One trajectory, shortened for a table: who, reward, prompt, and the final output items."""
    params = row.get("responses_create_params") or {}
    output = (row.get("response") or {}).get("output") or []
    return {
        "task": row.get("_ng_task_index"),
        "rollout": row.get("_ng_rollout_index"),
        "agent": (row.get("agent_ref") or {}).get("name"),
        "reward": _reward(row),
        "prompt": _text(params.get("input")),
        "output": _text(output),
    }


def read_rewards_and_sample(path: Path, n_sample: int) -> tuple[list[float], list[dict[str, Any]]]:
    """All rewards of the file and ``n_sample`` trajectories spread evenly over it (two passes)."""
    rewards = [r for r in (_reward(row) for row in _rollouts(path)) if r is not None]
    total = len(rewards)
    if total == 0 or n_sample <= 0:
        return rewards, []
    picks = {(i * total) // min(n_sample, total) for i in range(min(n_sample, total))}
    sample, i = [], 0
    for row in _rollouts(path):
        if _reward(row) is None:
            continue
        if i in picks:
            sample.append(trajectory_row(row))
        i += 1
    return rewards, sample


class RewardScan:
    """The rewards of a rollouts file without holding them: count, range, both histograms, a sample.

    What :func:`read_rewards_and_sample` and :func:`reward_histogram` give from the list of rewards,
    computed in passes over the file instead (memory O(``n_sample`` + ``bins``), not O(rollouts)):
    :attr:`histogram` is ``reward_histogram(rewards, bins)`` and :meth:`numpy_histogram`
    ``numpy.histogram(rewards, bins=bins)`` (what ``wandb.Histogram(rewards, num_bins=bins)`` builds),
    to the last bit."""

    def __init__(self, path: Path, n_sample: int, bins: int = HISTOGRAM_BINS) -> None:
        self.path = path
        self.bins = bins
        self.n = 0
        self.lo = math.inf
        self.hi = -math.inf
        for r in self._rewards():
            self.n += 1
            self.lo = min(self.lo, r)
            self.hi = max(self.hi, r)
        self.histogram = self._histogram_and_sample(n_sample)

    def _rewards(self) -> Iterator[float]:
        for row in _rollouts(self.path):
            r = _reward(row)
            if r is not None:
                yield r

    def _histogram_and_sample(self, n_sample: int) -> dict[str, Any]:
        """``reward_histogram`` of the rewards, and ``self.sample`` as ``read_rewards_and_sample`` picks it."""
        total, bins, lo, hi = self.n, self.bins, self.lo, self.hi
        self.sample: list[dict[str, Any]] = []
        picks = (
            {(i * total) // min(n_sample, total) for i in range(min(n_sample, total))}
            if total and n_sample > 0
            else set()
        )
        width = (hi - lo) / bins if total and hi != lo else 0.0
        counts = [0] * bins if width else []
        if total and (picks or width):
            i = 0
            for row in _rollouts(self.path):
                r = _reward(row)
                if r is None:
                    continue
                if i in picks:
                    self.sample.append(trajectory_row(row))
                if width:
                    counts[min(bins - 1, int((r - lo) / width))] += 1
                i += 1
        if not total:
            return {"edges": [], "counts": [], "n": 0}
        if hi == lo:
            return {"edges": [lo, hi], "counts": [total], "n": total}
        return {"edges": [lo + i * width for i in range(bins)] + [hi], "counts": counts, "n": total}

    def numpy_histogram(self, chunk: int = 65_536) -> tuple[Any, Any]:
        """``numpy.histogram(rewards, bins=self.bins)``: the same edges (as numpy makes them from the
        range), the counts summed over chunks of the file (numpy counts each value by those edges)."""
        import numpy as np

        first, last = (self.lo, self.hi) if self.n else (0.0, 1.0)  # numpy's range for no values
        if first == last:
            first, last = first - 0.5, last + 0.5
        edges = np.linspace(first, last, self.bins + 1, endpoint=True)
        counts = np.zeros(self.bins, dtype=np.intp)
        values: list[float] = []
        for r in self._rewards():
            values.append(r)
            if len(values) >= chunk:
                counts += np.histogram(np.asarray(values), bins=edges)[0]
                values = []
        if values:
            counts += np.histogram(np.asarray(values), bins=edges)[0]
        return counts, edges


def _note(message: str) -> None:
    sys.stderr.write(f"nemo_gym tracker: {message}\n")
    sys.stderr.flush()


def track_run(
    tracker: str,
    config: Mapping[str, Any],
    metrics: Mapping[str, Any],
    rollouts_path: Path,
    run_name: str,
    e2e: bool = True,
) -> str | None:
    """Export one finished collection; returns where it went (a run id / directory), None when off or failed."""
    if tracker not in TRACKERS:
        _note(f"+tracker={tracker!r} is not one of {', '.join(TRACKERS)}; tracking is off for this run")
        return None
    if importlib.util.find_spec(tracker) is None:
        _note(
            f'+tracker={tracker}: the {tracker} package is not installed (pip install "nemo-gym[tracking]" '
            f"or pip install {tracker}); tracking is off for this run"
        )
        return None
    values = e2e_flat_metrics(metrics) if e2e else flat_metrics(metrics)
    params = {k: _text(config[k]) for k in PARAM_KEYS if config.get(k) is not None}
    n = int(config.get("tracker_num_trajectories") or DEFAULT_NUM_TRAJECTORIES)
    rewards = RewardScan(rollouts_path, n)  # streamed: the rewards are not held
    try:
        if tracker == "mlflow":
            where = _to_mlflow(config, run_name, values, params, rewards, rollouts_path)
        else:
            where = _to_wandb(config, run_name, values, params, rewards, rollouts_path)
    except Exception as e:  # a tracker never takes the results down with it
        _note(
            f"{tracker} export failed ({type(e).__name__}: {e}); the rollouts and metrics files are complete"
        )
        return None
    print(f"Tracked in {tracker}: {where}", flush=True)
    return where


def _mlflow_uri(config: Mapping[str, Any], rollouts_path: Path) -> str:
    """``+mlflow_tracking_uri``, else ``MLFLOW_TRACKING_URI``, else ``mlruns`` beside the rollouts file."""
    explicit = config.get("mlflow_tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
    uri = str(explicit or rollouts_path.parent / "mlruns")
    if "://" in uri or uri.startswith("file:"):
        return uri
    return Path(uri).resolve().as_uri()  # a local directory: MLflow's file store


def _to_mlflow(
    config: Mapping[str, Any],
    run_name: str,
    values: dict[str, float],
    params: dict[str, str],
    rewards: RewardScan,
    rollouts_path: Path,
) -> str:
    uri = _mlflow_uri(config, rollouts_path)
    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    name = str(config.get("mlflow_experiment_name") or "nemo_gym")
    experiment = client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(name)
    run = client.create_run(experiment_id, run_name=str(config.get("mlflow_run_name") or run_name))
    run_id = run.info.run_id
    status = "FAILED"
    try:
        from mlflow.entities import Metric, Param

        now = int(time.time() * 1000)
        client.log_batch(
            run_id,
            metrics=[Metric(k, v, now, 0) for k, v in sorted(values.items())],
            params=[Param(k, v[:6000]) for k, v in sorted(params.items())],
        )
        client.log_dict(run_id, rewards.histogram, "reward_histogram.json")
        client.log_text(
            run_id,
            "".join(orjson.dumps(r).decode() + "\n" for r in rewards.sample),
            "trajectories_sample.jsonl",
        )
        status = "FINISHED"
    finally:
        client.set_terminated(run_id, status=status)
    return f"{uri} experiment {name!r} run {run_id}"


def _wandb_dir(config: Mapping[str, Any], rollouts_path: Path) -> Path:
    """``+wandb_dir``, else ``WANDB_DIR``, else the rollouts file's directory (W&B adds ``wandb/``)."""
    explicit = config.get("wandb_dir") or os.environ.get("WANDB_DIR")
    where = Path(str(explicit)) if explicit else rollouts_path.parent
    where.mkdir(parents=True, exist_ok=True)
    return where


def _to_wandb(
    config: Mapping[str, Any],
    run_name: str,
    values: dict[str, float],
    params: dict[str, str],
    rewards: RewardScan,
    rollouts_path: Path,
) -> str:
    import wandb

    run = wandb.init(
        project=str(config.get("wandb_project") or "nemo_gym"),
        name=str(config.get("wandb_name") or run_name),
        mode=str(config.get("wandb_mode") or "offline"),
        dir=str(_wandb_dir(config, rollouts_path)),
        config=params,
        reinit="create_new",
    )
    try:
        run.summary.update(values)
        columns = ["task", "rollout", "agent", "reward", "prompt", "output"]
        table = wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rewards.sample])
        payload: dict[str, Any] = {"trajectories_sample": table, **values}
        if rewards.n:
            # numpy.histogram(rewards, bins=HISTOGRAM_BINS), as wandb.Histogram(rewards, ...) computes it
            payload["reward_histogram"] = wandb.Histogram(np_histogram=rewards.numpy_histogram())
        run.log(payload)
        where = str(getattr(run, "dir", "") or run.id)
    finally:
        run.finish()
    return where
