"""Prometheus metrics from every server of a run (``GET /metrics``) and the head server's scrape targets.

Contract
--------
* Every server built on :class:`nemo_gym.server.base.BaseServer` (resources servers, agents, model
  servers) and the head server serve ``GET /metrics`` in Prometheus's text format, produced by
  ``prometheus_client`` from a registry of their own (:class:`ServerMetrics`: one per app, never the
  process-global one, so many apps in one process do not collide). The route sits behind the run
  token like every other route.
* ``+metrics_enabled=false`` (top-level, default true) installs nothing: no route, no middleware, no
  event-loop tick.
* What is measured, and with which labels, is listed in docs/observability.md (and in
  :mod:`nemo_gym.server.metrics.registry`). Label values are bounded: route templates (never raw paths),
  registered tool names, known error kinds, server kinds; never a session id or row content.
* The event loop's lag (how late a periodic tick fires) is measured from app start-up to shutdown
  (:mod:`nemo_gym.server.metrics.loop_lag`): environment code that blocks the loop shows up there.
* The head server serves ``GET /prometheus_targets`` in Prometheus's HTTP service-discovery format
  (:mod:`nemo_gym.server.metrics.discovery`): one target per server process (each Ray replica) and itself.

The request path costs one dict lookup (the route template), two ``perf_counter`` calls, a counter
increment and a histogram observation per request, counted in the server's one ASGI layer
(:class:`nemo_gym.server.asgi.ServerLayer` feeding :class:`nemo_gym.server.metrics.middleware.RequestMeter`).
"""

from nemo_gym.server.metrics.install import install_metrics as install_metrics
from nemo_gym.server.metrics.install import metrics_enabled as metrics_enabled
from nemo_gym.server.metrics.install import observe_agent_loop as observe_agent_loop
from nemo_gym.server.metrics.install import observed_model_call as observed_model_call
from nemo_gym.server.metrics.install import observed_verify as observed_verify
from nemo_gym.server.metrics.registry import METRICS_ENABLED_KEY_NAME as METRICS_ENABLED_KEY_NAME
from nemo_gym.server.metrics.registry import METRICS_PATH as METRICS_PATH
from nemo_gym.server.metrics.registry import ServerMetrics as ServerMetrics
