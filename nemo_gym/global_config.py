"""The global configuration: load it, merge it, validate it, hand it to child servers.

Contract
--------
* ``load_global_config(argv)`` builds one config from, lowest precedence first:
  the YAML files named by ``config_paths`` (each file may name more, loaded transitively and
  each only once, the including file winning over what it includes), then ``env.yaml`` in the
  working directory, then ``initial_global_config_dict`` (values a program passes, e.g. a trainer's
  live vLLM URL), then the Hydra-syntax command-line overrides.
* ``validate_global_config`` checks everything that can be checked before a process starts and
  raises one :class:`ConfigError` that lists every problem, each with the file and line (or the
  command-line override) it came from. That includes mistyped options: :data:`COMMAND_OPTIONS` is
  the one registry of each command's top-level options, and :func:`option_problems` reports a
  top-level key close to one of them unless it is a server instance, set in env.yaml, used by an
  interpolation, or another command's option (see the function for the rule). Typos inside server
  blocks are found by each server's config class, before any server starts (``nemo_gym.supervisor``).
* ``LoadedConfig.env_yaml_data`` keeps env.yaml as read: its values are secrets
  (:mod:`nemo_gym.redaction`, whose ``REDACTED``, ``is_secret_key`` and ``redact`` are re-exported).
  A command-line override of a secret key is quoted as ``+key=***`` in messages.
* Child servers never parse the command line: the launcher passes them the merged config as YAML
  in ``NEMO_GYM_CONFIG_DICT`` and their own instance name in ``NEMO_GYM_CONFIG_PATH``;
  ``get_global_config_dict()`` reads it back (interpolations resolve in the child, at its start).
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    InterpolationKeyError,
    InterpolationResolutionError,
    InterpolationToMissingValueError,
    MissingMandatoryValue,
)
from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_gym.redaction import REDACTED as REDACTED
from nemo_gym.redaction import is_secret_key as is_secret_key
from nemo_gym.redaction import redact_config

SERVER_TYPES: tuple[str, ...] = ("resources_servers", "responses_api_agents", "responses_api_models")
HEAD_SERVER_KEY_NAME = "head_server"
CONFIG_PATHS_KEY_NAME = "config_paths"
DEFAULT_HEAD_SERVER_HOST = "127.0.0.1"
DEFAULT_HEAD_SERVER_PORT = 11000

NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME = "NEMO_GYM_CONFIG_DICT"
NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME = "NEMO_GYM_CONFIG_PATH"
NEMO_GYM_SESSION_SECRET_ENV_VAR_NAME = "NEMO_GYM_SESSION_SECRET"
NEMO_GYM_LISTEN_FD_ENV_VAR_NAME = "NEMO_GYM_LISTEN_FD"
NEMO_GYM_PARENT_PID_ENV_VAR_NAME = "NEMO_GYM_PARENT_PID"
# "<write fd>,<read fd>": the server reports whether its config is valid, then waits for "go".
NEMO_GYM_VALIDATION_FDS_ENV_VAR_NAME = "NEMO_GYM_VALIDATION_FDS"

ENV_YAML_FNAME = "env.yaml"

# Names upstream NeMo Gym code imports from here (same values as upstream).
# Keys of a task row / rollout result:
TASK_INDEX_KEY_NAME = "_ng_task_index"
ROLLOUT_INDEX_KEY_NAME = "_ng_rollout_index"
ATTEMPT_INDEX_KEY_NAME = "_ng_attempt_index"
ROLLOUT_ID_KEY_NAME = "_ng_rollout_id"
RESPONSES_CREATE_PARAMS_KEY_NAME = "responses_create_params"
RESPONSE_KEY_NAME = "response"
AGENT_REF_KEY_NAME = "agent_ref"
SKILLS_REF_KEY_NAME = "skills_ref"
# Top-level config keys:
ENTRYPOINT_KEY_NAME = "entrypoint"
DEFAULT_HOST_KEY_NAME = "default_host"
DISALLOWED_PORTS_KEY_NAME = "disallowed_ports"
HF_TOKEN_KEY_NAME = "hf_token"
RAY_HEAD_NODE_ADDRESS_KEY_NAME = "ray_head_node_address"
PORT_RANGE_LOW_KEY_NAME = "port_range_low"
PORT_RANGE_HIGH_KEY_NAME = "port_range_high"
RESULTS_DIR_KEY_NAME = "results_dir"
CACHE_DIR_KEY_NAME = "cache_dir"
POLICY_BASE_URL_KEY_NAME = "policy_base_url"
POLICY_API_KEY_KEY_NAME = "policy_api_key"
POLICY_MODEL_NAME_KEY_NAME = "policy_model_name"
POLICY_MODEL_KEY_NAME = "policy_model"
# Client connection pools (upstream sizes its aiohttp connector with these; we size ours, see
# :func:`client_connection_limits`).
GLOBAL_AIOHTTP_CONNECTOR_LIMIT_KEY_NAME = "global_aiohttp_connector_limit"
GLOBAL_AIOHTTP_CONNECTOR_LIMIT_PER_HOST_KEY_NAME = "global_aiohttp_connector_limit_per_host"
DEFAULT_CONNECTION_LIMIT = 1024

# Top-level keys the launcher itself understands (everything else is either a server instance or a
# free value such as ``policy_base_url`` that other values interpolate).
LAUNCHER_KEYS = {
    CONFIG_PATHS_KEY_NAME,
    HEAD_SERVER_KEY_NAME,
    "isolate_server_venvs",
    "venv_cache_dir",
    "log_dir",
    "startup_timeout_s",
    "shutdown_timeout_s",
    "server_auth",  # nemo_gym.auth.SERVER_AUTH_KEY_NAME
    "max_request_body_bytes",  # nemo_gym.auth.MAX_REQUEST_BODY_BYTES_KEY_NAME: the default of every server
    GLOBAL_AIOHTTP_CONNECTOR_LIMIT_KEY_NAME,
    GLOBAL_AIOHTTP_CONNECTOR_LIMIT_PER_HOST_KEY_NAME,
    DEFAULT_HOST_KEY_NAME,
    PORT_RANGE_LOW_KEY_NAME,
    PORT_RANGE_HIGH_KEY_NAME,
    # Ray (nemo_gym.ray): join a cluster, or start a private local one.
    RAY_HEAD_NODE_ADDRESS_KEY_NAME,
    "ray_start_local",
    "ray_local_num_cpus",
    "ray_local_object_store_mb",
    # Model-call capture (nemo_gym.observability): upstream's switch, and our bounds of the store.
    "observability_enabled",
    "model_call_capture_max_calls",
    "model_call_capture_max_bytes",
}
# Top-level keys upstream NeMo Gym defines that have no effect here, accepted so that configs and
# trainers written for it (NeMo RL sets uv_cache_dir, uv_venv_dir, ...) start unchanged.
# They are never typo errors (a near miss of one is); ng_run and RunHelper name the ones set.
UPSTREAM_NO_EFFECT_KEYS = frozenset(
    {
        DISALLOWED_PORTS_KEY_NAME, "head_server_deps", "python_version", "pip_install_verbose", "use_absolute_ip",
        "uv_pip_set_python", "skip_venv_if_present", "dry_run",
        "uvicorn_timeout_worker_healthcheck", "model_endpoint_readiness_timeout_seconds",
        "allow_openai_version_skew", "uv_cache_dir", "uv_venv_dir", RESULTS_DIR_KEY_NAME, CACHE_DIR_KEY_NAME,
        "nemo_gym_log_dir", "verbose", "global_aiohttp_client_request_debug",
        "global_aiohttp_tcp_keepalive_idle_seconds", "global_aiohttp_tcp_keepalive_interval_seconds",
        "global_aiohttp_tcp_keepalive_probes", "uvicorn_logging_show_200_ok", "profiling_enabled",
        "profiling_results_dirpath", "error_on_almost_servers",
    }
)  # fmt: skip
# Upstream keys that do have an effect here without being launcher options (read where they are used).
UPSTREAM_KEYS_USED_ELSEWHERE = frozenset({HF_TOKEN_KEY_NAME})
HEAD_SERVER_KEYS = frozenset({"host", "port"})

# The one registry of the top-level options each command reads (``+key=value``); commands check their
# config against it (:func:`option_problems`) and tests check it against each command's options model.
# A new option is added here (for ng_run: to LAUNCHER_KEYS), or a near-miss of it is reported as a typo.
_COLLECT_OPTIONS = (
    "input_jsonl_fpath", "output_jsonl_fpath", "agent_name", "limit", "num_repeats", "num_samples_in_parallel",
    "responses_create_params", "num_repeats_add_seed", "resume_from_cache", "overwrite", "max_attempts",
    "pass_threshold", "request_timeout_s", "progress", "circuit_breaker_threshold", "tracker",
    "observability_enabled",
)  # fmt: skip
# Experiment tracking (nemo_gym.eval.tracking.OPTION_KEYS besides ``tracker``; upstream's key names).
TRACKER_OPTIONS = (
    "tracker_num_trajectories", "mlflow_tracking_uri", "mlflow_experiment_name", "mlflow_run_name",
    "wandb_project", "wandb_name", "wandb_mode", "wandb_dir",
)  # fmt: skip
COMMAND_OPTIONS: dict[str, frozenset[str]] = {
    "ng_run": frozenset(LAUNCHER_KEYS),
    "ng_dump_config": frozenset(LAUNCHER_KEYS),
    "ng_status": frozenset({CONFIG_PATHS_KEY_NAME, HEAD_SERVER_KEY_NAME}),
    "ng_test": frozenset(
        {
            CONFIG_PATHS_KEY_NAME,
            "entrypoint",
            "should_validate_data",
            "isolate_server_venvs",
            "venv_cache_dir",
            "test_timeout_s",
        }
    ),
    "ng_init_resources_server": frozenset({"entrypoint", "name"}),
    "ng_prepare_data": frozenset(
        {
            CONFIG_PATHS_KEY_NAME,
            "output_dirpath",
            "mode",
            "should_download",
            "data_source",
            "overwrite_metrics_conflicts",
        }
    ),
    "ng_collect_rollouts": frozenset(
        {CONFIG_PATHS_KEY_NAME, HEAD_SERVER_KEY_NAME, *_COLLECT_OPTIONS, *TRACKER_OPTIONS}
    ),
    # nemo_gym.eval.e2e.E2ECollectionConfig's fields, plus ng_run's (it starts the servers).
    "ng_e2e_collect_rollouts": frozenset(
        {*LAUNCHER_KEYS, *_COLLECT_OPTIONS, *TRACKER_OPTIONS, "split", "agent_num_repeats"}
        - {"input_jsonl_fpath"}
    ),
    "ng_reward_profile": frozenset(
        {CONFIG_PATHS_KEY_NAME, "jsonl_fpath", "input_jsonl_fpath", "pass_threshold"}
    ),
    "ng_bench": frozenset(
        {
            CONFIG_PATHS_KEY_NAME,
            "env",
            "concurrencies",
            "num_rollouts",
            "output_json_fpath",
            "skip_bare",
            "compare_auth",
            "rounds",
        }
    ),
    "ng_viewer": frozenset(
        {
            CONFIG_PATHS_KEY_NAME,
            "jsonl_fpath",
            "host",
            "port",
            "compare_jsonl_fpath",
            "pass_threshold",
            "index_dir",
            "allowed_roots",
            "token",
        }
    ),
}

# The repository root when installed editable (``pip install -e .``): server folders and configs are
# looked up relative to the working directory first, then here.
PACKAGE_PARENT_DIR = Path(__file__).resolve().parent.parent


class ConfigError(Exception):
    """A configuration problem a user must fix; the message is meant to be printed as is."""


# --------------------------------------------------------------------------------------------------
# Provenance: where each dotted key was last set, so errors can say "configs/x.yaml:12".


@dataclass
class Provenance:
    """Where each dotted key was last set (``file:line`` or the command-line override)."""

    locations: dict[str, str] = field(default_factory=dict)

    def where(self, dotted: str) -> str | None:
        """The location of ``dotted`` or of its closest parent that has one (list indices ignored)."""
        key = dotted
        while key:
            if key in self.locations:
                return self.locations[key]
            key = key[: key.rindex("[")] if key.endswith("]") else key.rpartition(".")[0]
        return None

    def update(self, other: dict[str, str]) -> None:
        """Record ``other`` (later sources win)."""
        self.locations.update(other)


def _node_locations(node: yaml.Node, fname: str, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            out[key] = f"{fname}:{key_node.start_mark.line + 1}"
            out.update(_node_locations(value_node, fname, key + "."))
    return out


def _display_path(path: Path, cwd: Path | None) -> str:
    """``path`` relative to ``cwd`` when it is inside it (shorter error messages), else absolute."""
    if cwd is not None:
        try:
            return str(path.relative_to(cwd))
        except ValueError:
            pass
    return str(path)


def load_yaml_file(path: Path, display_name: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Parse one YAML file into a dict and a map of dotted key -> ``file:line``."""
    name = display_name or str(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"Cannot read config file {name}: {e.strerror}") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else {}
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark else name
        snippet = ""
        if mark is not None:
            lines = text.splitlines()
            if 0 <= mark.line < len(lines):
                snippet = f"\n    {lines[mark.line]}\n    {' ' * mark.column}^"
        problem = e.problem or "invalid YAML"
        started = ""
        if e.context and e.context_mark is not None and e.problem_mark is not None:
            started = f" ({e.context} started at line {e.context_mark.line + 1}, column {e.context_mark.column + 1})"
        elif e.context:
            started = f" ({e.context})"
        raise ConfigError(
            f"Malformed YAML at {where}: {problem}{started}{snippet}\n"
            "Fix the YAML syntax there (indent with spaces, close every [ and {, quote values containing ': ')."
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"Malformed YAML in {name}: {e}") from None
    finally:
        loader.dispose()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{name}: a config file must be a mapping of keys to values (`key: value` lines), "
            f"but it holds a {type(data).__name__}."
        )
    return data, _node_locations(node, name) if node is not None else {}


