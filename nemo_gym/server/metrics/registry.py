"""The metrics of one server app, in a registry of its own.

Contract
--------
* :class:`ServerMetrics` holds one ``prometheus_client.CollectorRegistry`` per app (never the global
  one) with the metrics every server has and those of its kind (``kind``: a server type such as
  ``resources_servers``, or ``head_server``). Names, types and labels are listed in
  docs/observability.md; every label value is bounded (see :mod:`nemo_gym.server.metrics`).
* The metrics the request path updates (every request, tool call, model call, ``/run``, ``/verify``
  time) are :class:`HotCounter` / :class:`HotHistogram`: plain lists in a dict, updated without a lock by
  the middleware (which runs on the app's event loop only) and turned into the same samples as
  ``prometheus_client``'s ``Counter`` / ``Histogram`` (``_total``/``_created``, ``_bucket``/``_count``/
  ``_sum``/``_created``) at scrape time. ``prometheus_client``'s own classes validate and take a lock on
  every ``inc``/``observe`` and walk the buckets one by one: per request that cost several microseconds.
  The request path looks each labelled cell up once (one dict lookup per request for all of them).
  The reward, observed by the async verify wrapper on the event loop, is one too. Agent loops (observed by
  agents' code, possibly on worker threads) keep ``prometheus_client``'s locked classes.
* :meth:`ServerMetrics.exposition` is the body of ``GET /metrics`` (``generate_latest``).
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.gc_collector import GCCollector
from prometheus_client.metrics_core import Metric
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

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


class _HotMetric(Collector):
    """What the request-path metrics share: one list of floats per label set (``cell_size`` long), made at
    first use with its ``_created`` time; without labels, its one cell exists from the start, as with
    ``prometheus_client``'s own classes."""

    kind = ""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], cell_size: int,
        registry: CollectorRegistry | None,
    ) -> None:  # fmt: skip
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.cell_size = cell_size
        self.cells: dict[tuple[str, ...], list[float]] = {}
        self.created: dict[tuple[str, ...], float] = {}
        if not self.labelnames:
            self.cell(())
        if registry is not None:
            registry.register(self)

    def cell(self, labelvalues: tuple[str, ...]) -> list[float]:
        cell = self.cells.get(labelvalues)
        if cell is None:
            self.created[labelvalues] = time.time()
            cell = self.cells[labelvalues] = [0.0] * self.cell_size
        return cell

    def describe(self) -> list[Metric]:
        return [Metric(self.name, self.documentation, self.kind)]


class HotCounter(_HotMetric):
    """A counter for the request path (see the module docstring): :meth:`cell` gives the one-element list
    of a label set's value (``cell[0] += n`` counts); exposed as ``prometheus_client.Counter`` would be."""

    kind = "counter"

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str] = (), registry: CollectorRegistry | None = None
    ) -> None:  # fmt: skip
        super().__init__(name, documentation, labelnames, 1, registry)

    def inc(self, amount: float = 1) -> None:
        """Count on the label-less cell."""
        self.cells[()][0] += amount

    def collect(self) -> Iterator[Metric]:
        metric = Metric(self.name, self.documentation, "counter")
        names = self.labelnames
        for key, cell in list(self.cells.items()):
            labels = dict(zip(names, key, strict=True))
            metric.add_sample(self.name + "_total", labels, cell[0])
            if _use_created():
                metric.add_sample(self.name + "_created", labels, self.created[key])
        yield metric


class HotHistogram(_HotMetric):
    """A histogram for the request path (see the module docstring): :meth:`cell` gives a label set's list
    of per-bucket counts (not cumulative; the last bucket is ``+Inf``) followed by the sum, which
    :func:`observe` updates; exposed as ``prometheus_client.Histogram`` would be."""

    kind = "histogram"

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str] = (), buckets: Sequence[float] = (),
        registry: CollectorRegistry | None = None,
    ) -> None:  # fmt: skip
        bounds = [float(b) for b in buckets]
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        if bounds != sorted(bounds) or bounds[0] < 0:
            raise ValueError("buckets must be sorted and not negative")
        self.bounds = tuple(bounds)
        super().__init__(name, documentation, labelnames, len(self.bounds) + 1, registry)

    def observe(self, amount: float) -> None:
        """Observe on the label-less cell."""
        observe(self.bounds, self.cells[()], amount)

    def collect(self) -> Iterator[Metric]:
        metric = Metric(self.name, self.documentation, "histogram")
        names, name = self.labelnames, self.name
        les = [floatToGoString(b) for b in self.bounds]
        for key, cell in list(self.cells.items()):
            labels = dict(zip(names, key, strict=True))
            acc = 0.0
            for i, le in enumerate(les):
                acc += cell[i]
                metric.add_sample(name + "_bucket", {**labels, "le": le}, acc)
            metric.add_sample(name + "_count", labels, acc)
            metric.add_sample(name + "_sum", labels, cell[-1])
            if _use_created():
                metric.add_sample(name + "_created", labels, self.created[key])
        yield metric


