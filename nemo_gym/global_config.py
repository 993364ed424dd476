"""The global configuration: load it, merge it, validate it, hand it to child servers.

This module is the public face (upstream NeMo Gym's module path ``nemo_gym.global_config``): every
name below is importable from here, while the code lives in :mod:`nemo_gym.config`, one module per
concept. What this module owns itself is the config THIS PROCESS holds, and what reads it.

Contract
--------
* ``load_global_config(argv)`` (:mod:`nemo_gym.config.loading`) builds one config from, lowest
  precedence first: the YAML files named by ``config_paths`` (each file may name more, loaded
  transitively and each only once, the including file winning over what it includes), then
  ``env.yaml`` in the working directory, then ``initial_global_config_dict`` (values a program passes,
  e.g. a trainer's live vLLM URL), then the Hydra-syntax command-line overrides.
* ``validate_global_config`` (:mod:`nemo_gym.config.validation`) checks everything that can be checked
  before a process starts and raises one :class:`ConfigError` that lists every problem, each with the
  file and line (or the command-line override) it came from. That includes mistyped options:
  :data:`COMMAND_OPTIONS` (:mod:`nemo_gym.config.options`) is the one registry of each command's
  top-level options, and :func:`option_problems` reports a top-level key close to one of them unless
  it is a server instance, set in env.yaml, used by an interpolation, or another command's option.
  Typos inside server blocks are found by each server's config class, before any server starts
  (:mod:`nemo_gym.run.supervision.verdicts`).
* ``LoadedConfig.env_yaml_data`` keeps env.yaml as read: its values are secrets
  (:mod:`nemo_gym.redaction`, whose ``REDACTED``, ``is_secret_key`` and ``redact`` are re-exported).
  A command-line override of a secret key is quoted as ``+key=***`` in messages.
* Child servers never parse the command line: the launcher passes them the merged config as YAML
  in ``NEMO_GYM_CONFIG_DICT`` and their own instance name in ``NEMO_GYM_CONFIG_PATH``;
  ``get_global_config_dict()`` reads it back (interpolations resolve in the child, at its start) and
  holds it for the process (``_GLOBAL_CONFIG``; ``set_global_config_dict`` replaces or forgets it).
"""

from __future__ import annotations

