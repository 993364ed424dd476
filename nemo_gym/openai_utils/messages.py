"""Anthropic Messages API <-> Responses API: the one place where the two shapes are mapped.

Every model server answers ``POST /v1/messages`` by converting the request into a Responses request,
running its own ``/v1/responses`` path (which, for Chat Completions backends, goes on through
:mod:`nemo_gym.kit.chat_conversion`), and converting the Responses answer back. So there is no
Messages <-> Chat mapping of its own: Chat is reached through Responses. The functions take and return
plain JSON-ready dicts and never do I/O.

Contract
--------
Messages request -> Responses request (:func:`messages_request_to_responses`), validated field by field;
anything wrong raises :class:`MessagesRequestError` (a ``ValueError``) whose message names the field:

* ``max_tokens`` (required, an integer >= 1) -> ``max_output_tokens``; ``model`` is required (a string)
  and echoed on the answer, though the server's config picks the model.
* ``system`` (a string or a list of ``text`` blocks) -> ``instructions``.
* ``messages``: ``user`` / ``assistant`` turns whose content is a string or a list of blocks:
  ``text`` -> message text; ``tool_use`` (assistant) -> a ``function_call`` item (``call_id`` = the
  block's ``id``, ``arguments`` = its ``input`` as JSON); ``tool_result`` (user) -> a
  ``function_call_output`` item (its content string or text blocks joined; ``is_error: true`` prefixes
  the output with ``"Error: "``, Responses having no error flag); ``thinking`` (assistant) -> a
  ``reasoning`` item. ``image``, ``document`` and every other block type are refused by name.
* ``tools`` (``name``, ``description``, ``input_schema``; ``type`` absent or ``"custom"``) -> function
  tools; a server tool (``bash_...``, ``web_search_...``) is refused by name. ``tool_choice``: ``auto`` ->
  ``"auto"``, ``any`` -> ``"required"``, ``tool`` -> that function, ``none`` -> ``"none"``;
  ``disable_parallel_tool_use: true`` -> ``parallel_tool_calls: false``.
* ``temperature``, ``top_p`` -> the same; ``metadata.user_id`` -> ``metadata: {"user_id": ...}``.
  ``top_k`` and ``stop_sequences`` have no Responses field: they are validated and kept on the
  :class:`MessagesCall` (``top_k`` for a server that can apply it; ``stop_sequences`` are applied to the
  answer, see below).
* ``cache_control`` (top level, on blocks, system blocks and tools) and ``citations`` are prompt-caching and
  citation hints; they are accepted and ignored. ``stream: true`` is answered as Messages
  server-sent events (:class:`nemo_gym.server.streaming.MessagesEventEncoder`). Any other top-level field (``thinking``,
  ``service_tier``, ``mcp_servers``, ...) is refused by name.

Responses answer -> Messages answer (:func:`responses_to_messages_answer`, also the starting point of a
streamed answer): ``reasoning`` items -> ``thinking`` blocks (``signature: ""``), ``message`` text and
refusals -> ``text`` blocks, ``function_call`` items -> ``tool_use`` blocks (``id`` = ``call_id``;
arguments that are not a JSON object become ``{"_raw_arguments": "<text>"}``, and such an input is sent
back as that text, so a round trip is lossless). ``stop_reason``: ``max_tokens`` when the response is
``incomplete`` (token budget or context window), else ``tool_use`` when there is a call, else
``end_turn``. ``stop_sequences`` are applied to the text: the earliest occurrence of any of them in
the first text block holding one cuts the text there and drops every block after it, with
``stop_reason: "stop_sequence"`` and ``stop_sequence`` set (the backend generated past it; the cut makes
the answer what a backend that stops there would have given). ``usage`` has ``input_tokens`` /
``output_tokens`` (plus ``cache_read_input_tokens`` from cached tokens and ``cache_creation_input_tokens:
0``).

Errors go out in Anthropic's shape (:func:`messages_error_body`): ``{"type": "error", "error": {"type",
"message"}}``, the type chosen by HTTP status (:func:`error_type_for_status`).

``count_tokens`` (:func:`estimate_input_tokens`) uses a server's tokenizer where it has one; the
estimate used otherwise is documented there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import orjson

from nemo_gym.openai_utils.responses import TOKEN_ID_FIELDS, new_id

__all__ = [
    "COUNT_TOKENS_FIELDS",
    "MESSAGES_FIELDS",
    "RAW_ARGUMENTS_KEY",
    "MessagesCall",
    "MessagesRequestError",
    "apply_stop_sequences",
    "error_type_for_status",
    "estimate_input_tokens",
    "messages_error_body",
    "messages_request_to_responses",
    "responses_to_messages_answer",
]

# The top-level fields of a Messages request this server understands (anything else is refused by name).
MESSAGES_FIELDS = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "metadata",
        "tools",
        "tool_choice",
        "stream",
        "cache_control",
    }
)
# ``POST /v1/messages/count_tokens`` takes the prompt part only (Anthropic's own list).
COUNT_TOKENS_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "cache_control"})
RAW_ARGUMENTS_KEY = "_raw_arguments"
_IGNORED_BLOCK_KEYS = frozenset({"cache_control", "citations"})
_STATUS_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


class MessagesRequestError(ValueError):
    """A Messages request this server cannot take; the message names the field."""


@dataclass
class MessagesCall:
    """A validated Messages request: the Responses request to run, and what Responses cannot carry."""

    params: dict[str, Any]  # a Responses create request (plain JSON)
    model: str
    stop_sequences: list[str] = field(default_factory=list)
    top_k: int | None = None
    stream: bool = False  # answered as Messages server-sent events (nemo_gym.server.streaming)


def error_type_for_status(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status (``api_error`` for any other 5xx or unknown status)."""
    if status in _STATUS_ERROR_TYPES:
        return _STATUS_ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def messages_error_body(status: int, message: str, error_type: str | None = None) -> dict[str, Any]:
    """The body of an error answer in Anthropic's shape."""
    return {
        "type": "error",
        "error": {"type": error_type or error_type_for_status(status), "message": message},
    }


