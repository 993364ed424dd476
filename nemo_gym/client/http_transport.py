"""A lean HTTP/1.1 keep-alive client for calls between our own servers (the rollout hot path).

Contract
--------
* ``HttpTransport.request(method, host, port, path, body, headers, timeout_s)`` sends one request
  on a pooled keep-alive connection and returns a :class:`RawResponse` with the whole body read.
* At most ``max_connections`` requests are in flight (and, when ``max_connections_per_host`` is
  set, at most that many to one host:port); further requests wait their turn in order (FIFO).
* At most ``max_sockets`` sockets (default: ``max_connections``) are open at once, busy or idle,
  whatever the hosts, so a pool sized from the open-file budget (:mod:`nemo_gym.client.fd_limits`) never
  meets "Too many open files". Idle connections are reused; one the server closed while idle is
  never reused. A request for a host with no idle connection while every socket is taken closes an
  idle connection of another host and waits (at most ``connect_timeout_s``) until that socket is
  gone; while requests wait so, connections finishing a request are closed rather than kept idle.
  Give ``max_sockets`` room above ``max_connections`` when requests go to several hosts, or idle
  sockets of one host get closed to open sockets to another (connection churn).
* Errors are typed so the caller can tell what is safe to retry: :class:`ConnectFailed` (nothing
  was sent), :class:`DisconnectedBeforeResponse` (the server closed the connection without
  answering), :class:`ResponseTimeout` (no complete answer within ``timeout_s``), and
  :class:`ProtocolFailure` (anything else, e.g. a reset in the middle of a response).
* Responses are parsed by ``httptools`` (the C parser uvicorn uses), so each call costs a fraction
  of a general-purpose client's CPU. Only plain HTTP to hosts named in our own config is supported:
  no TLS, proxies, redirects or compression — use a general client for anything else.
* ``RawResponse.raise_for_status()`` raises :class:`nemo_gym.errors.UpstreamError`; that module
  (which imports neither this one nor the client) is all of ``nemo_gym`` this module imports.
"""

from __future__ import annotations

import asyncio
import collections
import http
from collections.abc import Callable
from http.cookies import CookieError, SimpleCookie
from typing import Any

import httptools
import orjson

from nemo_gym.errors import FullyReadResponse
from nemo_gym.errors import raise_for_status as _raise_for_status


class TransportError(Exception):
    """Base class of the errors below."""


class ConnectFailed(TransportError):
    """The TCP connection could not be opened; the request was not sent."""


class DisconnectedBeforeResponse(TransportError):
    """The server closed the connection before any byte of a response arrived."""


class ResponseTimeout(TransportError):
    """No complete response within the time limit."""


class ProtocolFailure(TransportError):
    """The exchange broke after the response had started, or the response was not valid HTTP."""


class RawResponse(FullyReadResponse):
    """A fully read HTTP response, shaped like aiohttp's ``ClientResponse`` for the callers that matter:
    ``status``, ``ok``, ``reason``, ``headers``, ``cookies``, ``await read()/json()/text()``,
    ``await content.read()`` and ``raise_for_status()``. ``server_name``/``url_path`` say which call it
    answered (set by :class:`nemo_gym.client.server_client.ServerClient`) so an error can name them."""

    __slots__ = ("status", "headers", "_body", "_cookies", "server_name", "url_path")

    def __init__(self, status: int, headers: list[tuple[str, str]], body: bytes):
        self.status = status
        self.headers = _Headers(headers)
        self._body = body
        self._cookies: SimpleCookie | None = None
        self.server_name = ""
        self.url_path = ""

    @property
    def ok(self) -> bool:
        return self.status < 400

    @property
    def reason(self) -> str:
        return http.HTTPStatus(self.status).phrase if self.status in _KNOWN_STATUSES else ""

    @property
    def content(self) -> _Content:
        return _Content(self._body)

    @property
    def cookies(self) -> SimpleCookie:
        if self._cookies is None:
            jar: SimpleCookie = SimpleCookie()
            for value in self.headers.getall("set-cookie"):
                try:
                    jar.load(value)
                except CookieError:
                    continue
            self._cookies = jar
        return self._cookies

    def cookie_values(self) -> dict[str, str]:
        """``{name: value}`` of the cookies this response sets (a cheap parse for the hot path)."""
        out: dict[str, str] = {}
        for k, v in self.headers._items:
            if k == "set-cookie":
                name, sep, value = v.split(";", 1)[0].partition("=")
                if sep:
                    value = value.strip()
                    if len(value) > 1 and value[0] == value[-1] == '"':
                        value = value[1:-1]
                    out[name.strip()] = value
        return out

    async def read(self) -> bytes:
        return self._body

    async def json(self, **_: Any) -> Any:
        return orjson.loads(self._body)

    async def text(self, encoding: str = "utf-8") -> str:
        return self._body.decode(encoding, errors="replace")

    def raise_for_status(self) -> None:
        """Raise :class:`nemo_gym.errors.UpstreamError` (with ``status`` and ``response_content``)
        for a status >= 400, like aiohttp's method of the same name."""
        if self.status >= 400:
            _raise_for_status(self)

    def release(self) -> None:
        """Nothing to release: the body is read and the connection already back in the pool."""


