"""Server plumbing shared by every server process: the HTTP client, sessions, errors, start-up.

Contract
--------
* :class:`ServerClient` is the one client for server-to-server calls. It keeps one aiohttp session
  per process and event loop, never stores cookies (callers pass them explicitly), puts a timeout on
  every request, retries only failures to *reach* a server (bounded exponential backoff) and never
  retries an HTTP error status.
* :class:`BaseServer` turns a pydantic config into a FastAPI app with ``GET /`` (health), a signed
  per-instance session cookie, and JSON errors that name the server, the path and the inner error.
  ``run_webserver()`` is what each ``app.py`` calls under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import os
import re
import signal
import socket
import sys
import threading
import uuid
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel, ConfigDict, ValidationError

from nemo_gym.config_types import BaseServerConfig
from nemo_gym.global_config import (
    DEFAULT_HEAD_SERVER_HOST,
    DEFAULT_HEAD_SERVER_PORT,
    HEAD_SERVER_KEY_NAME,
    NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME,
    NEMO_GYM_LISTEN_FD_ENV_VAR_NAME,
    NEMO_GYM_PARENT_PID_ENV_VAR_NAME,
    NEMO_GYM_SESSION_SECRET_ENV_VAR_NAME,
    SERVER_TYPES,
    get_global_config_dict,
)

logger = logging.getLogger("nemo_gym")

SESSION_ID_KEY = "session_id"
DEFAULT_REQUEST_TIMEOUT_S = 600.0


class BaseRunServerInstanceConfig(BaseModel):
    """The impl block of one server instance in YAML. Unknown keys are an error (typos surface)."""

    model_config = ConfigDict(extra="forbid")

    name: str = ""  # the instance name, filled in by the launcher
    entrypoint: str = "app.py"
    host: str = "127.0.0.1"
    port: int | None = None
    domain: str | None = None
    description: str | None = None
    verified: bool | None = None
    license: str | None = None


# ------------------------------------------------------------------------------------------------
# Errors.


class UpstreamError(Exception):
    """A call to another server failed; carries enough to say which, where and why."""

    def __init__(self, server: str, path: str, status: int | None, detail: Any, kind: str = "http_error"):
        self.server, self.path, self.status, self.detail, self.kind = server, path, status, detail, kind
        super().__init__(f"{kind} from {server}{path} (status {status}): {str(detail)[:500]}")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "server": self.server, "path": self.path, "status": self.status, "detail": self.detail}


# ------------------------------------------------------------------------------------------------
# The HTTP client.


def _find_instance_block(cfg: DictConfig | dict, name: str) -> tuple[str, str, Any] | None:
    block = cfg.get(name) if hasattr(cfg, "get") else None
    if block is None or not hasattr(block, "keys"):
        return None
    for server_type in SERVER_TYPES:
        if server_type in block:
            impls = block[server_type]
            impl = next(iter(impls.keys()))
            return server_type, str(impl), impls[impl]
    return None


# One aiohttp session per process and event loop (aiohttp sessions are bound to the loop that made
# them). Keyed by the loop object itself, not ``id(loop)``: an id can be reused by a later loop.
_SESSIONS: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

# Failures to *reach* a server: nothing was processed, so trying again is safe.
_RETRYABLE_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError)
MAX_BACKOFF_S = 2.0


def _shared_session(max_connections: int) -> aiohttp.ClientSession:
    """The process-wide aiohttp session for the running loop (created on first use)."""
    loop = asyncio.get_running_loop()
    session = _SESSIONS.get(loop)
    if session is None or session.closed:
        # Forget sessions of loops that are gone (each test of an async test suite has its own loop).
        for old_loop in [lp for lp in _SESSIONS if lp.is_closed()]:
            del _SESSIONS[old_loop]
        connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, keepalive_timeout=30, ttl_dns_cache=None)
        session = aiohttp.ClientSession(
            connector=connector,
            # Never store cookies: a rollout's session cookies are passed explicitly on each call, so
            # two rollouts sharing this client can never see each other's sessions.
            cookie_jar=aiohttp.DummyCookieJar(),
            json_serialize=lambda o: orjson.dumps(o).decode(),
            timeout=aiohttp.ClientTimeout(total=DEFAULT_REQUEST_TIMEOUT_S, sock_connect=10),
            trust_env=False,
        )
        _SESSIONS[loop] = session
    return session


async def close_shared_session() -> None:
    """Close this loop's shared client session (call before the loop ends to avoid warnings)."""
    session = _SESSIONS.pop(asyncio.get_running_loop(), None)
    if session is not None and not session.closed:
        await session.close()


