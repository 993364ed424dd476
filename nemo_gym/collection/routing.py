"""Which server a row's ``/run`` goes to: its agent, or the environment server in front of it (NeMo Gym 0.7).

Contract
--------
* A config with no ``environment_servers`` instance: every row goes to its agent, as before 0.7.
* ``environment_routing_mode: agent`` (the default, upstream's name and meaning): a row goes to the one
  environment server whose config references its agent (``agent_server``, or any field
  ``{type: responses_api_agents, name: ...}``); a row whose agent no environment server fronts goes to
  the agent directly (upstream generates a relay for it with a deprecation warning; the answer is the
  same). An agent fronted by several environment servers is an :class:`InputError` naming them.
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


def environment_route(cfg: CollectionOptions, global_config: Mapping[str, Any], agents: set[str]) -> Route:
    """A function from a row to the environment server its ``/run`` goes to (None: its agent), after
    checking the options against the config and the input's ``agents``; raises :class:`InputError`."""
    servers = environment_server_instances(global_config)
    mode = cfg.environment_routing_mode
    if mode == "taskset" or cfg.environment_server_routes:
        raise InputError(
            "environment_routing_mode=taskset and environment_server_routes (materialized task rows with "
            "task_id.taskset and task_input) are not supported yet; use environment_routing_mode=agent or legacy"
        )
    if mode == "legacy":
        name = cfg.environment_server_name
        if name is None:
            raise InputError("environment_routing_mode=legacy needs +environment_server_name=<instance>")
        if name not in servers:
            raise InputError(
                f"environment_server_name={name!r} is not an environment server instance of the running config "
                f"(environment servers: {', '.join(servers) or 'none'})"
            )
        return lambda _row: name
    if cfg.environment_server_name is not None:
        raise InputError("environment_server_name applies only with environment_routing_mode=legacy")
    if not servers:
        return lambda _row: None
    by_agent = environment_servers_by_agent(global_config)
    ambiguous = {a: by_agent[a] for a in sorted(agents) if len(by_agent.get(a, [])) > 1}
    if ambiguous:
        listed = "; ".join(f"{a}: {', '.join(s)}" for a, s in ambiguous.items())
        raise InputError(
            f"agents fronted by several environment servers, so a row cannot choose one ({listed}); "
            "use +environment_routing_mode=legacy +environment_server_name=<instance>"
        )
    front = {a: s[0] for a, s in by_agent.items() if len(s) == 1}
    return lambda row: front.get(row["agent_ref"]["name"])