import os
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from nemo_gym.config.discovery import ENTRY_POINT_GROUP as ENTRY_POINT_GROUP
from nemo_gym.config.discovery import ServerFolder as ServerFolder
from nemo_gym.config.discovery import env_config_path as env_config_path
from nemo_gym.config.discovery import env_names as env_names
from nemo_gym.config.discovery import find_folder as find_folder
from nemo_gym.config.discovery import installed_servers as installed_servers
from nemo_gym.config.discovery import server_folders as server_folders
from nemo_gym.config.instances import ServerInstance as ServerInstance
from nemo_gym.config.instances import find_server_dir as find_server_dir
from nemo_gym.config.instances import get_first_server_config_dict as get_first_server_config_dict
from nemo_gym.config.instances import scan_server_instances as scan_server_instances
from nemo_gym.config.instances import server_instances as server_instances
from nemo_gym.config.keys import AGENT_REF_KEY_NAME as AGENT_REF_KEY_NAME
from nemo_gym.config.keys import ATTEMPT_INDEX_KEY_NAME as ATTEMPT_INDEX_KEY_NAME
from nemo_gym.config.keys import CACHE_DIR_KEY_NAME as CACHE_DIR_KEY_NAME
from nemo_gym.config.keys import CONFIG_PATHS_KEY_NAME as CONFIG_PATHS_KEY_NAME
from nemo_gym.config.keys import DEFAULT_CONNECTION_LIMIT as DEFAULT_CONNECTION_LIMIT
from nemo_gym.config.keys import DEFAULT_HEAD_SERVER_HOST as DEFAULT_HEAD_SERVER_HOST
from nemo_gym.config.keys import DEFAULT_HEAD_SERVER_PORT as DEFAULT_HEAD_SERVER_PORT
from nemo_gym.config.keys import DEFAULT_HOST_KEY_NAME as DEFAULT_HOST_KEY_NAME
from nemo_gym.config.keys import DEFAULT_SHUTDOWN_TIMEOUT_S as DEFAULT_SHUTDOWN_TIMEOUT_S
from nemo_gym.config.keys import DEFAULT_STARTUP_TIMEOUT_S as DEFAULT_STARTUP_TIMEOUT_S
from nemo_gym.config.keys import DISALLOWED_PORTS_KEY_NAME as DISALLOWED_PORTS_KEY_NAME
from nemo_gym.config.keys import ENTRYPOINT_KEY_NAME as ENTRYPOINT_KEY_NAME
from nemo_gym.config.keys import ENV_KEY_NAME as ENV_KEY_NAME
from nemo_gym.config.keys import ENV_YAML_FNAME as ENV_YAML_FNAME
from nemo_gym.config.keys import (
    GLOBAL_AIOHTTP_CONNECTOR_LIMIT_KEY_NAME as GLOBAL_AIOHTTP_CONNECTOR_LIMIT_KEY_NAME,
)
from nemo_gym.config.keys import (
    GLOBAL_AIOHTTP_CONNECTOR_LIMIT_PER_HOST_KEY_NAME as GLOBAL_AIOHTTP_CONNECTOR_LIMIT_PER_HOST_KEY_NAME,
)
from nemo_gym.config.keys import HEAD_SERVER_KEY_NAME as HEAD_SERVER_KEY_NAME
from nemo_gym.config.keys import HF_TOKEN_KEY_NAME as HF_TOKEN_KEY_NAME
from nemo_gym.config.keys import NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME as NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME
from nemo_gym.config.keys import NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME as NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME
from nemo_gym.config.keys import NEMO_GYM_LISTEN_FD_ENV_VAR_NAME as NEMO_GYM_LISTEN_FD_ENV_VAR_NAME
from nemo_gym.config.keys import NEMO_GYM_PARENT_PID_ENV_VAR_NAME as NEMO_GYM_PARENT_PID_ENV_VAR_NAME
from nemo_gym.config.keys import NEMO_GYM_SESSION_SECRET_ENV_VAR_NAME as NEMO_GYM_SESSION_SECRET_ENV_VAR_NAME
from nemo_gym.config.keys import NEMO_GYM_VALIDATION_FDS_ENV_VAR_NAME as NEMO_GYM_VALIDATION_FDS_ENV_VAR_NAME
from nemo_gym.config.keys import PACKAGE_PARENT_DIR as PACKAGE_PARENT_DIR
from nemo_gym.config.keys import POLICY_API_KEY_KEY_NAME as POLICY_API_KEY_KEY_NAME
from nemo_gym.config.keys import POLICY_BASE_URL_KEY_NAME as POLICY_BASE_URL_KEY_NAME
from nemo_gym.config.keys import POLICY_MODEL_KEY_NAME as POLICY_MODEL_KEY_NAME
from nemo_gym.config.keys import POLICY_MODEL_NAME_KEY_NAME as POLICY_MODEL_NAME_KEY_NAME
from nemo_gym.config.keys import PORT_RANGE_HIGH_KEY_NAME as PORT_RANGE_HIGH_KEY_NAME
from nemo_gym.config.keys import PORT_RANGE_LOW_KEY_NAME as PORT_RANGE_LOW_KEY_NAME
from nemo_gym.config.keys import RAY_HEAD_NODE_ADDRESS_KEY_NAME as RAY_HEAD_NODE_ADDRESS_KEY_NAME
from nemo_gym.config.keys import RESPONSE_KEY_NAME as RESPONSE_KEY_NAME
from nemo_gym.config.keys import RESPONSES_CREATE_PARAMS_KEY_NAME as RESPONSES_CREATE_PARAMS_KEY_NAME
from nemo_gym.config.keys import RESULTS_DIR_KEY_NAME as RESULTS_DIR_KEY_NAME
from nemo_gym.config.keys import ROLLOUT_ID_KEY_NAME as ROLLOUT_ID_KEY_NAME
from nemo_gym.config.keys import ROLLOUT_INDEX_KEY_NAME as ROLLOUT_INDEX_KEY_NAME
from nemo_gym.config.keys import SERVER_TYPES as SERVER_TYPES
from nemo_gym.config.keys import SKILLS_REF_KEY_NAME as SKILLS_REF_KEY_NAME
from nemo_gym.config.keys import TASK_INDEX_KEY_NAME as TASK_INDEX_KEY_NAME
from nemo_gym.config.loading import LoadedConfig as LoadedConfig
from nemo_gym.config.loading import config_to_yaml as config_to_yaml
from nemo_gym.config.loading import file_override_notes as file_override_notes
from nemo_gym.config.loading import load_global_config as load_global_config
from nemo_gym.config.loading import load_yaml_file as load_yaml_file
from nemo_gym.config.missing import find_missing_values as find_missing_values
from nemo_gym.config.network import configured_port_range as configured_port_range
from nemo_gym.config.network import connection_limits_from
from nemo_gym.config.network import find_open_port as find_open_port
from nemo_gym.config.options import COMMAND_OPTIONS as COMMAND_OPTIONS
from nemo_gym.config.options import HEAD_SERVER_KEYS as HEAD_SERVER_KEYS
from nemo_gym.config.options import LAUNCHER_KEYS as LAUNCHER_KEYS
from nemo_gym.config.options import TRACKER_OPTIONS as TRACKER_OPTIONS
from nemo_gym.config.options import UPSTREAM_KEYS_USED_ELSEWHERE as UPSTREAM_KEYS_USED_ELSEWHERE
from nemo_gym.config.options import UPSTREAM_NO_EFFECT_KEYS as UPSTREAM_NO_EFFECT_KEYS
from nemo_gym.config.options import check_options as check_options
from nemo_gym.config.options import no_effect_upstream_keys as no_effect_upstream_keys
from nemo_gym.config.options import option_problems as option_problems
from nemo_gym.config.overrides import CliOverride as CliOverride
from nemo_gym.config.overrides import parse_cli_overrides as parse_cli_overrides
from nemo_gym.config.parser import GlobalConfigDictParser as GlobalConfigDictParser
from nemo_gym.config.parser import GlobalConfigDictParserConfig as GlobalConfigDictParserConfig
from nemo_gym.config.problems import ConfigError as ConfigError
from nemo_gym.config.problems import Provenance as Provenance
from nemo_gym.config.problems import did_you_mean as did_you_mean
from nemo_gym.config.validation import validate_global_config as validate_global_config
from nemo_gym.redaction import REDACTED as REDACTED
from nemo_gym.redaction import is_secret_key as is_secret_key
from nemo_gym.redaction import redact_config