_KNOWN_STATUSES = frozenset(s.value for s in http.HTTPStatus)


class _Content:
    """``response.content`` of aiohttp: here the body is already read, so ``read()`` just returns it."""

    __slots__ = ("_body",)

    def __init__(self, body: bytes):
        self._body = body

    async def read(self, n: int = -1) -> bytes:
        return self._body if n < 0 else self._body[:n]


class _Headers:
    """Case-insensitive, multi-valued response headers."""

    __slots__ = ("_items",)

    def __init__(self, items: list[tuple[str, str]]):
        self._items = items

    def get(self, name: str, default: str | None = None) -> str | None:
        name = name.lower()
        for k, v in self._items:
            if k == name:
                return v
        return default

    def getall(self, name: str) -> list[str]:
        name = name.lower()
        return [v for k, v in self._items if k == name]

    def __getitem__(self, name: str) -> str:
        value = self.get(name)
        if value is None:
            raise KeyError(name)
        return value

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def items(self) -> list[tuple[str, str]]:
        return list(self._items)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one request in flight on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_lost: Callable[[_Connection], None]):
        self.loop = loop
        self.on_lost = on_lost  # told once, when the socket is gone
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future | None = None
        self.started = False
        self.headers: list[tuple[str, str]] = []
        self.chunks: list[bytes] = []
        self.keep_alive = True

    # -- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.started = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(ProtocolFailure("the server tried to upgrade the connection"))
        except httptools.HttpParserError as e:
            self._fail(ProtocolFailure(f"invalid HTTP response: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            if self.started:
                self._fail(
                    ProtocolFailure(f"connection lost in the middle of the response ({exc or 'closed'})")
                )
            else:
                self._fail(
                    DisconnectedBeforeResponse(f"the server closed the connection ({exc or 'no answer'})")
                )
        self.on_lost(self)

    # -- httptools callbacks ------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(RawResponse(self.parser.get_status_code(), self.headers, b"".join(self.chunks)))

    # -- use ----------------------------------------------------------------------------------------
    def _fail(self, exc: Exception) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    def send(self, data: bytes) -> asyncio.Future:
        self.waiter = self.loop.create_future()
        self.started = False
        self.headers = []
        self.chunks = []
        self.parser = httptools.HttpResponseParser(self)
        assert self.transport is not None
        self.transport.write(data)
        return self.waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class HttpTransport:
    """A pool of keep-alive connections per (host, port) for one event loop."""

    def __init__(
        self,
        max_connections: int = 1024,
        connect_timeout_s: float = 10.0,
        max_connections_per_host: int | None = None,
        max_sockets: int | None = None,
    ):
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections!r}")
        if max_sockets is not None and max_sockets < 1:
            raise ValueError(f"max_sockets must be >= 1, got {max_sockets!r}")
        self.loop = asyncio.get_running_loop()
        self.max_connections = max_connections
        self.max_sockets = max_sockets or max_connections
        self.max_connections_per_host = max_connections_per_host
        self._host_slots: dict[tuple[str, int], asyncio.Semaphore] = {}
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, int], list[_Connection]] = collections.defaultdict(list)
        self._busy = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        # Sockets counted against ``max_sockets``: connecting, busy, idle, or closed by us but
        # not yet gone. A socket is uncounted when it is gone (``_socket_gone``), or handed over.
        self._open = 0
        self._room_waiters: collections.deque[asyncio.Future] = collections.deque()
        self._all: set[_Connection] = set()
        self.closed = False

    @property
    def open_sockets(self) -> int:
        """Sockets counted against ``max_sockets`` now."""
        return self._open

    async def _slot(self) -> None:
        if self._busy < self.max_connections and not self._waiters:
            self._busy += 1
            return
        fut = self.loop.create_future()
        self._waiters.append(fut)
        try:
            await fut  # the releaser hands its slot over (``_busy`` unchanged)
        except BaseException:
            if fut.done() and not fut.cancelled():
                self._release_slot()  # we were handed a slot but will not use it
            else:
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
            raise

    def _release_slot(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self._busy -= 1

    # -- the socket count --------------------------------------------------------------------------
    async def _room(self) -> None:
        """Count one more socket, waiting (bounded) while ``max_sockets`` are open."""
        if self._open < self.max_sockets and not self._room_waiters:
            self._open += 1
            return
        # Every socket is taken. This request holds a slot and its host has no idle connection, so
        # any idle connection belongs to another host: close one; its socket is handed to a waiter.
        self._close_one_idle()
        fut = self.loop.create_future()
        self._room_waiters.append(fut)
        timer = self.loop.call_later(self.connect_timeout_s, _expire_room, fut, self.connect_timeout_s)
        try:
            await fut  # ``_socket_gone`` hands its count over (``_open`` unchanged)
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._socket_gone(None)  # handed a socket but will not use it
            else:
                try:
                    self._room_waiters.remove(fut)
                except ValueError:
                    pass
            raise
        finally:
            timer.cancel()

    def _close_one_idle(self) -> None:
        for idle in self._idle.values():
            while idle:
                conn = idle.pop()
                if not conn.closed:
                    conn.close()
                    return

    def _socket_gone(self, conn: _Connection | None) -> None:
        """A counted socket is gone (or was never opened): hand its count to a waiter, else uncount it."""
        if conn is not None:
            if conn not in self._all:
                return  # already uncounted
            self._all.discard(conn)
        while self._room_waiters:
            fut = self._room_waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self._open -= 1

    async def _connection(self, host: str, port: int) -> _Connection:
        idle = self._idle.get((host, port))
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        await self._room()
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: _Connection(self.loop, self._socket_gone), host, port),
                self.connect_timeout_s,
            )
        except BaseException as e:
            self._socket_gone(None)
            if isinstance(e, (OSError, TimeoutError)):
                raise ConnectFailed(f"cannot connect to {host}:{port}: {type(e).__name__}: {e}") from e
            raise
        if conn.closed:  # lost before we saw it: its socket is already gone
            self._socket_gone(None)
            raise DisconnectedBeforeResponse(f"the server closed the connection to {host}:{port} at once")
        self._all.add(conn)
        return conn

    async def request(
        self,
        method: str,
        host: str,
        port: int,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
        timeout_s: float,
    ) -> RawResponse:
        if self.closed:
            raise ConnectFailed("the transport is closed")
        head = [f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"]
        for k, v in headers.items():
            head.append(f"{k}: {v}\r\n")
        if body is not None or method in ("POST", "PUT", "PATCH"):
            head.append(f"Content-Length: {len(body or b'')}\r\n")
        head.append("\r\n")
        data = "".join(head).encode("latin-1") + (body or b"")

        # With a per-host cap, the host's slot first: a request waiting for a busy host holds no slot of
        # the total. Without one (the default) this costs one attribute test.
        host_slot = None
        if self.max_connections_per_host is not None:
            host_slot = self._host_slots.get((host, port))
            if host_slot is None:
                host_slot = self._host_slots[(host, port)] = asyncio.Semaphore(self.max_connections_per_host)
            await host_slot.acquire()
        try:
            await self._slot()
        except BaseException:
            if host_slot is not None:
                host_slot.release()
            raise
        conn: _Connection | None = None
        timer = None
        try:
            conn = await self._connection(host, port)
            waiter = conn.send(data)
            timer = self.loop.call_later(timeout_s, _expire, conn, timeout_s)
            response = await waiter
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        finally:
            if timer is not None:
                timer.cancel()
            self._release_slot()
            if host_slot is not None:
                host_slot.release()
        if conn.keep_alive and not conn.closed and not self._room_waiters:
            self._idle[(host, port)].append(conn)
        else:
            conn.close()  # its socket goes to a request waiting for room, if any
        return response

    async def close(self) -> None:
        self.closed = True
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
        while self._room_waiters:
            fut = self._room_waiters.popleft()
            if not fut.done():
                fut.set_exception(ConnectFailed("the transport is closed"))
        await asyncio.sleep(0)


def _expire_room(fut: asyncio.Future, timeout_s: float) -> None:
    if not fut.done():
        fut.set_exception(ConnectFailed(f"no socket came free within {timeout_s} s (all sockets in use)"))


def _expire(conn: _Connection, timeout_s: float) -> None:
    conn._fail(ResponseTimeout(f"no complete response within {timeout_s} s"))
