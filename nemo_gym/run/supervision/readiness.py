"""Readiness and watching: health-polling the children, telling which server died and how.

Contract
--------
* :meth:`ReadinessMixin._wait_ready` polls ``GET /`` of every child (with the run token) until all
  answer 200, a child dies, start-up is interrupted or the deadline passes (then
  :class:`~nemo_gym.run.supervision.children.StartupError` names the servers still waiting).
  A child's listening socket exists from its spawn, so a poll sent while it still starts waits in the
  socket's backlog and is answered the moment the child serves: readiness is seen at once, without
  a fixed polling interval. A poll that is refused or fails at once is retried after a pause that
  starts at :data:`POLL_FIRST_S` and doubles up to :data:`POLL_MAX_S`; one that gets no answer within
  :data:`POLL_TIMEOUT_S` is sent again (so death, Ctrl+C and the deadline are checked that often).
  The poll is a plain HTTP/1.1 request of the standard library: the launcher loads no HTTP client
  for it.
* :meth:`ReadinessMixin.dead_server` reports the first child that exited (a replica only once every
  local replica of its instance is dead), or an instance on Ray whose every replica is dead (its
  actors are asked at most once per :data:`RAY_DEAD_CHECK_S`).
* :meth:`ReadinessMixin.describe_exit` says how a server exited, with its last log lines.
"""

from __future__ import annotations

import http.client
import signal
import time

from nemo_gym.auth import auth_headers
from nemo_gym.run.supervision.children import ChildServer, DeadRayInstance, StartupError
from nemo_gym.server.startup import startup_mark

RAY_DEAD_CHECK_S = 1.0  # how often dead_server() asks the Ray replicas' actors for their status
POLL_FIRST_S = 0.005  # the first pause after a refused or failed poll; doubles each time...
POLL_MAX_S = 0.1  # ...up to this
POLL_TIMEOUT_S = 1.0  # a poll waiting in a starting child's backlog is sent again after this
EXITED_LOG_WAIT_S = 5.0  # the most an error message waits for an exited server's last log lines


def answers_ok(host: str, port: int, headers: dict[str, str], timeout: float) -> bool | None:
    """Whether ``GET /`` at ``host:port`` answers 200 within ``timeout``: True, False (refused, another
    status, a broken connection), or None when it did not answer in time (still starting)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/", headers=headers)
        return conn.getresponse().status == 200
    except TimeoutError:
        return None
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


class ReadinessMixin:
    """Health-polling and watching the children (mixed into :class:`ServerSupervisor`)."""

    def _wait_ready(self, deadline: float) -> None:
        headers = auth_headers(self.auth_token)
        pause = POLL_FIRST_S
        while True:
            if self.stop_event.is_set():
                raise StartupError("Start-up interrupted.")
            dead = self.dead_server()
            if dead is not None:
                raise StartupError(self.describe_exit(dead, during_startup=True))
            failed = False
            for child in self.children:
                if child.ready:
                    continue
                timeout = max(0.01, min(POLL_TIMEOUT_S, deadline - time.monotonic()))
                answer = answers_ok(child.host, child.port, headers, timeout)
                if answer:
                    child.ready = True
                    startup_mark("ready", child.label)
                elif answer is None:
                    break  # it waited its time: check deaths, Ctrl+C and the deadline, then again
                else:
                    failed = True
            if all(c.ready for c in self.children):
                return
            if time.monotonic() > deadline:
                waiting = [c for c in self.children if not c.ready]
                details = "\n".join(self._tail_text(c) for c in waiting)
                raise StartupError(
                    f"Timed out after {self.startup_timeout_s:g} s waiting for "
                    f"{', '.join(c.name for c in waiting)} to answer GET / "
                    f"(raise +startup_timeout_s=... if it is just slow).\n{details}"
                )
            if failed:
                self.stop_event.wait(pause)
                pause = min(pause * 2, POLL_MAX_S)

    def dead_server(self) -> ChildServer | DeadRayInstance | None:
        """The first child that has exited since start, if any; a dead replica only once every replica
        of its instance on this machine is dead (clients route around the others). An instance placed
        on Ray is dead once every replica is (restarts used up, actor or node lost); its actors are
        asked at most once per :data:`RAY_DEAD_CHECK_S`."""
        for child in self.children:
            if child.process is not None and child.process.poll() is not None:
                if child.replica is not None and any(
                    c.name == child.name and c.process is not None and c.process.poll() is None
                    for c in self.children
                ):
                    continue
                return child
        if self.ray_groups and not self._shut_down:
            if self._ray_dead is None and time.monotonic() >= self._ray_checked_at + RAY_DEAD_CHECK_S:
                self._ray_checked_at = time.monotonic()
                for name, group in self.ray_groups.items():
                    statuses = group.all_dead()
                    if statuses is not None:
                        self._ray_dead = DeadRayInstance(name, statuses)
                        break
            return self._ray_dead
        return None

    def _tail_text(self, child: ChildServer) -> str:
        if child.reader is not None:
            # An exited server's last lines are on their way through its output pipe (a busy machine
            # can hold the reader back for seconds); a live one's reader never ends.
            exited = child.process is not None and child.process.poll() is not None
            child.reader.join(timeout=EXITED_LOG_WAIT_S if exited else 0.5)
        lines = list(child.tail) or ["(no output)"]
        return f"--- last log lines of {child.label} ---\n" + "\n".join(lines)

    def describe_exit(self, child: ChildServer | DeadRayInstance, during_startup: bool = False) -> str:
        """How ``child`` exited, with its last log lines (for error messages)."""
        if isinstance(child, DeadRayInstance):
            return child.describe()
        assert child.process is not None
        code = child.process.returncode
        how = (
            f"was killed by signal {-code} ({signal.Signals(-code).name})"
            if code < 0
            else f"exited with code {code}"
        )
        when = " during start-up" if during_startup else ""
        return f"Server '{child.label}' ({child.instance.folder}, pid {child.process.pid}) {how}{when}.\n{self._tail_text(child)}"
