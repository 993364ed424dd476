"""simulated_user_agent with the calendar environment: a scripted policy and scripted simulated users
(separate model instances) hold whole conversations; the calendar verifier scores the final calendar."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nemo_gym.cli import RunHelper
from nemo_gym.tools.testing import get, post_json, run_rollout, running_servers, server_url

CONFIGS = [
    "resources_servers/calendar/configs/calendar.yaml",
    "responses_api_agents/simulated_user_agent/configs/simulated_user_agent.yaml",
]
AGENT = "calendar_simulated_user_agent"
DATA = Path(__file__).resolve().parents[1] / "data" / "example.jsonl"
ROW_WITH_OPENING = json.loads(DATA.read_text().splitlines()[0])
ROW = copy.deepcopy(ROW_WITH_OPENING)  # the same task, but the simulator writes the opening
ROW["responses_create_params"]["input"].pop()

OPEN = 'Please add "Budget sync with finance" for 30 minutes. (event id: 0)'
ASK_2 = 'Also add "Interview: backend candidate", 60 minutes. (event id: 1)'
ASK_3 = "The budget sync has to be after 2pm, finance is out until then. (event id: 0)"


def cal(*events: tuple[int, str, int]) -> str:
    return json.dumps(
        [{"event_id": i, "event_name": f"event {i}", "start_time": s, "duration": d} for i, s, d in events]
    )


def _scripted(
    script: list[dict[str, Any]] | None = None, by_input: list[dict[str, Any]] | None = None
) -> dict:
    body: dict[str, Any] = {"entrypoint": "app.py"}
    if script is not None:
        body["script"] = script
    if by_input is not None:
        body["scripts_by_input"] = by_input
    return {"responses_api_models": {"scripted_model": body}}


POLICY_RIGHT = [
    {"text": cal((0, "10:00", 30))},
    {"text": "Done. " + cal((0, "10:00", 30), (1, "10:30", 60))},
    {"text": "Moved it: " + cal((1, "10:30", 60), (0, "14:00", 30))},
]
POLICY_WRONG = [  # never moves the budget sync
    {"text": cal((0, "10:00", 30))},
    {"text": cal((0, "10:00", 30), (1, "10:30", 60))},
    {"text": "Noted. " + cal((0, "10:00", 30), (1, "10:30", 60))},
]


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    agent_block = {
        "responses_api_agents": {
            "simulated_user_agent": {
                "user_model_server": {"type": "responses_api_models", "name": "user_model"}
            }
        }
    }
    extra = {
        # The policy picks its turns by the conversation's first user message (the user's opening).
        "policy_model": _scripted(
            by_input=[
                {"contains": OPEN + " [impatient]", "turns": POLICY_WRONG},
                {"contains": OPEN + " [slow]", "turns": [{"delay_s": 5.0, "text": "Let me think."}]},
                {"contains": OPEN, "turns": POLICY_RIGHT},
            ]
        ),
        # A user who states things one at a time and ends with the marker ...
        "user_model": _scripted(
            script=[{"text": OPEN}, {"text": ASK_2}, {"text": ASK_3}, {"text": "Perfect, thanks! ###DONE###"}]
        ),
        # ... and one who never says done (the agent's max_turns ends it).
        "impatient_user_model": _scripted(
            script=[{"text": OPEN + " [impatient]"}, {"text": ASK_2}, {"text": ASK_3}, {"text": "Hello?"}] * 3
        ),
        # ... and one whose policy takes 5 s to answer (its caller gives up before).
        "slow_user_model": _scripted(script=[{"text": OPEN + " [slow]"}, {"text": ASK_2}] * 3),
        "slow_agent": {
            "responses_api_agents": {
                "simulated_user_agent": {
                    "entrypoint": "app.py",
                    "resources_server": {"type": "resources_servers", "name": "calendar"},
                    "model_server": {"type": "responses_api_models", "name": "policy_model"},
                    "user_model_server": {"type": "responses_api_models", "name": "slow_user_model"},
                }
            }
        },
        AGENT: agent_block,
        "impatient_agent": {
            "responses_api_agents": {
                "simulated_user_agent": {
                    "entrypoint": "app.py",
                    "resources_server": {"type": "resources_servers", "name": "calendar"},
                    "model_server": {"type": "responses_api_models", "name": "policy_model"},
                    "user_model_server": {"type": "responses_api_models", "name": "impatient_user_model"},
                    "max_turns": 3,
                }
            }
        },
    }
    with running_servers(CONFIGS, extra) as h:
        yield h


def _roles(result: dict[str, Any]) -> list[str]:
    return [o.get("role", o.get("type")) for o in result["response"]["output"]]


def test_conversation_until_the_user_is_done_scores_the_final_calendar(helper: RunHelper) -> None:
    result = run_rollout(helper, AGENT, ROW)
    assert result["reward"] == 1.0, result["failure_reason"]
    assert result["ended_by"] == "user_done" and result["num_policy_turns"] == 3
    assert _roles(result) == ["user", "assistant"] * 3 + ["user"]
    users = [o["content"] for o in result["response"]["output"] if o.get("role") == "user"]
    assert users == [OPEN, ASK_2, ASK_3, "Perfect, thanks!"]  # the marker is stripped
    assert result["user_persona"] == ROW["user_persona"] and result["user_usage"]["total_tokens"] > 0


def test_user_that_never_finishes_is_cut_at_max_turns_and_a_wrong_calendar_scores_zero(
    helper: RunHelper,
) -> None:
    result = run_rollout(helper, "impatient_agent", ROW)
    assert result["ended_by"] == "max_turns" and result["num_policy_turns"] == 3
    assert _roles(result) == ["user", "assistant"] * 3  # no user turn after the last allowed answer
    assert (result["reward"], result["failure_reason"]) == (0.0, "constraint_violated")


def test_an_opening_message_in_the_row_is_the_users_first_turn(helper: RunHelper) -> None:
    assert ROW_WITH_OPENING["responses_create_params"]["input"][-1] == {"role": "user", "content": OPEN}
    result = run_rollout(helper, AGENT, ROW_WITH_OPENING)
    # The simulator continues from its second line; the conversation is the same from there on.
    users = [o["content"] for o in result["response"]["output"] if o.get("role") == "user"]
    assert users == [ASK_2, ASK_3, "Perfect, thanks!"] and result["reward"] == 1.0


def test_row_without_a_persona_is_refused(helper: RunHelper) -> None:
    row = {k: v for k, v in ROW.items() if k != "user_persona"}
    resp = post_json(server_url(helper, AGENT) + "/run", row)
    assert resp.status_code == 422 and "user_persona" in resp.text


def test_the_user_sees_only_the_policys_text() -> None:
    from responses_api_agents.simulated_user_agent.app import _visible_text

    turn = [
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "secret plan"}]},
        {"type": "function_call", "name": "lookup", "arguments": "{}", "call_id": "c"},
        {"type": "function_call_output", "call_id": "c", "output": "tool data"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Here it is."}]},
    ]
    assert _visible_text(turn) == "Here it is."


def test_a_dropped_conversation_stops_at_once(helper: RunHelper) -> None:
    """The caller gives up while the policy thinks (5 s): the agent cancels the conversation, so the
    simulated user is never asked for its next message."""
    users = server_url(helper, "slow_user_model")
    with pytest.raises(httpx.ReadTimeout):
        post_json(server_url(helper, "slow_agent") + "/run", ROW, timeout=3)
    assert get(users + "/stats").json()["requests"] == 1  # the opening message
    time.sleep(5)  # past the policy's answer: an agent still running would now ask the user again
    assert get(users + "/stats").json()["requests"] == 1