class ServerClient:
    """Calls other servers by instance name: ``await client.post(server_name=..., url_path=..., json=...)``.

    Every request has a timeout (``timeout_s``, for the whole request: connect, send, and reading the
    body). Failures to reach the server (connection refused, the server closed the connection before
    answering) are retried ``max_retries`` times with exponential backoff starting at ``backoff_s``
    (capped at 2 s); they then raise :class:`UpstreamError` with kind ``connection_error``. A timeout
    raises kind ``timeout``. HTTP error statuses are returned as they are, never retried.
    """

    def __init__(
        self,
        global_config_dict: DictConfig | dict | None = None,
        head_server_config: BaseServerConfig | None = None,
        timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        max_retries: int = 4,
        backoff_s: float = 0.1,
        max_connections: int = 1024,
    ):
        if timeout_s is None or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries!r}")
        self._cfg = global_config_dict
        self.head_server_config = head_server_config
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_connections = max_connections
        self._urls: dict[str, str] = {}

    # -- construction helpers ------------------------------------------------------------------
    @classmethod
    def load_from_global_config(cls, head_server_config: BaseServerConfig | None = None, **kwargs) -> ServerClient:
        """For processes outside ``ng_run`` (trainers, the collector): ask the head server for the config."""
        import httpx
        import yaml

        head = head_server_config or BaseServerConfig(host=DEFAULT_HEAD_SERVER_HOST, port=DEFAULT_HEAD_SERVER_PORT)
        try:
            r = httpx.get(f"{head.base_url}/global_config_dict_yaml", timeout=10, trust_env=False)
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise ConnectionError(
                f"Cannot reach the NeMo Gym head server at {head.base_url} ({e}). Is `ng_run` running? "
                f"Pass the head server's host/port if it is not {DEFAULT_HEAD_SERVER_HOST}:{DEFAULT_HEAD_SERVER_PORT}."
            ) from None
        return cls(global_config_dict=OmegaConf.create(yaml.safe_load(r.text)), head_server_config=head, **kwargs)

    @property
    def global_config_dict(self) -> DictConfig:
        if self._cfg is None:
            self._cfg = get_global_config_dict()
        return self._cfg

    def base_url(self, server_name: str) -> str:
        url = self._urls.get(server_name)
        if url is None:
            found = _find_instance_block(self.global_config_dict, server_name)
            if found is None:
                known = [k for k in self.global_config_dict.keys() if _find_instance_block(self.global_config_dict, k)]
                raise KeyError(f"No server instance named {server_name!r}. Known instances: {known}")
            block = found[2]
            if block.get("port") is None:
                raise KeyError(f"Server instance {server_name!r} has no port assigned (is it running under ng_run?)")
            url = f"http://{block.get('host') or '127.0.0.1'}:{block['port']}"
            self._urls[server_name] = url
        return url

    # -- transport -------------------------------------------------------------------------------
    def _session(self) -> aiohttp.ClientSession:
        return _shared_session(self.max_connections)

    async def request(
        self,
        method: str,
        server_name: str,
        url_path: str,
        json: Any = None,
        cookies: dict[str, str] | None = None,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> aiohttp.ClientResponse:
        """Send one request; the body is already read when this returns (``await resp.json()`` works).

        ``cookies`` are sent as given (the client keeps none). Raises :class:`UpstreamError` when the
        server cannot be reached or does not answer in time; an HTTP error status is returned.
        """
        url = self.base_url(server_name) + url_path
        headers = dict(kwargs.pop("headers", None) or {})
        if cookies:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in cookies.items())
        data = kwargs.pop("data", None)
        if json is not None:
            data = orjson.dumps(json, default=_json_default)
            headers["Content-Type"] = "application/json"
        limit_s = timeout_s or self.timeout_s
        # ``total`` bounds the whole exchange (a server that trickles bytes cannot hold us forever).
        timeout = aiohttp.ClientTimeout(total=limit_s, sock_connect=min(10.0, limit_s))
        session = self._session()
        attempt = 0
        while True:
            try:
                async with session.request(method, url, data=data, headers=headers, timeout=timeout, **kwargs) as resp:
                    await resp.read()
                    return resp
            except _RETRYABLE_ERRORS as e:
                attempt += 1
                if attempt > self.max_retries:
                    raise UpstreamError(
                        server_name,
                        url_path,
                        None,
                        f"{type(e).__name__}: {e} (gave up after {attempt} attempts)",
                        kind="connection_error",
                    ) from e
                delay = min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)
                logger.warning(
                    "Cannot reach %s at %s (%s); retry %d/%d in %.2f s",
                    server_name, url, type(e).__name__, attempt, self.max_retries, delay,
                )
                await asyncio.sleep(delay)
            except TimeoutError as e:
                raise UpstreamError(server_name, url_path, None, f"no response within {limit_s} s", kind="timeout") from e
            except aiohttp.ClientError as e:
                # E.g. the connection broke while the body was being read: not safe to resend.
                raise UpstreamError(server_name, url_path, None, f"{type(e).__name__}: {e}", kind="connection_error") from e

    async def post(self, server_name: str, url_path: str, json: Any = None, **kwargs: Any) -> aiohttp.ClientResponse:
        return await self.request("POST", server_name, url_path, json=json, **kwargs)

    async def get(self, server_name: str, url_path: str, **kwargs: Any) -> aiohttp.ClientResponse:
        return await self.request("GET", server_name, url_path, **kwargs)

    async def post_json(self, server_name: str, url_path: str, json: Any = None, **kwargs: Any) -> tuple[Any, dict[str, str]]:
        """POST and return (parsed body, cookies set); a non-2xx raises :class:`UpstreamError`."""
        resp = await self.post(server_name, url_path, json=json, **kwargs)
        raise_for_status(resp, server_name, url_path)
        body = response_body(resp)
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise UpstreamError(
                server_name, url_path, resp.status, f"response is not JSON ({e}): {body[:500]!r}", kind="bad_response"
            ) from None
        return parsed, response_cookies(resp)


