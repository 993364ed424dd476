"""The metrics of one server app, in a registry of its own.

Contract
--------
* :class:`ServerMetrics` holds one ``prometheus_client.CollectorRegistry`` per app (never the global
  one) with the metrics every server has and those of its kind (``kind``: a server type such as
  ``resources_servers``, or ``head_server``). Names, types and labels are listed in
  docs/observability.md; every label value is bounded (see :mod:`nemo_gym.server.metrics`).
* Labelled children are cached in plain dicts, so the request path pays one dict lookup for them
  instead of ``prometheus_client``'s ``labels()`` (which validates and locks on every call).
* :meth:`ServerMetrics.exposition` is the body of ``GET /metrics`` (``generate_latest``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

METRICS_ENABLED_KEY_NAME = "metrics_enabled"
METRICS_PATH = "/metrics"
CONTENT_TYPE = CONTENT_TYPE_LATEST

RESOURCES = "resources_servers"
AGENTS = "responses_api_agents"
MODELS = "responses_api_models"
HEAD = "head_server"

# Error kinds of this project's error envelope (nemo_gym.errors.error_envelope callers); any other kind
# is counted as "other", an error answer without an envelope (a plain 404 or 405) as "no_envelope".
KNOWN_ERROR_KINDS = frozenset(
    {
        "unauthorized",
        "request_too_large",
        "validation_error",
        "internal_error",
        "upstream_error",
        "verify_timeout",
        "verify_failed",
        "client_disconnected",
        "replica_session_lost",
    }
)
KNOWN_METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"})
UNMATCHED_ROUTE = "unmatched"  # every path no route of the app serves: one label value

# Seconds; the default buckets of prometheus_client, with a finer low end (most requests are sub-ms).
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    300,
)
# Event-loop lag: how late a 100 ms tick fired.
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# No negative bound: prometheus_client leaves out ``_sum`` (the mean reward) when the first one is below 0;
# a negative reward counts in the ``le=0`` bucket.
REWARD_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 2.0, 5.0, 10.0)
TURN_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 50, 100)
TOOL_CALL_BUCKETS = (0, 1, 2, 3, 4, 5, 8, 10, 15, 20, 30, 50, 100)
# Resources servers: a session counts as open from /seed_session to /verify; at most this many are
# remembered (a rollout that never reaches /verify is forgotten, oldest first).
MAX_OPEN_SESSIONS = 100_000


class ServerMetrics:
    """The metrics of one app (see the module docstring)."""

    def __init__(self, server_name: str, kind: str) -> None:
        self.server_name = server_name
        self.kind = kind
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        ProcessCollector(registry=reg)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)
        self.in_flight = 0  # read by the gauge at scrape time: no lock on the request path
        self.open_sessions: OrderedDict[bytes, None] = OrderedDict()

        self.requests = Counter(
            "nemo_gym_http_requests",
            "HTTP requests answered, by method, route template and status.",
            ("method", "route", "status"),
            registry=reg,
        )
        self.latency = Histogram(
            "nemo_gym_http_request_duration_seconds",
            "Time from a request's arrival to the end of its answer, by method and route template.",
            ("method", "route"),
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        gauge = Gauge("nemo_gym_http_requests_in_flight", "HTTP requests being served now.", registry=reg)
        gauge.set_function(lambda: self.in_flight)
        self.errors = Counter(
            "nemo_gym_http_errors",
            "Error answers (status >= 400), by route template and the error envelope's kind.",
            ("route", "kind"),
            registry=reg,
        )
        self.loop_lag = Histogram(
            "nemo_gym_event_loop_lag_seconds",
            "How late a periodic event-loop tick fired (actual minus expected time): code blocking the "
            "loop shows up here.",
            buckets=LAG_BUCKETS,
            registry=reg,
        )
        self._requests: dict[tuple[str, str, int], Any] = {}
        self._latency: dict[tuple[str, str], Any] = {}
        self._errors: dict[tuple[str, str], Any] = {}

        if kind == RESOURCES:
            sessions = Gauge(
                "nemo_gym_open_sessions",
                f"Sessions seeded (/seed_session) and not yet verified (/verify); at most {MAX_OPEN_SESSIONS}.",
                registry=reg,
            )
            sessions.set_function(lambda: len(self.open_sessions))
            self.verify_latency = Histogram(
                "nemo_gym_verify_duration_seconds",
                "Time the verifier took (the /verify handler), successful or not.",
                buckets=LATENCY_BUCKETS,
                registry=reg,
            )
            self.reward = Histogram(
                "nemo_gym_verify_reward", "Rewards /verify answered.", buckets=REWARD_BUCKETS, registry=reg
            )
            self.tool_calls = Counter(
                "nemo_gym_tool_calls",
                "Tool calls, by registered tool name and outcome (ok: status < 400).",
                ("tool", "outcome"),
                registry=reg,
            )
            self._tool_calls: dict[tuple[str, str], Any] = {}
        elif kind == MODELS:
            self._model_children: dict[tuple[str, bool], tuple[Any, Any, Any, Any]] = {}
            self.model_calls = Counter(
                "nemo_gym_model_calls",
                "Model calls, by endpoint route and outcome (ok: status < 400).",
                ("endpoint", "outcome"),
                registry=reg,
            )
            self.prompt_tokens = Counter(
                "nemo_gym_model_prompt_tokens",
                "Prompt (input) tokens of successful model calls, from the usage of the answers.",
                ("endpoint",),
                registry=reg,
            )
            self.completion_tokens = Counter(
                "nemo_gym_model_completion_tokens",
                "Completion (output) tokens of successful model calls, from the usage of the answers.",
                ("endpoint",),
                registry=reg,
            )
            self.generation_latency = Histogram(
                "nemo_gym_model_generation_duration_seconds",
                "Time a model call took, to the end of its answer (streamed answers included).",
                ("endpoint",),
                buckets=LATENCY_BUCKETS,
                registry=reg,
            )
        elif kind == AGENTS:
            self.rollouts_started = Counter(
                "nemo_gym_rollouts_started", "Rollouts (/run requests) started.", registry=reg
            )
            self.rollouts_finished = Counter(
                "nemo_gym_rollouts_finished", "Rollouts (/run) answered with a success.", registry=reg
            )
            self.rollouts_failed = Counter(
                "nemo_gym_rollouts_failed",
                "Rollouts (/run) answered with an error, by the error envelope's kind.",
                ("kind",),
                registry=reg,
            )
            self.turns = Histogram(
                "nemo_gym_agent_turns",
                "Model turns per agent loop (one rollout's /run, or one /v1/responses).",
                buckets=TURN_BUCKETS,
                registry=reg,
            )
            self.loop_tool_calls = Histogram(
                "nemo_gym_agent_tool_calls",
                "Tool calls per agent loop (one rollout's /run, or one /v1/responses).",
                buckets=TOOL_CALL_BUCKETS,
                registry=reg,
            )

    # -- the request path (labelled children cached: one dict lookup each) -----------------------------
    def observe_request(self, method: str, route: str, status: int, elapsed: float) -> None:
        key = (method, route, status)
        child = self._requests.get(key)
        if child is None:
            child = self._requests[key] = self.requests.labels(method, route, str(status))
        child.inc()
        lkey = (method, route)
        hist = self._latency.get(lkey)
        if hist is None:
            hist = self._latency[lkey] = self.latency.labels(method, route)
        hist.observe(elapsed)

    def observe_error(self, route: str, kind: str) -> None:
        key = (route, kind)
        child = self._errors.get(key)
        if child is None:
            child = self._errors[key] = self.errors.labels(route, kind)
        child.inc()

    def observe_tool_call(self, tool: str, ok: bool) -> None:
        key = (tool, "ok" if ok else "error")
        child = self._tool_calls.get(key)
        if child is None:
            child = self._tool_calls[key] = self.tool_calls.labels(*key)
        child.inc()

    def observe_reward(self, reward: Any) -> None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            return
        self.reward.observe(float(reward))

    def session_opened(self, cookie: bytes) -> None:
        sessions = self.open_sessions
        sessions[cookie] = None
        if len(sessions) > MAX_OPEN_SESSIONS:
            sessions.popitem(last=False)

    def session_closed(self, cookie: bytes) -> None:
        self.open_sessions.pop(cookie, None)

    def observe_model_call(
        self, endpoint: str, ok: bool, elapsed: float, usage: tuple[int, int] | None
    ) -> None:
        children = self._model_children.get((endpoint, ok))
        if children is None:
            children = self._model_children[(endpoint, ok)] = (
                self.model_calls.labels(endpoint, "ok" if ok else "error"),
                self.generation_latency.labels(endpoint),
                self.prompt_tokens.labels(endpoint),
                self.completion_tokens.labels(endpoint),
            )
        calls, latency, prompt, completion = children
        calls.inc()
        latency.observe(elapsed)
        if usage is not None:
            prompt.inc(usage[0])
            completion.inc(usage[1])

    def observe_agent_loop(self, turns: int, tool_calls: int) -> None:
        if self.kind != AGENTS:
            return
        self.turns.observe(turns)
        self.loop_tool_calls.observe(tool_calls)

    # -- exposition ------------------------------------------------------------------------------------
    def exposition(self) -> bytes:
        """The Prometheus text format of every metric of this app."""
        return generate_latest(self.registry)
