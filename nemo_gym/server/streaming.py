"""Streaming model answers (``stream: true``): one stream of generation deltas, one event encoder per API.

Why this shape
--------------
A model server produces *what* is generated (text pieces, reasoning pieces, tool-call pieces, then an
end with the finish reason and usage) as :data:`Delta` objects; an encoder turns that one stream into
one API's documented server-sent events:

* :class:`ResponsesEventEncoder`: ``response.created``, ``response.in_progress``,
  ``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta`` ...,
  ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``
  (function calls with ``response.function_call_arguments.delta`` / ``.done``, reasoning with
  ``response.reasoning_summary_*``), then ``response.completed`` (or ``response.incomplete``) with the
  whole response and its usage; every event has a ``sequence_number``.
* :class:`ChatChunkEncoder`: ``chat.completion.chunk`` objects (the role first, content deltas,
  ``tool_calls`` deltas with index/id/name and then argument pieces, the ``finish_reason``, a usage chunk
  when ``stream_options.include_usage``), then ``data: [DONE]``.

Another API (Anthropic Messages) is one more encoder with the same three methods.

:class:`StreamingDispatch` (installed by :class:`nemo_gym.server.model.SimpleResponsesAPIModel`) takes
``stream: true`` requests of ``/v1/responses`` and ``/v1/chat/completions`` before the routes (whose
bodies are the non-streaming types) and answers them from the server's ``responses_deltas`` /
``chat_completions_deltas``. Requests without ``"stream`` in their body pass through untouched (one
substring test of a body the route reads anyway). Malformed stream requests (``stream: "yes"``,
``stream_options`` without ``stream: true``) are a 400 naming the field.

A client that goes away mid-stream closes the delta iterator (``GeneratorExit`` / cancellation in it),
which is how a generation loop learns to stop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import orjson
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nemo_gym.errors import error_envelope
from nemo_gym.kit.chat_conversion import build_response, chat_usage_to_responses_usage
from nemo_gym.openai_utils.responses import new_id

if TYPE_CHECKING:
    import aiohttp

logger = logging.getLogger("nemo_gym.streaming")

RESPONSES_PATH = "/v1/responses"
CHAT_PATH = "/v1/chat/completions"
SSE_MEDIA_TYPE = "text/event-stream"
# Text and tool arguments of an answer known in full are sent in pieces of about this many characters.
REPLAY_PIECE_CHARS = 24


# ------------------------------------------------------------------------------------------------
# The deltas a model server yields.


@dataclass(slots=True)
class TextDelta:
    """A piece of the assistant message's text."""

    text: str
    item_id: str | None = None  # the message item's id (Responses), when the server has one already


@dataclass(slots=True)
class ReasoningDelta:
    """A piece of reasoning (Responses: a reasoning item's summary text; Chat: ``reasoning_content``)."""

    text: str
    item_id: str | None = None


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of tool call ``index``: its first delta carries ``call_id`` and ``name``."""

    index: int
    arguments: str = ""
    call_id: str | None = None
    name: str | None = None
    item_id: str | None = None


@dataclass(slots=True)
class StreamEnd:
    """The end of the answer. ``usage`` in either API's shape; ``token_info`` (``prompt_token_ids``,
    ``generation_token_ids``, ``generation_log_probs``) goes on the last output item / the final chunk;
    ``response``: the whole Responses object when the server already has it (then it is sent as is)."""

    finish_reason: Literal["stop", "length", "tool_calls"] = "stop"
    usage: dict[str, Any] | None = None
    token_info: dict[str, Any] | None = None
    response: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None


Delta = TextDelta | ReasoningDelta | ToolCallDelta | StreamEnd


class EventEncoder(Protocol):
    """One API's server-sent events for a stream of deltas."""

    def start(self) -> list[bytes]: ...

    def feed(self, delta: TextDelta | ReasoningDelta | ToolCallDelta) -> list[bytes]: ...

    def end(self, end: StreamEnd) -> list[bytes]: ...

    def error(self, message: str) -> list[bytes]: ...


def usage_pair(usage: dict[str, Any] | None) -> tuple[int, int]:
    """(prompt, completion) tokens of a usage object in either API's shape."""
    usage = usage or {}
    prompt = usage.get("prompt_tokens", usage.get("input_tokens")) or 0
    completion = usage.get("completion_tokens", usage.get("output_tokens")) or 0
    return int(prompt), int(completion)


