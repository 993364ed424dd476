"""Policy versions for asynchronous RL: which weights produced the tokens of each model call.

Contract
--------
* Every model server (:class:`nemo_gym.server.model.SimpleResponsesAPIModel`) serves
  ``POST /policy_version`` with ``{"policy_version": <int or non-empty string>}`` (a trainer calls it
  after each weight update) and ``GET /policy_version`` (``{"policy_version": ..., "updated_at": ...}``,
  ``null`` until set). Both sit behind the run token like every route; ``POST`` also needs the
  **trainer credential** (``X-NeMo-Gym-Trainer-Token``, :func:`nemo_gym.auth.trainer_token`; the server
  holds only its hash): without it a 403 naming it, so no environment, agent or harness (which hold the
  run token or a rollout credential, never the trainer's) can move the version. With authentication off
  (``+server_auth=false``, or a server started without a run token) it is open like every route.
  A bad body is a 400 whose message names ``policy_version``.
* The version only moves forward: a new version equal to the current one, or lower when both are
  integers (or strings holding integers), is a 409 naming the current one. Other strings may follow one
  another freely (they carry no order), but never repeat the current one.
* While no version is set nothing is changed on the request path. Once one is set, each JSON answer of
  a model endpoint (``/v1/responses``, ``/v1/chat/completions``, ``/v1/completions``, ``/v1/messages``)
  carries the version that was current **when the call started** (a weight update during the call
  gives the older version, so a lag check errs on the stale side):

  - ``/v1/responses``: on every output item (items pass every hop unchanged, so the version reaches
    the agent's final response and the rollout line);
  - the other endpoints: ``policy_version`` at the top level, and on a chat completion's assistant
    message when it carries ``generation_token_ids``.

  Streamed answers (server-sent events) carry it on their final event, each event otherwise passed on
  as it comes (:class:`PolicyVersionStreamStampMiddleware`):

  - ``/v1/responses``: on every output item of ``response.completed`` (or ``response.incomplete``);
  - ``/v1/chat/completions`` (and ``/v1/completions``): ``policy_version`` at the top level of the chunk
    that finishes a choice (its ``finish_reason``) and of the usage chunk after it, and on that chunk's
    ``delta`` when it carries ``generation_token_ids``;
  - ``/v1/messages``: ``policy_version`` at the top level of ``message_delta``.
* A recorded model call (``/ng_model_calls/pop``) carries the same ``policy_version``
  (:class:`nemo_gym.server.model_calls.ModelCallCaptureMiddleware` reads it from :class:`PolicyVersion`).
* :func:`policy_versions_of` lists the distinct versions found in a rollout result, in the order they
  appear; :func:`policy_lag` says how far its oldest one is behind the current version.
"""

from __future__ import annotations

import hmac
import time
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from nemo_gym.auth import (
    TRAINER_TOKEN_HEADER_NAME,
    TRAINER_TOKEN_SHA256_ENV_VAR_NAME,
    server_token_from_env,
    token_sha256,
)
from nemo_gym.config.types import POLICY_VERSION_PATH
from nemo_gym.errors import error_envelope
from nemo_gym.launch import launch_value

POLICY_VERSION_KEY = "policy_version"
POLICY_VERSIONS_KEY = "policy_versions"  # on a rollout line: the versions its model calls used
STAMPED_PATHS = frozenset({"/v1/responses", "/v1/chat/completions", "/v1/completions", "/v1/messages"})
MAX_STRING_VERSION_CHARS = 256

PolicyVersionValue = int | str


def parse_policy_version(body: Any) -> PolicyVersionValue:
    """The version in a ``POST /policy_version`` body; ``ValueError`` naming the field otherwise."""
    if not isinstance(body, dict):
        raise ValueError(
            f'the body must be a JSON object {{"policy_version": <int or string>}}, got {type(body).__name__}'
        )
    unknown = sorted(set(body) - {POLICY_VERSION_KEY})
    if unknown:
        raise ValueError(f'unknown field(s) {unknown}; the body is {{"policy_version": <int or string>}}')
    if POLICY_VERSION_KEY not in body:
        raise ValueError("`policy_version` is required (an integer or a non-empty string)")
    value = body[POLICY_VERSION_KEY]
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(
            f"`policy_version` must be an integer or a non-empty string, got {type(value).__name__} {value!r}"
        )
    if isinstance(value, str) and not (0 < len(value) <= MAX_STRING_VERSION_CHARS):
        raise ValueError(
            f"`policy_version` as a string must have 1 to {MAX_STRING_VERSION_CHARS} characters, got {len(value)}"
        )
    return value


