"""Upstream NeMo Gym's module path ``nemo_gym.base_resources_server``, kept as a thin face for code written against upstream.

It holds exactly upstream's public names here that we implement, each imported from the module of ours
that defines it; the code and its contract live in :mod:`nemo_gym.server.resources`. Our own code imports from the
defining modules (tests/test_architecture.py checks both).
"""

from __future__ import annotations

from nemo_gym.config.types import AggregateMetrics, AggregateMetricsRequest, BaseRunServerInstanceConfig
from nemo_gym.kit.judge import judge_failsafe
from nemo_gym.kit.reward_profile import AggregateMetricsMixin, compute_aggregate_metrics
from nemo_gym.openai_utils.responses import NeMoGymResponse, NeMoGymResponseCreateParamsNonStreaming
from nemo_gym.server.base import BaseServer, SimpleServer
from nemo_gym.server.mcp import (
    NEMO_GYM_MCP_METADATA_KEY,
    NEMO_GYM_MCP_SESSION_TOKEN_HEADER,
    MCPServerMetadata,
)
from nemo_gym.server.resources import (
    BaseMultiRewardVerifyResponse,
    BaseResourcesServer,
    BaseResourcesServerConfig,
    BaseRunRequest,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ResourcesCloseSessionRequest,
    ResourcesCloseSessionResponse,
    ResourcesSeedSessionRequest,
    ResourcesSeedSessionResponse,
    ResourcesVerifyRequest,
    ReverifyMode,
    SimpleResourcesServer,
)
from nemo_gym.server.rollout_prefix import RolloutContextMiddleware

__all__ = [
    "AggregateMetrics",
    "AggregateMetricsMixin",
    "AggregateMetricsRequest",
    "BaseMultiRewardVerifyResponse",
    "BaseResourcesServer",
    "BaseResourcesServerConfig",
    "BaseRunRequest",
    "BaseRunServerInstanceConfig",
    "BaseSeedSessionRequest",
    "BaseSeedSessionResponse",
    "BaseServer",
    "BaseVerifyRequest",
    "BaseVerifyResponse",
    "MCPServerMetadata",
    "NEMO_GYM_MCP_METADATA_KEY",
    "NEMO_GYM_MCP_SESSION_TOKEN_HEADER",
    "NeMoGymResponse",
    "NeMoGymResponseCreateParamsNonStreaming",
    "ResourcesCloseSessionRequest",
    "ResourcesCloseSessionResponse",
    "ResourcesSeedSessionRequest",
    "ResourcesSeedSessionResponse",
    "ResourcesVerifyRequest",
    "ReverifyMode",
    "RolloutContextMiddleware",
    "SimpleResourcesServer",
    "SimpleServer",
    "compute_aggregate_metrics",
    "judge_failsafe",
]
