"""Upstream NeMo Gym's module path ``nemo_gym.server_utils``, kept as a thin face for code written against upstream.

It holds exactly upstream's public names here that we implement, each imported from the module of ours
that defines it; the code and its contract live in :mod:`nemo_gym.server.base`. Our own code imports from the
defining modules (tests/test_architecture.py checks both).
"""

from __future__ import annotations

from nemo_gym import WORKING_DIR
from nemo_gym.client.server_client import ServerClient, get_response_json
from nemo_gym.config.keys import (
    DEFAULT_HEAD_SERVER_PORT,
    HEAD_SERVER_KEY_NAME,
    NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME,
    RAY_HEAD_NODE_ADDRESS_KEY_NAME,
)
from nemo_gym.config.parser import GlobalConfigDictParser, GlobalConfigDictParserConfig
from nemo_gym.config.process import get_global_config_dict
from nemo_gym.config.types import (
    ROLLOUT_PATH_PREFIX,
    TOKEN_CAPTURE_PATH_SEGMENT,
    BaseRunServerInstanceConfig,
    BaseServerConfig,
)
from nemo_gym.errors import raise_for_status
from nemo_gym.server.asgi.sessions import SESSION_ID_KEY
from nemo_gym.server.base import (
    MAX_NUM_TRIES,
    BaseServer,
    SimpleServer,
    get_first_server_config_dict,
    get_server_url,
    is_nemo_gym_fastapi_entrypoint,
    request,
)
from nemo_gym.server.rollout_prefix import (
    apply_rollout_prefix,
    current_rollout_id,
    maybe_rollout_id_from_run_body,
    rollout_path_prefix,
)

__all__ = [
    "BaseRunServerInstanceConfig",
    "BaseServer",
    "BaseServerConfig",
    "DEFAULT_HEAD_SERVER_PORT",
    "GlobalConfigDictParser",
    "GlobalConfigDictParserConfig",
    "HEAD_SERVER_KEY_NAME",
    "MAX_NUM_TRIES",
    "NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME",
    "RAY_HEAD_NODE_ADDRESS_KEY_NAME",
    "ROLLOUT_PATH_PREFIX",
    "SESSION_ID_KEY",
    "ServerClient",
    "SimpleServer",
    "TOKEN_CAPTURE_PATH_SEGMENT",
    "WORKING_DIR",
    "apply_rollout_prefix",
    "current_rollout_id",
    "get_first_server_config_dict",
    "get_global_config_dict",
    "get_response_json",
    "get_server_url",
    "is_nemo_gym_fastapi_entrypoint",
    "maybe_rollout_id_from_run_body",
    "raise_for_status",
    "request",
    "rollout_path_prefix",
]
