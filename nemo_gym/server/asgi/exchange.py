"""What one request's answer turned out to be, as the server's ASGI layer saw it pass.

The layer (:class:`nemo_gym.server.asgi.ServerLayer`) already sees every answer start and holds every error
body to scrub it, so it fills in an :class:`Exchange` on the way and the metrics read it afterwards
(:class:`nemo_gym.server.metrics.middleware.RequestMeter`), with no ``send`` wrapper of their own.
"""

from __future__ import annotations

MAX_KEPT_BODY_BYTES = 1 << 20


class Exchange:
    """One request's answer: its ``status`` (0 until an answer started), its ``body`` (kept for an error
    answer, or any answer when ``keep_body``; at most :data:`MAX_KEPT_BODY_BYTES`), the session id it was
    served under, and ``kind``: its error kind when known without reading the body (a refusal by the run
    token check or the body limit; ``"cancelled"`` or ``"internal_error"`` when that escaped the app)."""

    __slots__ = ("status", "body", "keep_body", "session", "kind", "_chunks")

    def __init__(self, keep_body: bool) -> None:
        self.status = 0
        self.body: bytes | None = None
        self.keep_body = keep_body
        self.session: str | None = None
        self.kind: str | None = None
        self._chunks: list[bytes] | None = None

    def started(self, status: int) -> None:
        """The answer started with ``status``."""
        self.status = status
        if status >= 400 or self.keep_body:
            self._chunks = []

    def body_part(self, message: dict) -> None:
        """A body message of the answer went out (kept when :meth:`started` said so)."""
        chunks = self._chunks
        if chunks is None:
            return
        piece = message.get("body", b"")
        if piece and sum(map(len, chunks)) < MAX_KEPT_BODY_BYTES:
            chunks.append(piece)
        if not message.get("more_body", False):
            self.body = b"".join(chunks)
