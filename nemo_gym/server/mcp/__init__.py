"""Serve a resources server's tools over MCP (streamable HTTP, the official ``mcp`` package), bound to
the rollout's session.

Contract
--------
* Installed by :class:`nemo_gym.server.resources.SimpleResourcesServer` when the config sets
  ``expose_tools_over_mcp: true`` (:func:`install_mcp`). The optional ``mcp`` package (and ``httpx``)
  is imported only then: this module itself imports without them, since
  :mod:`nemo_gym.server.resources` imports its metadata model and names at start. It never
  imports the server classes (:class:`MCPServable` is what it needs of a server).
* ``POST /mcp`` is a stateless MCP endpoint (JSON responses). It sits behind the same request guard as
  every route: MCP clients send the run token (``Authorization: Bearer ...`` or ``X-NeMo-Gym-Token``)
  like any client, and a tool call passes on whichever of the two it came with.
* ``GET /mcp`` (the client's stream for server-initiated messages, which stateless MCP never sends) is
  ended once no event went out on it for ``mcp_stream_idle_timeout_s`` (default 60 s; keep-alive pings
  do not count), so idle streams do not hold connections for ever; clients reconnect if they want.
* ``/seed_session`` answers carry ``{"mcp": {"server_name", "url_path": "/mcp", "transport": "http",
  "headers": {...}}}`` (an environment server's seed, answered with ``resources_session_id``, carries the
  same in ``resources_tools`` unless the server set it) (:class:`MCPServerMetadata`, key
  ``NEMO_GYM_MCP_METADATA_KEY``; both are also
  exported by upstream's path :mod:`nemo_gym.base_resources_server`). ``headers`` hold
  ``X-NeMo-Gym-Session-Token`` (``NEMO_GYM_MCP_SESSION_TOKEN_HEADER``: this session's signed cookie
  value, which binds MCP calls to the session just seeded) and, when the run has a token, the
  ``Authorization`` header. Send them on every MCP request.
* ``tools/list`` lists the server's tools: ``server.mcp_tool_schemas()`` when the server defines it
  (function tools: ``{name, description, parameters}``), else every ``POST /<name>`` route except
  the protocol's own (seed_session, verify, ...), with its pydantic body's JSON schema.
* ``tools/call`` runs the tool through the server's own ASGI app in process (``POST /<name>`` with
  the session's cookie and the caller's token): the same validation, state and errors as the HTTP
  route, so effects show up in that session's ``/verify``. A 2xx answer is the result (its JSON as
  text, and as structured content when it is an object); any other answer, or a missing or forged
  session token, is an MCP tool error (``isError``) with the reason; so is a call that takes longer
  than ``MCP_TOOL_TIMEOUT_S``.
* Differences from NVIDIA NeMo Gym (same config key, seed-response key and header name): the session
  token is the session's signed cookie value rather than a separately signed payload; tools are chosen
  by ``mcp_tool_schemas()`` or harvesting, not upstream's ``mcp_tools(harvested, catchall)`` hook; there
  is no per-session tool allow-list (``mcp_allowed_tools_for_session``) and no renaming of
  ``mcp__<server>__`` tool names before ``/verify``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

import orjson
from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.routing import Route

NEMO_GYM_MCP_METADATA_KEY = "mcp"
NEMO_GYM_MCP_SESSION_TOKEN_HEADER = "X-NeMo-Gym-Session-Token"
MCP_URL_PATH = "/mcp"
MCP_TOOL_TIMEOUT_S = 180.0  # one tools/call, as the agents' default tool_timeout_s
DEFAULT_MCP_STREAM_IDLE_TIMEOUT_S = 60.0
# The run-token headers a tool call forwards to the route it runs (see nemo_gym.auth).
_FORWARDED_AUTH_HEADERS = ("authorization", "x-nemo-gym-token")
# Routes that belong to the protocol, never offered as tools.
RESERVED_PATHS = frozenset(
    {
        "/seed_session",
        "/close_session",
        "/verify",
        "/aggregate_metrics",
        "/reverify_mode",
        "/row_schema",
        MCP_URL_PATH,
        "/reset",
        "/step",
        "/close",
    }
)


class MCPServerMetadata(BaseModel):
    """Where a client finds a session's MCP server (upstream's seed-response metadata, key ``"mcp"``)."""

    server_name: str
    url_path: str = "/mcp"
    transport: str = "http"
    headers: dict[str, str] = {}


class _ServerConfig(Protocol):
    @property
    def name(self) -> str: ...


class MCPServable(Protocol):
    """What :func:`install_mcp` reads of a server (a
    :class:`~nemo_gym.server.resources.SimpleResourcesServer`): its config's ``name`` (and
    ``mcp_stream_idle_timeout_s`` when the config has it), and ``mcp_tool_schemas()`` when the server
    defines it. A structural type, so this package never imports the server classes (which import it)."""

    @property
    def config(self) -> _ServerConfig: ...


def _body_schema(route: APIRoute) -> dict[str, Any]:
    try:
        signature = inspect.signature(route.endpoint, eval_str=True)
    except (NameError, TypeError, ValueError):
        signature = None
    if signature is not None:
        for param in signature.parameters.values():
            if isinstance(param.annotation, type) and issubclass(param.annotation, BaseModel):
                return param.annotation.model_json_schema()
    return {"type": "object"}


def harvest_tool_schemas(app: FastAPI) -> list[dict[str, Any]]:
    """Every ``POST /<name>`` route of ``app`` that is not part of the protocol, as a function tool."""
    tools = []
    for route in app.router.routes:
        if not isinstance(route, APIRoute) or "POST" not in route.methods or route.path in RESERVED_PATHS:
            continue
        name = route.path.lstrip("/")
        if not name or "/" in name or "{" in name:
            continue
        tools.append(
            {
                "name": name,
                "description": route.description or route.summary or "",
                "parameters": _body_schema(route),
            }
        )
    return tools


class _SeedMetadataMiddleware:
    """Adds the ``mcp`` metadata to every 2xx JSON answer of ``/seed_session``."""

    def __init__(self, app: Any, metadata_for: Any) -> None:
        self.app, self.metadata_for = app, metadata_for

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/seed_session":
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] = {}
        chunks: list[bytes] = []

        async def capture(message: dict) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
                return
            if message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = b"".join(chunks)
            if 200 <= start.get("status", 500) < 300:
                try:
                    payload = orjson.loads(body)
                except orjson.JSONDecodeError:
                    payload = None
                if isinstance(payload, dict):
                    session_id = scope.get("state", {}).get("session_id")
                    if "resources_session_id" in payload:  # an environment server's seed: its own field
                        if payload.get("resources_tools") is None:
                            payload["resources_tools"] = self.metadata_for(session_id)
                    else:
                        payload[NEMO_GYM_MCP_METADATA_KEY] = self.metadata_for(session_id)
                    body = orjson.dumps(payload)
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, capture)


_INSTALLED_FLAG = "nemo_gym_mcp_installed"


def mcp_installed(app: FastAPI) -> bool:
    """True once :func:`install_mcp` has served MCP on ``app``."""
    return bool(getattr(app.state, _INSTALLED_FLAG, False))


def install_mcp(server: MCPServable, app: FastAPI) -> None:
    """Mount ``/mcp`` on ``app``, announce it in ``/seed_session`` answers, run its session manager with
    the app. Tools are collected on first use, so routes registered after this call are included.
    A second call on the same app does nothing."""
    if mcp_installed(app):
        return
    import httpx
    import mcp.types as types
    from mcp.server.lowlevel import Server
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

    from nemo_gym.auth import auth_headers, server_token_from_env
    from nemo_gym.server.asgi.sessions import SessionMiddleware, cookie_name_for, session_secret

    logging.getLogger("mcp.server.streamable_http").setLevel(logging.WARNING)  # one INFO line per request
    name = server.config.name or type(server).__name__
    cookie_name = cookie_name_for(server.config.name)
    signer = SessionMiddleware(None, cookie_name, session_secret())
    cache: dict[str, list[dict[str, Any]]] = {}

    def tool_schemas() -> list[dict[str, Any]]:
        if "tools" not in cache:
            custom = getattr(server, "mcp_tool_schemas", None)
            cache["tools"] = list(custom()) if callable(custom) else harvest_tool_schemas(app)
        return cache["tools"]

    def metadata_for(session_id: str | None) -> dict[str, Any]:
        headers = {NEMO_GYM_MCP_SESSION_TOKEN_HEADER: f"{session_id}.{signer._sign(session_id or '')}"}
        token, _ = server_token_from_env()
        headers.update(auth_headers(token))
        return MCPServerMetadata(server_name=name, url_path=MCP_URL_PATH, headers=headers).model_dump()

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(
            tools=[
                types.Tool(
                    name=t["name"],
                    description=t.get("description") or None,
                    input_schema=t.get("parameters") or {"type": "object"},
                )
                for t in tool_schemas()
            ]
        )

    def error(text: str) -> types.CallToolResult:
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=True)

    internal = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://mcp.internal", timeout=None
    )

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        request = ctx.request
        token = request.headers.get(NEMO_GYM_MCP_SESSION_TOKEN_HEADER, "") if request is not None else ""
        if not token or signer._verify(token) is None:
            return error(
                f"missing or invalid {NEMO_GYM_MCP_SESSION_TOKEN_HEADER} header: send the headers that "
                f"/seed_session announced under 'mcp'"
            )
        if params.name not in {t["name"] for t in tool_schemas()}:
            return error(f"unknown tool {params.name!r}")
        headers = {"cookie": f"{cookie_name}={token}", "content-type": "application/json"}
        for header in _FORWARDED_AUTH_HEADERS:
            if request.headers.get(header):
                headers[header] = request.headers[header]
        try:
            resp = await asyncio.wait_for(
                internal.post(
                    f"/{params.name}", content=orjson.dumps(params.arguments or {}), headers=headers
                ),
                MCP_TOOL_TIMEOUT_S,
            )
        except TimeoutError:
            return error(f"tool {params.name!r} did not answer within {MCP_TOOL_TIMEOUT_S:g} s")
        text = resp.text
        if resp.status_code >= 300:
            return error(f"HTTP {resp.status_code}: {text}")
        try:
            parsed = orjson.loads(resp.content)
        except orjson.JSONDecodeError:
            parsed = None
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text)],
            structured_content=parsed if isinstance(parsed, dict) else None,
        )

    mcp_server = Server(name, on_list_tools=list_tools, on_call_tool=call_tool)
    manager = StreamableHTTPSessionManager(app=mcp_server, stateless=True, json_response=True)

    idle_s = float(getattr(server.config, "mcp_stream_idle_timeout_s", DEFAULT_MCP_STREAM_IDLE_TIMEOUT_S))

    async def endpoint(scope: dict, receive: Any, send: Any) -> None:
        if scope.get("method") == "GET":
            await serve_idle_bounded_stream(manager.handle_request, scope, receive, send, idle_s)
        else:
            await manager.handle_request(scope, receive, send)

    app.router.routes.append(
        Route(MCP_URL_PATH, endpoint=_ASGIEndpoint(endpoint), methods=["GET", "POST", "DELETE"])
    )
    app.add_middleware(_SeedMetadataMiddleware, metadata_for=metadata_for)

    previous = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        async with manager.run():
            async with previous(a) as state:
                try:
                    yield state
                finally:
                    await internal.aclose()

    app.router.lifespan_context = lifespan
    setattr(app.state, _INSTALLED_FLAG, True)


async def serve_idle_bounded_stream(app: Any, scope: dict, receive: Any, send: Any, idle_s: float) -> None:
    """Serve an event-stream response of ``app``, ending it once no event has gone out for ``idle_s``.

    ``app`` is told the client disconnected (its next ``receive()`` says so), the response is finished
    properly (a last empty chunk) so the connection stays usable, and should ``app`` not return within
    a few seconds after that it is cancelled. SSE comments (``:``-lines, e.g. keep-alive pings) do not
    count as events.
    """
    loop = asyncio.get_running_loop()
    last_event = loop.time()
    started = finished = False
    expired = False

    async def tracking_send(message: dict) -> None:
        nonlocal last_event, started, finished
        if message["type"] == "http.response.start":
            started = True
        elif message["type"] == "http.response.body":
            body = message.get("body", b"")
            if body and not body.lstrip().startswith(b":"):
                last_event = loop.time()
            finished = not message.get("more_body", False)
        await send(message)

    pending: asyncio.Future | None = None

    async def bounded_receive() -> dict:
        nonlocal pending, expired
        while not expired:
            if pending is None:
                pending = asyncio.ensure_future(receive())
            remaining = last_event + idle_s - loop.time()
            if remaining > 0:
                done, _ = await asyncio.wait({pending}, timeout=remaining)
                if done:
                    message, pending = pending.result(), None
                    return message
                continue  # an event may have gone out meanwhile: look again
            expired = True
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(app(scope, bounded_receive, tracking_send))
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=max(0.05, last_event + idle_s - loop.time()))
            if not task.done() and loop.time() - last_event >= idle_s + 5.0:
                task.cancel()  # told of the disconnect and still running: stop it
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if not task.cancelled():
            task.result()
    finally:
        if pending is not None:
            pending.cancel()
        if not task.done():
            task.cancel()
    if started and not finished:
        finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class _ASGIEndpoint:
    """Starlette calls a non-function endpoint as a raw ASGI app."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        await self.fn(scope, receive, send)
