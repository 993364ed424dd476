"""Serving with a cap on accepted connections, so a server never runs out of descriptors.

Contract
--------
:class:`BoundedServer` is a ``uvicorn.Server`` that accepts connections itself, at most
``max_accepted`` open at once. Beyond that it stops accepting: new connections wait in the
kernel's listen backlog (the client's request waits there, under the client's own timeout) and are
accepted, in order, as open ones close. While at the cap, every response closes its connection
(``Connection: close``), so keep-alive connections cannot hold the server's places forever and the
backlog drains. Should ``accept`` still fail for lack of descriptors (something else used them),
accepting pauses briefly and resumes; the connection stays in the backlog, nothing crashes.
Below the cap nothing changes: keep-alive as usual.

Slow and silent clients (:class:`ConnectionLimits`) cannot hold places either:

* A connection that has not delivered a complete request head within ``head_timeout_s`` (counted from
  the accept, or from the first byte of a later request on a kept-alive connection) is closed; if it
  sent part of a head, it is told ``408`` first.
* A request body that stalls (no byte for ``body_idle_timeout_s`` while the server is reading it; time
  the application leaves a large body unread does not count) closes the connection.
* A client that stops reading the answer (the server's writes stay paused by flow control, no byte
  drained, for ``body_idle_timeout_s``) has its connection closed, which releases the handler waiting
  to write.
* Idle keep-alive connections between requests are closed after uvicorn's ``timeout_keep_alive``.
* A connection becomes *trusted* once one of its request heads passes ``trusts(scope)`` (the run-token
  check). Untrusted connections may hold at most ``1 - reserved_fraction`` of the places: past that,
  the oldest untrusted connections that have not sent a whole request head within a grace period (a quarter of the head
  timeout, at most 1 s) are closed, at each accept and at each sweep, so a client with the token finds
  a place while silent connections hold all the others. A connection is never closed so before its
  grace period, nor while its socket holds bytes not read yet: its request may simply not have been
  read (a busy event loop can take longer than the grace to get to it).

One sweep per ``min(timeouts) / 4`` (at most once a second) checks the open connections; per request the
cost is a clock read and a few attribute tests in ``data_received``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import socket
import sys
import termios
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn

logger = logging.getLogger("nemo_gym")

ACCEPT_RETRY_S = 0.1
_WARN_EVERY_S = 10.0

DEFAULT_REQUEST_HEAD_TIMEOUT_S = 10.0
DEFAULT_REQUEST_BODY_IDLE_TIMEOUT_S = 30.0
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 60.0
DEFAULT_RESERVED_CONNECTION_FRACTION = 0.1

_REQUEST_TIMEOUT_ANSWER = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
    b"content-length: 46\r\n\r\nrequest head not received in time; reconnect\r\n"
)


@dataclass(frozen=True)
class ConnectionLimits:
    """How long a connection may take to send a request, and the places kept for trusted clients."""

    head_timeout_s: float = DEFAULT_REQUEST_HEAD_TIMEOUT_S
    body_idle_timeout_s: float = DEFAULT_REQUEST_BODY_IDLE_TIMEOUT_S
    reserved_fraction: float = DEFAULT_RESERVED_CONNECTION_FRACTION

    def __post_init__(self) -> None:
        for name in ("head_timeout_s", "body_idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.reserved_fraction < 1:
            raise ValueError(f"reserved_fraction must be in [0, 1), got {self.reserved_fraction!r}")

    @classmethod
    def from_settings(cls, setting: Callable[[str, Any], Any]) -> tuple[ConnectionLimits, float]:
        """(limits, keep-alive timeout) read through ``setting(key, default)`` from the keys
        ``request_head_timeout_s``, ``request_body_idle_timeout_s``, ``reserved_connection_fraction`` and
        ``keep_alive_timeout_s`` (one reading for every server: ours, the head server, ``ng_viewer``)."""
        limits = cls(
            head_timeout_s=float(setting("request_head_timeout_s", DEFAULT_REQUEST_HEAD_TIMEOUT_S)),
            body_idle_timeout_s=float(
                setting("request_body_idle_timeout_s", DEFAULT_REQUEST_BODY_IDLE_TIMEOUT_S)
            ),
            reserved_fraction=float(
                setting("reserved_connection_fraction", DEFAULT_RESERVED_CONNECTION_FRACTION)
            ),
        )
        return limits, float(setting("keep_alive_timeout_s", DEFAULT_KEEP_ALIVE_TIMEOUT_S))

    @property
    def eviction_grace_s(self) -> float:
        """How long a new connection may be silent before it can lose its place to a trusted client."""
        return min(1.0, self.head_timeout_s / 4)

    @property
    def sweep_interval_s(self) -> float:
        return min(1.0, max(0.02, min(self.head_timeout_s, self.body_idle_timeout_s) / 4))


def _has_unread_bytes(transport: Any) -> bool:
    """Whether the connection's socket holds bytes this process has not read yet: its client is not
    silent, the event loop has not got to it (on a busy machine that can take longer than the grace)."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return False
    try:
        buf = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except OSError:
        return False
    return int.from_bytes(buf, sys.byteorder) > 0