# --------------------------------------------------------------------------------------------------
# Command-line overrides (Hydra syntax).


@dataclass
class CliOverride:
    """One parsed ``+key=value`` / ``++key=value`` / ``key=value`` / ``~key`` argument."""

    key: str
    value: Any
    delete: bool
    text: str


def parse_cli_overrides(argv: list[str]) -> list[CliOverride]:
    """Parse Hydra-syntax overrides; raise ConfigError on syntax errors and sweeps."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    result = []
    for arg in argv:
        try:
            (override,) = parser.parse_overrides([arg])
        except OverrideParseException as e:
            raise ConfigError(
                f"Cannot parse command-line override {arg!r}: {e}\n"
                "Overrides use Hydra syntax, e.g. +config_paths=[a.yaml,b.yaml] ++policy_model_name=gpt-4o"
            ) from None
        if not override.key_or_group:
            raise ConfigError(
                f"Cannot parse command-line override {arg!r}: the key before '=' is empty.\n"
                "Overrides use Hydra syntax, e.g. +config_paths=[a.yaml,b.yaml] ++policy_model_name=gpt-4o"
            )
        if override.is_sweep_override():
            raise ConfigError(
                f"Command-line override {arg!r} is a sweep (several values); sweeps are not supported.\n"
                f"Give one value: a list is written in brackets (+{override.key_or_group}=[a,b]), "
                f"a string containing commas is quoted (+{override.key_or_group}='a,b')."
            )
        result.append(
            CliOverride(
                key=override.key_or_group,
                value=None if override.is_delete() else override.value(),
                delete=override.is_delete(),
                text=arg,
            )
        )
    return result


def _apply_overrides(cfg: DictConfig, overrides: list[CliOverride]) -> dict[str, str]:
    """Apply ``overrides`` in order to ``cfg`` (in place); return the locations they set."""
    locations = {}
    for o in overrides:
        if o.delete:
            parent_key, _, leaf = o.key.rpartition(".")
            parent = OmegaConf.select(cfg, parent_key, default=None) if parent_key else cfg
            if not isinstance(parent, DictConfig) or leaf not in parent:
                siblings = [str(k) for k in parent.keys()] if isinstance(parent, DictConfig) else []
                raise ConfigError(
                    f"Command-line override `{o.text}` deletes '{o.key}', which is not in the config."
                    f"{_did_you_mean(leaf, siblings, prefix=parent_key + '.' if parent_key else '')}"
                    " Remove the override or fix the key."
                )
            del parent[leaf]
            continue
        try:
            OmegaConf.update(cfg, o.key, o.value, merge=True, force_add=True)
        except Exception as e:  # e.g. a dotted key below a list or a scalar
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"Command-line override `{o.text}` cannot be applied: {first}") from None
        # The override is quoted in error messages: not with a credential in it.
        text = f"{o.text.partition('=')[0]}=***" if is_secret_key(o.key.rpartition(".")[2]) else o.text
        locations[o.key] = f"command-line override `{text}`"
        if isinstance(o.value, dict):
            for sub in _flatten_keys(o.value, o.key + "."):
                locations[sub] = f"command-line override `{text}`"
    return locations


def _flatten_keys(d: dict, prefix: str) -> list[str]:
    out = []
    for k, v in d.items():
        out.append(prefix + str(k))
        if isinstance(v, dict):
            out.extend(_flatten_keys(v, f"{prefix}{k}."))
    return out


# --------------------------------------------------------------------------------------------------
# Loading.


def _resolve_config_path(raw: str, relative_to: Path | None, cwd: Path) -> Path | None:
    """Find a config file: next to the file that lists it, then in ``cwd``, then in the repo root."""
    path = Path(raw).expanduser()
    if path.is_absolute():
        return path.resolve() if path.is_file() else None
    candidates = [relative_to / path] if relative_to is not None else []
    candidates += [cwd / path, PACKAGE_PARENT_DIR / path]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    return None


def _as_path_list(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple, ListConfig)):
        return [str(v) for v in value]
    raise ConfigError(
        f"{where}: `config_paths` must be a list of YAML file paths, got {value!r}. "
        "Write it as config_paths: [a.yaml, b.yaml] (on the command line: +config_paths=[a.yaml,b.yaml])."
    )


@dataclass
class LoadedConfig:
    """The merged config, where each key came from, the files read (in merge order) and the root dir."""

    config: DictConfig
    provenance: Provenance
    files: list[Path]
    root_dir: Path
    env_yaml_data: dict = field(default_factory=dict)  # env.yaml as read (its values are secrets)


def load_global_config(
    argv: list[str] | None = None,
    initial_global_config_dict: dict | None = None,
    cwd: Path | None = None,
    load_env_yaml: bool = True,
    env_yaml_path: Path | str | None = None,
) -> LoadedConfig:
    """Load and merge the config; see the module docstring for the precedence order.

    ``env_yaml_path`` names the env.yaml-style file to read instead of ``<cwd>/env.yaml`` (a trainer's
    ``dotenv_path``); when it does not exist nothing is loaded and one line on stderr says so.
    """
    cwd = (cwd or Path.cwd()).resolve()
    provenance = Provenance()
    overrides = parse_cli_overrides(argv or [])

    env_data: dict = {}
    env_locations: dict[str, str] = {}
    env_path = cwd / ENV_YAML_FNAME if env_yaml_path is None else (cwd / Path(env_yaml_path).expanduser())
    if load_env_yaml and env_yaml_path is not None and not env_path.is_file():
        import sys

        sys.stderr.write(f"nemo_gym: dotenv_path {env_path} does not exist; no env.yaml values loaded.\n")
    if load_env_yaml and env_path.is_file():
        env_data, env_locations = load_yaml_file(env_path, _display_path(env_path, cwd))
    env_yaml_data = dict(env_data)

    initial = dict(initial_global_config_dict or {})

    cli_paths: Any = None
    cli_paths_where = "the command line"
    for o in overrides:
        if o.key == CONFIG_PATHS_KEY_NAME:
            cli_paths = None if o.delete else o.value
            cli_paths_where = f"command-line override `{o.text}`"
    roots: list[tuple[str, str]] = []
    for source, where in (
        (initial.pop(CONFIG_PATHS_KEY_NAME, None), "initial_global_config_dict"),
        (env_data.pop(CONFIG_PATHS_KEY_NAME, None), env_locations.get(CONFIG_PATHS_KEY_NAME, ENV_YAML_FNAME)),
        (cli_paths, cli_paths_where),
    ):
        for p in _as_path_list(source, where):
            roots.append((p, where))

    merged = OmegaConf.create({})
    files: list[Path] = []
    seen: set[Path] = set()

    def load_one(raw: str, where: str, relative_to: Path | None) -> None:
        nonlocal merged
        path = _resolve_config_path(raw, relative_to, cwd)
        if path is None:
            looked = [str(d) for d in (relative_to, cwd, PACKAGE_PARENT_DIR) if d is not None]
            raise ConfigError(
                f"Config file {raw!r} (listed in {where}) does not exist.\n"
                f"Looked in: {', '.join(dict.fromkeys(looked))}. Fix the path or remove it from config_paths."
            )
        if path in seen:  # diamond or cyclic includes: each file is loaded once
            return
        seen.add(path)
        data, locations = load_yaml_file(path, _display_path(path, cwd))
        nested = data.pop(CONFIG_PATHS_KEY_NAME, None)
        child_where = locations.pop(CONFIG_PATHS_KEY_NAME, _display_path(path, cwd))
        for child in _as_path_list(nested, child_where):
            load_one(child, child_where, path.parent)
        try:
            merged = OmegaConf.merge(merged, OmegaConf.create(data))
        except Exception as e:  # omegaconf type clashes, e.g. a list merged over a dict
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(
                f"{_display_path(path, cwd)}: cannot merge into the config loaded so far: {first}"
            ) from None
        provenance.update(locations)
        files.append(path)

    for raw, where in roots:
        load_one(raw, where, None)

    env_locations.pop(CONFIG_PATHS_KEY_NAME, None)
    try:
        merged = OmegaConf.merge(merged, OmegaConf.create(env_data))
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{ENV_YAML_FNAME}: cannot merge over the YAML config files: {first}") from None
    provenance.update(env_locations)
    # Values a program passes (a trainer's live vLLM URL, a test's script) beat YAML defaults and env.yaml.
    try:
        merged = OmegaConf.merge(merged, OmegaConf.create(initial))
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            f"initial_global_config_dict: cannot merge over the YAML config files: {first}"
        ) from None
    provenance.update(
        {k: "initial_global_config_dict" for k in _flatten_keys(initial, "")} if initial else {}
    )
    provenance.update(_apply_overrides(merged, [o for o in overrides if o.key != CONFIG_PATHS_KEY_NAME]))
    merged.pop(CONFIG_PATHS_KEY_NAME, None)
    return LoadedConfig(
        config=merged, provenance=provenance, files=files, root_dir=cwd, env_yaml_data=env_yaml_data
    )


# --------------------------------------------------------------------------------------------------
# Server instances.


@dataclass(frozen=True)
class ServerInstance:
    """One server process to start: ``<name>: {<server_type>: {<impl>: {...}}}``."""

    name: str
    server_type: str
    impl: str
    config_key: str  # dotted path of the impl block, e.g. "policy_model.responses_api_models.openai_model"

    @property
    def folder(self) -> str:
        """``<server_type>/<impl>``, the server's folder relative to the root dir."""
        return f"{self.server_type}/{self.impl}"


