"""Where a run's servers listen: replica counts, explicit ports, and a busy head port.

Contract
--------
* ``num_replicas`` must be a positive integer (default 1); ``replicas`` is filled in by the launcher
  and setting it is a ``ConfigError`` naming the file:line.
* Two entries asking for the same explicit port is a ``ConfigError`` naming both, raised before any
  port is reserved.
* When the head server's port is taken, the hint says whether another ``ng_run`` answers there and
  how to choose another port (bounded probe of 1 s).
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from nemo_gym.client.replicas import NUM_REPLICAS_KEY_NAME, REPLICAS_KEY_NAME
from nemo_gym.config.instances import ServerInstance
from nemo_gym.config.keys import HEAD_SERVER_KEY_NAME
from nemo_gym.config.problems import ConfigError


class PlacementMixin:
    """Ports and replica counts of the run's servers (mixed into :class:`ServerSupervisor`)."""

    def _num_replicas(self, inst: ServerInstance, block: Any) -> int:
        if block.get(REPLICAS_KEY_NAME) is not None:
            where = self.loaded.provenance.where(f"{inst.config_key}.{REPLICAS_KEY_NAME}")
            raise ConfigError(
                f"'{inst.config_key}.{REPLICAS_KEY_NAME}'{f' ({where})' if where else ''} is filled in by the "
                f"launcher; set '{NUM_REPLICAS_KEY_NAME}' (and ray_resources) instead."
            )
        value = block.get(NUM_REPLICAS_KEY_NAME)
        if value is None:
            return 1
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            where = self.loaded.provenance.where(f"{inst.config_key}.{NUM_REPLICAS_KEY_NAME}")
            raise ConfigError(
                f"'{inst.config_key}.{NUM_REPLICAS_KEY_NAME}'{f' ({where})' if where else ''} must be a "
                f"positive integer, got {value!r}."
            )
        return value

    def _check_explicit_ports_distinct(self) -> None:
        """Two entries of this config asking for the same explicit port is a config error naming both."""
        owners: dict[int, str] = {}
        if self.head_port:
            default = OmegaConf.select(self.cfg, f"{HEAD_SERVER_KEY_NAME}.port", default=None) is None
            owners[self.head_port] = (
                f"the head server ({HEAD_SERVER_KEY_NAME}.port{', default' if default else ''})"
            )
        for inst in self.instances:
            port = OmegaConf.select(self.cfg, f"{inst.config_key}.port", default=None)
            if not port:
                continue
            what = f"server '{inst.name}' ({inst.config_key}.port)"
            if int(port) in owners:
                raise ConfigError(
                    f"Port {int(port)} is set for both {owners[int(port)]} and {what}; "
                    "give each its own port (a server whose port is left unset gets a free one)."
                )
            owners[int(port)] = what

    def _head_port_busy_hint(self) -> str:
        """What to do when the head server's port is taken (the default one is not a free pick)."""
        import httpx  # only on this error path: the launcher's start-up does not load an HTTP client

        explicit = OmegaConf.select(self.cfg, f"{HEAD_SERVER_KEY_NAME}.port", default=None) is not None
        who = ""
        try:  # another run's head server names itself, in its answer or in its 401 (it wants a token)
            r = httpx.get(f"http://{self.head_host}:{self.head_port}/", timeout=1.0, trust_env=False)
            body = r.json()
            name = body.get("name") if r.status_code == 200 else (body.get("error") or {}).get("server")
            if name == HEAD_SERVER_KEY_NAME:
                who = " Another ng_run's head server answers there (see ng_status); stop it, or run this one elsewhere."
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        what = "the default head server port" if not explicit else "the head server port you set"
        return (
            f"Port {self.head_port} is {what} and another process is using it.{who} Choose a free port with "
            f"+{HEAD_SERVER_KEY_NAME}.port=<port> (+{HEAD_SERVER_KEY_NAME}.port=0 picks one and prints it), and "
            f"give ng_collect_rollouts, ng_status and trainers the same +{HEAD_SERVER_KEY_NAME}.port."
        )
