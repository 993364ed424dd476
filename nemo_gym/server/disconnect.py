"""Stop an agent's rollout when the caller of ``/run`` goes away.

Contract
--------
* ``await run_until_disconnected(request, work)`` awaits the coroutine ``work`` while a watcher task
  waits on the request's ASGI receive channel. When the client disconnects first, the work is
  cancelled with the message :data:`CLIENT_DISCONNECTED` (its ``finally`` blocks run: an agent closes
  the env it holds there, seeing why in the ``CancelledError``), its clean-up runs to the end (as long as
  it takes; agents bound their close calls), and :class:`ClientDisconnected` is raised. Otherwise the
  result (or exception) of ``work`` comes back unchanged.
* The disconnect is noticed while the agent is waiting on anything (the model, a tool, an env step), not
  only between turns: uvicorn answers the receive channel with ``http.disconnect`` as soon as the
  connection drops. Read the request body before calling this (the watcher consumes the channel).
* :func:`disconnected_response` is what the handler returns then (499, nobody reads it; it keeps
  uvicorn from logging a traceback).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import Response

from nemo_gym.errors import error_envelope

logger = logging.getLogger(__name__)

T = TypeVar("T")

CLIENT_DISCONNECTED = "client_disconnected"


class ClientDisconnected(Exception):
    """The caller closed its connection before the rollout finished; the rollout was cancelled."""


def cancel_reason(error: BaseException) -> str:
    """Why a ``CancelledError`` happened: :data:`CLIENT_DISCONNECTED` when this module cancelled it."""
    return CLIENT_DISCONNECTED if CLIENT_DISCONNECTED in getattr(error, "args", ()) else "cancelled"


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client has disconnected (the request body must already be read)."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


async def run_until_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """``await work``, cancelling it and raising :class:`ClientDisconnected` if the caller goes away.

    ``work`` runs in the handler's own task (no task of its own, no ``asyncio.wait``: one watcher task per
    request is the whole cost); when the watcher sees the disconnect, it cancels the handler's task with
    :data:`CLIENT_DISCONNECTED`, which ``work``'s ``finally`` blocks see as it unwinds."""
    current = asyncio.current_task()
    assert current is not None, "run_until_disconnected runs inside a task"
    state = {"done": False, "disconnected": False}

    def on_watcher_done(watcher: asyncio.Future) -> None:
        if state["done"] or watcher.cancelled() or watcher.exception() is not None:
            return
        state["disconnected"] = True
        current.cancel(CLIENT_DISCONNECTED)

    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    watcher.add_done_callback(on_watcher_done)
    try:
        return await work
    except asyncio.CancelledError:
        if not state["disconnected"]:
            raise  # this handler itself was cancelled (the server is stopping): so is the work
        current.uncancel()
        raise ClientDisconnected(
            f"the client of {request.url.path} disconnected; the rollout was cancelled"
        ) from None
    finally:
        state["done"] = True
        watcher.cancel()


def disconnected_response(server_name: str, error: ClientDisconnected) -> Response:
    """The (unread) answer to a request whose client has gone."""
    logger.info("server '%s': %s", server_name, error)
    body = error_envelope(CLIENT_DISCONNECTED, server=server_name, message=str(error))
    return Response(orjson.dumps(body), status_code=499, media_type="application/json")
