"""Environment servers (NeMo Gym 0.7's fourth kind of server) under ng_run, with real servers.

One run holds: example_single_tool_call and its simple_agent fronted by legacy_agent exactly as 0.7's
own config lays them out; a second agent fronted by a legacy_agent with tight bounds; an environment
server of the user's own (a folder in the working directory, written against upstream's module paths)
with a typed episode protocol; the scripted model.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from nemo_gym.auth import auth_headers, client_token_for_url
from nemo_gym.run.cli import RunHelper
from nemo_gym.tools.testing import (
    collect_rollouts,
    example_rows,
    post_json,
    running_servers,
    scrape,
    server_url,
)
from resources_servers.example_single_tool_call.app import weather_report

AGENT = "example_single_tool_call_simple_agent"
ENV_SERVER = "example_single_tool_call_environment_server"
BOUNDED_AGENT = "bounded_agent"
BOUNDED_ENV = "bounded_environment_server"
USER_ENV = "count_env_server"
CITIES = [r["expected_city"] for r in example_rows("example_single_tool_call")]

# NeMo Gym 0.7's example_single_tool_call.yaml, key for key (written here): its resources server, its
# agent, and the legacy_agent environment server in front of the agent.
UPSTREAM_07_CONFIG = """\
example_single_tool_call:
  resources_servers:
    example_single_tool_call:
      entrypoint: app.py
      domain: agent
      verified: false
      description: Basic single-step tool calling
example_single_tool_call_simple_agent:
  responses_api_agents:
    simple_agent:
      entrypoint: app.py
      resources_server:
        type: resources_servers
        name: example_single_tool_call
      model_server:
        type: responses_api_models
        name: policy_model
      datasets:
      - name: example
        type: example
        jsonl_fpath: resources_servers/example_single_tool_call/data/example.jsonl

example_single_tool_call_environment_server:
  environment_servers:
    legacy_agent:
      entrypoint: app.py
      agent_server:
        type: responses_api_agents
        name: example_single_tool_call_simple_agent
"""

# A second agent behind a relay that allows one episode at a time, waits 0.3 s for a place, 1 s per episode.
BOUNDED_CONFIG = f"""\
{BOUNDED_AGENT}:
  responses_api_agents:
    simple_agent:
      entrypoint: app.py
      resources_server: {{type: resources_servers, name: example_single_tool_call}}
      model_server: {{type: responses_api_models, name: policy_model}}
{BOUNDED_ENV}:
  environment_servers:
    legacy_agent:
      entrypoint: app.py
      agent_server: {{type: responses_api_agents, name: {BOUNDED_AGENT}}}
      max_concurrent_episodes: 1
      queue_timeout_seconds: 0.3
      default_episode_timeout_seconds: 1
"""

# An environment server of the user's, found in the working directory, importing upstream's paths only.
USER_ENV_APP = """\
import asyncio
from pathlib import Path

from pydantic import BaseModel

from nemo_gym.base_environment_server import (
    BaseEnvironmentServer,
    BaseEnvironmentServerConfig,
    CleanupContext,
    HandledEpisodeError,
)
from nemo_gym.episode_types import BaseEpisodeRequest, BaseEpisodeResponse, EpisodeFailure, TaskId


class CountInput(BaseModel):
    action: str
    marker: str


class CountResult(BaseModel):
    reward: float


class CountEnvConfig(BaseEnvironmentServerConfig):
    pass


class CountEnv(BaseEnvironmentServer):
    config: CountEnvConfig
    request_model = BaseEpisodeRequest[CountInput]
    response_model = BaseEpisodeResponse[CountResult]

    async def run(self, request, cleanup: CleanupContext):
        task = request.task.task_input
        cleanup.register_cleanup("first", lambda: _append(task.marker, "first"))
        cleanup.register_cleanup("second", lambda: _append(task.marker, "second"))
        if task.action == "handled":
            raise HandledEpisodeError(EpisodeFailure(failure_reason="seed refused", terminal=True, stage="seed"))
        if task.action == "crash":
            raise RuntimeError("boom")
        if task.action == "hang":
            await asyncio.sleep(60)
        task_id = request.task.task_id
        if task.action == "wrong_task":
            task_id = TaskId(taskset=task_id.taskset, task_id="another")
        return self.response_model(episode_id=request.episode_id, task_id=task_id, result=CountResult(reward=1.0))


