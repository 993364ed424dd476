"""gymnasium_agent against the real gymnasium server: episodes are closed after success and after a
failed model call; a failed model call fails the rollout (502), never a reward."""

from __future__ import annotations

from typing import Any

from nemo_gym.testing import example_rows, get, post_json, running_servers, server_url

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
        assert stats["idle_envs"]["blackjack"] >= 1 and stats["idle_envs"]["frozen_lake"] >= 1
