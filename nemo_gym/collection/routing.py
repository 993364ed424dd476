"""Which server a row's ``/run`` goes to: its agent, or the environment server in front of it (NeMo Gym 0.7).

Contract
--------
* A config with no ``environment_servers`` instance: every row goes to its agent, as before 0.7.
* ``environment_routing_mode: agent`` (the default, upstream's name and meaning): a row goes to the one
  environment server whose config references its agent (``agent_server``, or any field
  ``{type: responses_api_agents, name: ...}``); a row whose agent no environment server fronts goes to
  the agent directly (upstream generates a relay for it with a deprecation warning; the answer is the
  same). An agent fronted by several environment servers is an :class:`InputError` naming them.
  :class:`EnvironmentRouter` holds this rule for the collector and for ``run_examples``.
* ``environment_routing_mode: legacy``: every row goes to ``environment_server_name``, which must be an
  environment server instance of the config.
* ``environment_routing_mode: taskset`` (materialized tasks, ``task_id``/``task_input`` rows routed by
  ``environment_server_routes``) is an :class:`InputError` saying it is not supported yet.
* Every check runs before anything is sent. The chosen server is stamped on each result as
  ``_ng_environment_server`` (upstream's key).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from omegaconf import DictConfig

from nemo_gym.collection.options import CollectionOptions, InputError
from nemo_gym.config.instances import environment_servers_by_agent
from nemo_gym.config.keys import ENVIRONMENT_SERVER_TYPE_KEY_NAME

Route = Callable[[dict[str, Any]], str | None]


def environment_server_instances(global_config: Mapping[str, Any]) -> list[str]:
    """The names of the config's environment server instances, in config order."""
    return [
        str(name)
        for name, block in global_config.items()
        if isinstance(block, Mapping | DictConfig)
        and isinstance(block.get(ENVIRONMENT_SERVER_TYPE_KEY_NAME), Mapping | DictConfig)
    ]


class EnvironmentRouter:
    """Agent name -> the environment server its rows go through (None: the agent itself).

    With ``environment_server_name``, that server for every agent (it must be an environment server
    instance of ``global_config``, else ``ValueError``); otherwise the one server that fronts the agent.
    Asking for an agent that several front raises ``ValueError`` naming them."""

    def __init__(self, global_config: Mapping[str, Any], environment_server_name: str | None = None) -> None:
        servers = environment_server_instances(global_config)
        if environment_server_name is not None and environment_server_name not in servers:
            raise ValueError(
                f"environment_server_name={environment_server_name!r} is not an environment server instance "
                f"of the running config (environment servers: {', '.join(servers) or 'none'})"
            )
        self.name = environment_server_name
        self.fronts = environment_servers_by_agent(global_config) if servers else {}

    def __call__(self, agent: str) -> str | None:
        if self.name is not None:
            return self.name
        fronts = self.fronts.get(agent, [])
        if len(fronts) > 1:
            raise ValueError(
                f"agent {agent!r} is fronted by several environment servers ({', '.join(fronts)}), so its rows "
                "cannot choose one: name one with environment_server_name (and environment_routing_mode=legacy)"
            )
        return fronts[0] if fronts else None


def environment_route(cfg: CollectionOptions, global_config: Mapping[str, Any], agents: set[str]) -> Route:
    """A function from a row to the environment server its ``/run`` goes to (None: its agent), after
    checking the options against the config and the input's ``agents``; raises :class:`InputError`."""
    mode = cfg.environment_routing_mode
    if mode == "taskset" or cfg.environment_server_routes:
        raise InputError(
            "environment_routing_mode=taskset and environment_server_routes (materialized task rows with "
            "task_id.taskset and task_input) are not supported yet; use environment_routing_mode=agent or legacy"
        )
    if mode == "legacy" and cfg.environment_server_name is None:
        raise InputError("environment_routing_mode=legacy needs +environment_server_name=<instance>")
    if mode != "legacy" and cfg.environment_server_name is not None:
        raise InputError("environment_server_name applies only with environment_routing_mode=legacy")
    try:
        router = EnvironmentRouter(global_config, cfg.environment_server_name)
        for agent in sorted(agents):  # every agent of the input resolves now, before anything is sent
            router(agent)
    except ValueError as e:
        raise InputError(str(e)) from None
    return lambda row: router(row["agent_ref"]["name"])
