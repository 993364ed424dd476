"""Replicas of a server instance without Ray (``num_replicas: N`` runs N local processes).

A session-keeping environment (example_session_state_mgmt: a counter per session, changed over
several tool calls) runs with 3 resources-server replicas and 2 agent replicas: every rollout scores
1 only if every call of its session reaches the replica that seeded it. Routing, the replica cookie,
a restarted or dead replica, config errors, and the unchanged single-replica case are checked
through real servers and the real client.
"""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from nemo_gym.cli import RunHelper
from nemo_gym.client.replicas import replica_cookie_name
from nemo_gym.client.server_client import ServerClient
from nemo_gym.errors import UpstreamError
from nemo_gym.global_config import ConfigError
from nemo_gym.server.asgi.sessions import cookie_name_for
from nemo_gym.tools.testing import collect_rollouts, example_rows, get, post_json, running_servers

ENV = "example_session_state_mgmt"
CONFIG = f"resources_servers/{ENV}/configs/{ENV}.yaml"
AGENT = f"{ENV}_simple_agent"
ROWS = example_rows(ENV)
REPLICA_COOKIE = replica_cookie_name(ENV)
SESSION_COOKIE = cookie_name_for(ENV)


def _inc(*counts: int) -> dict[str, Any]:
    return {"tool_calls": [{"name": "increment_counter", "arguments": {"count": c}} for c in counts]}


GET = {"tool_calls": [{"name": "get_counter_value", "arguments": {}}]}


def _done(row: dict[str, Any]) -> dict[str, Any]:
    """The final answer, stating the counter's value (the environment's reward needs it told)."""
    return {"text": f"Done: the counter shows {row['expected_count']}."}


CORRECT_TURNS: list[list[dict[str, Any]]] = [
    [*turns, _done(row)]
    for row, turns in zip(
        ROWS,
        [
            [_inc(5, 12), GET],
            [_inc(3), _inc(3), _inc(3), GET],
            [_inc(-25, 7), GET],
            [GET, _inc(10), GET],
            [GET],
        ],
        strict=True,
    )
]


def _user_text(row: dict[str, Any]) -> str:
    return next(m["content"] for m in row["responses_create_params"]["input"] if m["role"] == "user")


def _extra(
    resources_replicas: int = 3, agent_replicas: int = 2, first_turn_delay_s: float = 0.0
) -> dict[str, Any]:
    scripts = [
        {
            "contains": _user_text(r),
            "turns": [{**t[0], "delay_s": first_turn_delay_s}, *t[1:]] if first_turn_delay_s else t,
        }
        for r, t in zip(ROWS, CORRECT_TURNS, strict=True)
    ]
    return {
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": scripts}}},
        ENV: {"resources_servers": {ENV: {"num_replicas": resources_replicas}}},
        AGENT: {"responses_api_agents": {"simple_agent": {"num_replicas": agent_replicas}}},
    }


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    with running_servers([CONFIG], _extra()) as h:
        yield h


def _rows(helper: RunHelper, name: str) -> list[dict[str, Any]]:
    return [r for r in helper.server_instances() if r["name"] == name]


def _client(helper: RunHelper) -> ServerClient:
    return ServerClient(global_config_dict=helper.global_config_dict, max_retries=2, backoff_s=0.05)


def test_each_replica_is_its_own_process_and_every_process_is_told_of_all(helper: RunHelper) -> None:
    rows = _rows(helper, ENV)
    assert [r["replica"] for r in rows] == [0, 1, 2]
    assert len({r["port"] for r in rows}) == 3 and len({r["pid"] for r in rows}) == 3
    assert all(r["alive"] for r in rows)
    assert [r["replica"] for r in _rows(helper, AGENT)] == [0, 1]
    # Servers without num_replicas are one process, listed as before.
    (model,) = _rows(helper, "policy_model")
    assert "replica" not in model
    head = f"http://127.0.0.1:{helper.head_server_config.port}"
    served = yaml.safe_load(get(head + "/global_config_dict_yaml").text)
    listed = served[ENV]["resources_servers"][ENV]["replicas"]
    assert [r["port"] for r in listed] == [r["port"] for r in rows]
    assert served[ENV]["resources_servers"][ENV]["port"] == rows[0]["port"]


def test_rollouts_through_replicas_keep_their_sessions(helper: RunHelper, tmp_path: Path) -> None:
    """40 rollouts of multi-call sessions over 3 resources replicas: each scores 1 only if every call
    reached the replica holding its counter."""
    rows = [copy.deepcopy(ROWS[i % 5]) for i in range(40)]
    code, out, err = collect_rollouts(helper, rows, tmp_path, AGENT)
    assert code == 0, err[-3000:]
    assert len(out) == 40 and [r["reward"] for r in out] == [1.0] * 40


async def _seed(client: ServerClient, cookies: dict[str, str] | None = None) -> dict[str, str]:
    row = {**ROWS[0], "initial_count": 7}
    _, set_cookies = await client.post_json(ENV, "/seed_session", json=row, cookies=cookies)
    return set_cookies


