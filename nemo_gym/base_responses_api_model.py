"""Upstream NeMo Gym's module path ``nemo_gym.base_responses_api_model``, kept as a thin face for code written against upstream.

It holds exactly upstream's public names here that we implement, each imported from the module of ours
that defines it; the code and its contract live in :mod:`nemo_gym.server.model`. Our own code imports from the
defining modules (tests/test_architecture.py checks both).
"""

from __future__ import annotations

from nemo_gym.config.types import (
    ROLLOUT_PATH_PREFIX,
    TOKEN_CAPTURE_PATH_SEGMENT,
    BaseRunServerInstanceConfig,
    ModelServerRef,
)
from nemo_gym.openai_utils.responses import NeMoGymResponse, NeMoGymResponseCreateParamsNonStreaming
from nemo_gym.server.base import BaseServer, SimpleServer
from nemo_gym.server.model import BaseResponsesAPIModelConfig, SimpleResponsesAPIModel
from nemo_gym.server.rollout_prefix import maybe_rollout_id_from_run_body

__all__ = [
    "BaseResponsesAPIModelConfig",
    "BaseRunServerInstanceConfig",
    "BaseServer",
    "ModelServerRef",
    "NeMoGymResponse",
    "NeMoGymResponseCreateParamsNonStreaming",
    "ROLLOUT_PATH_PREFIX",
    "SimpleResponsesAPIModel",
    "SimpleServer",
    "TOKEN_CAPTURE_PATH_SEGMENT",
    "maybe_rollout_id_from_run_body",
]
