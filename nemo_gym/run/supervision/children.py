"""One server process of a run, and the promise that it dies with the launcher.

Contract
--------
* :class:`ChildServer` is one local server instance (or replica): its address, script, reserved
  socket, process, last :data:`LOG_TAIL_LINES` log lines and config-verdict pipe ends.
  :class:`DeadRayInstance` is an instance placed on Ray whose every replica is dead.
* :class:`SpawnerThread` runs every ``Popen`` of a supervisor (and of a Ray replica's actor) on one
  long-lived thread: Linux delivers the parent-death signal when the forking *thread* exits.
* The child's side, that a server process exits when the launcher dies, is
  :func:`nemo_gym.server.startup.die_with_parent`.
* :func:`signal_group` signals a child's process group, ignoring one that is already gone.
* :class:`StartupError`: a server failed to come up; the message names it with its last log lines.
"""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_gym.config.instances import ServerInstance
from nemo_gym.run.zygote import ForkedChild

LOG_TAIL_LINES = 30


class StartupError(RuntimeError):
    """A server failed to come up; the message names it and shows its last log lines."""


class SpawnerThread:
    """One long-lived thread that runs every ``Popen`` of a supervisor (see the module docstring)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the spawner thread and return its result (or raise its exception)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="nemo-gym-spawner", daemon=True)
            self._thread.start()
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut.result()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, fut = job
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller
                fut.set_exception(e)

    def stop(self) -> None:
        """Let the thread end (only once every child it spawned has been reaped)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=5)
            self._thread = None


@dataclass
class ChildServer:
    """One server instance: where it listens, how it is started, and its process once spawned."""

    instance: ServerInstance
    host: str
    port: int
    python: str
    script: Path
    sock: socket.socket | None = None
    process: subprocess.Popen | ForkedChild | None = None  # ForkedChild: forked by the fork server
    tail: deque = field(default_factory=lambda: deque(maxlen=LOG_TAIL_LINES))
    reader: threading.Thread | None = None
    ready: bool = False
    verdict_fd: int | None = None  # read end: the child's config verdict (one JSON line)
    go_fd: int | None = None  # write end: b"g" lets the child go on once every config is valid
    verdict_buf: bytes = b""
    verdict: dict[str, Any] | None = None
    replica: int | None = None  # index among the instance's replicas (None: not replicated)
    identity: str | None = None  # NEMO_GYM_REPLICA of a replica (nemo_gym.client.replicas)

    @property
    def url(self) -> str:
        """Base URL of the server."""
        return f"http://{self.host}:{self.port}"

    @property
    def name(self) -> str:
        """Instance name (the top-level config key)."""
        return self.instance.name

    @property
    def label(self) -> str:
        """The instance name, with ``[<replica>]`` for a replica (log prefixes, messages)."""
        return self.name if self.replica is None else f"{self.name}[{self.replica}]"


@dataclass
class DeadRayInstance:
    """An instance placed on Ray whose every replica is dead (what :meth:`ServerSupervisor.dead_server`
    reports for it)."""

    name: str
    statuses: list[dict[str, Any]]

    @property
    def label(self) -> str:
        return self.name

    def describe(self) -> str:
        parts = [
            f"replica {i} on node {st.get('node')} (pid {st.get('pid')}, {st.get('restarts', 0)} restart(s))"
            for i, st in enumerate(self.statuses)
        ]
        return (
            f"Server '{self.name}' (placed on the Ray cluster) is dead: every replica exited and has no "
            f"restarts left (ray_max_restarts), or lost its actor or node: {'; '.join(parts)}."
        )


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