class PoolCollector(Collector):
    """The process's worker pools (:mod:`nemo_gym.kit.pool_stats`: the verify pool and the sandbox's slots),
    read at scrape time; every pool is listed (zeros before first use)."""

    GAUGES = (
        ("size", "Calls the pool may run at once (0: not used yet, or decided by a Ray cluster)."),
        ("busy", "Calls running in the pool."),
        ("queued", "Calls waiting for a free worker or slot."),
    )
    COUNTERS = (
        ("calls", "Calls the pool finished, however they ended."),
        ("timeouts", "Calls past their time bound (the verify timeout; a sandboxed program's limit)."),
        ("failures", "Infrastructure failures: a worker that died, a program the sandbox could not run."),
        ("refused", "Calls given up while queued (the sandbox's queue_timeout_s)."),
    )

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

        from nemo_gym.kit.pool_stats import POOLS

        snapshots = {name: stats.snapshot() for name, stats in POOLS.items()}
        for key, doc in self.GAUGES:
            gauge = GaugeMetricFamily(f"nemo_gym_pool_{key}", doc, labels=["pool"])
            for pool, snap in snapshots.items():
                gauge.add_metric([pool], snap[key])
            yield gauge
        for key, doc in self.COUNTERS:
            counter = CounterMetricFamily(f"nemo_gym_pool_{key}", doc, labels=["pool"])
            for pool, snap in snapshots.items():
                counter.add_metric([pool], snap[key])
            yield counter


def _use_created() -> bool:
    """Whether ``prometheus_client`` exposes ``_created`` samples (``PROMETHEUS_DISABLE_CREATED_SERIES``,
    ``disable_created_metrics()``): the hot metrics follow it as its own classes do."""
    return getattr(prometheus_metrics, "_use_created", True)


def observe(bounds: tuple[float, ...], cell: list[float], amount: float) -> None:
    """Count ``amount`` in a :class:`HotHistogram` cell (``bounds``: that histogram's ``bounds``): the
    first bucket whose upper bound is at least ``amount``, as ``prometheus_client`` does."""
    cell[bisect_left(bounds, amount)] += 1
    cell[-1] += amount


