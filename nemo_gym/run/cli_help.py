"""``--help`` texts of the launcher commands (``ng_run``, ``ng_dump_config``, ``ng_status``).

Contract
--------
* The options a help text lists are the command's entries of :data:`nemo_gym.config.options.COMMAND_OPTIONS`
  (the registry its config is checked against), so an option added there appears in ``--help``; its
  one-line description comes from :func:`option_help` (a test fails when one is missing; until then
  the option is still listed, marked undescribed). ``head_server`` is listed as its settings
  (``head_server.host``, ``head_server.port``).
* The per-instance keys listed for ``ng_run`` are the fields of the server-instance config model
  (:class:`nemo_gym.config.types.BaseRunServerInstanceConfig`) minus the ones the launcher fills in.
* Defaults quoted are the constants the code applies, imported from where they are defined.
"""

from __future__ import annotations

import textwrap

from nemo_gym.config.keys import (
    DEFAULT_CONNECTION_LIMIT,
    DEFAULT_HEAD_SERVER_PORT,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_STARTUP_TIMEOUT_S,
    HEAD_SERVER_KEY_NAME,
)
from nemo_gym.config.options import COMMAND_OPTIONS, HEAD_SERVER_KEYS
from nemo_gym.config.tracing import DEFAULT_TRACING_ENDPOINT


def _mib(n: int) -> str:
    return f"{n // 2**20} MiB" if n % 2**20 == 0 else str(n)


def option_help() -> dict[str, tuple[str, str]]:
    """option -> (value placeholder, one line: what it does, with the default the code uses)."""
    # Imported here: the defaults live with the code that applies them (no copies to drift).
    from nemo_gym.auth import DEFAULT_MAX_REQUEST_BODY_BYTES
    from nemo_gym.run.ray import DEFAULT_LOCAL_OBJECT_STORE_MB
    from nemo_gym.run.server_venvs import DEFAULT_VENV_CACHE_DIR
    from nemo_gym.server.accept_limit import (
        DEFAULT_KEEP_ALIVE_TIMEOUT_S,
        DEFAULT_REQUEST_BODY_IDLE_TIMEOUT_S,
        DEFAULT_REQUEST_HEAD_TIMEOUT_S,
        DEFAULT_RESERVED_CONNECTION_FRACTION,
    )
    from nemo_gym.server.model_calls import DEFAULT_MAX_BYTES, DEFAULT_MAX_CALLS

    return {
        "config_paths": ("[a.yaml,b.yaml]", "YAML files to load, in order (they may list more config_paths)"),
        "env": (
            "NAME",
            "load environment NAME's default config (configs/NAME.yaml of its folder or package; ng_list) "
            "before config_paths; a model config is still needed",
        ),
        f"{HEAD_SERVER_KEY_NAME}.host": (
            "HOST",
            "where the head server listens (default default_host, else 127.0.0.1)",
        ),
        f"{HEAD_SERVER_KEY_NAME}.port": (
            "PORT",
            f"the head server's port (default {DEFAULT_HEAD_SERVER_PORT}; 0 picks a free one); "
            "clients find the servers through it",
        ),
        "log_dir": ("DIR", "also write each server's output to DIR/<instance>.log (default: terminal only)"),
        "startup_timeout_s": (
            "SECONDS",
            f"fail when the servers do not all answer within this (default {DEFAULT_STARTUP_TIMEOUT_S:g})",
        ),
        "shutdown_timeout_s": (
            "SECONDS",
            f"how long stopping may take before servers are killed (default {DEFAULT_SHUTDOWN_TIMEOUT_S:g})",
        ),
        "isolate_server_venvs": (
            "true",
            "run each server folder that has a requirements.txt in its own venv, built once and reused",
        ),
        "venv_cache_dir": ("DIR", f"where isolated venvs live (default {DEFAULT_VENV_CACHE_DIR})"),
        "fork_server": (
            "false",
            "start every server as its own interpreter instead of forking it from one process that "
            "imported the web stack once (default true; a server with its own venv is never forked)",
        ),
        "server_auth": ("false", "switch the run-token check off for this run (loudly; docs/security.md)"),
        "max_request_body_bytes": (
            "N",
            f"every server's request body limit unless its block sets one (default {_mib(DEFAULT_MAX_REQUEST_BODY_BYTES)})",
        ),
        "request_head_timeout_s": (
            "SECONDS",
            "close a connection that has not sent a whole request head within this "
            f"(default {DEFAULT_REQUEST_HEAD_TIMEOUT_S:g}; a server's block may set its own)",
        ),
        "request_body_idle_timeout_s": (
            "SECONDS",
            f"close a connection whose request body stalls this long (default {DEFAULT_REQUEST_BODY_IDLE_TIMEOUT_S:g})",
        ),
        "keep_alive_timeout_s": (
            "SECONDS",
            f"close a connection idle between requests after this (default {DEFAULT_KEEP_ALIVE_TIMEOUT_S:g})",
        ),
        "reserved_connection_fraction": (
            "F",
            "share of each server's connections kept for clients that sent the run token "
            f"(default {DEFAULT_RESERVED_CONNECTION_FRACTION:g})",
        ),
        "global_aiohttp_connector_limit": (
            "N",
            f"most HTTP connections each process's client pool keeps busy (default {DEFAULT_CONNECTION_LIMIT})",
        ),
        "global_aiohttp_connector_limit_per_host": (
            "N",
            "most connections to one host:port at once (default: no cap)",
        ),
        "default_host": ("HOST", "the address servers without their own host listen on (default 127.0.0.1)"),
        "port_range_low": (
            "PORT",
            "servers without a port get a free one in [low, high) (default: any free port)",
        ),
        "port_range_high": ("PORT", "the upper end (exclusive) of the port_range_low range"),
        "ray_head_node_address": ("HOST:PORT", "join this Ray cluster, e.g. a trainer's (docs/ray.md)"),
        "ray_start_local": ("true", "start a private one-node Ray cluster for the run; stopped at the end"),
        "ray_local_num_cpus": ("N", "CPUs of the +ray_start_local cluster (default: all)"),
        "ray_local_object_store_mb": (
            "MB",
            f"object store of the +ray_start_local cluster (default {DEFAULT_LOCAL_OBJECT_STORE_MB})",
        ),
        "observability_enabled": ("true", "record every model call of each rollout (docs/trainers.md)"),
        "metrics_enabled": (
            "false",
            "no Prometheus GET /metrics on the servers (default on; docs/observability.md)",
        ),
        "tracing": (
            "otlp",
            "an OpenTelemetry trace per rollout, spans sent over OTLP/HTTP (needs the tracing extra; "
            "docs/observability.md)",
        ),
        "tracing_endpoint": ("URL", f"where +tracing=otlp sends spans (default {DEFAULT_TRACING_ENDPOINT})"),
        "model_call_capture_max_calls": (
            "N",
            f"most calls a model server keeps for capture (default {DEFAULT_MAX_CALLS})",
        ),
        "model_call_capture_max_bytes": (
            "N",
            f"most body bytes a model server keeps for capture (default {_mib(DEFAULT_MAX_BYTES)})",
        ),
    }


