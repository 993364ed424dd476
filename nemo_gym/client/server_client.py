"""The HTTP client for server-to-server calls (and for the collector, trainers and benchmarks).

Contract
--------
:class:`ServerClient` is the one client for calls between our processes. It keeps one pool of
keep-alive connections (:mod:`nemo_gym.client.http_transport`) per process and event loop, never stores cookies (callers pass them explicitly), puts a
timeout on every request, retries only failures to *reach* a server (bounded exponential backoff)
and never retries an HTTP error status. Failures surface as
:class:`~nemo_gym.errors.UpstreamError` naming the server, the path and the inner error (the
error, :func:`raise_for_status` and :func:`response_body` are defined in :mod:`nemo_gym.errors`
and re-exported here). This module imports no web framework, so command-line tools that only call
servers start quickly.

:func:`live_replicas` probes which replicas of an instance answer now (the collector's circuit
breaker asks it before it calls a replicated server down: one dead replica is not a dead server).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any
from urllib.parse import urlencode

import orjson
from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel

from nemo_gym.auth import TRAINER_TOKEN_HEADER_NAME, auth_headers, client_token, trainer_token
from nemo_gym.client import tracing as client_tracing
from nemo_gym.client.fd_limits import client_socket_budget
from nemo_gym.client.http_transport import (
    ConnectFailed,
    DisconnectedBeforeResponse,
    HttpTransport,
    RawResponse,
    ResponseTimeout,
    TransportError,
)
from nemo_gym.client.replicas import ReplicaSet, replica_set_from_block
from nemo_gym.client.tracing import end_client_span, start_client_span
from nemo_gym.config.keys import (
    DEFAULT_HEAD_SERVER_HOST,
    DEFAULT_HEAD_SERVER_PORT,
    HEAD_SERVER_KEY_NAME,
    SERVER_TYPES,
)
from nemo_gym.config.process import (
    client_connection_limits,
    current_global_config_dict,
    get_global_config_dict,
)
from nemo_gym.config.types import POLICY_VERSION_PATH, BaseServerConfig
from nemo_gym.errors import UpstreamError as UpstreamError
from nemo_gym.errors import raise_for_status as raise_for_status
from nemo_gym.errors import response_body as response_body

logger = logging.getLogger("nemo_gym")

DEFAULT_REQUEST_TIMEOUT_S = 600.0


# ------------------------------------------------------------------------------------------------
# The HTTP client.


def find_instance_block(cfg: DictConfig | dict, name: str) -> tuple[str, str, Any] | None:
    block = cfg.get(name) if hasattr(cfg, "get") else None
    if block is None or not hasattr(block, "keys"):
        return None
    for server_type in SERVER_TYPES:
        if server_type in block:
            impls = block[server_type]
            impl = next(iter(impls.keys()))
            return server_type, str(impl), impls[impl]
    return None


# One connection pool per process and event loop (connections belong to the loop that opened them).
# Keyed by the loop object itself, not ``id(loop)``: an id can be reused by a later loop.
_SESSIONS: dict[asyncio.AbstractEventLoop, HttpTransport] = {}

# Failures to *reach* a server: nothing was processed, so trying again is safe.
_RETRYABLE_ERRORS: tuple[type[BaseException], ...] = (ConnectFailed, DisconnectedBeforeResponse)
MAX_BACKOFF_S = 2.0

# "Cannot reach" warnings are rate-limited per server: a dead server costs a few lines, not one per retry.
RETRY_WARNING_BURST = 5
RETRY_WARNING_WINDOW_S = 10.0


class _RetryWarnings:
    """Per server address, the first ``RETRY_WARNING_BURST`` retry warnings of each
    ``RETRY_WARNING_WINDOW_S`` window are logged; the rest are only counted, and the count is logged
    with the next line."""

    def __init__(self) -> None:
        # (server, host, port) -> [window start, lines logged, suppressed]
        self._state: dict[tuple[str, str, int], list[float]] = {}

    def warn(self, server: str, host: str, port: int, message: str, *args: Any) -> None:
        now = time.monotonic()
        key = (server, host, port)
        state = self._state.get(key)
        if state is None or now - state[0] >= RETRY_WARNING_WINDOW_S:
            state = self._state[key] = [now, 0, state[2] if state else 0]
        if state[1] >= RETRY_WARNING_BURST:
            state[2] += 1
            return
        state[1] += 1
        suppressed, state[2] = int(state[2]), 0
        if suppressed:
            message += " (%d more retry warning(s) for %s were not shown)"
            args = (*args, suppressed, server)
        logger.warning(message, *args)


_retry_warnings = _RetryWarnings()


def _shared_session(max_connections: int, max_connections_per_host: int | None = None) -> HttpTransport:
    """The process-wide connection pool for the running loop (created on first use, with the limits
    of the client that first needs it).

    At most ``max_connections`` requests are in flight and at most the open-file budget left
    (:func:`nemo_gym.client.fd_limits.client_socket_budget`) of sockets are open: requests beyond either
    queue for a connection. Sockets may outnumber busy requests (idle keep-alive connections to
    several servers), so the socket cap is the budget itself, never the request cap.
    """
    loop = asyncio.get_running_loop()
    session = _SESSIONS.get(loop)
    if session is None or session.closed:
        # Forget pools of loops that are gone (each test of an async test suite has its own loop).
        for old_loop in [lp for lp in _SESSIONS if lp.is_closed()]:
            del _SESSIONS[old_loop]
        budget = client_socket_budget()
        if budget < max_connections:
            logger.info("connection pool: %d sockets (open-file budget; %d asked)", budget, max_connections)
        session = HttpTransport(
            max_connections=min(max_connections, budget),
            max_connections_per_host=max_connections_per_host,
            max_sockets=budget,
        )
        _SESSIONS[loop] = session
    return session


async def close_shared_session() -> None:
    """Close this loop's shared connection pool (call before the loop ends)."""
    session = _SESSIONS.pop(asyncio.get_running_loop(), None)
    if session is not None and not session.closed:
        await session.close()


