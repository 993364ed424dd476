"""Ray support (nemo_gym.ray) on a real 2-node Ray cluster started by this module on this machine.

One module-scoped cluster (two nodes, one CPU each, custom resources ``node_a`` / ``node_b``) is
shared by the tests; it is stopped through ``ray.cluster_utils.Cluster.shutdown`` (never ``ray stop``,
which would kill other people's Ray processes) and the teardown checks that every process it started
is gone. Without a Ray config nothing imports ray: checked in a fresh interpreter.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from nemo_gym.global_config import ConfigError
from nemo_gym.ray import ray_settings
from nemo_gym.testing import get, run_rollout, running_servers, server_url
from nemo_gym.verify_pool import (
    VerifyTimeoutError,
    VerifyWorkerCrashedError,
    run_in_verify_pool,
    set_verify_ray_address,
)

REPO = Path(__file__).resolve().parents[1]
ENV_CONFIG = "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml"
OBJECT_STORE_BYTES = 100 * 2**20

ray = pytest.importorskip("ray", reason="the `ray` extra is not installed (pip install -e '.[ray]')")


# ------------------------------------------------------------------------------------------------
# Without Ray.


def test_nothing_imports_ray_without_a_ray_config() -> None:
    """ng_run's modules, and a whole RunHelper start/stop of a config without Ray keys, import no ray."""
    code = f"""
import sys
import nemo_gym.cli, nemo_gym.server_client, nemo_gym.verify_pool, nemo_gym.rollout_collection, nemo_gym.ray
assert "ray" not in sys.modules, "importing nemo_gym's launcher modules imported ray"
from nemo_gym.testing import running_servers
with running_servers([{ENV_CONFIG!r}]) as helper:
    assert len(helper.server_instances()) == 3
assert "ray" not in sys.modules, "starting servers without a Ray config imported ray"
print("NO-RAY-OK")
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0 and "NO-RAY-OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


def test_ray_settings_read_the_keys_and_reject_bad_ones() -> None:
    assert ray_settings({}) is None
    assert ray_settings({"ray_head_node_address": None, "ray_start_local": False}) is None
    joined = ray_settings({"ray_head_node_address": "10.0.0.5:6379"})
    assert joined is not None and joined.address == "10.0.0.5:6379" and not joined.start_local
    local = ray_settings({"ray_start_local": "true", "ray_local_num_cpus": 2})
    assert local is not None and local.start_local and local.address is None and local.local_num_cpus == 2
    with pytest.raises(ConfigError, match="not both"):
        ray_settings({"ray_head_node_address": "h:1", "ray_start_local": True})
    with pytest.raises(ConfigError, match="must be host:port"):
        ray_settings({"ray_head_node_address": "no-port"})
    with pytest.raises(ConfigError, match="ray://"):
        ray_settings({"ray_head_node_address": "ray://h:10001"})
    with pytest.raises(ConfigError, match="'ray_local_num_cpus' must be a positive integer"):
        ray_settings({"ray_start_local": True, "ray_local_num_cpus": 0})


def test_an_unreachable_cluster_fails_within_the_bound_naming_the_address(tmp_path: Path) -> None:
    # In a fresh interpreter: the abandoned connect attempt must not linger in this test process.
    code = """
import os, sys
from nemo_gym.ray import ray_settings
from nemo_gym.ray.cluster import RayConnectError, connect
try:
    connect(ray_settings({"ray_head_node_address": "127.0.0.1:1"}), timeout_s=3)
except RayConnectError as e:
    print("ERROR:", e, flush=True)
os._exit(0)
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_TMPDIR": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert (
        "ERROR: Could not join the Ray cluster at ray_head_node_address=127.0.0.1:1 within 3 s" in out.stdout
    ), out.stdout + out.stderr[-2000:]


