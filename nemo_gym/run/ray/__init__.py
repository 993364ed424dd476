"""Ray support: join a trainer's Ray cluster (or start a private one) for a run.

Contract
--------
* Nothing here imports :mod:`ray` at import time. :func:`ray_settings` reads a config and says whether
  Ray is wanted at all; only then does the launcher import :mod:`nemo_gym.run.ray.cluster` (which imports
  ray). A config without ``ray_head_node_address`` / ``ray_start_local`` never imports ray, so ng_run's
  start-up on a laptop is unchanged.
* ``ray_head_node_address: host:port`` (upstream's key; NeMo RL sets it to its GCS address) joins that
  cluster: the run connects as a driver and disconnects at shutdown, never stopping the cluster.
* ``ray_start_local: true`` starts a private single-node cluster for trying Ray out (sized by
  ``ray_local_num_cpus``, object store capped by ``ray_local_object_store_mb``) and stops exactly that
  cluster at shutdown. Setting both is a config error.
* Once connected, the launcher writes the cluster's GCS address into the config every server receives
  (``ray_head_node_address``), so servers can join the same cluster (heavy verification as Ray tasks,
  :mod:`nemo_gym.kit.verify_pool`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nemo_gym.config.flags import config_flag
from nemo_gym.config.keys import RAY_HEAD_NODE_ADDRESS_KEY_NAME
from nemo_gym.config.problems import ConfigError

RAY_START_LOCAL_KEY_NAME = "ray_start_local"
RAY_LOCAL_NUM_CPUS_KEY_NAME = "ray_local_num_cpus"
RAY_LOCAL_OBJECT_STORE_MB_KEY_NAME = "ray_local_object_store_mb"
RAY_KEYS = (
    RAY_HEAD_NODE_ADDRESS_KEY_NAME,
    RAY_START_LOCAL_KEY_NAME,
    RAY_LOCAL_NUM_CPUS_KEY_NAME,
    RAY_LOCAL_OBJECT_STORE_MB_KEY_NAME,
)
DEFAULT_LOCAL_OBJECT_STORE_MB = 256


@dataclass(frozen=True)
class RaySettings:
    """What a config asks of Ray: join ``address``, or start a local cluster."""

    address: str | None
    start_local: bool
    local_num_cpus: int | None = None
    local_object_store_mb: int = DEFAULT_LOCAL_OBJECT_STORE_MB


def _positive_int(cfg: Any, key: str, default: int | None) -> int | None:
    value = cfg.get(key) if hasattr(cfg, "get") else None
    if value is None:
        return default
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or isinstance(value, bool):
        raise ConfigError(f"'{key}' must be a positive integer, got {value!r}.")
    return number


def ray_settings(cfg: Any) -> RaySettings | None:
    """The Ray settings of ``cfg`` (a DictConfig or dict), or None when the config does not use Ray.

    Raises :class:`ConfigError` for a malformed address or for both keys set at once.
    """
    if cfg is None or not hasattr(cfg, "get"):
        return None
    address = cfg.get(RAY_HEAD_NODE_ADDRESS_KEY_NAME)
    start_local = config_flag(cfg, RAY_START_LOCAL_KEY_NAME, False)
    if address in (None, "", False):
        address = None
    if address is not None:
        address = str(address).strip()
        if address.startswith("ray://"):
            raise ConfigError(
                f"'{RAY_HEAD_NODE_ADDRESS_KEY_NAME}' is {address!r}: Ray Client (ray://) addresses are not "
                "supported; give the cluster's GCS address host:port (what `ray start --head` prints)."
            )
        host, sep, port = address.rpartition(":")
        if address != "auto" and (not sep or not host or not port.isdigit()):
            raise ConfigError(
                f"'{RAY_HEAD_NODE_ADDRESS_KEY_NAME}' must be host:port (the cluster's GCS address, e.g. "
                f"10.0.0.5:6379) or 'auto', got {address!r}."
            )
    if address is not None and start_local:
        raise ConfigError(
            f"Set either '{RAY_HEAD_NODE_ADDRESS_KEY_NAME}' (join a cluster) or '{RAY_START_LOCAL_KEY_NAME}' "
            "(start a private one), not both."
        )
    if address is None and not start_local:
        return None
    return RaySettings(
        address=address,
        start_local=start_local,
        local_num_cpus=_positive_int(cfg, RAY_LOCAL_NUM_CPUS_KEY_NAME, None),
        local_object_store_mb=_positive_int(
            cfg, RAY_LOCAL_OBJECT_STORE_MB_KEY_NAME, DEFAULT_LOCAL_OBJECT_STORE_MB
        )
        or DEFAULT_LOCAL_OBJECT_STORE_MB,
    )


__all__ = ["RAY_KEYS", "RAY_START_LOCAL_KEY_NAME", "RaySettings", "ray_settings"]