class PolicyVersion:
    """The current policy version of one model server (None until a trainer sets one)."""

    def __init__(self) -> None:
        self.value: PolicyVersionValue | None = None
        self.updated_at: float | None = None

    def get(self) -> PolicyVersionValue | None:
        return self.value

    def set(self, value: PolicyVersionValue) -> None:
        self.value = value
        self.updated_at = time.time()

    def answer(self) -> dict[str, Any]:
        return {POLICY_VERSION_KEY: self.value, "updated_at": self.updated_at}

    def install(self, app: FastAPI, server_name: str) -> None:
        """``GET`` / ``POST /policy_version`` on ``app``, and the middleware that stamps answers."""
        token, disabled = server_token_from_env()
        trainer_sha256 = (
            None if disabled or token is None else launch_value(TRAINER_TOKEN_SHA256_ENV_VAR_NAME) or ""
        )

        async def read_policy_version() -> dict[str, Any]:
            return self.answer()

        async def set_policy_version(request: Request) -> Response:
            if trainer_sha256 is not None:
                presented = request.headers.get(TRAINER_TOKEN_HEADER_NAME, "")
                if not trainer_sha256 or not hmac.compare_digest(token_sha256(presented), trainer_sha256):
                    return _refused(
                        server_name,
                        403,
                        "forbidden",
                        f"setting the policy version needs the run's trainer credential in {TRAINER_TOKEN_HEADER_NAME} "
                        "(nemo_gym.auth.trainer_token: the process that started the run has it, and the run's "
                        "trainer-token file); the run token alone does not move it",
                    )
            raw = await request.body()
            try:
                value = parse_policy_version(orjson.loads(raw) if raw else None)
            except orjson.JSONDecodeError as e:
                return _bad_request(
                    server_name, f'the body is not JSON ({e}); send {{"policy_version": <int>}}'
                )
            except ValueError as e:
                return _bad_request(server_name, str(e))
            current = self.value
            if current is not None and not moves_forward(current, value):
                return _refused(
                    server_name,
                    409,
                    "conflict",
                    f"the policy version only moves forward: it is {current!r}, and {value!r} is "
                    + ("the same" if value == current else "lower"),
                )
            self.set(value)
            return Response(orjson.dumps(self.answer()), media_type="application/json")

        app.get(POLICY_VERSION_PATH)(read_policy_version)
        app.post(POLICY_VERSION_PATH)(set_policy_version)
        from starlette.middleware import Middleware

        app.user_middleware.append(Middleware(PolicyVersionStampMiddleware, version=self))

    def install_stream_stamp(self, app: FastAPI) -> None:
        """The middleware that stamps streamed answers; it must sit outside whatever answers streams
        itself (``StreamingDispatch``) and inside the model-call capture, so that recorded streams carry
        the stamp too."""
        from starlette.middleware import Middleware

        app.user_middleware.append(Middleware(PolicyVersionStreamStampMiddleware, version=self))


def moves_forward(current: PolicyVersionValue, new: PolicyVersionValue) -> bool:
    """Whether ``new`` may follow ``current`` (see the module docstring)."""
    if new == current:
        return False
    old, now = _as_int(current), _as_int(new)
    return old is None or now is None or now > old


def _refused(server_name: str, status: int, kind: str, message: str) -> Response:
    body = error_envelope(
        kind, server=server_name, path=POLICY_VERSION_PATH, message=message, field=POLICY_VERSION_KEY
    )
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _bad_request(server_name: str, message: str) -> Response:
    body = error_envelope(
        "bad_request", server=server_name, path=POLICY_VERSION_PATH, message=message, field=POLICY_VERSION_KEY
    )
    return Response(orjson.dumps(body), status_code=400, media_type="application/json")


