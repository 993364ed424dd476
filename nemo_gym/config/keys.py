"""The names of the global configuration: top-level keys, row keys, environment variables, defaults.

Contract
--------
* Plain constants, no behaviour; each value equals upstream NeMo Gym's where upstream has the name,
  so code written for it (``from nemo_gym.global_config import TASK_INDEX_KEY_NAME``) is unchanged.
* :data:`PACKAGE_PARENT_DIR` is the repository root of an editable install: server folders and
  config files are looked up relative to the working directory first, then there.
"""

from __future__ import annotations

from pathlib import Path

SERVER_TYPES: tuple[str, ...] = (
    "resources_servers",
    "responses_api_agents",
    "responses_api_models",
    # NeMo Gym 0.7's fourth kind: a server that owns whole episodes (nemo_gym.server.environment).
    "environment_servers",
)
ENVIRONMENT_SERVER_TYPE_KEY_NAME = "environment_servers"
AGENT_SERVER_TYPE_KEY_NAME = "responses_api_agents"
# The field of an environment server's config that names the agent it fronts.
AGENT_SERVER_REF_KEY_NAME = "agent_server"
HEAD_SERVER_KEY_NAME = "head_server"
CONFIG_PATHS_KEY_NAME = "config_paths"
# ``+env=<name>``: load the environment's default config (configs/<name>.yaml) before config_paths.
ENV_KEY_NAME = "env"
DEFAULT_HEAD_SERVER_HOST = "127.0.0.1"
DEFAULT_HEAD_SERVER_PORT = 11000

NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME = "NEMO_GYM_CONFIG_DICT"
NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME = "NEMO_GYM_CONFIG_PATH"
NEMO_GYM_SESSION_SECRET_ENV_VAR_NAME = "NEMO_GYM_SESSION_SECRET"
NEMO_GYM_LISTEN_FD_ENV_VAR_NAME = "NEMO_GYM_LISTEN_FD"
NEMO_GYM_PARENT_PID_ENV_VAR_NAME = "NEMO_GYM_PARENT_PID"
# "<write fd>,<read fd>": the server reports whether its config is valid, then waits for "go".
NEMO_GYM_VALIDATION_FDS_ENV_VAR_NAME = "NEMO_GYM_VALIDATION_FDS"
# A file path: the launcher and every server append one JSON line per start-up phase they reach
# (nemo_gym.server.startup.startup_mark; read by python -m nemo_gym.tools.bench.startup).
NEMO_GYM_STARTUP_TRACE_ENV_VAR_NAME = "NEMO_GYM_STARTUP_TRACE"
# ng_run's switch of the fork server (nemo_gym.run.zygote): servers forked from one process that has
# imported the web stack once (default true; false starts each server as its own interpreter).
FORK_SERVER_KEY_NAME = "fork_server"

ENV_YAML_FNAME = "env.yaml"

# Names upstream NeMo Gym code imports from nemo_gym.global_config (same values as upstream).
# Keys of a task row / rollout result:
TASK_INDEX_KEY_NAME = "_ng_task_index"
ROLLOUT_INDEX_KEY_NAME = "_ng_rollout_index"
ATTEMPT_INDEX_KEY_NAME = "_ng_attempt_index"
ROLLOUT_ID_KEY_NAME = "_ng_rollout_id"
RESPONSES_CREATE_PARAMS_KEY_NAME = "responses_create_params"
RESPONSE_KEY_NAME = "response"
AGENT_REF_KEY_NAME = "agent_ref"
SKILLS_REF_KEY_NAME = "skills_ref"
# The environment server a row was dispatched through (stamped on the row and its result).
ENVIRONMENT_SERVER_STAMP_KEY_NAME = "_ng_environment_server"
# Collection options that route rows through environment servers (upstream 0.7's names).
ENVIRONMENT_ROUTING_MODE_KEY_NAME = "environment_routing_mode"
ENVIRONMENT_SERVER_NAME_KEY_NAME = "environment_server_name"
ENVIRONMENT_SERVER_ROUTES_KEY_NAME = "environment_server_routes"
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
# ``nemo_gym.config.process.client_connection_limits``).
GLOBAL_AIOHTTP_CONNECTOR_LIMIT_KEY_NAME = "global_aiohttp_connector_limit"
GLOBAL_AIOHTTP_CONNECTOR_LIMIT_PER_HOST_KEY_NAME = "global_aiohttp_connector_limit_per_host"
DEFAULT_CONNECTION_LIMIT = 1024
# ng_run's waits (``startup_timeout_s``, ``shutdown_timeout_s``), applied by nemo_gym.run.supervision.core.
DEFAULT_STARTUP_TIMEOUT_S = 120.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 3.0

# The repository root when installed editable (``pip install -e .``): server folders and configs are
# looked up relative to the working directory first, then here.
PACKAGE_PARENT_DIR = Path(__file__).resolve().parent.parent.parent