async def _append(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(text + "\\n")


if __name__ == "__main__":
    CountEnv.run_webserver()
"""

USER_ENV_CONFIG = f"""\
{USER_ENV}:
  environment_servers:
    count_env:
      entrypoint: app.py
      max_concurrent_episodes: 1
      queue_timeout_seconds: 0.3
      default_episode_timeout_seconds: 1
      cleanup_timeout_seconds: 5
"""


def _scripts() -> list[dict[str, Any]]:
    rules = [
        {
            "contains": city,
            "turns": [
                {"tool_calls": [{"name": "get_weather", "arguments": {"city": city}}]},
                {"text": weather_report(city)},
            ],
        }
        for city in CITIES
    ]
    # A model that takes 3 s: past the bounded relay's 1 s episode bound.
    rules.append({"contains": "Slowtown", "turns": [{"text": "thinking...", "delay_s": 3}]})
    return rules


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunHelper, Path]]:
    work = tmp_path_factory.mktemp("env_servers")
    (work / "upstream_07.yaml").write_text(UPSTREAM_07_CONFIG)
    (work / "bounded.yaml").write_text(BOUNDED_CONFIG)
    (work / "count_env.yaml").write_text(USER_ENV_CONFIG)
    folder = work / "environment_servers" / "count_env"
    folder.mkdir(parents=True)
    (folder / "app.py").write_text(USER_ENV_APP)
    configs = [str(work / n) for n in ("upstream_07.yaml", "bounded.yaml", "count_env.yaml")]
    extra = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": _scripts()}}}}
    cwd = os.getcwd()
    os.chdir(work)  # the user's folder is found in the working directory
    try:
        with running_servers(configs, extra) as helper:
            yield helper, work
    finally:
        os.chdir(cwd)


def _route_count(url: str, route: str, status: str) -> float:
    samples = scrape(url)
    return sum(
        v
        for labels, v in samples.get("nemo_gym_http_requests_total", [])
        if labels.get("route") == route and labels.get("status") == status
    )


def test_an_upstream_07_config_starts_its_four_servers_and_its_rollouts_run_through_the_environment_server(
    run: tuple[RunHelper, Path], tmp_path: Path
) -> None:
    helper, _work = run
    kinds = {r["name"] for r in helper.server_instances()}
    assert {"example_single_tool_call", AGENT, ENV_SERVER, "policy_model"} <= kinds
    env_url, agent_url = server_url(helper, ENV_SERVER), server_url(helper, AGENT)
    env_before, agent_before = _route_count(env_url, "/run", "200"), _route_count(agent_url, "/run", "200")
    rows = example_rows("example_single_tool_call")
    code, out, err = collect_rollouts(helper, rows, tmp_path, AGENT)
    assert code == 0, err
    assert [r["reward"] for r in out] == [1.0] * 5, err
    assert {r["_ng_environment_server"] for r in out} == {ENV_SERVER}
    # Each /run went to the environment server, which relayed it to the agent.
    assert _route_count(env_url, "/run", "200") - env_before == 5
    assert _route_count(agent_url, "/run", "200") - agent_before == 5
    assert (
        not (tmp_path / "output_failures.jsonl").exists()
        or not (tmp_path / "output_failures.jsonl").read_text()
    )


def test_the_relay_answers_with_the_agents_answer_and_holds_its_bounds(run: tuple[RunHelper, Path]) -> None:
    helper, _work = run
    url = server_url(helper, BOUNDED_ENV) + "/run"
    # The agent's own error comes back unchanged: status and body.
    bad = post_json(url, {"responses_create_params": {"input": 7}})
    assert bad.status_code == 422, bad.text
    assert "responses_create_params" in bad.text
    # An episode past default_episode_timeout_seconds: a 504 naming the agent and the setting, after ~1 s.
    slow = {"responses_create_params": {"input": "Slowtown?"}}
    timed_out = post_json(url, slow)
    assert timed_out.status_code == 504, timed_out.text
    assert BOUNDED_AGENT in timed_out.text and "default_episode_timeout_seconds" in timed_out.text

    # One episode at a time: a second caller waits at most queue_timeout_seconds, then a 503 saying so.
    async def both() -> list[httpx.Response]:
        headers = {**auth_headers(client_token_for_url(url)), "content-type": "application/json"}
        async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
            first = asyncio.ensure_future(client.post(url, content=orjson.dumps(slow), headers=headers))
            await asyncio.sleep(0.2)
            second = await client.post(url, content=orjson.dumps(slow), headers=headers)
            return [await first, second]

    first, second = asyncio.run(both())
    assert first.status_code == 504, first.text
    assert second.status_code == 503 and "queue_timeout_seconds" in second.text, second.text


def test_a_relay_timeout_is_a_failure_of_the_collection_never_a_reward(
    run: tuple[RunHelper, Path], tmp_path: Path
) -> None:
    helper, _work = run
    rows = [
        {"responses_create_params": {"input": "Slowtown?"}, "expected_city": "Slowtown"},
        {**example_rows("example_single_tool_call")[0]},
    ]
    code, out, err = collect_rollouts(helper, rows, tmp_path, BOUNDED_AGENT, "+num_samples_in_parallel=1")
    assert [r["expected_city"] for r in out] == ["Paris"] and out[0]["reward"] == 1.0, err
    assert out[0]["_ng_environment_server"] == BOUNDED_ENV
    (failure,) = [
        orjson.loads(line) for line in (tmp_path / "output_failures.jsonl").read_bytes().splitlines()
    ]
    # The agent timed out, as the relay in front of it (which answered 504) reports.
    assert (failure["_ng_task_index"], failure["kind"], failure["server"]) == (0, "timeout", BOUNDED_AGENT), (
        failure
    )
    assert failure["via"] == {"server": BOUNDED_ENV, "path": "/run", "status": 504}, failure
    assert "default_episode_timeout_seconds" in failure["error"]


def test_routing_options_are_checked_before_anything_is_sent(
    run: tuple[RunHelper, Path], tmp_path: Path
) -> None:
    helper, _work = run
    rows = example_rows("example_single_tool_call")[:1]
    code, out, err = collect_rollouts(helper, rows, tmp_path / "a", AGENT, "+environment_routing_mode=legacy")
    assert code == 2 and "environment_server_name" in err and not out, err
    code, out, err = collect_rollouts(
        helper,
        rows,
        tmp_path / "b",
        AGENT,
        "+environment_routing_mode=legacy",
        f"+environment_server_name={AGENT}",
    )
    assert code == 2 and f"environment_server_name='{AGENT}'" in err and ENV_SERVER in err, err
    code, out, err = collect_rollouts(
        helper, rows, tmp_path / "c", AGENT, "+environment_routing_mode=taskset"
    )
    assert code == 2 and "not supported yet" in err, err
    # legacy: every row through the named server (here the bounded relay in front of the other agent).
    code, out, err = collect_rollouts(
        helper,
        rows,
        tmp_path / "d",
        AGENT,
        "+environment_routing_mode=legacy",
        f"+environment_server_name={BOUNDED_ENV}",
    )
    assert code == 0 and out[0]["reward"] == 1.0 and out[0]["_ng_environment_server"] == BOUNDED_ENV, err


def _episode(action: str, marker: Path, rollout: str = "r1") -> dict[str, Any]:
    return {
        "episode_id": {"rollout_id": rollout, "attempt": 1},
        "task": {
            "task_id": {"taskset": "count", "task_id": "t1"},
            "task_input": {"action": action, "marker": str(marker)},
        },
    }


def test_a_users_environment_server_answers_each_episode_with_a_result_or_a_failure_and_cleans_up(
    run: tuple[RunHelper, Path], tmp_path: Path
) -> None:
    helper, _work = run
    url = server_url(helper, USER_ENV) + "/run"

    def episode(action: str) -> tuple[httpx.Response, list[str]]:
        marker = tmp_path / f"{action}.txt"
        resp = post_json(url, _episode(action, marker))
        return resp, marker.read_text().split() if marker.exists() else []

    ok, cleaned = episode("answer")
    assert ok.status_code == 200, ok.text
    body = ok.json()
    assert body["result"] == {"reward": 1.0} and body["failure"] is None
    assert body["episode_id"] == {"rollout_id": "r1", "attempt": 1}
    assert body["task_id"] == {"taskset": "count", "task_id": "t1"}
    assert cleaned == ["second", "first"]  # last registered, first run
    handled, cleaned = episode("handled")
    assert handled.json()["failure"] == {"failure_reason": "seed refused", "terminal": True, "stage": "seed"}
    assert handled.json()["result"] is None and cleaned == ["second", "first"]
    crashed, cleaned = episode("crash")
    failure = crashed.json()["failure"]
    assert failure["terminal"] is True and "RuntimeError: boom" in failure["failure_reason"], failure
    assert cleaned == ["second", "first"]
    hung, cleaned = episode("hang")
    failure = hung.json()["failure"]
    assert failure["terminal"] is False and "default_episode_timeout_seconds" in failure["failure_reason"], (
        failure
    )
    assert cleaned == ["second", "first"]
    wrong, _ = episode("wrong_task")
    assert wrong.status_code == 500, wrong.text
    invalid = post_json(url, {"task": _episode("answer", tmp_path / "x")["task"]})
    assert invalid.status_code == 422 and "episode_id" in invalid.text, invalid.text
    suffixed = post_json(url, _episode("answer", tmp_path / "y", rollout="r1-a2"))
    assert suffixed.status_code == 422 and "-a<N>" in suffixed.text, suffixed.text


def test_a_users_environment_server_admits_at_most_max_concurrent_episodes(
    run: tuple[RunHelper, Path], tmp_path: Path
) -> None:
    helper, _work = run
    url = server_url(helper, USER_ENV) + "/run"

    async def both() -> list[httpx.Response]:
        headers = {**auth_headers(client_token_for_url(url)), "content-type": "application/json"}
        async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
            hang = orjson.dumps(_episode("hang", tmp_path / "hang.txt"))
            first = asyncio.ensure_future(client.post(url, content=hang, headers=headers))
            await asyncio.sleep(0.2)
            answer = orjson.dumps(_episode("answer", tmp_path / "answer.txt", rollout="r2"))
            second = await client.post(url, content=answer, headers=headers)
            return [await first, second]

    first, second = asyncio.run(both())
    assert first.json()["failure"]["terminal"] is False
    failure = second.json()["failure"]
    assert failure["stage"] == "admission" and failure["terminal"] is False, failure
    assert "queue_timeout_seconds" in failure["failure_reason"]
    assert not (tmp_path / "answer.txt").exists()  # never admitted: nothing ran, nothing to clean up


def test_the_package_ships_legacy_agent_where_a_0_7_config_looks_for_it() -> None:
    from nemo_gym.config.discovery import find_folder

    folder = find_folder("environment_servers", "legacy_agent", Path("/nonexistent"))
    assert (
        folder is not None
        and (folder / "app.py").is_file()
        and (folder / "configs" / "legacy_agent.yaml").is_file()
    )
    assert "agent_server" in (folder / "README.md").read_text()


def test_routing_reads_a_config_whose_top_level_holds_lists_and_scalars() -> None:
    """A trainer's config carries top-level lists and values beside the server blocks (NeMo RL's did)."""
    from omegaconf import OmegaConf

    from nemo_gym.collection.routing import environment_server_instances
    from nemo_gym.config.instances import environment_servers_by_agent

    cfg = OmegaConf.create(
        {
            "stop_strings": ["</answer>"],
            "seed": 3,
            "front": {"environment_servers": {"legacy_agent": {"agent_server": {"name": "agent_a"}}}},
            "user_sim": {
                "environment_servers": {
                    "sim": {
                        "user": {"type": "responses_api_agents", "name": "agent_b"},
                        "assistant": {"type": "responses_api_agents", "name": "agent_c"},
                        "resources_server": {"type": "resources_servers", "name": "r"},
                    }
                }
            },
        }
    )
    assert environment_servers_by_agent(cfg) == {
        "agent_a": ["front"],
        "agent_b": ["user_sim"],
        "agent_c": ["user_sim"],
    }
    assert environment_server_instances(cfg) == ["front", "user_sim"]


def test_run_examples_sends_each_row_through_the_environment_server_in_front_of_its_agent(
    run: tuple[RunHelper, Path],
) -> None:
    """The trainer's path (``RolloutCollectionHelper.run_examples``) routes as the collector does."""
    from nemo_gym.rollout_collection import RolloutCollectionHelper

    helper, _work = run
    env_url = server_url(helper, ENV_SERVER)
    before = _route_count(env_url, "/run", "200")
    rows = [{**r, "agent_ref": {"name": AGENT}} for r in example_rows("example_single_tool_call")[:2]]
    bounded_row = {**rows[0], "agent_ref": {"name": AGENT}}

    async def go() -> tuple[list[float], BaseException | None]:
        collector = RolloutCollectionHelper(num_samples_in_parallel=2)
        rewards = [
            (await f)[1]["reward"]
            for f in collector.run_examples(rows, head_server_config=helper.head_server_config)
        ]
        # A name that is not an environment server instance: refused before anything is sent.
        try:
            collector.run_examples([bounded_row], helper.head_server_config, environment_server_name=AGENT)
            refused = None
        except ValueError as e:
            refused = e
        await collector.aclose()
        return rewards, refused

    rewards, refused = asyncio.run(go())
    assert rewards == [1.0, 1.0]
    assert _route_count(env_url, "/run", "200") - before == 2
    assert refused is not None and "is not an environment server instance" in str(refused)
