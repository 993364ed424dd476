"""Policy versions for asynchronous RL, with real servers: ``POST /policy_version`` on the model servers,
the version on every answer, recorded call and rollout line, and ``max_policy_lag`` in
``ng_collect_rollouts`` and ``RolloutCollectionHelper``.

Two scripted models: ``policy_model`` (behind the example's simple agent) and ``policy_model_2``
(behind ``agent_2``). Giving them different versions makes the stale rollouts exactly those of one
agent, whatever the order the rollouts finish in.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from nemo_gym.auth import TRAINER_TOKEN_HEADER_NAME, auth_headers, rollout_credential, trainer_token
from nemo_gym.config.types import BaseServerConfig
from nemo_gym.rollout_collection import RolloutCollectionHelper, StalePolicyError
from nemo_gym.server.policy_version import policy_lag
from nemo_gym.tools.testing import collect_rollouts, get, post_json, running_servers, server_url, weather_row

EXAMPLE_CONFIG = "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml"
AGENT = "example_single_tool_call_simple_agent"
AGENT_2 = "agent_2"
MODELS = ("policy_model", "policy_model_2")
SLOW_CALL_S = 1.5


def _tool(city: str) -> dict[str, Any]:
    return {"name": "get_weather", "arguments": {"city": city}}


SCRIPTS = [
    {
        "contains": "Slowtown",
        "turns": [{"tool_calls": [_tool("Slowtown")], "delay_s": SLOW_CALL_S}, {"text": "Done."}],
    }
]


@pytest.fixture(scope="module")
def run() -> Any:
    extra = {
        "observability_enabled": True,
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": SCRIPTS}}},
        "policy_model_2": {"responses_api_models": {"scripted_model": {"entrypoint": "app.py"}}},
        AGENT_2: {
            "responses_api_agents": {
                "simple_agent": {
                    "entrypoint": "app.py",
                    "resources_server": {"type": "resources_servers", "name": "example_single_tool_call"},
                    "model_server": {"type": "responses_api_models", "name": "policy_model_2"},
                    "max_steps": 5,
                }
            }
        },
    }
    with running_servers([EXAMPLE_CONFIG], extra) as helper:
        yield helper


def _set(helper: Any, model: str, version: Any) -> httpx.Response:
    return post_json(server_url(helper, model) + "/policy_version", {"policy_version": version})


def _base(helper: Any) -> int:
    """A version above both models' current ones: the version only moves forward, and the tests of this
    module share one run, so each test counts from its own base."""
    current = [get(server_url(helper, m) + "/policy_version").json()["policy_version"] for m in MODELS]
    return max([v for v in current if isinstance(v, int)] + [0]) + 100


def _lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def test_bad_bodies_are_400s_naming_the_field(run: Any) -> None:
    url = server_url(run, "policy_model") + "/policy_version"
    for body in (
        {},
        {"policy_version": 1.5},
        {"policy_version": True},
        {"policy_version": ""},
        {"policy_version": None},
        [3],
    ):
        resp = post_json(url, body)
        assert resp.status_code == 400, (body, resp.text)
        assert "policy_version" in resp.json()["error"]["message"], body
    resp = post_json(url, {"policy_version": 1, "version": 2})
    assert resp.status_code == 400 and "'version'" in resp.json()["error"]["message"]
    token = {"content-type": "application/json"}
    no_token = httpx.post(url, content=b'{"policy_version": 1}', headers=token, timeout=10, trust_env=False)
    assert no_token.status_code in (401, 403)


def test_only_the_trainer_credential_moves_the_policy_version(run: Any) -> None:
    """Before: any holder of the run token (every server, any harness) could set it, under a rollout's
    base URL too. Now the run token alone is a 403 naming the trainer credential; a rollout credential
    does not even pass the door."""
    model = server_url(run, "policy_model")
    b = _base(run)
    body = orjson.dumps({"policy_version": b})
    run_token = {"content-type": "application/json", **auth_headers(run.supervisor.auth_token)}
    for headers in (run_token, {**run_token, TRAINER_TOKEN_HEADER_NAME: "not-the-trainer-token"}):
        resp = httpx.post(
            model + "/policy_version", content=body, headers=headers, timeout=10, trust_env=False
        )
        assert resp.status_code == 403, resp.text
        assert TRAINER_TOKEN_HEADER_NAME in resp.json()["error"]["message"]
    scoped = {
        "content-type": "application/json",
        **auth_headers(rollout_credential(run.supervisor.auth_token, "r1")),
    }
    resp = httpx.post(
        model + "/ng-rollout/r1/policy_version", content=body, headers=scoped, timeout=10, trust_env=False
    )
    assert resp.status_code == 401, resp.text
    assert get(model + "/policy_version").json()["policy_version"] != b  # nothing moved it
    trainer = {**run_token, TRAINER_TOKEN_HEADER_NAME: trainer_token(run.head_server_config.port)}
    resp = httpx.post(model + "/policy_version", content=body, headers=trainer, timeout=10, trust_env=False)
    assert resp.status_code == 200 and resp.json()["policy_version"] == b


def test_the_policy_version_only_moves_forward(run: Any) -> None:
    b = _base(run)
    assert _set(run, "policy_model", b + 2).status_code == 200
    for stale in (b + 2, b + 1, str(b)):
        resp = _set(run, "policy_model", stale)
        assert resp.status_code == 409, (stale, resp.text)
        assert f"it is {b + 2}" in resp.json()["error"]["message"]
    assert _set(run, "policy_model", str(b + 3)).status_code == 200  # a string holding a higher integer
    assert _set(run, "policy_model", "ckpt-a").status_code == 200  # strings without an order may follow
    assert _set(run, "policy_model", "ckpt-a").status_code == 409  # but never repeat the current one
    assert _set(run, "policy_model", b + 4).status_code == 200
    assert get(server_url(run, "policy_model") + "/policy_version").json()["policy_version"] == b + 4


def test_version_set_mid_run_reaches_later_calls_records_and_lines(run: Any, tmp_path: Path) -> None:
    """One collection (one rollout at a time): the first model call of the first rollout starts at
    version b+7 and sleeps; the version becomes b+8 meanwhile; every later call is answered at b+8."""
    b = _base(run)
    assert _set(run, "policy_model", b + 7).status_code == 200
    assert get(server_url(run, "policy_model") + "/policy_version").json()["policy_version"] == b + 7
    stats_url = server_url(run, "policy_model") + "/stats"
    before = get(stats_url).json()["requests"]
    rows = [weather_row("Slowtown"), weather_row("Paris"), weather_row("Tokyo")]
    bumped = threading.Event()

    def trainer() -> None:  # the collector runs on this thread (it installs signal handlers)
        deadline = time.monotonic() + 30
        while get(stats_url).json()["requests"] == before:  # the slow first call has started
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        if _set(run, "policy_model", b + 8).status_code == 200:
            bumped.set()

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    code, out, err = collect_rollouts(run, rows, tmp_path, AGENT, "+num_samples_in_parallel=1")
    thread.join(30)
    assert bumped.is_set(), "the first model call never arrived, or the version was not set"
    assert code == 0, err
    by_city = {r["expected_city"]: r for r in out}
    assert by_city["Slowtown"]["policy_versions"] == [b + 7, b + 8]
    assert by_city["Paris"]["policy_versions"] == [b + 8] and by_city["Tokyo"]["policy_versions"] == [b + 8]
    assert all("stale_policy" not in r for r in out)  # no max_policy_lag: nothing judged
    calls = [c for c in _lines(tmp_path / "output_model_calls.jsonl") if c["kind"] == "model_call"]
    slow = sorted((c for c in calls if c["_ng_task_index"] == 0), key=lambda c: c["call_index"])
    assert [c["policy_version"] for c in slow] == [b + 7, b + 8]
    assert {c["policy_version"] for c in calls if c["_ng_task_index"] != 0} == {b + 8}
    # The recorded answer carries the stamp too (on every output item).
    assert all(item["policy_version"] == b + 7 for item in slow[0]["response"]["output"])


def _mixed_rows() -> list[dict[str, Any]]:
    """Four rollouts of agent 1 (policy_model) and three of agent 2 (policy_model_2), interleaved."""
    cities = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Perth"]
    return [weather_row(c, AGENT if i % 2 == 0 else AGENT_2) for i, c in enumerate(cities)]


@pytest.mark.parametrize("mode", ["mark", "drop"])
def test_max_policy_lag_in_ng_collect_rollouts(run: Any, tmp_path: Path, mode: str) -> None:
    """Agent 1's model is at version 5, agent 2's (the one the collector asks) at 8: with a lag bound
    of 2, exactly agent 1's rollouts (3 versions behind) are stale."""
    b = _base(run)
    assert _set(run, "policy_model", b + 5).status_code == 200
    assert _set(run, "policy_model_2", b + 8).status_code == 200
    args = ("+max_policy_lag=2", f"+stale_policy={mode}", "+policy_version_model=policy_model_2")
    code, out, err = collect_rollouts(run, _mixed_rows(), tmp_path, AGENT, *args)
    assert code == (0 if mode == "mark" else 1), err  # dropped rollouts are missing: exit status 1
    agent_1 = [r for r in out if r["agent_ref"]["name"] == AGENT]
    agent_2 = [r for r in out if r["agent_ref"]["name"] == AGENT_2]
    assert len(agent_2) == 3 and all(
        r["policy_versions"] == [b + 8] and "stale_policy" not in r for r in agent_2
    )
    summary = orjson.loads((tmp_path / "output_aggregate_metrics.json").read_bytes())
    if mode == "mark":
        assert len(agent_1) == 4
        assert all(
            r["policy_versions"] == [b + 5] and r["stale_policy"] is True and r["policy_lag"] == 3
            for r in agent_1
        )
        assert summary["policy_lag"]["stale"] == 4 and summary["policy_lag"]["dropped"] == 0
    else:
        assert agent_1 == []  # written nowhere: a resume runs them again
        assert summary["policy_lag"]["dropped"] == 4 and summary["not_persisted"] == 4

    # At the bound itself nothing is stale.
    code, out, err = collect_rollouts(run, _mixed_rows(), tmp_path / "bound", AGENT, "+max_policy_lag=3",
                                      f"+stale_policy={mode}", "+policy_version_model=policy_model_2")  # fmt: skip
    assert code == 0, err
    assert len(out) == 7 and all("stale_policy" not in r for r in out)