def find_server_dir(instance: ServerInstance, root_dir: Path) -> Path | None:
    """The instance's folder under ``root_dir`` or else the repo root; None if neither has it."""
    for base in (root_dir, PACKAGE_PARENT_DIR):
        candidate = base / instance.server_type / instance.impl
        if candidate.is_dir():
            return candidate
    return None


def _close(word: str, options: list[str] | tuple[str, ...], cutoff: float = 0.6) -> list[str]:
    return difflib.get_close_matches(word, list(options), n=3, cutoff=cutoff)


def _did_you_mean(word: str, options: list[str] | tuple[str, ...], prefix: str = "") -> str:
    matches = _close(word, options)
    if matches:
        return " Did you mean " + " or ".join(f"'{prefix}{m}'" for m in matches) + "?"
    return ""


def did_you_mean(word: str, options: list[str] | tuple[str, ...], prefix: str = "") -> str:
    """`` Did you mean 'x'?`` naming the options close to ``word``, or "" when none is."""
    return _did_you_mean(word, options, prefix)


def _loc(prov: Provenance, dotted: str) -> str:
    where = prov.where(dotted)
    return f" ({where})" if where else ""


def _is_server_ref(node: Any) -> bool:
    return isinstance(node, DictConfig) and {"type", "name"} <= {str(k) for k in node.keys()}


