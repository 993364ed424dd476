"""Server replicas placed on the nodes of a real 2-node Ray cluster started for this module on this
machine (tests/ray_cluster.py): what a replica's process holds (secrets, environment, the run token),
2,000 rollouts through two replicas, placement no node can satisfy, a killed node and resume, and ng_run
and RunHelper noticing replicas that died.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from nemo_gym.global_config import ConfigError
from nemo_gym.run.supervision.children import StartupError
from nemo_gym.tools.testing import get, running_servers
from tests.ray_cluster import (
    ENV_CONFIG,
    NODE_SECRET,
    NODE_SECRET_VAR,
    OBJECT_STORE_BYTES,
    REPO,
    descendants,
    node_with,
    wait_gone,
)

ray = pytest.importorskip("ray", reason="the `ray` extra is not installed (pip install -e '.[ray]')")

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


MODEL_ONLY_KEY = "sk-only-the-model-holds-this-8e2f"


@pytest.mark.slow
def test_ray_replicas_get_only_their_own_secrets_and_a_filtered_environment(ray_cluster: Any) -> None:
    """A replica's server process on a Ray node: not the node's secret-looking variables (unless its
    block names them in pass_env), not another server's key; the run token is there."""
    extra = _placed_extra(ray_cluster.address, [{"node_a": 1}, {"node_b": 1}])
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


def _replica_rows(helper: Any) -> list[dict[str, Any]]:
    return [r for r in helper.server_instances() if r["name"] == RES]


def _cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


@pytest.mark.slow
def test_replicas_run_on_their_nodes_require_the_token_and_serve_2000_rollouts(
    ray_cluster: Any, tmp_path: Path
) -> None:
    """Replica 0 on node_a, replica 1 on node_b (each started by its actor there, bound to every
    interface); without the run token a replica refuses; 2,000 rollouts through both, all rewarded 1."""
    import httpx

    from nemo_gym.tools.testing import collect_rollouts, example_rows

    extra = _placed_extra(ray_cluster.address, [{"node_a": 1}, {"node_b": 1}])
    with running_servers([ENV_CONFIG], extra) as helper:
        rows = _replica_rows(helper)
        assert [r["replica"] for r in rows] == [0, 1]
        assert [r["node"] for r in rows] == [node_with("node_a"), node_with("node_b")]
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
    assert not wait_gone({r["pid"] for r in rows}), "a replica's server outlived the run"
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
def test_placement_no_node_can_satisfy_fails_within_the_bound_naming_the_replica(ray_cluster: Any) -> None:
    extra = {**_placed_extra(ray_cluster.address, [{"node_z": 1}]), "startup_timeout_s": 5}
    with pytest.raises(StartupError, match=r"Could not place replica example_single_tool_call\[0\].*node_z"):
        with running_servers([ENV_CONFIG], extra):
            pass


@pytest.mark.slow
def test_a_killed_node_loses_no_row_and_resume_completes_the_missing_pairs(
    ray_cluster: Any, tmp_path: Path
) -> None:
    """Replica 1 on a third node that is removed (its raylet, actor and server killed) mid-run: no
    row is scored 0 or lost, the failed rollouts are infrastructure failures, the run goes on through
    the other replica (not stopped as "server down"), and a resume completes exactly the missing
    pairs through the surviving replica."""
    from nemo_gym.tools.testing import collect_rollouts, example_rows

    node_c = ray_cluster.add_node(
        num_cpus=1, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False, resources={"node_c": 1}
    )
    try:
        ray_cluster.wait_for_nodes(timeout=60)
        extra = _placed_extra(ray_cluster.address, [{"node_a": 1}, {"node_c": 1}], ray_max_restarts=1)
        with running_servers([ENV_CONFIG], extra) as helper:
            rows = _replica_rows(helper)
            assert rows[1]["node"] == node_with("node_c")
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
                        ray_cluster.remove_node(node_c, allow_graceful=False)
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
            assert not wait_gone({victim_pid}), "the killed node's replica process outlived its node"
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
            ray_cluster.remove_node(node_c)


# ------------------------------------------------------------------------------------------------
# The launcher and Ray-placed replicas: ready count, dead instances, config check.


@pytest.mark.slow
def test_ng_run_counts_ray_replicas_and_stops_when_every_replica_is_dead(ray_cluster: Any) -> None:
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
        f"+ray_head_node_address={ray_cluster.address}",
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
def test_run_helper_poll_reports_an_instance_whose_ray_replicas_all_died(ray_cluster: Any) -> None:
    extra = _placed_extra(ray_cluster.address, [{"node_a": 1}, {"node_b": 1}], ray_max_restarts=0)
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
def test_ray_placed_replicas_config_is_checked_before_anything_serves(ray_cluster: Any) -> None:
    """An unknown key in a Ray-placed block is reported like one in a local block (file, "did you
    mean"), together with the local servers' problems, and no server starts serving."""
    extra = _placed_extra(ray_cluster.address, [{"node_a": 1}, {"node_b": 1}], expose_tools_over_mpc=True)
    extra[AGENT] = {"responses_api_agents": {"simple_agent": {"max_stepz": 3}}}
    before = descendants()
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
    assert not wait_gone(descendants() - before), "a server of the refused run is still running"
