"""ServerClient against tiny real servers on 127.0.0.1: shared session, no cookie jar, timeouts, retries."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web
from fastapi import FastAPI

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_gym.client.server_client import close_shared_session
from nemo_gym.errors import UpstreamError, response_body
from nemo_gym.server_utils import ServerClient
from tests.conftest import serve_app

BOUND_S = 20.0  # the outer bound on anything a test awaits


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def tiny_server(routes: dict[str, Handler], sock: socket.socket | None = None) -> AsyncIterator[int]:
    """An aiohttp.web server on 127.0.0.1 (on ``sock`` if given) answering POST/GET on ``routes``; yields its port."""
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_route("*", path, handler)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site: web.BaseSite = (
        web.SockSite(runner, sock) if sock is not None else web.TCPSite(runner, "127.0.0.1", 0)
    )
    await site.start()
    port = sock.getsockname()[1] if sock is not None else runner.addresses[0][1]
    try:
        yield port
    finally:
        await runner.cleanup()


def client_for(port: int, host: str = "127.0.0.1", **kwargs: Any) -> ServerClient:
    cfg = {"tiny": {"resources_servers": {"tiny_impl": {"host": host, "port": port}}}}
    return ServerClient(global_config_dict=cfg, **kwargs)


def bound_but_not_listening() -> socket.socket:
    """A reserved port on which connections are refused until ``listen()`` is called."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.fixture(autouse=True)
async def _close_session() -> AsyncIterator[None]:
    yield
    await close_shared_session()


