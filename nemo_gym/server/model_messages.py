"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` of every model server (Anthropic's Messages API).

Contract
--------
* :class:`nemo_gym.server.model.SimpleResponsesAPIModel` registers both routes (through
  ``observed_model_call``, so the answer's ``usage`` is counted like the other APIs'); a server needs no
  code of its own. The request is validated and converted by :mod:`nemo_gym.openai_utils.messages`, run
  through the server's own ``responses`` handler, and its answer converted back
  (:func:`messages_answer`: the finished Messages answer, the piece a streaming answer starts from).
* Every error answer has Anthropic's shape ``{"type": "error", "error": {"type", "message"}}``: a bad
  request is a 400 ``invalid_request_error`` naming the field (a body that is not JSON too); an error
  answer of the ``responses`` handler keeps its status and message, its type chosen by status
  (404 ``not_found_error``, 429 ``rate_limit_error``, 503/529 ``overloaded_error`` with the
  ``Retry-After`` header kept, other 5xx ``api_error``); an exception raised by the handler is a 500
  ``api_error`` (502 for a failed call to another server), its text scrubbed of secrets. The run-token
  check (401) comes before the route and keeps the framework's shape.
* ``count_tokens`` answers ``{"input_tokens": n}``: the server's tokenizer count where it has one
  (a server overrides ``count_input_tokens``; local_model and vllm_model do), else
  :func:`nemo_gym.openai_utils.messages.estimate_input_tokens`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import HTTPException, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from nemo_gym.errors import UpstreamError
from nemo_gym.openai_utils.messages import (
    MessagesCall,
    MessagesRequestError,
    estimate_input_tokens,
    messages_error_body,
    messages_request_to_responses,
    responses_to_messages_answer,
)
from nemo_gym.openai_utils.responses import NeMoGymResponseCreateParamsNonStreaming, openai_error_message
from nemo_gym.redaction import scrub
from nemo_gym.server.streaming import MessagesEventEncoder, StreamEnd, cut_at_stop_sequences, sse_response

logger = logging.getLogger("nemo_gym")

__all__ = [
    "MESSAGES_COUNT_TOKENS_PATH",
    "MESSAGES_PATH",
    "count_tokens_answer",
    "messages_answer",
    "messages_endpoint_answer",
    "messages_error",
]

MESSAGES_PATH = "/v1/messages"
MESSAGES_COUNT_TOKENS_PATH = "/v1/messages/count_tokens"

ResponsesHandler = Callable[[Request, NeMoGymResponseCreateParamsNonStreaming], Awaitable[Any]]
# A model server's ``responses_deltas``: the deltas of a streamed answer, or an error answer.
DeltasHandler = Callable[[Request, NeMoGymResponseCreateParamsNonStreaming], Awaitable[Any]]
TokenCounter = Callable[[Request, MessagesCall], Awaitable[int | None]]


def messages_error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """An error answer in Anthropic's shape (the message scrubbed of known secrets)."""
    body = messages_error_body(status, scrub(message))
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


async def _parsed_call(request: Request, *, count_only: bool) -> MessagesCall | Response:
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return messages_error(400, f"the request body is not valid JSON ({e})")
    try:
        return messages_request_to_responses(body, count_only=count_only)
    except MessagesRequestError as e:
        return messages_error(400, str(e))


def _from_error_answer(answer: Response) -> Response:
    status = answer.status_code
    message = openai_error_message(bytes(answer.body)) if answer.body else f"HTTP {status}"
    retry_after = answer.headers.get("retry-after")
    return messages_error(status, message, headers={"Retry-After": retry_after} if retry_after else None)


async def _run(
    request: Request, call: MessagesCall, handler: ResponsesHandler | DeltasHandler
) -> tuple[Any, Response | None]:
    """``handler`` (a model server's ``responses`` or ``responses_deltas``) on ``call``'s Responses request:
    ``(what it returned, None)``, or ``(None, an error answer in Anthropic's shape)`` when the request cannot
    be run, the handler raised or an upstream failed."""
    try:
        params = NeMoGymResponseCreateParamsNonStreaming.model_validate(call.params)
    except ValidationError as e:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return None, messages_error(400, f"the request cannot be run: {where}: {first.get('msg', e)}")
    try:
        return await handler(request, params), None
    except HTTPException as e:
        return None, messages_error(e.status_code, str(e.detail))
    except UpstreamError as e:
        logger.warning("/v1/messages: %s", e)
        return None, messages_error(504 if e.kind == "timeout" else 502, str(e))
    except Exception as e:  # the handler failed: answered here, in the Messages shape
        logger.exception("/v1/messages: the model server's handler raised")
        return None, messages_error(500, f"{type(e).__name__}: {e}")


