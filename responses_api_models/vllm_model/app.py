"""vllm_model: the Responses API in front, Chat Completions to one or more vLLM servers behind.

Contract
--------
* ``POST /v1/responses``: the request is converted with :mod:`nemo_gym.kit.chat_conversion`, sent to
  ``<base_url>/chat/completions`` of one backend, and the answer converted back into ``reasoning`` /
  ``message`` / ``function_call`` items (reasoning from ``reasoning_content`` or ``<think>`` tags).
  ``finish_reason == "length"`` gives ``status: "incomplete"`` (reason ``max_output_tokens``).
* ``POST /v1/completions`` (the legacy Completions API, raw prompts): forwarded to the backend's
  ``/v1/completions``; the token-id fields as below, on every choice (see ``completions``).
* ``POST /v1/chat/completions``: forwarded to the same backend (``model`` set to ``model``), the
  backend's answer returned as is; with ``return_token_id_information``, the backend is asked for
  vLLM's ``return_token_ids`` and ``logprobs`` and the assistant message gets ``prompt_token_ids``,
  ``generation_token_ids``, ``generation_log_probs`` (what the client did not ask for is left out).
* ``stream: true``: chat streams are the backend's stream relayed as it arrives; a Responses stream is
  the backend's chat stream turned into Responses events as it arrives. With
  ``return_token_id_information`` both carry the plain answer's token ids on their final event (the
  last output item of ``response.completed``; the ``delta`` of the chunk with the ``finish_reason``),
  from the stream's ``prompt_token_ids`` / ``token_ids`` / ``logprobs``. A client that goes away closes
  the backend connection, which makes vLLM abort the generation.
* Calls under a rollout prefix (with ``return_token_id_information``): a client that resends an earlier
  answer as plain text gets that answer's remembered ids put back on its message, so the backend
  builds the prompt on them (:mod:`nemo_gym.server.rollout_tokens`).
* ``base_url`` is one URL or a list (or a comma-separated string). The backend is picked from a
  hash of the per-rollout session id (``request.state.session_id``, carried by this server's
  session cookie), so all calls of one rollout go to the same vLLM server (its prefix cache stays
  warm) and rollouts spread evenly over the servers.
* ``return_token_id_information: true``: the chat request asks for ``logprobs`` with
  ``top_logprobs: 0`` and ``return_tokens_as_token_ids`` (tokens come back as ``"token_id:<n>"``);
  the prompt's ids come from the backend's ``/tokenize`` (the server root, not ``/v1``), called
  concurrently with the same messages and tools. The last output item of each call gets
  ``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs``. Assistant turns of the
  input that carry such ids are sent with ``prompt_token_ids``/``generation_token_ids`` on their
  chat message, so a backend that understands them does not re-tokenise earlier turns.
* A prompt that does not fit the model's context (vLLM's 400 "maximum context length ...") is not
  an error: the answer is an ``incomplete`` response with no output, so the rollout ends cleanly.
* Failures to reach a backend and 429/502/503/504 are retried (``max_retries``, bounded exponential
  backoff); then the answer is a 502 naming the backend. Any other backend 4xx is returned with
  the same status and the backend's message. The API key is never logged or echoed.
* ``POST /v1/messages/count_tokens`` counts with the backend's tokenizer: its ``/tokenize`` over the
  chat messages and tools the request converts to (with the generation prompt, as a generation reads it).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from fastapi import Body, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import Field, PrivateAttr, SecretStr, field_validator

from nemo_gym.base_responses_api_model import BaseResponsesAPIModelConfig, SimpleResponsesAPIModel
from nemo_gym.client.fd_limits import client_socket_budget
from nemo_gym.config.process import connector_limits
from nemo_gym.errors import UpstreamError
from nemo_gym.kit.chat_conversion import (
    ChatConversionError,
    build_response,
    chat_message_to_output_items,
    responses_params_to_chat_request,
)
from nemo_gym.kit.completions import CompletionsRequestError, parse_prompts
from nemo_gym.openai_utils import NeMoGymResponseCreateParamsNonStreaming, dump, new_id, openai_error_message
from nemo_gym.openai_utils.messages import MessagesCall, MessagesRequestError
from nemo_gym.server.model import ModelAnswer
from nemo_gym.server.rollout_tokens import answer_of_output_items, rollout_for_token_reuse
from nemo_gym.server.streaming import (
    SSE_MEDIA_TYPE,
    Delta,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
    deltas_of_chat_chunks,
    relay_sse,
    split_think_stream,
    sse_data,
    streaming_timeout,
)

logger = logging.getLogger("nemo_gym.vllm_model")

RETRY_STATUSES = frozenset({429, 502, 503, 504})
# vLLM's wordings for "the prompt (plus max_tokens) does not fit the model's context".
_CONTEXT_OVERFLOW_RE = re.compile(
    r"maximum context length|max_model_len|maximum model length|longer than the maximum|context length exceeded"
    r"|prompt is too long|too many tokens",
    re.IGNORECASE,
)
_TOKEN_ID_PREFIX = "token_id:"
_OUT_OF_VOCABULARY_RE = re.compile(r"out of vocabulary|out of range|invalid token", re.IGNORECASE)


class VLLMModelConfig(BaseResponsesAPIModelConfig):
    base_url: list[str] = Field(
        description="OpenAI-compatible base URL(s) of the vLLM server(s), e.g. http://host:8000/v1"
    )
    api_key: SecretStr = SecretStr("EMPTY")
    model: str
    return_token_id_information: bool = False
    parse_think_tags: bool = True  # <think>...</think> in the content becomes a reasoning item
    chat_template_kwargs: dict[str, Any] | None = None
    extra_body: dict[str, Any] = Field(default_factory=dict)  # merged into every chat request (e.g. top_k)
    timeout_s: float = Field(default=600.0, gt=0)
    max_retries: int = Field(default=3, ge=0)
    backoff_s: float = Field(default=0.5, ge=0)
    max_backoff_s: float = Field(default=8.0, ge=0)
    max_connections: int = Field(default=1024, ge=1)

    @field_validator("base_url", mode="before")
    @classmethod
    def _urls(cls, value: Any) -> list[str]:
        urls = value.split(",") if isinstance(value, str) else list(value or [])
        urls = [str(u).strip().rstrip("/") for u in urls if str(u).strip()]
        if not urls:
            raise ValueError("base_url needs at least one URL (e.g. http://127.0.0.1:8000/v1)")
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"base_url entries must start with http:// or https://, got {bad}")
        return urls


def pick_backend(urls: list[str], session_id: str | None) -> str:
    """The backend for a session: a stable hash of the session id (every call of a rollout, one backend)."""
    if len(urls) == 1 or not session_id:
        return urls[0]
    digest = hashlib.blake2b(session_id.encode(), digest_size=8).digest()
    return urls[int.from_bytes(digest, "big") % len(urls)]


def server_root(base_url: str) -> str:
    """Where vLLM serves ``/tokenize``: the base URL without its trailing ``/v1``."""
    return base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url


def is_context_overflow(status: int, body: Any) -> bool:
    return status == 400 and bool(_CONTEXT_OVERFLOW_RE.search(openai_error_message(body)))


def generation_ids_and_log_probs(choice: dict[str, Any]) -> tuple[list[int], list[float]]:
    """Token ids and log probs of a choice whose logprobs were requested with ``return_tokens_as_token_ids``."""
    entries = ((choice.get("logprobs") or {}).get("content")) or []
    ids, log_probs = [], []
    for entry in entries:
        token = entry.get("token", "")
        if not token.startswith(_TOKEN_ID_PREFIX):
            raise ValueError(
                f"the backend returned logprob token {token!r}, not 'token_id:<n>': it ignored "
                "return_tokens_as_token_ids (return_token_id_information needs a vLLM OpenAI server)"
            )
        ids.append(int(token[len(_TOKEN_ID_PREFIX) :]))
        log_probs.append(float(entry.get("logprob", 0.0)))
    return ids, log_probs


def _discard(task: asyncio.Task[Any] | None) -> None:
    """Cancel a task whose result is no longer needed (and swallow its error, so nothing is logged as lost)."""
    if task is not None:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())


class _BackendError(Exception):
    def __init__(self, url: str, status: int, body: Any):
        self.url, self.status, self.body = url, status, body
        super().__init__(f"HTTP {status} from {url}: {openai_error_message(body)[:500]}")


class VLLMModel(SimpleResponsesAPIModel):
    config: VLLMModelConfig
    uses_sessions = True  # the session id picks the backend
    _sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = PrivateAttr(default_factory=dict)

    async def on_shutdown(self) -> None:
        await self._close_sessions()

    # -- HTTP to the backends -------------------------------------------------------------------------
    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            # At most the open-file budget left (requests beyond it queue for a connection).
            limit, per_host = connector_limits(self.config)
            limit = min(limit or client_socket_budget(), client_socket_budget())
            connector = aiohttp.TCPConnector(limit=limit, limit_per_host=per_host, keepalive_timeout=30)
            session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                timeout=aiohttp.ClientTimeout(
                    total=self.config.timeout_s, sock_connect=min(10.0, self.config.timeout_s)
                ),
                trust_env=False,
            )
            self._sessions[loop] = session
        return session

    async def _close_sessions(self) -> None:
        for session in self._sessions.values():
            if not session.closed:
                await session.close()
        self._sessions.clear()

    def _headers(self) -> dict[str, str]:
        return {
            "Authorization": f"Bearer {self.config.api_key.get_secret_value()}",
            "Content-Type": "application/json",
        }

    async def _post(self, url: str, body: dict[str, Any]) -> tuple[int, bytes]:
        """POST with retries of unreachable backends and 429/502/503/504; returns (status, body bytes)."""
        data = orjson.dumps(body)
        attempt = 0
        while True:
            try:
                async with self._session().post(url, data=data, headers=self._headers()) as resp:
                    payload = await resp.read()
                    status = resp.status
                if status not in RETRY_STATUSES or attempt >= self.config.max_retries:
                    return status, payload
                reason = f"HTTP {status}"
            except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as e:
                if attempt >= self.config.max_retries:
                    raise UpstreamError(
                        f"vLLM backend {url}",
                        "",
                        None,
                        f"{type(e).__name__}: {e} (gave up after {attempt + 1} attempts)",
                        kind="connection_error",
                    ) from e
                reason = type(e).__name__
            except TimeoutError as e:
                raise UpstreamError(
                    f"vLLM backend {url}",
                    "",
                    None,
                    f"no response within {self.config.timeout_s} s",
                    kind="timeout",
                ) from e
            except aiohttp.ClientError as e:  # e.g. the connection broke mid-answer: not safe to resend
                raise UpstreamError(
                    f"vLLM backend {url}", "", None, f"{type(e).__name__}: {e}", kind="connection_error"
                ) from e
            attempt += 1
            delay = min(self.config.backoff_s * 2 ** (attempt - 1), self.config.max_backoff_s)
            logger.warning(
                "%s from %s; retry %d/%d in %.2f s", reason, url, attempt, self.config.max_retries, delay
            )
            await asyncio.sleep(delay)

    async def _post_json(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        status, payload = await self._post(url, body)
        try:
            parsed = orjson.loads(payload)
        except orjson.JSONDecodeError:
            parsed = payload.decode(errors="replace")[:2000]
        if status >= 400:
            raise _BackendError(url, status, parsed)
        if not isinstance(parsed, dict):
            raise UpstreamError(
                f"vLLM backend {url}",
                "",
                status,
                f"response is not a JSON object: {str(parsed)[:500]}",
                kind="bad_response",
            )
        return parsed

    def _error_response(self, request: Request, exc: _BackendError, hint: str = "") -> Response:
        status = exc.status if 400 <= exc.status < 500 else 502
        body = {
            "error": {
                "kind": "backend_error",
                "server": self.config.name,
                "path": request.url.path,
                "backend": exc.url,
                "backend_status": exc.status,
                "message": f"vLLM backend {exc.url} answered HTTP {exc.status}: {openai_error_message(exc.body)}{hint}",
            }
        }
        return Response(orjson.dumps(body), status_code=status, media_type="application/json")

    def _bad_request(self, request: Request, message: str) -> Response:
        body = {
            "error": {
                "kind": "bad_request",
                "server": self.config.name,
                "path": request.url.path,
                "message": message,
            }
        }
        return Response(orjson.dumps(body), status_code=400, media_type="application/json")

    def _backend_chat_request(
        self, request: Request, params: dict[str, Any], keep_token_ids: bool
    ) -> dict[str, Any] | Response:
        """The backend's chat request for Responses ``params``, or the 400 saying why it cannot be made."""
        try:
            chat = responses_params_to_chat_request(params, self.config.model, keep_token_ids=keep_token_ids)
        except ChatConversionError as e:
            return self._bad_request(request, str(e))
        chat.update(self.config.extra_body)
        if self.config.chat_template_kwargs:
            chat["chat_template_kwargs"] = {
                **self.config.chat_template_kwargs,
                **chat.get("chat_template_kwargs", {}),
            }
        return chat

    # -- endpoints ----------------------------------------------------------------------------------
    async def responses(self, request: Request, body: NeMoGymResponseCreateParamsNonStreaming) -> Response:
        params = dump(body)
        want_ids = self.config.return_token_id_information
        chat = self._backend_chat_request(request, params, want_ids)
        if isinstance(chat, Response):
            return chat
        if want_ids:
            chat.update(logprobs=True, top_logprobs=0, return_tokens_as_token_ids=True)
        # A client resending plain history (an agent harness): the remembered ids of the answer it resends
        # go on that assistant message, as the backend reads them (nemo_gym.server.rollout_tokens).
        rollout_id = rollout_for_token_reuse(want_ids)
        chat["messages"] = self._rollout_tokens.attach(rollout_id, chat["messages"], chat.get("tools"))
        base = pick_backend(self.config.base_url, getattr(request.state, "session_id", None))

        tokenize_task: asyncio.Task[dict[str, Any]] | None = None
        if want_ids:
            tokenize_body = {
                k: chat[k] for k in ("model", "messages", "tools", "chat_template_kwargs") if k in chat
            }
            tokenize_body["add_generation_prompt"] = True
            tokenize_task = asyncio.create_task(
                self._post_json(server_root(base) + "/tokenize", tokenize_body)
            )
        try:
            completion = await self._post_json(base + "/chat/completions", chat)
        except _BackendError as e:
            _discard(tokenize_task)
            if is_context_overflow(e.status, e.body):
                logger.info("context length exceeded on %s; answering an incomplete response", base)
                response = build_response(
                    params,
                    [],
                    None,
                    self.config.model,
                    status="incomplete",
                    incomplete_details={"reason": "max_output_tokens"},
                )
                return ModelAnswer(response)
            return self._error_response(request, e)
        except BaseException:
            _discard(tokenize_task)
            raise

        choices = completion.get("choices") or []
        if not choices:
            _discard(tokenize_task)
            raise UpstreamError(
                f"vLLM backend {base}",
                "/chat/completions",
                200,
                "the answer has no choices",
                kind="bad_response",
            )
        choice = choices[0]
        truncated = choice.get("finish_reason") == "length"
        item_status = "incomplete" if truncated else "completed"
        output = chat_message_to_output_items(
            choice.get("message") or {}, status=item_status, parse_think_tags=self.config.parse_think_tags
        )
        if want_ids:
            assert tokenize_task is not None
            try:
                tokenized = await tokenize_task
            except _BackendError as e:
                return self._error_response(
                    request, e, hint=" (return_token_id_information needs the backend's /tokenize)"
                )
            try:
                gen_ids, gen_log_probs = generation_ids_and_log_probs(choice)
            except ValueError as e:
                raise UpstreamError(
                    f"vLLM backend {base}", "/chat/completions", 200, str(e), kind="bad_response"
                ) from None
            if not output:  # nothing but an end-of-turn token: still record the tokens
                output.append(
                    {
                        "type": "message",
                        "id": new_id("msg"),
                        "role": "assistant",
                        "status": item_status,
                        "content": [{"type": "output_text", "text": "", "annotations": []}],
                    }
                )
            prompt_ids = list(tokenized.get("tokens") or [])
            output[-1].update(
                prompt_token_ids=prompt_ids,
                generation_token_ids=gen_ids,
                generation_log_probs=gen_log_probs,
            )
            self._rollout_tokens.remember(
                rollout_id,
                chat["messages"],
                chat.get("tools"),
                answer_of_output_items(output),
                prompt_ids,
                gen_ids,
            )
        response = build_response(
            params,
            output,
            completion.get("usage"),
            completion.get("model") or self.config.model,
            status="incomplete" if truncated else "completed",
            incomplete_details={"reason": "max_output_tokens"} if truncated else None,
        )
        return ModelAnswer(response)

    async def count_input_tokens(self, request: Request, call: MessagesCall) -> int | None:
        """The prompt's length by the backend's tokenizer (``/tokenize``, the request's chat messages and
        tools with the generation prompt), for Messages ``count_tokens``."""
        try:
            chat = responses_params_to_chat_request(call.params, self.config.model)
        except ChatConversionError as e:
            raise MessagesRequestError(str(e)) from None
        body = {k: chat[k] for k in ("model", "messages", "tools") if k in chat}
        if self.config.chat_template_kwargs:
            body["chat_template_kwargs"] = dict(self.config.chat_template_kwargs)
        body["add_generation_prompt"] = True
        base = pick_backend(self.config.base_url, getattr(request.state, "session_id", None))
        url = server_root(base) + "/tokenize"
        try:
            tokenized = await self._post_json(url, body)
        except _BackendError as e:
            raise UpstreamError(f"vLLM backend {url}", "", e.status, str(e), kind="http_error") from None
        count = tokenized.get("count")
        return int(count) if isinstance(count, int) else len(tokenized.get("tokens") or [])

    async def chat_completions(self, request: Request, body: dict[str, Any] = Body(...)) -> Response:
        if body.get("stream"):
            return self._bad_request(
                request, "stream: true is not supported; send the request without streaming."
            )
        base = pick_backend(self.config.base_url, getattr(request.state, "session_id", None))
        if self.config.return_token_id_information and isinstance(body.get("messages"), list):
            return await self._chat_with_token_ids(request, body, base)
        status, payload = await self._post(base + "/chat/completions", {**body, "model": self.config.model})
        if status >= 400:
            try:
                parsed: Any = orjson.loads(payload)
            except orjson.JSONDecodeError:
                parsed = payload.decode(errors="replace")[:2000]
            return self._error_response(request, _BackendError(base + "/chat/completions", status, parsed))
        return Response(payload, media_type="application/json")

    # -- chat completions with token ids (return_token_id_information) ------------------------------------
    def _chat_upstream(self, body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        """The backend request for a chat request whose answer gets token ids, and the call's rollout id.

        vLLM's ``return_token_ids`` gives the prompt's ids (on the answer, or the first chunk of a stream)
        and the generated ids (per choice, or per chunk); ``logprobs`` with no alternatives their
        log-probabilities. An earlier answer the client resends as plain text gets its remembered ids
        (nemo_gym.server.rollout_tokens)."""
        rollout_id = rollout_for_token_reuse(True)
        messages = self._rollout_tokens.attach(rollout_id, body["messages"], body.get("tools"))
        upstream = {**body, "messages": messages, "model": self.config.model, "return_token_ids": True}
        if not body.get("logprobs"):
            upstream.update(logprobs=True, top_logprobs=0)
        return upstream, rollout_id

    def _chat_token_fields(
        self, base: str, prompt_ids: Any, gen_ids: Any, entries: list[Any]
    ) -> dict[str, Any]:
        """``prompt_token_ids`` / ``generation_token_ids`` / ``generation_log_probs`` of a chat answer, or an
        ``UpstreamError`` saying the backend did not send them."""
        if not isinstance(prompt_ids, list) or not isinstance(gen_ids, list):
            raise UpstreamError(
                f"vLLM backend {base}",
                "/chat/completions",
                200,
                "the answer has no prompt_token_ids/token_ids: return_token_id_information on "
                "/v1/chat/completions needs vLLM >= 0.10.2 (return_token_ids)",
                kind="bad_response",
            )
        log_probs = [float(e.get("logprob", 0.0)) for e in entries if isinstance(e, dict)]
        if len(log_probs) != len(gen_ids):
            raise UpstreamError(
                f"vLLM backend {base}",
                "/chat/completions",
                200,
                f"{len(gen_ids)} generated ids but {len(log_probs)} log probs",
                kind="bad_response",
            )
        return {
            "prompt_token_ids": [int(t) for t in prompt_ids],
            "generation_token_ids": [int(t) for t in gen_ids],
            "generation_log_probs": log_probs,
        }

    async def _chat_with_token_ids(self, request: Request, body: dict[str, Any], base: str) -> Response:
        """A plain chat answer whose assistant message carries the call's token ids (as local_model's)."""
        upstream, rollout_id = self._chat_upstream(body)
        url = base + "/chat/completions"
        try:
            answer = await self._post_json(url, upstream)
        except _BackendError as e:
            return self._error_response(request, e)
        choices = answer.get("choices") or []
        if not choices or not isinstance(choices[0], dict):
            raise UpstreamError(f"vLLM backend {base}", "/chat/completions", 200, "the answer has no choices")
        choice = choices[0]
        message = choice.get("message") or {}
        entries = (choice.get("logprobs") or {}).get("content") or []
        fields = self._chat_token_fields(
            base, answer.get("prompt_token_ids"), choice.get("token_ids"), entries
        )
        self._rollout_tokens.remember(
            rollout_id,
            upstream["messages"],
            body.get("tools"),
            message,
            fields["prompt_token_ids"],
            fields["generation_token_ids"],
        )
        choice["message"] = {**message, **fields}
        _hide_unasked(answer, body)
        return ModelAnswer(answer)

    def _relay_with_token_ids(
        self,
        resp: aiohttp.ClientResponse,
        body: dict[str, Any],
        upstream: dict[str, Any],
        rollout_id: str | None,
    ) -> Response:
        """The backend's chat stream relayed chunk by chunk; the chunk that ends the first choice (its
        ``finish_reason``) carries the call's token ids on its ``delta``, as a plain answer's message does."""
        base = str(resp.url).rsplit("/chat/completions", 1)[0]

        async def relayed() -> AsyncIterator[bytes]:
            prompt_ids: Any = None
            gen_ids: list[int] = []
            entries: list[Any] = []
            text: list[str] = []
            calls: dict[int, dict[str, Any]] = {}
            async for data in sse_data(resp):
                try:
                    chunk = orjson.loads(data)
                except orjson.JSONDecodeError:
                    yield b"data: " + data + b"\n\n"
                    continue
                if not isinstance(chunk, dict):
                    yield b"data: " + data + b"\n\n"
                    continue
                if chunk.get("prompt_token_ids") is not None:
                    prompt_ids = chunk["prompt_token_ids"]
                for choice in chunk.get("choices") or []:
                    if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                        continue
                    gen_ids.extend(choice.get("token_ids") or [])
                    entries.extend((choice.get("logprobs") or {}).get("content") or [])
                    delta = choice.get("delta") or {}
                    text.append(delta.get("content") or "")
                    for call in delta.get("tool_calls") or []:
                        function = call.get("function") or {}
                        seen = calls.setdefault(int(call.get("index") or 0), {"name": "", "arguments": ""})
                        seen["name"] += function.get("name") or ""
                        seen["arguments"] += function.get("arguments") or ""
                    if choice.get("finish_reason"):
                        try:
                            fields = self._chat_token_fields(base, prompt_ids, gen_ids, entries)
                        except UpstreamError as e:  # mid-stream: an error event, as the stream's end
                            logger.warning("%s", e)
                            error = {"error": {"message": str(e), "type": "server_error"}}
                            yield b"data: " + orjson.dumps(error) + b"\n\n"
                            return
                        choice["delta"] = {**delta, **fields}
                        answer = {
                            "role": "assistant",
                            "content": "".join(text),
                            "tool_calls": [{"function": calls[i]} for i in sorted(calls)],
                        }
                        self._rollout_tokens.remember(
                            rollout_id,
                            upstream["messages"],
                            body.get("tools"),
                            answer,
                            fields["prompt_token_ids"],
                            fields["generation_token_ids"],
                        )
                _hide_unasked(chunk, body)
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            yield b"data: [DONE]\n\n"

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for event in relayed():
                    yield event
            finally:  # the client went away (or the stream ended): vLLM aborts a closed request
                resp.close()

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(chunks(), media_type=SSE_MEDIA_TYPE, headers=headers)

    async def completions(self, request: Request, body: dict[str, Any] = Body(...)) -> Response:
        """``POST /v1/completions``: forwarded to the backend's ``/v1/completions`` (``model`` set to ``model``).

        ``prompt`` is checked first (a string, strings, token ids or lists of token ids; a 400 naming
        ``prompt[i]`` otherwise); an id the backend finds out of its vocabulary is the backend's 400,
        its message prefixed with the field. With ``return_token_id_information`` (or the request's
        ``return_token_ids: true``) every choice gets ``prompt_token_ids``, ``generation_token_ids``
        and ``generation_log_probs``, from vLLM's ``return_token_ids`` and ``logprobs`` (asked for
        with 0 alternatives, and left out of the answer, when the client did not ask for logprobs).
        """
        if not isinstance(body, dict):
            return self._bad_request(request, "the body must be a JSON object")
        if body.get("stream"):
            return self._bad_request(
                request, "`stream`: vllm_model answers /v1/completions without streaming; send stream: false."
            )
        try:
            if "prompt" not in body:
                raise CompletionsRequestError("prompt", "is required")
            parse_prompts(body["prompt"])
        except CompletionsRequestError as e:
            return self._bad_request(request, str(e))
        want_ids = self.config.return_token_id_information or body.get("return_token_ids") is True
        upstream = {**body, "model": self.config.model}
        if want_ids:
            upstream["return_token_ids"] = True
            if body.get("logprobs") is None:
                upstream["logprobs"] = 0
        base = pick_backend(self.config.base_url, getattr(request.state, "session_id", None))
        url = base + "/completions"
        try:
            answer = await self._post_json(url, upstream)
        except _BackendError as e:
            hint = ""
            if e.status == 400 and _OUT_OF_VOCABULARY_RE.search(openai_error_message(e.body)):
                hint = " (in the request's `prompt`: every token id must be in the model's vocabulary)"
            return self._error_response(request, e, hint=hint)
        if want_ids:
            for choice in answer.get("choices") or []:
                prompt_ids, gen_ids = choice.get("prompt_token_ids"), choice.get("token_ids")
                if prompt_ids is None or gen_ids is None:
                    raise UpstreamError(
                        f"vLLM backend {base}",
                        "/completions",
                        200,
                        "the answer has no prompt_token_ids/token_ids: return_token_ids needs vLLM >= 0.10.2",
                        kind="bad_response",
                    )
                log_probs = ((choice.get("logprobs") or {}).get("token_logprobs")) or []
                log_probs = log_probs[len(log_probs) - len(gen_ids) :] if gen_ids else []
                if len(log_probs) != len(gen_ids) or any(lp is None for lp in log_probs):
                    raise UpstreamError(
                        f"vLLM backend {base}",
                        "/completions",
                        200,
                        f"{len(gen_ids)} generated ids but {len(log_probs)} log probs",
                        kind="bad_response",
                    )
                choice["generation_token_ids"] = list(gen_ids)
                choice["generation_log_probs"] = [float(lp) for lp in log_probs]
                if body.get("logprobs") is None:
                    choice["logprobs"] = None
                if body.get("return_token_ids") is not True:
                    choice.pop("token_ids", None)
        return ModelAnswer(answer)

    # -- streaming (stream: true; nemo_gym.server.streaming) ----------------------------------------------
    def streamed_model_name(self, body: dict[str, Any]) -> str:
        return self.config.model

    async def _open_stream(self, request: Request, chat: dict[str, Any]) -> aiohttp.ClientResponse | Response:
        """The backend's streaming answer to ``chat`` (headers received), or the error answer to send."""
        base = pick_backend(self.config.base_url, getattr(request.state, "session_id", None))
        url = base + "/chat/completions"
        try:
            resp = await self._session().post(
                url,
                data=orjson.dumps(chat),
                headers=self._headers(),
                timeout=streaming_timeout(self.config.timeout_s),
            )
        except (aiohttp.ClientError, TimeoutError) as e:
            return self._error_response(request, _BackendError(url, 502, f"{type(e).__name__}: {e}"))
        if resp.status >= 400:
            payload = await resp.read()
            resp.release()
            try:
                parsed: Any = orjson.loads(payload)
            except orjson.JSONDecodeError:
                parsed = payload.decode(errors="replace")[:2000]
            return self._error_response(request, _BackendError(url, resp.status, parsed))
        return resp

    async def responses_deltas(
        self, request: Request, body: NeMoGymResponseCreateParamsNonStreaming
    ) -> AsyncIterator[Delta] | Response:
        """The backend's chat stream turned into Responses deltas as it arrives. Token ids are not
        streamed (``return_token_id_information`` needs the non-streamed answer)."""
        want_ids = self.config.return_token_id_information
        chat = self._backend_chat_request(request, dump(body), keep_token_ids=want_ids)
        if isinstance(chat, Response):
            return chat
        chat.update(stream=True, stream_options={"include_usage": True})
        rollout_id = None
        if want_ids:  # the ids as the plain answer has them, from vLLM's return_token_ids
            rollout_id = rollout_for_token_reuse(True)
            chat["messages"] = self._rollout_tokens.attach(rollout_id, chat["messages"], chat.get("tools"))
            chat.update(return_token_ids=True, logprobs=True, top_logprobs=0)
        resp = await self._open_stream(request, chat)
        if isinstance(resp, Response):
            return resp
        deltas = deltas_of_chat_chunks(resp, token_ids=want_ids)
        deltas = split_think_stream(deltas) if self.config.parse_think_tags else deltas
        return self._remembering(deltas, rollout_id, chat) if want_ids else deltas

    async def _remembering(
        self, deltas: AsyncIterator[Delta], rollout_id: str | None, chat: dict[str, Any]
    ) -> AsyncIterator[Delta]:
        """``deltas`` unchanged; at their end the call's ids are kept for the rollout (rollout_tokens)."""
        text: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        async for delta in deltas:
            if isinstance(delta, TextDelta):
                text.append(delta.text)
            elif isinstance(delta, ToolCallDelta):
                seen = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                seen["name"] = delta.name or seen["name"]
                seen["arguments"] += delta.arguments
            elif isinstance(delta, StreamEnd) and delta.token_info:
                answer = {
                    "role": "assistant",
                    "content": "".join(text),
                    "tool_calls": [{"function": calls[i]} for i in sorted(calls)],
                }
                self._rollout_tokens.remember(
                    rollout_id,
                    chat["messages"],
                    chat.get("tools"),
                    answer,
                    delta.token_info["prompt_token_ids"],
                    delta.token_info["generation_token_ids"],
                )
            yield delta

    async def stream_chat_completions(self, request: Request, body: dict[str, Any]) -> Response:
        """``/v1/chat/completions`` with ``stream: true``: the backend's stream relayed as it arrives (with
        ``return_token_id_information``, chunk by chunk, the call's token ids on the finishing chunk)."""
        if self.config.return_token_id_information and isinstance(body.get("messages"), list):
            upstream, rollout_id = self._chat_upstream(body)
            resp = await self._open_stream(request, upstream)
            if isinstance(resp, Response):
                return resp
            return self._relay_with_token_ids(resp, body, upstream, rollout_id)
        resp = await self._open_stream(request, {**body, "model": self.config.model})
        if isinstance(resp, Response):
            return resp
        return relay_sse(resp)


def _hide_unasked(answer: dict[str, Any], body: dict[str, Any]) -> None:
    """Drop from a chat answer (or chunk) what the backend was asked for on the server's behalf only:
    ``logprobs`` when the client did not ask for them, vLLM's raw ``prompt_token_ids`` / ``token_ids``
    when it did not set ``return_token_ids`` (the ids are on the message as ``*_token_ids`` anyway)."""
    if body.get("return_token_ids") is not True:
        answer.pop("prompt_token_ids", None)
    for choice in answer.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        if not body.get("logprobs"):
            choice["logprobs"] = None
        if body.get("return_token_ids") is not True:
            choice.pop("token_ids", None)


if __name__ == "__main__":
    VLLMModel.run_webserver()