def _impl_types(impl: str, root_dir: Path | None) -> list[str]:
    """The server types that have a folder named ``impl`` (to suggest where a block belongs)."""
    bases = [b for b in (root_dir, PACKAGE_PARENT_DIR) if b is not None]
    return [t for t in SERVER_TYPES if any((b / t / impl).is_dir() for b in bases)]


def _scan_server_instances(
    cfg: DictConfig, prov: Provenance, root_dir: Path | None = None
) -> tuple[list[ServerInstance], list[str], set[str]]:
    """Instances, problems, and the names of top-level blocks that were meant as instances but are broken."""
    problems: list[str] = []
    broken: set[str] = set()
    instances: list[ServerInstance] = []
    types = ", ".join(SERVER_TYPES)
    for name in cfg.keys():
        name = str(name)
        value = cfg._get_node(name)
        near_type = _close(name, SERVER_TYPES, 0.75)
        if (
            near_type
            and name not in LAUNCHER_KEYS
            and isinstance(value, DictConfig)
            and not _is_server_ref(value)
            # A well-formed instance whose name resembles a type (``arc_agi_resources_server``) is fine.
            and not any(str(k) in SERVER_TYPES for k in value.keys())
        ):
            what = (
                "is a server type" if name in SERVER_TYPES else f"looks like the server type '{near_type[0]}'"
            )
            problems.append(
                f"Top-level key '{name}'{_loc(prov, name)} {what}, but the top level holds instance names. "
                f"Nest it under an instance name:\n      my_instance:\n        {near_type[0]}:\n          <impl>: {{...}}"
            )
            continue
        if not isinstance(value, DictConfig):
            continue
        keys = [str(k) for k in value.keys()]
        type_keys = [k for k in keys if k in SERVER_TYPES]
        if not type_keys:
            near = [
                (k, m)
                for k in keys
                if (m := _close(k, SERVER_TYPES, 0.75))
                and isinstance(value._get_node(k), DictConfig)
                and not _is_server_ref(value._get_node(k))
            ]
            if near:
                k, m = near[0]
                broken.add(name)
                problems.append(
                    f"Top-level block '{name}'{_loc(prov, f'{name}.{k}')} looks like a server instance but "
                    f"'{k}' is not a server type. Did you mean '{m[0]}'? Server types: {types}."
                )
            elif name not in LAUNCHER_KEYS and _looks_like_impl_block(value):
                broken.add(name)
                impl = next((k for k in keys if isinstance(value._get_node(k), DictConfig)), None)
                found = _impl_types(impl, root_dir) if impl and "entrypoint" not in value else []
                if found:
                    fix = f"Did you mean '{name}: {{{found[0]}: {{{impl}: {{entrypoint: ..., ...}}}}}}'?"
                else:
                    fix = (
                        f"Write it as '{name}: {{<server_type>: {{<impl>: {{entrypoint: app.py, ...}}}}}}' "
                        f"with <server_type> one of {types} and <impl> the server's folder name."
                    )
                problems.append(
                    f"Top-level block '{name}'{_loc(prov, name)} has an `entrypoint` but no server type. {fix}"
                )
            continue
        broken.add(name)
        if len(keys) != 1:
            extra = [k for k in keys if k not in type_keys]
            problems.append(
                f"Server instance '{name}'{_loc(prov, name)} must contain exactly one server-type key; "
                f"found {keys}. Move {extra or type_keys[1:]} inside the impl block or to a separate instance."
            )
            continue
        server_type = type_keys[0]
        type_block = value._get_node(server_type)
        key = f"{name}.{server_type}"
        if isinstance(type_block, DictConfig) and "entrypoint" in type_block:
            problems.append(
                f"'{key}'{_loc(prov, key)} has `entrypoint` directly under the server type; the impl folder "
                f"level is missing. Write '{name}: {{{server_type}: {{<impl>: {{entrypoint: ..., ...}}}}}}' "
                f"with <impl> the folder name under {server_type}/."
            )
            continue
        if not isinstance(type_block, DictConfig) or len(type_block) != 1:
            got = list(type_block.keys()) if isinstance(type_block, DictConfig) else type_block
            problems.append(
                f"Server instance '{key}'{_loc(prov, key)} must contain exactly one impl block (the folder "
                f"name under {server_type}/), got {got!r}. Use one instance name per server."
            )
            continue
        impl = str(next(iter(type_block.keys())))
        impl_block = type_block._get_node(impl)
        key = f"{name}.{server_type}.{impl}"
        if not isinstance(impl_block, DictConfig):
            problems.append(f"'{key}'{_loc(prov, key)} must be a mapping with at least `entrypoint: app.py`.")
            continue
        if "entrypoint" not in impl_block:
            problems.append(f"'{key}'{_loc(prov, key)} has no `entrypoint`; add `entrypoint: app.py`.")
            continue
        broken.discard(name)
        instances.append(ServerInstance(name=name, server_type=server_type, impl=impl, config_key=key))
    return instances, problems, broken


