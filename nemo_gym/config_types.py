"""Upstream NeMo Gym's module path ``nemo_gym.config_types``, kept as a thin face for code written against upstream.

It holds exactly upstream's public names here that we implement, each imported from the module of ours
that defines it; the code and its contract live in :mod:`nemo_gym.config.types`. Our own code imports from the
defining modules (tests/test_architecture.py checks both).
"""

from __future__ import annotations

from nemo_gym.config.types import (
    AGENT_REF_KEY,
    ROLLOUT_PATH_PREFIX,
    TOKEN_CAPTURE_PATH_SEGMENT,
    AgentServerRef,
    AggregateMetrics,
    AggregateMetricsRequest,
    BaseRunServerConfig,
    BaseRunServerInstanceConfig,
    BaseServerConfig,
    BenchmarkDatasetConfig,
    DatasetConfig,
    DatasetSource,
    Domain,
    EnvironmentServerRef,
    GitlabDatasetSource,
    HuggingFaceDatasetSource,
    JsonlDatasetGitlabIdentifer,
    JsonlDatasetHuggingFaceIdentifer,
    ModelServerRef,
    ResourcesServerRef,
    ServerRef,
    is_server_ref,
)

__all__ = [
    "AGENT_REF_KEY",
    "AgentServerRef",
    "AggregateMetrics",
    "AggregateMetricsRequest",
    "BaseRunServerConfig",
    "BaseRunServerInstanceConfig",
    "BaseServerConfig",
    "BenchmarkDatasetConfig",
    "DatasetConfig",
    "DatasetSource",
    "Domain",
    "EnvironmentServerRef",
    "GitlabDatasetSource",
    "HuggingFaceDatasetSource",
    "JsonlDatasetGitlabIdentifer",
    "JsonlDatasetHuggingFaceIdentifer",
    "ModelServerRef",
    "ROLLOUT_PATH_PREFIX",
    "ResourcesServerRef",
    "ServerRef",
    "TOKEN_CAPTURE_PATH_SEGMENT",
    "is_server_ref",
]
