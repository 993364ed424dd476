"""Connect this process to a Ray cluster for a run, or start (and later stop) a private local one.

Contract
--------
* :func:`connect` imports ray (this module is only imported when the config uses Ray, see
  :func:`nemo_gym.run.ray.ray_settings`) and returns a :class:`RayConnection`.
* Joining (``settings.address``): ``ray.init(address=...)`` as a driver. If this process is already a
  Ray driver (a trainer that called ``ray.init`` itself), that connection is reused and left alone at
  close. Close disconnects only what this module connected; the cluster keeps running.
* Starting (``settings.start_local``): ``ray.init(address="local", ...)`` starts a fresh single-node
  cluster owned by this process (never one that happens to run on the machine: ``address="local"``),
  without the dashboard, with the object store capped. Close shuts exactly that cluster down.
* Connecting is bounded: a cluster that does not answer within ``timeout_s`` raises
  :class:`RayConnectError` naming the address (every ``ray.init`` runs on one long-lived helper thread, see :class:`_RayThread`).
* :attr:`RayConnection.gcs_address` is what servers of the run use to join the same cluster.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import Any

import ray

from nemo_gym.kit.ray_quiet import drop_not_main_thread_warning, restore_python_sigterm_handler
from nemo_gym.run.ray import RaySettings

DEFAULT_CONNECT_TIMEOUT_S = 60.0


class RayConnectError(RuntimeError):
    """The Ray cluster could not be joined or started; the message says which and why."""


@dataclass
class RayConnection:
    """This process's link to the run's Ray cluster (see the module docstring)."""

    gcs_address: str
    started_local: bool
    owns_connection: bool
    _closed: bool = field(default=False, repr=False)

    def nodes(self) -> list[dict[str, Any]]:
        """The cluster's live nodes: ``NodeID``, ``Alive``, ``Resources`` (ray.nodes() filtered)."""
        return [n for n in ray.nodes() if n.get("Alive")]

    def close(self) -> None:
        """Disconnect (joined) or stop the private cluster (started); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.owns_connection and ray.is_initialized():
            ray.shutdown()


class _RayThread:
    """One long-lived thread that makes every ``ray.init`` of this process.

    Linux delivers a child's parent-death signal when the *thread* that forked it exits, and Ray arms
    that signal for the GCS and raylet of a cluster it starts: started from a short-lived thread, a
    private cluster would die as soon as that thread ends. This thread lives as long as the process.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], Any]) -> Future:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="nemo-gym-ray", daemon=True)
                self._thread.start()
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut

    def _loop(self) -> None:
        while True:
            fn, fut = self._jobs.get()
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller
                fut.set_exception(e)


_RAY_THREAD = _RayThread()


def _init_bounded(kwargs: dict[str, Any], timeout_s: float, what: str) -> None:
    drop_not_main_thread_warning()  # ray.init runs on the Ray thread: its warning about that is noise
    fut = _RAY_THREAD.submit(lambda: ray.init(**kwargs))
    try:
        fut.result(timeout=timeout_s)
        restore_python_sigterm_handler()  # a SIGTERM to ng_run is a normal stop, not a crash to print
    except FutureTimeoutError:
        raise RayConnectError(
            f"Could not {what} within {timeout_s:g} s (is the cluster running and reachable from here?)."
        ) from None
    except Exception as e:
        raise RayConnectError(f"Could not {what}: {type(e).__name__}: {e}") from e


def connect(settings: RaySettings, timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> RayConnection:
    """Join ``settings.address`` or start a private local cluster; see the module docstring."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        # A trainer that is itself a Ray driver: use its connection, never close it.
        return RayConnection(
            gcs_address=ray.get_runtime_context().gcs_address, started_local=False, owns_connection=False
        )
    common: dict[str, Any] = {"log_to_driver": False, "configure_logging": False}
    if settings.start_local:
        _init_bounded(
            {
                **common,
                "address": "local",
                "num_cpus": settings.local_num_cpus,
                "object_store_memory": settings.local_object_store_mb * 2**20,
                "include_dashboard": False,
            },
            timeout_s,
            "start a local Ray cluster (+ray_start_local=true)",
        )
        started = True
    else:
        assert settings.address is not None
        _init_bounded(
            {**common, "address": settings.address},
            timeout_s,
            f"join the Ray cluster at ray_head_node_address={settings.address}",
        )
        started = False
    return RayConnection(
        gcs_address=ray.get_runtime_context().gcs_address, started_local=started, owns_connection=True
    )


__all__ = ["DEFAULT_CONNECT_TIMEOUT_S", "RayConnectError", "RayConnection", "connect"]
