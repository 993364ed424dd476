"""Upstream NeMo Gym's module path ``nemo_gym.rollout_correlation``, kept as a thin face for code written against upstream.

It holds exactly upstream's public names here that we implement, each imported from the module of ours
that defines it; the code and its contract live in :mod:`nemo_gym.server.rollout_prefix`. Our own code imports from the
defining modules (tests/test_architecture.py checks both).
"""

from __future__ import annotations

from nemo_gym.config.keys import (
    ATTEMPT_INDEX_KEY_NAME,
    ROLLOUT_ID_KEY_NAME,
    ROLLOUT_INDEX_KEY_NAME,
    TASK_INDEX_KEY_NAME,
)
from nemo_gym.config.types import ROLLOUT_PATH_PREFIX
from nemo_gym.server.rollout_prefix import (
    ROLLOUT_ID_PATTERN,
    RolloutContextMiddleware,
    current_rollout_id,
    maybe_rollout_id_from_run_body,
    rollout_context,
)

__all__ = [
    "ATTEMPT_INDEX_KEY_NAME",
    "ROLLOUT_ID_KEY_NAME",
    "ROLLOUT_ID_PATTERN",
    "ROLLOUT_INDEX_KEY_NAME",
    "ROLLOUT_PATH_PREFIX",
    "RolloutContextMiddleware",
    "TASK_INDEX_KEY_NAME",
    "current_rollout_id",
    "maybe_rollout_id_from_run_body",
    "rollout_context",
]