async def messages_answer(
    request: Request, call: MessagesCall, responses: ResponsesHandler
) -> dict[str, Any] | Response:
    """The finished Messages answer (a dict) for ``call``, run through ``responses`` (a model server's
    Responses handler); or an error answer in Anthropic's shape."""
    result, failed = await _run(request, call, responses)
    if failed is not None:
        return failed
    if isinstance(result, Response):
        if result.status_code >= 400:
            return _from_error_answer(result)
        response = orjson.loads(bytes(result.body))
    elif isinstance(result, BaseModel):
        response = result.model_dump(mode="json")
    else:
        response = result
    if not isinstance(response, dict) or response.get("status") == "failed":
        error = (response or {}).get("error") if isinstance(response, dict) else None
        return messages_error(500, f"the model failed: {openai_error_message({'error': error})}")
    return responses_to_messages_answer(response, call)


async def messages_endpoint_answer(
    request: Request,
    responses: ResponsesHandler,
    deltas: DeltasHandler,
    on_end: Callable[[StreamEnd], None] | None = None,
) -> Any:
    """``POST /v1/messages``: the whole answer (a dict the base class wraps, or an error answer); with
    ``stream: true`` the Messages events of ``deltas`` (a model server's ``responses_deltas``), generated
    as they come, cut at the first stop sequence (which stops the generation)."""
    call = await _parsed_call(request, count_only=False)
    if isinstance(call, Response):
        return call
    if not call.stream:
        return await messages_answer(request, call, responses)
    source, failed = await _run(request, call, deltas)
    if failed is not None:
        return failed
    if isinstance(source, Response):
        return _from_error_answer(source) if source.status_code >= 400 else source
    encoder = MessagesEventEncoder(call.model)
    return sse_response(encoder, cut_at_stop_sequences(source, call.stop_sequences, encoder), on_end=on_end)


# What /v1/messages/count_tokens counts at most: a tokenizer (and its chat template) costs time linear in the
# conversation, on a worker of the model server; 30,001 turns took local_model 68 CPU-s. Past either bound
# the answer is a 400 naming it (no model's context holds such a conversation anyway).
COUNT_TOKENS_MAX_ITEMS = 4096
COUNT_TOKENS_MAX_TOKENS_ESTIMATE = 1_000_000


async def count_tokens_answer(request: Request, counter: TokenCounter) -> dict[str, int] | Response:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": n}`` (tokenizer count, else the estimate);
    a conversation past :data:`COUNT_TOKENS_MAX_ITEMS` items or an estimated
    :data:`COUNT_TOKENS_MAX_TOKENS_ESTIMATE` tokens is a 400 saying so, never tokenized."""
    call = await _parsed_call(request, count_only=True)
    if isinstance(call, Response):
        return call
    items = len(call.params.get("input") or [])
    estimate = estimate_input_tokens(call.params)
    if items > COUNT_TOKENS_MAX_ITEMS or estimate > COUNT_TOKENS_MAX_TOKENS_ESTIMATE:
        return messages_error(
            400,
            f"the conversation is too large to count: {items:,} items, about {estimate:,} tokens (count_tokens "
            f"counts at most {COUNT_TOKENS_MAX_ITEMS:,} items and about {COUNT_TOKENS_MAX_TOKENS_ESTIMATE:,} tokens)",
        )
    try:
        counted = await counter(request, call)
    except UpstreamError as e:
        return messages_error(504 if e.kind == "timeout" else 502, str(e))
    except MessagesRequestError as e:
        return messages_error(400, str(e))
    except Exception as e:
        logger.exception("/v1/messages/count_tokens: the token counter raised")
        return messages_error(500, f"{type(e).__name__}: {e}")
    return {"input_tokens": counted if counted is not None else estimate_input_tokens(call.params)}
