"""Responses API types: request parameters, input/output items, usage and the response object.

Contract
--------
* ``NeMoGymResponseCreateParamsNonStreaming`` is strict at the top level: an unknown key is a
  validation error (FastAPI turns it into a 422 whose message names the key). ``input`` is required;
  ``tools`` defaults to ``[]``, ``parallel_tool_calls`` to ``True`` and ``tool_choice`` to ``"auto"``
  (the OpenAI defaults); ``parallel_tool_calls: null`` is accepted (the OpenAI API allows it, upstream's
  recorded rows carry it) and kept as given, meaning the default. ``tools`` and input content parts stay plain dicts (as the SDK's TypedDicts
  do), checked for the keys that matter (a function tool needs a string ``name``).
* Items (input and output) are lenient: fields we do not model are kept and passed on unchanged, so
  ``previous_input + response.output`` round-trips without loss. An item's class is chosen from its
  ``type`` (and, for messages, its ``role``/``content``) in O(1), never by trying every class:
  an assistant message with a list of output parts (or with no role) is a
  ``NeMoGymResponseOutputMessage`` (``role`` defaults to ``"assistant"``, ``status`` to
  ``"completed"``); any other message is a ``NeMoGymEasyInputMessage``. Unknown item types are kept
  verbatim as :class:`OtherItem`; a dict without ``type`` is a message.
* Training fields ``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs`` (and the
  opaque ``routed_experts``) may sit on messages, function calls and reasoning items. The three come
  all together or not at all, with one log-prob per generated token; an item carrying them parses
  into its ``...ForTraining`` class (where they are required). They pass every hop unchanged.
* Serialise with :func:`dump` (``exclude_unset``) so an absent field stays absent on the next hop;
  optional fields left at ``None`` are never serialised.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Required, Union

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PlainValidator,
    Tag,
    model_validator,
)
from typing_extensions import TypedDict

TOKEN_ID_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
REQUIRED_TOKEN_METADATA_FIELDS = frozenset(TOKEN_ID_FIELDS)
TOKEN_METADATA_FIELDS = REQUIRED_TOKEN_METADATA_FIELDS | {"routed_experts"}


def _is_none(value: Any) -> bool:
    return value is None


class _OmitNone(BaseModel):
    """Optional fields left at ``None`` are not serialised: an absent field stays absent on the next hop.

    Each such field (default ``None``, not required) of this class and of every subclass gets pydantic's
    ``exclude_if``, so the rule runs inside pydantic-core's serialiser. (A ``model_serializer(mode="wrap")``
    did the same in Python, once per nested model: dumping a Responses object took three to four times as
    long.) The schema is built at first use (``defer_build``), after the fields are marked."""

    model_config = ConfigDict(defer_build=True)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        for field in cls.model_fields.values():
            if field.default is None and not field.is_required() and field.exclude_if is None:
                field.exclude_if = _is_none


class _Lenient(_OmitNone):
    model_config = ConfigDict(extra="allow")


def _has_all_token_fields(v: Any) -> bool:
    if isinstance(v, dict):
        return all(v.get(f) is not None for f in TOKEN_ID_FIELDS)
    return all(getattr(v, f, None) is not None for f in TOKEN_ID_FIELDS)


def check_token_fields(values: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless the training fields in ``values`` are all three or none, with one
    log-prob per generated token."""
    present = [f for f in sorted(TOKEN_METADATA_FIELDS) if values.get(f) is not None]
    if not present:
        return
    missing = [f for f in TOKEN_ID_FIELDS if values.get(f) is None]
    if missing:
        raise ValueError(
            f"token-id fields come all together: has {present} but not {missing} "
            f"(token metadata must include all of {list(TOKEN_ID_FIELDS)})"
        )
    ids, log_probs = values["generation_token_ids"], values["generation_log_probs"]
    if isinstance(ids, list) and isinstance(log_probs, list) and len(ids) != len(log_probs):
        raise ValueError(
            f"generation_token_ids and generation_log_probs must have the same length "
            f"({len(ids)} != {len(log_probs)})"
        )


