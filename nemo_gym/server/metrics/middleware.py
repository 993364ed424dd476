"""The request-path half of the metrics: one pure-ASGI layer, outermost, counting every answer.

Contract
--------
* Every HTTP request is counted once by method, route template and status, its time observed from
  arrival to the end of its answer, and the requests in flight kept; refused ones (401, 413) too.
* The route label is the path template of the route that serves the path (``/verify``,
  ``/items/{item_id}``, ``/mcp`` for a mount), found by one dict lookup for a static path; a path no route
  serves is ``unmatched``; a ``/ng-rollout/<id>/<path>`` is labelled as ``<path>``. The table is built
  from the app's routes at the first request (routes are added after the middleware) and again when the
  number of routes changed.
* An error answer (status >= 400) also counts under its error envelope's ``kind`` (only the kinds this
  project sends; any other is ``other``, an answer without an envelope ``no_envelope``), read from the body
  as it passes through (kept up to 1 MiB). An exception escaping the app counts as 500
  ``internal_error`` (499 ``cancelled`` when the request was cancelled before any answer) and propagates.
* Per server kind, on its own routes (other routes pay nothing more): resources servers count tool calls
  by registered tool (every ``POST`` route besides the base ones), time ``/verify`` and count open
  sessions (a session cookie from a successful ``/seed_session`` until its ``/verify``); model servers
  count calls, their time and the prompt/completion tokens of the answer's ``usage``: read from what the
  handler returned when the base class registered it (:func:`nemo_gym.server.metrics.install.observed_model_call`),
  else found from the end of the answer's body (a route a subclass added itself); agents count rollouts
  (``/run``) started, finished and failed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from time import perf_counter
from typing import Any

import orjson

from nemo_gym.server.metrics.loop_lag import LoopLagMonitor
from nemo_gym.server.metrics.registry import (
    AGENTS,
    KNOWN_ERROR_KINDS,
    KNOWN_METHODS,
    MODELS,
    RESOURCES,
    UNMATCHED_ROUTE,
    ServerMetrics,
)
from nemo_gym.server.rollout_prefix import split_rollout_prefix

MAX_KEPT_BODY_BYTES = 1 << 20
# Set (true) on a model route's endpoint that counts its answer's tokens itself.
USAGE_OBSERVED_ATTR = "nemo_gym_observes_usage"
MODEL_ENDPOINTS = frozenset({"/v1/responses", "/v1/chat/completions", "/v1/completions", "/v1/messages"})
# Routes of the resources-server base (and of every server): not tools.
NOT_TOOLS = frozenset(
    {"/seed_session", "/verify", "/aggregate_metrics", "/ng_model_calls/pop", "/metrics", "/"}
)

# What the special routes of a kind do once answered: (metrics, status, start message, body, elapsed).
Finish = Callable[[ServerMetrics, int, dict | None, bytes | None, float], None]


class _Special:
    """What a route of a server's kind measures besides the common metrics."""

    __slots__ = ("wants_body", "on_start", "finish")

    def __init__(self, finish: Finish, wants_body: bool = False, on_start: Callable[[], None] | None = None):
        self.finish = finish
        self.wants_body = wants_body
        self.on_start = on_start


def error_kind(body: bytes | None) -> str:
    """The error envelope's ``kind`` of an error answer's body, bounded to the known kinds."""
    if not body:
        return "no_envelope"
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return "no_envelope"
    error = parsed.get("error") if isinstance(parsed, dict) else None
    kind = error.get("kind") if isinstance(error, dict) else None
    if kind is None:
        return "no_envelope"
    return kind if kind in KNOWN_ERROR_KINDS else "other"


def usage_tokens(body: bytes | None) -> tuple[int, int] | None:
    """(prompt, completion) tokens of the last ``"usage": {...}`` object in a model answer (a JSON body or
    a stream of events), without parsing the rest of the body; None when there is none."""
    if not body:
        return None
    at = body.rfind(b'"usage"')
    if at < 0:
        return None
    start = body.find(b"{", at)
    if start < 0 or body[at + 7 : start].strip(b" :\t\r\n"):
        return None  # "usage": null, or not an object
    # The matching "}" (braces in strings count too, as they always did here): one find per brace rather
    # than a Python loop over every byte.
    limit = min(len(body), start + 4096)
    depth = 0
    at = start
    while True:
        close = body.find(b"}", at, limit)
        if close < 0:
            return None
        open_ = body.find(b"{", at, close)
        if open_ >= 0:
            depth += 1
            at = open_ + 1
            continue
        depth -= 1
        at = close + 1
        if depth == 0:
            break
    try:
        usage = orjson.loads(body[start:at])
    except orjson.JSONDecodeError:
        return None
    if not isinstance(usage, dict):
        return None
    return _token_count(usage, "input_tokens", "prompt_tokens"), _token_count(
        usage, "output_tokens", "completion_tokens"
    )