# ------------------------------------------------------------------------------------------------
# Responses API events.


class ResponsesEventEncoder:
    """Responses API server-sent events (``event: <type>`` + ``data: <json>``)."""

    def __init__(self, params: dict[str, Any], model: str) -> None:
        self.params = params
        self.model = model
        self.response_id = new_id("resp")
        self.created_at = float(int(time.time()))
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._open_kind = ""
        self._open_index = -1  # tool call index of an open function_call
        self._open_text: list[str] = []

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _snapshot(self, status: str) -> dict[str, Any]:
        response = build_response(self.params, list(self.output), None, self.model, status=status)
        response.update(id=self.response_id, created_at=self.created_at, usage=None)
        return response

    def start(self) -> list[bytes]:
        snapshot = self._snapshot("in_progress")
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def _add(self, kind: str, item: dict[str, Any]) -> list[bytes]:
        self._open, self._open_kind, self._open_text = item, kind, []
        return [self._event("response.output_item.added", output_index=len(self.output), item=dict(item))]

    def feed(self, delta: TextDelta | ReasoningDelta | ToolCallDelta) -> list[bytes]:
        # The open item is not in ``self.output`` until it is closed: its index is len(self.output).
        events: list[bytes] = []
        if isinstance(delta, TextDelta):
            if self._open_kind != "message":
                events += self._close()
                item = {
                    "id": delta.item_id or new_id("msg"),
                    "type": "message",
                    "role": "assistant",
                    "status": "in_progress",
                    "content": [],
                }
                events += self._add("message", item)
                part = {"type": "output_text", "text": "", "annotations": []}
                events.append(
                    self._event(
                        "response.content_part.added",
                        item_id=item["id"],
                        output_index=len(self.output),
                        content_index=0,
                        part=part,
                    )
                )
            assert self._open is not None
            self._open_text.append(delta.text)
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self._open["id"],
                    output_index=len(self.output),
                    content_index=0,
                    delta=delta.text,
                    logprobs=[],
                )
            )
        elif isinstance(delta, ReasoningDelta):
            if self._open_kind != "reasoning":
                events += self._close()
                item = {"id": delta.item_id or new_id("rs"), "type": "reasoning", "summary": []}
                events += self._add("reasoning", item)
                events.append(
                    self._event(
                        "response.reasoning_summary_part.added",
                        item_id=item["id"],
                        output_index=len(self.output),
                        summary_index=0,
                        part={"type": "summary_text", "text": ""},
                    )
                )
            assert self._open is not None
            self._open_text.append(delta.text)
            events.append(
                self._event(
                    "response.reasoning_summary_text.delta",
                    item_id=self._open["id"],
                    output_index=len(self.output),
                    summary_index=0,
                    delta=delta.text,
                )
            )
        else:
            if self._open_kind != "function_call" or self._open_index != delta.index:
                events += self._close()
                item = {
                    "id": delta.item_id or new_id("fc"),
                    "type": "function_call",
                    "call_id": delta.call_id or new_id("call"),
                    "name": delta.name or "",
                    "arguments": "",
                    "status": "in_progress",
                }
                events += self._add("function_call", item)
                self._open_index = delta.index
            assert self._open is not None
            if delta.arguments:
                self._open_text.append(delta.arguments)
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=self._open["id"],
                        output_index=len(self.output),
                        delta=delta.arguments,
                    )
                )
        return events

    def _close(self, status: str = "completed", extra: dict[str, Any] | None = None) -> list[bytes]:
        """Finish the open item: its ``.done`` events and ``response.output_item.done``."""
        item, kind = self._open, self._open_kind
        if item is None:
            return []
        self._open, self._open_kind, self._open_index = None, "", -1
        text = "".join(self._open_text)
        index = len(self.output)
        events: list[bytes] = []
        if kind == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            events.append(
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            events.append(
                self._event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
            item.update(status=status, content=[part])
        elif kind == "reasoning":
            part = {"type": "summary_text", "text": text}
            events.append(
                self._event(
                    "response.reasoning_summary_text.done",
                    item_id=item["id"],
                    output_index=index,
                    summary_index=0,
                    text=text,
                )
            )
            events.append(
                self._event(
                    "response.reasoning_summary_part.done",
                    item_id=item["id"],
                    output_index=index,
                    summary_index=0,
                    part=part,
                )
            )
            item["summary"] = [part]
        else:
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=text,
                )
            )
            item.update(arguments=text, status=status)
        if extra:
            item.update(extra)
        self.output.append(item)
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def end(self, end: StreamEnd) -> list[bytes]:
        truncated = end.finish_reason == "length"
        status = "incomplete" if truncated else "completed"
        events: list[bytes] = []
        if end.token_info and self._open is None and not self.output:
            # The model ended at once: still one (empty) message, to carry the token ids.
            events += self.feed(TextDelta(""))
        events += self._close(status="incomplete" if truncated else "completed", extra=end.token_info)
        if end.token_info and self.output and "generation_token_ids" not in self.output[-1]:
            self.output[-1].update(end.token_info)
        if end.response is not None:
            response = dict(end.response)
            status = response.get("status") or status
        else:
            details = end.incomplete_details or ({"reason": "max_output_tokens"} if truncated else None)
            response = build_response(
                self.params, self.output, end.usage, self.model, status=status, incomplete_details=details
            )
            response["usage"] = chat_usage_to_responses_usage(end.usage)
        response.update(id=self.response_id, created_at=self.created_at)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        events.append(self._event(kind, response=response))
        return events

    def error(self, message: str) -> list[bytes]:
        return [self._event("error", code="server_error", message=message, param=None)]


