"""Responses API <-> Chat Completions conversion: the one place where the two shapes are mapped.

Every model server that talks Chat Completions to its backend (``vllm_model``, ``local_model``)
uses these functions; they take and return plain JSON-ready dicts and never do I/O.

Contract
--------
Responses request -> Chat Completions request (:func:`responses_params_to_chat_request`):

* ``instructions`` becomes the first ``system`` message; ``developer`` and ``system`` messages
  become ``system`` messages (their text parts joined).
* ``user`` messages keep string content; a content list becomes a string when it is one text part,
  else a list of chat parts (``text``, ``image_url``, ``file``).
* An assistant *turn* (the items between two non-assistant items) becomes **one** assistant
  message: ``reasoning`` items -> ``reasoning_content``, ``message`` items -> ``content``,
  ``function_call`` items -> ``tool_calls`` (``id`` = the call's ``call_id``). A reasoning item
  after text or calls of the turn starts a new assistant message (reasoning precedes output).
* ``function_call_output`` -> ``{"role": "tool", "tool_call_id": call_id, "content": text}``.
* Function tools -> ``{"type": "function", "function": {...}}``; ``tool_choice``,
  ``parallel_tool_calls``, ``max_output_tokens`` (-> ``max_tokens``), ``temperature``, ``top_p``,
  ``seed``, ``user``, ``top_logprobs``, ``text.format`` (-> ``response_format``) and
  ``reasoning.effort`` (-> ``reasoning_effort``) are mapped; parameters that were not set are not sent.
* With ``keep_token_ids=True`` the training fields of a turn's items (``prompt_token_ids``,
  ``generation_token_ids``; see :data:`SENT_TOKEN_ID_FIELDS`) are put on that turn's assistant
  message, so a backend that understands them can reuse the exact tokens instead of re-tokenising.
* Anything that cannot be expressed in Chat Completions (a hosted tool, an ``item_reference``)
  raises :class:`ChatConversionError` (a ``ValueError``) naming the item or tool.

Chat Completions answer -> Responses output (:func:`chat_message_to_output_items`):

* Reasoning comes from ``reasoning_content`` (or vLLM's newer ``reasoning``), else from a
  ``<think>...</think>`` block in the content (also an unterminated ``<think>`` when generation was
  cut off, and a bare ``...</think>`` when the chat template opened the block in the prompt). It
  becomes a ``reasoning`` item first, then a ``message`` item if any text is left, then one
  ``function_call`` item per tool call (``call_id`` = the tool call's id, minted if missing).

:func:`build_response` wraps output items into a complete Responses ``response`` object that the
official SDK's ``Response`` parses strictly. Round trips are lossless for what both APIs can carry:
``chat_message_to_output_items`` then ``responses_to_chat_messages`` gives back the same message.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from nemo_gym.openai_utils.responses import new_id

__all__ = [
    "ChatConversionError",
    "SENT_TOKEN_ID_FIELDS",
    "build_response",
    "chat_message_to_output_items",
    "chat_usage_to_responses_usage",
    "responses_params_to_chat_request",
    "responses_to_chat_messages",
    "responses_tools_to_chat_tools",
    "split_think_tags",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# The training fields sent back to a Chat Completions backend on an assistant message (log probs are
# not needed to rebuild a prompt, so they are not sent).
SENT_TOKEN_ID_FIELDS = ("prompt_token_ids", "generation_token_ids")

# Responses request keys echoed on the response object (None when the request did not set them).
_ECHOED_PARAMS = (
    "instructions",
    "max_output_tokens",
    "max_tool_calls",
    "metadata",
    "previous_response_id",
    "reasoning",
    "temperature",
    "text",
    "top_logprobs",
    "top_p",
    "truncation",
    "user",
)


class ChatConversionError(ValueError):
    """Something in a Responses request has no Chat Completions equivalent."""


# ------------------------------------------------------------------------------------------------
# Responses -> Chat Completions.


def _text_parts(content: Any) -> str:
    """All text of a string or a list of content parts (input_text, output_text, text, refusal)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, dict):
            text = part.get("text")
            if text is None and part.get("type") == "refusal":
                text = part.get("refusal")
            if isinstance(text, str):
                out.append(text)
    return "".join(out)