def test_ng_run_names_a_bad_ray_setting_and_starts_nothing() -> None:
    """``+ray_head_node_address=...`` on the command line is read (no longer "no effect"); a bad value
    stops ng_run with an error naming the key, before any server starts."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    base = [
        sys.executable,
        "-c",
        "import sys; from nemo_gym.cli import run_main; run_main(sys.argv[1:])",
        f"+config_paths=[{ENV_CONFIG},responses_api_models/scripted_model/configs/scripted_model.yaml]",
        "+head_server.port=0",
    ]
    for args, expected in (
        (["+ray_head_node_address=nonsense"], "'ray_head_node_address' must be host:port"),
        (["+ray_head_node_address=127.0.0.1:6379", "+ray_start_local=true"], "not both"),
    ):
        out = subprocess.run(base + args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and expected in out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
        assert "no effect here" not in out.stderr and "servers ready" not in out.stdout


# ------------------------------------------------------------------------------------------------
# The 2-node cluster.


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _wait_gone(pids: set[int], bound_s: float = 20.0) -> set[int]:
    deadline = time.monotonic() + bound_s
    left = _alive(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _alive(left)
    return left


@pytest.fixture(scope="module")
def ray_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The environment every Ray process of this module runs with (private temp dir, no telemetry)."""
    tmp = tmp_path_factory.mktemp("ray")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_TMPDIR", str(tmp))
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        mp.setenv("RAY_AUTH_MODE", "disabled")
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        yield


