"""``nemo_gym.openai_utils``: the OpenAI-API types and client environments and agents import.

Every name is importable from ``nemo_gym.openai_utils`` (upstream NeMo Gym's names and meanings);
the code lives in three modules:

* :mod:`nemo_gym.openai_utils.responses` - Responses API: ``NeMoGymResponseCreateParamsNonStreaming``
  (strict: an unknown top-level key is an error naming it), input/output items and their
  ``...ForTraining`` variants, usage, ``NeMoGymResponse``, and helpers (``dump``, ``new_id``, ...).
* :mod:`nemo_gym.openai_utils.chat` - Chat Completions: create params, message params (plain dicts),
  ``NeMoGymChatCompletion`` and its choices/messages/tool calls.
* :mod:`nemo_gym.openai_utils.client` - ``NeMoGymAsyncOpenAI`` (bounded retries) and the retry
  status lists ``RATE_LIMIT_ERROR_CODES`` / ``RETRY_ERROR_CODES``.

See each module's docstring for its contract.

The Chat Completions names and the client load on first use (PEP 562 ``__getattr__``): the chat
types subclass the ``openai`` SDK's models (importing the SDK costs ~1 s and ~35 MB per process) and
the client imports aiohttp (~0.2 s); servers that use neither should not pay for them at start-up.
"""

from typing import Any

from nemo_gym.openai_utils.chat_names import CHAT_NAMES as _chat_names
from nemo_gym.openai_utils.responses import (
    REQUIRED_TOKEN_METADATA_FIELDS,
    RESPONSES_TO_TRAIN,
    TOKEN_ID_FIELDS,
    TOKEN_METADATA_FIELDS,
    NeMoGymComputerCallOutput,
    NeMoGymContent,
    NeMoGymEasyInputMessage,
    NeMoGymEasyInputMessageForTraining,
    NeMoGymFunctionCallOutput,
    NeMoGymFunctionToolParam,
    NeMoGymImageGenerationCall,
    NeMoGymInputVideoPart,
    NeMoGymLocalShellCall,
    NeMoGymLocalShellCallOutput,
    NeMoGymMcpApprovalResponse,
    NeMoGymMessage,
    NeMoGymMessageForTraining,
    NeMoGymResponse,
    NeMoGymResponseCodeInterpreterToolCall,
    NeMoGymResponseComputerToolCall,
    NeMoGymResponseCreateParamsNonStreaming,
    NeMoGymResponseCustomToolCall,
    NeMoGymResponseCustomToolCallOutput,
    NeMoGymResponseFileSearchToolCall,
    NeMoGymResponseFunctionToolCall,
    NeMoGymResponseFunctionToolCallForTraining,
    NeMoGymResponseFunctionWebSearch,
    NeMoGymResponseInput,
    NeMoGymResponseInputContentList,
    NeMoGymResponseInputContentPart,
    NeMoGymResponseInputItem,
    NeMoGymResponseInputText,
    NeMoGymResponseInputTokensDetails,
    NeMoGymResponseMcpApprovalRequest,
    NeMoGymResponseMcpCall,
    NeMoGymResponseMcpListTools,
    NeMoGymResponseOutputItem,
    NeMoGymResponseOutputMessage,
    NeMoGymResponseOutputMessageForTraining,
    NeMoGymResponseOutputRefusal,
    NeMoGymResponseOutputText,
    NeMoGymResponseOutputTokensDetails,
    NeMoGymResponseReasoningItem,
    NeMoGymResponseReasoningItemForTraining,
    NeMoGymResponseUsage,
    NeMoGymSummary,
    NeMoGymToolParam,
    OtherContent,
    OtherItem,
    TokenIDLogProbMixin,
    TokenIDLogProbTypedDictMixin,
    TokenIdMixin,
    accumulate_response_usage,
    check_token_fields,
    dump,
    new_id,
    openai_error_message,
    text_of_message,
    training_variant_of,
)

__all__ = [
    *_chat_names,
    "MAX_NUM_TRIES",
    "RATE_LIMIT_ERROR_CODES",
    "RETRY_ERROR_CODES",
    "NeMoGymAsyncOpenAI",
    "REQUIRED_TOKEN_METADATA_FIELDS",
    "RESPONSES_TO_TRAIN",
    "TOKEN_ID_FIELDS",
    "TOKEN_METADATA_FIELDS",
    "NeMoGymComputerCallOutput",
    "NeMoGymContent",
    "NeMoGymEasyInputMessage",
    "NeMoGymEasyInputMessageForTraining",
    "NeMoGymFunctionCallOutput",
    "NeMoGymFunctionToolParam",
    "NeMoGymImageGenerationCall",
    "NeMoGymInputVideoPart",
    "NeMoGymLocalShellCall",
    "NeMoGymLocalShellCallOutput",
    "NeMoGymMcpApprovalResponse",
    "NeMoGymMessage",
    "NeMoGymMessageForTraining",
    "NeMoGymResponse",
    "NeMoGymResponseCodeInterpreterToolCall",
    "NeMoGymResponseComputerToolCall",
    "NeMoGymResponseCreateParamsNonStreaming",
    "NeMoGymResponseCustomToolCall",
    "NeMoGymResponseCustomToolCallOutput",
    "NeMoGymResponseFileSearchToolCall",
    "NeMoGymResponseFunctionToolCall",
    "NeMoGymResponseFunctionToolCallForTraining",
    "NeMoGymResponseFunctionWebSearch",
    "NeMoGymResponseInput",
    "NeMoGymResponseInputContentList",
    "NeMoGymResponseInputContentPart",
    "NeMoGymResponseInputItem",
    "NeMoGymResponseInputText",
    "NeMoGymResponseInputTokensDetails",
    "NeMoGymResponseMcpApprovalRequest",
    "NeMoGymResponseMcpCall",
    "NeMoGymResponseMcpListTools",
    "NeMoGymResponseOutputItem",
    "NeMoGymResponseOutputMessage",
    "NeMoGymResponseOutputMessageForTraining",
    "NeMoGymResponseOutputRefusal",
    "NeMoGymResponseOutputText",
    "NeMoGymResponseOutputTokensDetails",
    "NeMoGymResponseReasoningItem",
    "NeMoGymResponseReasoningItemForTraining",
    "NeMoGymResponseUsage",
    "NeMoGymSummary",
    "NeMoGymToolParam",
    "OtherContent",
    "OtherItem",
    "TokenIdMixin",
    "TokenIDLogProbMixin",
    "TokenIDLogProbTypedDictMixin",
    "accumulate_response_usage",
    "check_token_fields",
    "dump",
    "new_id",
    "openai_error_message",
    "text_of_message",
    "training_variant_of",
]


_CLIENT_NAMES = ("MAX_NUM_TRIES", "RATE_LIMIT_ERROR_CODES", "RETRY_ERROR_CODES", "NeMoGymAsyncOpenAI")


def __getattr__(name: str) -> Any:
    if name in _chat_names or name in _CLIENT_NAMES:
        import importlib

        module = importlib.import_module(
            "nemo_gym.openai_utils.chat" if name in _chat_names else "nemo_gym.openai_utils.client"
        )
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