def _user_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A user message's content: a string, or chat content parts when there is more than one text."""
    if content is None or isinstance(content, str):
        return content or ""
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image":
            url = part.get("image_url")
            if not url:
                raise ChatConversionError(
                    f"{where}: an input_image without image_url (file_id images are not supported)"
                )
            image: dict[str, Any] = {"url": url}
            if part.get("detail"):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        elif kind == "input_file":
            file = {k: part[k] for k in ("file_data", "file_id", "filename") if part.get(k) is not None}
            parts.append({"type": "file", "file": file})
        else:
            raise ChatConversionError(
                f"{where}: content part type {kind!r} cannot be sent to a Chat Completions backend"
            )
    if len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0]["text"]
    return parts


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its ``reasoning_text`` content if any, else its summary texts."""
    content = [p.get("text", "") for p in item.get("content") or [] if isinstance(p, dict) and p.get("text")]
    if content:
        return "\n".join(content)
    return "\n".join(
        s.get("text", "") for s in item.get("summary") or [] if isinstance(s, dict) and s.get("text")
    )


def _tool_output_text(output: Any) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(
        isinstance(p, dict) and isinstance(p.get("text"), str) for p in output
    ):
        return "".join(p["text"] for p in output)
    return orjson.dumps(output).decode()


def responses_to_chat_messages(
    params: dict[str, Any], *, keep_token_ids: bool = False
) -> list[dict[str, Any]]:
    """The Chat Completions ``messages`` for a Responses request (``instructions`` + ``input``).

    See the module docstring for the rules. ``keep_token_ids`` copies ``prompt_token_ids`` and
    ``generation_token_ids`` of a turn's items onto that turn's assistant message.
    """
    messages: list[dict[str, Any]] = []
    if params.get("instructions"):
        messages.append({"role": "system", "content": params["instructions"]})
    raw = params.get("input")
    items: list[Any] = [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw or [])

    turn: dict[str, Any] | None = None  # the assistant message of the current turn, if one is open

    def open_turn() -> dict[str, Any]:
        nonlocal turn
        turn = {"role": "assistant", "content": None}
        messages.append(turn)
        return turn

    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise ChatConversionError(f"{where}: expected an object, got {type(item).__name__}")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role in ("system", "developer"):
                messages.append({"role": "system", "content": _text_parts(item.get("content"))})
                turn = None
            elif role == "user":
                messages.append({"role": "user", "content": _user_content(item.get("content"), where)})
                turn = None
            elif role == "assistant":
                # A refusal part is sent as text: chat templates only render ``content``.
                current = turn if turn is not None and turn["content"] is None else open_turn()
                current["content"] = _text_parts(item.get("content"))
            else:
                raise ChatConversionError(
                    f"{where}: message role {role!r} is not one of user/assistant/system/developer"
                )
        elif kind == "reasoning":
            text = _reasoning_text(item)
            if not text:  # e.g. only encrypted_content: nothing a Chat Completions backend can read
                continue
            fresh = turn is not None and turn["content"] is None and not turn.get("tool_calls")
            current = turn if fresh else open_turn()
            assert current is not None
            previous = current.get("reasoning_content")
            current["reasoning_content"] = f"{previous}\n{text}" if previous else text
        elif kind == "function_call":
            current = turn if turn is not None else open_turn()
            current.setdefault("tool_calls", []).append(
                {
                    "id": item.get("call_id") or item.get("id") or new_id("call"),
                    "type": "function",
                    "function": {"name": item.get("name", ""), "arguments": item.get("arguments") or ""},
                }
            )
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id", ""),
                    "content": _tool_output_text(item.get("output")),
                }
            )
            turn = None
            continue
        else:
            raise ChatConversionError(
                f"{where}: item type {kind!r} cannot be sent to a Chat Completions backend"
            )
        if keep_token_ids and turn is not None and item.get("generation_token_ids") is not None:
            for field in SENT_TOKEN_ID_FIELDS:
                turn[field] = item.get(field)
    return messages


def responses_tools_to_chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in Chat Completions shape; None when there are none. Other tool types raise."""
    if not tools:
        return None
    out = []
    for index, tool in enumerate(tools):
        kind = tool.get("type", "function")
        if kind != "function":
            raise ChatConversionError(
                f"tools[{index}]: tool type {kind!r} is not supported by a Chat Completions backend"
            )
        function: dict[str, Any] = {"name": tool["name"]}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt["type"] == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "description", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt["type"]}


def responses_params_to_chat_request(
    params: dict[str, Any], model: str, *, keep_token_ids: bool = False
) -> dict[str, Any]:
    """A Chat Completions request body for a Responses request (only parameters that were set)."""
    request: dict[str, Any] = {
        "model": model,
        "messages": responses_to_chat_messages(params, keep_token_ids=keep_token_ids),
    }
    tools = responses_tools_to_chat_tools(params.get("tools"))
    if tools:
        request["tools"] = tools
        if params.get("tool_choice") is not None:
            request["tool_choice"] = _chat_tool_choice(params["tool_choice"])
        if params.get("parallel_tool_calls") is not None:
            request["parallel_tool_calls"] = params["parallel_tool_calls"]
    if params.get("max_output_tokens") is not None:
        request["max_tokens"] = params["max_output_tokens"]
    for key in ("temperature", "top_p", "seed", "user"):
        if params.get(key) is not None:
            request[key] = params[key]
    if params.get("top_logprobs") is not None:
        request["logprobs"] = True
        request["top_logprobs"] = params["top_logprobs"]
    response_format = _response_format(params.get("text"))
    if response_format is not None:
        request["response_format"] = response_format
    effort = (params.get("reasoning") or {}).get("effort")
    if effort is not None:
        request["reasoning_effort"] = effort
    return request


