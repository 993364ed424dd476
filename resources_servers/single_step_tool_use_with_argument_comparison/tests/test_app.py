"""single_step_tool_use_with_argument_comparison against real servers, and the comparator's rules."""

import copy
import json
from pathlib import Path

import pytest

from nemo_gym.openai_utils import NeMoGymResponse
from nemo_gym.tools.testing import collect_rollouts, example_rows, running_servers
from resources_servers.single_step_tool_use_with_argument_comparison.common.response_utils import (
    extract_action,
)
from resources_servers.single_step_tool_use_with_argument_comparison.common.verification_utils import (
    ActionComparator,
    FunctionCallAction,
    FunctionCallBatchAction,
    MessageAction,
    StepRewardCategory,
    ToolCallComparatorConfig,
)

ENV = "single_step_tool_use_with_argument_comparison"
CONFIG = f"resources_servers/{ENV}/configs/{ENV}.yaml"
AGENT = f"{ENV}_simple_agent"
C = StepRewardCategory


def _turn(action: dict) -> dict:
    if action["type"] == "message":
        return {"text": action["content"]}
    calls = action["calls"] if action["type"] == "function_call_batch" else [action]
    return {"tool_calls": [{"name": c["name"], "arguments": c["arguments"]} for c in calls]}


def _first_user(row: dict) -> str:
    return next(m["content"] for m in row["responses_create_params"]["input"] if m.get("role") == "user")


def _marked(row: dict, marker: str) -> dict:
    out = copy.deepcopy(row)
    next(m for m in out["responses_create_params"]["input"] if m.get("role") == "user")["content"] += marker
    return out


def _call(name: str, **args) -> dict:
    return {"type": "function_call", "name": name, "arguments": json.dumps(args)}


# Wrong next steps for the five example rows, and the category each must get.
WRONG = [
    (_call("lookup_order", order_number="A-1093"), C.UNEXPECTED_TOOL),  # skipped verification
    (_call("lookup_order", order_number="A-1039"), C.ARGUMENT_VALUE_DIFFERENT),
    (
        _call("issue_refund", order_number="B-2201", amount=12, reason="screen protector cracked"),
        C.ARGUMENT_VALUE_TYPE_DIFFERENT,
    ),
    (_call("lookup_order", order_number="C-3310"), C.NO_EXPECTED_CHAT_MESSAGE),
    ({"type": "message", "content": "Let me check."}, C.NO_EXPECTED_TOOL_CALL),
]
RIGHT_CATEGORIES = [C.EXPECTED_TOOL_CALL] * 3 + [C.EXPECTED_CHAT_MESSAGE_FOUND, C.EXPECTED_TOOL_CALL_BATCH]


@pytest.mark.slow
def test_scripted_right_and_wrong_next_steps(tmp_path: Path) -> None:
    rows = example_rows(ENV)
    right = [r["expected_action"] for r in rows]
    # The refund reason is worded differently (word overlap passes) and the batch comes in reverse order.
    right[2] = _call(
        "issue_refund", order_number="B-2201", amount=12.5, reason="The screen protector was cracked"
    )
    right[4] = {**right[4], "calls": list(reversed(right[4]["calls"]))}
    wrong_rows = [_marked(r, f" [wrong-{i}]") for i, r in enumerate(rows)]
    rules = []
    # Rows 0 and 1 share their first user message: one script, turn by turn (row 1 already has a call).
    for tag, actions in (("[wrong-0]", [WRONG[0][0], None]), ("[wrong-1]", [right[0], WRONG[1][0]])):
        rules.append({"contains": tag, "turns": [_turn(a) for a in actions if a is not None]})
    rules += [{"contains": f"[wrong-{i}]", "turns": [_turn(WRONG[i][0])]} for i in (2, 3, 4)]
    rules.append({"contains": _first_user(rows[0]), "turns": [_turn(right[0]), _turn(right[1])]})
    rules += [{"contains": _first_user(rows[i]), "turns": [_turn(right[i])]} for i in (2, 3, 4)]
    extra = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": rules}}}}
    with running_servers([CONFIG], extra) as helper:
        code, out, err = collect_rollouts(helper, rows + wrong_rows, tmp_path, AGENT)
        assert code == 0, err[-3000:]
        assert [r["reward"] for r in out] == [1.0] * 5 + [0.0] * 5
        assert [r["category"] for r in out] == RIGHT_CATEGORIES + [c for _, c in WRONG]

        bad = [
            rows[0],
            {k: v for k, v in rows[1].items() if k != "expected_action"},
            {**rows[2], "expected_action": "x"},
        ]
        code, out, err = collect_rollouts(helper, bad, tmp_path / "bad", AGENT)
        assert code == 2 and out == []
        assert "input.jsonl:2: missing field `expected_action`" in err
        assert "input.jsonl:3: field `expected_action` must be object" in err


def _cmp(**cfg) -> ActionComparator:
    return ActionComparator(config=ToolCallComparatorConfig(word_count_similarity_threshold=0.1, **cfg))


