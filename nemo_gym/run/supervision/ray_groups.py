"""Instances placed on a Ray cluster: joining the cluster, reserving, starting and awaiting replicas.

Contract
--------
* ``ray`` is imported only when the config asks for a cluster (``ray_head_node_address`` /
  ``ray_start_local``) or places an instance on it (``ray_resources`` / ``ray_node_id``); placing one
  without a cluster is a ``ConfigError`` naming the key.
* Each placed instance is a ``nemo_gym.run.ray.replicas.RayReplicaGroup``: its replicas' ports are
  reserved on their nodes before anything starts and written into the config (``host``, ``port``,
  ``replicas``); they check their config blocks and wait for go like local children, and get what a
  local child gets: their own secret values and the run token (sealed), and their node's environment
  without secret-looking variables except their block's ``pass_env``. A placement or start failure is a :class:`~nemo_gym.run.supervision.children.StartupError`.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from nemo_gym.auth import (
    AUTH_DISABLED_ENV_VAR_NAME,
    AUTH_TOKEN_ENV_VAR_NAME,
    TRAINER_TOKEN_SHA256_ENV_VAR_NAME,
    token_sha256,
)
from nemo_gym.client.replicas import REPLICAS_KEY_NAME, new_replica_identity
from nemo_gym.config.instances import ServerInstance, find_server_dir
from nemo_gym.config.keys import NEMO_GYM_SESSION_SECRET_ENV_VAR_NAME
from nemo_gym.config.problems import ConfigError
from nemo_gym.redaction import NEMO_GYM_SECRET_VALUES_ENV_VAR_NAME, Scrubber
from nemo_gym.run.supervision.children import StartupError


class RayGroupsMixin:
    """Instances placed on a Ray cluster (mixed into :class:`ServerSupervisor`)."""

    def _connect_ray(self) -> None:
        """Join (or start) the run's Ray cluster when the config asks for it (only then is ray imported),
        and hand its address to every server through the config."""
        from nemo_gym.run.ray import RAY_START_LOCAL_KEY_NAME, ray_settings

        settings = ray_settings(self.cfg)
        if settings is None:
            return
        from nemo_gym.run.ray.cluster import RayConnectError, connect

        try:
            self.ray_connection = connect(settings, timeout_s=min(self.startup_timeout_s, 60.0))
        except RayConnectError as e:
            raise StartupError(str(e)) from None
        how = "started a local Ray cluster" if self.ray_connection.started_local else "joined the Ray cluster"
        self.echo(f"nemo_gym: {how} at {self.ray_connection.gcs_address}")
        OmegaConf.update(self.cfg, "ray_head_node_address", self.ray_connection.gcs_address, force_add=True)
        OmegaConf.update(self.cfg, RAY_START_LOCAL_KEY_NAME, False, force_add=True)

    def _placed_on_ray(self, inst: ServerInstance, block: Any) -> bool:
        """Whether the instance asks to run on Ray nodes (``ray_resources`` / ``ray_node_id``)."""
        keys = [k for k in ("ray_resources", "ray_node_id") if block.get(k) is not None]
        if not keys:
            return False
        if self.ray_connection is None:
            raise ConfigError(
                f"'{inst.config_key}.{keys[0]}' places '{inst.name}' on a Ray cluster, but the run has none: "
                "set ray_head_node_address (join a cluster) or +ray_start_local=true."
            )
        return True

    def _reserve_ray_replicas(self, inst: ServerInstance, block: Any, num_replicas: int) -> None:
        from nemo_gym.run.ray.replicas import RayPlacementError, RayReplicaGroup

        try:
            group = RayReplicaGroup(inst.name, OmegaConf.to_container(block, resolve=True), num_replicas)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.ray_groups[inst.name] = group
        try:
            infos = group.reserve(timeout_s=min(self.startup_timeout_s, 60.0))
        except RayPlacementError as e:
            raise StartupError(str(e)) from None
        replicas = [
            {
                "host": i["host"],
                "port": i["port"],
                "url": f"http://{i['host']}:{i['port']}",
                "node": i["node"],
            }
            for i in infos
        ]
        block["host"], block["port"] = replicas[0]["host"], replicas[0]["port"]
        block[REPLICAS_KEY_NAME] = replicas

    def _start_ray_replicas(self, run_scrubber: Scrubber, secret: str) -> None:
        if not self.ray_groups:  # ray is imported only when something runs on it
            return
        from nemo_gym.run.ray.replicas import script_spec

        for inst in self.instances:
            group = self.ray_groups.get(inst.name)
            if group is None:
                continue
            # Like a local child: its own secret values and the run token, nobody else's.
            secrets_env = {
                NEMO_GYM_SESSION_SECRET_ENV_VAR_NAME: secret,
                AUTH_TOKEN_ENV_VAR_NAME: self.auth_token or "",
                TRAINER_TOKEN_SHA256_ENV_VAR_NAME: token_sha256(self.trainer_token)
                if self.trainer_token
                else "",
                AUTH_DISABLED_ENV_VAR_NAME: "" if self.auth_enabled else "1",
                NEMO_GYM_SECRET_VALUES_ENV_VAR_NAME: self._own_secrets_json(inst.name, run_scrubber),
            }
            pass_env = self._pass_env(inst.name)
            folder = find_server_dir(inst, self.loaded.root_dir)
            assert folder is not None
            block = OmegaConf.select(self.cfg, inst.config_key)
            script = folder / str(block.get("entrypoint") or "app.py")
            specs = []
            for index, info in enumerate(group.infos):
                config_yaml = self._config_yaml_for(inst.name, info["host"], info["port"], run_scrubber)
                identity = new_replica_identity(index)
                specs.append(
                    script_spec(
                        inst.name,
                        index,
                        identity,
                        self.loaded.root_dir,
                        script,
                        config_yaml,
                        self.startup_timeout_s,
                        pass_env,
                    )
                )
            group.start(specs, secrets_env)

    def _wait_ray_replicas(self, deadline: float) -> None:
        if not self.ray_groups:
            return
        from nemo_gym.run.ray.replicas import RayPlacementError

        for group in self.ray_groups.values():
            try:
                group.wait_started(deadline)
            except RayPlacementError as e:
                raise StartupError(str(e)) from None
            for info in group.infos:
                self.echo(
                    f"nemo_gym: replica {group.instance_name}[{group.infos.index(info)}] at "
                    f"http://{info['host']}:{info['port']} on Ray node {info['node']}"
                )
