"""Chat Completions types: request parameters and messages (plain dicts), completions (SDK models).

Contract
--------
* Outputs (``NeMoGymChatCompletion`` -> ``NeMoGymChoice`` -> ``NeMoGymChatCompletionMessage`` ->
  ``NeMoGymChatCompletionMessageToolCall``) are the ``openai`` SDK's models with lists instead of
  iterables; fields we do not model (e.g. a backend's ``reasoning_content``) are kept. A message
  carrying ``prompt_token_ids`` / ``generation_token_ids`` / ``generation_log_probs`` parses into
  ``NeMoGymChatCompletionMessageForTraining``; the three come all together or not at all.
* Inputs (messages, content parts, tools, tool calls) are TypedDicts: validated values stay plain
  dicts, keys we do not model are kept. A message's class is chosen by its ``role`` in O(1); the
  deprecated ``function`` role and an unknown role are errors naming the role.
* ``NeMoGymChatCompletionCreateParamsNonStreaming`` requires ``messages``; ``parallel_tool_calls``
  defaults to ``True``; ``stream`` may only be false. Keys it does not model (``chat_template_kwargs``,
  ``top_k``, ...) are kept and sent on, so a backend that does not know one answers with its own error
  (upstream drops them silently).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Required, Union

from openai.types.chat import (
    ChatCompletion,
    ChatCompletionMessage,
    ChatCompletionMessageCustomToolCall,
    ChatCompletionMessageFunctionToolCall,
)
from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, with_config
from typing_extensions import TypedDict

from nemo_gym.openai_utils.chat_names import CHAT_NAMES
from nemo_gym.openai_utils.responses import (
    TokenIDLogProbMixin,
    TokenIDLogProbTypedDictMixin,
    _has_all_token_fields,
    _OmitNone,
    check_token_fields,
)

__all__ = list(CHAT_NAMES)

_KEEP_EXTRA = ConfigDict(extra="allow")


def _token_fields_checked(v: Any) -> Any:
    """Before-validator: a dict's training fields are all three or none (cheap key lookups only)."""
    if isinstance(v, dict):
        check_token_fields(v)
    return v


# ---------------------------------------------------------------------------------------------
# Outputs.


class NeMoGymFunction(BaseModel):
    """The function of a tool call: its name and its arguments as a JSON string."""

    arguments: str
    name: str


class NeMoGymChatCompletionMessageToolCall(ChatCompletionMessageFunctionToolCall):
    function: NeMoGymFunction


class NeMoGymChatCompletionMessageCustomToolCall(ChatCompletionMessageCustomToolCall):
    pass


NeMoGymChatCompletionMessageToolCallUnion = Annotated[
    NeMoGymChatCompletionMessageToolCall | NeMoGymChatCompletionMessageCustomToolCall,
    Field(discriminator="type"),
]


class NeMoGymChatCompletionMessage(ChatCompletionMessage):
    tool_calls: list[NeMoGymChatCompletionMessageToolCallUnion] | None = None


class NeMoGymChatCompletionMessageForTraining(TokenIDLogProbMixin, NeMoGymChatCompletionMessage):
    pass


def _output_message_tag(v: Any) -> str:
    return "train" if _has_all_token_fields(v) else "plain"


NeMoGymChatCompletionOutputMessage = Annotated[
    Annotated[NeMoGymChatCompletionMessage, Tag("plain")]
    | Annotated[NeMoGymChatCompletionMessageForTraining, Tag("train")],
    Discriminator(_output_message_tag),
    BeforeValidator(_token_fields_checked),
]


class NeMoGymChoice(Choice):
    message: NeMoGymChatCompletionOutputMessage


class NeMoGymChatCompletion(ChatCompletion):
    choices: list[NeMoGymChoice]


# ---------------------------------------------------------------------------------------------
# Inputs (TypedDicts: values stay dicts).


@with_config(_KEEP_EXTRA)
class NeMoGymFunctionDefinition(TypedDict, total=False):
    name: Required[str]
    description: str
    parameters: dict[str, Any]
    strict: bool | None


@with_config(_KEEP_EXTRA)
class NeMoGymChatCompletionToolParam(TypedDict, total=False):
    function: Required[NeMoGymFunctionDefinition]
    type: Required[Literal["function"]]


@with_config(_KEEP_EXTRA)
class NeMoGymChatCompletionCustomToolParam(TypedDict, total=False):
    custom: Required[dict[str, Any]]
    type: Required[Literal["custom"]]


NeMoGymChatCompletionToolUnionParam = Annotated[
    NeMoGymChatCompletionToolParam | NeMoGymChatCompletionCustomToolParam, Field(discriminator="type")
]


@with_config(_KEEP_EXTRA)
class NeMoGymChatCompletionContentPartTextParam(TypedDict, total=False):
    text: Required[str]
    type: Required[Literal["text"]]


@with_config(_KEEP_EXTRA)
class NeMoGymChatCompletionContentPartImageParam(TypedDict, total=False):
    image_url: Required[dict[str, Any]]
    type: Required[Literal["image_url"]]


@with_config(_KEEP_EXTRA)
class NeMoGymChatCompletionContentPartInputAudioParam(TypedDict, total=False):
    input_audio: Required[dict[str, Any]]
    type: Required[Literal["input_audio"]]


@with_config(_KEEP_EXTRA)
class NeMoGymChatCompletionContentPartFileParam(TypedDict, total=False):
    file: Required[dict[str, Any]]
    type: Required[Literal["file"]]