class ServerClient:
    """Calls other servers by instance name: ``await client.post(server_name=..., url_path=..., json=...)``.

    Every request has a timeout (``timeout_s``, for the whole request: connect, send, and reading the
    body). Failures to reach the server (connection refused, the server closed the connection before
    answering) are retried ``max_retries`` times with exponential backoff starting at ``backoff_s``
    (capped at 2 s); they then raise :class:`UpstreamError` with kind ``connection_error``. A timeout
    raises kind ``timeout``. HTTP error statuses are returned as they are, never retried. Retry
    warnings are rate-limited per server (a few per window, then a count of those not shown).

    Every request carries the run token (:mod:`nemo_gym.auth`): ``auth_token`` when given, else the
    one :func:`nemo_gym.auth.client_token` finds for the head server's port.

    The connection pool's limits are ``max_connections`` / ``max_connections_per_host`` when given,
    else the config's ``global_aiohttp_connector_limit`` / ``global_aiohttp_connector_limit_per_host``
    (:func:`nemo_gym.config.process.client_connection_limits`; default 1024 in total, no per-host cap).
    """

    def __init__(
        self,
        global_config_dict: DictConfig | dict | None = None,
        head_server_config: BaseServerConfig | None = None,
        timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        max_retries: int = 4,
        backoff_s: float = 0.1,
        max_connections: int | None = None,
        auth_token: str | None = None,
        max_connections_per_host: int | None = None,
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
        self.max_connections_per_host = max_connections_per_host
        self._limits: tuple[int, int | None] | None = None
        self._urls: dict[str, str] = {}
        # Per instance: (host, port), or its ReplicaSet when it has several replicas (nemo_gym.client.replicas).
        self._host_ports: dict[str, tuple[str, int] | ReplicaSet] = {}
        self._auth_headers: dict[str, str] | None = auth_headers(auth_token) if auth_token else None

    # -- construction helpers ------------------------------------------------------------------
    @classmethod
    def load_from_global_config(
        cls, head_server_config: BaseServerConfig | None = None, **kwargs
    ) -> ServerClient:
        """For processes outside ``ng_run`` (trainers, the collector): ask the head server for the config."""
        import httpx
        import yaml

        head = head_server_config or BaseServerConfig(
            host=DEFAULT_HEAD_SERVER_HOST, port=DEFAULT_HEAD_SERVER_PORT
        )
        token = kwargs.get("auth_token") or client_token(head.port)
        try:
            r = httpx.get(
                f"{head.base_url}/global_config_dict_yaml",
                timeout=10,
                trust_env=False,
                headers=auth_headers(token),
            )
            if r.status_code == 401:
                raise ConnectionError(
                    f"The head server at {head.base_url} refused the request: {_error_message(r.text)}"
                )
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise ConnectionError(
                f"Cannot reach the NeMo Gym head server at {head.base_url} ({e}). Is `ng_run` running? "
                f"Pass the head server's host/port if it is not {DEFAULT_HEAD_SERVER_HOST}:{DEFAULT_HEAD_SERVER_PORT}."
            ) from None
        kwargs["auth_token"] = token
        return cls(
            global_config_dict=OmegaConf.create(yaml.safe_load(r.text)), head_server_config=head, **kwargs
        )

    @property
    def global_config_dict(self) -> DictConfig:
        if self._cfg is None:
            self._cfg = get_global_config_dict()
        return self._cfg

    def base_url(self, server_name: str) -> str:
        url = self._urls.get(server_name)
        if url is None:
            found = find_instance_block(self.global_config_dict, server_name)
            if found is None:
                known = [
                    k
                    for k in self.global_config_dict.keys()
                    if find_instance_block(self.global_config_dict, k)
                ]
                raise KeyError(f"No server instance named {server_name!r}. Known instances: {known}")
            block = found[2]
            if block.get("port") is None:
                raise KeyError(
                    f"Server instance {server_name!r} has no port assigned (is it running under ng_run?)"
                )
            url = f"http://{block.get('host') or '127.0.0.1'}:{block['port']}"
            self._urls[server_name] = url
        return url

    def auth_headers(self) -> dict[str, str]:
        """The headers carrying this client's run token (resolved once, on first use)."""
        if self._auth_headers is None:
            port = self.head_server_config.port if self.head_server_config is not None else None
            if port is None:
                head = self.global_config_dict.get(HEAD_SERVER_KEY_NAME)
                port = head.get("port") if head is not None else None
            self._auth_headers = auth_headers(client_token(port))
        return self._auth_headers

    def _trainer_headers(self) -> dict[str, str]:
        """The trainer credential, when this process has the run's (only ``POST /policy_version`` needs it)."""
        port = self.head_server_config.port if self.head_server_config is not None else None
        if port is None:
            head = self.global_config_dict.get(HEAD_SERVER_KEY_NAME)
            port = head.get("port") if head is not None else None
        token = trainer_token(port)
        return {TRAINER_TOKEN_HEADER_NAME: token} if token else {}

    # -- transport -------------------------------------------------------------------------------
    def _session(self) -> HttpTransport:
        limits = self._limits
        if limits is None:
            cfg = self._cfg if self._cfg is not None else current_global_config_dict()
            total, per_host = client_connection_limits(cfg)
            limits = self._limits = (
                self.max_connections or total,
                self.max_connections_per_host or per_host,
            )
        return _shared_session(*limits)

    def _host_port(self, server_name: str) -> tuple[str, int] | ReplicaSet:
        hp = self._host_ports.get(server_name)
        if hp is None:
            host, _, port = self.base_url(server_name).removeprefix("http://").rpartition(":")
            found = find_instance_block(self.global_config_dict, server_name)
            replicas = replica_set_from_block(server_name, found[2]) if found is not None else None
            hp = self._host_ports[server_name] = replicas or (host, int(port))
        return hp

    async def request(
        self,
        method: str,
        server_name: str,
        url_path: str,
        json: Any = None,
        cookies: Any = None,
        timeout_s: float | None = None,
        timeout_setting: str | None = None,
        **kwargs: Any,
    ) -> RawResponse:
        """Send one request; the body is already read when this returns (``await resp.json()`` works).

        ``cookies`` are sent as given (the client keeps none): a dict of values, or of cookie morsels
        (what ``resp.cookies`` holds). Raises :class:`UpstreamError` when the server cannot be reached
        or does not answer in time; an HTTP error status is returned.
        ``timeout_setting`` names the setting ``timeout_s`` came from, so a timeout error says what to raise.

        Upstream NeMo Gym's call shapes work too: ``request(server_name=..., url_path=..., method=...)``
        in any argument order, and aiohttp's ``timeout=`` (seconds or an object with ``total``),
        ``headers=``, ``params=`` and ``data=``.
        """
        if method not in _HTTP_METHODS and url_path in _HTTP_METHODS:
            # Upstream's positional order: (server_name, url_path, method).
            method, server_name, url_path = url_path, method, server_name
        if "timeout" in kwargs:
            timeout_s = timeout_s or _timeout_seconds(kwargs.pop("timeout"))
        endpoint = self._host_ports.get(server_name) or self._host_port(server_name)
        replicas: ReplicaSet | None = None
        if endpoint.__class__ is tuple:
            host, port = endpoint  # type: ignore[misc]
        else:  # several replicas: the session's own, else the next one (nemo_gym.client.replicas)
            replicas = endpoint  # type: ignore[assignment]
            replica = replicas.sticky_replica(cookies, url_path)
            sticky = replica is not None
            if replica is None:
                replica = replicas.next_index()
            host, port = replicas.endpoints[replica]
        headers = {**self.auth_headers(), **(kwargs.pop("headers", None) or {})}
        if url_path == POLICY_VERSION_PATH and method == "POST":
            headers.update(self._trainer_headers())
        if cookies:
            headers["Cookie"] = "; ".join(f"{k}={getattr(v, 'value', v)}" for k, v in cookies.items())
        data = kwargs.pop("data", None)
        if json is not None:
            data = orjson.dumps(json, default=_json_default)
            headers["Content-Type"] = "application/json"
        elif isinstance(data, str):
            data = data.encode()
        params = kwargs.pop("params", None)
        if kwargs:
            raise TypeError(f"ServerClient.request got unexpected arguments: {sorted(kwargs)}")
        path = url_path + ("?" + urlencode(params) if params else "")
        limit_s = timeout_s or self.timeout_s
        transport = self._session()
        # Traces off (the default): one attribute read is all they cost here (nemo_gym.client.tracing).
        span = (
            None if client_tracing.TRACER is None else start_client_span(method, server_name, path, headers)
        )
        attempt = 0
        try:
            while True:
                try:
                    # The limit bounds each whole attempt: sending, and reading the complete response.
                    resp = await transport.request(method, host, port, path, data, headers, limit_s)
                    resp.server_name, resp.url_path = server_name, url_path
                    if span is not None:
                        end_client_span(span, resp.status, None, (host, port))
                    return resp
                except _RETRYABLE_ERRORS as e:
                    attempt += 1
                    if attempt > self.max_retries:
                        where = f" ({replicas.describe(replica)})" if replicas is not None else ""
                        raise UpstreamError(
                            server_name,
                            url_path,
                            None,
                            f"{type(e).__name__}: {e} (gave up after {attempt} attempts){where}",
                            kind="connection_error",
                        ) from e
                    delay = min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)
                    _retry_warnings.warn(
                        server_name,
                        host,
                        port,
                        "Cannot reach %s at %s:%s%s (%s); retry %d/%d in %.2f s",
                        server_name,
                        host,
                        port,
                        url_path,
                        type(e).__name__,
                        attempt,
                        self.max_retries,
                        delay,
                    )
                    if replicas is not None and not sticky:
                        # Nothing was processed: a new session may go to another replica at once.
                        replicas.mark_down(replica)
                        failed, replica = replica, replicas.next_index(avoid=replica)
                        host, port = replicas.endpoints[replica]
                        if replica != failed:
                            delay = 0.0
                    await asyncio.sleep(delay)
                except ResponseTimeout as e:
                    setting = timeout_setting or "the client's timeout_s"
                    raise UpstreamError(
                        server_name,
                        url_path,
                        None,
                        f"no response within {limit_s:g} s (limit set by {setting})",
                        kind="timeout",
                    ) from e
                except TransportError as e:
                    # E.g. the connection broke while the response was being read: not safe to resend.
                    raise UpstreamError(
                        server_name, url_path, None, f"{type(e).__name__}: {e}", kind="connection_error"
                    ) from e
        except BaseException as e:
            if span is not None:
                end_client_span(span, None, e, (host, port))
            raise

    async def post(self, server_name: str, url_path: str, json: Any = None, **kwargs: Any) -> RawResponse:
        return await self.request("POST", server_name, url_path, json=json, **kwargs)

    async def get(self, server_name: str, url_path: str, **kwargs: Any) -> RawResponse:
        return await self.request("GET", server_name, url_path, **kwargs)

    async def post_json(
        self, server_name: str, url_path: str, json: Any = None, **kwargs: Any
    ) -> tuple[Any, dict[str, str]]:
        """POST and return (parsed body, cookies set); a non-2xx raises :class:`UpstreamError`."""
        resp = await self.post(server_name, url_path, json=json, **kwargs)
        raise_for_status(resp, server_name, url_path)
        body = response_body(resp)
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise UpstreamError(
                server_name,
                url_path,
                resp.status,
                f"response is not JSON ({e}): {body[:500]!r}",
                kind="bad_response",
            ) from None
        return parsed, response_cookies(resp)