class TokenIdMixin(BaseModel):
    """The optional per-item training information (all three fields or none)."""

    prompt_token_ids: list[int] | None = None
    generation_token_ids: list[int] | None = None
    generation_log_probs: list[float] | None = None
    # Opaque to us (e.g. per-token routed MoE experts, or a trainer's string envelope): passed on as is.
    routed_experts: str | list[Any] | None = None

    @model_validator(mode="after")
    def _all_or_none(self) -> TokenIdMixin:
        if (
            self.generation_token_ids is None
            and self.prompt_token_ids is None
            and self.generation_log_probs is None
            and self.routed_experts is None
        ):
            return self  # the common case, kept cheap: no training fields at all
        check_token_fields(
            {
                "prompt_token_ids": self.prompt_token_ids,
                "generation_token_ids": self.generation_token_ids,
                "generation_log_probs": self.generation_log_probs,
                "routed_experts": self.routed_experts,
            }
        )
        return self


class TokenIDLogProbMixin(BaseModel):
    """The training fields as required fields (mixed into every ``...ForTraining`` class, first)."""

    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    routed_experts: str | list[Any] | None = None


class TokenIDLogProbTypedDictMixin(TypedDict, total=False):
    """The training fields on a TypedDict (Chat Completions assistant message params)."""

    prompt_token_ids: Required[list[int]]
    generation_token_ids: Required[list[int]]
    generation_log_probs: Required[list[float]]
    routed_experts: str | list[Any]


# ---------------------------------------------------------------------------------------------
# Content parts.


class NeMoGymResponseOutputText(_Lenient):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] | None = None


class NeMoGymResponseOutputRefusal(_Lenient):
    type: Literal["refusal"] = "refusal"
    refusal: str


class OtherContent(_Lenient):
    """An output content part of a type we do not model: kept verbatim."""

    type: str


def _tag_of(v: Any, default: str | None = None) -> Any:
    return v.get("type", default) if isinstance(v, dict) else getattr(v, "type", default)


def _content_tag(v: Any) -> str:
    t = _tag_of(v)
    return t if t in ("output_text", "refusal") else "other"


NeMoGymContent = Annotated[
    Annotated[NeMoGymResponseOutputText, Tag("output_text")]
    | Annotated[NeMoGymResponseOutputRefusal, Tag("refusal")]
    | Annotated[OtherContent, Tag("other")],
    Discriminator(_content_tag),
]


class NeMoGymResponseInputText(TypedDict, total=False):
    """An ``input_text`` content part (a plain dict, like the SDK's ``ResponseInputTextParam``)."""

    text: Required[str]
    type: Required[Literal["input_text"]]


class NeMoGymInputVideoPart(TypedDict, total=False):
    """An ``input_video`` content part: exactly one of ``video_url`` / ``video`` (a URL string or
    a dict with a non-empty ``url``)."""

    type: Required[Literal["input_video"]]
    video_url: str | dict[str, Any]
    video: str | dict[str, Any]


def _input_part(v: Any) -> dict[str, Any]:
    """An input content part, checked and kept as a dict (the caller's keys, nothing added)."""
    if isinstance(v, BaseModel):
        v = v.model_dump(mode="json", exclude_none=True)
    if not isinstance(v, dict):
        raise ValueError(f"a content part must be an object, got {type(v).__name__}")
    kind = v.get("type")
    if not isinstance(kind, str):
        raise ValueError("a content part needs a string 'type' (e.g. 'input_text')")
    if kind in ("input_text", "output_text") and not isinstance(v.get("text"), str):
        raise ValueError(f"a {kind!r} content part needs a string 'text'")
    if kind == "input_video":
        sources = [k for k in ("video_url", "video") if k in v]
        if len(sources) != 1:
            raise ValueError("input_video needs exactly one of 'video_url' or 'video'")
        source = v[sources[0]]
        url = source.get("url") if isinstance(source, dict) else source
        if not isinstance(url, str) or not url.strip():
            raise ValueError(f"input_video.{sources[0]} needs a non-empty URL")
    return dict(v)


NeMoGymResponseInputContentPart = Annotated[
    dict[str, Any], PlainValidator(_input_part, json_schema_input_type=dict[str, Any])
]
NeMoGymResponseInputContentList = list[NeMoGymResponseInputContentPart]


# ---------------------------------------------------------------------------------------------
# Items.


