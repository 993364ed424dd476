"""Upstream NeMo Gym's module path ``nemo_gym.responses_converter``, kept as a thin face for code written against upstream.

It holds exactly upstream's public names here that we implement, each imported from the module of ours
that defines it; the code and its contract live in :mod:`nemo_gym.kit.responses_converter`. Our own code imports from the
defining modules (tests/test_architecture.py checks both).
"""

from __future__ import annotations

from nemo_gym.kit.responses_converter import ResponsesConverter
from nemo_gym.openai_utils import NeMoGymChatCompletionCreateParamsNonStreaming
from nemo_gym.openai_utils.responses import (
    NeMoGymEasyInputMessage,
    NeMoGymFunctionCallOutput,
    NeMoGymFunctionToolParam,
    NeMoGymResponse,
    NeMoGymResponseCreateParamsNonStreaming,
    NeMoGymResponseFunctionToolCall,
    NeMoGymResponseInputTokensDetails,
    NeMoGymResponseOutputItem,
    NeMoGymResponseOutputMessage,
    NeMoGymResponseOutputText,
    NeMoGymResponseOutputTokensDetails,
    NeMoGymResponseReasoningItem,
    NeMoGymResponseUsage,
    NeMoGymSummary,
    TokenIDLogProbMixin,
    training_variant_of,
)

__all__ = [
    "NeMoGymChatCompletionCreateParamsNonStreaming",
    "NeMoGymEasyInputMessage",
    "NeMoGymFunctionCallOutput",
    "NeMoGymFunctionToolParam",
    "NeMoGymResponse",
    "NeMoGymResponseCreateParamsNonStreaming",
    "NeMoGymResponseFunctionToolCall",
    "NeMoGymResponseInputTokensDetails",
    "NeMoGymResponseOutputItem",
    "NeMoGymResponseOutputMessage",
    "NeMoGymResponseOutputText",
    "NeMoGymResponseOutputTokensDetails",
    "NeMoGymResponseReasoningItem",
    "NeMoGymResponseUsage",
    "NeMoGymSummary",
    "ResponsesConverter",
    "TokenIDLogProbMixin",
    "training_variant_of",
]
