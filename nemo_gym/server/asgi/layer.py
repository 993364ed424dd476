"""One ASGI layer for every server of ours: guard, rollout prefix, session cookie, error answers.

Contract
--------
Per HTTP request, in this order (a WebSocket is checked for the run token, as in step 1, and then
passes straight through, like every other scope type):

1. The run token and the body limit (:meth:`nemo_gym.auth.RequestGuard.admit`): a refused request is
   answered 401 / 413 here, with no session cookie, and nothing behind this layer runs.
2. ``/ng-rollout/<id>/<path>`` is served as ``/<path>`` with ``<id>`` current for the handler and
   everything it awaits (:func:`nemo_gym.server.rollout_prefix.current_rollout_id`).
3. With sessions: the request's session id goes into the scope and every answer sets the cookie
   (:mod:`nemo_gym.server.asgi.sessions`).
4. With errors: an unhandled exception becomes a JSON 500, and an error answer is scrubbed of secrets
   before it leaves (:mod:`nemo_gym.server.asgi.errors`).

The behaviour is exactly that of ``RequestGuard`` > ``RolloutContextMiddleware`` > ``SessionMiddleware`` >
``InternalErrorMiddleware`` stacked (outermost first), at the cost of one call and at most one ``send``
wrapper per request instead of four calls and two wrappers.
"""

from __future__ import annotations

from typing import Any

from nemo_gym.auth import RequestGuard
from nemo_gym.server.asgi.errors import serve_with_error_answers
from nemo_gym.server.asgi.sessions import SessionMiddleware, with_cookie
from nemo_gym.server.rollout_prefix import enter_rollout, leave_rollout, split_rollout_prefix


class ServerLayer:
    """See the module docstring. ``sessions``: the cookie signer, or ``None`` for a server without
    sessions. ``errors``: whether this layer answers unhandled errors and scrubs error answers (off when
    an app installed :class:`nemo_gym.server.asgi.InternalErrorMiddleware` itself)."""

    def __init__(
        self,
        app: Any,
        guard: RequestGuard,
        server_name: str,
        sessions: SessionMiddleware | None = None,
        errors: bool = True,
    ):
        self.app = app
        self.guard = guard
        self.server_name = server_name
        self.sessions = sessions
        self.errors = errors

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # a WebSocket needs the run token too; lifespan passes
            await self.guard.not_http(scope, receive, send, self.app)
            return
        receive = await self.guard.admit(scope, receive, send)
        if receive is None:
            return
        context = None
        if scope["path"].startswith("/ng-rollout/"):
            split = split_rollout_prefix(scope["path"])
            if split is not None:
                rollout_id, rest = split
                scope = {**scope, "path": rest, "raw_path": rest.encode()}
                context = enter_rollout(rollout_id)
        try:
            cookie = self.sessions.enter(scope) if self.sessions is not None else None
            if not self.errors:
                if cookie is None:
                    await self.app(scope, receive, send)
                else:
                    await self.app(scope, receive, with_cookie(send, cookie))
                return
            await serve_with_error_answers(self.app, scope, receive, send, self.server_name, cookie)
        finally:
            if context is not None:
                leave_rollout(context)