class NeMoGymEasyInputMessage(TokenIdMixin, _Lenient):
    """An input message; ``content`` is a string or a list of content-part dicts."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | NeMoGymResponseInputContentList
    id: str | None = None
    status: str | None = None


class NeMoGymMessage(NeMoGymEasyInputMessage):
    """An input message in its long form (list content, a status)."""

    role: Literal["user", "system", "developer"]
    content: NeMoGymResponseInputContentList
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class NeMoGymResponseOutputMessage(TokenIdMixin, _Lenient):
    """A message the model wrote: output text / refusal parts; ``role`` defaults to ``"assistant"``."""

    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[NeMoGymContent]
    id: str | None = None
    status: str = "completed"


class NeMoGymResponseFunctionToolCall(TokenIdMixin, _Lenient):
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class NeMoGymFunctionCallOutput(_Lenient):
    type: Literal["function_call_output"] = "function_call_output"
    call_id: str
    output: str | list[Any]
    id: str | None = None
    status: str | None = None


class NeMoGymSummary(_Lenient):
    type: Literal["summary_text"] = "summary_text"
    text: str


class NeMoGymResponseReasoningItem(TokenIdMixin, _Lenient):
    type: Literal["reasoning"] = "reasoning"
    id: str | None = None
    summary: list[NeMoGymSummary] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class OtherItem(_Lenient):
    """Any item type we do not model (item_reference, a vendor's own, ...): kept verbatim."""

    type: str


# Hosted and other tool items: kept field for field; only ``type`` (and an optional ``id``) is modelled.
class _HostedItem(_Lenient):
    id: str | None = None


class NeMoGymResponseMcpCall(_HostedItem):
    type: Literal["mcp_call"] = "mcp_call"


class NeMoGymResponseMcpListTools(_HostedItem):
    type: Literal["mcp_list_tools"] = "mcp_list_tools"
    tools: list[Any] = Field(default_factory=list)


class NeMoGymResponseMcpApprovalRequest(_HostedItem):
    type: Literal["mcp_approval_request"] = "mcp_approval_request"


class NeMoGymMcpApprovalResponse(_HostedItem):
    type: Literal["mcp_approval_response"] = "mcp_approval_response"


class NeMoGymResponseFileSearchToolCall(_HostedItem):
    type: Literal["file_search_call"] = "file_search_call"


class NeMoGymResponseFunctionWebSearch(_HostedItem):
    type: Literal["web_search_call"] = "web_search_call"


class NeMoGymResponseComputerToolCall(_HostedItem):
    type: Literal["computer_call"] = "computer_call"


class NeMoGymComputerCallOutput(_HostedItem):
    type: Literal["computer_call_output"] = "computer_call_output"


class NeMoGymImageGenerationCall(_HostedItem):
    type: Literal["image_generation_call"] = "image_generation_call"


class NeMoGymResponseCodeInterpreterToolCall(_HostedItem):
    type: Literal["code_interpreter_call"] = "code_interpreter_call"


class NeMoGymLocalShellCall(_HostedItem):
    type: Literal["local_shell_call"] = "local_shell_call"


class NeMoGymLocalShellCallOutput(_HostedItem):
    type: Literal["local_shell_call_output"] = "local_shell_call_output"


class NeMoGymResponseCustomToolCall(_HostedItem):
    type: Literal["custom_tool_call"] = "custom_tool_call"


class NeMoGymResponseCustomToolCallOutput(_HostedItem):
    type: Literal["custom_tool_call_output"] = "custom_tool_call_output"


# Training variants: the same item with the token fields required (TokenIDLogProbMixin first so its
# required fields win over the optional ones of the base).
class NeMoGymEasyInputMessageForTraining(TokenIDLogProbMixin, NeMoGymEasyInputMessage):
    pass


class NeMoGymMessageForTraining(TokenIDLogProbMixin, NeMoGymMessage):
    pass


class NeMoGymResponseOutputMessageForTraining(TokenIDLogProbMixin, NeMoGymResponseOutputMessage):
    pass


class NeMoGymResponseFunctionToolCallForTraining(TokenIDLogProbMixin, NeMoGymResponseFunctionToolCall):
    pass


class NeMoGymResponseReasoningItemForTraining(TokenIDLogProbMixin, NeMoGymResponseReasoningItem):
    pass


RESPONSES_TO_TRAIN: dict[type[BaseModel], type[BaseModel]] = {
    NeMoGymEasyInputMessage: NeMoGymEasyInputMessageForTraining,
    NeMoGymMessage: NeMoGymMessageForTraining,
    NeMoGymResponseOutputMessage: NeMoGymResponseOutputMessageForTraining,
    NeMoGymResponseFunctionToolCall: NeMoGymResponseFunctionToolCallForTraining,
    NeMoGymResponseReasoningItem: NeMoGymResponseReasoningItemForTraining,
}


def training_variant_of(item_cls: type) -> type:
    """The ``...ForTraining`` class of ``item_cls``; ``NotImplementedError`` naming it when it has none."""
    try:
        return RESPONSES_TO_TRAIN[item_cls]
    except KeyError:
        raise NotImplementedError(
            f"{item_cls.__name__} has no ForTraining variant: token ids and log-probs can be attached only to "
            f"{', '.join(c.__name__ for c in RESPONSES_TO_TRAIN)}"
        ) from None


_HOSTED: dict[str, type[BaseModel]] = {
    cls.model_fields["type"].default: cls
    for cls in (
        NeMoGymResponseMcpCall,
        NeMoGymResponseMcpListTools,
        NeMoGymResponseMcpApprovalRequest,
        NeMoGymMcpApprovalResponse,
        NeMoGymResponseFileSearchToolCall,
        NeMoGymResponseFunctionWebSearch,
        NeMoGymResponseComputerToolCall,
        NeMoGymComputerCallOutput,
        NeMoGymImageGenerationCall,
        NeMoGymResponseCodeInterpreterToolCall,
        NeMoGymLocalShellCall,
        NeMoGymLocalShellCallOutput,
        NeMoGymResponseCustomToolCall,
        NeMoGymResponseCustomToolCallOutput,
    )
}
_TRAINABLE = frozenset({"input_message", "output_message", "function_call", "reasoning"})
_TRAIN_TAG = {t: f"{t}:train" for t in _TRAINABLE}
_UNTRAINED_TAGS = frozenset({*_HOSTED, "function_call_output"})


def _item_tag(v: Any) -> str:
    """The union member for an item, from a few key lookups (this runs for every item of every hop)."""
    if isinstance(v, dict):
        t = v.get("type", "message")
        if t == "message":
            role = v.get("role")
            output = role is None or (role == "assistant" and not isinstance(v.get("content"), str))
            t = "output_message" if output else "input_message"
        elif t in _UNTRAINED_TAGS:
            return t
        elif t not in _TRAINABLE:
            return "other"
        if v.get("generation_token_ids") is None:
            return t
        return _TRAIN_TAG[t] if _has_all_token_fields(v) else t
    t = getattr(v, "type", "message")
    if t == "message":
        output = isinstance(v, NeMoGymResponseOutputMessage) or getattr(v, "role", None) is None
        t = "output_message" if output else "input_message"
    elif t in _UNTRAINED_TAGS:
        return t
    elif t not in _TRAINABLE:
        return "other"
    return _TRAIN_TAG[t] if _has_all_token_fields(v) else t


def _union_of(tagged: dict[str, type[BaseModel]]) -> Any:
    members = tuple(Annotated[cls, Tag(tag)] for tag, cls in tagged.items())
    return Annotated[
        Union[members],  # noqa: UP007 - built from a computed tuple
        Discriminator(_item_tag),
    ]


_ITEM_CLASSES: dict[str, type[BaseModel]] = {
    "input_message": NeMoGymEasyInputMessage,
    "input_message:train": NeMoGymEasyInputMessageForTraining,
    "output_message": NeMoGymResponseOutputMessage,
    "output_message:train": NeMoGymResponseOutputMessageForTraining,
    "function_call": NeMoGymResponseFunctionToolCall,
    "function_call:train": NeMoGymResponseFunctionToolCallForTraining,
    "function_call_output": NeMoGymFunctionCallOutput,
    "reasoning": NeMoGymResponseReasoningItem,
    "reasoning:train": NeMoGymResponseReasoningItemForTraining,
    **_HOSTED,
    "other": OtherItem,
}

NeMoGymResponseInputItem = _union_of(_ITEM_CLASSES)
NeMoGymResponseOutputItem = NeMoGymResponseInputItem
NeMoGymResponseInput = list[NeMoGymResponseInputItem]


# ---------------------------------------------------------------------------------------------
# Tools and request parameters.


class NeMoGymFunctionToolParam(TypedDict, total=False):
    """A Responses API function tool (a plain dict, like the SDK's ``FunctionToolParam``)."""

    name: Required[str]
    parameters: dict[str, Any] | None
    strict: bool | None
    type: Required[Literal["function"]]
    description: str | None


def _tool(v: Any) -> dict[str, Any]:
    """A tool, checked and kept as a dict: a function tool (``type`` absent or ``"function"``) needs a
    string ``name`` and an object (or null) ``parameters``; other tool types need a string ``type``."""
    if isinstance(v, BaseModel):
        v = v.model_dump(mode="json", exclude_none=True)
    if not isinstance(v, dict):
        raise ValueError(f"a tool must be an object, got {type(v).__name__}")
    kind = v.get("type", "function")
    if not isinstance(kind, str):
        raise ValueError("a tool's 'type' must be a string")
    if kind == "function":
        if not isinstance(v.get("name"), str) or not v["name"]:
            raise ValueError("a function tool needs a non-empty string 'name'")
        if v.get("parameters") is not None and not isinstance(v["parameters"], dict):
            raise ValueError(f"function tool {v['name']!r}: 'parameters' must be a JSON-schema object")
    return dict(v)


NeMoGymToolParam = Annotated[dict[str, Any], PlainValidator(_tool, json_schema_input_type=dict[str, Any])]


class NeMoGymResponseCreateParamsNonStreaming(_OmitNone):
    """The body of ``POST /v1/responses``. Unknown top-level keys are rejected (422)."""

    model_config = ConfigDict(extra="forbid")

    input: str | NeMoGymResponseInput
    model: str | None = None
    instructions: str | None = None
    tools: list[NeMoGymToolParam] = Field(default_factory=list)
    tool_choice: Any = "auto"
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    # null is accepted (the OpenAI API and the SDK's params type allow it; upstream's recorded rows carry
    # it) and means the default, True; it is kept as given.
    parallel_tool_calls: bool | None = True
    metadata: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    truncation: str | None = None
    store: bool | None = None
    stream: Literal[False] | None = None
    include: list[str] | None = None
    user: str | None = None
    top_logprobs: int | None = None
    seed: int | None = None
    previous_response_id: str | None = None
    # Accepted for SDK compatibility; model servers may ignore them.
    background: bool | None = None
    background_options: Any = None
    conversation: Any = None
    context_management: Any = None
    prompt: Any = None
    prompt_cache_key: str | None = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    stream_options: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None

    def input_items(self) -> list[Any]:
        """``input`` as a list of items (a bare string becomes one user message)."""
        if isinstance(self.input, str):
            return [NeMoGymEasyInputMessage(role="user", content=self.input)]
        return list(self.input)


# ---------------------------------------------------------------------------------------------
# Usage and the response object.


class NeMoGymResponseInputTokensDetails(_Lenient):
    cached_tokens: int | None = 0  # None: the backend did not say
    cache_write_tokens: int = 0  # required by recent ``openai`` SDKs' ``InputTokensDetails``


class NeMoGymResponseOutputTokensDetails(_Lenient):
    reasoning_tokens: int | None = 0


def _add_counts(a: int | None, b: int | None) -> int | None:
    """A sum of token counts; unknown (None) on either side stays unknown."""
    return None if a is None or b is None else a + b


class NeMoGymResponseUsage(_Lenient):
    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    input_tokens_details: NeMoGymResponseInputTokensDetails = Field(
        default_factory=NeMoGymResponseInputTokensDetails
    )
    output_tokens_details: NeMoGymResponseOutputTokensDetails = Field(
        default_factory=NeMoGymResponseOutputTokensDetails
    )

    def plus(self, other: NeMoGymResponseUsage) -> NeMoGymResponseUsage:
        """A new usage: this one and ``other`` added up (detail counts stay None if either is)."""
        mine_in, theirs_in = self.input_tokens_details, other.input_tokens_details
        mine_out, theirs_out = self.output_tokens_details, other.output_tokens_details
        return NeMoGymResponseUsage(
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            total_tokens=self.total_tokens + other.total_tokens,
            input_tokens_details=NeMoGymResponseInputTokensDetails(
                cached_tokens=_add_counts(mine_in.cached_tokens, theirs_in.cached_tokens),
                cache_write_tokens=mine_in.cache_write_tokens + theirs_in.cache_write_tokens,
            ),
            output_tokens_details=NeMoGymResponseOutputTokensDetails(
                reasoning_tokens=_add_counts(mine_out.reasoning_tokens, theirs_out.reasoning_tokens)
            ),
        )

    @classmethod
    def sum_from_list(cls, usages: Any) -> NeMoGymResponseUsage:
        """The sum of ``usages`` (all zeros for none)."""
        total = cls()
        for usage in usages:
            total = total.plus(usage)
        return total


def accumulate_response_usage(
    total: NeMoGymResponseUsage | None, additional: NeMoGymResponseUsage | None
) -> NeMoGymResponseUsage | None:
    """``total + additional`` as a new object; either may be None (then the other, copied, is the answer)."""
    if additional is None:
        return total
    if total is None:
        return additional.model_copy(deep=True)
    return total.plus(additional)


class _AttributeOrKey(_Lenient):
    """A small sub-object read as the SDK reads it (``details.reason``) and as a dict (``details["reason"]``,
    ``details.get("reason")``), so code written either way works."""

    def __getitem__(self, key: str) -> Any:
        data = self.model_dump()
        if key not in data:
            raise KeyError(key)
        return data[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.model_dump().get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self.model_dump()


class NeMoGymResponseIncompleteDetails(_AttributeOrKey):
    """Why a response is incomplete (``reason``: ``"max_output_tokens"``, ``"content_filter"``, ...)."""

    reason: str | None = None


class NeMoGymResponseError(_AttributeOrKey):
    """A failed response's error (``code``, ``message``)."""

    code: str | None = None
    message: str | None = None


class NeMoGymResponse(BaseModel):
    """A Responses API response object, as the SDK's ``Response`` parses it (every field always present).

    As in the SDK, ``status`` is ``None`` unless the server set it (some providers leave it out), and
    ``incomplete_details`` / ``error`` are objects with attributes (``incomplete_details.reason``);
    they also answer dict-style reads.
    """

    model_config = ConfigDict(extra="allow")

    id: str = Field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    object: Literal["response"] = "response"
    created_at: float = Field(default_factory=lambda: float(int(time.time())))
    model: str = ""
    # Unset stays None, as in the SDK's ``Response`` and upstream's subclass of it (not "completed": a
    # response that did not say is not claimed to be complete). Our model servers always set it.
    status: str | None = None
    output: list[NeMoGymResponseOutputItem]  # required, as in the SDK: `{}` is not a response
    usage: NeMoGymResponseUsage | None = None
    parallel_tool_calls: bool = True
    tool_choice: Any = "auto"
    tools: list[NeMoGymToolParam] = Field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    instructions: str | None = None
    metadata: dict[str, Any] | None = None
    incomplete_details: NeMoGymResponseIncompleteDetails | None = None
    error: NeMoGymResponseError | None = None

    @property
    def output_text(self) -> str:
        """The text of every ``output_text`` part of every output message, concatenated."""
        parts = []
        for item in self.output:
            if isinstance(item, NeMoGymResponseOutputMessage):
                parts.extend(p.text for p in item.content if isinstance(p, NeMoGymResponseOutputText))
        return "".join(parts)


# ---------------------------------------------------------------------------------------------
# Helpers.


def dump(model: BaseModel) -> dict[str, Any]:
    """JSON-ready dict of ``model`` with unset fields left out (absent stays absent)."""
    return model.model_dump(mode="json", exclude_unset=True)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_of_message(item: BaseModel | dict) -> str:
    """All text of a message item (string content or its text parts)."""
    content = item.get("content") if isinstance(item, dict) else getattr(item, "content", None)
    if isinstance(content, str):
        return content
    out = []
    for part in content or []:
        text = part.get("text") if isinstance(part, dict) else getattr(part, "text", None)
        if isinstance(text, str):
            out.append(text)
    return "".join(out)


def openai_error_message(body: Any) -> str:
    """The message of an OpenAI-compatible error body: ``{"error": {"message": ...}}``, ``{"message": ...}``
    or ``{"detail": ...}``; bytes are parsed first; anything else is shown (shortened) as it is."""
    if isinstance(body, (bytes, bytearray)):
        try:
            body = orjson.loads(body)
        except orjson.JSONDecodeError:
            return bytes(body).decode(errors="replace")[:1000]
    if isinstance(body, dict):
        inner = body.get("error")
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
        if isinstance(inner, str):
            return inner
        for key in ("message", "detail"):
            if body.get(key):
                return str(body[key])
    return str(body)[:2000]
