"""Error answers: unhandled exceptions become JSON 500s, and every error answer is scrubbed of secrets.

Contract
--------
* An unhandled exception before the answer started becomes a JSON 500 naming the server, the path,
  the exception's type and its (scrubbed) message, logged with its traceback; the connection stays
  usable (a handler registered for ``Exception`` would make starlette re-raise, and uvicorn would then
  close the keep-alive connection under the caller's next request). After the answer started, the
  exception propagates and the server closes the connection.
* An answer with status >= 400, whoever built it, is held until its body is complete, scrubbed of the
  secret values this process knows (:func:`nemo_gym.redaction.process_scrubber`) and sent with a
  corrected ``Content-Length``. A success passes straight through.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from nemo_gym.errors import error_envelope
from nemo_gym.redaction import process_scrubber
from nemo_gym.server.asgi.exchange import Exchange

logger = logging.getLogger("nemo_gym")


def internal_error_answer(server_name: str, path: str, exc: BaseException) -> tuple[list, bytes]:
    """(headers, body) of the JSON 500 for ``exc`` (logged here, with its traceback)."""
    logger.exception("Unhandled error in %s %s", server_name, path, exc_info=exc)
    body = orjson.dumps(
        error_envelope(
            "internal_error",
            server=server_name,
            path=path,
            type=type(exc).__name__,
            message=process_scrubber().scrub(str(exc)),
        )
    )
    return [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())], body


def scrubbed_error_answer(start: dict, chunks: list[bytes]) -> tuple[dict, dict]:
    """The held start of an error answer and its body, scrubbed, with the length corrected."""
    body = process_scrubber().scrub_bytes(b"".join(chunks))
    headers = [(k, v) for k, v in start.get("headers", ()) if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    return {**start, "headers": headers}, {"type": "http.response.body", "body": body}


async def serve_with_error_answers(
    app: Any,
    scope: dict,
    receive: Any,
    send: Any,
    server_name: str,
    cookie: bytes | None = None,
    exchange: Exchange | None = None,
) -> None:
    """Serve one HTTP request through ``app`` applying this module's contract; ``cookie``: a
    ``Set-Cookie`` value every answer carries (the session layer's), or None; ``exchange``: the
    :class:`~nemo_gym.server.asgi.exchange.Exchange` to fill in for the metrics, or None."""
    started = False
    held: dict | None = None  # the start of an error answer, sent once its body is scrubbed
    chunks: list[bytes] = []
    keep = exchange is not None and exchange.keep_body

    async def send_one(message: dict) -> None:
        nonlocal started, held
        kind = message["type"]
        if kind == "http.response.start":
            started = True
            if cookie is not None:
                message["headers"] = [*message.get("headers", ()), (b"set-cookie", cookie)]
            if exchange is not None:
                exchange.started(message["status"])
            if message["status"] >= 400:
                held = message
                return
        elif held is not None and kind == "http.response.body":
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            start, body = scrubbed_error_answer(held, chunks)
            held = None
            if exchange is not None:
                exchange.body = body["body"]
            await send(start)
            await send(body)
            return
        elif keep and kind == "http.response.body":
            exchange.body_part(message)
        await send(message)

    try:
        await app(scope, receive, send_one)
    except Exception as exc:
        if started:  # too late for an error answer; the server closes the connection
            raise
        headers, body = internal_error_answer(server_name, scope.get("path", ""), exc)
        if cookie is not None:
            headers.append((b"set-cookie", cookie))
        if exchange is not None:
            exchange.started(500)
            exchange.body = body
        await send({"type": "http.response.start", "status": 500, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def serve_seen(
    app: Any, scope: dict, receive: Any, send: Any, cookie: bytes | None, exchange: Exchange
) -> None:
    """Serve one HTTP request through ``app`` as it answers (no error answers of this module's), filling in
    ``exchange`` as :func:`serve_with_error_answers` does; ``cookie`` as there."""

    async def send_one(message: dict) -> None:
        if message["type"] == "http.response.start":
            if cookie is not None:
                message["headers"] = [*message.get("headers", ()), (b"set-cookie", cookie)]
            exchange.started(message["status"])
        elif message["type"] == "http.response.body":
            exchange.body_part(message)
        await send(message)

    await app(scope, receive, send_one)


class InternalErrorMiddleware:
    """Pure ASGI middleware applying this module's contract on its own."""

    def __init__(self, app: Any, server_name: str):
        self.app = app
        self.server_name = server_name

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await serve_with_error_answers(self.app, scope, receive, send, self.server_name)