def server_instances(cfg: DictConfig, prov: Provenance | None = None) -> list[ServerInstance]:
    """All server instances in ``cfg``; raises ConfigError on blocks that are almost instances."""
    instances, problems, _ = _scan_server_instances(cfg, prov or Provenance())
    if problems:
        raise ConfigError(_format_problems("Invalid server instance configuration", problems))
    return instances


def _looks_like_impl_block(value: DictConfig) -> bool:
    if "entrypoint" in value:
        return True
    for k in value.keys():
        child = value._get_node(k)
        if isinstance(child, DictConfig) and "entrypoint" in child:
            return True
    return False


def _format_problems(title: str, problems: list[str]) -> str:
    lines = [f"{title} ({len(problems)} problem{'s' if len(problems) != 1 else ''}):"]
    for p in problems:
        lines.append(f"  - {p}")
    return "\n".join(lines)


def _iter_leaves(node: Any, prefix: str):
    if isinstance(node, DictConfig):
        for k in node.keys():
            yield from _iter_leaves(node._get_node(k), f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            yield from _iter_leaves(node._get_node(i), f"{prefix}[{i}]")
    else:
        yield prefix, node


def _iter_server_refs(node: Any, prefix: str):
    """Yield (dotted_path, type, name) for every ``{type: ..., name: ...}`` mapping that names a server.

    ``type`` is yielded as written, so a misspelled server type can be reported; mappings whose
    ``type`` is nowhere near a server type (dataset entries: ``type: train``) are not references.
    """
    if isinstance(node, DictConfig):
        if _is_server_ref(node):
            ref_type, ref_name = _ref_value(node, "type"), _ref_value(node, "name")
            if ref_type in SERVER_TYPES or _close(ref_type, SERVER_TYPES, 0.75):
                yield prefix, ref_type, ref_name
                return
        for k in node.keys():
            yield from _iter_server_refs(node._get_node(k), f"{prefix}.{k}")
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            yield from _iter_server_refs(node._get_node(i), f"{prefix}[{i}]")


def _ref_value(node: DictConfig, key: str) -> str:
    """``node[key]`` resolved when possible (a reference may interpolate), else as written."""
    try:
        return str(node[key])
    except Exception:  # unresolvable: reported as a missing value
        return str(node._get_node(key)._value())


_INTERP_RE = re.compile(r"\$\{([^}]+)\}")
_MISSING_VALUE_RE = re.compile(r"Missing mandatory value: (\S+)")
_MAX_USERS_SHOWN = 3
_MAX_MISSING_DETAILED = 12
_UNSET = object()


def _absolute_ref(ref: str, path: str) -> str:
    """The absolute dotted key of interpolation ``ref`` used at ``path`` (handles ``${.x}``/``${..x}``)."""
    if not ref.startswith("."):
        return ref
    dots = len(ref) - len(ref.lstrip("."))
    parts = re.sub(r"\[\d+\]", "", path).split(".")
    base = parts[: max(len(parts) - dots, 0)]
    return ".".join([*base, ref[dots:]])


@dataclass
class _Missing:
    declared_at: str | None = None  # where the key is set to ``???``
    users: list[str] = field(default_factory=list)  # "path (file:line)" of values that interpolate it


def find_missing_values(cfg: DictConfig, prov: Provenance) -> list[str]:
    """One line per value that is ``???``, interpolates a key that is not set, or cannot be resolved.

    Values that need the same missing key are grouped under it, so ``${policy_base_url}`` used by
    three servers is reported once, with the override that sets it.
    """
    return _find_missing(cfg, prov)[1]


def _find_missing(cfg: DictConfig, prov: Provenance) -> tuple[int, list[str]]:
    """(number of missing keys and unresolvable values, the lines describing them)."""
    missing: dict[str, _Missing] = {}
    unresolvable: list[str] = []
    for path, node in _iter_leaves(cfg, ""):
        try:
            OmegaConf.select(cfg, path, throw_on_missing=True, throw_on_resolution_failure=True)
        except MissingMandatoryValue:
            missing.setdefault(path, _Missing()).declared_at = (
                f"??? at {prov.where(path)}" if prov.where(path) else "???"
            )
        except InterpolationToMissingValueError as e:
            m = _MISSING_VALUE_RE.search(str(e))
            target = m.group(1) if m else path
            missing.setdefault(target, _Missing()).users.append(f"{path}{_loc(prov, path)}")
        except InterpolationKeyError:
            raw = node._value() if hasattr(node, "_value") else None
            refs = [
                _absolute_ref(r.strip(), path)
                for r in _INTERP_RE.findall(raw if isinstance(raw, str) else "")
            ]
            refs = [r for r in refs if ":" not in r] or [path]
            target = next((r for r in refs if OmegaConf.select(cfg, r, default=_UNSET) is _UNSET), refs[0])
            missing.setdefault(target, _Missing()).users.append(f"{path}{_loc(prov, path)}")
        except InterpolationResolutionError as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            reason = reason.replace("KeyError raised while resolving interpolation: ", "").strip('"')
            raw = node._value() if hasattr(node, "_value") else ""
            unresolvable.append(
                f"{path}{_loc(prov, path)}: `{raw}` cannot be resolved: {reason}. "
                f"Fix it, or set it directly with ++{path}=<value>."
            )
    out = []
    width = max((len(k) for k in missing), default=0) + len("++=<value>")
    for key, info in missing.items():
        notes = []
        notes.append(info.declared_at or "not defined anywhere")
        if info.users:
            shown = info.users[:_MAX_USERS_SHOWN]
            more = len(info.users) - len(shown)
            notes.append("needed by " + ", ".join(shown) + (f" and {more} more" if more else ""))
        out.append(f"{f'++{key}=<value>'.ljust(width)}  ({'; '.join(notes)})")
    if len(out) > _MAX_MISSING_DETAILED:  # still list every key, compactly, to stay on one screen
        rest = ", ".join(f"++{key}" for key in list(missing)[_MAX_MISSING_DETAILED:])
        out = out[:_MAX_MISSING_DETAILED] + [f"also not set: {rest}"]
    return len(missing) + len(unresolvable), out + unresolvable


def validate_global_config(loaded: LoadedConfig) -> list[ServerInstance]:
    """Check the whole config before anything starts; raise one ConfigError listing every problem."""
    cfg, prov = loaded.config, loaded.provenance
    instances, problems, broken = _scan_server_instances(cfg, prov, loaded.root_dir)

    by_type: dict[str, list[str]] = {t: [] for t in SERVER_TYPES}
    for inst in instances:
        by_type[inst.server_type].append(inst.name)
        folder = find_server_dir(inst, loaded.root_dir)
        if folder is None:
            available = _available_impls(inst.server_type, loaded.root_dir)
            looked = " or ".join(dict.fromkeys(str(b) for b in (loaded.root_dir, PACKAGE_PARENT_DIR)))
            problems.append(
                f"'{inst.config_key}'{_loc(prov, inst.config_key)}: there is no folder "
                f"{inst.server_type}/{inst.impl}/ (looked under {looked}).{_did_you_mean(inst.impl, available)}"
                + (f" Available: {', '.join(available)}." if available else "")
            )
        else:
            entry = str(OmegaConf.select(cfg, f"{inst.config_key}.entrypoint", default="app.py"))
            if not (folder / entry).is_file():
                files = sorted(p.name for p in folder.glob("*.py"))
                problems.append(
                    f"'{inst.config_key}.entrypoint'{_loc(prov, inst.config_key + '.entrypoint')}: "
                    f"{folder / entry} does not exist."
                    + (f" Python files there: {', '.join(files)}." if files else "")
                )

    all_names = [i.name for i in instances]
    for inst in instances:
        block = OmegaConf.select(cfg, inst.config_key)
        for path, ref_type, ref_name in _iter_server_refs(block, inst.config_key):
            if ref_type not in SERVER_TYPES:
                problems.append(
                    f"'{path}.type'{_loc(prov, path + '.type')}: '{ref_type}' is not a server type."
                    f"{_did_you_mean(ref_type, SERVER_TYPES)} Server types: {', '.join(SERVER_TYPES)}."
                )
                continue
            if ref_name in by_type[ref_type] or ref_name in broken:  # broken ones are reported already
                continue
            if ref_name in all_names:
                actual = next(i.server_type for i in instances if i.name == ref_name)
                problems.append(
                    f"'{path}'{_loc(prov, path + '.name')} refers to '{ref_name}' as {ref_type}, "
                    f"but '{ref_name}' is a {actual} instance. Set `type: {actual}` or name a {ref_type} instance."
                )
                continue
            hint = _did_you_mean(ref_name, by_type[ref_type])
            known = ", ".join(by_type[ref_type]) or "none are configured"
            if not hint:
                defining = _configs_defining(ref_name, ref_type, loaded.root_dir)
                hint = (
                    f" It is defined in {', or '.join(defining)}: add that file to config_paths."
                    if defining
                    else " Did you forget to add its YAML to config_paths?"
                )
            problems.append(
                f"'{path}'{_loc(prov, path + '.name')} refers to {ref_type} instance '{ref_name}', "
                f"which does not exist.{hint} Known {ref_type} instances: {known}."
            )

    problems += option_problems(loaded, "ng_run")
    try:
        configured_port_range(cfg)
    except ValueError as e:
        problems.append(f"'{PORT_RANGE_LOW_KEY_NAME}'{_loc(prov, PORT_RANGE_LOW_KEY_NAME)}: {e}")
    for key in (GLOBAL_AIOHTTP_CONNECTOR_LIMIT_KEY_NAME, GLOBAL_AIOHTTP_CONNECTOR_LIMIT_PER_HOST_KEY_NAME):
        try:
            client_connection_limits(
                {key: OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)}
            )
        except ValueError as e:
            problems.append(f"'{key}'{_loc(prov, key)}: {e}")
    count, missing = _find_missing(cfg, prov)
    if missing:
        problems.append(
            f"Missing or unresolvable values ({count}). Set each on the command line as shown, "
            f"or under the same (nested) key in {ENV_YAML_FNAME}:\n      " + "\n      ".join(missing)
        )
    if problems:
        raise ConfigError(_format_problems("The configuration is not valid", problems))
    return instances


