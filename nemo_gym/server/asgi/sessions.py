"""Sessions: a signed cookie per server instance carrying a per-rollout session id.

Contract
--------
* The cookie is ``ng_session_<instance>=<id>.<signature>``; the signature covers the cookie's name, so
  a cookie one instance issued is not accepted by another instance of the same run.
* The signing secret is ``NEMO_GYM_SESSION_SECRET`` (``ng_run`` sets a random one per run), else a
  random secret made once per process, never a constant.
* A request without a valid cookie of this instance gets a new id. Handlers read it as
  ``request.session[SESSION_ID_KEY]`` (upstream's way) or ``request.state.session_id``; every answer
  sets the cookie, so a client that only sends back the cookies of the last answer keeps its session.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import uuid
from typing import Any

from nemo_gym.config.keys import NEMO_GYM_SESSION_SECRET_ENV_VAR_NAME
from nemo_gym.launch import launch_value

SESSION_ID_KEY = "session_id"
_COOKIE_ATTRIBUTES = b"; Path=/; HttpOnly; SameSite=Lax"

_PROCESS_SECRET: bytes | None = None


def session_secret() -> bytes:
    """The cookie-signing secret (see the module docstring)."""
    global _PROCESS_SECRET
    secret = launch_value(NEMO_GYM_SESSION_SECRET_ENV_VAR_NAME)
    if secret:
        return secret.encode()
    if _PROCESS_SECRET is None:
        _PROCESS_SECRET = os.urandom(32)
    return _PROCESS_SECRET


def cookie_name_for(instance_name: str) -> str:
    return "ng_session_" + re.sub(r"[^A-Za-z0-9_]", "_", instance_name or "server")


class SessionMiddleware:
    """Pure ASGI middleware for the session cookie (see the module docstring). Also the cookie signer
    :class:`nemo_gym.server.asgi.ServerLayer` and the MCP mount use (``app`` may then be ``None``)."""

    def __init__(self, app: Any, cookie_name: str, secret: bytes):
        self.app = app
        self.cookie_name = cookie_name.encode()
        self.secret = secret
        self._prefix = self.cookie_name + b"="

    def _sign(self, sid: str) -> str:
        digest = hmac.new(self.secret, self.cookie_name + b"=" + sid.encode(), hashlib.sha256).digest()[:18]
        return base64.urlsafe_b64encode(digest).decode()

    def _verify(self, value: str) -> str | None:
        sid, _, sig = value.partition(".")
        if sid and sig and hmac.compare_digest(sig, self._sign(sid)):
            return sid
        return None

    def _from_headers(self, headers: list[tuple[bytes, bytes]]) -> tuple[str, bytes] | None:
        """(session id, cookie value) of a valid cookie of this instance in the request, else None."""
        prefix = self._prefix
        for k, v in headers:
            if k != b"cookie":
                continue
            for part in v.split(b";"):
                part = part.strip()
                if part.startswith(prefix):
                    value = part[len(prefix) :]
                    sid = self._verify(value.decode(errors="replace"))
                    return None if sid is None else (sid, value)
        return None

    def enter(self, scope: dict) -> bytes:
        """Put the request's session id (its cookie's, else a new one) into ``scope``; return the
        ``Set-Cookie`` value every answer to it carries."""
        found = self._from_headers(scope["headers"])
        if found is None:
            sid = uuid.uuid4().hex
            value = f"{sid}.{self._sign(sid)}".encode()
        else:
            sid, value = found
        scope.setdefault("state", {})[SESSION_ID_KEY] = sid
        # ``request.session[SESSION_ID_KEY]`` (starlette reads ``scope["session"]``), as upstream handlers do.
        scope["session"] = {SESSION_ID_KEY: sid}
        return self._prefix + value + _COOKIE_ATTRIBUTES

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.app(scope, receive, with_cookie(send, self.enter(scope)))


def with_cookie(send: Any, cookie: bytes) -> Any:
    """``send`` with ``Set-Cookie: <cookie>`` added to the start of the answer."""

    async def send_with_cookie(message: dict) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", ()), (b"set-cookie", cookie)]
        await send(message)

    return send_with_cookie