async def test_new_sessions_spread_and_later_calls_stick(helper: RunHelper) -> None:
    client = _client(helper)
    seeded = [await _seed(client) for _ in range(6)]
    indices = [int(c[REPLICA_COOKIE].partition(".")[0]) for c in seeded]
    assert sorted(indices) == [0, 0, 1, 1, 2, 2]  # round robin over the three
    for cookies in seeded:
        _, again = await client.post_json(ENV, "/increment_counter", json={"count": 3}, cookies=cookies)
        assert REPLICA_COOKIE not in again  # the replica only names itself to a request that lacks it
        body, _ = await client.post_json(ENV, "/get_counter_value", json={}, cookies=cookies)
        assert body["count"] == 10  # the session's own counter: the calls reached its replica


async def test_a_restarted_replicas_old_sessions_fail_as_infrastructure(helper: RunHelper) -> None:
    client = _client(helper)
    cookies = await _seed(client)
    index, _, boot = cookies[REPLICA_COOKIE].partition(".")
    stale = {**cookies, REPLICA_COOKIE: f"{index}.{'0' * len(boot)}"}  # an earlier boot of that replica
    with pytest.raises(UpstreamError) as info:
        await client.post_json(ENV, "/increment_counter", json={"count": 1}, cookies=stale)
    assert info.value.status == 503 and info.value.detail["error"]["kind"] == "replica_session_lost"
    with pytest.raises(UpstreamError, match="names no replica"):
        await client.post_json(ENV, "/get_counter_value", json={}, cookies={REPLICA_COOKIE: "9.x"})


def test_round_robin_skips_replicas_marked_down() -> None:
    from nemo_gym.client.replicas import ReplicaSet

    rs = ReplicaSet("x", [{"host": "h", "port": p} for p in (1, 2, 3)])
    assert [rs.next_index() for _ in range(4)] == [0, 1, 2, 0]
    rs.mark_down(2)
    assert [rs.next_index() for _ in range(4)] == [1, 0, 1, 0]
    assert rs.next_index(avoid=1) == 0
    rs.mark_down(0)
    rs.mark_down(1)
    assert rs.next_index() in (0, 1, 2)  # every replica down: try one anyway (it may be back)
    assert rs.sticky_index({"ng_replica_x": "2.abc"}) == 2 and rs.sticky_index({}) is None


def test_replica_cookie_is_absent_without_replicas() -> None:
    extra = {AGENT: {"responses_api_agents": {"simple_agent": {"num_replicas": 1}}}}
    with running_servers([CONFIG], extra) as h:
        (row,) = _rows(h, ENV)
        assert "replica" not in row
        resp = post_json(row["url"] + "/seed_session", {**ROWS[0], "initial_count": 1})
        assert resp.status_code == 200 and SESSION_COOKIE in resp.cookies
        assert not any(name.startswith("ng_replica_") for name in resp.cookies)
        client = ServerClient(global_config_dict=h.global_config_dict)
        client._host_port(ENV)
        assert client._host_ports[ENV] == ("127.0.0.1", row["port"])  # a plain address: no routing


def test_bad_num_replicas_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(
        ConfigError, match=rf"'{ENV}\.resources_servers\.{ENV}\.num_replicas'.*positive integer"
    ):
        with running_servers([CONFIG], {ENV: {"resources_servers": {ENV: {"num_replicas": 0}}}}):
            pass


def test_ray_placement_without_a_cluster_and_launcher_keys_are_config_errors() -> None:
    block = {"ray_resources": {"CPU": 1}}
    with pytest.raises(
        ConfigError,
        match=r"\.ray_resources' places 'example_session_state_mgmt' on a Ray cluster, but the run has none",
    ):
        with running_servers([CONFIG], {ENV: {"resources_servers": {ENV: block}}}):
            pass
    block = {"replicas": [{"host": "127.0.0.1", "port": 1}]}
    with pytest.raises(ConfigError, match=r"\.replicas' .*is filled in by the launcher"):
        with running_servers([CONFIG], {ENV: {"resources_servers": {ENV: block}}}):
            pass


def test_a_dead_replica_gets_no_new_sessions_and_its_sessions_fail_as_infrastructure(tmp_path: Path) -> None:
    with running_servers([CONFIG], _extra(resources_replicas=2, agent_replicas=1)) as h:
        client = _client(h)

        async def scenario() -> None:
            seeded = [await _seed(client) for _ in range(2)]
            by_index = {int(c[REPLICA_COOKIE].partition(".")[0]): c for c in seeded}
            victim = next(r for r in _rows(h, ENV) if r["replica"] == 1)
            os.kill(victim["pid"], signal.SIGKILL)
            deadline = time.monotonic() + 10
            while (
                next(r for r in _rows(h, ENV) if r["replica"] == 1)["alive"] and time.monotonic() < deadline
            ):
                await asyncio.sleep(0.05)
            # Its session: an infrastructure failure naming the replica, never an answer.
            with pytest.raises(UpstreamError, match="replica 1 of 2") as info:
                await client.post_json(ENV, "/increment_counter", json={"count": 1}, cookies=by_index[1])
            assert info.value.kind == "connection_error"
            # New sessions all go to the live replica, without errors.
            fresh = [await _seed(client) for _ in range(4)]
            assert {c[REPLICA_COOKIE].partition(".")[0] for c in fresh} == {"0"}
            # The run goes on: a replica with a live sibling is not a dead server.
            assert h.supervisor.dead_server() is None

        asyncio.run(scenario())
        code, out, err = collect_rollouts(h, [copy.deepcopy(r) for r in ROWS], tmp_path, AGENT)
        assert code == 0, err[-3000:]
        assert [r["reward"] for r in out] == [1.0] * 5