# ------------------------------------------------------------------------------------------------
# Chat Completions chunks.


class ChatChunkEncoder:
    """``chat.completion.chunk`` objects as ``data:`` lines, then ``data: [DONE]``."""

    def __init__(self, model: str, include_usage: bool = False) -> None:
        self.id = new_id("chatcmpl")
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self._calls_seen: set[int] = set()

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
        }
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def start(self) -> list[bytes]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def feed(self, delta: TextDelta | ReasoningDelta | ToolCallDelta) -> list[bytes]:
        if isinstance(delta, TextDelta):
            return [self._chunk({"content": delta.text})] if delta.text else []
        if isinstance(delta, ReasoningDelta):
            return [self._chunk({"reasoning_content": delta.text})] if delta.text else []
        if delta.index not in self._calls_seen:
            self._calls_seen.add(delta.index)
            call = {
                "index": delta.index,
                "id": delta.call_id or new_id("call"),
                "type": "function",
                "function": {"name": delta.name or "", "arguments": delta.arguments},
            }
            return [self._chunk({"tool_calls": [call]})]
        if not delta.arguments:
            return []
        return [
            self._chunk({"tool_calls": [{"index": delta.index, "function": {"arguments": delta.arguments}}]})
        ]

    def end(self, end: StreamEnd) -> list[bytes]:
        events = [self._chunk(dict(end.token_info or {}), finish_reason=end.finish_reason)]
        if self.include_usage:
            prompt, completion = usage_pair(end.usage)
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
            chunk = {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage,
            }
            events.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        return events

    def error(self, message: str) -> list[bytes]:
        return [b"data: " + orjson.dumps({"error": {"message": message, "type": "server_error"}}) + b"\n\n"]


# ------------------------------------------------------------------------------------------------
# Anthropic Messages events.