def stamp(path: str, answer: Any, version: PolicyVersionValue) -> bool:
    """Put ``version`` on a model answer (in place, as the module docstring says); False: not an answer."""
    if not isinstance(answer, dict):
        return False
    if path == "/v1/responses":
        for item in answer.get("output") or []:
            if isinstance(item, dict):
                item[POLICY_VERSION_KEY] = version
        return True
    answer[POLICY_VERSION_KEY] = version
    for choice in answer.get("choices") or []:
        message = choice.get("message") if isinstance(choice, dict) else None
        if isinstance(message, dict) and message.get("generation_token_ids") is not None:
            message[POLICY_VERSION_KEY] = version
    return True


def _is_model_call(scope: dict[str, Any], path: str) -> bool:
    """Whether a request is a model call whose answer carries the version (both stamping middlewares)."""
    return scope["type"] == "http" and scope.get("method") == "POST" and path in STAMPED_PATHS


class PolicyVersionStampMiddleware:
    """Pure ASGI middleware: stamps JSON answers of model endpoints with the version current at the call's
    start. With no version set it costs one dict lookup per request."""

    def __init__(self, app: Any, version: PolicyVersion) -> None:
        self.app = app
        self.version = version

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        version = self.version.get()
        path = scope.get("path", "")
        if version is None or not _is_model_call(scope, path):
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] | None = None
        chunks: list[bytes] = []
        passthrough = False

        async def send_stamped(message: dict[str, Any]) -> None:
            nonlocal start, passthrough
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                is_json = headers.get(b"content-type", b"").startswith(b"application/json")
                if message["status"] >= 400 or not is_json:
                    passthrough = True
                    await send(message)
                else:
                    start = message
                return
            if message["type"] != "http.response.body" or passthrough or start is None:
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(chunks)
            try:
                answer = orjson.loads(body)
                if stamp(path, answer, version):
                    body = orjson.dumps(answer)
            except orjson.JSONDecodeError:
                pass
            headers = [(k, v) for k, v in start.get("headers") or [] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        await self.app(scope, receive, send_stamped)


# ------------------------------------------------------------------------------------------------
# Rollout side: the versions a rollout used, and its lag.


def policy_versions_of(result: Any) -> list[PolicyVersionValue]:
    """The distinct ``policy_version`` values of a rollout result (``/run`` JSON), in the order they
    appear: those an agent stated itself as ``policy_versions`` (an agent whose model calls are not its
    output items, such as harness_agent), then those on the output items (``response.output``)."""
    response = result.get("response") if isinstance(result, dict) else None
    output = response.get("output") if isinstance(response, dict) else None
    stated = result.get(POLICY_VERSIONS_KEY) if isinstance(result, dict) else None
    seen: list[PolicyVersionValue] = []
    for value in stated if isinstance(stated, list) else []:
        if value is not None and value not in seen:
            seen.append(value)
    for item in output or []:
        value = item.get(POLICY_VERSION_KEY) if isinstance(item, dict) else None
        if value is not None and value not in seen:
            seen.append(value)
    return seen


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def policy_lag(versions: list[PolicyVersionValue], current: PolicyVersionValue | None) -> int | None:
    """How many versions the oldest of ``versions`` is behind ``current`` (None: nothing to compare).

    Integer versions (or strings holding integers) are compared numerically. Other strings carry no
    order: a rollout that used any version other than the current one counts as behind by an
    unknown amount, reported as a lag larger than any bound (``sys.maxsize``)."""
    if current is None or not versions:
        return None
    now = _as_int(current)
    numbers = [_as_int(v) for v in versions]
    if now is not None and all(n is not None for n in numbers):
        return max(0, now - min(n for n in numbers if n is not None))
    if all(str(v) == str(current) for v in versions):
        return 0
    import sys

    return sys.maxsize


# ------------------------------------------------------------------------------------------------
# Streamed answers: the version on the final event.

_FINAL_MARKERS: dict[str, tuple[bytes, ...]] = {
    "/v1/responses": (b'"response.completed"', b'"response.incomplete"'),
    "/v1/messages": (b'"message_delta"',),
}


def _is_final_event(path: str, event: bytes) -> bool:
    """Whether an SSE event (bytes of one event, no separator) is one that gets the stamp: a cheap look
    at the bytes, so that only final events are parsed."""
    markers = _FINAL_MARKERS.get(path)
    if markers is not None:
        return any(m in event for m in markers)
    if b'"usage":{' in event:  # chat's usage chunk, which follows the finishing one
        return True
    return b'"finish_reason"' in event and b'"finish_reason":null' not in event


def stamp_event(path: str, event: dict[str, Any], version: PolicyVersionValue) -> None:
    """Put ``version`` on a final streamed event (in place; see the module docstring)."""
    if path == "/v1/responses":
        if isinstance(event.get("response"), dict):
            stamp(path, event["response"], version)
        return
    event[POLICY_VERSION_KEY] = version
    for choice in event.get("choices") or []:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if isinstance(delta, dict) and delta.get("generation_token_ids") is not None:
            delta[POLICY_VERSION_KEY] = version


def _stamped(path: str, event: bytes, newline: bytes, version: PolicyVersionValue) -> bytes:
    if not _is_final_event(path, event):
        return event
    lines = event.split(newline)
    for i, line in enumerate(lines):
        if not line.startswith(b"data:"):
            continue
        try:
            parsed = orjson.loads(line[5:])
        except orjson.JSONDecodeError:
            return event
        if not isinstance(parsed, dict):
            return event
        stamp_event(path, parsed, version)
        lines[i] = b"data: " + orjson.dumps(parsed)
        return newline.join(lines)
    return event


_MAX_HELD_BYTES = 4 * 1024 * 1024  # an event longer than this is sent on unstamped rather than held


class PolicyVersionStreamStampMiddleware:
    """Pure ASGI middleware: the version current at the call's start on the final event of a streamed
    model answer. Events are passed on as they complete (a partial event is held until its end); JSON
    answers pass untouched (:class:`PolicyVersionStampMiddleware` stamps those). With no version set it
    costs one dict lookup per request."""

    def __init__(self, app: Any, version: PolicyVersion) -> None:
        self.app = app
        self.version = version

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        version = self.version.get()
        path = scope.get("path", "")
        if version is None or not _is_model_call(scope, path):
            await self.app(scope, receive, send)
            return
        streaming = False
        held = b""
        separator = b"\n\n"

        async def send_stamped(message: dict[str, Any]) -> None:
            nonlocal streaming, held, separator
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                kind = headers.get(b"content-type", b"")
                streaming = message["status"] < 400 and kind.startswith(b"text/event-stream")
                if streaming:  # the events change length: no content-length (streams carry none anyway)
                    message = {
                        **message,
                        "headers": [
                            (k, v) for k, v in message.get("headers") or [] if k.lower() != b"content-length"
                        ],
                    }
                await send(message)
                return
            if message["type"] != "http.response.body" or not streaming:
                await send(message)
                return
            data = held + message.get("body", b"")
            more = message.get("more_body", False)
            if not held and b"\r\n\r\n" in data and b"\n\n" not in data.replace(b"\r\n\r\n", b""):
                separator = b"\r\n\r\n"  # a stream that ends its events with CRLF
            newline = separator[: len(separator) // 2]
            if more:
                cut = data.rfind(separator)
                if cut < 0:  # no event complete yet: hold it (unless it is far too long to be one)
                    held = data if len(data) <= _MAX_HELD_BYTES else b""
                    if not held:
                        await send({"type": "http.response.body", "body": data, "more_body": True})
                    return
                complete, held = data[:cut], data[cut + len(separator) :]
                out = separator.join(_stamped(path, e, newline, version) for e in complete.split(separator))
                await send({"type": "http.response.body", "body": out + separator, "more_body": True})
                return
            held = b""
            out = separator.join(_stamped(path, e, newline, version) for e in data.split(separator))
            await send({"type": "http.response.body", "body": out, "more_body": False})

        await self.app(scope, receive, send_stamped)
