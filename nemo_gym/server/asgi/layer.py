"""One ASGI layer for every server of ours: metrics, guard, rollout prefix, session cookie, error answers.

Contract
--------
Per HTTP request, in this order (a WebSocket is checked for the run token, as in step 1, and then
passes straight through, like every other scope type):

0. With a meter (metrics on): the request is counted when it arrives and again when its answer ended,
   refused ones included, and ``/metrics`` (behind the run token like every path) is answered by it (:class:`nemo_gym.server.metrics.middleware.RequestMeter`); the answer's status
   and error body reach the meter through an :class:`~nemo_gym.server.asgi.exchange.Exchange` this layer
   fills in as the answer passes (no ``send`` wrapper of the metrics' own).
1. The run token and the body limit (:meth:`nemo_gym.auth.RequestGuard.admit`): a refused request is
   answered 401 / 413 here, with no session cookie, and nothing behind this layer runs.
2. ``/ng-rollout/<id>/<path>`` is served as ``/<path>`` with ``<id>`` current for the handler and
   everything it awaits (:func:`nemo_gym.server.rollout_prefix.current_rollout_id`).
3. With sessions: the request's session id goes into the scope and every answer sets the cookie
   (:mod:`nemo_gym.server.asgi.sessions`).
4. With errors: an unhandled exception becomes a JSON 500, and an error answer is scrubbed of secrets
   before it leaves (:mod:`nemo_gym.server.asgi.errors`).

The behaviour is exactly that of ``MetricsMiddleware`` > ``RequestGuard`` > ``RolloutContextMiddleware`` >
``SessionMiddleware`` > ``InternalErrorMiddleware`` stacked (outermost first), at the cost of one call and
at most one ``send`` wrapper per request instead of five calls and three wrappers.
"""

from __future__ import annotations

import asyncio
from time import perf_counter
from typing import Any

from nemo_gym.auth import REFUSAL_KINDS, RequestGuard
from nemo_gym.server.asgi.errors import serve_seen, serve_with_error_answers
from nemo_gym.server.asgi.sessions import SESSION_ID_KEY, SessionMiddleware, with_cookie
from nemo_gym.server.rollout_prefix import enter_rollout, leave_rollout, split_rollout_prefix


class ServerLayer:
    """See the module docstring. ``sessions``: the cookie signer, or ``None`` for a server without
    sessions. ``errors``: whether this layer answers unhandled errors and scrubs error answers (off when
    an app installed :class:`nemo_gym.server.asgi.InternalErrorMiddleware` itself). ``meter``: the
    server's :class:`~nemo_gym.server.metrics.middleware.RequestMeter`, or ``None`` with metrics off."""

    def __init__(
        self,
        app: Any,
        guard: RequestGuard,
        server_name: str,
        sessions: SessionMiddleware | None = None,
        errors: bool = True,
        meter: Any = None,
    ):
        self.app = app
        self.guard = guard
        self.server_name = server_name
        self.sessions = sessions
        self.errors = errors
        self.meter = meter

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # a WebSocket needs the run token too; lifespan passes
            await self.guard.not_http(scope, receive, send, self.app)
            return
        meter = self.meter
        exchange = None
        if meter is not None:
            route, special, exchange = meter.begin(scope["path"])
            began = perf_counter()
        context = None
        try:
            admitted = await self.guard.admit(scope, receive, send)
            if isinstance(admitted, int):  # refused: the 401 / 413 went out
                if exchange is not None:
                    exchange.status, exchange.kind = admitted, REFUSAL_KINDS[admitted]
                return
            if exchange is not None and route == meter.own_route:  # /metrics: the meter answers
                await meter.answer_metrics(scope, send, exchange)
                return
            if scope["path"].startswith("/ng-rollout/"):
                split = split_rollout_prefix(scope["path"])
                if split is not None:
                    rollout_id, rest = split
                    scope = {**scope, "path": rest, "raw_path": rest.encode()}
                    context = enter_rollout(rollout_id)
            cookie = None
            if self.sessions is not None:
                cookie = self.sessions.enter(scope)
                if exchange is not None:
                    exchange.session = scope["state"][SESSION_ID_KEY]
            if self.errors:
                await serve_with_error_answers(
                    self.app, scope, admitted, send, self.server_name, cookie, exchange
                )
            elif exchange is not None:
                await serve_seen(self.app, scope, admitted, send, cookie, exchange)
            elif cookie is None:
                await self.app(scope, admitted, send)
            else:
                await self.app(scope, admitted, with_cookie(send, cookie))
        except asyncio.CancelledError:
            if exchange is not None:
                exchange.kind = "cancelled"
            raise
        except BaseException:
            if exchange is not None:
                exchange.kind = "internal_error"
            raise
        finally:
            if context is not None:
                leave_rollout(context)
            if exchange is not None:
                if special is not None and exchange.session is None:  # sessions set up by the app itself
                    exchange.session = (scope.get("state") or {}).get(SESSION_ID_KEY)
                meter.end(scope["method"], route, special, exchange, perf_counter() - began)
