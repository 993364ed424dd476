"""Upstream NeMo Gym's module path for serving a resources server's tool routes over MCP.

Contract
--------
* ``maybe_auto_expose(server, app)`` serves ``server``'s tools over MCP at ``/mcp`` on ``app`` when its
  config sets ``expose_tools_over_mcp: true``, and does nothing otherwise. It returns whether ``app``
  serves MCP afterwards.
* It is idempotent: :meth:`SimpleResourcesServer.setup_webserver` already installs MCP for a server
  with the flag set (so ``ng_run`` needs no extra call); calling ``maybe_auto_expose`` on that app, as
  upstream's own tests and launch code do, leaves it is.
* An app that already routes ``/mcp`` by other means (a server that mounted its own MCP endpoint) is
  refused with a :class:`ValueError` naming the server, rather than served twice.
* The serving itself (tools/list, tools/call bound to the seeded session, the ``"mcp"`` key of
  ``/seed_session`` answers and its ``X-NeMo-Gym-Session-Token`` header) is :mod:`nemo_gym.server.mcp`'s; see
  there for how it differs from upstream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI

from nemo_gym.server.mcp import MCP_URL_PATH, NEMO_GYM_MCP_SESSION_TOKEN_HEADER, install_mcp, mcp_installed

if TYPE_CHECKING:
    from nemo_gym.server.resources import SimpleResourcesServer

# Upstream's alias for the per-rollout session-token header an MCP client sends on every call.
TOKEN_HEADER = NEMO_GYM_MCP_SESSION_TOKEN_HEADER


def _routes_mcp(app: FastAPI) -> bool:
    return any(getattr(route, "path", None) == MCP_URL_PATH for route in app.router.routes)


def install_auto_exposure(server: SimpleResourcesServer, app: FastAPI) -> None:
    """Serve ``server``'s tools over MCP on ``app`` whatever its config says (once per app)."""
    if mcp_installed(app):
        return
    if _routes_mcp(app):
        name = getattr(server.config, "name", None) or type(server).__name__
        raise ValueError(
            f"resources server {name!r} already routes {MCP_URL_PATH} itself: expose_tools_over_mcp "
            f"would serve a second MCP endpoint there; unset the flag or remove the route"
        )
    install_mcp(server, app)


def maybe_auto_expose(server: SimpleResourcesServer, app: FastAPI) -> bool:
    """Serve the tools over MCP when ``server.config.expose_tools_over_mcp`` is set; True if ``app`` does."""
    if not getattr(server.config, "expose_tools_over_mcp", False):
        return mcp_installed(app)
    install_auto_exposure(server, app)
    return True