REPLICA_PROBE_TIMEOUT_S = 3.0


async def live_replicas(
    client: ServerClient, instance_name: str, timeout_s: float = REPLICA_PROBE_TIMEOUT_S
) -> list[int]:
    """The replicas of ``instance_name`` that answer their liveness route (``GET /``) now, probed at
    once through a copy of ``client`` (its config and run token) without retries, each bounded by
    ``timeout_s``."""
    probe = ServerClient(
        global_config_dict=client.global_config_dict,
        head_server_config=client.head_server_config,
        timeout_s=timeout_s,
        max_retries=0,
    )
    probe._auth_headers = client.auth_headers()
    replicas = probe._host_port(instance_name)
    if not isinstance(replicas, ReplicaSet):
        return [0]
    cookie = replicas.cookie_name

    async def alive(index: int) -> bool:
        try:
            resp = await probe.request("GET", instance_name, "/", cookies={cookie: f"{index}.probe"})
        except Exception:
            return False
        return 200 <= resp.status < 300

    answers = await asyncio.gather(*(alive(i) for i in range(len(replicas))))
    return [i for i, ok in enumerate(answers) if ok]


def _json_default(o: Any) -> Any:
    if isinstance(o, BaseModel):
        return o.model_dump(mode="json", exclude_unset=True)
    if isinstance(o, (DictConfig,)):
        return OmegaConf.to_container(o, resolve=True)
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


def _error_message(text: str) -> str:
    """The ``error.message`` of one of our JSON error bodies, else the text itself (shortened)."""
    try:
        return str(orjson.loads(text)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return text[:500]


def response_cookies(resp: RawResponse) -> dict[str, str]:
    """``{name: value}`` of the cookies a response sets."""
    if isinstance(resp, RawResponse):
        return resp.cookie_values()
    return {k: getattr(m, "value", m) for k, m in resp.cookies.items()}


async def get_response_json(resp: Any) -> Any:
    """The parsed JSON body of a response (ours, aiohttp's, or anything with an async ``read()``)."""
    if isinstance(resp, RawResponse):
        return orjson.loads(response_body(resp))
    return orjson.loads(await resp.read())


_HTTP_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


def _timeout_seconds(timeout: Any) -> float | None:
    """Seconds from aiohttp's ``timeout=`` (a number, or an object with ``total``); None keeps the default."""
    if timeout is None:
        return None
    if isinstance(timeout, (int, float)):
        return float(timeout) if timeout > 0 else None
    total = getattr(timeout, "total", None)
    return float(total) if isinstance(total, (int, float)) and total > 0 else None
