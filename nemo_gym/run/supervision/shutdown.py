"""Stopping a run: every child, the head server, Ray groups and the run token, bounded and idempotent.

Contract
--------
* Agents get SIGTERM first (for at most a second of ``shutdown_timeout_s``), so they do not report
  failed calls to servers already stopping; then every other child's process group. Whatever is
  left at the bound gets SIGKILL (the whole group, even when its leader exited).
* The fork server (:mod:`nemo_gym.run.zygote`), if any, is stopped. Sockets and pipe ends are closed,
  the head server stopped, Ray replicas and the cluster connection released, the run token
  unregistered and its file removed, the spawner thread ended.
* A second call does nothing (it also runs at interpreter exit).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

from nemo_gym.auth import register_in_process, remove_token_file
from nemo_gym.run.supervision.children import signal_group


class ShutdownMixin:
    """Stopping the run (mixed into :class:`ServerSupervisor`)."""

    def shutdown(self) -> None:
        """Stop every child (SIGTERM to its group, SIGKILL after the bound) and the head server; idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        alive = [c for c in self.children if c.process is not None]
        deadline = time.monotonic() + self.shutdown_timeout_s
        # Agents stop first (for at most a second of the bound), so they do not report failed calls
        # to servers that are already stopping; then everything else.
        agents = [c for c in alive if c.instance.server_type == "responses_api_agents"]
        others = [c for c in alive if c.instance.server_type != "responses_api_agents"]
        for stage, stage_deadline in ((agents, min(deadline, time.monotonic() + 1.0)), (others, deadline)):
            for c in stage:
                signal_group(c.process.pid, signal.SIGTERM)
            for c in stage:
                try:
                    c.process.wait(timeout=max(0.0, stage_deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for c in alive:
            # Kill the whole group even when the leader exited: nothing of ours may outlive the run.
            signal_group(c.process.pid, signal.SIGKILL)
            try:
                c.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        self._stop_zygote()  # the servers it forked are this process's children, stopped above
        for c in self.children:
            if c.sock is not None:
                c.sock.close()
                c.sock = None
            self._close_go(c, go=False)
            if c.verdict_fd is not None:
                os.close(c.verdict_fd)
                c.verdict_fd = None
        if self._head_server is not None:
            self._head_server.should_exit = True
            if self._head_thread is not None:
                self._head_thread.join(timeout=3)
        if self._head_sock is not None:
            self._head_sock.close()
            self._head_sock = None
        for group in self.ray_groups.values():
            group.stop()
        if self.ray_connection is not None:
            self.ray_connection.close()
        if self.auth_token is not None:
            register_in_process(self._run_ports(), None)
            if self.token_file is not None:
                remove_token_file(self.head_port, self.auth_token)
        self._spawner.stop()
        if self._launch_files is not None:  # what a child did not read (it died first) goes too
            shutil.rmtree(self._launch_files, ignore_errors=True)