def usage_of(result: Any) -> tuple[int, int] | None:
    """(prompt, completion) tokens of what a model handler returned: an object or dict with a ``usage``
    (Responses' ``input_tokens``/``output_tokens`` or Chat's ``prompt_tokens``/``completion_tokens``), or a
    ready successful ``Response`` whose body holds one; None when there is none."""
    usage = result.get("usage") if isinstance(result, dict) else getattr(result, "usage", None)
    if usage is None:
        body = getattr(result, "body", None)
        if isinstance(body, bytes) and getattr(result, "status_code", 200) < 400:
            return usage_tokens(body)
        return None
    if not isinstance(usage, dict):
        usage = {
            k: getattr(usage, k, None)
            for k in ("input_tokens", "output_tokens", "prompt_tokens", "completion_tokens")
        }
    return _token_count(usage, "input_tokens", "prompt_tokens"), _token_count(
        usage, "output_tokens", "completion_tokens"
    )


def _token_count(usage: dict, first: str, second: str) -> int:
    """The first of two keys of a usage object holding a count (a non-negative int), else 0."""
    for key in (first, second):
        value = usage.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return 0


def _set_cookie(start: dict | None, prefix: bytes) -> bytes | None:
    """The value of the ``Set-Cookie`` whose name and ``=`` are ``prefix`` in an answer's start."""
    if start is None:
        return None
    for k, v in start.get("headers", ()):
        if k.lower() == b"set-cookie" and v.startswith(prefix):
            return v[len(prefix) :].split(b";", 1)[0]
    return None


