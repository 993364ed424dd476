"""Upstream NeMo Gym's module path ``nemo_gym.mcp_auto_exposure``, kept as a thin face for code written against upstream.

It holds exactly upstream's public names here that we implement, each imported from the module of ours
that defines it; the code and its contract live in :mod:`nemo_gym.server.mcp_exposure`. Our own code imports from the
defining modules (tests/test_architecture.py checks both).
"""

from __future__ import annotations

from nemo_gym.server.asgi.sessions import SESSION_ID_KEY
from nemo_gym.server.mcp import (
    MCP_URL_PATH,
    NEMO_GYM_MCP_METADATA_KEY,
    NEMO_GYM_MCP_SESSION_TOKEN_HEADER,
    MCPServerMetadata,
)
from nemo_gym.server.mcp_exposure import TOKEN_HEADER, install_auto_exposure, maybe_auto_expose

__all__ = [
    "MCPServerMetadata",
    "MCP_URL_PATH",
    "NEMO_GYM_MCP_METADATA_KEY",
    "NEMO_GYM_MCP_SESSION_TOKEN_HEADER",
    "SESSION_ID_KEY",
    "TOKEN_HEADER",
    "install_auto_exposure",
    "maybe_auto_expose",
]
