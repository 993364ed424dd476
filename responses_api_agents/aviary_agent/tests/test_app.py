"""aviary_agent against real servers (Aviary GSM8K, the scripted model with token ids), and step export.

Checks the agent's per-step records carry the model's token ids; that the step-level export
(``ng_export_transitions``) writes one row per turn whose prompt is exactly what the model was sent
(every text of the rebuilt prompt appears, in order, in the prompt the scripted model rendered into
token ids); rewards-to-go and groups; the CLI's errors; and that ``/v1/responses`` without a task is
refused with a clear message.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from nemo_gym.cli import RunHelper
from nemo_gym.tools.export_transitions import main as export_main
from nemo_gym.tools.export_transitions import transitions
from nemo_gym.tools.testing import metric_value, post_json, run_rollout, running_servers, scrape, server_url

CONFIG = "resources_servers/aviary/configs/gsm8k_aviary.yaml"
AGENT = "gsm8k_aviary_agent"


def _calc(expr: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "calculator", "arguments": {"expr": expr}}]}


SCRIPTS = [
    {
        "contains": "Maya buys",
        "turns": [
            _calc("3*12"),
            _calc("36-7"),
            {"tool_calls": [{"name": "submit_answer", "arguments": {"answer": "29"}}]},
        ],
    },
    {"contains": "bakery", "turns": [_calc("45*2"), _calc("80*1"), _calc("90+80")]},
]


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    extra = {
        "policy_model": {
            "responses_api_models": {
                "scripted_model": {"scripts_by_input": SCRIPTS, "return_token_id_information": True}
            }
        },
        AGENT: {"responses_api_agents": {"aviary_agent": {"max_steps": 2}}},
    }
    with running_servers([CONFIG], extra) as h:
        yield h


def _texts(items: list[dict[str, Any]]) -> list[str]:
    out = []
    for it in items:
        for key in ("content", "output", "arguments"):
            v = it.get(key)
            if isinstance(v, str) and v:
                out.append(v)
        for part in it.get("content") if isinstance(it.get("content"), list) else []:
            if isinstance(part, dict) and part.get("text"):
                out.append(part["text"])
    return out


def _in_order(needles: list[str], haystack: str) -> bool:
    pos = 0
    for n in needles:
        found = haystack.find(n, pos)
        if found < 0:
            return False
        pos = found + len(n)
    return True


def test_max_steps_bounds_the_rollout_and_steps_carry_token_ids(helper: RunHelper) -> None:
    before = scrape(server_url(helper, AGENT))
    result = run_rollout(helper, AGENT, {"task_idx": 1, "responses_create_params": {"input": []}})
    resp = result["response"]
    assert resp["stop_reason"] == "max_steps" and len(resp["steps"]) == 2
    # The agent's metrics saw one episode of two model turns and its tool calls.
    after = scrape(server_url(helper, AGENT))
    calls = sum(1 for it in resp["output"] if it.get("type") == "function_call")
    for name, grew in (("turns_count", 1), ("turns_sum", 2), ("tool_calls_sum", calls)):
        assert (
            metric_value(after, f"nemo_gym_agent_{name}") - metric_value(before, f"nemo_gym_agent_{name}")
            == grew
        )
    assert result["reward"] == 0.0 and result["step_rewards"] == [0.0, 0.0] and not result["env_done"]
    for step in resp["steps"]:
        assert step["prompt_token_ids"] and step["generation_token_ids"]
        assert len(step["generation_token_ids"]) == len(step["generation_log_probs"])
        # The ids are the ones on the model's output item, unchanged.
        item = resp["output"][step["output_start"]]
        assert item["generation_token_ids"] == step["generation_token_ids"]


def test_step_export_rebuilds_each_prompt_the_model_saw(helper: RunHelper, tmp_path: Path) -> None:
    rows = []
    for rollout in range(2):
        result = run_rollout(helper, AGENT, {"task_idx": 0, "responses_create_params": {"input": []}})
        rows.append({**result, "_ng_task_index": 0, "_ng_rollout_index": rollout})
    steps = transitions(rows[0])
    assert [s["step"] for s in steps] == [1, 2] and all(s["group_id"] == "0" for s in steps)
    assert [s["step_reward"] for s in steps] == [0.0, 0.0]
    model_steps = rows[0]["response"]["steps"]
    for exported, record in zip(steps, model_steps, strict=True):
        prompt = bytes(record["prompt_token_ids"]).decode()
        assert _in_order(_texts(exported["responses_create_params"]["input"]), prompt)
        assert exported["response"]["output"][0]["type"] == "function_call"
        assert exported["generation_token_ids"] == record["generation_token_ids"]
    # Step 2's prompt holds step 1's call and its result.
    assert "36" in _texts(steps[1]["responses_create_params"]["input"])

    src, dst = tmp_path / "rollouts.jsonl", tmp_path / "steps.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    export_main([f"+input_jsonl_fpath={src}", f"+output_jsonl_fpath={dst}", "+group_by=task_step"])
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert len(out) == 4
    assert sorted({o["group_id"] for o in out}) == ["0:step1", "0:step2"]
    assert {(o["_ng_rollout_index"], o["step"]) for o in out} == {(0, 1), (0, 2), (1, 1), (1, 2)}


def test_rewards_to_go_and_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    row = {
        "reward": 0.5,
        "task_idx": 3,
        "responses_create_params": {"input": []},
        "response": {
            "group_id": "3",
            "output": [
                {"type": "message", "role": "user", "content": "q"},
                {"type": "function_call", "call_id": "a", "name": "t", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "a", "output": "x"},
                {"type": "function_call", "call_id": "b", "name": "t", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "b", "output": "y"},
            ],
            "steps": [
                {"step": 1, "output_start": 1, "action_end": 2, "output_end": 3, "reward": -1.0},
                {"step": 2, "output_start": 3, "action_end": 4, "output_end": 5, "reward": 1.5, "done": True},
            ],
        },
    }
    assert [s["reward"] for s in transitions(row)] == [0.5, 1.5]
    assert [s["reward"] for s in transitions(row, "step")] == [-1.0, 1.5]
    assert [s["reward"] for s in transitions(row, "trajectory")] == [0.5, 0.5]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(row) + "\n{oops\n")
    with pytest.raises(SystemExit) as e:
        export_main([f"+input_jsonl_fpath={bad}", f"+output_jsonl_fpath={tmp_path / 'o.jsonl'}"])
    assert e.value.code == 2 and f"{bad}:2: not valid JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        export_main([f"+input_jsonl_fpath={bad}", "+output_jsonl_fpath=x", "+reward=median"])
    assert "+reward must be one of" in capsys.readouterr().err


def test_responses_endpoint_without_a_task_is_refused(helper: RunHelper) -> None:
    resp = post_json(server_url(helper, AGENT) + "/v1/responses", {"input": "hi"})
    assert resp.status_code == 400 and "/run" in resp.text