@with_config(_KEEP_EXTRA)
class NeMoGymChatCompletionContentPartVideoUrlParam(TypedDict, total=False):
    video_url: Required[str | dict[str, Any]]
    type: Required[Literal["video_url"]]


NeMoGymChatCompletionContentPartParam = Annotated[
    NeMoGymChatCompletionContentPartTextParam
    | NeMoGymChatCompletionContentPartImageParam
    | NeMoGymChatCompletionContentPartInputAudioParam
    | NeMoGymChatCompletionContentPartFileParam
    | NeMoGymChatCompletionContentPartVideoUrlParam,
    Field(discriminator="type"),
]


@with_config(_KEEP_EXTRA)
class NeMoGymChatCompletionUserMessageParam(TypedDict, total=False):
    content: Required[str | list[NeMoGymChatCompletionContentPartParam]]
    role: Required[Literal["user"]]
    name: str


@with_config(_KEEP_EXTRA)
class NeMoGymChatCompletionSystemMessageParam(TypedDict, total=False):
    content: Required[str | list[NeMoGymChatCompletionContentPartTextParam]]
    role: Required[Literal["system"]]
    name: str


@with_config(_KEEP_EXTRA)
class NeMoGymChatCompletionDeveloperMessageParam(TypedDict, total=False):
    content: Required[str | list[NeMoGymChatCompletionContentPartTextParam]]
    role: Required[Literal["developer"]]
    name: str


@with_config(_KEEP_EXTRA)
class NeMoGymChatCompletionMessageToolCallFunctionParam(TypedDict, total=False):
    arguments: Required[str]
    name: Required[str]


@with_config(_KEEP_EXTRA)
class NeMoGymChatCompletionMessageToolCallParam(TypedDict, total=False):
    id: Required[str]
    function: Required[NeMoGymChatCompletionMessageToolCallFunctionParam]
    type: Required[Literal["function"]]


@with_config(_KEEP_EXTRA)
class NeMoGymChatCompletionMessageCustomToolCallParam(TypedDict, total=False):
    id: Required[str]
    custom: Required[dict[str, Any]]
    type: Required[Literal["custom"]]


NeMoGymChatCompletionMessageToolCallUnionParam = Annotated[
    NeMoGymChatCompletionMessageToolCallParam | NeMoGymChatCompletionMessageCustomToolCallParam,
    Field(discriminator="type"),
]


@with_config(_KEEP_EXTRA)
class NeMoGymChatCompletionAssistantMessageParam(TypedDict, total=False):
    role: Required[Literal["assistant"]]
    content: str | list[dict[str, Any]] | None
    tool_calls: list[NeMoGymChatCompletionMessageToolCallUnionParam] | None
    refusal: str | None
    name: str
    audio: dict[str, Any] | None


@with_config(_KEEP_EXTRA)
class NeMoGymChatCompletionAssistantMessageForTrainingParam(
    NeMoGymChatCompletionAssistantMessageParam, TokenIDLogProbTypedDictMixin, total=False
):
    pass


@with_config(_KEEP_EXTRA)
class NeMoGymChatCompletionToolMessageParam(TypedDict, total=False):
    content: Required[str | list[NeMoGymChatCompletionContentPartTextParam]]
    role: Required[Literal["tool"]]
    tool_call_id: Required[str]


_ROLES = ("developer", "system", "user", "assistant", "tool")


def _message_tag(v: Any) -> str | None:
    role = v.get("role") if isinstance(v, dict) else getattr(v, "role", None)
    if role == "assistant" and _has_all_token_fields(v):
        return "assistant:train"
    return role if role in _ROLES else None


NeMoGymChatCompletionMessageParam = Annotated[
    Annotated[NeMoGymChatCompletionDeveloperMessageParam, Tag("developer")]
    | Annotated[NeMoGymChatCompletionSystemMessageParam, Tag("system")]
    | Annotated[NeMoGymChatCompletionUserMessageParam, Tag("user")]
    | Annotated[NeMoGymChatCompletionAssistantMessageParam, Tag("assistant")]
    | Annotated[NeMoGymChatCompletionToolMessageParam, Tag("tool")]
    | Annotated[NeMoGymChatCompletionAssistantMessageForTrainingParam, Tag("assistant:train")],
    Discriminator(
        _message_tag,
        custom_error_type="chat_message_role",
        custom_error_message="a chat message needs a 'role' of developer, system, user, assistant or tool",
    ),
    BeforeValidator(_token_fields_checked),
]


class NeMoGymChatCompletionCreateParamsNonStreaming(_OmitNone):
    """The body of ``POST /v1/chat/completions`` (non-streaming). Unmodelled keys are kept."""

    model_config = ConfigDict(extra="allow")

    messages: list[NeMoGymChatCompletionMessageParam]
    model: str | None = None
    audio: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, int] | None = None
    logprobs: bool | None = None
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    metadata: dict[str, str] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    n: int | None = None
    parallel_tool_calls: bool = True
    prediction: dict[str, Any] | None = None
    presence_penalty: float | None = None
    reasoning_effort: str | None = None
    response_format: dict[str, Any] | None = None
    seed: int | None = None
    service_tier: str | None = None
    stop: Union[str, list[str], None] = None  # noqa: UP007
    store: bool | None = None
    stream_options: dict[str, Any] | None = None
    temperature: float | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[NeMoGymChatCompletionToolUnionParam] | None = None
    top_logprobs: int | None = None
    top_p: float | None = None
    user: str | None = None
    web_search_options: dict[str, Any] | None = None
    stream: Literal[False] | None = None