@pytest.fixture(scope="module")
def cluster(ray_env: None) -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    before = _descendants()
    nodes: set[int] = set()
    node_args = {"num_cpus": 1, "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False}
    c = Cluster(initialize_head=True, head_node_args={**node_args, "resources": {"node_a": 1}})
    try:
        c.add_node(**{**node_args, "resources": {"node_b": 1}})
        c.wait_for_nodes(timeout=60)
        nodes = _alive(_descendants() - before)  # the cluster's own processes
        yield c
    finally:
        # The cluster's processes and everything they started (Ray workers); not other children of
        # this test process (the local verify pool's workers).
        nodes = nodes or _alive(_descendants() - before)
        started = set(nodes)
        for pid in nodes:
            try:
                started |= {p.pid for p in psutil.Process(pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()
        left = _wait_gone(started)
        assert not left, f"Ray processes the test started are still running: {left}"


@pytest.fixture
def ray_driver(cluster: Any) -> Iterator[Any]:
    """This process connected to the cluster as a driver (disconnected afterwards)."""
    set_verify_ray_address(cluster.address)
    try:
        yield cluster
    finally:
        set_verify_ray_address(None)
        if ray.is_initialized():
            ray.shutdown()


def _where(seconds: float = 0.0) -> dict[str, Any]:
    """Runs in a Ray task: where it ran, and whether signal.alarm works there (math-verify needs it)."""
    import ray as _ray

    signal.alarm(30)
    signal.alarm(0)
    time.sleep(seconds)
    return {
        "pid": os.getpid(),
        "node": _ray.get_runtime_context().get_node_id(),
        "main_thread": threading.current_thread() is threading.main_thread(),
    }


def _raise_value_error(text: str) -> None:
    raise ValueError(text)


def _crash() -> None:
    os._exit(7)


async def test_verification_runs_as_ray_tasks_on_both_nodes(ray_driver: Any) -> None:
    import asyncio

    results = await asyncio.gather(*(run_in_verify_pool(_where, 1.5, timeout=60) for _ in range(2)))
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    # Two 1-CPU tasks at once on two 1-CPU nodes: one on each node, in Ray workers, on their main threads.
    assert {r["node"] for r in results} == nodes
    assert all(r["main_thread"] and r["pid"] != os.getpid() for r in results)

    with pytest.raises(ValueError, match="bad answer"):
        await run_in_verify_pool(_raise_value_error, "bad answer", timeout=60)
    with pytest.raises(VerifyTimeoutError, match="ran past its 1 s timeout"):
        await run_in_verify_pool(_where, 30.0, timeout=1)
    with pytest.raises(VerifyWorkerCrashedError, match="_crash"):
        await run_in_verify_pool(_crash, timeout=60)
    # The cluster still serves after a timeout and a crash.
    assert (await run_in_verify_pool(_where, timeout=60))["node"] in nodes


async def test_verification_stays_local_without_a_cluster() -> None:
    set_verify_ray_address("")
    try:
        result = await run_in_verify_pool(_where, timeout=60)
    finally:
        set_verify_ray_address(None)
    assert result["pid"] != os.getpid() and result["main_thread"]


@pytest.mark.slow
def test_run_helper_joins_the_cluster_and_leaves_it_running(cluster: Any) -> None:
    assert not ray.is_initialized()
    extra = {"ray_head_node_address": cluster.address}
    with running_servers([ENV_CONFIG], extra) as helper:
        connection = helper.supervisor.ray_connection
        assert connection is not None and not connection.started_local
        assert ray.is_initialized() and connection.gcs_address.endswith(cluster.address.rpartition(":")[2])
        assert len(connection.nodes()) == 2
        # Every server (and every outside client) is told the cluster's address.
        head = f"http://127.0.0.1:{helper.head_server_config.port}"
        served = yaml.safe_load(get(head + "/global_config_dict_yaml").text)
        assert served["ray_head_node_address"] == connection.gcs_address
        row = {
            "responses_create_params": {"input": [{"role": "user", "content": "weather in Paris?"}]},
            "expected_city": "Paris",
        }
        agent = "example_single_tool_call_simple_agent"
        assert server_url(helper, agent)
        result = run_rollout(helper, agent, row)
        assert "reward" in result
    assert not ray.is_initialized()  # disconnected ...
    ray.init(address=cluster.address, log_to_driver=False)  # ... and the cluster still runs
    try:
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_ray_start_local_starts_and_stops_exactly_its_cluster(ray_env: None) -> None:
    assert not ray.is_initialized()
    before = _descendants()
    with running_servers([ENV_CONFIG], {"ray_start_local": True, "ray_local_num_cpus": 1}) as helper:
        connection = helper.supervisor.ray_connection
        assert connection is not None and connection.started_local
        names = {psutil.Process(p).name() for p in _alive(_descendants() - before)}
        assert {"gcs_server", "raylet"} <= names
        started = _descendants() - before
    assert not ray.is_initialized()
    assert not _wait_gone(started), "the local Ray cluster outlived the run"


SO_CONFIG = "resources_servers/structured_outputs/configs/structured_outputs.yaml"
SO_RIGHT = (
    '{"title": "The Left Hand of Darkness", "author": "Ursula K. Le Guin", "year": 1969, "genres": ["sf"]}'
)
SO_WRONG = '{"title": "The Left Hand of Darkness", "author": "Ursula K. Le Guin", "year": "1969"}'


@pytest.mark.slow
def test_servers_of_a_run_verify_as_ray_tasks_on_the_cluster(cluster: Any, tmp_path: Path) -> None:
    """ng_run hands the cluster's address to every server; a server's run_in_verify_pool then runs on
    the cluster (no local pool worker is started) and rewards are the same as locally."""
    from nemo_gym.testing import collect_rollouts, example_rows

    row = example_rows("structured_outputs")[0]
    wrong = json_row_with_marker(row, "[wrong]")
    rules = [
        {"contains": "[wrong]", "turns": [{"text": SO_WRONG}]},
        {"contains": "Le Guin", "turns": [{"text": SO_RIGHT}]},
    ]
    extra = {
        "ray_head_node_address": cluster.address,
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": rules}}},
        "structured_outputs": {"resources_servers": {"structured_outputs": {"pool_threshold_chars": 0}}},
    }
    with running_servers([SO_CONFIG], extra) as helper:
        code, out, err = collect_rollouts(helper, [row, wrong], tmp_path, "structured_outputs_simple_agent")
        assert code == 0, err[-3000:]
        assert [r["reward"] for r in out] == [1.0, 0.0]
        assert out[1]["error_type"] == "validation_error"
        pid = next(r["pid"] for r in helper.server_instances() if r["name"] == "structured_outputs")
        # The local verify pool would have started worker processes under the server: there are none.
        assert psutil.Process(pid).children(recursive=True) == []


def json_row_with_marker(row: dict[str, Any], marker: str) -> dict[str, Any]:
    import copy

    out = copy.deepcopy(row)
    out["responses_create_params"]["input"][-1]["content"] += f" {marker}"
    return out
