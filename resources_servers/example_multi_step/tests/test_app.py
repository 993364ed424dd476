"""example_multi_step against real servers: lookups, ordered parallel calls, reward, metrics, task fields.

One set of servers serves the whole module. The scripted model picks a script by a substring of the
first user message: each example row's own text selects the correct trajectory, and a tag appended to
the text (``[variant=... row=...]``) selects a deliberately different one.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from nemo_gym.cli import RunHelper
from nemo_gym.tools.testing import example_rows, post_json, run_rollout, running_servers, server_url

ENV = "example_multi_step"
CONFIG = f"resources_servers/{ENV}/configs/{ENV}.yaml"
AGENT = f"{ENV}_simple_agent"
ROWS = example_rows(ENV)
NOT_A_VALUE = 1000  # synonym values are 0..999, so this is never an expected value


def _user_text(row: dict[str, Any]) -> str:
    return next(m["content"] for m in row["responses_create_params"]["input"] if m["role"] == "user")


def _tag(variant: str, index: int) -> str:
    return f"[variant={variant} row={index}]"


def _tagged(row: dict[str, Any], variant: str, index: int) -> dict[str, Any]:
    """A copy of ``row`` whose user message selects the ``variant`` script."""
    out = copy.deepcopy(row)
    for message in out["responses_create_params"]["input"]:
        if message["role"] == "user":
            message["content"] = f"{message['content']} {_tag(variant, index)}"
    return out


def _lookups(row: dict[str, Any]) -> dict[str, Any]:
    """One model turn calling get_synonym_value for every expected word, in order."""
    return {
        "tool_calls": [
            {"name": "get_synonym_value", "arguments": {"synonym": w}} for w in row["expected_synonyms"]
        ]
    }


def _extract(values: Any) -> dict[str, Any]:
    return {"tool_calls": [{"name": "extract_synonym_values", "arguments": {"synonym_values": values}}]}


DONE = {"text": "I have reported the synonym values."}


def _variants(row: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    expected = row["expected_synonym_values"]
    words = row["expected_synonyms"]
    return {
        "reversed": [_lookups(row), _extract(expected[::-1]), DONE],
        "partial": [_lookups(row), _extract(expected[:2] + [NOT_A_VALUE, NOT_A_VALUE + 1]), DONE],
        "last_good": [_lookups(row), _extract([NOT_A_VALUE]), _extract(expected), DONE],
        "last_bad": [_lookups(row), _extract(expected), _extract(expected[:-1]), DONE],
        "no_extract": [_lookups(row), DONE],
        "string_values": [_lookups(row), _extract([str(v) for v in expected]), DONE],
        "other_case": [
            {
                "tool_calls": [
                    {"name": "get_synonym_value", "arguments": {"synonym": f"  {w.upper()} "}} for w in words
                ]
            },
            _extract(expected),
            DONE,
        ],
        "same_turn": [{"tool_calls": _lookups(row)["tool_calls"] + _extract(expected)["tool_calls"]}, DONE],
        "one_per_turn": [
            *({"tool_calls": [{"name": "get_synonym_value", "arguments": {"synonym": w}}]} for w in words),
            _extract(expected),
            DONE,
        ],
    }


def _scripts() -> list[dict[str, Any]]:
    tagged = [
        {"contains": _tag(variant, i), "turns": turns}
        for i, row in enumerate(ROWS)
        for variant, turns in _variants(row).items()
    ]
    # Tagged rules come first: a tagged message also contains the row's plain text.
    correct = [
        {
            "contains": _user_text(row),
            "turns": [_lookups(row), _extract(row["expected_synonym_values"]), DONE],
        }
        for row in ROWS
    ]
    return tagged + correct


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    extra = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": _scripts()}}}}
    with running_servers([CONFIG], extra) as h:
        yield h


def test_example_rows_are_consistent_with_the_tool(helper: RunHelper) -> None:
    assert len(ROWS) == 5
    url = server_url(helper, ENV) + "/get_synonym_value"
    for row in ROWS:
        assert len(row["expected_synonyms"]) == len(row["expected_synonym_values"]) >= 2
        got = [post_json(url, {"synonym": w}).json()["synonym_value"] for w in row["expected_synonyms"]]
        assert got == row["expected_synonym_values"]
        assert _user_text(row).count("'") >= 2 * len(row["expected_synonyms"])  # the words are in the prompt


def test_tools_are_deterministic_and_strict(helper: RunHelper) -> None:
    base = server_url(helper, ENV)
    first = post_json(base + "/get_synonym_value", {"synonym": "Blazing"}).json()
    assert first == {"synonym": "Blazing", "synonym_value": first["synonym_value"]}
    assert 0 <= first["synonym_value"] < 1000
    assert (
        post_json(base + "/get_synonym_value", {"synonym": "  blazing "}).json()["synonym_value"]
        == first["synonym_value"]
    )
    assert post_json(base + "/extract_synonym_values", {"synonym_values": [1, 2]}).json() == {"success": True}
    for bad in (["1"], [1.5], [True], "1, 2"):
        resp = post_json(base + "/extract_synonym_values", {"synonym_values": bad})
        assert resp.status_code == 422, (bad, resp.text)
        assert "synonym_values" in resp.json()["error"]["message"]


def test_every_row_correct_trajectory_scores_one(helper: RunHelper) -> None:
    for row in ROWS:
        result = run_rollout(helper, AGENT, row)
        assert result["reward"] == 1.0
        assert result["set_overlap"] == result["set_precision"] == result["set_jaccard"] == 1.0
        assert result["num_synonym_lookups"] == len(row["expected_synonyms"])
        assert result["num_extract_calls"] == 1
        # Task fields survive /run.
        assert result["expected_synonyms"] == row["expected_synonyms"]
        assert result["expected_synonym_values"] == row["expected_synonym_values"]
        sent, kept = row["responses_create_params"], result["responses_create_params"]
        assert [(m["role"], m["content"]) for m in kept["input"]] == [
            (m["role"], m["content"]) for m in sent["input"]
        ]
        assert kept["tools"] == sent["tools"]


def test_several_calls_in_one_turn_run_in_order(helper: RunHelper) -> None:
    row = max(ROWS, key=lambda r: len(r["expected_synonyms"]))
    n = len(row["expected_synonyms"])
    output = run_rollout(helper, AGENT, row)["response"]["output"]
    types = [item["type"] for item in output]
    assert types == ["function_call"] * n + ["function_call_output"] * n + [
        "function_call",
        "function_call_output",
        "message",
    ]
    calls, results = output[:n], output[n : 2 * n]
    assert [c["call_id"] for c in calls] == [r["call_id"] for r in results]
    assert [orjson.loads(c["arguments"])["synonym"] for c in calls] == row["expected_synonyms"]
    looked_up = [orjson.loads(r["output"]) for r in results]
    assert [x["synonym"] for x in looked_up] == row["expected_synonyms"]
    assert [x["synonym_value"] for x in looked_up] == row["expected_synonym_values"]
    assert orjson.loads(output[-2]["output"]) == {"success": True}


def test_every_row_wrong_order_scores_zero_with_full_overlap(helper: RunHelper) -> None:
    for i, row in enumerate(ROWS):
        result = run_rollout(helper, AGENT, _tagged(row, "reversed", i))
        assert result["reward"] == 0.0
        # The right values in the wrong order: the set metrics cannot tell, the reward can.
        assert result["set_overlap"] == result["set_precision"] == result["set_jaccard"] == 1.0
        assert result["expected_synonym_values"] == row["expected_synonym_values"]


def test_partial_answer_metrics(helper: RunHelper) -> None:
    i, row = next((i, r) for i, r in enumerate(ROWS) if len(set(r["expected_synonym_values"])) == 3)
    result = run_rollout(helper, AGENT, _tagged(row, "partial", i))
    # expected {a, b, c}; answered {a, b, x, y}: 2 in common, union of 5.
    assert result["reward"] == 0.0
    assert result["set_overlap"] == pytest.approx(2 / 3)
    assert result["set_precision"] == pytest.approx(2 / 4)
    assert result["set_jaccard"] == pytest.approx(2 / 5)


def test_only_the_last_extract_call_counts(helper: RunHelper) -> None:
    row = ROWS[0]
    good = run_rollout(helper, AGENT, _tagged(row, "last_good", 0))
    assert good["reward"] == 1.0 and good["num_extract_calls"] == 2 and good["set_jaccard"] == 1.0
    bad = run_rollout(helper, AGENT, _tagged(row, "last_bad", 0))
    assert bad["reward"] == 0.0 and bad["num_extract_calls"] == 2
    assert bad["set_overlap"] == pytest.approx(1 / 2) and bad["set_precision"] == 1.0


def test_no_extract_call_scores_zero_with_zero_metrics(helper: RunHelper) -> None:
    result = run_rollout(helper, AGENT, _tagged(ROWS[1], "no_extract", 1))
    assert result["reward"] == 0.0 and result["num_extract_calls"] == 0
    assert result["set_overlap"] == result["set_precision"] == result["set_jaccard"] == 0.0
    assert result["num_synonym_lookups"] == len(ROWS[1]["expected_synonyms"])


def test_invalid_extract_arguments_are_shown_to_the_model_and_score_zero(helper: RunHelper) -> None:
    result = run_rollout(helper, AGENT, _tagged(ROWS[2], "string_values", 2))
    assert result["reward"] == 0.0
    assert result["set_overlap"] == 0.0 and result["num_extract_calls"] == 1
    extract_output = [o for o in result["response"]["output"] if o["type"] == "function_call_output"][-1][
        "output"
    ]
    assert extract_output.startswith("Error: invalid arguments for tool 'extract_synonym_values'")


def test_lookups_over_several_turns(helper: RunHelper) -> None:
    i, row = 3, ROWS[3]
    result = run_rollout(helper, AGENT, _tagged(row, "one_per_turn", i))
    assert result["reward"] == 1.0
    types = [item["type"] for item in result["response"]["output"]]
    assert types == ["function_call", "function_call_output"] * (len(row["expected_synonyms"]) + 1) + [
        "message"
    ]


def test_the_values_must_come_from_lookups_read_before_the_report(helper: RunHelper) -> None:
    # A lookup of the word in another case or with spaces is the same lookup (the tool reads it so).
    other_case = run_rollout(helper, AGENT, _tagged(ROWS[1], "other_case", 1))
    assert other_case["reward"] == 1.0 and other_case["failure_reason"] is None
    # The report written in the lookups' own turn, before any of them answered: not read, so memorised.
    same_turn = run_rollout(helper, AGENT, _tagged(ROWS[1], "same_turn", 1))
    assert same_turn["reward"] == 0.0 and same_turn["set_jaccard"] == 1.0
    assert same_turn["failure_reason"].startswith("values reported without having read their lookup first")
    assert all(w in same_turn["failure_reason"] for w in ROWS[1]["expected_synonyms"])
