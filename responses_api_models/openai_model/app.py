"""openai_model: forwards the Responses API and Chat Completions to any OpenAI-compatible endpoint.

Contract
--------
* ``POST /v1/responses`` -> ``<openai_base_url>/responses`` and ``POST /v1/chat/completions`` ->
  ``<openai_base_url>/chat/completions``, with ``model`` set to ``openai_model`` and
  ``Authorization: Bearer <openai_api_key>``. The endpoint's answer is returned byte for byte.
  Training fields (``prompt_token_ids`` / ``generation_token_ids`` / ``generation_log_probs``) on
  input items are removed before forwarding (OpenAI rejects unknown item fields).
* 429 and 5xx answers, and failures to reach the endpoint, are retried up to ``max_retries`` times
  with exponential backoff (``backoff_s`` doubling, capped at ``max_backoff_s``; a ``Retry-After``
  header is honoured up to the same cap). When retries run out the answer is a 502 naming the
  endpoint, its last status and its message.
* 401/403 become an error telling to check ``openai_api_key`` (``policy_api_key`` in env.yaml);
  404 one telling to check ``openai_base_url`` / ``openai_model`` (``policy_base_url`` /
  ``policy_model_name``). These and other 4xx keep their status (so clients do not retry them) and
  carry the endpoint's message.
* The API key is never logged and never appears in an error: it is held as a ``SecretStr`` and
  scrubbed out of any text taken from the endpoint's answers, as is every other secret this process
  knows (``extra_headers`` values, a password in ``openai_base_url``, env.yaml values:
  :mod:`nemo_gym.redaction`).
* ``stream: true``: sent upstream with ``stream: true`` and the endpoint's event stream relayed as it
  arrives (not retried once sent; an error answer before the stream is passed on like a plain one's).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import orjson
from fastapi import Body, Request
from fastapi.responses import Response
from pydantic import Field, PrivateAttr, SecretStr, field_validator

from nemo_gym.base_responses_api_model import BaseResponsesAPIModelConfig, SimpleResponsesAPIModel
from nemo_gym.client.fd_limits import client_socket_budget
from nemo_gym.config.process import connector_limits
from nemo_gym.openai_utils import (
    TOKEN_ID_FIELDS,
    NeMoGymResponseCreateParamsNonStreaming,
    dump,
    openai_error_message,
)
from nemo_gym.redaction import process_scrubber
from nemo_gym.server.model import validated_stream_body
from nemo_gym.server.streaming import relay_sse, streaming_timeout

logger = logging.getLogger("nemo_gym.openai_model")

REDACTED = "***"


class OpenAIModelConfig(BaseResponsesAPIModelConfig):
    openai_base_url: str = Field(description="Base URL of the API, e.g. https://api.openai.com/v1")
    openai_api_key: SecretStr
    openai_model: str
    max_retries: int = Field(default=4, ge=0)
    backoff_s: float = Field(default=1.0, ge=0)
    max_backoff_s: float = Field(default=30.0, ge=0)
    timeout_s: float = Field(default=600.0, gt=0)
    max_connections: int = Field(default=1024, ge=1)
    extra_headers: dict[str, str] = Field(default_factory=dict)  # e.g. OpenAI-Organization

    @field_validator("openai_base_url")
    @classmethod
    def _url(cls, value: str) -> str:
        value = value.strip().rstrip("/")
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"openai_base_url must start with http:// or https://, got {value!r}")
        return value


def retry_delay(attempt: int, backoff_s: float, max_backoff_s: float, retry_after: str | None) -> float:
    """Seconds to wait before retry number ``attempt`` (1-based)."""
    if retry_after is not None:
        try:
            return min(max(float(retry_after), 0.0), max_backoff_s)
        except ValueError:
            pass  # an HTTP date: fall back to our own backoff
    return min(backoff_s * 2 ** (attempt - 1), max_backoff_s)


class OpenAIModel(SimpleResponsesAPIModel):
    config: OpenAIModelConfig
    uses_sessions = False  # stateless: nothing per rollout
    _sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = PrivateAttr(default_factory=dict)

    async def on_shutdown(self) -> None:
        for session in self._sessions.values():
            if not session.closed:
                await session.close()
        self._sessions.clear()

    # -- HTTP -------------------------------------------------------------------------------------------
    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            session = aiohttp.ClientSession(
                # At most the open-file budget left (requests beyond it queue for a connection).
                connector=aiohttp.TCPConnector(
                    limit=min(
                        connector_limits(self.config)[0] or client_socket_budget(), client_socket_budget()
                    ),
                    limit_per_host=connector_limits(self.config)[1],
                    keepalive_timeout=30,
                ),
                cookie_jar=aiohttp.DummyCookieJar(),
                timeout=aiohttp.ClientTimeout(
                    total=self.config.timeout_s, sock_connect=min(30.0, self.config.timeout_s)
                ),
                trust_env=True,  # honour HTTPS_PROXY / NO_PROXY for a remote API
            )
            self._sessions[loop] = session
        return session

    def _scrub(self, text: str) -> str:
        key = self.config.openai_api_key.get_secret_value()
        return process_scrubber().scrub(text.replace(key, REDACTED) if key else text)

    def _error(self, request: Request, status: int, kind: str, message: str, **extra: Any) -> Response:
        error = {
            "kind": kind,
            "server": self.config.name,
            "path": request.url.path,
            "message": self._scrub(message),
            **extra,
        }
        return Response(orjson.dumps({"error": error}), status_code=status, media_type="application/json")

    async def _forward(self, request: Request, endpoint_path: str, body: dict[str, Any]) -> Response:
        url = self.config.openai_base_url + endpoint_path
        headers = {
            **self.config.extra_headers,
            "Authorization": f"Bearer {self.config.openai_api_key.get_secret_value()}",
            "Content-Type": "application/json",
        }
        data = orjson.dumps(body)
        attempt = 0
        while True:
            retry_after: str | None = None
            try:
                async with self._session().post(url, data=data, headers=headers) as resp:
                    payload = await resp.read()
                    status = resp.status
                    retry_after = resp.headers.get("Retry-After")
                    content_type = resp.headers.get("Content-Type", "application/json")
            except (
                aiohttp.ClientConnectorError,
                aiohttp.ServerDisconnectedError,
                aiohttp.ClientOSError,
            ) as e:
                status, payload, content_type = 0, b"", ""
                failure = f"cannot reach {url} ({type(e).__name__})"
            except TimeoutError:
                return self._error(
                    request,
                    504,
                    "upstream_timeout",
                    f"{url} did not answer within timeout_s={self.config.timeout_s} s",
                )
            except aiohttp.ClientError as e:  # e.g. a broken answer: not safe to resend
                return self._error(request, 502, "upstream_error", f"{type(e).__name__} from {url}: {e}")
            else:
                if status < 400:
                    return Response(
                        payload, status_code=status, media_type=content_type.split(";")[0] or None
                    )
                failure = f"HTTP {status} from {url}"
            retryable = status == 0 or status == 429 or status >= 500
            if not retryable:
                return self._status_error(request, url, status, payload)
            if attempt >= self.config.max_retries:
                detail = f": {openai_error_message(payload)}" if payload else ""
                return self._error(
                    request,
                    502,
                    "upstream_error",
                    f"{failure}{detail} (gave up after {attempt + 1} attempts; max_retries={self.config.max_retries})",
                    upstream_status=status or None,
                )
            attempt += 1
            delay = retry_delay(attempt, self.config.backoff_s, self.config.max_backoff_s, retry_after)
            logger.warning("%s; retry %d/%d in %.2f s", failure, attempt, self.config.max_retries, delay)
            await asyncio.sleep(delay)

    def _status_error(self, request: Request, url: str, status: int, payload: bytes) -> Response:
        upstream = openai_error_message(payload)
        if status in (401, 403):
            message = (
                f"{url} rejected the API key (HTTP {status}: {upstream}). Check openai_api_key "
                "(set from policy_api_key in env.yaml)."
            )
            kind = "upstream_auth_error"
        elif status == 404:
            message = (
                f"{url} answered HTTP 404 ({upstream}). Check openai_base_url (policy_base_url, "
                f"currently {self.config.openai_base_url!r}; it usually ends in /v1) and openai_model "
                f"(policy_model_name, currently {self.config.openai_model!r})."
            )
            kind = "upstream_not_found"
        else:
            message = f"{url} answered HTTP {status}: {upstream}"
            kind = "upstream_bad_request"
        logger.error("%s", self._scrub(message))
        # The endpoint's status is kept: a client (e.g. the openai SDK) must not retry a configuration error.
        return self._error(request, status, kind, message, upstream_status=status)

    # -- endpoints ----------------------------------------------------------------------------------
    async def responses(self, request: Request, body: NeMoGymResponseCreateParamsNonStreaming) -> Response:
        params = dump(body)
        raw = params.get("input")
        if isinstance(raw, list):
            params["input"] = [
                {k: v for k, v in item.items() if k not in TOKEN_ID_FIELDS and k != "policy_version"}
                if isinstance(item, dict)
                else item
                for item in raw
            ]
        params["model"] = self.config.openai_model
        return await self._forward(request, "/responses", params)

    async def chat_completions(self, request: Request, body: dict[str, Any] = Body(...)) -> Response:
        if body.get("stream"):
            return self._error(
                request,
                400,
                "bad_request",
                "stream: true is not supported; send the request without streaming.",
            )
        return await self._forward(request, "/chat/completions", {**body, "model": self.config.openai_model})

    # -- streaming (stream: true): the upstream's own event stream, relayed as it arrives ----------------
    async def stream_responses(self, request: Request, body: dict[str, Any]) -> Response:
        validated = validated_stream_body(request, body, self.config.name)
        if isinstance(validated, Response):
            return validated
        params = dump(validated)
        raw = params.get("input")
        if isinstance(raw, list):
            params["input"] = [
                {k: v for k, v in item.items() if k not in TOKEN_ID_FIELDS}
                if isinstance(item, dict)
                else item
                for item in raw
            ]
        params.update(model=self.config.openai_model, stream=True)
        if body.get("stream_options") is not None:
            params["stream_options"] = body["stream_options"]
        return await self._relay(request, "/responses", params)

    async def stream_chat_completions(self, request: Request, body: dict[str, Any]) -> Response:
        return await self._relay(request, "/chat/completions", {**body, "model": self.config.openai_model})

    async def _relay(self, request: Request, endpoint_path: str, body: dict[str, Any]) -> Response:
        """POST ``body`` upstream and pass its event stream on; an upstream error before the stream starts
        is answered as the plain request's would be (no retries once a stream may have begun)."""
        url = self.config.openai_base_url + endpoint_path
        headers = {
            **self.config.extra_headers,
            "Authorization": f"Bearer {self.config.openai_api_key.get_secret_value()}",
            "Content-Type": "application/json",
        }
        try:
            resp = await self._session().post(
                url,
                data=orjson.dumps(body),
                headers=headers,
                timeout=streaming_timeout(self.config.timeout_s),
            )
        except (aiohttp.ClientError, TimeoutError) as e:
            return self._error(request, 502, "upstream_error", f"{type(e).__name__} from {url}: {e}")
        if resp.status >= 400:
            payload = await resp.read()
            resp.release()
            try:
                parsed: Any = orjson.loads(payload)
            except orjson.JSONDecodeError:
                parsed = payload.decode(errors="replace")[:2000]
            return self._error(
                request,
                resp.status if resp.status < 500 else 502,
                "upstream_error",
                f"{url} answered HTTP {resp.status}: {openai_error_message(parsed)}",
                upstream_status=resp.status,
            )
        return relay_sse(resp)


if __name__ == "__main__":
    OpenAIModel.run_webserver()
