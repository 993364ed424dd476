"""Gymnasium-style resources servers: the :class:`GymnasiumServer` base (upstream's names) and its
request/response models; ``app.py`` is the generic wrapper of any text ``gymnasium.Env``."""

from resources_servers.gymnasium.base import (
    EnvResetRequest,
    EnvResetResponse,
    EnvStepRequest,
    EnvStepResponse,
    GymnasiumServer,
    extract_text,
)

__all__ = [
    "EnvResetRequest",
    "EnvResetResponse",
    "EnvStepRequest",
    "EnvStepResponse",
    "GymnasiumServer",
    "extract_text",
]
