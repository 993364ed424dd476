"""Putting the metrics on an app: the ``metrics_enabled`` switch, ``GET /metrics``, the hooks of the bases.

Contract
--------
* :func:`metrics_enabled` reads the run's top-level ``metrics_enabled`` (default true; read as every
  switch is, :mod:`nemo_gym.config.flags`).
* :func:`install_metrics` gives an app its :class:`~nemo_gym.server.metrics.registry.ServerMetrics` (also at
  ``app.state.nemo_gym_metrics``), ``GET /metrics``, its request meter (``metrics.meter``) and the
  event-loop lag tick, wrapped around the app's lifespan. The meter must see every request, refused ones
  too: a server of ours hands it to its :class:`nemo_gym.server.asgi.ServerLayer` (``middleware=False``),
  which then answers ``GET /metrics`` itself (no route in the app's router, so no other request pays for
  matching it); any other app gets the route and the meter as
  :class:`~nemo_gym.server.metrics.middleware.MetricsMiddleware`, added last so outermost. Metrics off:
  nothing at all is installed, and it returns None.
* :func:`observed_verify` wraps a resources server's ``verify`` handler so the reward it answers is
  observed (the handler's signature is kept for FastAPI); :func:`observe_agent_loop` records one agent
  loop's model turns and tool calls. Both are no-ops without metrics.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from nemo_gym.config.flags import config_flag
from nemo_gym.server.metrics.loop_lag import LoopLagMonitor
from nemo_gym.server.metrics.middleware import (
    USAGE_OBSERVED_ATTR,
    MetricsMiddleware,
    RequestMeter,
    usage_of,
)
from nemo_gym.server.metrics.registry import (
    CONTENT_TYPE,
    METRICS_ENABLED_KEY_NAME,
    METRICS_PATH,
    RESOURCES,
    ServerMetrics,
)


def metrics_enabled(global_config: Mapping[str, Any] | Any | None) -> bool:
    """Whether the run's config leaves metrics on (the default)."""
    return config_flag(global_config, METRICS_ENABLED_KEY_NAME, True)


def install_metrics(
    app: FastAPI,
    server_name: str,
    kind: str,
    global_config: Mapping[str, Any] | Any | None = None,
    middleware: bool = True,
) -> ServerMetrics | None:
    """Install the metrics on ``app`` (see the module docstring); ``middleware``: whether to wrap the app
    in :class:`MetricsMiddleware` (else the caller hands ``metrics.meter`` to the app's ``ServerLayer``)."""
    if not metrics_enabled(global_config):
        return None
    metrics = ServerMetrics(server_name, kind)
    app.state.nemo_gym_metrics = metrics
    lag = LoopLagMonitor(metrics.loop_lag.observe, observe_blocked=metrics.loop_blocked.observe)

    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan_with_lag(a: Any) -> AsyncIterator[Any]:
        lag.start()
        try:
            async with inner(a) as state:
                yield state
        finally:
            await lag.stop()

    app.router.lifespan_context = lifespan_with_lag
    metrics.meter = RequestMeter(metrics, app.router, lag, answers_metrics=not middleware)
    if middleware:

        async def metrics_endpoint() -> Response:
            return Response(metrics.exposition(), media_type=CONTENT_TYPE)

        app.add_api_route(METRICS_PATH, metrics_endpoint, methods=["GET"], include_in_schema=False)
        app.add_middleware(MetricsMiddleware, meter=metrics.meter)
    return metrics


def observed_verify(
    metrics: ServerMetrics | None, endpoint: Callable[..., Awaitable[Any]]
) -> Callable[..., Awaitable[Any]]:
    """``endpoint`` (a resources server's ``verify``) observing the reward it answers; unchanged when
    metrics are off."""
    if metrics is None or metrics.kind != RESOURCES:
        return endpoint

    @functools.wraps(endpoint)
    async def verify(*args: Any, **kwargs: Any) -> Any:
        result = await endpoint(*args, **kwargs)
        reward = result.get("reward") if isinstance(result, dict) else getattr(result, "reward", None)
        metrics.observe_reward(reward)
        return result

    return verify


def observed_model_call(
    metrics: ServerMetrics | None, path: str, endpoint: Callable[..., Awaitable[Any]]
) -> Callable[..., Awaitable[Any]]:
    """``endpoint`` (a model server's handler of ``path``) counting the tokens of the ``usage`` it answers;
    unchanged when metrics are off. The middleware then counts the call and its time only."""
    if metrics is None:
        return endpoint

    @functools.wraps(endpoint)
    async def call(*args: Any, **kwargs: Any) -> Any:
        result = await endpoint(*args, **kwargs)
        usage = usage_of(result)
        if usage is not None:
            metrics.observe_tokens(path, usage)
        return result

    setattr(call, USAGE_OBSERVED_ATTR, True)
    return call


def observe_agent_loop(metrics: ServerMetrics | None, turns: int, tool_calls: int) -> None:
    """Record one agent loop's model turns and tool calls (nothing when metrics are off)."""
    if metrics is not None:
        metrics.observe_agent_loop(turns, tool_calls)