def test_max_policy_lag_names_an_unknown_model_server(run: Any, tmp_path: Path) -> None:
    code, _, err = collect_rollouts(
        run, [weather_row("Paris")], tmp_path, AGENT, "+max_policy_lag=1", "+policy_version_model=nope"
    )
    assert code == 2 and "policy_version_model='nope'" in err


@pytest.mark.parametrize("mode", ["mark", "drop"])
def test_max_policy_lag_in_rollout_collection_helper(run: Any, mode: str) -> None:
    b = _base(run)
    assert _set(run, "policy_model", b + 10).status_code == 200
    assert _set(run, "policy_model_2", b + 12).status_code == 200
    head = BaseServerConfig(host="127.0.0.1", port=run.head_server_config.port)
    rows = _mixed_rows()

    async def main() -> tuple[list[dict[str, Any]], list[StalePolicyError]]:
        helper = RolloutCollectionHelper(
            num_samples_in_parallel=4,
            max_policy_lag=1,
            stale_policy=mode,
            policy_version_model="policy_model_2",
        )
        kept, dropped = [], []
        try:
            for future in helper.run_examples(rows, head_server_config=head):
                try:
                    _, result = await future
                    kept.append(result)
                except StalePolicyError as e:
                    dropped.append(e)
        finally:
            await helper.aclose()
        return kept, dropped

    kept, dropped = asyncio.run(asyncio.wait_for(main(), 120))
    stale = [r for r in kept if r.get("stale_policy")]
    fresh = [r for r in kept if not r.get("stale_policy")]
    assert len(fresh) == 3 and all(r["policy_versions"] == [b + 12] for r in fresh)
    if mode == "mark":
        assert len(stale) == 4 and not dropped
        assert all(r["policy_versions"] == [b + 10] and r["policy_lag"] == 2 for r in stale)
    else:
        assert not stale and len(dropped) == 4
        assert all(
            e.lag == 2 and e.current == b + 12 and e.row["agent_ref"]["name"] == AGENT for e in dropped
        )


def test_policy_lag_rule() -> None:
    assert policy_lag([3, 5], 6) == 3 and policy_lag([6], 6) == 0 and policy_lag([7], 6) == 0
    assert policy_lag(["4"], "6") == 2 and policy_lag([], 6) is None and policy_lag([1], None) is None
    assert policy_lag(["ckpt-a"], "ckpt-a") == 0 and policy_lag(["ckpt-a"], "ckpt-b") > 10**9
