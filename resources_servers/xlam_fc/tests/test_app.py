"""xlam_fc against real servers: scripted right and wrong calls, and the matching rules."""

import copy
import json
from pathlib import Path

import pytest

from nemo_gym.tools.testing import collect_rollouts, example_rows, post_json, running_servers, server_url
from resources_servers.xlam_fc.app import call_problem, grade_calls, offered_tools, parse_call_arguments

CONFIG = "resources_servers/xlam_fc/configs/xlam_fc.yaml"
AGENT = "xlam_fc_simple_agent"


def _marked(row: dict, marker: str) -> dict:
    out = copy.deepcopy(row)
    out["responses_create_params"]["input"][-1]["content"] += f" {marker}"
    return out


def _calls(expected: list[dict]) -> list[dict]:
    return [{"name": c["name"], "arguments": dict(c["arguments"])} for c in expected]


def _with_optional_note(row: dict) -> dict:
    """``row`` whose first tool also declares an optional ``note`` argument (the expected calls omit it)."""
    out = copy.deepcopy(row)
    params = out["responses_create_params"]["tools"][0]["parameters"]
    params["properties"]["note"] = {"type": "string", "description": "An optional note."}
    return out


@pytest.mark.slow
def test_scripted_right_and_wrong_calls(tmp_path: Path) -> None:
    rows = example_rows("xlam_fc")
    rows[0] = _with_optional_note(rows[0])
    # Right: the expected calls, in reverse order (order does not matter) plus an extra argument the
    # tool declares.
    right = [list(reversed(_calls(r["expected_answers"]))) for r in rows]
    right[0][0]["arguments"] = {**right[0][0]["arguments"], "note": "extra arguments are fine"}
    # Wrong, one way each: a wrong value and an argument the tool does not declare, a missing call, an
    # extra call, a wrong name, a missing argument.
    wrong = [_calls(r["expected_answers"]) for r in rows]
    wrong[0][0]["arguments"]["to_currency"] = "USD"
    wrong[0].append({**right[0][0], "arguments": {**right[0][0]["arguments"], "rate": 160}})
    wrong[1] = wrong[1][:1]
    wrong[2] = wrong[2] + [{"name": "is_prime", "arguments": {"n": 7}}]
    wrong[3][0]["name"] = "is_prime"
    wrong[4][0]["arguments"] = {"ingredient": "lentils"}
    wrong_rows = [_marked(r, f"[wrong-{i}]") for i, r in enumerate(rows)]
    rules = [{"contains": f"[wrong-{i}]", "turns": [{"tool_calls": w}]} for i, w in enumerate(wrong)]
    rules += [
        {"contains": r["responses_create_params"]["input"][-1]["content"], "turns": [{"tool_calls": c}]}
        for r, c in zip(rows, right, strict=True)
    ]
    extra = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": rules}}}}
    with running_servers([CONFIG], extra) as helper:
        code, out, err = collect_rollouts(helper, rows + wrong_rows, tmp_path, AGENT)
        assert code == 0, err[-3000:]
        assert [r["reward"] for r in out] == [1.0] * 5 + [0.0] * 5
        # The rule is stated in each response: the extra argument of row 0 was allowed, and counted.
        assert all(r["extra_arguments_allowed"] is True for r in out)
        assert [r["num_extra_arguments"] for r in out[:5]] == [1, 0, 0, 0, 0]
        assert [r["num_correct"] for r in out[5:]] == [0, 1, 2, 0, 0]
        assert [r["num_predicted"] for r in out[5:]] == [2, 1, 3, 1, 1]
        assert [r["num_invalid_calls"] for r in out] == [0] * 5 + [1, 0, 0, 1, 0]  # is_prime has no weight_kg
        assert out[5]["failure_reason"].startswith("1 call(s) are not valid calls of the offered tools")
        assert "'rate'" in out[5]["failure_reason"] and all(r["failure_reason"] is None for r in out[:5])
        # The tools are not run: each call gets the fixed note, and there is one model turn.
        outputs = [i for i in out[1]["response"]["output"] if i["type"] == "function_call_output"]
        assert len(outputs) == 2 and all("recorded" in o["output"] for o in outputs)
        assert [i["type"] for i in out[1]["response"]["output"]].count("function_call") == 2

        bad = [rows[0], {k: v for k, v in rows[1].items() if k != "expected_answers"}]
        bad.append({**rows[2], "expected_answers": {"name": "is_prime"}})
        code, out, err = collect_rollouts(helper, bad, tmp_path / "bad", AGENT)
        assert code == 2 and out == []
        assert "input.jsonl:2: missing field `expected_answers`" in err
        assert "input.jsonl:3: field `expected_answers` must be array" in err


