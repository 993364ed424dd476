"""gymnasium_agent against the real gymnasium server: episodes are closed after success, after a
failed model call, and at once when the caller disconnects; a failed model call fails the rollout (502),
never a reward."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from nemo_gym.tools.testing import (
    example_rows,
    get,
    metric_value,
    post_json,
    running_servers,
    scrape,
    server_url,
)

CONFIG = "responses_api_agents/gymnasium_agent/configs/gymnasium_agent.yaml"
ROWS = example_rows("gymnasium")


def _act(name: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "take_action", "arguments": {"action": name}}]}


def test_episodes_close_after_success_and_after_failure() -> None:
    scripts = [
        {"contains": "Play the hand", "turns": [_act("stick")]},  # blackjack: one step ends it
        {
            "contains": "Reach the goal.",
            "turns": [_act("right"), {"http_error": 503}],
        },  # model fails mid-episode
    ]
    extra = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": scripts}}}}
    with running_servers([CONFIG], extra) as helper:
        agent, env = server_url(helper, "gymnasium_agent"), server_url(helper, "gymnasium")
        ok = post_json(agent + "/run", ROWS[4])
        assert (
            ok.status_code == 200
            and ok.json()["terminated"] is True
            and "cleanup_warning" not in ok.json()["info"]
        )
        failed = post_json(agent + "/run", ROWS[0])
        assert failed.status_code == 502, failed.text
        assert "policy_model" in failed.text and "reward" not in failed.json()
        stats = get(env + "/stats").json()
        assert stats["live_episodes"] == 0  # both episodes were closed
        # The agent's metrics: one episode finished (one model turn, one tool call), one failed.
        metrics = scrape(agent)
        assert metric_value(metrics, "nemo_gym_agent_turns_count") == 1
        assert metric_value(metrics, "nemo_gym_agent_turns_sum") == 1
        assert metric_value(metrics, "nemo_gym_agent_tool_calls_sum") == 1
        assert metric_value(metrics, "nemo_gym_rollouts_failed_total") == 1
        assert stats["idle_envs"]["blackjack"] >= 1 and stats["idle_envs"]["frozen_lake"] >= 1


def test_a_dropped_rollout_closes_its_episode_at_once() -> None:
    """The caller gives up while the model thinks (a 60 s turn): the agent cancels the rollout and
    closes the episode with reason client_disconnected, without waiting for the model."""
    scripts = [{"contains": "Reach the goal.", "turns": [{"delay_s": 60.0, **_act("right")}, _act("down")]}]
    extra = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": scripts}}}}
    with running_servers([CONFIG], extra) as helper:
        agent, env = server_url(helper, "gymnasium_agent"), server_url(helper, "gymnasium")
        with pytest.raises(httpx.ReadTimeout):
            post_json(agent + "/run", ROWS[0], timeout=3)
        deadline = time.monotonic() + 10
        while get(env + "/stats").json()["live_episodes"] and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = get(env + "/stats").json()
        assert stats["live_episodes"] == 0 and stats["closed_by_reason"] == {"client_disconnected": 1}, stats