# ------------------------------------------------------------------------------------------------
# Chat Completions -> Responses.


def split_think_tags(text: str) -> tuple[str | None, str]:
    """``(reasoning, rest)`` of a text that may hold a ``<think>...</think>`` block.

    An unterminated ``<think>`` (generation cut off while thinking) makes everything after it
    reasoning; a ``</think>`` without an opening tag (the template opened it in the prompt) makes
    everything before it reasoning. Without tags: ``(None, text)``.
    """
    start = text.find(THINK_OPEN)
    end = text.find(THINK_CLOSE)
    if start != -1 and (end == -1 or start < end):
        before = text[:start]
        inner_start = start + len(THINK_OPEN)
        if end == -1:
            return text[inner_start:].strip(), before.strip()
        after = text[end + len(THINK_CLOSE) :]
        rest = after.lstrip() if not before.strip() else before + after
        return text[inner_start:end].strip(), rest
    if end != -1:
        return text[:end].strip(), text[end + len(THINK_CLOSE) :].lstrip()
    return None, text


def chat_message_to_output_items(
    message: dict[str, Any], *, status: str = "completed", parse_think_tags: bool = True
) -> list[dict[str, Any]]:
    """Responses output items for one Chat Completions assistant message.

    Order: a ``reasoning`` item (if any), a ``message`` item (if any text or refusal is left), then
    one ``function_call`` per tool call. ``status`` goes on the message and call items
    (``"incomplete"`` when generation hit the token limit).
    """
    content = message.get("content")
    text = content if isinstance(content, str) else _text_parts(content)
    reasoning = next(
        (r for r in (message.get("reasoning_content"), message.get("reasoning")) if isinstance(r, str) and r),
        None,
    )
    if parse_think_tags and text and (THINK_OPEN in text or THINK_CLOSE in text):
        think, text = split_think_tags(text)
        if think:
            reasoning = f"{reasoning}\n{think}" if reasoning else think
    items: list[dict[str, Any]] = []
    if reasoning:
        items.append(
            {
                "type": "reasoning",
                "id": new_id("rs"),
                "summary": [{"type": "summary_text", "text": reasoning}],
            }
        )
    parts: list[dict[str, Any]] = []
    if text:
        parts.append({"type": "output_text", "text": text, "annotations": []})
    if message.get("refusal"):
        parts.append({"type": "refusal", "refusal": message["refusal"]})
    if parts:
        items.append(
            {"type": "message", "id": new_id("msg"), "role": "assistant", "status": status, "content": parts}
        )
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = orjson.dumps(arguments if arguments is not None else {}).decode()
        items.append(
            {
                "type": "function_call",
                "id": new_id("fc"),
                "call_id": call.get("id") or new_id("call"),
                "name": function.get("name", ""),
                "arguments": arguments,
                "status": status,
            }
        )
    return items


def chat_usage_to_responses_usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    """A full Responses ``usage`` object from Chat Completions usage (or Responses usage, or None)."""
    usage = usage or {}
    if "prompt_tokens" in usage or "completion_tokens" in usage:
        input_tokens = int(usage.get("prompt_tokens") or 0)
        output_tokens = int(usage.get("completion_tokens") or 0)
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        reasoning = int((usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)
    else:
        input_tokens = int(usage.get("input_tokens") or 0)
        output_tokens = int(usage.get("output_tokens") or 0)
        cached = int((usage.get("input_tokens_details") or {}).get("cached_tokens") or 0)
        reasoning = int((usage.get("output_tokens_details") or {}).get("reasoning_tokens") or 0)
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "total_tokens": int(usage.get("total_tokens") or input_tokens + output_tokens),
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": reasoning},
    }


def build_response(
    params: dict[str, Any],
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    model: str,
    status: str = "completed",
    incomplete_details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A complete Responses ``response`` object (every field the SDK's ``Response`` requires).

    ``usage`` may be Chat Completions usage, Responses usage or None (zeros). Request parameters
    are echoed as the Responses API does; ones the request did not set are None.
    """
    response: dict[str, Any] = {
        "id": new_id("resp"),
        "object": "response",
        "created_at": float(int(time.time())),
        "model": model,
        "status": status,
        "output": output,
        "usage": chat_usage_to_responses_usage(usage),
        "parallel_tool_calls": params.get("parallel_tool_calls")
        if params.get("parallel_tool_calls") is not None
        else True,
        "tool_choice": params.get("tool_choice") or "auto",
        "tools": params.get("tools") or [],
        "incomplete_details": incomplete_details,
        "error": None,
    }
    for key in _ECHOED_PARAMS:
        response[key] = params.get(key)
    return response