# ------------------------------------------------------------------------------------------------
# Messages request -> Responses request.


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_keys(block: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(block) - allowed - _IGNORED_BLOCK_KEYS)
    if unknown:
        raise MessagesRequestError(f"{where}: unsupported field(s) {', '.join(map(repr, unknown))}")


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise MessagesRequestError(f"{where}: expected a text block, got {kind!r}")
    _check_keys(block, {"type", "text"}, where)
    if not isinstance(block.get("text"), str):
        raise MessagesRequestError(f"{where}.text: must be a string")
    return block["text"]


def _system_text(system: Any) -> str:
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return "\n".join(_text_block(b, f"system[{i}]") for i, b in enumerate(system))
    raise MessagesRequestError("system: must be a string or a list of text blocks")


def _tool_result_output(block: dict[str, Any], where: str) -> str:
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise MessagesRequestError(
                    f"{where}.content[{i}]: block type {kind!r} is not supported in a tool_result "
                    "(only text blocks)"
                )
            parts.append(_text_block(part, f"{where}.content[{i}]"))
        text = "".join(parts)
    else:
        raise MessagesRequestError(f"{where}.content: must be a string or a list of text blocks")
    if block.get("is_error") is True:
        return f"Error: {text}"
    return text


def _arguments_of(block: dict[str, Any], where: str) -> str:
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise MessagesRequestError(f"{where}.input: must be an object")
    if set(arguments) == {RAW_ARGUMENTS_KEY} and isinstance(arguments[RAW_ARGUMENTS_KEY], str):
        return arguments[RAW_ARGUMENTS_KEY]  # what the model sent when it was not a JSON object
    return orjson.dumps(arguments).decode()