def redact(value: Any) -> Any:
    """A copy of a plain config with secrets hidden, scrubbed with its own secret values.

    Kept for callers of the old name; see :func:`nemo_gym.redaction.redact_config`.
    """
    return redact_config(value)


# --------------------------------------------------------------------------------------------------
# The config this process holds, and what reads it.


_GLOBAL_CONFIG: DictConfig | None = None


def get_global_config_dict(
    global_config_dict_parser_config: GlobalConfigDictParserConfig | None = None,
    global_config_dict_parser_cls: type[GlobalConfigDictParser] = GlobalConfigDictParser,
) -> DictConfig:
    """The config this process runs under: the one already held, else the launcher's
    (``NEMO_GYM_CONFIG_DICT``), else parsed with ``global_config_dict_parser_config`` (default: the
    command line, env.yaml and the files they name) and kept for later calls."""
    global _GLOBAL_CONFIG
    if _GLOBAL_CONFIG is None:
        raw = os.environ.get(NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME)
        if raw is not None:
            _GLOBAL_CONFIG = OmegaConf.create(yaml.safe_load(raw))
        elif global_config_dict_parser_config is not None:
            _GLOBAL_CONFIG = global_config_dict_parser_cls().parse(global_config_dict_parser_config)
        else:
            import sys

            _GLOBAL_CONFIG = load_global_config(sys.argv[1:]).config
    return _GLOBAL_CONFIG


def current_global_config_dict() -> DictConfig | None:
    """The config this process already holds (set, or read from the launcher); None if it has none.

    Unlike :func:`get_global_config_dict`, never parses the command line.
    """
    if _GLOBAL_CONFIG is None and os.environ.get(NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME) is not None:
        return get_global_config_dict()
    return _GLOBAL_CONFIG


def maybe_get_global_config_dict() -> DictConfig | None:
    """Upstream's name for :func:`current_global_config_dict`: the held config or None, never parsing."""
    return current_global_config_dict()


def set_global_config_dict(
    cfg: DictConfig | dict | GlobalConfigDictParserConfig | None = None,
    global_config_dict_parser_cls: type[GlobalConfigDictParser] = GlobalConfigDictParser,
) -> None:
    """Hold ``cfg`` as this process's config. A :class:`GlobalConfigDictParserConfig` is parsed first
    (upstream's form); ``None`` forgets the held config (the next :func:`get_global_config_dict` loads
    again)."""
    global _GLOBAL_CONFIG
    if isinstance(cfg, GlobalConfigDictParserConfig):
        _GLOBAL_CONFIG = global_config_dict_parser_cls().parse(cfg)
    else:
        _GLOBAL_CONFIG = None if cfg is None else OmegaConf.create(cfg)


def get_hf_token() -> str | None:
    """``hf_token`` from the process's config (env.yaml), else the ``HF_TOKEN`` environment variable."""
    cfg = current_global_config_dict()
    token = OmegaConf.select(cfg, HF_TOKEN_KEY_NAME, default=None) if cfg is not None else None
    return str(token) if token else os.environ.get("HF_TOKEN") or None


def client_connection_limits(cfg: DictConfig | dict | None = None) -> tuple[int, int | None]:
    """``(total, per_host)`` connection limits for this process's HTTP client pools.

    From ``global_aiohttp_connector_limit`` (default 1024) and
    ``global_aiohttp_connector_limit_per_host`` (default: no limit beyond the total) in ``cfg`` (default:
    the config this process holds). A value that is not a positive integer raises ``ValueError`` naming
    the key (:func:`nemo_gym.config.network.connection_limits_from`).
    """
    if cfg is None:
        cfg = current_global_config_dict()
    return connection_limits_from(cfg)


def connector_limits(server_config: Any = None) -> tuple[int, int]:
    """``(limit, limit_per_host)`` for an aiohttp ``TCPConnector`` of a model server (0 = no cap).

    The server's own ``max_connections`` wins when its config sets it; else the global
    ``global_aiohttp_connector_limit`` / ``..._per_host`` keys (:func:`client_connection_limits`).
    """
    total, per_host = client_connection_limits()
    if server_config is not None and "max_connections" in getattr(server_config, "model_fields_set", ()):
        total = int(server_config.max_connections)
    return total, per_host or 0
