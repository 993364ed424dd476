"""The head server: where outside processes (collector, trainers, ``ng_status``) learn about a run.

``GET /`` liveness; ``GET /global_config_dict_yaml`` the merged config with every port filled in and
secrets hidden (:func:`nemo_gym.redaction.redact_config`: values under secret keys, URL passwords,
and every secret value of the config and of ``env.yaml`` wherever it appears); ``GET /server_instances``
name, type/impl, url, pid and liveness of each server; ``GET /metrics`` and ``GET /prometheus_targets``
(Prometheus scrape targets of the run, :mod:`nemo_gym.server.metrics`) unless ``+metrics_enabled=false``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, Protocol

import yaml
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from omegaconf import OmegaConf

from nemo_gym.auth import RequestGuard
from nemo_gym.redaction import Scrubber, collect_secret_values, redact_config
from nemo_gym.server.metrics.discovery import install_head_metrics


class RunState(Protocol):
    """What the head server reads of a run (a :class:`nemo_gym.run.supervision.core.ServerSupervisor`)."""

    cfg: Any
    env_secret_values: list[str]

    def server_instances_info(self) -> list[dict[str, Any]]: ...


def redacted_config_yaml(cfg: Any, secret_values: Iterable[str] = ()) -> str:
    """``cfg`` as YAML, interpolations resolved where possible, secrets hidden.

    ``secret_values`` are scrubbed too (the values of env.yaml), besides those found in ``cfg``.
    """
    try:
        container = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # an unresolvable value must not hide the rest
        container = OmegaConf.to_container(cfg, resolve=False)
    scrubber = Scrubber(collect_secret_values(container) | set(secret_values))
    return yaml.safe_dump(redact_config(container, scrubber), sort_keys=False)


def build_head_app(supervisor: RunState, token: str | None = None, auth_disabled: bool = False) -> FastAPI:
    """The head server's FastAPI app, reading live state from ``supervisor``; every request must carry
    the run ``token`` (see :mod:`nemo_gym.auth`) unless ``auth_disabled``."""
    app = FastAPI(title="NeMo Gym head server", docs_url="/docs", redoc_url=None)
    guard_args: dict[str, Any] = {
        "server_name": "head_server",
        "token": token,
        "disabled": auth_disabled,
        "max_body_bytes": 1 << 20,
    }
    app.add_middleware(RequestGuard, **guard_args)
    # Its ``trusts`` gives token bearers the connection places kept for them (nemo_gym.server.accept_limit).
    app.state.nemo_gym_request_guard = RequestGuard(None, **guard_args)
    # GET /metrics and GET /prometheus_targets (the run's scrape targets): nemo_gym.server.metrics.
    install_head_metrics(app, supervisor)

    @app.get("/")
    async def health() -> dict[str, str]:
        return {"status": "ok", "name": "head_server"}

    @app.get("/global_config_dict_yaml", response_class=PlainTextResponse)
    async def global_config_dict_yaml() -> str:
        return redacted_config_yaml(supervisor.cfg, supervisor.env_secret_values)

    @app.get("/server_instances")
    async def server_instances() -> list[dict[str, Any]]:
        # Off the event loop: replicas on a Ray cluster are asked for their status (bounded).
        return await asyncio.to_thread(supervisor.server_instances_info)

    return app
