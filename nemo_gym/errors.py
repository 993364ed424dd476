"""The error envelope: what every server of ours answers on failure, and what a client makes of it.

Contract
--------
* Every error answer's JSON carries ``{"error": {"kind", "server", "path", "message", ...}}``, built by
  :func:`error_envelope` (the ASGI layer, the request guard, the exception handlers, the replica and
  disconnect answers): ``kind`` is what the failures file and the circuit breaker sort by.
* A failed server-to-server call surfaces as :class:`UpstreamError` naming the server, the path and
  the inner error (its message scrubbed of known secrets before it is cut to length, so no part of one
  is left); ``kind`` says what failed (``http_error``, ``connection_error``, ``timeout``, ...),
  ``status`` is the HTTP status (``None`` when nothing answered) and ``response_content`` the raw body
  of an error answer.
* :func:`raise_for_status` turns an error answer into that error, called either way: ours
  (``raise_for_status(resp, server_name, url_path)``) or upstream NeMo Gym's
  (``await raise_for_status(resp)``). :func:`response_body` is the already-read body of one of our
  responses.
* Our responses (:class:`nemo_gym.client.http_transport.RawResponse`, what
  :class:`nemo_gym.client.server_client.ServerClient` returns) are recognised by their base
  :class:`FullyReadResponse`, defined here: this module imports neither the transport nor the client
  (both import it), so it sits below them without an import cycle. The client re-exports these names
  (``from nemo_gym.client.server_client import UpstreamError`` keeps working), as does
  :mod:`nemo_gym.server_utils` (upstream's path of ``raise_for_status``).
"""

from __future__ import annotations

from typing import Any

import orjson

from nemo_gym.redaction import scrub

__all__ = ["FullyReadResponse", "UpstreamError", "error_envelope", "raise_for_status", "response_body"]


def error_envelope(
    kind: str, *, server: str, message: str | None = None, path: str | None = None, **fields: Any
) -> dict[str, Any]:
    """``{"error": {"kind", "server", "path", ..., "message"}}``: the body of an error answer. ``path`` and
    ``message`` are left out when None; ``fields`` (``type``, ``inner``, ...) go in as given."""
    error: dict[str, Any] = {"kind": kind, "server": server}
    if path is not None:
        error["path"] = path
    error.update(fields)
    if message is not None:
        error["message"] = message
    return {"error": error}


class FullyReadResponse:
    """Base of responses whose whole body is already read (:class:`nemo_gym.client.http_transport.RawResponse`):
    :func:`raise_for_status` judges these at once. Only marks the type; the transport's class holds
    the data."""

    __slots__ = ()

    status: int
    server_name: str
    url_path: str
    _body: bytes


class UpstreamError(Exception):
    """A call to another server failed; carries enough to say which, where and why."""

    def __init__(
        self,
        server: str,
        path: str,
        status: int | None,
        detail: Any,
        kind: str = "http_error",
        response_content: bytes | None = None,
    ):
        self.server, self.path, self.status, self.detail, self.kind = server, path, status, detail, kind
        # The raw body of the error answer (upstream's aiohttp error carries it under this name).
        self.response_content = response_content
        super().__init__(f"{kind} from {server}{path} (status {status}): {scrub(str(detail))[:500]}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "server": self.server,
            "path": self.path,
            "status": self.status,
            "detail": self.detail,
        }


class _Done:
    """What :func:`raise_for_status` returns on success: awaitable (upstream awaits the call) without
    being a coroutine, so a caller that does not await gets no "never awaited" warning."""

    __slots__ = ()

    def __await__(self) -> Any:
        return iter(())


_DONE = _Done()


def raise_for_status(resp: Any, server_name: str | None = None, url_path: str | None = None) -> Any:
    """Raise :class:`UpstreamError` if ``resp`` is an error answer; works both ways it is called.

    ``raise_for_status(resp, server_name, url_path)`` (ours) and ``await raise_for_status(resp)``
    (upstream NeMo Gym): for a response of :class:`~nemo_gym.client.server_client.ServerClient` (a
    :class:`FullyReadResponse`) the error is raised at once (the body
    is already read) and on success an already-finished awaitable is returned. The error carries
    ``status``, ``response_content`` (the raw body) and the parsed ``detail``; without names it names the
    server and path the response came from. Any other response object (aiohttp's, a test double) is
    judged by its ``ok`` and returns a coroutine that reads the body before raising.
    """
    if isinstance(resp, FullyReadResponse):
        if resp.status < 400:
            return _DONE
        _raise_http_error(
            resp.status, response_body(resp), server_name or resp.server_name, url_path or resp.url_path
        )
    if resp.ok:
        return _DONE
    return _raise_for_foreign_response(resp, server_name or "", url_path or "")


async def _raise_for_foreign_response(resp: Any, server_name: str, url_path: str) -> None:
    """Upstream's order for a response that is not ours: read the body, then let the object raise its
    own error (aiohttp's ``ClientResponseError``, a test double's) with ``response_content`` attached;
    an object that does not raise gets our :class:`UpstreamError`."""
    content = getattr(resp, "content", None)
    body = await (content.read() if content is not None and hasattr(content, "read") else resp.read())
    own = getattr(resp, "raise_for_status", None)
    if callable(own):
        try:
            own()
        except Exception as exc:
            try:
                exc.response_content = body  # type: ignore[attr-defined]
            except AttributeError:
                pass
            raise
    _raise_http_error(getattr(resp, "status", None), body, server_name, url_path)


def _raise_http_error(status: int | None, body: bytes, server_name: str, url_path: str) -> None:
    try:
        detail: Any = orjson.loads(body)
    except (orjson.JSONDecodeError, TypeError):
        detail = body.decode(errors="replace")[:2000] if isinstance(body, bytes) else str(body)[:2000]
    raise UpstreamError(server_name, url_path, status, detail, kind="http_error", response_content=body)


def response_body(resp: FullyReadResponse) -> bytes:
    """The body of a response returned by :class:`~nemo_gym.client.server_client.ServerClient` (already read;
    the connection is released)."""
    return resp._body or b""
