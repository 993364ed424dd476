"""Prometheus HTTP service discovery: the head server's ``GET /prometheus_targets``.

Contract
--------
* :func:`prometheus_targets` turns the run's server rows (:meth:`nemo_gym.run.supervision.instances.
  InstancesMixin.server_instances_info`: one per server process, each Ray replica included) and the head
  server's own address into Prometheus's ``http_sd_configs`` answer: ``[{"targets": ["host:port"],
  "labels": {...}}]``, one entry per process. Labels: ``instance_name``, ``server_type`` (``head_server``
  for the head), ``impl``, and for a replica ``replica`` (its index) and ``node`` when known. All label
  values are strings, as the format requires.
* A server listening on every address (``0.0.0.0``, ``::``, empty) is given as ``127.0.0.1``: Prometheus
  on the same machine can reach it (on another machine, set the servers' ``host``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from fastapi import Request

from nemo_gym.server.metrics.install import install_metrics
from nemo_gym.server.metrics.registry import HEAD

TARGETS_PATH = "/prometheus_targets"
_ANY_ADDRESS = {"", "0.0.0.0", "::", "[::]", None}


def _target(host: Any, port: Any) -> str:
    host = "127.0.0.1" if host in _ANY_ADDRESS else str(host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    return f"{host}:{int(port)}"


def prometheus_targets(
    rows: Iterable[dict[str, Any]], head_host: Any, head_port: int
) -> list[dict[str, Any]]:
    """The ``http_sd`` answer for a run's server rows plus the head server (see the module docstring)."""
    out: list[dict[str, Any]] = [
        {
            "targets": [_target(head_host, head_port)],
            "labels": {"instance_name": HEAD, "server_type": HEAD, "impl": HEAD},
        }
    ]
    for row in rows:
        if row.get("port") is None:
            continue  # a replica that has not reported its address yet
        labels = {
            "instance_name": str(row.get("name", "")),
            "server_type": str(row.get("server_type", "")),
            "impl": str(row.get("impl", "")),
        }
        if row.get("replica") is not None:
            labels["replica"] = str(row["replica"])
            if row.get("node"):
                labels["node"] = str(row["node"])
        out.append({"targets": [_target(row.get("host"), row["port"])], "labels": labels})
    return out


def install_head_metrics(app: Any, supervisor: Any) -> None:
    """The head server's metrics (``GET /metrics``, as every server) and ``GET /prometheus_targets``
    (the run's scrape targets); nothing with ``+metrics_enabled=false``."""
    if install_metrics(app, HEAD, HEAD, getattr(supervisor, "cfg", None)) is None:
        return

    async def targets(request: Request) -> list[dict[str, Any]]:
        # Off the event loop: replicas on a Ray cluster are asked for their status (bounded).
        rows = await asyncio.to_thread(supervisor.server_instances_info)
        host, port = request.scope.get("server") or ("127.0.0.1", 0)  # the head's own listening address
        return prometheus_targets(rows, host, port)

    app.add_api_route(TARGETS_PATH, targets, methods=["GET"])
