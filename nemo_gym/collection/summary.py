"""The collector's end-of-run summary as a typed value (:class:`CollectionSummary`).

Contract
--------
* :class:`CollectionSummary` holds what :func:`~nemo_gym.collection.collector.collect_rollouts`
  reports: counts, this run's numbers (:class:`RunCounts`), failure kinds, down servers, files, and the
  aggregate metrics of :mod:`nemo_gym.kit.rollout_stats` (``metrics``, keys such as ``mean/reward``).
* :meth:`CollectionSummary.to_dict` is the dict written to ``<stem>_aggregate_metrics.json`` and
  given to trackers: the same keys in the same order as before the summary was typed, the metrics
  at the top level, so those files keep every key they had; the ``live`` block
  (:mod:`nemo_gym.collection.live_stats`) comes last.
* ``summary[key]`` reads that dict, for Python callers written against the dict summary; code in
  this package reads attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RunCounts:
    """This run alone (a resume counts only what it ran)."""

    ok: int
    failed: int
    wall_time_s: float
    rollouts_per_s: float


@dataclass
class CollectionSummary:
    """One collection's summary; see the module docstring for the dict form."""

    input_jsonl_fpath: str
    rows: int
    num_repeats: int
    expected_rollouts: int
    rollouts_ok: int
    rollouts_missing: int
    this_run: RunCounts
    interrupted: bool
    # Rows not sent this run (a server was down, or an interrupt): not failures, a resume runs them.
    not_attempted: int
    # Rollouts whose /run answer carried _ng_no_persist: written nowhere, a resume runs them.
    not_persisted: int
    # Every open breaker: the down server, the evidence, the agents it blocked.
    down_servers: list[dict[str, Any]]
    # Failures of a replicated server's sessions while another replica of it was alive.
    replica_losses: int
    failure_kinds: list[dict[str, Any]]
    skipped_after_max_attempts: int
    max_attempts: int
    unreadable_output_lines: int
    files: dict[str, str]
    # nemo_gym.kit.rollout_stats.aggregate_metrics of the output (num_rollouts, tokens, mean/..., pass@k, ...).
    metrics: dict[str, Any] = field(default_factory=dict)
    # The model-call capture's summary, when capture was on.
    model_calls: dict[str, Any] | None = None
    # This run's live numbers (nemo_gym.collection.live_stats.LiveStats.to_dict): rates, failures by
    # kind, reward mean/std, tokens. Written last, so every key before it is as it was.
    live: dict[str, Any] | None = None
    # The max_policy_lag filter's counts (nemo_gym.collection.policy_lag), when the option was set.
    policy_lag: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (metrics file, trackers): keys in the order the dict summary always had."""
        out: dict[str, Any] = {
            "input_jsonl_fpath": self.input_jsonl_fpath,
            "rows": self.rows,
            "num_repeats": self.num_repeats,
            "expected_rollouts": self.expected_rollouts,
            "rollouts_ok": self.rollouts_ok,
            "rollouts_missing": self.rollouts_missing,
            "this_run": {
                "ok": self.this_run.ok,
                "failed": self.this_run.failed,
                "wall_time_s": self.this_run.wall_time_s,
                "rollouts_per_s": self.this_run.rollouts_per_s,
            },
            "interrupted": self.interrupted,
            "not_attempted": self.not_attempted,
            "not_persisted": self.not_persisted,
            "down_servers": self.down_servers,
            "replica_losses": self.replica_losses,
            "failure_kinds": self.failure_kinds,
            "skipped_after_max_attempts": self.skipped_after_max_attempts,
            "max_attempts": self.max_attempts,
            "unreadable_output_lines": self.unreadable_output_lines,
            "files": dict(self.files),
            **self.metrics,
        }
        if self.model_calls is not None:
            out["model_calls"] = self.model_calls
        if self.policy_lag is not None:
            out["policy_lag"] = self.policy_lag
        if self.live is not None:
            out["live"] = self.live
        return out

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]