class ServerMetrics:
    """The metrics of one app (see the module docstring)."""

    def __init__(self, server_name: str, kind: str) -> None:
        self.server_name = server_name
        self.kind = kind
        self.meter: Any = (
            None  # its request meter (nemo_gym.server.metrics.middleware), set by install_metrics
        )
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        ProcessCollector(registry=reg)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)
        self.in_flight = 0  # read by the gauge at scrape time: no lock on the request path
        self.open_sessions: OrderedDict[bytes, None] = OrderedDict()

        self.requests = HotCounter(
            "nemo_gym_http_requests",
            "HTTP requests answered, by method, route template and status.",
            ("method", "route", "status"),
            registry=reg,
        )
        self.latency = HotHistogram(
            "nemo_gym_http_request_duration_seconds",
            "Time from a request's arrival to the end of its answer, by method and route template.",
            ("method", "route"),
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        gauge = Gauge("nemo_gym_http_requests_in_flight", "HTTP requests being served now.", registry=reg)
        gauge.set_function(lambda: self.in_flight)
        self.errors = HotCounter(
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
        self.loop_blocked = Histogram(
            "nemo_gym_event_loop_blocked_seconds",
            "The part of a tick's lateness the event loop was held by code (running or sleeping on it): the "
            "lag less the time the loop's thread waited for a CPU. A busy machine adds to the lag, not here.",
            buckets=LAG_BUCKETS,
            registry=reg,
        )
        # (method, route, status) -> (its request-count cell, its latency cell)
        self._requests: dict[tuple[str, str, int], tuple[list[float], list[float]]] = {}
        self._latency_bounds = self.latency.bounds

        if kind == RESOURCES:
            sessions = Gauge(
                "nemo_gym_open_sessions",
                f"Sessions seeded (/seed_session) and not yet verified (/verify); at most {MAX_OPEN_SESSIONS}.",
                registry=reg,
            )
            sessions.set_function(lambda: len(self.open_sessions))
            self.verify_latency = HotHistogram(
                "nemo_gym_verify_duration_seconds",
                "Time the verifier took (the /verify handler), successful or not.",
                buckets=LATENCY_BUCKETS,
                registry=reg,
            )
            # Observed by the verify wrapper (nemo_gym.server.metrics.install.observed_verify), a coroutine on
            # the app's event loop: a hot histogram, like the request path's.
            self.reward = HotHistogram(
                "nemo_gym_verify_reward", "Rewards /verify answered.", buckets=REWARD_BUCKETS, registry=reg
            )
            self.tool_calls = HotCounter(
                "nemo_gym_tool_calls",
                "Tool calls, by registered tool name and outcome (ok: status < 400).",
                ("tool", "outcome"),
                registry=reg,
            )
            self._tool_calls: dict[tuple[str, bool], list[float]] = {}
            reg.register(PoolCollector())  # the verify pool and the sandbox's slots of this process
        elif kind == MODELS:
            self._model_cells: dict[
                tuple[str, bool], tuple[list[float], list[float], list[float], list[float]]
            ] = {}
            self.model_calls = HotCounter(
                "nemo_gym_model_calls",
                "Model calls, by endpoint route and outcome (ok: status < 400).",
                ("endpoint", "outcome"),
                registry=reg,
            )
            self.prompt_tokens = HotCounter(
                "nemo_gym_model_prompt_tokens",
                "Prompt (input) tokens of successful model calls, from the usage of the answers.",
                ("endpoint",),
                registry=reg,
            )
            self.completion_tokens = HotCounter(
                "nemo_gym_model_completion_tokens",
                "Completion (output) tokens of successful model calls, from the usage of the answers.",
                ("endpoint",),
                registry=reg,
            )
            self.model_in_flight = 0  # model calls being answered, kept by the middleware
            Gauge(
                "nemo_gym_model_calls_in_flight",
                "Model calls being answered (arrived, answer not finished): the load waiting on the model.",
                registry=reg,
            ).set_function(lambda: self.model_in_flight)
            self.generation_latency = HotHistogram(
                "nemo_gym_model_generation_duration_seconds",
                "Time a model call took, to the end of its answer (streamed answers included).",
                ("endpoint",),
                buckets=LATENCY_BUCKETS,
                registry=reg,
            )
        elif kind == AGENTS:
            self.rollouts_started = HotCounter(
                "nemo_gym_rollouts_started", "Rollouts (/run requests) started.", registry=reg
            )
            self.rollouts_finished = HotCounter(
                "nemo_gym_rollouts_finished", "Rollouts (/run) answered with a success.", registry=reg
            )
            self.rollouts_failed = HotCounter(
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

    # -- the request path (cells cached: one dict lookup per request) ----------------------------------
    def observe_request(self, method: str, route: str, status: int, elapsed: float) -> None:
        cells = self._requests.get((method, route, status))
        if cells is None:
            cells = self._requests[(method, route, status)] = (
                self.requests.cell((method, route, str(status))),
                self.latency.cell((method, route)),
            )
        cells[0][0] += 1
        latency = cells[1]
        latency[bisect_left(self._latency_bounds, elapsed)] += 1
        latency[-1] += elapsed

    def observe_error(self, route: str, kind: str) -> None:
        self.errors.cell((route, kind))[0] += 1

    def observe_tool_call(self, tool: str, ok: bool) -> None:
        cell = self._tool_calls.get((tool, ok))
        if cell is None:
            cell = self._tool_calls[(tool, ok)] = self.tool_calls.cell((tool, "ok" if ok else "error"))
        cell[0] += 1

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
        cells = self._model_cells.get((endpoint, ok))
        if cells is None:
            cells = self._model_cells[(endpoint, ok)] = (
                self.model_calls.cell((endpoint, "ok" if ok else "error")),
                self.generation_latency.cell((endpoint,)),
                self.prompt_tokens.cell((endpoint,)),
                self.completion_tokens.cell((endpoint,)),
            )
        calls, latency, prompt, completion = cells
        calls[0] += 1
        self.model_in_flight -= 1  # counted in when it arrived (the middleware's on_start)
        observe(self.generation_latency.bounds, latency, elapsed)
        if usage is not None:
            prompt[0] += usage[0]
            completion[0] += usage[1]

    def add_queue_depth(self, depth: Callable[[], int | None]) -> None:
        """Expose ``nemo_gym_model_queue_depth``: calls waiting in the model server's own queue, as
        ``depth()`` tells at scrape time (a server with a queue of its own, such as local_model's)."""
        Gauge(
            "nemo_gym_model_queue_depth",
            "Model calls waiting in this server's own queue (behind the ones generating).",
            registry=self.registry,
        ).set_function(lambda: depth() or 0)

    def observe_tokens(self, endpoint: str, usage: tuple[int, int]) -> None:
        """Count the prompt and completion tokens of one model answer (on the app's event loop)."""
        self.prompt_tokens.cell((endpoint,))[0] += usage[0]
        self.completion_tokens.cell((endpoint,))[0] += usage[1]

    def observe_agent_loop(self, turns: int, tool_calls: int) -> None:
        if self.kind != AGENTS:
            return
        self.turns.observe(turns)
        self.loop_tool_calls.observe(tool_calls)

    # -- exposition ------------------------------------------------------------------------------------
    def exposition(self) -> bytes:
        """The Prometheus text format of every metric of this app."""
        return generate_latest(self.registry)