def test_grading_rules() -> None:
    want = [{"name": "f", "arguments": {"a": 1}}, {"name": "f", "arguments": {"a": 2}}]
    assert grade_calls(
        [{"name": "f", "arguments": {"a": 2}}, {"name": "f", "arguments": {"a": 1}}], want
    ) == (1.0, 2)
    # One predicted call cannot match two expected ones.
    assert grade_calls(
        [{"name": "f", "arguments": {"a": 1}}, {"name": "f", "arguments": {"a": 1}}], want
    ) == (0.0, 1)
    assert grade_calls(
        [{"name": "f", "arguments": '{"a": 1}'}], [{"name": "f", "arguments": '{"a": 1}'}]
    ) == (1.0, 1)
    assert grade_calls([{"name": "f", "arguments": {"a": "1"}}], want[:1]) == (0.0, 0)  # types matter
    assert grade_calls([], []) == (1.0, 0) and grade_calls([{"name": "f", "arguments": {}}], []) == (0.0, 0)
    # Values compare as JSON: one number type (a right answer may write 250.0), but a boolean is no number.
    assert grade_calls([{"name": "f", "arguments": {"a": 1.0}}], want[:1]) == (1.0, 1)
    assert grade_calls([{"name": "f", "arguments": {"a": True}}], want[:1]) == (0.0, 0)
    assert (
        grade_calls([{"name": "f", "arguments": {"a": [1]}}], [{"name": "f", "arguments": {"a": [True]}}])[0]
        == 0
    )
    # A call marked invalid (unreadable arguments, an undeclared argument) never pairs.
    assert grade_calls([{"name": "f", "arguments": {}, "invalid": True}], [{"name": "f"}]) == (0.0, 0)


def test_call_validity() -> None:
    tools = offered_tools(
        [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {}, "b": {}},
          "additionalProperties": False}}, {"type": "function", "name": "g", "parameters": {"properties": {"a": {}}}}]
    )  # fmt: skip
    assert call_problem("f", {"a": 1}, tools) is None and call_problem("f", {"a": 1, "b": 2}, tools) is None
    assert "'c'" in call_problem("f", {"a": 1, "c": 3}, tools)
    assert call_problem("g", {"a": 1, "c": 3}, tools) is None  # the schema allows more
    assert "not a tool the row offers" in call_problem("h", {}, tools)
    assert call_problem("h", {}, {}) is None  # a row without tools: nothing to check against
    assert parse_call_arguments('{"a": 1}') == ({"a": 1}, None)
    assert parse_call_arguments('{"a": 1, "a": 2}')[1] == "argument 'a' is given twice"
    for bad in ('{"a": 1', "[1]", '"x"'):
        assert parse_call_arguments(bad)[0] is None
    assert parse_call_arguments("")[0] == {}  # no arguments at all: an empty object


def _verify_body(row: dict, calls: list[dict]) -> dict:
    output = [
        {
            "type": "function_call",
            "call_id": f"c{i}",
            "name": c["name"],
            "arguments": json.dumps(c["arguments"]),
        }
        for i, c in enumerate(calls)
    ]
    return {**row, "response": {"output": output}}


@pytest.mark.slow
def test_exact_arguments_refuses_extra_arguments() -> None:
    row = _with_optional_note(example_rows("xlam_fc")[0])
    calls = _calls(row["expected_answers"])
    padded = [{**calls[0], "arguments": {**calls[0]["arguments"], "note": "an extra argument"}}, *calls[1:]]
    extra = {"xlam_fc": {"resources_servers": {"xlam_fc": {"exact_arguments": True}}}}
    with running_servers([CONFIG], extra) as helper:
        url = server_url(helper, "xlam_fc") + "/verify"
        exact = post_json(url, _verify_body(row, calls)).json()
        assert exact["reward"] == 1.0 and exact["num_extra_arguments"] == 0
        resp = post_json(url, _verify_body(row, padded))
        assert resp.status_code == 200, resp.text[:1000]
        body = resp.json()
        assert body["reward"] == 0.0 and body["num_correct"] == 0
        assert body["extra_arguments_allowed"] is False and body["num_extra_arguments"] == 1
