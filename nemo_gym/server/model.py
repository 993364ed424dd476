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
* With ``observability_enabled`` set for the run, model calls made under a rollout prefix are recorded
  in a bounded store and handed out by ``POST /ng_model_calls/pop`` (:mod:`nemo_gym.server.model_calls`);
  off, nothing is installed on the request path.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import orjson
from fastapi import Body, FastAPI, Request
from fastapi.responses import Response
from pydantic import PrivateAttr
from starlette.middleware import Middleware

from nemo_gym.config.process import current_global_config_dict
from nemo_gym.config.types import BaseRunServerInstanceConfig
from nemo_gym.errors import error_envelope
from nemo_gym.openai_utils.messages import MessagesCall
from nemo_gym.openai_utils.responses import NeMoGymResponse, NeMoGymResponseCreateParamsNonStreaming
from nemo_gym.server.base import SimpleServer
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


class SimpleResponsesAPIModel(SimpleServer):
    config: BaseResponsesAPIModelConfig
    _model_call_store: ModelCallStore | None = PrivateAttr(default=None)
    # The trainer's current policy version (POST /policy_version; nemo_gym.server.policy_version).
    _policy_version: PolicyVersion = PrivateAttr(default_factory=PolicyVersion)
    metrics_kind: ClassVar[str] = "responses_api_models"

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        # Each answer's tokens are counted from the object returned (nemo_gym.server.metrics).
        app.post("/v1/responses")(observed_model_call(self._metrics, "/v1/responses", self.responses))
        app.post("/v1/chat/completions")(
            observed_model_call(self._metrics, "/v1/chat/completions", self.chat_completions)
        )
        # Anthropic's Messages API, through this server's own Responses handler (nemo_gym.server.model_messages).
        app.post(MESSAGES_PATH)(observed_model_call(self._metrics, MESSAGES_PATH, self.messages))
        app.post(MESSAGES_COUNT_TOKENS_PATH)(
            observed_model_call(self._metrics, MESSAGES_COUNT_TOKENS_PATH, self.messages_count_tokens)
        )
        app.post("/v1/completions")(observed_model_call(self._metrics, "/v1/completions", self.completions))
        self.setup_model_call_capture(app)
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
        """Return and forget the recorded calls of ``body.rollout_ids`` (empty when capture is off)."""
        return pop_answer(self._model_call_store, body)

    async def messages(self, request: Request) -> Response:
        """``POST /v1/messages`` (Anthropic's Messages API): converted to this server's ``responses`` and
        back, errors in Anthropic's shape (:mod:`nemo_gym.server.model_messages`). The body is read here,
        not by FastAPI, so that a malformed one is answered in that shape too."""
        answer = await messages_endpoint_answer(request, self.responses)
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
