"""Upstream NeMo Gym's module path ``nemo_gym.global_config``, kept as a thin face for code written against upstream.

It holds exactly upstream's public names here that we implement, each imported from the module of ours
that defines it; the code and its contract live in :mod:`nemo_gym.config.process`. Our own code imports from the
defining modules (tests/test_architecture.py checks both).
"""

from __future__ import annotations

from nemo_gym import CACHE_DIR, RESULTS_DIR, WORKING_DIR
from nemo_gym.config.instances import (
    environment_server_agent_names,
    environment_server_agent_refs,
    get_first_server_config_dict,
)
from nemo_gym.config.keys import (
    AGENT_REF_KEY_NAME,
    AGENT_SERVER_REF_KEY_NAME,
    AGENT_SERVER_TYPE_KEY_NAME,
    ATTEMPT_INDEX_KEY_NAME,
    CACHE_DIR_KEY_NAME,
    CONFIG_PATHS_KEY_NAME,
    DEFAULT_HEAD_SERVER_PORT,
    DEFAULT_HOST_KEY_NAME,
    DISALLOWED_PORTS_KEY_NAME,
    ENTRYPOINT_KEY_NAME,
    ENVIRONMENT_ROUTING_MODE_KEY_NAME,
    ENVIRONMENT_SERVER_NAME_KEY_NAME,
    ENVIRONMENT_SERVER_ROUTES_KEY_NAME,
    ENVIRONMENT_SERVER_STAMP_KEY_NAME,
    ENVIRONMENT_SERVER_TYPE_KEY_NAME,
    HEAD_SERVER_KEY_NAME,
    HF_TOKEN_KEY_NAME,
    NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME,
    NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME,
    POLICY_API_KEY_KEY_NAME,
    POLICY_BASE_URL_KEY_NAME,
    POLICY_MODEL_KEY_NAME,
    POLICY_MODEL_NAME_KEY_NAME,
    PORT_RANGE_HIGH_KEY_NAME,
    PORT_RANGE_LOW_KEY_NAME,
    RAY_HEAD_NODE_ADDRESS_KEY_NAME,
    RESPONSE_KEY_NAME,
    RESPONSES_CREATE_PARAMS_KEY_NAME,
    RESULTS_DIR_KEY_NAME,
    ROLLOUT_ID_KEY_NAME,
    ROLLOUT_INDEX_KEY_NAME,
    SKILLS_REF_KEY_NAME,
    TASK_INDEX_KEY_NAME,
)
from nemo_gym.config.network import find_open_port
from nemo_gym.config.parser import GlobalConfigDictParser, GlobalConfigDictParserConfig
from nemo_gym.config.problems import ConfigError
from nemo_gym.config.process import (
    get_global_config_dict,
    get_hf_token,
    maybe_get_global_config_dict,
    set_global_config_dict,
)
from nemo_gym.config.types import is_server_ref

__all__ = [
    "AGENT_REF_KEY_NAME",
    "AGENT_SERVER_REF_KEY_NAME",
    "AGENT_SERVER_TYPE_KEY_NAME",
    "ENVIRONMENT_ROUTING_MODE_KEY_NAME",
    "ENVIRONMENT_SERVER_NAME_KEY_NAME",
    "ENVIRONMENT_SERVER_ROUTES_KEY_NAME",
    "ENVIRONMENT_SERVER_STAMP_KEY_NAME",
    "ENVIRONMENT_SERVER_TYPE_KEY_NAME",
    "environment_server_agent_names",
    "environment_server_agent_refs",
    "ATTEMPT_INDEX_KEY_NAME",
    "CACHE_DIR",
    "CACHE_DIR_KEY_NAME",
    "CONFIG_PATHS_KEY_NAME",
    "ConfigError",
    "DEFAULT_HEAD_SERVER_PORT",
    "DEFAULT_HOST_KEY_NAME",
    "DISALLOWED_PORTS_KEY_NAME",
    "ENTRYPOINT_KEY_NAME",
    "GlobalConfigDictParser",
    "GlobalConfigDictParserConfig",
    "HEAD_SERVER_KEY_NAME",
    "HF_TOKEN_KEY_NAME",
    "NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME",
    "NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME",
    "POLICY_API_KEY_KEY_NAME",
    "POLICY_BASE_URL_KEY_NAME",
    "POLICY_MODEL_KEY_NAME",
    "POLICY_MODEL_NAME_KEY_NAME",
    "PORT_RANGE_HIGH_KEY_NAME",
    "PORT_RANGE_LOW_KEY_NAME",
    "RAY_HEAD_NODE_ADDRESS_KEY_NAME",
    "RESPONSES_CREATE_PARAMS_KEY_NAME",
    "RESPONSE_KEY_NAME",
    "RESULTS_DIR",
    "RESULTS_DIR_KEY_NAME",
    "ROLLOUT_ID_KEY_NAME",
    "ROLLOUT_INDEX_KEY_NAME",
    "SKILLS_REF_KEY_NAME",
    "TASK_INDEX_KEY_NAME",
    "WORKING_DIR",
    "find_open_port",
    "get_first_server_config_dict",
    "get_global_config_dict",
    "get_hf_token",
    "is_server_ref",
    "maybe_get_global_config_dict",
    "set_global_config_dict",
]
