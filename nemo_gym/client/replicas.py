"""Replicas of a server instance: the replica cookie (server side) and routing (client side).

Contract
--------
* An instance block with ``num_replicas: N`` (N > 1), or one placed on a Ray cluster, is served by N
  processes, each with its own port. The launcher writes the list of replicas into the instance's
  impl block of the config every process receives: ``replicas: [{host, port, url, node}, ...]`` (the
  index in the list is the replica's index), and gives each replica process its identity
  ``NEMO_GYM_REPLICA=<index>.<boot id>`` (the boot id is new every time a replica process starts).
* Server side (:func:`install_replica_cookie`, one call from the server set-up): a server that keeps
  sessions and is a replica answers every request that carries no replica cookie of its instance with
  ``Set-Cookie: ng_replica_<instance>=<index>.<boot id>`` next to its session cookie. A request whose
  cookie names another replica or an earlier boot of this one (the replica restarted and its session
  state is gone) is answered ``503`` with kind ``replica_session_lost``: an infrastructure failure the
  caller sees as such, never a silently empty session. ``GET /`` (liveness) is left alone. Processes that are not replicas install
  nothing (no cost).
* Client side (:class:`ReplicaSet`, used by :class:`nemo_gym.client.server_client.ServerClient`): a request
  whose cookies carry the instance's replica cookie goes to that replica (sticky sessions: cookies
  already travel with every call of a rollout, so no state is kept in the client); any other request
  goes to the next replica in round-robin order that is not marked down. A replica that cannot be
  reached is marked down for :data:`REPLICA_DOWN_S` seconds and the request moves to another one
  (nothing was processed, so that is safe); a sticky request to a replica that cannot be reached fails
  with the client's usual bounded retries, as an infrastructure failure naming the replica.
* Instances without replicas keep a plain ``(host, port)`` in the client: the single-replica hot path
  is unchanged. Which replicas answer now is the client's to probe
  (:func:`nemo_gym.client.server_client.live_replicas`); this module imports no client.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from typing import Any

import orjson

from nemo_gym.errors import UpstreamError, error_envelope

REPLICA_ENV_VAR_NAME = "NEMO_GYM_REPLICA"
REPLICA_COOKIE_PREFIX = "ng_replica_"
REPLICAS_KEY_NAME = "replicas"
NUM_REPLICAS_KEY_NAME = "num_replicas"
# How long a replica that could not be reached gets no new sessions.
REPLICA_DOWN_S = 5.0


def replica_cookie_name(instance_name: str) -> str:
    """The replica cookie of an instance (named per instance, like the session cookie)."""
    return REPLICA_COOKIE_PREFIX + re.sub(r"[^A-Za-z0-9_]", "_", instance_name or "server")


def new_replica_identity(index: int) -> str:
    """``<index>.<boot id>``: what one start of replica ``index`` calls itself."""
    return f"{index}.{secrets.token_hex(6)}"


def replica_index(value: Any) -> int | None:
    """The replica index a cookie value (a string or a cookie morsel) names, or None if malformed."""
    text = str(getattr(value, "value", value))
    head = text.partition(".")[0]
    return int(head) if head.isdigit() else None


# ------------------------------------------------------------------------------------------------
# Server side.


def _cookie_from_headers(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == b"cookie":
            for part in value.split(b";"):
                k, sep, v = part.strip().partition(b"=")
                if sep and k == name:
                    return v
    return None


class ReplicaCookieMiddleware:
    """Pure ASGI middleware: the replica cookie of one replica process (see the module docstring)."""

    def __init__(self, app: Any, instance_name: str, identity: str) -> None:
        self.app = app
        self.instance_name = instance_name
        self.identity = identity.encode()
        self.name = replica_cookie_name(instance_name).encode()
        self.set_cookie = (
            b"set-cookie",
            self.name + b"=" + self.identity + b"; Path=/; HttpOnly; SameSite=Lax",
        )

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] == "/":  # liveness has no session (cookie jars send any)
            await self.app(scope, receive, send)
            return
        found = _cookie_from_headers(scope["headers"], self.name)
        if found == self.identity:
            await self.app(scope, receive, send)
            return
        if found is not None:
            await self._session_lost(scope, send, found.decode(errors="replace"))
            return

        async def send_with_cookie(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.set_cookie]
            await send(message)

        await self.app(scope, receive, send_with_cookie)

    async def _session_lost(self, scope: dict, send: Any, named: str) -> None:
        me = self.identity.decode()
        message = (
            f"This request belongs to a session of replica {named} of '{self.instance_name}', but "
            f"this is replica {me}: that replica restarted (or the request was misrouted), so the "
            "session's state is gone. This is an infrastructure failure; retry the rollout."
        )
        body = orjson.dumps(
            error_envelope(
                "replica_session_lost", server=self.instance_name, path=scope.get("path", ""), message=message
            )
        )
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def install_replica_cookie(app: Any, instance_name: str) -> None:
    """Add :class:`ReplicaCookieMiddleware` to ``app`` when this process is a replica (the launcher set
    ``NEMO_GYM_REPLICA``); otherwise do nothing."""
    identity = os.environ.get(REPLICA_ENV_VAR_NAME)
    if identity:
        app.add_middleware(ReplicaCookieMiddleware, instance_name=instance_name, identity=identity)


# ------------------------------------------------------------------------------------------------
# Client side.


class ReplicaSet:
    """The replicas of one instance as a client sees them: where each listens, which are down."""

    __slots__ = ("instance_name", "cookie_name", "endpoints", "nodes", "_down_until", "_next")

    def __init__(self, instance_name: str, replicas: list[dict[str, Any]]) -> None:
        self.instance_name = instance_name
        self.cookie_name = replica_cookie_name(instance_name)
        self.endpoints: list[tuple[str, int]] = [(str(r["host"]), int(r["port"])) for r in replicas]
        self.nodes: list[str | None] = [r.get("node") for r in replicas]
        self._down_until = [0.0] * len(self.endpoints)
        self._next = 0

    def __len__(self) -> int:
        return len(self.endpoints)

    def sticky_index(self, cookies: Any) -> int | None:
        """The replica the request's cookies name (its session lives there), else None.

        Raises ValueError for a replica cookie that names no replica of this instance."""
        if not cookies:
            return None
        value = cookies.get(self.cookie_name)
        if value is None:
            return None
        index = replica_index(value)
        if index is None or index >= len(self.endpoints):
            raise ValueError(
                f"cookie {self.cookie_name}={getattr(value, 'value', value)!r} names no replica of "
                f"'{self.instance_name}' (it has {len(self.endpoints)})"
            )
        return index

    def sticky_replica(self, cookies: Any, url_path: str) -> int | None:
        """:meth:`sticky_index` for a request to ``url_path``: a replica cookie naming no replica of this
        instance is the caller's error, raised as an ``UpstreamError`` of kind ``replica_unknown``."""
        try:
            return self.sticky_index(cookies)
        except ValueError as e:
            raise UpstreamError(self.instance_name, url_path, None, str(e), kind="replica_unknown") from None

    def next_index(self, avoid: int | None = None) -> int:
        """The next replica in round-robin order that is not marked down (and is not ``avoid``); when
        every replica is down, the next one anyway (it may be back)."""
        n = len(self.endpoints)
        now = time.monotonic()
        first = self._next
        for step in range(n):
            i = (first + step) % n
            if i != avoid and self._down_until[i] <= now:
                self._next = (i + 1) % n
                return i
        i = first if first != avoid or n == 1 else (first + 1) % n
        self._next = (i + 1) % n
        return i

    def mark_down(self, index: int) -> None:
        """No new sessions for replica ``index`` for :data:`REPLICA_DOWN_S` seconds."""
        self._down_until[index] = time.monotonic() + REPLICA_DOWN_S

    def describe(self, index: int) -> str:
        host, port = self.endpoints[index]
        node = self.nodes[index]
        return f"replica {index} of {len(self.endpoints)} at {host}:{port}" + (
            f" (node {node})" if node else ""
        )