def _fc(name: str, **args) -> FunctionCallAction:
    return FunctionCallAction(type="function_call", name=name, arguments=json.dumps(args))


def test_argument_rules() -> None:
    c = _cmp()
    want = _fc("f", a=1.0, s="one", t="two words here", o={"k": [1, 2]})
    ok = c.compare_action(want, _fc("f", a=1.0000001, s="one", t="HERE two", o={"k": [1, 2]}))
    assert (ok.reward, ok.category) == (1.0, C.EXPECTED_TOOL_CALL)
    cases = [
        (_fc("f", a=1, s="one", t="two words here", o={"k": [1, 2]}), C.ARGUMENT_VALUE_TYPE_DIFFERENT),
        (_fc("f", a=1.0, s="One", t="two words here", o={"k": [1, 2]}), C.ARGUMENT_VALUE_DIFFERENT),
        (_fc("f", a=1.0, s="one", t="nothing alike at all", o={"k": [1, 2]}), C.ARGUMENT_VALUE_DIFFERENT),
        (_fc("f", a=1.0, s="one", t="two words here", o={"k": [1]}), C.ARGUMENT_LIST_LENGTH_DIFFERENT),
        (_fc("f", a=1.0, s="one", t="two words here", o={"j": [1, 2]}), C.ARGUMENT_OBJECT_KEYS_DIFFERENT),
        (FunctionCallAction(type="function_call", name="f", arguments="{oops"), C.ARGUMENTS_DECODE_ERROR),
        # A key given twice (two parsers may read two calls) and nesting past the parser's depth.
        (FunctionCallAction(type="function_call", name="f", arguments='{"s": "x", "s": "one"}'),
         C.ARGUMENTS_DECODE_ERROR),
        (FunctionCallAction(type="function_call", name="f", arguments='{"s": ' + "[" * 3000 + "]" * 3000 + "}"),
         C.ARGUMENTS_DECODE_ERROR),
    ]  # fmt: skip
    for actual, category in cases:
        assert (c.compare_action(want, actual).reward, c.compare_action(want, actual).category) == (
            0.0,
            category,
        )


def test_a_boolean_is_no_number_and_a_blank_message_is_no_message() -> None:
    c = _cmp()
    assert c.compare_action(_fc("f", n=1), _fc("f", n=True)).category == C.ARGUMENT_VALUE_TYPE_DIFFERENT
    assert c.compare_action(_fc("f", n=[0]), _fc("f", n=[False])).reward == 0.0
    assert c.compare_action(_fc("f", b=True), _fc("f", b=True)).reward == 1.0
    assert c.compare_action(_fc("f", b=False), _fc("f", b=0)).reward == 0.0

    def said(*texts: str) -> NeMoGymResponse:
        content = [{"type": "output_text", "text": t} for t in texts]
        return NeMoGymResponse.model_validate(
            {"id": "r", "created_at": 0, "model": "m", "object": "response", "parallel_tool_calls": True,
             "tool_choice": "auto", "tools": [], "output": [{"type": "message", "role": "assistant",
             "id": "m", "status": "completed", "content": content}]}
        )  # fmt: skip

    assert extract_action(said("")) is None and extract_action(said(" \n\t ")) is None
    assert extract_action(said(" ", "Please verify first.")) == MessageAction(
        type="message", content="Please verify first."
    )


def test_parallel_modes() -> None:
    want = FunctionCallBatchAction(type="function_call_batch", calls=[_fc("g", x=1), _fc("g", x=2)])
    one = _fc("g", x=2)
    three = FunctionCallBatchAction(
        type="function_call_batch", calls=[_fc("g", x=2), _fc("g", x=1), _fc("g", x=3)]
    )
    # Default: the count must match; a surplus call (a hedge) fails as a missing one does.
    assert _cmp().compare_action(want, three).category == C.FUNCTION_CALL_BATCH_LENGTH_DIFFERENT
    assert _cmp().compare_action(want, three).reward == 0.0
    assert _cmp().compare_action(want, one).category == C.FUNCTION_CALL_BATCH_LENGTH_DIFFERENT
    hedged = FunctionCallBatchAction(type="function_call_batch", calls=[_fc("g", x=1), _fc("g", x=9)])
    assert _cmp().compare_action(_fc("g", x=1), hedged).reward == 0.0  # one call expected, two made
    strict = _cmp(parallel_tool_call_rewarding=True)
    assert strict.compare_action(want, three).reward == 0.0
    assert _cmp(
        parallel_tool_call_rewarding=True, allow_superset=True, parallel_tool_call_reward_mode="f1"
    ).compare_action(want, three).reward == pytest.approx(0.8)
    assert (
        _cmp(
            parallel_tool_call_rewarding=True, allow_subset=True, parallel_tool_call_reward_mode="fractional"
        )
        .compare_action(want, FunctionCallBatchAction(type="function_call_batch", calls=[one]))
        .reward
        == 1.0
    )
    assert (
        _cmp().compare_action(MessageAction(type="message", content="hi"), one).category
        == C.NO_EXPECTED_CHAT_MESSAGE
    )