_MESSAGES_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class MessagesEventEncoder:
    """Anthropic Messages server-sent events: ``message_start``; per content block ``content_block_start``,
    its ``content_block_delta`` events (``text_delta``, ``thinking_delta``, ``input_json_delta``) and
    ``content_block_stop``; ``message_delta`` (stop reason, usage) and ``message_stop``. One block is open
    at a time, as Anthropic streams them. ``stop_sequence``: set by :func:`cut_at_stop_sequences` when the
    text was cut at one (the stop reason is then ``stop_sequence``)."""

    def __init__(self, model: str) -> None:
        self.id = new_id("msg")
        self.model = model
        self.stop_sequence: str | None = None
        self._index = -1
        self._open: tuple[str, int | None] | None = None  # (block kind, tool call index)
        self._saw_tool = False

    @staticmethod
    def _event(kind: str, **fields: Any) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"

    def start(self) -> list[bytes]:
        message = {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0},
        }  # fmt: skip
        return [self._event("message_start", message=message)]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [self._event("content_block_stop", index=self._index)]

    def _begin(self, kind: str, block: dict[str, Any], call: int | None = None) -> list[bytes]:
        events = self._close()
        self._index += 1
        self._open = (kind, call)
        return [*events, self._event("content_block_start", index=self._index, content_block=block)]

    def feed(self, delta: TextDelta | ReasoningDelta | ToolCallDelta) -> list[bytes]:
        events: list[bytes] = []
        if isinstance(delta, TextDelta):
            if not delta.text:
                return []
            if self._open != ("text", None):
                events += self._begin("text", {"type": "text", "text": ""})
            return [
                *events,
                self._event(
                    "content_block_delta", index=self._index, delta={"type": "text_delta", "text": delta.text}
                ),
            ]
        if isinstance(delta, ReasoningDelta):
            if not delta.text:
                return []
            if self._open != ("thinking", None):
                events += self._begin("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            return [
                *events,
                self._event(
                    "content_block_delta",
                    index=self._index,
                    delta={"type": "thinking_delta", "thinking": delta.text},
                ),
            ]
        if self._open != ("tool_use", delta.index):
            self._saw_tool = True
            block = {
                "type": "tool_use",
                "id": delta.call_id or new_id("toolu"),
                "name": delta.name or "",
                "input": {},
            }
            events += self._begin("tool_use", block, delta.index)
        if delta.arguments:
            events.append(
                self._event(
                    "content_block_delta",
                    index=self._index,
                    delta={"type": "input_json_delta", "partial_json": delta.arguments},
                )
            )
        return events

    def end(self, end: StreamEnd) -> list[bytes]:
        events = self._close()
        if self.stop_sequence is not None:
            reason = "stop_sequence"
        elif end.finish_reason == "length" or end.incomplete_details:
            reason = "max_tokens"
        else:
            reason = (
                "tool_use" if self._saw_tool else _MESSAGES_STOP_REASONS.get(end.finish_reason, "end_turn")
            )
        prompt, completion = usage_pair(end.usage)
        extra = dict(end.token_info or {})  # training fields, as the plain answer carries them
        events.append(
            self._event(
                "message_delta",
                delta={"stop_reason": reason, "stop_sequence": self.stop_sequence},
                usage={"input_tokens": prompt, "output_tokens": completion},
                **extra,
            )
        )
        events.append(self._event("message_stop"))
        return events

    def error(self, message: str) -> list[bytes]:
        return [self._event("error", error={"type": "api_error", "message": message})]


async def cut_at_stop_sequences(
    deltas: AsyncIterator[Delta] | list[Delta], stops: list[str], encoder: MessagesEventEncoder
) -> AsyncIterator[Delta]:
    """``deltas`` with the text cut where it first contains one of ``stops`` (the generation is then
    stopped: the source is closed) and ``encoder.stop_sequence`` set. Text that may be the start of a stop
    sequence is held back until it is known not to be."""
    hold = max((len(x) for x in stops), default=1) - 1
    text = ""  # text seen and not yet sent
    source = _aiter(deltas)
    try:
        async for delta in source:
            if not isinstance(delta, TextDelta) or not stops:
                if isinstance(delta, StreamEnd) and text:
                    yield TextDelta(text)
                    text = ""
                yield delta
                continue
            text += delta.text
            found = [(text.find(x), x) for x in stops if x in text]
            if found:
                at, which = min(found)
                if text[:at]:
                    yield TextDelta(text[:at])
                encoder.stop_sequence = which
                yield StreamEnd(finish_reason="stop")
                return
            if len(text) > hold:
                yield TextDelta(text[: len(text) - hold])
                text = text[len(text) - hold :]
    finally:
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()


async def _aiter(deltas: AsyncIterator[Delta] | list[Delta]) -> AsyncIterator[Delta]:
    if isinstance(deltas, list):
        for delta in deltas:
            yield delta
        return
    try:
        async for delta in deltas:
            yield delta
    finally:
        aclose = getattr(deltas, "aclose", None)
        if aclose is not None:
            await aclose()


# ------------------------------------------------------------------------------------------------
# Answers known in full, sent in pieces (the scripted model; any server without a delta source).


def pieces(text: str, size: int = REPLAY_PIECE_CHARS) -> list[str]:
    """``text`` cut into pieces of ``size`` characters (at least one piece, maybe empty)."""
    return [text[i : i + size] for i in range(0, len(text), size)] or [text]


