"""Upstream NeMo Gym's module path ``nemo_gym.base_responses_api_agent``, kept as a thin face for code written against upstream.

It holds exactly upstream's public names here that we implement, each imported from the module of ours
that defines it; the code and its contract live in :mod:`nemo_gym.server.agent`. Our own code imports from the
defining modules (tests/test_architecture.py checks both).
"""

from __future__ import annotations

from nemo_gym.config.instances import get_first_server_config_dict
from nemo_gym.config.types import (
    ROLLOUT_PATH_PREFIX,
    TOKEN_CAPTURE_PATH_SEGMENT,
    AggregateMetrics,
    AggregateMetricsRequest,
    BaseRunServerInstanceConfig,
)
from nemo_gym.kit.reward_profile import AggregateMetricsMixin, compute_aggregate_metrics
from nemo_gym.openai_utils.responses import NeMoGymResponse, NeMoGymResponseCreateParamsNonStreaming
from nemo_gym.server.agent import BaseResponsesAPIAgentConfig, SimpleResponsesAPIAgent
from nemo_gym.server.base import BaseServer, SimpleServer
from nemo_gym.server.resources import BaseRunRequest, BaseVerifyResponse
from nemo_gym.server.rollout_prefix import (
    apply_rollout_prefix,
    maybe_rollout_id_from_run_body,
    rollout_context,
    rollout_path_prefix,
)

__all__ = [
    "AggregateMetrics",
    "AggregateMetricsMixin",
    "AggregateMetricsRequest",
    "BaseResponsesAPIAgentConfig",
    "BaseRunRequest",
    "BaseRunServerInstanceConfig",
    "BaseServer",
    "BaseVerifyResponse",
    "NeMoGymResponse",
    "NeMoGymResponseCreateParamsNonStreaming",
    "ROLLOUT_PATH_PREFIX",
    "SimpleResponsesAPIAgent",
    "SimpleServer",
    "TOKEN_CAPTURE_PATH_SEGMENT",
    "apply_rollout_prefix",
    "compute_aggregate_metrics",
    "get_first_server_config_dict",
    "maybe_rollout_id_from_run_body",
    "rollout_context",
    "rollout_path_prefix",
]