_CLI_WHERE = "command-line override"
_TYPO_CUTOFF = 0.8  # difflib ratio: 'startup_timout_s' vs 'startup_timeout_s' is 0.97, 'log_dir_path' 0.74


def _interpolated_top_keys(cfg: DictConfig) -> set[str]:
    """The top-level keys that some ``${...}`` interpolation in ``cfg`` refers to."""
    out: set[str] = set()
    for path, node in _iter_leaves(cfg, ""):
        raw = node._value() if hasattr(node, "_value") else None
        if not isinstance(raw, str) or "${" not in raw:
            continue
        for ref in _INTERP_RE.findall(raw):
            ref = ref.strip()
            if ref.startswith("oc.select:"):  # ${oc.select:key,default}
                ref = ref.partition(":")[2].partition(",")[0].strip()
            elif ":" in ref:  # another resolver (oc.env:...): not a config key
                continue
            out.add(re.split(r"[.\[]", _absolute_ref(ref, path), maxsplit=1)[0])
    return out


def option_problems(loaded: LoadedConfig, command: str, strict_cli: bool = False) -> list[str]:
    """Top-level keys of ``loaded`` that are mistyped options of ``command`` (one line each).

    A top-level key is fine when it is an option of ``command`` (:data:`COMMAND_OPTIONS`), of another
    command (config files are shared), a server instance block, set in env.yaml, or used by a
    ``${...}`` interpolation. Any other key is reported when it is close to an option of ``command``
    ("did you mean"); with ``strict_cli``, every such key set on the command line is reported (for
    commands that read nothing but their options). Unknown keys under ``head_server`` are reported too.
    """
    cfg, prov = loaded.config, loaded.provenance
    known = COMMAND_OPTIONS[command]
    shared = frozenset().union(*COMMAND_OPTIONS.values())
    from_cli = {k.split(".")[0] for k, where in prov.locations.items() if where.startswith(_CLI_WHERE)}
    referenced: set[str] | None = None  # computed on first need: a walk over the whole config
    problems = []
    for name in map(str, cfg.keys()):
        if name in known:
            continue
        where = _loc(prov, name)
        if strict_cli and name in from_cli:
            hint = _did_you_mean(name, sorted(known), prefix="+") or f" Options: {', '.join(sorted(known))}."
            problems.append(f"'+{name}'{where} is not an option of {command}.{hint}")
            continue
        if name in UPSTREAM_NO_EFFECT_KEYS or name in UPSTREAM_KEYS_USED_ELSEWHERE:
            continue
        candidates = known | UPSTREAM_NO_EFFECT_KEYS if command == "ng_run" else known
        near = _close(name, sorted(candidates), _TYPO_CUTOFF)
        if not near or name in shared or name in loaded.env_yaml_data:
            continue
        node = cfg._get_node(name)
        if isinstance(node, DictConfig) and any(
            k in SERVER_TYPES or _close(str(k), SERVER_TYPES, 0.75) for k in node
        ):
            continue  # a server instance (a broken one is reported by the instance checks)
        if referenced is None:
            referenced = _interpolated_top_keys(cfg)
        if name in referenced:
            continue
        problems.append(
            f"Top-level key '{name}'{where} is not an option of {command} and nothing refers to it. "
            f"Did you mean {' or '.join(repr(m) for m in near)}? (A top-level key that is not an option "
            "must be a server instance, be set in env.yaml, or be used by a ${...} interpolation.)"
        )
    head = (
        cfg._get_node(HEAD_SERVER_KEY_NAME)
        if HEAD_SERVER_KEY_NAME in known and HEAD_SERVER_KEY_NAME in cfg
        else None
    )
    if isinstance(head, DictConfig):
        for key in map(str, head.keys()):
            if key not in HEAD_SERVER_KEYS:
                dotted = f"{HEAD_SERVER_KEY_NAME}.{key}"
                problems.append(
                    f"'{dotted}'{_loc(prov, dotted)} is not a head server setting."
                    + (_did_you_mean(key, sorted(HEAD_SERVER_KEYS), prefix=HEAD_SERVER_KEY_NAME + ".") or "")
                    + f" Settings: {', '.join(f'{HEAD_SERVER_KEY_NAME}.{k}' for k in sorted(HEAD_SERVER_KEYS))}."
                )
    return problems


