"""The config THIS process holds, and what reads it (upstream's ``nemo_gym.global_config`` faces it).

Loading, merging and validating a config live in the other modules of :mod:`nemo_gym.config`, one per
concept; the contract of the whole is below, and each part is defined where it is named.

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
  (:mod:`nemo_gym.server.startup`, :mod:`nemo_gym.run.supervision.verdicts`).
* ``LoadedConfig.env_yaml_data`` keeps env.yaml as read: its values are secrets
  (:mod:`nemo_gym.redaction`).
  A command-line override of a secret key is quoted as ``+key=***`` in messages.
* Child servers never parse the command line: the launcher passes them the merged config as YAML
  (``NEMO_GYM_CONFIG_DICT``, in their private launch file: :mod:`nemo_gym.launch`) and their own
  instance name in ``NEMO_GYM_CONFIG_PATH``; ``get_global_config_dict()`` reads it back (interpolations resolve in the child, at its start) and
  holds it for the process (``_GLOBAL_CONFIG``; ``set_global_config_dict`` replaces or forgets it).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import yaml
from omegaconf import DictConfig, OmegaConf

from nemo_gym.config.keys import (
    HF_TOKEN_KEY_NAME,
    NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME,
)
from nemo_gym.config.network import connection_limits_from
from nemo_gym.launch import launch_value
from nemo_gym.redaction import redact_config

if TYPE_CHECKING:
    from nemo_gym.config.parser import GlobalConfigDictParser, GlobalConfigDictParserConfig

# A server process under ng_run reads its config from NEMO_GYM_CONFIG_DICT and never parses a command
# line: the loader (Hydra's override grammar, config discovery, validation) is imported only by the
# processes that do, so each server's start-up does not pay for it.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, when PyYAML has it


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
    global_config_dict_parser_cls: type[GlobalConfigDictParser] | None = None,
) -> DictConfig:
    """The config this process runs under: the one already held, else the launcher's
    (``NEMO_GYM_CONFIG_DICT``), else parsed with ``global_config_dict_parser_config`` by
    ``global_config_dict_parser_cls`` (default :class:`~nemo_gym.config.parser.GlobalConfigDictParser`;
    default config: the command line, env.yaml and the files they name) and kept for later calls."""
    global _GLOBAL_CONFIG
    if _GLOBAL_CONFIG is None:
        raw = launch_value(NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME)
        if raw is not None:
            _GLOBAL_CONFIG = OmegaConf.create(yaml.load(raw, Loader=_YAML_LOADER))
        elif global_config_dict_parser_config is not None:
            _GLOBAL_CONFIG = _parser_cls(global_config_dict_parser_cls)().parse(
                global_config_dict_parser_config
            )
        else:
            import sys

            from nemo_gym.config.loading import load_global_config

            _GLOBAL_CONFIG = load_global_config(sys.argv[1:]).config
    return _GLOBAL_CONFIG


def _parser_cls(cls: type[GlobalConfigDictParser] | None) -> type[GlobalConfigDictParser]:
    if cls is not None:
        return cls
    from nemo_gym.config.parser import GlobalConfigDictParser

    return GlobalConfigDictParser


def current_global_config_dict() -> DictConfig | None:
    """The config this process already holds (set, or read from the launcher); None if it has none.

    Unlike :func:`get_global_config_dict`, never parses the command line.
    """
    if _GLOBAL_CONFIG is None and launched_by_ng_run():
        return get_global_config_dict()
    return _GLOBAL_CONFIG


def launched_by_ng_run() -> bool:
    """Whether this process was handed a launcher's config (its launch file, or ``NEMO_GYM_CONFIG_DICT``)."""
    return launch_value(NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME) is not None


def maybe_get_global_config_dict() -> DictConfig | None:
    """Upstream's name for :func:`current_global_config_dict`: the held config or None, never parsing."""
    return current_global_config_dict()


def set_global_config_dict(
    cfg: DictConfig | dict | GlobalConfigDictParserConfig | None = None,
    global_config_dict_parser_cls: type[GlobalConfigDictParser] | None = None,
) -> None:
    """Hold ``cfg`` as this process's config. A :class:`GlobalConfigDictParserConfig` is parsed first
    (upstream's form, by ``global_config_dict_parser_cls``, default
    :class:`~nemo_gym.config.parser.GlobalConfigDictParser`); ``None`` forgets the held config (the next
    :func:`get_global_config_dict` loads again)."""
    global _GLOBAL_CONFIG
    if cfg is None or isinstance(cfg, (DictConfig, dict)):
        _GLOBAL_CONFIG = None if cfg is None else OmegaConf.create(cfg)
        return
    from nemo_gym.config.parser import GlobalConfigDictParserConfig

    if isinstance(cfg, GlobalConfigDictParserConfig):
        _GLOBAL_CONFIG = _parser_cls(global_config_dict_parser_cls)().parse(cfg)
    else:
        _GLOBAL_CONFIG = OmegaConf.create(cfg)


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
