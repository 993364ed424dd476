"""Upstream NeMo Gym's module path ``nemo_gym.reward_profile``, kept as a thin face for code written against upstream.

It holds exactly upstream's public names here that we implement, each imported from the module of ours
that defines it; the code and its contract live in :mod:`nemo_gym.kit.reward_profile`. Our own code imports from the
defining modules (tests/test_architecture.py checks both).
"""

from __future__ import annotations

from nemo_gym.config.keys import AGENT_REF_KEY_NAME
from nemo_gym.config.types import AggregateMetrics
from nemo_gym.kit.reward_profile import (
    ROLLOUT_INDEX_KEY_NAME,
    TASK_INDEX_KEY_NAME,
    AggregateMetricsMixin,
    add_avg_sample_std_dev,
    compute_aggregate_metrics,
    compute_pass_majority_metrics,
    compute_subset_metrics,
    highest_k_metrics,
)

__all__ = [
    "AGENT_REF_KEY_NAME",
    "AggregateMetrics",
    "AggregateMetricsMixin",
    "ROLLOUT_INDEX_KEY_NAME",
    "TASK_INDEX_KEY_NAME",
    "add_avg_sample_std_dev",
    "compute_aggregate_metrics",
    "compute_pass_majority_metrics",
    "compute_subset_metrics",
    "highest_k_metrics",
]