def _json_default(o: Any) -> Any:
    if isinstance(o, BaseModel):
        return o.model_dump(mode="json", exclude_unset=True)
    if isinstance(o, (DictConfig,)):
        return OmegaConf.to_container(o, resolve=True)
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


def response_cookies(resp: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: m.value for k, m in resp.cookies.items()}


def raise_for_status(resp: aiohttp.ClientResponse, server_name: str, url_path: str) -> None:
    if resp.status < 400:
        return
    body = response_body(resp)
    try:
        detail: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        detail = body.decode(errors="replace")[:2000]
    raise UpstreamError(server_name, url_path, resp.status, detail, kind="http_error")


def response_body(resp: aiohttp.ClientResponse) -> bytes:
    """The body of a response returned by :class:`ServerClient` (already read; the connection is released)."""
    return resp._body or b""


async def get_response_json(resp: aiohttp.ClientResponse) -> Any:
    return orjson.loads(response_body(resp))


# ------------------------------------------------------------------------------------------------
# Sessions: a signed cookie per server instance carrying a per-rollout session id.


_PROCESS_SECRET: bytes | None = None


def _session_secret() -> bytes:
    """The cookie-signing secret: ``NEMO_GYM_SESSION_SECRET`` (``ng_run`` sets a random one per run),
    else a random secret made once per process (never a constant)."""
    global _PROCESS_SECRET
    secret = os.environ.get(NEMO_GYM_SESSION_SECRET_ENV_VAR_NAME)
    if secret:
        return secret.encode()
    if _PROCESS_SECRET is None:
        _PROCESS_SECRET = os.urandom(32)
    return _PROCESS_SECRET


def cookie_name_for(instance_name: str) -> str:
    return "ng_session_" + re.sub(r"[^A-Za-z0-9_]", "_", instance_name or "server")


