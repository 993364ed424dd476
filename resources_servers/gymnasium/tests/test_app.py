"""gymnasium (the text-env wrapper) + gymnasium_agent against real servers with the scripted model.

Expected returns come from stepping a plain ``gymnasium.make`` env with the same actions, so the
adapter is checked against Gymnasium itself, not against numbers we wrote down.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import gymnasium
import pytest

from nemo_gym.cli import RunHelper
from nemo_gym.server.asgi.sessions import cookie_name_for
from nemo_gym.tools.testing import example_rows, post_json, run_rollout, running_servers, server_url
from resources_servers.gymnasium.app import GymEnvConfig, NotATextEnvError, make_env

ENV = "gymnasium"
CONFIG = f"resources_servers/{ENV}/configs/{ENV}.yaml"
AGENT = "gymnasium_agent"
COOKIE = cookie_name_for(ENV)
ROWS = example_rows(ENV)
GYM = {
    "frozen_lake": ("FrozenLake-v1", {"map_name": "4x4", "is_slippery": False}, 20),
    "taxi": ("Taxi-v4", {}, 40),
    "cliff_walking": ("CliffWalking-v1", {}, 30),
    "blackjack": ("Blackjack-v1", {}, None),
}
ACTIONS = {
    "frozen_lake": ["left", "down", "right", "up"],
    "taxi": ["south", "north", "east", "west", "pickup", "dropoff"],
    "cliff_walking": ["up", "right", "down", "left"],
    "blackjack": ["stick", "hit"],
}
# A good episode per example row (in order).
GOOD: list[list[str]] = [
    ["right", "right", "down", "down", "down", "right"],
    ["right", "right", "down", "down", "down", "right"],
    [
        "south",
        "south",
        "west",
        "west",
        "north",
        "north",
        "pickup",
        "south",
        "south",
        "south",
        "south",
        "dropoff",
    ],
    ["up", *["right"] * 11, "down"],
    ["stick"],
]
BAD: list[list[str]] = [
    ["down", "right"],  # into the hole at (1, 1)
    ["right", "down"],  # into the hole at (1, 1) from above
    [
        "pickup",
        "south",
        "south",
        "west",
        "west",
        "north",
        "north",
        "pickup",
        "dropoff",
    ],  # wrong dropoff stays open
    ["right", "up", *["right"] * 11, "down"],  # over the cliff first
    ["hit", "hit"],
]


def gym_return(env_name: str, seed: int | None, actions: list[str]) -> tuple[float, bool, bool, int]:
    """Play ``actions`` on a plain gymnasium env: (return, terminated, truncated, steps taken)."""
    env_id, kwargs, limit = GYM[env_name]
    env = (
        gymnasium.make(env_id, max_episode_steps=limit, **kwargs)
        if limit
        else gymnasium.make(env_id, **kwargs)
    )
    env.reset(seed=seed)
    total, steps = 0.0, 0
    for name in actions:
        _, reward, terminated, truncated, _ = env.step(ACTIONS[env_name].index(name))
        total, steps = total + float(reward), steps + 1
        if terminated or truncated:
            return total, terminated, truncated, steps
    return total, False, False, steps


def act(name: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "take_action", "arguments": {"action": name}}]}


def _tag(variant: str, i: int) -> str:
    return f"[variant={variant} row={i}]"


def _tagged(row: dict[str, Any], variant: str, i: int) -> dict[str, Any]:
    out = copy.deepcopy(row)
    out["responses_create_params"]["input"][-1]["content"] += " " + _tag(variant, i)
    return out


def _scripts() -> list[dict[str, Any]]:
    scripts = []
    for i in range(len(ROWS)):
        scripts.append({"contains": _tag("good", i), "turns": [act(a) for a in GOOD[i]]})
        scripts.append(
            {"contains": _tag("bad", i), "turns": [act(a) for a in BAD[i]] + [{"text": "I give up."}]}
        )
    scripts += [
        # Text actions (<action>..</action>) work like tool calls.
        {"contains": _tag("text", 4), "turns": [{"text": "I will stop here. <action>stick</action>"}]},
        # Never-ending walk into the wall: the env's time limit truncates (FrozenLake: 20 steps).
        {"contains": _tag("wall", 0), "turns": [act("left")] * 40},
        # Invalid actions, then two actions in one turn, the second after the episode ended.
        {
            "contains": _tag("mixed", 4),
            "turns": [
                act("fly"),
                {"tool_calls": [{"name": "look_around", "arguments": {}}]},
                {
                    "tool_calls": [
                        {"name": "take_action", "arguments": {"action": "STICK"}},
                        {"name": "take_action", "arguments": {"action": "1"}},
                    ]
                },
            ],
        },
        # Answers in prose only: the agent's max_steps ends it.
        {"contains": _tag("idle", 1), "turns": [{"text": "Hmm, let me think."}] * 40},
    ]
    return scripts


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    extra = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": _scripts()}}}}
    with running_servers([CONFIG], extra) as h:
        yield h


def _tool_outputs(result: dict[str, Any]) -> list[str]:
    return [o["output"] for o in result["response"]["output"] if o.get("type") == "function_call_output"]


def test_rows_and_config_cover_the_four_envs() -> None:
    assert len(ROWS) == 5
    assert {r["env_name"] for r in ROWS} == set(GYM)
    for row in ROWS:
        assert [t["name"] for t in row["responses_create_params"]["tools"]] == ["take_action"]


def test_good_episodes_score_the_gymnasium_return(helper: RunHelper) -> None:
    for i, row in enumerate(ROWS):
        result = run_rollout(helper, AGENT, _tagged(row, "good", i))
        expected, terminated, truncated, steps = gym_return(row["env_name"], row["seed"], GOOD[i])
        assert result["reward"] == pytest.approx(expected), (i, result["reward"], expected)
        assert (result["terminated"], result["truncated"], result["truncated_by_agent"]) == (
            True,
            False,
            False,
        )
        assert terminated and not truncated and result["episode_steps"] == steps == len(GOOD[i])
        assert len(_tool_outputs(result)) == steps  # every call has its answer, the last one too
        assert result["env_name"] == row["env_name"] and result["seed"] == row["seed"]
    # The returns themselves: goal 1, taxi 20 - 11 moves, cliff -13 moves.
    assert [gym_return(r["env_name"], r["seed"], GOOD[i])[0] for i, r in enumerate(ROWS[:4])] == [
        1,
        1,
        9,
        -13,
    ]


def test_bad_episodes_score_lower(helper: RunHelper) -> None:
    for i, row in enumerate(ROWS):
        result = run_rollout(helper, AGENT, _tagged(row, "bad", i))
        expected, terminated, _, _ = gym_return(row["env_name"], row["seed"], BAD[i])
        assert result["reward"] == pytest.approx(expected)
        assert result["terminated"] == terminated
        if i < 4:
            assert result["reward"] < gym_return(row["env_name"], row["seed"], GOOD[i])[0]
    taxi = run_rollout(helper, AGENT, _tagged(ROWS[2], "bad", 2))
    assert (taxi["terminated"], taxi["truncated"], taxi["truncated_by_agent"]) == (False, True, True)


def test_first_observation_is_the_rendered_board(helper: RunHelper) -> None:
    result = run_rollout(helper, AGENT, _tagged(ROWS[0], "good", 0))
    first = result["responses_create_params"]["input"][-1]["content"]
    assert first.startswith("[S]FFF\nFHFH\nFFFH\nHFFG") and "row 0, column 0" in first
    assert "\x1b" not in first and "Actions: left, down, right, up." in first
    assert "row 3, column 3" in _tool_outputs(result)[-1] and "terminal state" in _tool_outputs(result)[-1]


def test_text_action_and_env_time_limit_and_agent_limit(helper: RunHelper) -> None:
    text = run_rollout(helper, AGENT, _tagged(ROWS[4], "text", 4))
    assert text["reward"] == pytest.approx(gym_return("blackjack", 7, ["stick"])[0]) and text["terminated"]
    wall = run_rollout(helper, AGENT, _tagged(ROWS[0], "wall", 0), timeout=120)
    assert (wall["terminated"], wall["truncated"], wall["truncated_by_agent"]) == (False, True, False)
    assert wall["episode_steps"] == 20 and wall["reward"] == 0.0  # FrozenLake's limit here is 20 steps
    idle = run_rollout(helper, AGENT, _tagged(ROWS[1], "idle", 1), timeout=120)
    assert (idle["terminated"], idle["truncated"], idle["truncated_by_agent"]) == (False, True, True)
    assert idle["episode_steps"] == 30
    assert "No action taken" in idle["response"]["output"][1]["content"]


def test_invalid_actions_are_explained_and_cost_nothing(helper: RunHelper) -> None:
    result = run_rollout(helper, AGENT, _tagged(ROWS[4], "mixed", 4))
    outputs = _tool_outputs(result)
    assert "'fly' is not an action" in outputs[0] and "stick, hit" in outputs[0]
    assert "unknown tool 'look_around'" in outputs[1]
    assert outputs[2].startswith("Action: stick.") and "episode is over" in outputs[3]
    assert (
        result["reward"] == pytest.approx(gym_return("blackjack", 7, ["stick"])[0]) and result["terminated"]
    )


def test_sessions_are_separate_and_closed(helper: RunHelper) -> None:
    base = server_url(helper, ENV)
    row = ROWS[0]
    a = post_json(base + "/reset", row)
    b = post_json(base + "/reset", row)
    ca, cb = {COOKIE: a.cookies[COOKIE]}, {COOKIE: b.cookies[COOKIE]}
    assert ca != cb

    def step(cookies: dict[str, str], action: str) -> dict[str, Any]:
        call = {
            "type": "function_call",
            "name": "take_action",
            "arguments": f'{{"action": "{action}"}}',
            "call_id": "c1",
        }
        resp = post_json(base + "/step", {**row, "response": {"output": [call]}}, cookies=cookies)
        assert resp.status_code == 200, resp.text
        return resp.json()

    assert "row 0, column 1" in step(ca, "right")["info"]["tool_outputs"][0]["output"]
    assert "row 1, column 0" in step(cb, "down")["info"]["tool_outputs"][0]["output"]  # b did not move right
    assert "row 0, column 2" in step(ca, "right")["info"]["tool_outputs"][0]["output"]
    assert post_json(base + "/close", {}, cookies=ca).json() == {"closed": True}
    assert post_json(base + "/step", {**row, "response": {"output": []}}, cookies=ca).status_code == 409
    bad = post_json(base + "/reset", {**row, "env_name": "pong"})
    assert bad.status_code == 422 and "pong" in bad.text and "frozen_lake" in bad.text
    assert post_json(base + "/verify", {**row, "response": {"output": []}}).status_code == 501


def test_non_text_env_is_refused() -> None:
    with pytest.raises(
        NotATextEnvError, match=r"CartPole-v1 cannot be played as text: .*no text observation"
    ):
        make_env(GymEnvConfig(env_id="CartPole-v1"))
    with pytest.raises(NotATextEnvError, match="action space Box"):
        make_env(GymEnvConfig(env_id="MountainCarContinuous-v0"))
    env, ansi = make_env(GymEnvConfig(env_id="Blackjack-v1"))  # no ansi, but a Tuple of Discrete
    assert not ansi and env.action_space.n == 2


def test_server_with_a_non_text_env_does_not_start() -> None:
    instance = {
        ENV: {
            "resources_servers": {ENV: {"entrypoint": "app.py", "envs": {"pole": {"env_id": "CartPole-v1"}}}}
        }
    }
    with pytest.raises(Exception, match="CartPole-v1 cannot be played as text"):
        with running_servers([], instance, with_scripted_model=False):
            pass


def test_text_actions_are_found_in_linear_time_and_several_are_not_one() -> None:
    from resources_servers.gymnasium.app import text_actions

    assert text_actions("I go <ACTION> Down </action>.") == ["Down"]
    assert text_actions("<action>up</action> then <action>up</action>") == ["up"]  # the same one twice
    assert text_actions("<action>up</action><action>left</action><action>down</action>") == ["up", "left"]
    assert text_actions("no tag, or an unclosed <action>" + " " * 200_000) == []
    assert text_actions("<action>" * 100_000) == []
