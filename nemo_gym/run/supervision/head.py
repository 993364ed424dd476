"""The head server (run in this process) and the run token's publication.

Contract
--------
* The head server (:mod:`nemo_gym.run.head_server`) is served by uvicorn on a thread of this process, on
  the socket reserved for it, with the run's connection limits (:mod:`nemo_gym.server.accept_limit`: silent
  and slow connections closed, places kept for token bearers); it is up within 10 s or start-up fails with
  :class:`~nemo_gym.run.supervision.children.StartupError`.
* The run token is registered for this process's clients (every port of the run) and written to a
  0600 file for the user's other processes; with ``+server_auth=false`` a loud warning says
  authentication is off. A token file that cannot be written is a warning, not a failure.
"""

from __future__ import annotations

import socket
import threading
import time

from nemo_gym.auth import AUTH_TOKEN_ENV_VAR_NAME, register_in_process, write_token_file
from nemo_gym.run.supervision.children import StartupError


class HeadMixin:
    """The head server and the run token (mixed into :class:`ServerSupervisor`)."""

    def _publish_token(self) -> None:
        """Make the run token findable by this process's clients and, through a 0600 file, by the user's
        other processes on this machine; or warn loudly that authentication is off."""
        if self.auth_token is None:
            self.echo(
                "WARNING: server authentication is OFF for this run (+server_auth=false): any process that can "
                "reach these ports can call every server, verify fabricated trajectories and use the model "
                "server's API key. Never do this on a shared machine or off loopback."
            )
            return
        register_in_process(self._run_ports(), self.auth_token, self.trainer_token)
        try:
            self.token_file = write_token_file(self.head_port, self.auth_token, self.trainer_token)
        except OSError as e:
            self.echo(
                f"WARNING: could not write the run token file ({e}); clients in other processes need "
                f"{AUTH_TOKEN_ENV_VAR_NAME} set to reach this run."
            )

    def _run_ports(self) -> list[int]:
        ray_ports = [i["port"] for g in self.ray_groups.values() for i in g.infos]
        return [self.head_port] + [c.port for c in self.children] + ray_ports

    def _start_head_server(self, sock: socket.socket) -> None:
        from nemo_gym.client.fd_limits import socket_budget
        from nemo_gym.run.head_server import build_head_app
        from nemo_gym.server.accept_limit import ConnectionLimits, bounded_server

        app = build_head_app(self, token=self.auth_token, auth_disabled=not self.auth_enabled)
        # Bounded like every server of the run: silent or slow connections are closed, token bearers keep
        # places, at most a quarter of this process's free descriptors (the launcher needs the rest).
        limits, keep_alive_s = ConnectionLimits.from_settings(lambda key, default: self.cfg.get(key, default))
        trusts = app.state.nemo_gym_request_guard.trusts
        self._head_server = bounded_server(
            app, max(16, socket_budget() // 4), limits, keep_alive_s, trusts, lifespan="on"
        )  # lifespan on: the event-loop lag tick of nemo_gym.server.metrics starts with the server
        self._head_thread = threading.Thread(
            target=self._head_server.run, kwargs={"sockets": [sock]}, name="head-server", daemon=True
        )
        self._head_thread.start()
        deadline = time.monotonic() + 10
        while not self._head_server.started and time.monotonic() < deadline and self._head_thread.is_alive():
            time.sleep(0.01)
        if not self._head_server.started:
            raise StartupError(f"The head server did not start on {self.head_host}:{self.head_port}.")