class _Gate:
    """Counts accepted connections and accepts only while there are fewer than ``limit``.

    ``protocol_class(**protocol_kwargs)`` serves each connection; the gate subclasses it once so that
    its ``connection_lost`` gives the place back and its ``data_received`` notes when each request head
    completes (for the timeouts and the trust of :class:`ConnectionLimits`).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        limit: int,
        protocol_class: type,
        protocol_kwargs: dict[str, Any],
        limits: ConnectionLimits | None = None,
        trusts: Callable[[dict], bool] | None = None,
    ) -> None:
        self.loop = loop
        self.limit = limit
        self.open = 0
        self.limits = limits or ConnectionLimits()
        self.trusts = trusts
        self.untrusted_cap = max(1, limit - int(limit * self.limits.reserved_fraction))
        # Every connection being served, and (oldest first) those with no trusted request yet.
        self.conns: set[Any] = set()
        self.untrusted: dict[Any, None] = {}
        gate = self
        monotonic = time.monotonic

        class Counted(protocol_class):  # type: ignore[valid-type, misc]
            _released = False
            _ng_trusted = False
            # When the head being waited for began (accept, or a later request's first byte); None while
            # a request is in progress or the connection idles between requests.
            _ng_head_since: float | None = None
            _ng_head_bytes = False  # whether part of that head arrived
            _ng_rx = 0.0  # when the last bytes arrived
            _ng_write_stalled_since: float | None = None  # since when the client has read nothing we sent

            def connection_made(self, transport: Any) -> None:
                super().connection_made(transport)
                self._ng_head_since = self._ng_rx = monotonic()
                gate.track(self)

            def data_received(self, data: bytes) -> None:
                now = self._ng_rx = monotonic()
                cycle = self.cycle
                if cycle is None or cycle.response_complete:
                    if self._ng_head_since is None:
                        self._ng_head_since = now
                    self._ng_head_bytes = True
                super().data_received(data)
                if self._ng_head_since is None:
                    return
                cycle = self.cycle
                if cycle is not None and not cycle.response_complete:
                    self._ng_head_since = None  # a complete head: the request is being served
                    self._ng_head_bytes = False
                    if not self._ng_trusted:
                        gate.check_trust(self, cycle.scope)
                elif self.transport is not None and self.transport.get_protocol() is not self:
                    gate.upgraded(self, self.transport.get_protocol())  # now a WebSocket

            def on_response_complete(self) -> None:
                self._ng_head_since = None  # between requests: uvicorn's keep-alive timeout applies
                super().on_response_complete()

            def connection_lost(self, exc: Exception | None) -> None:
                try:
                    super().connection_lost(exc)
                finally:
                    gate.release_once(self)

        self.protocol_class = Counted
        self.protocol_kwargs = protocol_kwargs
        self.listeners: list[socket.socket] = []
        self._tasks: set[asyncio.Task] = set()
        self.watching = False
        self.stopped = False
        self._retry: asyncio.TimerHandle | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._last_warning = 0.0

    def start(self, listeners: list[socket.socket]) -> None:
        for sock in listeners:
            sock.setblocking(False)
        self.listeners = listeners
        self._watch()
        self._sweeper = self.loop.call_later(self.limits.sweep_interval_s, self._sweep)

    def stop(self) -> None:
        self.stopped = True
        self._unwatch()
        if self._retry is not None:
            self._retry.cancel()
        if self._sweeper is not None:
            self._sweeper.cancel()

    # -- trust and time limits ---------------------------------------------------------------------
    def track(self, conn: Any) -> None:
        """A new connection: untrusted until a request of its passes ``trusts``."""
        self.conns.add(conn)
        self.untrusted[conn] = None
        if len(self.untrusted) > self.untrusted_cap:
            self._evict_untrusted(1, time.monotonic())

    def _evict_untrusted(self, n: int, now: float) -> None:
        """Close up to ``n`` of the oldest untrusted connections that have been silent for the grace
        period (waiting for a head, or idle between requests). A connection younger than that is never
        closed so: its first request may simply not have been read yet."""
        stale_before = now - self.limits.eviction_grace_s
        victims = []
        for i, conn in enumerate(self.untrusted):
            if len(victims) >= n or i >= n + 64:
                break
            since = conn._ng_head_since  # a head begun long ago and still incomplete is stale too
            if since is None:
                cycle = conn.cycle
                if cycle is not None and not cycle.response_complete:
                    continue  # a request is being served
                since = conn._ng_rx
            if since < stale_before and not _has_unread_bytes(conn.transport):
                victims.append(conn)
        for conn in victims:
            del self.untrusted[conn]
            self.conns.discard(conn)
            conn.transport.close()

    def check_trust(self, conn: Any, scope: dict) -> None:
        if self.trusts is None or self.trusts(scope):
            conn._ng_trusted = True
            self.untrusted.pop(conn, None)

    def upgraded(self, conn: Any, protocol: Any) -> None:
        """``conn`` handed its transport to ``protocol`` (a WebSocket): no HTTP timeouts any more, and the
        place is given back when that protocol's connection is lost."""
        self.conns.discard(conn)
        self.untrusted.pop(conn, None)
        conn._ng_head_since = None
        lost = protocol.connection_lost

        def connection_lost(exc: Exception | None) -> None:
            try:
                lost(exc)
            finally:
                self.release_once(conn)

        protocol.connection_lost = connection_lost

    def _sweep(self) -> None:
        now = time.monotonic()
        head_deadline = now - self.limits.head_timeout_s
        body_deadline = now - self.limits.body_idle_timeout_s
        for conn in list(self.conns):
            transport = conn.transport
            if transport is None:
                continue
            if conn.flow is not None and conn.flow.write_paused:
                # The client stopped reading our answer (a close waits for the buffer to drain, so a
                # closing connection can hang here too): past the bound, abort.
                stalled = conn._ng_write_stalled_since
                if stalled is None:
                    conn._ng_write_stalled_since = now
                elif stalled < body_deadline:
                    self.conns.discard(conn)
                    transport.abort()  # wakes a handler waiting to write (uvicorn resumes it as lost)
                continue
            conn._ng_write_stalled_since = None
            if transport.is_closing():
                continue
            since = conn._ng_head_since
            if since is not None:
                if since < head_deadline:
                    self.conns.discard(conn)
                    if conn._ng_head_bytes:
                        transport.write(_REQUEST_TIMEOUT_ANSWER)
                    transport.close()
                continue
            cycle = conn.cycle
            if (
                cycle is not None
                and cycle.more_body
                and not cycle.response_complete
                and conn._ng_rx < body_deadline
            ):
                if conn.flow.read_paused:  # the application has not read what came: not a stall
                    conn._ng_rx = now
                    continue
                self.conns.discard(conn)
                transport.abort()
        excess = len(self.untrusted) - self.untrusted_cap
        if excess > 0:  # e.g. at the cap, where no accept makes room: make room for trusted clients
            self._evict_untrusted(excess, now)
        if not self.stopped:
            self._sweeper = self.loop.call_later(self.limits.sweep_interval_s, self._sweep)

    def _watch(self) -> None:
        if not self.watching and not self.stopped:
            for sock in self.listeners:
                self.loop.add_reader(sock.fileno(), self._accept, sock)
            self.watching = True

    def _unwatch(self) -> None:
        if self.watching:
            for sock in self.listeners:
                self.loop.remove_reader(sock.fileno())
            self.watching = False

    def _accept(self, listener: socket.socket) -> None:
        while self.open < self.limit:
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno == errno.ECONNABORTED:
                    continue
                self._pause_after(e)  # e.g. EMFILE: the connection stays queued in the backlog
                return
            self.open += 1
            conn.setblocking(False)
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = self.loop.create_task(self._serve(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._unwatch()  # at the cap: the next connections wait in the backlog

    def _pause_after(self, e: OSError) -> None:
        now = time.monotonic()
        if now - self._last_warning > _WARN_EVERY_S:
            self._last_warning = now
            logger.warning(
                "accept() failed (%s) with %d connections open: pausing accepts for %.1f s; waiting "
                "connections stay queued",
                e.strerror,
                self.open,
                ACCEPT_RETRY_S,
            )
        self._unwatch()
        self._retry = self.loop.call_later(ACCEPT_RETRY_S, self._resume_after_pause)

    def _resume_after_pause(self) -> None:
        self._retry = None
        self._watch()

    async def _serve(self, conn: socket.socket) -> None:
        protocol = self.protocol_class(**self.protocol_kwargs)
        try:
            await self.loop.connect_accepted_socket(lambda: protocol, conn)
        except BaseException as e:
            conn.close()
            self.release_once(protocol)  # a no-op if the protocol already reported the connection gone
            if not isinstance(e, Exception):
                raise
            logger.warning("could not set up an accepted connection: %s: %s", type(e).__name__, e)

    def release_once(self, protocol: Any) -> None:
        """Give back the place of ``protocol``'s connection (once, however often it is called)."""
        if protocol._released:
            return
        protocol._released = True
        self.conns.discard(protocol)
        self.untrusted.pop(protocol, None)
        self.open -= 1
        if self.open < self.limit and self._retry is None:
            self._watch()


class _CloseAtCap:
    """ASGI wrapper: while the gate is full, responses say ``Connection: close``."""

    def __init__(self, app: Any, server: BoundedServer) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        gate = self.server.gate
        if gate is None or gate.open < gate.limit or scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_closing(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"connection", b"close")]
            await send(message)

        await self.app(scope, receive, send_closing)


class BoundedServer(uvicorn.Server):
    """``uvicorn.Server`` accepting at most ``max_accepted`` connections at once (see the module doc).

    ``config.app`` must be the ASGI app itself (not an import string); serve with
    ``run(sockets=[listening_socket])``. ``limits``: the head and body timeouts and the places kept for
    trusted clients; ``trusts(scope)``: whether a request head makes its connection trusted (default:
    every complete head does).
    """

    def __init__(
        self,
        config: uvicorn.Config,
        max_accepted: int,
        limits: ConnectionLimits | None = None,
        trusts: Callable[[dict], bool] | None = None,
    ) -> None:
        if max_accepted < 1:
            raise ValueError(f"max_accepted must be >= 1, got {max_accepted!r}")
        if isinstance(config.app, str):
            raise TypeError("BoundedServer needs the ASGI app object, not an import string")
        super().__init__(config)
        self.max_accepted = max_accepted
        self.limits = limits or ConnectionLimits()
        self.trusts = trusts
        self.gate: _Gate | None = None
        config.app = _CloseAtCap(config.app, self)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if sockets is None:
            raise ValueError("BoundedServer serves listening sockets it is given: run(sockets=[...])")
        await super().startup(sockets=[])  # lifespan start-up, no listeners of uvicorn's own
        if self.should_exit:
            return
        # The keyword arguments uvicorn itself passes to its HTTP protocol class.
        kwargs = {"config": self.config, "server_state": self.server_state, "app_state": self.lifespan.state}
        self.gate = _Gate(
            asyncio.get_running_loop(),
            self.max_accepted,
            self.config.http_protocol_class,
            kwargs,
            self.limits,
            self.trusts,
        )
        for sock in sockets:
            sock.listen(self.config.backlog)
        self.gate.start(list(sockets))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.gate is not None:
            self.gate.stop()
        await super().shutdown(sockets=sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, except that a stop signal it handled (a graceful shutdown done) is not raised again
        afterwards: the process then ends normally, and its exit handlers run (a sandbox's session and
        pre-start dirs are removed; dying by the re-raised SIGTERM left them in the temp dir)."""
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def bounded_server(
    app: Any,
    max_accepted: int,
    limits: ConnectionLimits,
    keep_alive_s: float,
    trusts: Callable[[dict], bool] | None = None,
    lifespan: str = "on",
) -> BoundedServer:
    """A :class:`BoundedServer` for ``app`` with the uvicorn settings every server of ours uses (quiet,
    no proxy headers, no server/date headers, a deep backlog); serve with ``.run(sockets=[sock])``."""
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=keep_alive_s,  # type: ignore[arg-type]  # uvicorn takes a float too
        timeout_graceful_shutdown=3,
        backlog=4096,
        lifespan=lifespan,  # type: ignore[arg-type]
        proxy_headers=False,  # our servers talk to each other directly, never behind a proxy
        server_header=False,
        date_header=False,
    )
    return BoundedServer(config, max_accepted, limits, trusts)
