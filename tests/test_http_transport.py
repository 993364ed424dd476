"""The keep-alive transport under ServerClient, against a real aiohttp.web server on 127.0.0.1.

Covers what the ServerClient tests do not reach directly: the connection bound (on requests in
flight and on open sockets, whatever the hosts), reuse of idle
connections, a connection the server closed while idle, chunked bodies, several Set-Cookie headers,
``Connection: close``, and that a timed-out connection is dropped rather than reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from nemo_gym.client.http_transport import ConnectFailed, HttpTransport, ResponseTimeout


class Server:
    def __init__(self) -> None:
        self.peers: list[tuple[str, int]] = []
        self.active = 0
        self.peak = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.peers.append(request.transport.get_extra_info("peername"))
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            action = request.match_info["action"]
            if action == "slow":
                await asyncio.sleep(float(request.query.get("s", "0.2")))
                return web.Response(text="slow")
            if action == "chunked":
                resp = web.StreamResponse()
                resp.enable_chunked_encoding()
                await resp.prepare(request)
                for part in (b"alpha-", b"beta-", b"gamma"):
                    await resp.write(part)
                await resp.write_eof()
                return resp
            if action == "cookies":
                resp = web.Response(text="ok")
                resp.set_cookie("ng_session_a", "one")
                resp.set_cookie("ng_session_b", "two")
                return resp
            if action == "close":
                return web.Response(text="bye", headers={"Connection": "close"})
            body = await request.read()
            return web.Response(body=body, content_type="application/json")
        finally:
            self.active -= 1


@contextlib.asynccontextmanager
async def serving(keepalive_timeout: float = 0.3) -> AsyncIterator[tuple[Server, int]]:
    state = Server()
    app = web.Application()
    app.router.add_route("*", "/{action}", state.handle)
    runner = web.AppRunner(app, keepalive_timeout=keepalive_timeout)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield state, port
    finally:
        await runner.cleanup()


@pytest.fixture
async def server() -> AsyncIterator[tuple[Server, int]]:
    async with serving() as served:  # idle connections are closed quickly
        yield served


async def test_echo_and_keep_alive_reuse(server: tuple[Server, int]) -> None:
    state, port = server
    t = HttpTransport(max_connections=4)
    try:
        for i in range(10):
            r = await t.request(
                "POST", "127.0.0.1", port, "/echo", b'{"i": %d}' % i, {"Content-Type": "application/json"}, 10
            )
            assert r.status == 200 and await r.json() == {"i": i}
        assert len(set(state.peers)) == 1  # one connection served all ten sequential requests
    finally:
        await t.close()


async def test_at_most_max_connections_busy(server: tuple[Server, int]) -> None:
    state, port = server
    t = HttpTransport(max_connections=3)
    try:
        results = await asyncio.gather(
            *(t.request("GET", "127.0.0.1", port, "/slow?s=0.05", None, {}, 10) for _ in range(30))
        )
        assert [r.status for r in results] == [200] * 30
        assert state.peak <= 3
        assert len(set(state.peers)) <= 3
    finally:
        await t.close()


async def test_connection_closed_by_server_while_idle_is_not_reused(server: tuple[Server, int]) -> None:
    state, port = server
    t = HttpTransport()
    try:
        assert (await t.request("GET", "127.0.0.1", port, "/echo", None, {}, 10)).status == 200
        await asyncio.sleep(1.0)  # past the server's keep-alive timeout: it closes the idle connection
        assert (await t.request("GET", "127.0.0.1", port, "/echo", None, {}, 10)).status == 200
        assert len(set(state.peers)) == 2
    finally:
        await t.close()


async def test_chunked_body_cookies_and_connection_close(server: tuple[Server, int]) -> None:
    state, port = server
    t = HttpTransport()
    try:
        r = await t.request("GET", "127.0.0.1", port, "/chunked", None, {}, 10)
        assert r._body == b"alpha-beta-gamma"
        r = await t.request("GET", "127.0.0.1", port, "/cookies", None, {}, 10)
        assert {k: m.value for k, m in r.cookies.items()} == {"ng_session_a": "one", "ng_session_b": "two"}
        assert len(r.headers.getall("Set-Cookie")) == 2
        before = len(set(state.peers))
        assert (await t.request("GET", "127.0.0.1", port, "/close", None, {}, 10)).status == 200
        assert (await t.request("GET", "127.0.0.1", port, "/echo", None, {}, 10)).status == 200
        assert len(set(state.peers)) == before + 1  # the closed connection was not reused
    finally:
        await t.close()


async def test_timeout_drops_the_connection_and_the_next_request_works(server: tuple[Server, int]) -> None:
    state, port = server
    t = HttpTransport()
    try:
        with pytest.raises(ResponseTimeout):
            await t.request("GET", "127.0.0.1", port, "/slow?s=2", None, {}, 0.2)
        r = await t.request("GET", "127.0.0.1", port, "/echo", None, {}, 10)
        assert r.status == 200
        assert state.peers[-1] != state.peers[0]  # a fresh connection, not the one that timed out
    finally:
        await t.close()


async def test_nobody_listening_is_connect_failed() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connections are refused
        t = HttpTransport()
        try:
            with pytest.raises(ConnectFailed):
                await t.request("GET", "127.0.0.1", port, "/", None, {}, 5)
        finally:
            await t.close()


def _sockets_to(ports: set[int]) -> int:
    """This process's open TCP sockets connected to one of ``ports`` (what the kernel sees, not the pool)."""
    import psutil

    return sum(
        1
        for c in psutil.Process(os.getpid()).net_connections(kind="tcp")
        if c.raddr and c.raddr.port in ports and c.status == psutil.CONN_ESTABLISHED
    )


async def test_max_connections_bounds_open_sockets_across_hosts_and_requests_queue() -> None:
    # Idle connections to one host count too: switching hosts closes idle ones instead of opening more.
    async with serving(keepalive_timeout=60) as (a, port_a), serving(keepalive_timeout=60) as (b, port_b):
        ports = {port_a, port_b}
        t = HttpTransport(max_connections=3)
        peak = 0

        async def sample() -> None:
            nonlocal peak
            while True:
                peak = max(peak, _sockets_to(ports), t.open_sockets)
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        try:
            for port in (port_a, port_b, port_a):  # three at once to one host, then to the other
                results = await asyncio.gather(
                    *(t.request("GET", "127.0.0.1", port, "/slow?s=0.05", None, {}, 10) for _ in range(3))
                )
                assert [r.status for r in results] == [200] * 3
                peak = max(peak, _sockets_to(ports))
            # Many more requests than sockets, to both hosts at once: all are answered, in turn.
            mixed = await asyncio.gather(
                *(
                    t.request("GET", "127.0.0.1", (port_a, port_b)[i % 2], "/slow?s=0.01", None, {}, 10)
                    for i in range(60)
                )
            )
            assert [r.status for r in mixed] == [200] * 60
            peak = max(peak, _sockets_to(ports))
        finally:
            sampler.cancel()
            await t.close()
        assert 0 < peak <= 3, peak
        assert a.peak + b.peak >= 3  # the bound was reached, so it was what held the count down