def test_one_dead_replica_of_several_does_not_stop_the_run(tmp_path: Path) -> None:
    """Replica 1 of 2 is killed mid-run: its sessions in flight fail as infrastructure failures (the
    sidecar), the circuit breaker does not call the server down (its other replica is alive), the run
    finishes every other row through replica 0, and a resume completes exactly the missing pairs.
    Once replica 0 is killed too, the breaker calls the server down (exit 3)."""
    import json
    import threading

    # Each rollout's first model turn takes 0.8 s, its session open on its replica meanwhile: 300 rows at 24
    # in flight take >= 10 s, so the kill lands mid-run however late a loaded machine wakes the killer (a
    # run of 2.4 s once finished before it, with no session left on the victim and nothing failed).
    extra = _extra(resources_replicas=2, agent_replicas=1, first_turn_delay_s=0.8)
    with running_servers([CONFIG], extra) as h:
        victim = next(r for r in _rows(h, ENV) if r["replica"] == 1)
        rows = [copy.deepcopy(ROWS[i % 5]) for i in range(300)]
        output = tmp_path / "output.jsonl"
        killed = threading.Event()

        def kill_mid_run() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if output.exists() and output.read_bytes().count(b"\n") >= 40:
                    os.kill(victim["pid"], signal.SIGKILL)
                    killed.set()
                    return
                time.sleep(0.01)

        killer = threading.Thread(target=kill_mid_run)
        killer.start()
        try:
            args = ("+num_samples_in_parallel=24", "+circuit_breaker_threshold=2")
            code, out, err = collect_rollouts(h, rows, tmp_path, AGENT, *args)
        finally:
            killer.join(timeout=130)
        assert killed.is_set(), "the run ended before the replica was killed"
        summary = json.loads((tmp_path / "output_aggregate_metrics.json").read_text())
        assert summary["down_servers"] == [], summary["down_servers"]
        assert code == 1 and "is down" not in err, (code, err[-3000:])
        assert all(r["reward"] == 1.0 for r in out)
        failures = [
            json.loads(line) for line in (tmp_path / "output_failures.jsonl").read_text().splitlines()
        ]
        assert failures and all(f["server"] == ENV for f in failures), failures[:3]
        done = {(r["_ng_task_index"], r["_ng_rollout_index"]) for r in out}
        failed = {(f["_ng_task_index"], f["_ng_rollout_index"]) for f in failures}
        assert not done & failed and len(done | failed) == 300  # every row: rewarded, or in the sidecar
        code2, out2, err2 = collect_rollouts(h, rows, tmp_path, AGENT, "+resume_from_cache=true")
        assert code2 == 0, err2[-3000:]
        keys = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in out2]
        assert len(keys) == len(set(keys)) == 300 and set(keys) - done == failed
        assert all(r["reward"] == 1.0 for r in out2)
        # With its last replica gone too, the server is down: the breaker stops the run (exit 3).
        os.kill(next(r for r in _rows(h, ENV) if r["replica"] == 0)["pid"], signal.SIGKILL)
        code3, out3, err3 = collect_rollouts(h, rows, tmp_path / "all_dead", AGENT, *args)
        assert code3 == 3 and out3 == [] and f"server '{ENV}' is down" in err3, (code3, err3[-3000:])


def test_breaker_asks_before_calling_a_replicated_server_down() -> None:
    from nemo_gym.collection.circuit_breaker import CircuitBreaker

    def down(server: str) -> dict[str, Any]:
        return {"kind": "connection_error", "server": server, "path": "/verify", "status": None}

    breaker = CircuitBreaker(2, replicated={"res"})
    assert breaker.failure("agent", down("res")) is None
    assert breaker.failure("agent", down("res")) == "res"  # at the threshold: the caller checks replicas
    breaker.still_serving("res")  # a replica is alive: not down, the count starts again
    assert breaker.blocking("agent") is None and breaker.replica_losses == 2
    assert breaker.failure("agent", down("res")) is None
    assert breaker.failure("agent", down("res")) == "res"
    breaker.confirm_down("res")  # no replica answers
    assert breaker.blocking("agent")["server"] == "res"
    # A server with one process opens at the threshold, as before.
    single = CircuitBreaker(2)
    single.failure("agent", down("model"))
    assert single.failure("agent", down("model")) is None and single.blocking("agent")["server"] == "model"