HELP_WIDTH = 110  # columns of the help text

# Keys of a server instance's block the launcher fills in itself (not for users to set).
_FILLED_IN = frozenset({"name", "replicas"})

GENERIC = """\
Configuration uses Hydra override syntax: +key=value adds a value, ++key=value also overrides one a
config file sets, ~key deletes one, dotted keys reach inside (+head_server.port=11001). env.yaml in
the working directory is merged over the YAML files (secrets: policy_base_url, policy_api_key,
policy_model_name); the command line wins over both. Mistakes are reported before anything starts."""


def option_lines(command: str) -> list[tuple[str, str]]:
    """``(+key=VALUE, description)`` for each option of ``command``, sorted; ``config_paths`` first."""
    keys: list[str] = []
    for key in sorted(COMMAND_OPTIONS[command]):
        if key == HEAD_SERVER_KEY_NAME:
            keys += [f"{HEAD_SERVER_KEY_NAME}.{k}" for k in sorted(HEAD_SERVER_KEYS)]
        else:
            keys.append(key)
    keys.sort(key=lambda k: (k != "config_paths", k))
    described = option_help()
    out = []
    for key in keys:
        value, text = described.get(key, ("VALUE", "(undescribed)"))
        out.append((f"+{key}={value}", text))
    return out


def instance_keys() -> list[str]:
    """The keys a server instance's block may set (the instance config model's fields)."""
    from nemo_gym.config.types import BaseRunServerInstanceConfig

    return [k for k in BaseRunServerInstanceConfig.model_fields if k not in _FILLED_IN]


def command_help(command: str, summary: str, usage: str, examples: list[str], docs: str) -> str:
    """The whole ``--help`` text of ``command``."""
    rows = option_lines(command)
    width = min(max(len(flag) for flag, _ in rows), 44)
    parts = [f"{command}: {summary}", "", f"usage: {usage}", "", "Examples:"]
    parts += [f"  {e}" for e in examples]
    parts += ["", "Options:"]
    indent = " " * (width + 4)
    for flag, text in rows:
        first = f"  {flag}" if len(flag) > width else f"  {flag:<{width}}  "
        lines = textwrap.wrap(text, HELP_WIDTH - len(indent)) or [""]
        if len(flag) > width:
            parts.append(first)
            parts += [indent + line for line in lines]
        else:
            parts.append(first + lines[0])
            parts += [indent + line for line in lines[1:]]
    if command in ("ng_run", "ng_dump_config"):
        parts += [
            "",
            "Per server instance, in its YAML block (or +<instance>.<server_type>.<impl>.<key>=value):",
        ]
        parts += textwrap.wrap(
            ", ".join(instance_keys()), HELP_WIDTH, initial_indent="  ", subsequent_indent="  "
        )
        parts += textwrap.wrap(
            "pass_env=[NAME,...] lets that server inherit launcher environment variables whose names look "
            "secret (OPENAI_API_KEY, HF_TOKEN, AWS_*); servers get none of them otherwise (docs/security.md).",
            HELP_WIDTH,
            initial_indent="  ",
            subsequent_indent="  ",
        )
    parts += ["", GENERIC, "", f"Docs: {docs}"]
    return "\n".join(parts)