TOKEN_ID_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def deltas_of_response(response: dict[str, Any]) -> list[Delta]:
    """The deltas that reassemble a complete Responses ``response`` (item ids kept)."""
    deltas: list[Delta] = []
    calls = 0
    token_info: dict[str, Any] | None = None
    for item in response.get("output") or []:
        kind = item.get("type")
        if kind == "message":
            text = "".join(
                str(part.get("text", ""))
                for part in item.get("content") or []
                if part.get("type") == "output_text"
            )
            deltas += [TextDelta(piece, item_id=item.get("id")) for piece in pieces(text)]
        elif kind == "reasoning":
            text = "".join(str(s.get("text", "")) for s in item.get("summary") or [])
            deltas += [ReasoningDelta(piece, item_id=item.get("id")) for piece in pieces(text)]
        elif kind == "function_call":
            args = pieces(str(item.get("arguments", "")))
            deltas.append(
                ToolCallDelta(calls, args[0], item.get("call_id"), item.get("name"), item.get("id"))
            )
            deltas += [ToolCallDelta(calls, piece) for piece in args[1:]]
            calls += 1
        info = {k: item[k] for k in TOKEN_ID_FIELDS if k in item}
        if info:
            token_info = info
    truncated = response.get("status") == "incomplete"
    finish = "length" if truncated else ("tool_calls" if calls else "stop")
    deltas.append(StreamEnd(finish, response.get("usage"), token_info, response=response))
    return deltas