def replicated_instances(cfg: Any) -> set[str]:
    """Names of the server instances of a run's config that list more than one replica."""
    from nemo_gym.config.keys import SERVER_TYPES

    out: set[str] = set()
    for name in cfg.keys() if hasattr(cfg, "keys") else ():
        block = cfg.get(name)
        if not hasattr(block, "keys"):
            continue
        for server_type in SERVER_TYPES:
            impls = block.get(server_type) if server_type in block else None
            if hasattr(impls, "keys"):
                for impl in impls.keys():
                    if replica_set_from_block(str(name), impls[impl]) is not None:
                        out.add(str(name))
    return out


def replica_set_from_block(instance_name: str, block: Any) -> ReplicaSet | None:
    """The :class:`ReplicaSet` of an impl block that lists more than one replica, else None."""
    replicas = block.get(REPLICAS_KEY_NAME) if hasattr(block, "get") else None
    if not replicas or len(replicas) < 2:
        return None
    return ReplicaSet(instance_name, [dict(r) for r in replicas])


__all__ = [
    "NUM_REPLICAS_KEY_NAME",
    "REPLICAS_KEY_NAME",
    "REPLICA_COOKIE_PREFIX",
    "REPLICA_DOWN_S",
    "REPLICA_ENV_VAR_NAME",
    "ReplicaCookieMiddleware",
    "ReplicaSet",
    "install_replica_cookie",
    "new_replica_identity",
    "replica_cookie_name",
    "replica_index",
    "replica_set_from_block",
    "replicated_instances",
]
