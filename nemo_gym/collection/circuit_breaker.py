"""Failure classification and the per-server, replica-aware circuit breaker.

Contract
--------
* :func:`classify_failure` turns one failed rollout into its failures-file fields (kind, server,
  path, status, error, and ``via`` when the agent reports an inner failing call, whose server is then
  the one named); the error text is scrubbed of known secrets (:mod:`nemo_gym.redaction`) and cut to
  length.
* :func:`down_server`: a server is down when unreachable past the client's retries
  (``connection_error``) or answering 502/503/504; a timeout, a 4xx, a 500 or a 503 of kind
  ``verify_timeout`` / ``verify_failed`` (the server answered; its check could not be carried out) says
  nothing about that. Such a failure is filed under that kind, also when the agent reports it.
* :class:`CircuitBreaker`: after ``threshold`` consecutive "down" failures of one server, the agents
  whose failures named it are blocked for the run (O(1) per rollout). A server with several replicas
  is down only when none of them answers: :meth:`~CircuitBreaker.record_failure` records a failure,
  probes that server's replicas when its threshold is reached, and records the verdict (the lower-level
  :meth:`~CircuitBreaker.failure`, :meth:`~CircuitBreaker.confirm_down` and
  :meth:`~CircuitBreaker.still_serving` are its steps). A row held back raises :class:`ServerDownError` (an
  :class:`UpstreamError`) in the Python API; :func:`describe_down` words the evidence.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from nemo_gym.errors import UpstreamError
from nemo_gym.kit.verify_pool.errors import VERIFY_ERROR_KINDS
from nemo_gym.redaction import process_scrubber


def classify_failure(exc: BaseException, agent: str) -> dict[str, Any]:
    """The failures-file fields of one failed rollout: kind, server, path, status, error (and via).

    When the agent answered with an error that names an inner failing call (a server it could not
    reach, a model answering 503, ...), that inner server is the one named; ``via`` records the hop
    through the server called (the agent, or the environment server in front of it). The error text is
    scrubbed of known secrets before it is cut to length.
    """
    if isinstance(exc, UpstreamError):
        error = exc.detail.get("error") if isinstance(exc.detail, dict) else None
        error = error if isinstance(error, dict) else {}
        inner = error.get("inner")
        if isinstance(inner, dict) and inner:
            return {
                "kind": _verify_error_kind(inner.get("detail")) or inner.get("kind") or "upstream_error",
                "server": inner.get("server"),
                "path": inner.get("path"),
                "status": inner.get("status"),
                "error": _error_text(inner.get("detail")),
                "via": {"server": exc.server or agent, "path": exc.path, "status": exc.status},
            }
        # The agent's own error (its body says which kind when it is one of our servers).
        kind = error.get("kind") if isinstance(error.get("kind"), str) else exc.kind
        return {
            "kind": kind,
            "server": exc.server,
            "path": exc.path,
            "status": exc.status,
            "error": _error_text(exc.detail),
        }
    return {
        "kind": type(exc).__name__,
        "server": agent,
        "path": "/run",
        "status": None,
        "error": _error_text(exc),
    }


def _verify_error_kind(detail: Any) -> str | None:
    """``verify_timeout`` / ``verify_failed`` when ``detail`` is a server's answer saying its check could
    not be carried out (:mod:`nemo_gym.kit.verify_pool`), else None."""
    error = detail.get("error") if isinstance(detail, dict) else None
    kind = error.get("kind") if isinstance(error, dict) else None
    return kind if kind in VERIFY_ERROR_KINDS else None


def _error_text(detail: Any) -> str:
    """Error text for the failures file: secrets scrubbed, then cut to 4000 characters."""
    return process_scrubber().scrub(str(detail))[:4000]


# Statuses that say a server is unavailable (an agent or model server answers 502 when what it calls
# is unreachable past its own retries).
DOWN_STATUSES = frozenset({502, 503, 504})


def down_server(failure: dict[str, Any]) -> str | None:
    """The server a classified failure shows to be down, or None.

    Down means unreachable past the client's retries (``connection_error``) or answering 502/503/504.
    When the agent reports an inner failure, the inner server is the one named. A timeout, a 4xx, a
    500 (a bug) or a bad response says nothing about a server being down, and neither does a 503 that
    says a check could not be carried out (``verify_timeout`` / ``verify_failed``): that server answered.
    """
    if failure.get("kind") in VERIFY_ERROR_KINDS:
        return None
    if failure.get("kind") == "connection_error" or failure.get("status") in DOWN_STATUSES:
        server = failure.get("server")
        return server if isinstance(server, str) and server else None
    return None


class ServerDownError(UpstreamError):
    """A row that was not sent because a server its agent needs is down (the circuit breaker is open)."""

    def __init__(self, agent: str, opened: dict[str, Any]) -> None:
        detail = f"not sent to {agent}: {describe_down(opened)}"
        super().__init__(opened["server"], opened.get("path") or "", None, detail, kind="server_down")
        self.agent = agent


def describe_down(opened: dict[str, Any]) -> str:
    """One sentence: which server is down and the evidence (kind, count, path, agent in between)."""
    via = opened.get("via") or {}
    what = f"{opened['consecutive_failures']} consecutive {opened['kind']}"
    if opened.get("status") is not None:
        what += f" (HTTP {opened['status']})"
    where = f" on {opened['path']}" if opened.get("path") else ""
    through = f", reported by agent {via['server']}" if via.get("server") else ""
    return f"server {opened['server']!r} is down: {what} failure(s){where}{through}"


class CircuitBreaker:
    """Stops sending to agents whose rollouts keep failing because a server is down.

    Per server, consecutive "down" failures (see :func:`down_server`) are counted; a successful
    rollout through an agent resets the counts of the servers that agent's failures named. At
    ``threshold`` the breaker for that server opens and stays open for the run: every agent whose
    failures named it (before or after) is blocked, so rows for it are not sent. O(1) per rollout.

    A server in ``replicated`` (several replicas) is down only when none of its replicas is alive:
    at ``threshold`` :meth:`record_failure` probes its replicas and opens the breaker only when none
    answers; otherwise the failures were the sessions of a dead replica and the count starts again.
    (Its steps: :meth:`failure` returns the server's name instead of opening, then :meth:`confirm_down`
    or :meth:`still_serving` records the verdict.)
    """

    def __init__(self, threshold: int, replicated: Iterable[str] = ()) -> None:
        self.threshold = threshold
        self.replicated = frozenset(replicated)
        self._consecutive: dict[str, int] = {}
        self._named_by: dict[str, set[str]] = {}  # agent -> servers its down failures named
        self._pending: dict[str, dict[str, Any]] = {}  # replicated server -> the failure to check
        self.opened: dict[str, dict[str, Any]] = {}  # server -> the failure that opened its breaker
        self.blocked: dict[str, str] = {}  # agent -> the down server that blocks it
        self.replica_losses = 0  # down failures of replicated servers that still had a live replica

    def success(self, agent: str) -> None:
        """Record a finished rollout through ``agent``."""
        named = self._named_by.get(agent)
        if named:
            for server in named:
                self._consecutive.pop(server, None)
            named.clear()

    def failure(self, agent: str, failure: dict[str, Any]) -> str | None:
        """Record a failed rollout through ``agent`` (``failure`` as made by :func:`classify_failure`).

        Returns the name of a replicated server whose replicas the caller must check, else None."""
        server = down_server(failure)
        if server is None:
            return None
        self._named_by.setdefault(agent, set()).add(server)
        if server in self.opened:
            self.blocked.setdefault(agent, server)
            return None
        count = self._consecutive[server] = self._consecutive.get(server, 0) + 1
        if count >= self.threshold:
            if server in self.replicated:
                self._pending[server] = failure
                return server
            self._open(server, failure, count)
        return None

    async def record_failure(
        self, agent: str, failure: dict[str, Any], probe: Callable[[str], Awaitable[list[int]]]
    ) -> None:
        """Record a failed rollout through ``agent`` and decide whether its server is down.

        ``probe(instance)`` gives the live replicas of a replicated server (e.g.
        ``functools.partial(live_replicas, client)``); it is awaited only when such a server reaches
        the threshold, because one dead replica of several is not a dead server."""
        check = self.failure(agent, failure)
        if check is None:
            return
        if await probe(check):
            self.still_serving(check)
        else:
            self.confirm_down(check)

    def confirm_down(self, server: str) -> None:
        """No replica of ``server`` is alive: open its breaker."""
        failure = self._pending.pop(server, None)
        if failure is not None and server not in self.opened:
            self._open(server, failure, self._consecutive.get(server, self.threshold))

    def still_serving(self, server: str) -> None:
        """``server`` has a live replica: its failures so far do not make it down."""
        if self._pending.pop(server, None) is not None:
            self.replica_losses += self._consecutive.pop(server, 0)

    def _open(self, server: str, failure: dict[str, Any], count: int) -> None:
        fields = ("kind", "server", "path", "status", "via")
        self.opened[server] = {**{k: failure.get(k) for k in fields}, "consecutive_failures": count}
        for other, named in self._named_by.items():  # every agent whose failures named it
            if server in named:
                self.blocked.setdefault(other, server)

    def blocking(self, agent: str) -> dict[str, Any] | None:
        """The open breaker that blocks ``agent``, or None when rows for it may be sent."""
        server = self.blocked.get(agent) if self.blocked else None
        return None if server is None else self.opened[server]

    def report(self) -> list[dict[str, Any]]:
        """Every open breaker: the down server, the evidence, and the agents it blocked."""
        return [
            {**opened, "blocked_agents": sorted(a for a, s in self.blocked.items() if s == server)}
            for server, opened in self.opened.items()
        ]
