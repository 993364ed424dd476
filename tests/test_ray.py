"""Ray support (nemo_gym.run.ray) on a real 2-node Ray cluster started by this module on this machine.

One module-scoped cluster (two nodes, one CPU each, custom resources ``node_a`` / ``node_b``) is
shared by the tests; it is stopped through ``ray.cluster_utils.Cluster.shutdown`` (never ``ray stop``,
which would kill other people's Ray processes) and the teardown checks that every process it started
is gone. Without a Ray config nothing imports ray: checked in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from nemo_gym.global_config import ConfigError
from nemo_gym.kit.verify_pool import (
    VerifyTimeoutError,
    VerifyWorkerCrashedError,
    run_in_verify_pool,
    set_verify_ray_address,
)
from nemo_gym.run.ray import ray_settings
from nemo_gym.run.supervision.children import StartupError
from nemo_gym.run.supervision.spawning import kept_fork_server_pids
from nemo_gym.tools.testing import get, run_rollout, running_servers, server_url

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
import nemo_gym.cli, nemo_gym.run.cli, nemo_gym.client.server_client, nemo_gym.kit.verify_pool, nemo_gym.rollout_collection, nemo_gym.run.ray
assert "ray" not in sys.modules, "importing nemo_gym's launcher modules imported ray"
from nemo_gym.tools.testing import running_servers
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
from nemo_gym.run.ray import ray_settings
from nemo_gym.run.supervision.children import StartupError
from nemo_gym.run.ray.cluster import RayConnectError, connect
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
        "import sys; from nemo_gym.run.cli import run_main; run_main(sys.argv[1:])",
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
    """This process's descendants, but the fork server it keeps between runs (it outlives them on purpose)."""
    return {p.pid for p in psutil.Process().children(recursive=True)} - kept_fork_server_pids()


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
def ray_env() -> Iterator[None]:
    """The environment every Ray process of this module runs with (private temp dir, no telemetry)."""
    # A short dir of its own: Ray's socket paths under it must fit AF_UNIX's 107 bytes, and pytest's
    # tmp_path (``.../pytest-of-<user>/pytest-N/popen-gwN/...`` under pytest-xdist) leaves too little room.
    tmp = Path(tempfile.mkdtemp(prefix="ngray-"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_TMPDIR", str(tmp))
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        mp.setenv("RAY_AUTH_MODE", "disabled")
        # A secret in the environment the nodes (and so the replica actors) start with.
        mp.setenv(NODE_SECRET_VAR, NODE_SECRET)
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        try:
            yield
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


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
    from nemo_gym.tools.testing import collect_rollouts, example_rows

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


# ------------------------------------------------------------------------------------------------
# Replicas placed on the cluster's nodes.


def test_sealed_secrets_open_only_with_the_actors_key() -> None:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    from nemo_gym.run.ray.replicas import seal, unseal

    actor_key, other_key = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    public = actor_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    secret = b'{"NEMO_GYM_AUTH_TOKEN": "tok-0123456789abcdef"}'
    ephemeral, nonce, sealed = seal(public, secret)
    assert b"tok-0123456789abcdef" not in ephemeral + nonce + sealed
    assert unseal(actor_key, ephemeral, nonce, sealed) == secret
    with pytest.raises(InvalidTag):
        unseal(other_key, ephemeral, nonce, sealed)


AGENT = "example_single_tool_call_simple_agent"
RES = "example_single_tool_call"


def _weather_scripts() -> list[dict[str, Any]]:
    from nemo_gym.tools.testing import example_rows
    from resources_servers.example_single_tool_call.app import weather_report

    return [
        {
            "contains": row["expected_city"],
            "turns": [
                {"tool_calls": [{"name": "get_weather", "arguments": {"city": row["expected_city"]}}]},
                {"text": weather_report(row["expected_city"])},
            ],
        }
        for row in example_rows(RES)
    ]


def _placed_extra(address: str, resources: list[dict[str, float]], **block: Any) -> dict[str, Any]:
    return {
        "ray_head_node_address": address,
        "policy_model": {
            "responses_api_models": {"scripted_model": {"scripts_by_input": _weather_scripts()}}
        },
        RES: {
            "resources_servers": {RES: {"num_replicas": len(resources), "ray_resources": resources, **block}}
        },
    }


NODE_SECRET_VAR = "SOME_NODE_API_KEY"
NODE_SECRET = "node-exported-secret-4c1d"
MODEL_ONLY_KEY = "sk-only-the-model-holds-this-8e2f"


@pytest.mark.slow
def test_ray_replicas_get_only_their_own_secrets_and_a_filtered_environment(cluster: Any) -> None:
    """A replica's server process on a Ray node: not the node's secret-looking variables (unless its
    block names them in pass_env), not another server's key; the run token is there."""
    extra = _placed_extra(cluster.address, [{"node_a": 1}, {"node_b": 1}])
    # Another server holding an API key of its own (never called here).
    extra["judge_model"] = {
        "responses_api_models": {
            "openai_model": {
                "entrypoint": "app.py",
                "openai_base_url": "http://127.0.0.1:9/v1",
                "openai_api_key": MODEL_ONLY_KEY,
                "openai_model": "judge",
            }
        }
    }
    with running_servers([ENV_CONFIG], extra) as helper:
        rows = _replica_rows(helper)
        assert len(rows) == 2
        for row in rows:
            environ = psutil.Process(row["pid"]).environ()
            text = "\n".join(f"{k}={v}" for k, v in environ.items())
            assert NODE_SECRET not in text and MODEL_ONLY_KEY not in text, row
            assert helper.supervisor.auth_token in environ["NEMO_GYM_SECRET_VALUES"]
            assert environ["RAY_AUTH_MODE"] == "disabled"  # Ray's own settings pass
    extra[RES]["resources_servers"][RES]["pass_env"] = [NODE_SECRET_VAR]
    with running_servers([ENV_CONFIG], extra) as helper:
        for row in _replica_rows(helper):
            assert psutil.Process(row["pid"]).environ()[NODE_SECRET_VAR] == NODE_SECRET


def _node_with(resource: str) -> str:
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


def _replica_rows(helper: Any) -> list[dict[str, Any]]:
    return [r for r in helper.server_instances() if r["name"] == RES]


def _cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


@pytest.mark.slow
def test_replicas_run_on_their_nodes_require_the_token_and_serve_2000_rollouts(
    cluster: Any, tmp_path: Path
) -> None:
    """Replica 0 on node_a, replica 1 on node_b (each started by its actor there, bound to every
    interface); without the run token a replica refuses; 2,000 rollouts through both, all rewarded 1."""
    import httpx

    from nemo_gym.tools.testing import collect_rollouts, example_rows

    extra = _placed_extra(cluster.address, [{"node_a": 1}, {"node_b": 1}])
    with running_servers([ENV_CONFIG], extra) as helper:
        rows = _replica_rows(helper)
        assert [r["replica"] for r in rows] == [0, 1]
        assert [r["node"] for r in rows] == [_node_with("node_a"), _node_with("node_b")]
        assert all(r["alive"] for r in rows)
        # The head server lists the same replicas, and every process's config names their nodes.
        head = f"http://127.0.0.1:{helper.head_server_config.port}"
        served = [r for r in get(head + "/server_instances").json() if r["name"] == RES]
        assert [(r["url"], r["node"]) for r in served] == [(r["url"], r["node"]) for r in rows]
        config = yaml.safe_load(get(head + "/global_config_dict_yaml").text)
        listed = config[RES]["resources_servers"][RES]["replicas"]
        assert [(r["url"], r["node"]) for r in listed] == [(r["url"], r["node"]) for r in rows]
        row = example_rows(RES)[0]
        token = helper.supervisor.auth_token
        for r in rows:
            # Started by its actor (a Ray worker on its node), not by this process; listening on every interface.
            parent = psutil.Process(r["pid"]).parent()
            assert parent is not None and parent.pid != os.getpid()
            assert "ReplicaActor" in " ".join(parent.cmdline()), parent.cmdline()
            listening = [c for c in psutil.Process(r["pid"]).net_connections("tcp") if c.status == "LISTEN"]
            assert [(c.laddr.ip, c.laddr.port) for c in listening] == [("0.0.0.0", r["port"])]
            # A replica off this process requires the run token.
            refused = httpx.post(r["url"] + "/seed_session", json=row, timeout=10, trust_env=False)
            assert refused.status_code == 401, refused.text
            allowed = httpx.post(
                r["url"] + "/seed_session",
                json=row,
                timeout=10,
                trust_env=False,
                headers={"Authorization": f"Bearer {token}"},
            )
            assert allowed.status_code == 200, allowed.text
        before = [_cpu_s(r["pid"]) for r in rows]
        tasks = example_rows(RES)
        code, out, err = collect_rollouts(
            helper, tasks, tmp_path, AGENT, "+num_repeats=400", "+num_samples_in_parallel=64"
        )
        assert code == 0, err[-3000:]
        assert len(out) == 2000 and all(r["reward"] == 1.0 for r in out)
        assert len({(r["_ng_task_index"], r["_ng_rollout_index"]) for r in out}) == 2000
        # Both replicas did real work (each seeds, serves tools and verifies about half the sessions).
        used = [_cpu_s(r["pid"]) - b for r, b in zip(rows, before, strict=True)]
        assert min(used) > 0.25 * max(used), used

        # Prometheus finds both replicas through the head server (each with its replica index and node),
        # and each replica's own /metrics counts the verifications it served: 2,000 between them.
        from nemo_gym.tools.testing import metric_value, scrape

        auth = {"Authorization": f"Bearer {token}"}
        targets = httpx.get(head + "/prometheus_targets", headers=auth, timeout=30, trust_env=False).json()
        replica_targets = [t for t in targets if t["labels"]["instance_name"] == RES]
        assert [t["labels"]["replica"] for t in replica_targets] == ["0", "1"]
        assert [t["labels"]["node"] for t in replica_targets] == [r["node"] for r in rows]
        # Each at the address its node gives it (the same one the run's clients use).
        assert [t["targets"] for t in replica_targets] == [[r["url"].removeprefix("http://")] for r in rows]
        verified = [
            metric_value(scrape(f"http://{t['targets'][0]}", token), "nemo_gym_verify_duration_seconds_count")
            for t in replica_targets
        ]
        assert sum(verified) == 2000 and min(verified) > 0, verified

        # A replica's server that dies is restarted by its actor on the same address, as a new boot:
        # sessions of the old boot are refused as infrastructure failures, new ones are served.
        import asyncio

        from nemo_gym.client.replicas import replica_cookie_name
        from nemo_gym.client.server_client import ServerClient
        from nemo_gym.errors import UpstreamError

        client = ServerClient(global_config_dict=helper.global_config_dict, max_retries=2, backoff_s=0.05)
        cookie = replica_cookie_name(RES)

        async def seed() -> dict[str, str]:
            return (await client.post_json(RES, "/seed_session", json=row))[1]

        async def restart_scenario() -> None:
            old = [await seed() for _ in range(2)]
            on_1 = next(c for c in old if c[cookie].startswith("1."))
            os.kill(rows[1]["pid"], signal.SIGKILL)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                status = _replica_rows(helper)[1]
                if status["alive"] and status["pid"] != rows[1]["pid"]:
                    break
                await asyncio.sleep(0.2)
            assert status["restarts"] == 1 and status["alive"] and status["port"] == rows[1]["port"]
            with pytest.raises(UpstreamError) as info:
                await client.post_json(RES, "/verify", json={**row, "response": {"output": []}}, cookies=on_1)
            assert info.value.status == 503 and info.value.detail["error"]["kind"] == "replica_session_lost"
            fresh = [await seed() for _ in range(2)]
            assert {c[cookie].partition(".")[0] for c in fresh} == {"0", "1"}
            assert next(c for c in fresh if c[cookie].startswith("1."))[cookie] != on_1[cookie]

        asyncio.run(restart_scenario())
    # Stopping the run stopped the replicas' servers on both nodes.
    assert not _wait_gone({r["pid"] for r in rows}), "a replica's server outlived the run"
    # The token is in no Ray log or session file (it went to the actors sealed, and what they relay
    # from the servers is scrubbed).
    ray_tmp = Path(os.environ["RAY_TMPDIR"])
    leaked = [
        p
        for p in ray_tmp.rglob("*")
        if p.is_file() and p.stat().st_size < 50_000_000 and token.encode() in p.read_bytes()
    ]
    assert not leaked, leaked


@pytest.mark.slow
def test_placement_no_node_can_satisfy_fails_within_the_bound_naming_the_replica(cluster: Any) -> None:
    extra = {**_placed_extra(cluster.address, [{"node_z": 1}]), "startup_timeout_s": 5}
    with pytest.raises(StartupError, match=r"Could not place replica example_single_tool_call\[0\].*node_z"):
        with running_servers([ENV_CONFIG], extra):
            pass


@pytest.mark.slow
def test_a_killed_node_loses_no_row_and_resume_completes_the_missing_pairs(
    cluster: Any, tmp_path: Path
) -> None:
    """Replica 1 on a third node that is removed (its raylet, actor and server killed) mid-run: no
    row is scored 0 or lost, the failed rollouts are infrastructure failures, the run goes on through
    the other replica (not stopped as "server down"), and a resume completes exactly the missing
    pairs through the surviving replica."""
    from nemo_gym.tools.testing import collect_rollouts, example_rows

    node_c = cluster.add_node(
        num_cpus=1, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False, resources={"node_c": 1}
    )
    try:
        cluster.wait_for_nodes(timeout=60)
        extra = _placed_extra(cluster.address, [{"node_a": 1}, {"node_c": 1}], ray_max_restarts=1)
        with running_servers([ENV_CONFIG], extra) as helper:
            rows = _replica_rows(helper)
            assert rows[1]["node"] == _node_with("node_c")
            victim_pid = rows[1]["pid"]
            tasks = example_rows(RES)
            output = tmp_path / "output.jsonl"
            killed = threading.Event()

            def busy(url: str) -> bool:
                """Replica 1 holds rollouts now: sessions it seeded and has not verified yet."""
                from nemo_gym.tools.testing import metric_value, scrape

                try:
                    return (
                        metric_value(scrape(url, helper.supervisor.auth_token), "nemo_gym_open_sessions") >= 1
                    )
                except Exception:
                    return False

            def kill_node_mid_run() -> None:
                # The collector runs on the main thread (signal handlers); the node dies from here, once
                # 150 rows are written and replica 1 has rollouts in flight (on a busy machine the
                # collector can be between that replica's rollouts at any given moment).
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    if output.exists() and output.read_bytes().count(b"\n") >= 150 and busy(rows[1]["url"]):
                        cluster.remove_node(node_c, allow_graceful=False)
                        killed.set()
                        return
                    time.sleep(0.02)

            killer = threading.Thread(target=kill_node_mid_run)
            killer.start()
            result = {
                "first": collect_rollouts(
                    helper, tasks, tmp_path, AGENT, "+num_repeats=200", "+num_samples_in_parallel=32"
                )
            }
            killer.join(timeout=130)
            assert killed.is_set(), "the run ended before the node was killed"
            node_c = None
            code, out, err = result["first"]
            assert not _wait_gone({victim_pid}), "the killed node's replica process outlived its node"
            assert all(r["reward"] == 1.0 for r in out), "a rollout was scored although its replica died"
            # One replica of two died: the run went on through the other (exit 1: rollouts missing after
            # failures, not 3: no server was called down), every row rewarded or in the sidecar.
            summary = json.loads((tmp_path / "output_aggregate_metrics.json").read_text())
            assert code == 1 and summary["down_servers"] == [], (code, summary["down_servers"], err[-2000:])
            print(f"first run: exit {code}, {len(out)} of 1000 rollouts written")
            failures = [
                json.loads(line) for line in (tmp_path / "output_failures.jsonl").read_text().splitlines()
            ]
            assert failures and all(f["server"] == RES for f in failures), failures[:3]
            done_first = {(r["_ng_task_index"], r["_ng_rollout_index"]) for r in out}
            failed_first = {(f["_ng_task_index"], f["_ng_rollout_index"]) for f in failures}
            assert not done_first & failed_first and len(done_first | failed_first) == 1000
            # Resume: exactly the missing pairs, through the replica that is left.
            code2, out2, err2 = collect_rollouts(
                helper,
                tasks,
                tmp_path,
                AGENT,
                "+num_repeats=200",
                "+num_samples_in_parallel=32",
                "+resume_from_cache=true",
            )
            assert code2 == 0, err2[-3000:]
            keys = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in out2]
            assert len(keys) == len(set(keys)) == 1000
            assert set(keys) - done_first == failed_first
            assert all(r["reward"] == 1.0 for r in out2)
            status = _replica_rows(helper)[1]
            assert not status["alive"]
    finally:
        if node_c is not None:
            cluster.remove_node(node_c)


def json_row_with_marker(row: dict[str, Any], marker: str) -> dict[str, Any]:
    import copy

    out = copy.deepcopy(row)
    out["responses_create_params"]["input"][-1]["content"] += f" {marker}"
    return out


# ------------------------------------------------------------------------------------------------
# Sandboxed programs as Ray tasks (sandbox: {run_on: ray}).

SANDBOX_PROGRAM = """
import os, sys
data = sys.stdin.read()
print("got", data.strip(), open("in.txt").read().strip())
open("out.txt", "w").write("answer=" + str(sum(int(x) for x in data.split())))
os.remove("gone.txt")
os.symlink("/etc/passwd", "link.txt")
"""


async def test_sandbox_runs_programs_as_ray_tasks_on_the_pinned_node(ray_driver: Any) -> None:
    """An AsyncSandbox with run_on: ray runs each program under bubblewrap on the node its custom
    resource pins it to; files and stdin travel with the task, and what the program wrote (and
    deleted) is back in the local work dir afterwards; symlinks are never sent back."""
    from nemo_gym.sandbox import AsyncSandbox, SandboxSpec
    from nemo_gym.sandbox.ray_exec import node_counts

    before = node_counts()
    provider = {"run_on": "ray", "ray_resources": {"node_b": 1}}
    spec = SandboxSpec(files={"prog.py": SANDBOX_PROGRAM, "in.txt": "hello", "gone.txt": "x"})
    async with AsyncSandbox(provider=provider, spec=spec) as sandbox:
        run = await sandbox.exec(["python3", "-I", "prog.py"], stdin="20 22\n")
        assert run.ok and run.stdout == "got 20 22 hello\n", run
        assert (await sandbox.read_file("out.txt")) == b"answer=42"
        assert sorted(p.name for p in sandbox.host_workdir.iterdir()) == ["in.txt", "out.txt", "prog.py"]
        # Files persist between programs, as in a local sandbox; a failing program is its own outcome.
        again = await sandbox.exec(
            ["python3", "-I", "-c", "print(open('out.txt').read()); raise SystemExit(3)"]
        )
        assert again.stdout == "answer=42\n" and again.return_code == 3 and again.error_type is None
        # The same limits apply on the node: past the wall-clock limit the program is killed.
        slow = await sandbox.exec(["python3", "-I", "-c", "import time; time.sleep(30)"], timeout_s=1)
        assert slow.timed_out and slow.error_type == "timeout"
    after = node_counts()
    ran = {node: after[node] - before.get(node, 0) for node in after if after[node] != before.get(node, 0)}
    assert ran == {_node_with("node_b"): 3}, ran
    # Nothing is left in the Ray workers: no sandbox started ahead for a next task that may never come.
    deadline = time.monotonic() + 10
    node_b = next(n for n in ray_driver.worker_nodes if n.node_id == _node_with("node_b"))
    raylet_b = psutil.Process(next(p.pid for name, p in node_b.live_processes() if name == "raylet"))
    while (left := [p.pid for p in raylet_b.children(recursive=True) if p.name() == "bwrap"]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert not left, "a Ray task left sandbox processes behind in its worker"


async def test_sandbox_on_ray_refuses_what_it_cannot_send_and_needs_a_cluster(ray_driver: Any) -> None:
    from nemo_gym.sandbox import (
        AsyncSandbox,
        SandboxError,
        SandboxSpec,
        SandboxUnavailableError,
        check_sandbox_available,
    )

    spec = SandboxSpec(files={"big.bin": b"\0" * (2 * 2**20)})
    async with AsyncSandbox(provider={"run_on": "ray", "ray_max_payload_mib": 1}, spec=spec) as sandbox:
        with pytest.raises(SandboxError, match=r"ray_max_payload_mib=1 MiB .*big\.bin"):
            await sandbox.exec(["true"])
    set_verify_ray_address("")  # this process has no cluster now
    with pytest.raises(SandboxUnavailableError, match="no Ray cluster"):
        check_sandbox_available({"run_on": "ray"})
    check_sandbox_available({"run_on": "auto"})  # auto: the local bubblewrap, which is installed


async def test_sandbox_on_a_node_without_bwrap_or_a_dead_node_is_an_infrastructure_failure(
    ray_driver: Any,
) -> None:
    """node_c runs without bubblewrap on its PATH: a program pinned there fails with the node's
    SandboxUnavailableError. A program running there when the node is killed fails as SandboxError:
    never as a program outcome. (A node that is gone altogether: the code_gen test below.)"""
    import asyncio

    from nemo_gym.sandbox import AsyncSandbox, SandboxError, SandboxSpec, SandboxUnavailableError

    cluster = ray_driver
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", str(Path(sys.executable).parent))  # the venv's bin: python, no bwrap
        node_c = cluster.add_node(
            num_cpus=1,
            object_store_memory=OBJECT_STORE_BYTES,
            include_dashboard=False,
            resources={"node_c": 1},
        )
    try:
        cluster.wait_for_nodes(timeout=60)
        pinned = {"run_on": "ray", "ray_resources": {"node_c": 1}}
        async with AsyncSandbox(provider=pinned, spec=SandboxSpec(files={"a.py": "print(1)"})) as sandbox:
            with pytest.raises(SandboxUnavailableError, match="install the Debian package `bubblewrap`"):
                await sandbox.exec(["python3", "-I", "a.py"])
        # The unsafe backend needs no bwrap: a program that runs until its node is killed.
        unsafe = {**pinned, "backend": "unsafe_local_subprocess"}
        spec = SandboxSpec(resources={"wall_time_s": 120, "cpu_time_s": 120})
        async with AsyncSandbox(provider=unsafe, spec=spec) as sandbox:
            running = asyncio.ensure_future(
                sandbox.exec([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(100)"])
            )
            await asyncio.sleep(4)
            assert not running.done()
            await asyncio.to_thread(cluster.remove_node, node_c, False)
            node_c = None
            with pytest.raises(SandboxError, match="Ray task failed"):
                await asyncio.wait_for(running, 60)
    finally:
        if node_c is not None:
            cluster.remove_node(node_c)


CODE_GEN_CONFIG = "resources_servers/code_gen/configs/code_gen.yaml"


def _code_gen_extra(
    address: str, sandbox: dict[str, Any], **block: Any
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows 0 of code_gen, right (slowed a little, so its programs can be watched) and tagged [wrong]."""
    from nemo_gym.tools.testing import example_rows

    row = example_rows("code_gen")[0]
    wrong = json_row_with_marker(row, "[wrong]")
    right_code = "import time\ntime.sleep(0.5)\na, b = map(int, input().split())\nprint(a + b)"
    wrong_code = "a, b = map(int, input().split())\nprint(a - b)"
    rules = [
        {"contains": "[wrong]", "turns": [{"text": f"```python\n{wrong_code}\n```"}]},
        {"contains": "print their sum", "turns": [{"text": f"```python\n{right_code}\n```"}]},
    ]
    extra = {
        "ray_head_node_address": address,
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": rules}}},
        "code_gen": {"resources_servers": {"code_gen": {"sandbox": sandbox, **block}}},
    }
    return [row, wrong], extra


@pytest.mark.slow
def test_code_gen_runs_its_programs_on_the_other_node_and_a_missing_node_is_not_a_zero(
    cluster: Any, tmp_path: Path
) -> None:
    """code_gen with sandbox.run_on: ray pinned to node_b: every unit-test program runs under bwrap
    started by a Ray worker of node_b's raylet (never by the code_gen server), right and wrong programs
    score 1 and 0. Pinned to a node no live machine offers, the rows are infrastructure failures in the
    sidecar, not rewards of 0."""
    from nemo_gym.tools.testing import collect_rollouts

    rows, extra = _code_gen_extra(cluster.address, {"run_on": "ray", "ray_resources": {"node_b": 1}})
    with running_servers([CODE_GEN_CONFIG], extra) as helper:
        node_b = next(n for n in cluster.worker_nodes if n.node_id == _node_with("node_b"))
        raylet_b = next(p.pid for name, p in node_b.live_processes() if name == "raylet")
        server_pid = next(r["pid"] for r in helper.server_instances() if r["name"] == "code_gen")
        seen: list[set[int]] = []
        stop = threading.Event()

        def watch() -> None:  # the ancestors of every bwrap process this test started (others run tests too)
            while not stop.is_set():
                for proc in psutil.process_iter(["name"]):
                    if proc.info["name"] == "bwrap":
                        try:
                            ancestors = {p.pid for p in proc.parents()}
                        except psutil.Error:
                            continue
                        if os.getpid() in ancestors:
                            seen.append(ancestors)
                time.sleep(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            code, out, err = collect_rollouts(helper, rows, tmp_path / "b", "code_gen_simple_agent")
        finally:
            stop.set()
            watcher.join(timeout=10)
        assert code == 0, err[-3000:]
        assert [r["reward"] for r in out] == [1.0, 0.0], out
        assert out[1]["failure_reason"] == "wrong_answer"
        # Other tests of this process may hold idle pre-started sandboxes of their own: look only at
        # bwrap processes under this run's server or under one of the cluster's raylets.
        raylets = {
            p.pid for node in cluster.worker_nodes for name, p in node.live_processes() if name == "raylet"
        } | {p.pid for name, p in cluster.head_node.live_processes() if name == "raylet"}
        on_b = [a for a in seen if raylet_b in a]
        assert on_b, "no sandboxed program was seen running on node_b"
        assert not [a for a in seen if server_pid in a], "a program ran under the code_gen server itself"
        assert not [a for a in seen if (a & raylets) - {raylet_b}], "a program ran on another node"

    rows, extra = _code_gen_extra(
        cluster.address,
        {"run_on": "ray", "ray_resources": {"node_z": 1}, "queue_timeout_s": 1},
        unit_test_timeout_secs=1,
    )
    with running_servers([CODE_GEN_CONFIG], extra) as helper:
        code, out, err = collect_rollouts(helper, rows, tmp_path / "z", "code_gen_simple_agent")
        assert code != 0 and out == [], (code, out, err[-2000:])
        failures = [
            yaml.safe_load(line)
            for line in (tmp_path / "z" / "output_failures.jsonl").read_text().splitlines()
        ]
        assert len(failures) == 2, failures
        assert all("no node of the Ray cluster ran the program" in str(f) for f in failures), failures


# ------------------------------------------------------------------------------------------------
# The launcher and Ray-placed replicas: ready count, dead instances, config check.


@pytest.mark.slow
def test_ng_run_counts_ray_replicas_and_stops_when_every_replica_is_dead(cluster: Any) -> None:
    """ng_run counts the replicas on Ray nodes in "All N / N servers ready"; killing one replica (no
    restarts) keeps the run going; killing the last one stops ng_run (exit 1) naming the instance."""
    import re

    import httpx

    from nemo_gym.auth import auth_headers, client_token

    block = f"+{RES}.resources_servers.{RES}"
    cmd = [
        sys.executable,
        "-c",
        "import sys; from nemo_gym.run.cli import run_main; run_main(sys.argv[1:])",
        f"+config_paths=[{ENV_CONFIG},responses_api_models/scripted_model/configs/scripted_model.yaml]",
        "+head_server.port=0",
        f"+ray_head_node_address={cluster.address}",
        f"{block}.num_replicas=2",
        f"{block}.ray_resources=[{{node_a: 1}},{{node_b: 1}}]",
        f"{block}.ray_max_restarts=0",
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        head = None
        while head is None and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
            lines.append(line)
            found = re.match(r"Head server: (http://\S+)", line)
            head = found.group(1) if found else None
        assert head is not None, "".join(lines) + (proc.stderr.read() if proc.poll() is not None else "")
        # The agent and the model here, the resources server's two replicas on the nodes.
        assert any(line.startswith("All 4 / 4 servers ready!") for line in lines), "".join(lines)
        port = int(head.rpartition(":")[2])
        rows = httpx.get(
            head + "/server_instances", headers=auth_headers(client_token(port)), timeout=30, trust_env=False
        ).json()
        replicas = [r for r in rows if r["name"] == RES]
        assert [r["replica"] for r in replicas] == [0, 1] and all(r["alive"] for r in replicas)
        os.kill(replicas[0]["pid"], signal.SIGKILL)
        time.sleep(3)  # several of ng_run's checks: one dead replica of two is not a dead server
        assert proc.poll() is None, proc.stderr.read()
        os.kill(replicas[1]["pid"], signal.SIGKILL)
        code = proc.wait(timeout=60)
        err = proc.stderr.read()
        assert code == 1, (code, err[-3000:])
        assert f"Server '{RES}' (placed on the Ray cluster) is dead" in err, err[-3000:]
        assert "ng_run: stopping the other servers." in err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.mark.slow
def test_run_helper_poll_reports_an_instance_whose_ray_replicas_all_died(cluster: Any) -> None:
    extra = _placed_extra(cluster.address, [{"node_a": 1}, {"node_b": 1}], ray_max_restarts=0)
    with running_servers([ENV_CONFIG], extra) as helper:
        assert helper.supervisor.num_servers() == 4
        rows = _replica_rows(helper)
        os.kill(rows[0]["pid"], signal.SIGKILL)
        helper.poll()  # the other replica serves
        os.kill(rows[1]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        with pytest.raises(RuntimeError, match=rf"Server '{RES}' \(placed on the Ray cluster\) is dead"):
            while time.monotonic() < deadline:
                helper.poll()
                time.sleep(0.2)


@pytest.mark.slow
def test_ray_placed_replicas_config_is_checked_before_anything_serves(cluster: Any) -> None:
    """An unknown key in a Ray-placed block is reported like one in a local block (file, "did you
    mean"), together with the local servers' problems, and no server starts serving."""
    extra = _placed_extra(cluster.address, [{"node_a": 1}, {"node_b": 1}], expose_tools_over_mpc=True)
    extra[AGENT] = {"responses_api_agents": {"simple_agent": {"max_stepz": 3}}}
    before = _descendants()
    with pytest.raises(ConfigError) as info:
        with running_servers([ENV_CONFIG], extra):
            pass
    message = str(info.value)
    assert "no server was started" in message, message
    assert f"'{RES}.resources_servers.{RES}.expose_tools_over_mpc'" in message and "has no setting" in message
    assert (
        "expose_tools_over_mcp" in message
    )  # the "did you mean" of a typo (a key close to no setting is ignored)
    assert f"'{AGENT}.responses_api_agents.simple_agent.max_stepz'" in message and "max_steps" in message
    assert "(2 problems;" in message  # the agent's and the resources server's (two replicas, one problem)
    assert not _wait_gone(_descendants() - before), "a server of the refused run is still running"


# ------------------------------------------------------------------------------------------------
# A normal start and stop with Ray prints no crash-like output.


def test_ng_run_with_ray_starts_and_stops_quietly(ray_env: None, tmp_path: Path) -> None:
    """ng_run +ray_start_local=true, one rollout whose verification runs as a Ray task (so the resources
    server joined the cluster too), then Ctrl+C: no traceback, no Ray "SIGTERM received" stack, no Ray
    warning about signal handlers; the run reports a clean stop. (Errors are not filtered: only Ray's
    not-main-thread warning and its SIGTERM stack for a normal stop are, see nemo_gym.kit.ray_quiet.)"""
    from nemo_gym.tools.testing import collect_rollouts, example_rows

    overrides = tmp_path / "overrides.yaml"
    overrides.write_text(
        yaml.safe_dump(
            {
                "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": [
                    {"contains": "Le Guin", "turns": [{"text": SO_RIGHT}]}]}}},
                "structured_outputs": {"resources_servers": {"structured_outputs": {"pool_threshold_chars": 0}}},
            }
        )
    )  # fmt: skip
    configs = f"{SO_CONFIG},responses_api_models/scripted_model/configs/scripted_model.yaml,{overrides}"
    proc = subprocess.Popen(
        [sys.executable, "-c", "from nemo_gym.run.cli import run_main; run_main()", f"+config_paths=[{configs}]",
         "+ray_start_local=true", "+ray_local_num_cpus=1", "+head_server.port=0"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("servers ready" in x for x in lines) and proc.poll() is None:
            assert time.monotonic() < deadline, "ng_run did not start within 120 s:\n" + "".join(lines)
            time.sleep(0.2)
        assert proc.poll() is None, "ng_run exited during start-up:\n" + "".join(lines)
        port = int(next(x for x in lines if x.startswith("Head server:")).rsplit(":", 1)[1])

        class _Head:  # what collect_rollouts needs of a RunHelper
            head_server_config = type("H", (), {"port": port})()

        code, out, err = collect_rollouts(
            _Head(), [example_rows("structured_outputs")[0]], tmp_path, "structured_outputs_simple_agent"
        )  # type: ignore[arg-type]
        assert code == 0 and [r["reward"] for r in out] == [1.0], err[-3000:]
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    reader.join(timeout=10)
    text = "".join(lines)
    assert proc.returncode == 0, text
    assert "ng_run: all servers stopped." in text, text
    for noise in ("Traceback", "SIGTERM received", "PC: @", "SIGTERM handler is not set"):
        assert noise not in text, f"{noise!r} in the output of a normal start/stop:\n{text}"


def test_only_rays_not_main_thread_warning_is_filtered(caplog: pytest.LogCaptureFixture) -> None:
    """Real problems Ray logs still show; only the one warning about signal handlers is dropped."""
    import logging

    from nemo_gym.kit.ray_quiet import (
        NOT_MAIN_THREAD_WARNING,
        drop_not_main_thread_warning,
        restore_python_sigterm_handler,
    )

    drop_not_main_thread_warning()
    drop_not_main_thread_warning()  # idempotent
    logger = logging.getLogger("ray._private.worker")
    with caplog.at_level(logging.WARNING, logger="ray._private.worker"):
        logger.warning(NOT_MAIN_THREAD_WARNING + ".")
        logger.error("Failed to connect to GCS at 10.0.0.1:6379")
    assert [r.getMessage() for r in caplog.records] == ["Failed to connect to GCS at 10.0.0.1:6379"]
    assert sum(type(f).__name__ == "_DropNotMainThreadWarning" for f in logger.filters) == 1
    result: list[bool] = []
    worker = threading.Thread(target=lambda: result.append(restore_python_sigterm_handler()))
    worker.start()
    worker.join(timeout=10)
    assert result == [False]  # signal handlers can only be set on the main thread: left alone there
    before = signal.getsignal(signal.SIGTERM)
    assert restore_python_sigterm_handler() and signal.getsignal(signal.SIGTERM) is before
