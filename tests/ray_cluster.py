"""What the Ray tests share (tests/test_ray*.py): the environment their Ray processes run with, a real
2-node cluster on this machine, and the checks that a test's Ray processes are gone afterwards.

The fixtures built on these (``ray_env``, ``ray_cluster``, ``ray_driver``) are in tests/conftest.py and
module-scoped: each Ray test file starts one cluster of its own, so the files can run on different
pytest-xdist workers. A cluster is stopped through ``ray.cluster_utils.Cluster.shutdown``, never
``ray stop`` (which would kill other people's Ray processes). Nothing here imports ray at import time.
"""

from __future__ import annotations

import copy
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from nemo_gym.kit.verify_pool import set_verify_ray_address
from nemo_gym.run.supervision.spawning import kept_fork_server_pids

REPO = Path(__file__).resolve().parents[1]
ENV_CONFIG = "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml"
SO_CONFIG = "resources_servers/structured_outputs/configs/structured_outputs.yaml"
SO_RIGHT = (
    '{"title": "The Left Hand of Darkness", "author": "Ursula K. Le Guin", "year": 1969, "genres": ["sf"]}'
)
OBJECT_STORE_BYTES = 100 * 2**20
# A secret in the environment the nodes (and so the replica actors) start with.
NODE_SECRET_VAR = "SOME_NODE_API_KEY"
NODE_SECRET = "node-exported-secret-4c1d"


def descendants() -> set[int]:
    """This process's descendants, but the fork server it keeps between runs (it outlives them on purpose)."""
    return {p.pid for p in psutil.Process().children(recursive=True)} - kept_fork_server_pids()


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(pids: set[int], bound_s: float = 20.0) -> set[int]:
    deadline = time.monotonic() + bound_s
    left = alive(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = alive(left)
    return left


def ray_environment() -> Iterator[None]:
    """The environment every Ray process of a test module runs with (private temp dir, no telemetry)."""
    # A short dir of its own: Ray's socket paths under it must fit AF_UNIX's 107 bytes, and pytest's
    # tmp_path (``.../pytest-of-<user>/pytest-N/popen-gwN/...`` under pytest-xdist) leaves too little room.
    tmp = Path(tempfile.mkdtemp(prefix="ngray-"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_TMPDIR", str(tmp))
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        mp.setenv("RAY_AUTH_MODE", "disabled")
        mp.setenv(NODE_SECRET_VAR, NODE_SECRET)
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        try:
            yield
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def two_node_cluster() -> Iterator[Any]:
    """Two nodes, one CPU each, custom resources ``node_a`` / ``node_b``; on the way out, every process
    the cluster started must be gone (needs ``ray_environment`` around it)."""
    import ray
    from ray.cluster_utils import Cluster

    before = descendants()
    nodes: set[int] = set()
    node_args = {"num_cpus": 1, "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False}
    c = Cluster(initialize_head=True, head_node_args={**node_args, "resources": {"node_a": 1}})
    try:
        c.add_node(**{**node_args, "resources": {"node_b": 1}})
        c.wait_for_nodes(timeout=60)
        nodes = alive(descendants() - before)  # the cluster's own processes
        yield c
    finally:
        # The cluster's processes and everything they started (Ray workers); not other children of
        # this test process (the local verify pool's workers).
        nodes = nodes or alive(descendants() - before)
        started = set(nodes)
        for pid in nodes:
            try:
                started |= {p.pid for p in psutil.Process(pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()
        left = wait_gone(started)
        assert not left, f"Ray processes the test started are still running: {left}"


def driver_of(cluster: Any) -> Iterator[Any]:
    """This process connected to ``cluster`` as a driver (disconnected afterwards)."""
    import ray

    set_verify_ray_address(cluster.address)
    try:
        yield cluster
    finally:
        set_verify_ray_address(None)
        if ray.is_initialized():
            ray.shutdown()


def node_with(resource: str) -> str:
    import ray

    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


def where(seconds: float = 0.0) -> dict[str, Any]:
    """Runs in a Ray task: where it ran, and whether signal.alarm works there (math-verify needs it)."""
    import ray

    signal.alarm(30)
    signal.alarm(0)
    time.sleep(seconds)
    return {
        "pid": os.getpid(),
        "node": ray.get_runtime_context().get_node_id(),
        "main_thread": threading.current_thread() is threading.main_thread(),
    }


def json_row_with_marker(row: dict[str, Any], marker: str) -> dict[str, Any]:
    out = copy.deepcopy(row)
    out["responses_create_params"]["input"][-1]["content"] += f" {marker}"
    return out
