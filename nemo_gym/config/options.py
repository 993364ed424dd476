"""The options registry: the top-level keys each command reads, and the check for mistyped ones.

Contract
--------
* :data:`COMMAND_OPTIONS` is the one registry of each command's top-level options (``+key=value``);
  ng_run's are :data:`LAUNCHER_KEYS`. A new option is added here, or a near miss of it is reported as
  a typo. Tests check it against each command's options model.
* :data:`UPSTREAM_NO_EFFECT_KEYS` are upstream NeMo Gym's top-level keys that have no effect here,
  accepted so that its configs and trainers start unchanged (:func:`no_effect_upstream_keys` names
  the ones a config sets); they are never typo errors (a near miss of one is).
* :func:`option_problems` reports a top-level key close to an option of the command unless it is a
  server instance, set in env.yaml, used by an interpolation, or another command's option (see the
  function for the rule); :func:`check_options` raises them as one :class:`ConfigError`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from nemo_gym.config.keys import (
    CACHE_DIR_KEY_NAME,
    CONFIG_PATHS_KEY_NAME,
    DEFAULT_HOST_KEY_NAME,
    DISALLOWED_PORTS_KEY_NAME,
    ENV_KEY_NAME,
    FORK_SERVER_KEY_NAME,
    GLOBAL_AIOHTTP_CONNECTOR_LIMIT_KEY_NAME,
    GLOBAL_AIOHTTP_CONNECTOR_LIMIT_PER_HOST_KEY_NAME,
    HEAD_SERVER_KEY_NAME,
    HF_TOKEN_KEY_NAME,
    PORT_RANGE_HIGH_KEY_NAME,
    PORT_RANGE_LOW_KEY_NAME,
    RAY_HEAD_NODE_ADDRESS_KEY_NAME,
    RESULTS_DIR_KEY_NAME,
    SERVER_TYPES,
)
from nemo_gym.config.missing import _INTERP_RE, _absolute_ref, _iter_leaves
from nemo_gym.config.problems import ConfigError, _close, _did_you_mean, _format_problems, _loc

if TYPE_CHECKING:  # a server process reads LAUNCHER_KEYS (nemo_gym.config.instances), never the loader
    from nemo_gym.config.loading import LoadedConfig

# Top-level keys the launcher itself understands (everything else is either a server instance or a
# free value such as ``policy_base_url`` that other values interpolate).
LAUNCHER_KEYS = {
    CONFIG_PATHS_KEY_NAME,
    ENV_KEY_NAME,
    HEAD_SERVER_KEY_NAME,
    "isolate_server_venvs",
    "venv_cache_dir",
    FORK_SERVER_KEY_NAME,  # nemo_gym.run.zygote
    "log_dir",
    "startup_timeout_s",
    "shutdown_timeout_s",
    "server_auth",  # nemo_gym.auth.SERVER_AUTH_KEY_NAME
    "max_request_body_bytes",  # nemo_gym.auth.MAX_REQUEST_BODY_BYTES_KEY_NAME: the default of every server
    # nemo_gym.server.accept_limit: the default of every server (each may set its own)
    "request_head_timeout_s",
    "request_body_idle_timeout_s",
    "keep_alive_timeout_s",
    "reserved_connection_fraction",
    GLOBAL_AIOHTTP_CONNECTOR_LIMIT_KEY_NAME,
    GLOBAL_AIOHTTP_CONNECTOR_LIMIT_PER_HOST_KEY_NAME,
    DEFAULT_HOST_KEY_NAME,
    PORT_RANGE_LOW_KEY_NAME,
    PORT_RANGE_HIGH_KEY_NAME,
    # Ray (nemo_gym.run.ray): join a cluster, or start a private local one.
    RAY_HEAD_NODE_ADDRESS_KEY_NAME,
    "ray_start_local",
    "ray_local_num_cpus",
    "ray_local_object_store_mb",
    # Model-call capture (nemo_gym.server.model_calls): upstream's switch, and our bounds of the store.
    "observability_enabled",
    "model_call_capture_max_calls",
    "model_call_capture_max_bytes",
    # Prometheus metrics (nemo_gym.server.metrics): GET /metrics on every server, on unless false.
    "metrics_enabled",
    # OpenTelemetry traces (nemo_gym.config.tracing): +tracing=otlp, and where spans go.
    "tracing",
    "tracing_endpoint",
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
    "observability_enabled", "metrics_port", "max_policy_lag", "stale_policy", "policy_version_model",
    "environment_routing_mode", "environment_server_name", "environment_server_routes",
)  # fmt: skip
# Experiment tracking (nemo_gym.collection.tracking.OPTION_KEYS besides ``tracker``; upstream's key names).
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
            "pass_env",
        }
    ),
    "ng_init_resources_server": frozenset({"entrypoint", "name", "package"}),
    "ng_list": frozenset({"kind", "json"}),  # nemo_gym.tools.server_list.parse_options
    # nemo_gym.tools.upstream_check.OPTION_HELP's keys
    "ng_check_upstream_env": frozenset(
        {
            "upstream_checkout",
            "upstream_wheel",
            "envs",
            "output",
            "keep_scratch",
            "scratch_dir",
            "test_timeout_s",
            "start_timeout_s",
            "verify_timeout_s",
            "venv_cache_dir",
            "replay_tool_calls",
            "run_tests",
            "imported_from",
            "install_timeout_s",
        }
    ),
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
    # nemo_gym.tools.eval.e2e.E2ECollectionConfig's fields, plus ng_run's (it starts the servers).
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
            "compare_metrics",
            "rounds",
            # +suite=collector (nemo_gym.tools.bench.collector)
            "suite",
            "row_counts",
            "num_samples_in_parallel",
            "num_repeats",
            "resume",
            # +suite=all (nemo_gym.tools.bench.suite)
            "parts",
            "quick",
            "envs",
            "env_config_fpath",
            "agent_name",
            "rows_jsonl_fpath",
            # +suite=streaming (nemo_gym.tools.bench.streaming)
            "requests",
            "concurrency",
            "local",
            "local_requests",
            "max_tokens",
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
            "request_head_timeout_s",
            "request_body_idle_timeout_s",
            "keep_alive_timeout_s",
            "reserved_connection_fraction",
        }
    ),
}


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


def no_effect_upstream_keys(cfg: DictConfig | dict) -> list[str]:
    """The top-level keys of ``cfg`` that upstream NeMo Gym reads and this project ignores."""
    return sorted(str(k) for k in cfg.keys() if str(k) in UPSTREAM_NO_EFFECT_KEYS)