def _message_items(index: int, message: Any) -> list[dict[str, Any]]:
    """The Responses input items of one Messages turn, in the order of its blocks."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise MessagesRequestError(f"{where}: must be an object with role and content")
    _check_keys(message, {"role", "content"}, where)
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise MessagesRequestError(f"{where}.role: must be 'user' or 'assistant', got {role!r}")
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "message", "role": role, "content": content}]
    if not isinstance(content, list):
        raise MessagesRequestError(f"{where}.content: must be a string or a list of content blocks")
    items: list[dict[str, Any]] = []
    text: list[str] = []

    def flush() -> None:
        if text:
            items.append({"type": "message", "role": role, "content": "".join(text)})
            text.clear()

    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(_text_block(block, at))
        elif kind == "tool_use" and role == "assistant":
            _check_keys(block, {"type", "id", "name", "input"}, at)
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise MessagesRequestError(f"{at}: a tool_use block needs a string id and name")
            flush()
            items.append(
                {
                    "type": "function_call",
                    "call_id": block["id"],
                    "name": block["name"],
                    "arguments": _arguments_of(block, at),
                }
            )
        elif kind == "tool_result" and role == "user":
            _check_keys(block, {"type", "tool_use_id", "content", "is_error"}, at)
            if not isinstance(block.get("tool_use_id"), str):
                raise MessagesRequestError(f"{at}.tool_use_id: must be a string")
            flush()
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": block["tool_use_id"],
                    "output": _tool_result_output(block, at),
                }
            )
        elif kind == "thinking" and role == "assistant":
            _check_keys(block, {"type", "thinking", "signature"}, at)
            flush()
            if block.get("thinking"):
                items.append(
                    {
                        "type": "reasoning",
                        "id": new_id("rs"),
                        "summary": [{"type": "summary_text", "text": str(block["thinking"])}],
                    }
                )
        elif kind in ("tool_use", "tool_result", "thinking"):
            raise MessagesRequestError(f"{at}: a {kind} block cannot be in a {role} message")
        else:
            raise MessagesRequestError(
                f"{at}: content block type {kind!r} is not supported "
                "(text, tool_use, tool_result and thinking blocks are)"
            )
    flush()
    if not items:  # an empty turn still counts as one (the scripted model counts turns)
        items.append({"type": "message", "role": role, "content": ""})
    return items


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise MessagesRequestError("tools: must be a list")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise MessagesRequestError(f"{where}: must be an object")
        if tool.get("type") not in (None, "custom"):
            raise MessagesRequestError(
                f"{where}.type: tool type {tool['type']!r} is not supported (only client tools with "
                "name, description and input_schema)"
            )
        _check_keys(tool, {"type", "name", "description", "input_schema"}, where)
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise MessagesRequestError(f"{where}.name: required (a string)")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise MessagesRequestError(f"{where}.input_schema: required (a JSON schema object)")
        function: dict[str, Any] = {"type": "function", "name": tool["name"], "parameters": schema}
        if tool.get("description") is not None:
            function["description"] = str(tool["description"])
        out.append(function)
    return out


def _tool_choice(choice: Any, params: dict[str, Any]) -> None:
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise MessagesRequestError("tool_choice: must be {type: auto | any | tool | none}")
    _check_keys(choice, {"type", "name", "disable_parallel_tool_use"}, "tool_choice")
    kind = choice["type"]
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise MessagesRequestError("tool_choice.name: required for type 'tool'")
        params["tool_choice"] = {"type": "function", "name": choice["name"]}
    else:
        params["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if choice.get("disable_parallel_tool_use") is True:
        params["parallel_tool_calls"] = False


def messages_request_to_responses(body: Any, *, count_only: bool = False) -> MessagesCall:
    """Validate a Messages request and convert it (see the module docstring). ``count_only``: a
    ``count_tokens`` request (no ``max_tokens``; only :data:`COUNT_TOKENS_FIELDS`)."""
    if not isinstance(body, dict):
        raise MessagesRequestError("the request body must be a JSON object")
    allowed = COUNT_TOKENS_FIELDS if count_only else MESSAGES_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise MessagesRequestError(f"unsupported field(s): {', '.join(map(repr, unknown))}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise MessagesRequestError("model: required (a string)")
    params: dict[str, Any] = {}
    if not count_only:
        if "max_tokens" not in body:
            raise MessagesRequestError("max_tokens: required (the maximum number of tokens to generate)")
        if not _is_int(body["max_tokens"]) or body["max_tokens"] < 1:
            raise MessagesRequestError(f"max_tokens: must be an integer >= 1, got {body['max_tokens']!r}")
        params["max_output_tokens"] = body["max_tokens"]
        if body.get("stream") not in (None, False, True):
            raise MessagesRequestError(f"stream: must be true or false, got {body.get('stream')!r}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise MessagesRequestError("messages: required (a non-empty list of user/assistant turns)")
    items: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        items.extend(_message_items(i, message))
    params["input"] = items
    if body.get("system") is not None:
        system = _system_text(body["system"])
        if system:
            params["instructions"] = system
    if body.get("tools") is not None:
        tools = _tools(body["tools"])
        if tools:
            params["tools"] = tools
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], params)
    for key, low, high in (("temperature", 0.0, 1.0), ("top_p", 0.0, 1.0)):
        value = body.get(key)
        if value is not None:
            if not _is_number(value) or not low <= value <= high:
                raise MessagesRequestError(f"{key}: must be a number between {low} and {high}, got {value!r}")
            params[key] = value
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise MessagesRequestError(f"top_k: must be an integer >= 1, got {top_k!r}")
    stops = body.get("stop_sequences")
    if stops is not None and (
        not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)
    ):
        raise MessagesRequestError("stop_sequences: must be a list of non-empty strings")
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise MessagesRequestError("metadata: must be an object")
        _check_keys(metadata, {"user_id"}, "metadata")
        if metadata.get("user_id") is not None:
            if not isinstance(metadata["user_id"], str):
                raise MessagesRequestError("metadata.user_id: must be a string")
            params["metadata"] = {"user_id": metadata["user_id"]}
    return MessagesCall(
        params=params,
        model=model,
        stop_sequences=list(stops or []),
        top_k=top_k,
        stream=body.get("stream") is True,
    )


# ------------------------------------------------------------------------------------------------
# Responses answer -> Messages answer.


def _tool_input(arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = orjson.loads(arguments) if isinstance(arguments, (str, bytes)) and arguments else {}
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        return parsed
    return {RAW_ARGUMENTS_KEY: arguments if isinstance(arguments, str) else orjson.dumps(arguments).decode()}


def _content_blocks(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    for item in output:
        kind = item.get("type")
        if kind == "reasoning":
            texts = [p.get("text", "") for p in item.get("content") or [] if isinstance(p, dict)]
            texts = texts or [s.get("text", "") for s in item.get("summary") or [] if isinstance(s, dict)]
            thinking = "\n".join(t for t in texts if t)
            if thinking:
                blocks.append({"type": "thinking", "thinking": thinking, "signature": ""})
        elif kind == "message":
            for part in item.get("content") or []:
                text = part.get("text") if part.get("type") != "refusal" else part.get("refusal")
                if isinstance(text, str) and text:
                    blocks.append({"type": "text", "text": text})
        elif kind == "function_call":
            blocks.append(
                {
                    "type": "tool_use",
                    "id": item.get("call_id") or new_id("toolu"),
                    "name": item.get("name", ""),
                    "input": _tool_input(item.get("arguments")),
                }
            )
    return blocks


def apply_stop_sequences(
    blocks: list[dict[str, Any]], stop_sequences: list[str]
) -> tuple[list[dict[str, Any]], str | None]:
    """``(blocks, stop_sequence)``: the blocks cut at the earliest stop sequence of the first text block
    holding one (blocks after it dropped), and that sequence; unchanged and None when none occurs."""
    if not stop_sequences:
        return blocks, None
    for index, block in enumerate(blocks):
        if block.get("type") != "text":
            continue
        text = block["text"]
        found = [(text.find(s), s) for s in stop_sequences if s in text]
        if found:
            position, sequence = min(found)
            cut = text[:position]
            kept = blocks[:index] + ([{"type": "text", "text": cut}] if cut else [])
            return kept, sequence
    return blocks, None


def responses_to_messages_answer(response: dict[str, Any], call: MessagesCall) -> dict[str, Any]:
    """The Messages answer for a Responses answer to ``call.params`` (see the module docstring)."""
    blocks, stop_sequence = apply_stop_sequences(
        _content_blocks(response.get("output") or []), call.stop_sequences
    )
    if stop_sequence is not None:
        stop_reason = "stop_sequence"
    elif response.get("status") == "incomplete":
        stop_reason = "max_tokens"
    elif any(b["type"] == "tool_use" for b in blocks):
        stop_reason = "tool_use"
    else:
        stop_reason = "end_turn"
    usage = response.get("usage") or {}
    cached = (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
    answer = {
        "id": new_id("msg"),
        "type": "message",
        "role": "assistant",
        "model": call.model,
        "content": blocks,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {
            "input_tokens": int(usage.get("input_tokens") or 0),
            "output_tokens": int(usage.get("output_tokens") or 0),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": int(cached),
        },
    }
    # Training fields, as a model server returns them on the Responses item that carries them (an
    # Anthropic client ignores extra fields; a harness trained here is recorded with them).
    for item in reversed(response.get("output") or []):
        if isinstance(item, dict) and item.get("generation_token_ids") is not None:
            for key in TOKEN_ID_FIELDS:
                if item.get(key) is not None:
                    answer[key] = item[key]
            break
    return answer


def estimate_input_tokens(params: dict[str, Any]) -> int:
    """An estimate of a request's input tokens for a server without a tokenizer: one token per four
    UTF-8 bytes (rounded up) of the system text, every item's text and arguments, and the tools' JSON,
    plus four per input item for the chat template's role markers. English text with a BPE tokenizer
    comes to about four bytes a token; the estimate is not exact for any particular model."""
    size = len((params.get("instructions") or "").encode())
    items = params.get("input") or []
    for item in items:
        for key in ("content", "output", "arguments"):
            value = item.get(key)
            if isinstance(value, str):
                size += len(value.encode())
        for summary in item.get("summary") or []:
            size += len(str(summary.get("text", "")).encode())
    if params.get("tools"):
        size += len(orjson.dumps(params["tools"]))
    return math.ceil(size / 4) + 4 * len(items)