class SessionMiddleware:
    """Pure ASGI middleware: sets ``request.state.session_id``, minting and signing a new one if needed."""

    def __init__(self, app: Any, cookie_name: str, secret: bytes):
        self.app = app
        self.cookie_name = cookie_name.encode()
        self.secret = secret

    def _sign(self, sid: str) -> str:
        digest = hmac.new(self.secret, sid.encode(), hashlib.sha256).digest()[:18]
        return base64.urlsafe_b64encode(digest).decode()

    def _verify(self, value: str) -> str | None:
        sid, _, sig = value.partition(".")
        if sid and sig and hmac.compare_digest(sig, self._sign(sid)):
            return sid
        return None

    def _from_headers(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        prefix = self.cookie_name + b"="
        for k, v in headers:
            if k != b"cookie":
                continue
            for part in v.split(b";"):
                part = part.strip()
                if part.startswith(prefix):
                    return self._verify(part[len(prefix) :].decode(errors="replace"))
        return None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sid = self._from_headers(scope["headers"])
        state = scope.setdefault("state", {})
        if sid is not None:
            state[SESSION_ID_KEY] = sid
            await self.app(scope, receive, send)
            return
        sid = uuid.uuid4().hex
        state[SESSION_ID_KEY] = sid
        cookie = self.cookie_name + b"=" + f"{sid}.{self._sign(sid)}".encode() + b"; Path=/; HttpOnly; SameSite=Lax"

        async def send_with_cookie(message: dict) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"set-cookie", cookie)]
            await send(message)

        await self.app(scope, receive, send_with_cookie)


class InternalErrorMiddleware:
    """Pure ASGI middleware: an unhandled exception becomes a JSON 500 naming the server, the path and
    the error, and the connection stays usable. Logged with its traceback."""

    def __init__(self, app: Any, server_name: str):
        self.app = app
        self.server_name = server_name

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except Exception as exc:
            if started:  # too late for an error response; let the server close the connection
                raise
            path = scope.get("path", "")
            logger.exception("Unhandled error in %s %s", self.server_name, path)
            body = orjson.dumps(
                {
                    "error": {
                        "kind": "internal_error",
                        "server": self.server_name,
                        "path": path,
                        "type": type(exc).__name__,
                        "message": str(exc),
                    }
                }
            )
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 500, "headers": headers})
            await send({"type": "http.response.body", "body": body})


def get_session_id(request: Request) -> str:
    return request.state.session_id


# ------------------------------------------------------------------------------------------------
# The server base.


def _validation_message(errors: list[dict[str, Any]]) -> str:
    parts = []
    for err in errors[:20]:
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}")
    return "; ".join(parts)


