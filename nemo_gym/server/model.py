"""Model servers: the OpenAI Responses API (and Chat Completions) in front of some LLM backend.

Contract
--------
* ``POST /v1/responses`` takes ``NeMoGymResponseCreateParamsNonStreaming`` (strict: unknown keys are
  a 422 naming them) and returns a ``NeMoGymResponse``.
* ``POST /v1/chat/completions`` takes and returns the Chat Completions shapes (as plain JSON).
* ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's Messages API) run through
  ``responses`` (:mod:`nemo_gym.server.model_messages`); a server with a tokenizer overrides
  ``count_input_tokens``.
* ``POST /v1/completions`` (legacy Completions, raw prompts): served by the servers that override
  :meth:`SimpleResponsesAPIModel.completions` (local_model, vllm_model); the others answer a 404 saying so.
* Output items may carry ``prompt_token_ids``/``generation_token_ids``/``generation_log_probs``.
* ``POST``/``GET /policy_version``: the trainer's current policy version, stamped on every model answer
  and recorded call once set (:mod:`nemo_gym.server.policy_version`).
* ``stream: true`` on ``/v1/responses`` and ``/v1/chat/completions`` is answered as that API's server-sent events by
  :class:`~nemo_gym.server.streaming.StreamingDispatch` (before the routes): from
  :meth:`SimpleResponsesAPIModel.responses_deltas` / :meth:`~SimpleResponsesAPIModel.chat_completions_deltas`
  (by default the plain answer cut into pieces; a server that generates incrementally overrides them),
  or a server's own :meth:`~SimpleResponsesAPIModel.stream_responses` (a relay of a backend's stream).
* Servers that return token ids keep each rollout's earlier calls' exact ids, so that a client resending
  plain history gets prompts that extend them (:mod:`nemo_gym.server.rollout_tokens`).
* With ``observability_enabled`` set for the run, model calls made under a rollout prefix are recorded
  in a bounded store and handed out by ``POST /ng_model_calls/pop`` (:mod:`nemo_gym.server.model_calls`);
  off, nothing is installed on the request path.
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, ClassVar

import orjson
from fastapi import Body, FastAPI, Request
from fastapi.responses import Response
from pydantic import PrivateAttr, ValidationError
from starlette.middleware import Middleware

from nemo_gym.config.process import current_global_config_dict
from nemo_gym.config.types import BaseRunServerInstanceConfig
from nemo_gym.errors import error_envelope
from nemo_gym.openai_utils.messages import MessagesCall
from nemo_gym.openai_utils.responses import NeMoGymResponse, NeMoGymResponseCreateParamsNonStreaming, dump
from nemo_gym.server.base import SimpleServer
from nemo_gym.server.disconnect import ClientDisconnected, disconnected_response, run_until_disconnected
from nemo_gym.server.metrics.install import observed_model_call
from nemo_gym.server.model_calls import (
    POP_PATH,
    ModelCallCaptureMiddleware,
    ModelCallStore,
    PopModelCallsRequest,
    pop_answer,
    store_from_config,
)
from nemo_gym.server.model_messages import (
    MESSAGES_COUNT_TOKENS_PATH,
    MESSAGES_PATH,
    count_tokens_answer,
    messages_endpoint_answer,
)
from nemo_gym.server.policy_version import PolicyVersion
from nemo_gym.server.rollout_tokens import RolloutTokenMemory
from nemo_gym.server.streaming import (
    CHAT_PATH,
    RESPONSES_PATH,
    ChatChunkEncoder,
    Delta,
    ResponsesEventEncoder,
    StreamEnd,
    StreamingDispatch,
    bad_stream_request,
    deltas_of_chat_completion,
    deltas_of_response,
    sse_response,
    usage_pair,
    validation_message,
)


class BaseResponsesAPIModelConfig(BaseRunServerInstanceConfig):
    pass


class ModelAnswer(Response):
    """A model server's JSON answer (``content`` serialised with orjson) that keeps the answer's ``usage``
    beside the body, so the metrics count its tokens from the object rather than by reading the body back
    (:func:`nemo_gym.server.metrics.install.observed_model_call`). Any other ``Response`` works too."""

    media_type = "application/json"

    def __init__(
        self, content: Any, status_code: int = 200, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(orjson.dumps(content), status_code=status_code, headers=headers)
        self.usage = content.get("usage") if status_code < 400 and isinstance(content, dict) else None


def cancelled_with_client(
    server_name: str, handler: Callable[..., Awaitable[Any]]
) -> Callable[..., Awaitable[Any]]:
    """A non-streaming model endpoint (taking ``request``) cancelled when its client disconnects
    (:func:`nemo_gym.server.disconnect.run_until_disconnected`); its signature is kept for FastAPI."""

    @functools.wraps(handler)
    async def watched(*args: Any, **kwargs: Any) -> Any:
        request = kwargs.get("request") or next((a for a in args if isinstance(a, Request)), None)
        if request is None:
            return await handler(*args, **kwargs)
        try:
            return await run_until_disconnected(request, handler(*args, **kwargs))
        except ClientDisconnected as error:
            return disconnected_response(server_name, error)

    return watched


class SimpleResponsesAPIModel(SimpleServer):
    config: BaseResponsesAPIModelConfig
    _model_call_store: ModelCallStore | None = PrivateAttr(default=None)
    # The trainer's current policy version (POST /policy_version; nemo_gym.server.policy_version).
    _policy_version: PolicyVersion = PrivateAttr(default_factory=PolicyVersion)
    # Exact ids of each rollout's earlier calls, for clients that resend plain history
    # (nemo_gym.server.rollout_tokens); used by the servers that return token ids.
    _rollout_tokens: RolloutTokenMemory = PrivateAttr(default_factory=RolloutTokenMemory)
    metrics_kind: ClassVar[str] = "responses_api_models"

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        # Each answer's tokens are counted from the object returned (nemo_gym.server.metrics).
        # A client that goes away cancels its call (a generation queued or running, a backend request), as a
        # streamed answer's does: nobody is left to read it (an abandoned call held local_model for minutes).
        app.post("/v1/responses")(
            observed_model_call(
                self._metrics, "/v1/responses", cancelled_with_client(self.config.name, self.responses)
            )
        )
        app.post("/v1/chat/completions")(
            observed_model_call(
                self._metrics,
                "/v1/chat/completions",
                cancelled_with_client(self.config.name, self.chat_completions),
            )
        )
        # Anthropic's Messages API, through this server's own Responses handler (nemo_gym.server.model_messages).
        app.post(MESSAGES_PATH)(observed_model_call(self._metrics, MESSAGES_PATH, self.messages))
        app.post(MESSAGES_COUNT_TOKENS_PATH)(
            observed_model_call(self._metrics, MESSAGES_COUNT_TOKENS_PATH, self.messages_count_tokens)
        )
        app.post("/v1/completions")(
            observed_model_call(
                self._metrics, "/v1/completions", cancelled_with_client(self.config.name, self.completions)
            )
        )
        # Outside the streaming dispatch, so that streamed answers are recorded too.
        self.setup_model_call_capture(app)
        # Streamed answers get the policy version on their final event; outside the streaming dispatch
        # (which answers streams itself) and inside the capture (recorded streams carry it too).
        self._policy_version.install_stream_stamp(app)
        # stream: true on both paths is answered before the routes (nemo_gym.server.streaming).
        app.user_middleware.append(Middleware(StreamingDispatch, server=self))
        # After the capture middleware, so innermost: recorded answers carry the version stamp too.
        self._policy_version.install(app, self.config.name)
        if (
            self._metrics is not None
            and type(self).model_queue_depth is not SimpleResponsesAPIModel.model_queue_depth
        ):
            self._metrics.add_queue_depth(self.model_queue_depth)
        return app

    def model_queue_depth(self) -> int | None:
        """Calls waiting in this server's own queue (a model server that queues calls itself overrides this;
        its metrics then have ``nemo_gym_model_queue_depth``). None: no queue of its own."""
        return None

    def setup_model_call_capture(self, app: FastAPI) -> None:
        """``POST /ng_model_calls/pop``, and (capture on) the recording middleware, innermost so that it
        sees the rollout id and every answer, error answers included."""
        self._model_call_store = store_from_config(current_global_config_dict())
        app.post(POP_PATH, include_in_schema=False)(self.pop_model_calls)
        if self._model_call_store is not None:
            model_ref = {"type": "responses_api_models", "name": self.config.name}
            app.user_middleware.append(
                Middleware(
                    ModelCallCaptureMiddleware,
                    store=self._model_call_store,
                    model_ref=model_ref,
                    policy_version=self._policy_version.get,
                )
            )

    async def pop_model_calls(self, body: PopModelCallsRequest) -> dict[str, Any]:
        """Return and forget the recorded calls of ``body.rollout_ids`` (empty when capture is off), and the
        token ids remembered for them (nemo_gym.server.rollout_tokens)."""
        self._rollout_tokens.forget(body.rollout_ids)
        return pop_answer(self._model_call_store, body)

    async def messages(self, request: Request) -> Response:
        """``POST /v1/messages`` (Anthropic's Messages API): converted to this server's ``responses`` and
        back, errors in Anthropic's shape (:mod:`nemo_gym.server.model_messages`). The body is read here,
        not by FastAPI, so that a malformed one is answered in that shape too."""
        answer = await messages_endpoint_answer(
            request, self.responses, self.responses_deltas, self._count_streamed_tokens(MESSAGES_PATH)
        )
        return answer if isinstance(answer, Response) else ModelAnswer(answer)

    async def messages_count_tokens(self, request: Request) -> Response:
        """``POST /v1/messages/count_tokens``: ``{"input_tokens": n}`` (see :meth:`count_input_tokens`)."""
        answer = await count_tokens_answer(request, self.count_input_tokens)
        return answer if isinstance(answer, Response) else ModelAnswer(answer)

    async def count_input_tokens(self, request: Request, call: MessagesCall) -> int | None:
        """The input tokens of a Messages request by this server's tokenizer; None (the default, for a
        server without one): the documented estimate is answered instead."""
        return None

    @abstractmethod
    async def responses(
        self, request: Request, body: NeMoGymResponseCreateParamsNonStreaming
    ) -> NeMoGymResponse: ...

    async def completions(self, request: Request, body: dict[str, Any] = Body(...)) -> Response:
        """``POST /v1/completions`` (the legacy Completions API, raw prompts). Servers that can run a raw
        prompt (local_model, vllm_model) override this; the others answer 404 saying so."""
        message = (
            f"POST /v1/completions (the legacy Completions API) is not served by {type(self).__name__} "
            f"'{self.config.name}': it needs a model that takes raw prompts (local_model, vllm_model). "
            "Use /v1/chat/completions or /v1/responses here."
        )
        answer = error_envelope("not_served", server=self.config.name, path=request.url.path, message=message)
        return ModelAnswer(answer, 404)

    @abstractmethod
    async def chat_completions(
        self, request: Request, body: dict[str, Any] = Body(...)
    ) -> dict[str, Any]: ...

    # -- streaming (stream: true; nemo_gym.server.streaming) -------------------------------------------
    def streamed_model_name(self, body: dict[str, Any]) -> str:
        """The ``model`` a streamed answer names: the request's, else the server's configured name."""
        for value in (
            body.get("model"),
            getattr(self.config, "model_name", None),
            getattr(self.config, "model", None),
        ):
            if isinstance(value, str) and value:
                return value
        return self.config.name

    def _count_streamed_tokens(self, path: str) -> Callable[[StreamEnd], None] | None:
        metrics = self._metrics
        if metrics is None:
            return None
        return lambda end: metrics.observe_tokens(path, usage_pair(end.usage))

    async def stream_responses(self, request: Request, body: dict[str, Any]) -> Response:
        """``POST /v1/responses`` with ``stream: true``: the Responses events of :meth:`responses_deltas`."""
        validated = validated_stream_body(request, body, self.config.name)
        if isinstance(validated, Response):
            return validated
        source = await self.responses_deltas(request, validated)
        if isinstance(source, Response):
            return source
        encoder = ResponsesEventEncoder(dump(validated), self.streamed_model_name(body))
        return sse_response(encoder, source, on_end=self._count_streamed_tokens(RESPONSES_PATH))

    async def stream_chat_completions(self, request: Request, body: dict[str, Any]) -> Response:
        """``POST /v1/chat/completions`` with ``stream: true``: chunks of :meth:`chat_completions_deltas`."""
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        source = await self.chat_completions_deltas(request, plain)
        if isinstance(source, Response):
            return source
        encoder = ChatChunkEncoder(self.streamed_model_name(body), include_usage=include_usage)
        return sse_response(encoder, source, on_end=self._count_streamed_tokens(CHAT_PATH))

    async def responses_deltas(
        self, request: Request, body: NeMoGymResponseCreateParamsNonStreaming
    ) -> AsyncIterator[Delta] | list[Delta] | Response:
        """The deltas of a streamed ``/v1/responses`` answer, or an error answer (sent instead of a stream).

        By default the whole answer of :meth:`responses`, sent in pieces (what a server whose model
        cannot stream can do); a server that generates incrementally overrides this."""
        answer = _as_dict(await self.responses(request, body))
        if isinstance(answer, Response):
            return answer
        return deltas_of_response(answer)

    async def chat_completions_deltas(
        self, request: Request, body: dict[str, Any]
    ) -> AsyncIterator[Delta] | list[Delta] | Response:
        """The deltas of a streamed ``/v1/chat/completions`` answer (``body`` without ``stream``), or an
        error answer; by default the whole answer of :meth:`chat_completions`, sent in pieces."""
        answer = _as_dict(await self.chat_completions(request, body))
        if isinstance(answer, Response):
            return answer
        return deltas_of_chat_completion(answer)


def validated_stream_body(
    request: Request, body: dict[str, Any], server_name: str
) -> NeMoGymResponseCreateParamsNonStreaming | Response:
    """A streamed ``/v1/responses`` body checked as the route checks a plain one (``stream`` and
    ``stream_options`` aside), or the 400 naming the fields that are wrong (from ``server_name``)."""
    params = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    try:
        return NeMoGymResponseCreateParamsNonStreaming.model_validate(params)
    except ValidationError as e:
        return bad_stream_request(server_name, request.url.path, validation_message(e))


def _as_dict(answer: Any) -> dict[str, Any] | Response:
    """A handler's answer as a dict, or the (error / non-JSON) ``Response`` itself."""
    if isinstance(answer, Response):
        if answer.status_code >= 400 or not isinstance(answer.body, bytes):
            return answer
        return orjson.loads(answer.body)
    if isinstance(answer, dict):
        return answer
    return dump(answer)
