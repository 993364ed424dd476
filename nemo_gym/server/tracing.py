"""The server half of traces (``+tracing=otlp``): a span per request served, exported over OTLP/HTTP.

Contract
--------
* Off (unset or false, :func:`nemo_gym.config.tracing.tracing_mode`) :func:`install_tracing` returns at
  once: nothing of OpenTelemetry is imported by us (the SDK and exporter never load; recent FastAPI
  versions import ``opentelemetry-api`` themselves), no layer is added, no header is read or written.
* On, it gives the process a ``TracerProvider`` whose resource is ``service.name`` = the server's
  instance name and ``nemo_gym.server_type`` = its server type, with a ``BatchSpanProcessor`` and an
  OTLP/HTTP exporter to ``tracing_endpoint``; the usual ``OTEL_BSP_*`` and ``OTEL_EXPORTER_OTLP_*``
  environment variables (schedule delay, headers, ...) apply. It is NOT made OpenTelemetry's global
  provider: FastAPI >= 0.16x traces requests itself once a global provider is set, which would double
  every server span (environment code that wants spans of its own takes
  ``app.state.nemo_gym_tracer_provider``). It is flushed and shut down when the app's lifespan ends (after the server's own ``on_shutdown``),
  so spans of the last rollouts reach the collector when ``ng_run`` stops the server.
* Every HTTP request is a ``SERVER`` span named ``<METHOD> <path>`` (a ``/ng-rollout/<id>`` prefix left
  out of the name), the child of the caller's span when the request carries a W3C ``traceparent``,
  else the root of a new trace: an agent's ``POST /run`` from the collector is the root span of its
  rollout, and the agent's calls to the model and resources servers (client spans,
  :mod:`nemo_gym.client.tracing`) and those servers' spans hang below it. The layer is outermost, so
  requests the run-token check refuses are spans too; a status >= 500 or an escaping exception marks
  the span as an error. ``GET /`` (liveness, polled by the launcher) and ``GET /metrics`` (Prometheus)
  are not traced.
* Missing packages are a :class:`RuntimeError` naming the ``tracing`` extra (the launcher reports the
  same before anything starts: :func:`nemo_gym.config.tracing.tracing_problems`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import FastAPI

from nemo_gym.client.tracing import UNTRACED_GET_PATHS, enable_client_tracing, span_path
from nemo_gym.config.tracing import MISSING_PACKAGES_HINT, tracing_endpoint, tracing_mode

TRACER_NAME = "nemo_gym"
EXPORT_TIMEOUT_S = 5.0  # one export's bound (so a server whose collector is gone still stops quickly)


def install_tracing(
    app: FastAPI, server_name: str, server_type: str, global_config: Mapping[str, Any] | Any | None
) -> Any:
    """Trace ``app``'s requests when the run says ``tracing: otlp`` (see the module docstring);
    ``server_type``: ``resources_servers``, ``responses_api_agents``, ... Returns the ``TracerProvider``,
    or None when traces are off."""
    if tracing_mode(global_config) is None:
        return None
    provider = tracer_provider(server_name, server_type, tracing_endpoint(global_config))
    tracer = provider.get_tracer(TRACER_NAME)
    enable_client_tracing(tracer)
    app.state.nemo_gym_tracer_provider = provider

    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan_with_flush(a: Any) -> AsyncIterator[Any]:
        try:
            async with inner(a) as state:
                yield state
        finally:
            # Export what is left (the batch processor sends on a timer) before the process ends.
            await asyncio.to_thread(provider.shutdown)

    app.router.lifespan_context = lifespan_with_flush
    app.add_middleware(TracingMiddleware, tracer=tracer, server_name=server_name)
    return provider


def tracer_provider(service_name: str, server_type: str, endpoint: str) -> Any:
    """A ``TracerProvider`` exporting in batches over OTLP/HTTP to ``endpoint``."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise RuntimeError(f"{MISSING_PACKAGES_HINT} ({e})") from None
    resource = Resource.create({"service.name": service_name, "nemo_gym.server_type": server_type})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S))
    )
    return provider


class TracingMiddleware:
    """One ``SERVER`` span per HTTP request, continuing the caller's trace (pure ASGI, outermost)."""

    def __init__(self, app: Any, tracer: Any, server_name: str):
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.app = app
        self.tracer = tracer
        self.server_name = server_name
        self.propagator = TraceContextTextMapPropagator()
        self.server_kind = trace.SpanKind.SERVER
        self.status = trace.Status
        self.error = trace.StatusCode.ERROR

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or (scope["method"] == "GET" and scope["path"] in UNTRACED_GET_PATHS):
            await self.app(scope, receive, send)
            return
        carrier = {}
        for key, value in scope.get("headers") or ():
            if key == b"traceparent" or key == b"tracestate":
                carrier[key.decode("latin-1")] = value.decode("latin-1")
        parent = self.propagator.extract(carrier) if carrier else None
        method = scope["method"]
        path = scope["path"]
        attributes = {
            "http.request.method": method,
            "url.path": path,
            "nemo_gym.server_name": self.server_name,
        }
        with self.tracer.start_as_current_span(
            f"{method} {span_path(path)}", context=parent, kind=self.server_kind, attributes=attributes
        ) as span:

            async def send_with_status(message: dict) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(self.status(self.error, f"HTTP {status}"))
                await send(message)

            await self.app(scope, receive, send_with_status)