class BaseServer(BaseModel):
    """A server: its validated config plus a client for calling the others."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    config: BaseRunServerInstanceConfig
    server_client: ServerClient

    # Subclasses that keep per-rollout state set this so the session cookie is issued.
    uses_sessions: ClassVar[bool] = True

    def setup_webserver(self) -> FastAPI:
        app = FastAPI(title=f"{self.config.name} ({type(self).__name__})", docs_url="/docs", redoc_url=None)
        name = self.config.name

        @app.get("/")
        async def health() -> dict[str, str]:
            return {"status": "ok", "name": name}

        @app.exception_handler(UpstreamError)
        async def upstream_error(request: Request, exc: UpstreamError) -> Response:
            body = {"error": {"kind": "upstream_error", "server": name, "path": request.url.path, "inner": exc.to_dict()}}
            return Response(orjson.dumps(body), status_code=502, media_type="application/json")

        @app.exception_handler(RequestValidationError)
        async def validation_error(request: Request, exc: RequestValidationError) -> Response:
            errors = _jsonable_errors(exc.errors())
            body = {
                "detail": errors,
                "error": {
                    "kind": "validation_error",
                    "server": name,
                    "path": request.url.path,
                    "message": _validation_message(errors),
                },
            }
            return Response(orjson.dumps(body), status_code=422, media_type="application/json")

        # Unhandled exceptions: answered by a middleware rather than ``exception_handler(Exception)``.
        # Starlette re-raises after such a handler, and uvicorn then closes the keep-alive connection,
        # so the caller's next request on that pooled connection would fail with a reset.
        app.add_middleware(InternalErrorMiddleware, server_name=name)
        if self.uses_sessions:
            app.add_middleware(SessionMiddleware, cookie_name=cookie_name_for(name), secret=_session_secret())
        return app

    # -- start-up ------------------------------------------------------------------------------------
    @classmethod
    def config_class(cls) -> type[BaseRunServerInstanceConfig]:
        return cls.model_fields["config"].annotation  # type: ignore[return-value]

    @classmethod
    def load_instance_config(cls, instance_name: str | None = None) -> BaseRunServerInstanceConfig:
        """Validate this instance's impl block from the global config into the server's config class."""
        cfg = get_global_config_dict()
        name = instance_name or os.environ.get(NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME) or _guess_instance_name(cls, cfg)
        found = _find_instance_block(cfg, name)
        if found is None:
            raise SystemExit(f"[nemo_gym] No server instance named {name!r} in the config.")
        server_type, impl, block = found
        data = OmegaConf.to_container(block, resolve=True)
        data["name"] = name
        try:
            return cls.config_class().model_validate(data)
        except ValidationError as e:
            lines = [f"[nemo_gym] Invalid config for server instance '{name}' ({server_type}/{impl}):"]
            for err in e.errors():
                loc = ".".join(str(x) for x in err["loc"])
                lines.append(f"  {name}.{server_type}.{impl}.{loc}: {err['msg']}")
            raise SystemExit("\n".join(lines)) from None

    @classmethod
    def run_webserver(cls) -> None:
        """Start this server: validate its config, build the app, serve until told to stop."""
        import uvicorn

        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        _die_with_parent()
        config = cls.load_instance_config()
        server = cls(config=config, server_client=ServerClient())
        app = server.setup_webserver()
        fd = os.environ.get(NEMO_GYM_LISTEN_FD_ENV_VAR_NAME)
        uv_config = uvicorn.Config(
            app,
            host=config.host,
            port=config.port or 0,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=60,
            timeout_graceful_shutdown=3,
            backlog=4096,
            lifespan="on",
        )
        uv_server = uvicorn.Server(uv_config)
        if fd is not None:
            sock = socket.socket(fileno=int(fd))
            uv_server.run(sockets=[sock])
        else:
            uv_server.run()


def _jsonable_errors(errors: Any) -> list[dict[str, Any]]:
    out = []
    for e in errors:
        d = {k: v for k, v in e.items() if k in ("loc", "msg", "type")}
        if "input" in e:
            try:
                orjson.dumps(e["input"])
                d["input"] = e["input"]
            except TypeError:
                d["input"] = repr(e["input"])[:200]
        d["loc"] = list(d.get("loc", ()))
        out.append(d)
    return out


def _guess_instance_name(cls: type, cfg: DictConfig) -> str:
    """Outside ng_run: the one instance whose impl folder is the folder of the running app.py."""
    folder = Path(sys.modules[cls.__module__].__file__ or sys.argv[0]).resolve().parent
    candidates = []
    for key in cfg.keys():
        found = _find_instance_block(cfg, str(key))
        if found and found[1] == folder.name and found[0] == folder.parent.name:
            candidates.append(str(key))
    if len(candidates) == 1:
        return candidates[0]
    raise SystemExit(
        f"[nemo_gym] Cannot tell which server instance to run for {folder} (candidates: {candidates}). "
        f"Start it through ng_run, or set {NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME}=<instance name>."
    )


def _die_with_parent() -> None:
    """Make this process exit when the launcher dies, however it dies (even SIGKILL)."""
    parent = os.environ.get(NEMO_GYM_PARENT_PID_ENV_VAR_NAME)
    if not parent:
        return
    parent_pid = int(parent)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        import time

        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def head_server_config_from(cfg: DictConfig | dict) -> BaseServerConfig:
    head = cfg.get(HEAD_SERVER_KEY_NAME) or {}
    return BaseServerConfig(host=head.get("host", DEFAULT_HEAD_SERVER_HOST), port=head.get("port", DEFAULT_HEAD_SERVER_PORT))
