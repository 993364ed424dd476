"""The client half of traces (``+tracing=otlp``): a span per outgoing call, and the W3C ``traceparent``.

Contract
--------
* Off (the default) this module holds ``TRACER = None`` and imports nothing of OpenTelemetry;
  :class:`~nemo_gym.client.server_client.ServerClient` reads that one attribute per request and adds
  no header.
* :func:`enable_client_tracing` (called by :mod:`nemo_gym.server.tracing` when a server process turns
  traces on) sets the tracer. From then on every :meth:`ServerClient.request` is a ``CLIENT`` span,
  a child of the span current in the caller's context (the server span of the request being handled),
  named ``<METHOD> <path>`` (the path without a ``/ng-rollout/<id>`` prefix) with the target instance,
  method, path and answer status as attributes, and the request carries that span's ``traceparent``
  (and ``tracestate``) so the server called continues the same trace. A status >= 400 or an exception
  marks the span as an error. Retries of a call that did not reach its server are one span.
  ``GET /`` (liveness) and ``GET /metrics`` are never spans (:data:`UNTRACED_GET_PATHS`).
* One tracer per process: each server of a run is its own process. Apps sharing a process (tests)
  share the last tracer installed.
"""

from __future__ import annotations

from typing import Any

from nemo_gym.config.types import ROLLOUT_PATH_PREFIX

# The process's tracer while traces are on; None (the default) means off and costs one attribute read.
TRACER: Any = None
# ``GET`` of these paths is no span, on either side: liveness checks and Prometheus scrapes are no
# rollout's work, and a scrape every few seconds would bury the traces that are.
UNTRACED_GET_PATHS = frozenset({"/", "/metrics"})
_ROLLOUT_START = f"/{ROLLOUT_PATH_PREFIX}/"
_otel: Any = None  # the OpenTelemetry names used per call, bound once by enable_client_tracing


class _Otel:
    """The OpenTelemetry functions a client span needs, imported once (only when traces are on)."""

    def __init__(self) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.set_span_in_context = trace.set_span_in_context
        self.client_kind = trace.SpanKind.CLIENT
        self.status = trace.Status
        self.error = trace.StatusCode.ERROR
        self.propagator = TraceContextTextMapPropagator()


def enable_client_tracing(tracer: Any) -> None:
    """Make every ServerClient call of this process a span of ``tracer`` (None turns it off again)."""
    global TRACER, _otel
    if tracer is not None and _otel is None:
        _otel = _Otel()
    TRACER = tracer


def span_path(path: str) -> str:
    """``path`` as it names a span: without its query and ``/ng-rollout/<id>`` prefix (bounded names)."""
    path = path.partition("?")[0]
    if path.startswith(_ROLLOUT_START):
        rest = path[len(_ROLLOUT_START) :].partition("/")[2]
        return "/" + rest
    return path


def start_client_span(method: str, server_name: str, url_path: str, headers: dict[str, str]) -> Any:
    """Open the span of one outgoing call and put its ``traceparent`` into ``headers``; end it with
    :func:`end_client_span`. None (no span, no header) for a liveness check or scrape
    (:data:`UNTRACED_GET_PATHS`). Only called while :data:`TRACER` is set."""
    if method == "GET" and url_path in UNTRACED_GET_PATHS:
        return None
    span = TRACER.start_span(
        f"{method} {span_path(url_path)}",
        kind=_otel.client_kind,
        attributes={
            "http.request.method": method,
            "url.path": url_path,
            "nemo_gym.server_name": server_name,
        },
    )
    _otel.propagator.inject(headers, context=_otel.set_span_in_context(span))
    return span


def end_client_span(
    span: Any, status: int | None, error: BaseException | None = None, address: tuple[str, int] | None = None
) -> None:
    """Record the answer's ``status`` (or the ``error`` raised instead) and the address called; end ``span``."""
    if address is not None:
        span.set_attribute("server.address", address[0])
        span.set_attribute("server.port", address[1])
    if status is not None:
        span.set_attribute("http.response.status_code", status)
        if status >= 400:
            span.set_status(_otel.status(_otel.error, f"HTTP {status}"))
    if error is not None:
        span.record_exception(error)
        span.set_status(_otel.status(_otel.error, f"{type(error).__name__}: {error}"[:500]))
    span.end()