def check_options(loaded: LoadedConfig, command: str, strict_cli: bool = False) -> None:
    """Raise one ConfigError listing :func:`option_problems` (for commands other than ng_run)."""
    problems = option_problems(loaded, command, strict_cli)
    if problems:
        raise ConfigError(_format_problems(f"Unknown {command} options", problems))


def _configs_defining(name: str, server_type: str, root_dir: Path, limit: int = 3) -> list[str]:
    """Server config files (``<server_type>/*/configs/*.yaml``) that define instance ``name``."""
    found: list[str] = []
    for base in dict.fromkeys((root_dir, PACKAGE_PARENT_DIR)):
        for path in sorted(base.glob(f"{server_type}/*/configs/*.yaml")):
            try:
                data = yaml.safe_load(path.read_text())
            except (OSError, yaml.YAMLError):
                continue
            if isinstance(data, dict) and isinstance(data.get(name), dict) and server_type in data[name]:
                rel = str(path.relative_to(base))
                if rel not in found:
                    found.append(rel)
            if len(found) >= limit:
                return found
    return found


def _available_impls(server_type: str, root_dir: Path) -> list[str]:
    names: set[str] = set()
    for base in (root_dir, PACKAGE_PARENT_DIR):
        d = base / server_type
        if d.is_dir():
            names.update(p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
    return sorted(names)


# --------------------------------------------------------------------------------------------------
# Redaction (the rules live in nemo_gym.redaction).


def redact(value: Any) -> Any:
    """A copy of a plain config with secrets hidden, scrubbed with its own secret values.

    Kept for callers of the old name; see :func:`nemo_gym.redaction.redact_config`.
    """
    return redact_config(value)


# --------------------------------------------------------------------------------------------------
# The child-server side and the Python API.


class GlobalConfigDictParserConfig(BaseModel):
    """How to build the global config; upstream NeMo Gym's fields, each honoured.

    * ``dotenv_path``: the env.yaml-style file to read (default: ``env.yaml`` in the working
      directory). A path that does not exist loads nothing, as upstream, but says so on stderr.
    * ``initial_global_config_dict``: values a program passes; they beat the YAML files and env.yaml,
      the command line beats them. Its ``config_paths`` are loaded.
    * ``skip_load_from_cli``: do not read ``sys.argv`` overrides (``cli_args`` gives them explicitly).
    * ``skip_load_from_dotenv`` (alias ``skip_load_from_env_yaml``, our earlier name): load no env.yaml.
    * ``hide_secrets``: :func:`get_global_config_dict` / :meth:`GlobalConfigDictParser.parse` return
      the config with secret values replaced (:mod:`nemo_gym.redaction`).
    * ``offline``: accepted for upstream code; our parser never touches the network or probes ports
      (ports are bound by the launcher), so parsing is always offline.

    An unknown field is an error naming it (never silently dropped).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid", populate_by_name=True)

    dotenv_path: Path | None = None
    initial_global_config_dict: dict | DictConfig | None = None
    skip_load_from_cli: bool = False
    skip_load_from_dotenv: bool = Field(default=False, alias="skip_load_from_env_yaml")
    hide_secrets: bool = False
    offline: bool = False
    cli_args: list[str] | None = None

    # Upstream's constant for parsing without a model: empty policy values and a placeholder model.
    NO_MODEL_GLOBAL_CONFIG_DICT: ClassVar[dict[str, Any]] = {
        POLICY_BASE_URL_KEY_NAME: "",
        POLICY_API_KEY_KEY_NAME: "",
        POLICY_MODEL_NAME_KEY_NAME: "",
    }

    @model_validator(mode="before")
    @classmethod
    def _name_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = set(cls.model_fields) | {"skip_load_from_env_yaml"}
            unknown = [str(k) for k in data if k not in known]
            if unknown:
                hints = "".join(_did_you_mean(k, sorted(known)) for k in unknown)
                raise ValueError(
                    f"GlobalConfigDictParserConfig got unknown field(s) {unknown}.{hints} "
                    f"Fields: {', '.join(sorted(known))}."
                )
            if "skip_load_from_env_yaml" in data and "skip_load_from_dotenv" in data:
                if bool(data["skip_load_from_env_yaml"]) != bool(data["skip_load_from_dotenv"]):
                    raise ValueError(
                        "GlobalConfigDictParserConfig: skip_load_from_env_yaml and skip_load_from_dotenv are "
                        "the same setting and were given different values; pass only skip_load_from_dotenv."
                    )
                data = {k: v for k, v in data.items() if k != "skip_load_from_env_yaml"}
        return data

    @property
    def skip_load_from_env_yaml(self) -> bool:
        """Our earlier name of :attr:`skip_load_from_dotenv`."""
        return self.skip_load_from_dotenv

    def initial_dict(self) -> dict | None:
        """``initial_global_config_dict`` as a plain dict (interpolations kept as written)."""
        initial = self.initial_global_config_dict
        if isinstance(initial, DictConfig):
            return OmegaConf.to_container(initial, resolve=False)  # type: ignore[return-value]
        return None if initial is None else dict(initial)

    def argv(self) -> list[str]:
        """The command-line overrides to apply: ``cli_args``, else ``sys.argv[1:]`` unless skipped."""
        import sys

        if self.cli_args is not None:
            return list(self.cli_args)
        return [] if self.skip_load_from_cli else sys.argv[1:]

    def load(self, cwd: Path | None = None) -> LoadedConfig:
        """Load and merge the config these settings describe (see :func:`load_global_config`)."""
        return load_global_config(
            self.argv(),
            initial_global_config_dict=self.initial_dict(),
            cwd=cwd,
            load_env_yaml=not self.skip_load_from_dotenv,
            env_yaml_path=self.dotenv_path,
        )


class GlobalConfigDictParser:
    """Upstream's parser class: ``GlobalConfigDictParser().parse(parser_config) -> DictConfig``.

    ``parse`` loads (:func:`load_global_config`) and validates (:func:`validate_global_config`, which
    raises one :class:`ConfigError` listing every problem) the config. Ports are not assigned here:
    our launcher binds them when it starts the servers.
    """

    def parse(self, parse_config: GlobalConfigDictParserConfig | None = None) -> DictConfig:
        parse_config = parse_config or GlobalConfigDictParserConfig()
        loaded = parse_config.load()
        validate_global_config(loaded)
        if parse_config.hide_secrets:
            return OmegaConf.create(redact_config(OmegaConf.to_container(loaded.config, resolve=False)))
        return loaded.config

    def parse_no_environment(self, initial_global_config_dict: dict | DictConfig | None = None) -> DictConfig:
        """Parse ``initial_global_config_dict`` alone: no command line, no env.yaml."""
        return self.parse(
            GlobalConfigDictParserConfig(
                initial_global_config_dict=initial_global_config_dict,
                skip_load_from_cli=True,
                skip_load_from_dotenv=True,
            )
        )


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


def get_first_server_config_dict(global_config_dict: DictConfig | dict, top_level_path: str) -> DictConfig:
    """The impl block of server instance ``top_level_path`` (``cfg[name][<server_type>][<impl>]``).

    Raises ``KeyError`` naming the known instances when there is no such instance.
    """
    block = global_config_dict.get(top_level_path) if hasattr(global_config_dict, "get") else None
    if not hasattr(block, "keys") or not block:
        known = [
            str(k)
            for k, v in global_config_dict.items()
            if hasattr(v, "keys") and any(str(t) in SERVER_TYPES for t in v.keys())
        ]
        raise KeyError(f"No server instance named {top_level_path!r}. Known instances: {known}")
    type_block = next(iter(block.values()))
    impl_block = next(iter(type_block.values())) if hasattr(type_block, "values") else None
    if impl_block is None:
        raise KeyError(
            f"Server instance {top_level_path!r} has no impl block (<server_type>: {{<impl>: ...}})."
        )
    return impl_block if isinstance(impl_block, DictConfig) else OmegaConf.create(impl_block)


def get_hf_token() -> str | None:
    """``hf_token`` from the process's config (env.yaml), else the ``HF_TOKEN`` environment variable."""
    cfg = current_global_config_dict()
    token = OmegaConf.select(cfg, HF_TOKEN_KEY_NAME, default=None) if cfg is not None else None
    return str(token) if token else os.environ.get("HF_TOKEN") or None


def find_open_port(disallowed_ports: list[int] | None = None, max_retries: int = 50) -> int:
    """A TCP port free on this machine right now and not in ``disallowed_ports``.

    The port may be taken by someone else before it is used; our launcher never relies on this (it
    binds its sockets itself, see :mod:`nemo_gym.ports`). Raises ``RuntimeError`` after ``max_retries``.
    """
    import socket

    disallowed = set(disallowed_ports or ())
    for _ in range(max(1, max_retries)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        if port not in disallowed:
            return port
    raise RuntimeError(f"No free port outside {sorted(disallowed)} after {max_retries} tries.")


def client_connection_limits(cfg: DictConfig | dict | None = None) -> tuple[int, int | None]:
    """``(total, per_host)`` connection limits for this process's HTTP client pools.

    From ``global_aiohttp_connector_limit`` (default 1024) and
    ``global_aiohttp_connector_limit_per_host`` (default: no limit beyond the total) in ``cfg`` (default:
    the config this process holds). A value that is not a positive integer raises ``ValueError`` naming
    the key.
    """
    if cfg is None:
        cfg = current_global_config_dict()
    out: list[int | None] = []
    for key, default in (
        (GLOBAL_AIOHTTP_CONNECTOR_LIMIT_KEY_NAME, DEFAULT_CONNECTION_LIMIT),
        (GLOBAL_AIOHTTP_CONNECTOR_LIMIT_PER_HOST_KEY_NAME, None),
    ):
        raw = cfg.get(key) if cfg is not None else None
        if raw is None:
            out.append(default)
            continue
        try:
            value = int(raw)
        except (TypeError, ValueError):
            value = 0
        if value < 1 or isinstance(raw, bool):
            raise ValueError(f"{key} must be a positive integer (a connection count), got {raw!r}")
        out.append(value)
    return out[0] or DEFAULT_CONNECTION_LIMIT, out[1]


def configured_port_range(cfg: DictConfig | dict) -> tuple[int, int] | None:
    """``(port_range_low, port_range_high)`` when either is set (upstream's defaults fill the other:
    10001 and 20000), else None (the system picks any free port). Raises ``ValueError`` on a bad range."""
    low, high = cfg.get(PORT_RANGE_LOW_KEY_NAME), cfg.get(PORT_RANGE_HIGH_KEY_NAME)
    if low is None and high is None:
        return None
    try:
        lo, hi = int(10001 if low is None else low), int(20000 if high is None else high)
    except (TypeError, ValueError):
        raise ValueError(
            f"port_range_low / port_range_high must be port numbers, got {low!r} / {high!r}"
        ) from None
    if not 1 <= lo < hi <= 65536:
        raise ValueError(
            f"port_range_low ({lo}) must be below port_range_high ({hi}), both within 1..65536 "
            "(the range is [low, high))"
        )
    return lo, hi


def no_effect_upstream_keys(cfg: DictConfig | dict) -> list[str]:
    """The top-level keys of ``cfg`` that upstream NeMo Gym reads and this project ignores."""
    return sorted(str(k) for k in cfg.keys() if str(k) in UPSTREAM_NO_EFFECT_KEYS)


def connector_limits(server_config: Any = None) -> tuple[int, int]:
    """``(limit, limit_per_host)`` for an aiohttp ``TCPConnector`` of a model server (0 = no cap).

    The server's own ``max_connections`` wins when its config sets it; else the global
    ``global_aiohttp_connector_limit`` / ``..._per_host`` keys (:func:`client_connection_limits`).
    """
    total, per_host = client_connection_limits()
    if server_config is not None and "max_connections" in getattr(server_config, "model_fields_set", ()):
        total = int(server_config.max_connections)
    return total, per_host or 0


def config_to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=False)