class RetryLog(logging.Handler):
    """Collects the client's retry warnings."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "retry" in record.getMessage():
            self.messages.append(record.getMessage())


@pytest.fixture
def retry_log() -> Iterator[RetryLog]:
    handler = RetryLog()
    logger = logging.getLogger("nemo_gym")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


# -- one shared client ------------------------------------------------------------------------------


async def test_one_shared_session_per_process_and_loop() -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async with tiny_server({"/ok": ok}) as port:
        a, b = client_for(port), client_for(port, max_connections=5)
        assert a._session() is b._session()
        resp = await asyncio.wait_for(a.get("tiny", "/ok"), BOUND_S)
        assert resp.status == 200 and await resp.json() == {"ok": True}
        assert a._session() is b._session()
    session = a._session()
    await close_shared_session()
    assert session.closed and a._session() is not session


# -- cookies ----------------------------------------------------------------------------------------


async def test_set_cookie_is_never_sent_back_only_explicit_cookies_are() -> None:
    async def set_cookie(request: web.Request) -> web.Response:
        resp = web.json_response({"set": True})
        resp.set_cookie("tracker", "abc123", path="/")
        return resp

    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"cookie": request.headers.get("Cookie")})

    routes = {"/set": set_cookie, "/echo": echo}
    async with tiny_server(routes) as port:
        # "localhost" (not an IP) so that a normal cookie jar would keep the cookie: see the control below.
        base = f"http://localhost:{port}"
        async with aiohttp.ClientSession() as control:
            async with control.post(base + "/set") as r:
                assert r.status == 200
            async with control.post(base + "/echo") as r:
                assert (await r.json())["cookie"] == "tracker=abc123"

        client = client_for(port, host="localhost")
        first = await asyncio.wait_for(client.post("tiny", "/set"), BOUND_S)
        assert first.cookies["tracker"].value == "abc123"  # the client sees it (to pass on explicitly)
        second = await asyncio.wait_for(client.post("tiny", "/echo"), BOUND_S)
        assert (await second.json())["cookie"] is None
        explicit = await asyncio.wait_for(
            client.post("tiny", "/echo", cookies={"ng_session_x": "s1.sig"}), BOUND_S
        )
        assert (await explicit.json())["cookie"] == "ng_session_x=s1.sig"
        body, cookies = await asyncio.wait_for(client.post_json("tiny", "/set"), BOUND_S)
        assert body == {"set": True} and cookies == {"tracker": "abc123"}


# -- timeouts ---------------------------------------------------------------------------------------


async def test_a_server_slower_than_the_timeout_is_a_timeout_error_and_not_retried() -> None:
    release = asyncio.Event()
    hits = 0

    async def slow(request: web.Request) -> web.Response:
        nonlocal hits
        hits += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(release.wait(), BOUND_S)
        return web.json_response({"late": True})

    async with tiny_server({"/slow": slow}) as port:
        client = client_for(port, timeout_s=0.3)
        try:
            with pytest.raises(UpstreamError) as info:
                await asyncio.wait_for(client.post("tiny", "/slow", json={}), BOUND_S)
        finally:
            release.set()
    assert info.value.kind == "timeout" and info.value.server == "tiny" and info.value.path == "/slow"
    assert hits == 1


async def test_timeout_bounds_the_whole_request_even_if_bytes_keep_trickling() -> None:
    """A server that sends a byte now and then must not keep a request alive past the timeout."""
    stop = asyncio.Event()

    async def trickle(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(400):  # at most ~20 s, far beyond the client's 0.5 s timeout
            if stop.is_set():
                break
            await resp.write(b" ")
            await asyncio.sleep(0.05)
        await resp.write_eof()
        return resp

    async with tiny_server({"/trickle": trickle}) as port:
        client = client_for(port, timeout_s=0.5)
        try:
            with pytest.raises(UpstreamError) as info:
                await asyncio.wait_for(client.get("tiny", "/trickle"), BOUND_S + 5)
        finally:
            stop.set()
    assert info.value.kind == "timeout"


async def test_per_call_timeout_overrides_the_client_default() -> None:
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(release.wait(), BOUND_S)
        return web.json_response({})

    async with tiny_server({"/slow": slow}) as port:
        client = client_for(port)  # default timeout: minutes
        try:
            with pytest.raises(UpstreamError) as info:
                await asyncio.wait_for(client.post("tiny", "/slow", timeout_s=0.2), BOUND_S)
        finally:
            release.set()
    assert info.value.kind == "timeout"


# -- connection errors: retried with backoff ----------------------------------------------------------


async def test_a_server_that_starts_listening_late_is_reached(retry_log: RetryLog) -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"finally": True})

    sock = bound_but_not_listening()
    try:
        client = client_for(sock.getsockname()[1], max_retries=10, backoff_s=0.05)
        task = asyncio.ensure_future(client.post("tiny", "/ok", json={"x": 1}))
        # Start listening only after the client has been refused at least once.
        for _ in range(200):
            if retry_log.messages or task.done():
                break
            await asyncio.sleep(0.02)
        assert retry_log.messages, "the client never retried"
        assert not task.done()
        sock.listen(16)
        async with tiny_server({"/ok": ok}, sock=sock):
            resp = await asyncio.wait_for(task, BOUND_S)
            assert resp.status == 200 and await resp.json() == {"finally": True}
    finally:
        sock.close()


async def test_nobody_listening_fails_after_max_retries(retry_log: RetryLog) -> None:
    sock = bound_but_not_listening()
    try:
        client = client_for(sock.getsockname()[1], max_retries=3, backoff_s=0.01)
        with pytest.raises(UpstreamError) as info:
            await asyncio.wait_for(client.post("tiny", "/anything", json={}), BOUND_S)
    finally:
        sock.close()
    err = info.value
    assert err.kind == "connection_error" and err.status is None
    assert err.server == "tiny" and err.path == "/anything"
    assert "4 attempts" in str(err.detail)
    assert len(retry_log.messages) == 3
    assert err.to_dict()["kind"] == "connection_error"


async def test_a_dropped_connection_before_any_answer_is_retried() -> None:
    """The server closes the first connection without answering (as a restarting server would)."""
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await reader.readuntil(b"\r\n\r\n")
        if connections > 1:
            body = b'{"second": true}'
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        client = client_for(server.sockets[0].getsockname()[1], max_retries=2, backoff_s=0.01)
        resp = await asyncio.wait_for(client.get("tiny", "/x"), BOUND_S)
        assert resp.status == 200 and await resp.json() == {"second": True}
        assert connections == 2
    finally:
        server.close()
        await asyncio.wait_for(server.wait_closed(), BOUND_S)


# -- HTTP errors: never retried -----------------------------------------------------------------------


@pytest.mark.parametrize("status", [500, 503, 404])
async def test_http_error_statuses_are_not_retried(status: int) -> None:
    hits = 0

    async def failing(request: web.Request) -> web.Response:
        nonlocal hits
        hits += 1
        return web.json_response({"error": {"message": f"nope {status}"}}, status=status)

    async with tiny_server({"/fail": failing}) as port:
        client = client_for(port, max_retries=5, backoff_s=0.01)
        resp = await asyncio.wait_for(client.post("tiny", "/fail", json={}), BOUND_S)
        assert resp.status == status and hits == 1
        with pytest.raises(UpstreamError) as info:
            await asyncio.wait_for(client.post_json("tiny", "/fail", json={}), BOUND_S)
        assert hits == 2
    err = info.value
    assert err.kind == "http_error" and err.status == status
    assert err.detail == {"error": {"message": f"nope {status}"}}


async def test_post_json_names_a_body_that_is_not_json() -> None:
    async def text(request: web.Request) -> web.Response:
        return web.Response(text="<html>proxy page</html>")

    async with tiny_server({"/text": text}) as port:
        client = client_for(port)
        with pytest.raises(UpstreamError) as info:
            await asyncio.wait_for(client.post_json("tiny", "/text", json={}), BOUND_S)
        raw = await asyncio.wait_for(client.post("tiny", "/text"), BOUND_S)
        assert response_body(raw) == b"<html>proxy page</html>"
    assert info.value.kind == "bad_response" and "proxy page" in str(info.value.detail)


async def test_request_body_and_pydantic_models_are_sent_as_json() -> None:
    from nemo_gym.openai_utils import NeMoGymResponseCreateParamsNonStreaming

    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"got": await request.json(), "type": request.content_type})

    async with tiny_server({"/echo": echo}) as port:
        client = client_for(port)
        params = NeMoGymResponseCreateParamsNonStreaming.model_validate({"input": "hi"})
        body, _ = await asyncio.wait_for(client.post_json("tiny", "/echo", json={"params": params}), BOUND_S)
    assert body == {"got": {"params": {"input": "hi"}}, "type": "application/json"}


# -- configuration ------------------------------------------------------------------------------------


def test_unknown_server_name_lists_the_known_ones() -> None:
    client = client_for(1234)
    assert client.base_url("tiny") == "http://127.0.0.1:1234"
    with pytest.raises(KeyError, match="tiny"):
        client.base_url("tinny")


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        client_for(1, timeout_s=0)
    with pytest.raises(ValueError, match="max_retries"):
        client_for(1, max_retries=-1)


# -- a server built on BaseServer: errors are JSON and keep the connection usable ----------------------


class RaisingServer(SimpleResourcesServer):
    """A resources server with a route that raises."""

    config: BaseResourcesServerConfig

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/boom")(self.boom)
        app.post("/ok")(self.ok)
        return app

    async def boom(self) -> dict[str, str]:
        raise ValueError("the tool broke")

    async def ok(self) -> dict[str, str]:
        return {"ok": "yes"}

    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse:
        return BaseVerifyResponse(**body.model_dump(), reward=0.0)


async def test_a_raising_route_answers_json_500_and_the_connection_stays_usable() -> None:
    server = RaisingServer(
        config=BaseResourcesServerConfig(name="raiser", port=0),
        server_client=ServerClient(global_config_dict={}),
    )
    with serve_app(server.setup_webserver()) as url:
        port = urlsplit(url).port
        client = client_for(port, max_retries=0)  # a reset connection would surface, not be retried away
        for _ in range(5):
            boom = await asyncio.wait_for(client.post("tiny", "/boom", json={}), BOUND_S)
            assert boom.status == 500
            assert await boom.json() == {
                "error": {
                    "kind": "internal_error",
                    "server": "raiser",
                    "path": "/boom",
                    "type": "ValueError",
                    "message": "the tool broke",
                }
            }
            assert boom.cookies.get("ng_session_raiser") is not None  # the session cookie is still issued
            ok = await asyncio.wait_for(client.post("tiny", "/ok", json={}), BOUND_S)
            assert ok.status == 200 and await ok.json() == {"ok": "yes"}