def deltas_of_chat_completion(completion: dict[str, Any]) -> list[Delta]:
    """The deltas that reassemble a complete ``chat.completion`` (first choice)."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    deltas: list[Delta] = []
    if message.get("reasoning_content"):
        deltas += [ReasoningDelta(piece) for piece in pieces(message["reasoning_content"])]
    if message.get("content"):
        deltas += [TextDelta(piece) for piece in pieces(message["content"])]
    for index, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") or {}
        args = pieces(str(function.get("arguments", "")))
        deltas.append(ToolCallDelta(index, args[0], call.get("id"), function.get("name")))
        deltas += [ToolCallDelta(index, piece) for piece in args[1:]]
    info = {k: message[k] for k in TOKEN_ID_FIELDS if k in message}
    finish = choice.get("finish_reason") or "stop"
    deltas.append(StreamEnd(finish, completion.get("usage"), info or None))
    return deltas


def encoded_events(
    encoder: EventEncoder, deltas: list[Delta], on_end: Callable[[StreamEnd], None] | None = None
) -> list[bytes]:
    """Every event of a complete list of deltas (which ends with a :class:`StreamEnd`)."""
    events = encoder.start()
    for delta in deltas:
        if isinstance(delta, StreamEnd):
            if on_end is not None:
                on_end(delta)
            return events + encoder.end(delta)
        events += encoder.feed(delta)
    return events + encoder.error("the answer ended without a final event")


# ------------------------------------------------------------------------------------------------
# The HTTP side.


def sse_response(
    encoder: EventEncoder,
    deltas: AsyncIterator[Delta] | list[Delta],
    on_end: Callable[[StreamEnd], None] | None = None,
) -> Response:
    """The event stream of ``deltas`` through ``encoder``. An exception mid-stream becomes the API's error
    event (the status line is already sent); a client that went away closes ``deltas``.

    Deltas given as a list (an answer known in full) are encoded into one body, written at once: the
    same events, without a write and a task switch per delta for data that is all there already."""
    if isinstance(deltas, list):
        return Response(b"".join(encoded_events(encoder, deltas, on_end)), media_type=SSE_MEDIA_TYPE)

    async def body() -> AsyncIterator[bytes]:
        yield b"".join(encoder.start())
        try:
            async for delta in deltas:
                if isinstance(delta, StreamEnd):
                    if on_end is not None:
                        on_end(delta)
                    yield b"".join(encoder.end(delta))
                    return
                events = encoder.feed(delta)
                if events:
                    yield b"".join(events)
            yield b"".join(encoder.error("the model's stream ended without a final event"))
        except Exception as e:  # noqa: BLE001 - reported to the client in the stream, and logged
            logger.exception("stream failed")
            yield b"".join(encoder.error(f"{type(e).__name__}: {e}"))
        finally:
            aclose = getattr(deltas, "aclose", None)
            if aclose is not None:
                await aclose()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(body(), media_type=SSE_MEDIA_TYPE, headers=headers)


def bad_stream_request(server: str, path: str, message: str) -> Response:
    """The 400 for a malformed streaming request (``server``: the model server's instance name)."""
    body = error_envelope("bad_request", server=server, path=path, message=message)
    return Response(orjson.dumps(body), status_code=400, media_type="application/json")


def stream_request_error(body: dict[str, Any]) -> str | None:
    """Why a request's ``stream`` / ``stream_options`` are malformed, or None when they are fine."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return f"`stream` must be a boolean (true or false), got {stream!r}."
    options = body.get("stream_options")
    if options is not None:
        if stream is not True:
            return "`stream_options` is only allowed with `stream: true`."
        if not isinstance(options, dict):
            return f"`stream_options` must be an object, got {options!r}."
        include = options.get("include_usage")
        if include is not None and not isinstance(include, bool):
            return f"`stream_options.include_usage` must be a boolean, got {include!r}."
    return None


def validation_message(error: ValidationError) -> str:
    """A pydantic error as one line naming the fields."""
    parts = []
    for e in error.errors()[:5]:
        where = ".".join(str(p) for p in e.get("loc", ())) or "body"
        parts.append(f"`{where}`: {e.get('msg')}")
    return "invalid request body: " + "; ".join(parts)


DeltaSource = Callable[[Request, dict[str, Any]], Awaitable["AsyncIterator[Delta] | Response"]]


class StreamingDispatch:
    """ASGI middleware: ``stream: true`` POSTs to ``/v1/responses`` and ``/v1/chat/completions`` are answered
    as event streams by ``server``; every other request reaches the app unchanged (its body replayed)."""

    def __init__(self, app: ASGIApp, server: Any) -> None:  # its SimpleResponsesAPIModel (no import: a cycle)
        self.app = app
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if scope.get("method") != "POST" or not path.endswith((RESPONSES_PATH, CHAT_PATH)):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        body: Any = None
        if b'"stream' in raw:
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                body = None
        if not isinstance(body, dict) or ("stream" not in body and "stream_options" not in body):
            await self.app(scope, replay, send)
            return
        problem = stream_request_error(body)
        if problem is not None:
            await bad_stream_request(self.server.config.name, path, problem)(scope, receive, send)
            return
        if body.get("stream") is not True:
            await self.app(scope, replay, send)
            return
        request = Request(scope, replay)
        if path.endswith(RESPONSES_PATH):
            response = await self.server.stream_responses(request, body)
        else:
            response = await self.server.stream_chat_completions(request, body)
        await response(scope, receive, send)


# ------------------------------------------------------------------------------------------------
# Backends that stream themselves (vLLM, an OpenAI-compatible upstream), through aiohttp.


async def sse_data(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of a server-sent event stream, up to ``[DONE]``; closing this iterator (the
    client went away) closes the connection, which makes a vLLM server abort the generation."""
    try:
        async for line in resp.content:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield data
    finally:
        resp.close()


async def deltas_of_chat_chunks(
    resp: aiohttp.ClientResponse, token_ids: bool = False
) -> AsyncIterator[Delta]:
    """The deltas of a backend's ``chat.completion.chunk`` stream (first choice).

    ``token_ids``: the stream was asked for vLLM's ``return_token_ids`` and ``logprobs``; the prompt's ids
    (``prompt_token_ids`` of the first chunk), the generated ids (each chunk's ``token_ids``) and their
    log-probabilities end up on the :class:`StreamEnd` as ``token_info``, as a plain answer carries them
    (a ``RuntimeError`` when the backend sent none)."""
    finish: Any = "stop"
    usage: dict[str, Any] | None = None
    prompt_ids: Any = None
    gen_ids: list[int] = []
    log_probs: list[float] = []
    async for data in sse_data(resp):
        chunk = orjson.loads(data)
        if "error" in chunk and "choices" not in chunk:
            raise RuntimeError(f"the backend's stream failed: {str(chunk['error'])[:500]}")
        if chunk.get("usage"):
            usage = chunk["usage"]
        if token_ids and chunk.get("prompt_token_ids") is not None:
            prompt_ids = chunk["prompt_token_ids"]
        for choice in chunk.get("choices") or []:
            if token_ids and choice.get("index", 0) == 0:
                gen_ids.extend(int(t) for t in choice.get("token_ids") or [])
                for entry in (choice.get("logprobs") or {}).get("content") or []:
                    log_probs.append(float(entry.get("logprob", 0.0)))
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                yield ReasoningDelta(delta["reasoning_content"])
            if delta.get("content"):
                yield TextDelta(delta["content"])
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                yield ToolCallDelta(
                    int(call.get("index") or 0),
                    function.get("arguments") or "",
                    call.get("id"),
                    function.get("name"),
                )
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
    token_info = None
    if token_ids:
        if not isinstance(prompt_ids, list) or len(log_probs) != len(gen_ids):
            raise RuntimeError(
                "the backend's stream has no prompt_token_ids/token_ids (or not one log-prob per generated "
                "token): token ids of a streamed answer need vLLM >= 0.10.2 (return_token_ids)"
            )
        token_info = {
            "prompt_token_ids": [int(t) for t in prompt_ids],
            "generation_token_ids": gen_ids,
            "generation_log_probs": log_probs,
        }
    yield StreamEnd(finish if finish in ("stop", "length", "tool_calls") else "stop", usage, token_info)


async def split_think_stream(deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """``deltas`` with a leading ``<think>...</think>`` in the text turned into reasoning, as the plain answer
    parses it (:func:`nemo_gym.kit.chat_conversion.split_think_tags`): the reasoning without its outer
    whitespace, the text after the tag without its leading whitespace. Text that may still be part of a
    tag, or whitespace that may end the reasoning, is held until it is known."""
    open_tag, close_tag = "<think>", "</think>"
    state = "start"  # start -> thinking -> after -> text
    held = ""
    started_reasoning = False
    try:
        async for delta in deltas:
            if not isinstance(delta, TextDelta):
                if isinstance(delta, StreamEnd) and held:
                    if state == "thinking":
                        if held.strip():
                            yield ReasoningDelta(held.strip() if not started_reasoning else held.rstrip())
                    elif state != "after" or held.strip():
                        yield TextDelta(held if state != "after" else held.lstrip())
                    held = ""
                yield delta
                continue
            if state == "text":
                yield delta
                continue
            held += delta.text
            if state == "start":
                stripped = held.lstrip()
                if stripped.startswith(open_tag):
                    state, held = "thinking", stripped[len(open_tag) :].lstrip()
                elif open_tag.startswith(stripped):
                    continue  # maybe the tag, not yet complete
                else:
                    state = "text"
                    yield TextDelta(held)
                    held = ""
                    continue
            if state == "thinking":
                end = held.find(close_tag)
                if end == -1:
                    # Send what cannot be part of the closing tag or of the whitespace before it.
                    keep = len(close_tag) - 1
                    body = held[: max(0, len(held) - keep)]
                    sendable = body.rstrip()
                    if sendable:
                        text = sendable if started_reasoning else sendable.lstrip()
                        if text:
                            yield ReasoningDelta(text)
                            started_reasoning = True
                        held = held[len(sendable) :]
                    continue
                reasoning = held[:end].rstrip()
                if not started_reasoning:
                    reasoning = reasoning.lstrip()
                if reasoning:
                    yield ReasoningDelta(reasoning)
                state, held = "after", held[end + len(close_tag) :]
            if state == "after":
                rest = held.lstrip()
                if rest:
                    state = "text"
                    yield TextDelta(rest)
                held = ""
    finally:
        aclose = getattr(deltas, "aclose", None)
        if aclose is not None:
            await aclose()


def relay_sse(resp: aiohttp.ClientResponse) -> StreamingResponse:
    """The backend's event stream passed on as it arrives (the connection is closed when the client goes
    away or the stream ends)."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.content.iter_any():
                yield chunk
        finally:
            resp.close()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(body(), media_type=SSE_MEDIA_TYPE, headers=headers)


def streaming_timeout(total_s: float) -> aiohttp.ClientTimeout:
    """A stream may last long; what is bounded is connecting and each silence between two reads."""
    import aiohttp  # only the servers that relay a backend's stream load it

    return aiohttp.ClientTimeout(total=None, sock_connect=min(30.0, total_s), sock_read=total_s)
