"""The request-path half of the metrics: the meter that counts every answer of a server.

Contract
--------
* :class:`RequestMeter` is told of each HTTP request twice: when it arrives (:meth:`RequestMeter.begin`) and
  when its answer ended (:meth:`RequestMeter.end`). The servers of ours call it from their one ASGI layer
  (:class:`nemo_gym.server.asgi.ServerLayer`, which already sees every answer's status and holds its
  error body); an app without that layer (the head server) wraps itself in :class:`MetricsMiddleware`.
* Every HTTP request is counted once by method, route template and status, its time observed from
  arrival to the end of its answer, and the requests in flight kept; refused ones (401, 413) too.
* The route label is the path template of the route that serves the path (``/verify``,
  ``/items/{item_id}``, ``/mcp`` for a mount), found by one dict lookup for a static path; a path no route
  serves is ``unmatched``; a ``/ng-rollout/<id>/<path>`` is labelled as ``<path>``. The table is built
  from the app's routes at the first request (routes are added after the middleware) and again when the
  number of routes changed.
* An error answer (status >= 400) also counts under its error envelope's ``kind`` (only the kinds this
  project sends; any other is ``other``, an answer without an envelope ``no_envelope``), read from the body
  as it passes through (kept up to :data:`nemo_gym.server.asgi.exchange.MAX_KEPT_BODY_BYTES`). An exception escaping the app counts as 500
  ``internal_error`` (499 ``cancelled`` when the request was cancelled before any answer) and propagates.
* Per server kind, on its own routes (other routes pay nothing more): resources servers count tool calls
  by registered tool (every ``POST`` route besides the base ones), time ``/verify`` and count open
  sessions (a session id from a successful ``/seed_session`` until its ``/verify``: the id the layer read
  from the request's cookie or made for it); model servers
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

from nemo_gym.server.asgi.exchange import Exchange
from nemo_gym.server.metrics.loop_lag import LoopLagMonitor
from nemo_gym.server.metrics.registry import (
    AGENTS,
    CONTENT_TYPE,
    KNOWN_ERROR_KINDS,
    KNOWN_METHODS,
    METRICS_PATH,
    MODELS,
    RESOURCES,
    UNMATCHED_ROUTE,
    ServerMetrics,
)
from nemo_gym.server.rollout_prefix import split_rollout_prefix

# Set (true) on a model route's endpoint that counts its answer's tokens itself.
USAGE_OBSERVED_ATTR = "nemo_gym_observes_usage"
MODEL_ENDPOINTS = frozenset({"/v1/responses", "/v1/chat/completions", "/v1/completions", "/v1/messages"})
# Routes of the resources-server base (and of every server): not tools.
NOT_TOOLS = frozenset(
    {"/seed_session", "/verify", "/aggregate_metrics", "/ng_model_calls/pop", "/metrics", "/"}
)

# What the special routes of a kind do once answered: (metrics, status, session id, body, elapsed).
Finish = Callable[[ServerMetrics, int, str | None, bytes | None, float], None]


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


class RequestMeter:
    """Counts a server's requests into its :class:`ServerMetrics` (see the module docstring). ``router``: the
    app's router (its routes are read at the first request, and again when their number changed); ``lag``:
    started at the first request if the app's lifespan did not start it."""

    def __init__(
        self,
        metrics: ServerMetrics,
        router: Any,
        lag: LoopLagMonitor | None = None,
        answers_metrics: bool = False,
    ) -> None:
        self.metrics = metrics
        self.router = router
        self.lag = lag
        self.answers_metrics = answers_metrics
        # The route the caller answers with answer_metrics (never a route of the app's router), or None.
        self.own_route = METRICS_PATH if answers_metrics else None
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
        if self.answers_metrics:
            static[METRICS_PATH] = METRICS_PATH
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
            if "/seed_session" in paths:

                def seeded(m: ServerMetrics, status: int, session: str | None, _b: Any, _e: float) -> None:
                    if session is not None and status < 400:
                        m.session_opened(session)

                special["/seed_session"] = _Special(seeded)
            if "/verify" in paths:

                def verified(m: ServerMetrics, _s: int, session: str | None, _b: Any, elapsed: float) -> None:
                    m.verify_latency.observe(elapsed)
                    if session is not None:
                        m.session_closed(session)

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
    def begin(self, path: str) -> tuple[str, _Special | None, Exchange]:
        """A request for ``path`` arrived: its route template, what its route measures besides, and the
        :class:`Exchange` to fill in while serving it (hand all three to :meth:`end`)."""
        lag = self.lag
        if lag is not None and lag.task is None:
            lag.start()
        if len(self.router.routes) != self._n_routes:
            self._build()
        route = self._static.get(path) or self.route_of(path)
        special = self._special.get(route)
        if special is None:
            exchange = Exchange(False)
        else:
            exchange = Exchange(special.wants_body)
            if special.on_start is not None:
                special.on_start()
        self.metrics.in_flight += 1
        return route, special, exchange

    def end(
        self, method: str, route: str, special: _Special | None, exchange: Exchange, elapsed: float
    ) -> None:
        """The answer to a request :meth:`begin` counted ended (or the app raised: ``exchange.kind``)."""
        metrics = self.metrics
        metrics.in_flight -= 1
        status = exchange.status
        if status == 0:  # no answer started: the app raised or was cancelled
            status = 499 if exchange.kind == "cancelled" else 500
        if method not in KNOWN_METHODS:
            method = "other"
        metrics.observe_request(method, route, status, elapsed)
        if status >= 400:
            metrics.observe_error(route, exchange.kind or error_kind(exchange.body))
        if special is not None:
            special.finish(metrics, status, exchange.session, exchange.body, elapsed)

    async def answer_metrics(self, scope: dict, send: Any, exchange: Exchange) -> None:
        """Answer a request for ``/metrics`` (for a caller with ``answers_metrics``): the Prometheus text
        format to ``GET`` (and ``HEAD``), 405 to any other method."""
        if scope["method"] in ("GET", "HEAD"):
            status, body = 200, self.metrics.exposition()
            headers = [(b"content-type", CONTENT_TYPE.encode())]
        else:
            status, body = 405, orjson.dumps({"detail": "Method Not Allowed"})
            headers = [(b"content-type", b"application/json"), (b"allow", b"GET")]
        headers.append((b"content-length", str(len(body)).encode()))
        exchange.started(status)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})
        exchange.body_part({"body": body})


class MetricsMiddleware:
    """Pure ASGI middleware metering an app that is not served through :class:`nemo_gym.server.asgi.ServerLayer`
    (the head server): the same counts, with a ``send`` wrapper of its own to see the answers."""

    def __init__(self, app: Any, meter: RequestMeter) -> None:
        self.app = app
        self.meter = meter

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        meter = self.meter
        route, special, exchange = meter.begin(scope["path"])

        async def send_seen(message: dict) -> None:
            if message["type"] == "http.response.start":
                exchange.started(message["status"])
            elif message["type"] == "http.response.body":
                exchange.body_part(message)
            await send(message)

        began = perf_counter()
        try:
            await self.app(scope, receive, send_seen)
        except asyncio.CancelledError:
            exchange.kind = "cancelled"
            raise
        except BaseException:
            exchange.kind = "internal_error"
            raise
        finally:
            meter.end(scope["method"], route, special, exchange, perf_counter() - began)