class MetricsMiddleware:
    """Pure ASGI middleware (see the module docstring). ``router``: the app's router (its routes are read
    at the first request); ``lag``: started at the first request if the lifespan did not start it."""

    def __init__(
        self, app: Any, metrics: ServerMetrics, router: Any, lag: LoopLagMonitor | None = None,
        session_cookie: str | None = None,
    ) -> None:  # fmt: skip
        self.app = app
        self.metrics = metrics
        self.router = router
        self.lag = lag
        self.cookie_prefix = session_cookie.encode() + b"=" if session_cookie else None
        self._n_routes = -1
        self._static: dict[str, str] = {}
        self._patterns: list[tuple[Any, str]] = []
        self._special: dict[str, _Special] = {}

    # -- the route table ----------------------------------------------------------------------------
    def _build(self) -> None:
        routes = list(self.router.routes)
        static: dict[str, str] = {}
        patterns: list[tuple[Any, str]] = []
        tools: list[str] = []
        observed: set[str] = set()  # model routes whose handler reports its own usage
        for r in routes:
            path = getattr(r, "path", None)
            regex = getattr(r, "path_regex", None)
            if path is None:
                continue
            if (
                "{" in path or getattr(r, "routes", None) is not None or regex is None
            ):  # a parameter or a mount
                if regex is not None:
                    patterns.append((regex, path or "/"))
                    if getattr(r, "routes", None) is not None:
                        static.setdefault(path, path)  # the mount's own path
                continue
            static[path] = path
            if getattr(getattr(r, "endpoint", None), USAGE_OBSERVED_ATTR, False):
                observed.add(path)
            methods = getattr(r, "methods", None) or ()
            if "POST" in methods and path not in NOT_TOOLS and getattr(r, "include_in_schema", True):
                tools.append(path)
        self._static, self._patterns = static, patterns
        self._special = self._specials(set(static), tools, observed)
        self._n_routes = len(routes)

    def _specials(self, paths: set[str], tools: list[str], observed: set[str]) -> dict[str, _Special]:
        kind = self.metrics.kind
        special: dict[str, _Special] = {}
        if kind == RESOURCES:
            for path in tools:
                name = path[1:]
                special[path] = _Special(
                    lambda m, status, _s, _b, _e, name=name: m.observe_tool_call(name, status < 400)
                )
            prefix = self.cookie_prefix
            if "/seed_session" in paths:

                def seeded(m: ServerMetrics, status: int, start: dict | None, _b: Any, _e: float) -> None:
                    cookie = _set_cookie(start, prefix) if prefix is not None and status < 400 else None
                    if cookie is not None:
                        m.session_opened(cookie)

                special["/seed_session"] = _Special(seeded)
            if "/verify" in paths:

                def verified(
                    m: ServerMetrics, _status: int, start: dict | None, _b: Any, elapsed: float
                ) -> None:
                    m.verify_latency.observe(elapsed)
                    cookie = _set_cookie(start, prefix) if prefix is not None else None
                    if cookie is not None:
                        m.session_closed(cookie)

                special["/verify"] = _Special(verified)
        elif kind == MODELS:
            metrics = self.metrics

            def model_call_started() -> None:
                metrics.model_in_flight += 1  # observe_model_call takes it back

            for path in MODEL_ENDPOINTS & paths:
                if path in observed:  # the tokens were counted from the handler's result
                    special[path] = _Special(
                        lambda m, status, _s, _b, elapsed, path=path: m.observe_model_call(
                            path, status < 400, elapsed, None
                        ),
                        on_start=model_call_started,
                    )
                    continue
                special[path] = _Special(
                    lambda m, status, _s, body, elapsed, path=path: m.observe_model_call(
                        path, status < 400, elapsed, usage_tokens(body) if status < 400 else None
                    ),
                    wants_body=True,
                    on_start=model_call_started,
                )
        elif kind == AGENTS and "/run" in paths:
            metrics = self.metrics

            def ran(m: ServerMetrics, status: int, _s: Any, body: bytes | None, _e: float) -> None:
                if status < 400:
                    m.rollouts_finished.inc()
                else:
                    m.rollouts_failed.cell((error_kind(body),))[0] += 1

            special["/run"] = _Special(ran, on_start=metrics.rollouts_started.inc)
        return special

    def route_of(self, path: str) -> str:
        """The route template serving ``path`` (``unmatched`` when none does)."""
        route = self._static.get(path)
        if route is not None:
            return route
        if path.startswith("/ng-rollout/"):
            split = split_rollout_prefix(path)
            if split is not None:
                return self.route_of(split[1])
        for regex, template in self._patterns:
            if regex.match(path):
                return template
        return UNMATCHED_ROUTE

    # -- the request path ---------------------------------------------------------------------------
    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lag = self.lag
        if lag is not None and not lag.started:
            lag.start()
        if len(self.router.routes) != self._n_routes:
            self._build()
        route = self._static.get(scope["path"]) or self.route_of(scope["path"])
        method = scope["method"]
        if method not in KNOWN_METHODS:
            method = "other"
        metrics = self.metrics
        special = self._special.get(route)
        wants_body = special is not None and special.wants_body
        if special is not None and special.on_start is not None:
            special.on_start()
        status = 0
        start_message: dict | None = None
        chunks: list[bytes] | None = None
        kept = 0

        async def send_counted(message: dict) -> None:
            nonlocal status, start_message, chunks, kept
            if message["type"] == "http.response.start":
                status = message["status"]
                start_message = message
                if status >= 400 or wants_body:
                    chunks = []
            elif chunks is not None:
                body = message.get("body")
                if body and kept < MAX_KEPT_BODY_BYTES:
                    chunks.append(body)
                    kept += len(body)
            await send(message)

        metrics.in_flight += 1
        began = perf_counter()
        raised: str | None = None
        try:
            await self.app(scope, receive, send_counted)
        except asyncio.CancelledError:
            raised = "cancelled"
            raise
        except BaseException:
            raised = "internal_error"
            raise
        finally:
            elapsed = perf_counter() - began
            metrics.in_flight -= 1
            if status == 0:  # no answer started: the app raised or was cancelled
                status = 499 if raised == "cancelled" else 500
            metrics.observe_request(method, route, status, elapsed)
            body = b"".join(chunks) if chunks else None
            if status >= 400:
                metrics.observe_error(route, raised or error_kind(body))
            if special is not None:
                special.finish(metrics, status, start_message, body, elapsed)
