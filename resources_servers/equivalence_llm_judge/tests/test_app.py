"""equivalence_llm_judge against real servers, the judge scripted both ways (and failing)."""

import copy
from pathlib import Path

import orjson
import pytest

from nemo_gym.tools.testing import collect_rollouts, example_rows, running_servers
from resources_servers.equivalence_llm_judge.app import last_match

CONFIG = "resources_servers/equivalence_llm_judge/configs/equivalence_llm_judge.yaml"
AGENT = "equivalence_llm_judge_simple_agent"
SERVER = "equivalence_llm_judge"

# The judge's prompt quotes the policy's answer, so a tag in the answer picks the judge's verdict.
# Judge rules come first: the policy's own prompt (the question) never contains a tag.
JUDGE_RULES = [
    {"contains": "(a-rescue)", "turns": [{"text": "The full text names it. [[A=B]]"}]},
    {"contains": "(a-yes)", "turns": [{"text": "Same thing. [[A=B]]"}]},
    {"contains": "(a-no)", "turns": [{"text": "Different. [[A!=B]]"}]},
    {"contains": "(a-garbage)", "turns": [{"text": "Could be either, really."}]},
    {"contains": "(a-down)", "turns": [{"http_error": 503}]},
]


def _marked(row: dict, marker: str) -> dict:
    out = copy.deepcopy(row)
    out["responses_create_params"]["input"][-1]["content"] += f" {marker}"
    return out


def _policy(marker: str, text: str) -> dict:
    return {"contains": marker, "turns": [{"text": text}]}


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["default", "swap_rescue_metric"])
def test_judge_scripted_both_ways(tmp_path: Path, variant: str) -> None:
    rows = example_rows("equivalence_llm_judge")
    cases = {  # marker -> what the policy answers
        "[right]": f"It is \\boxed{{{rows[0]['expected_answer']} (a-yes)}}",
        "[wrong]": "It is \\boxed{oxygen (a-no)}",
        "[rescue]": "Canberra (a-rescue), though I boxed \\boxed{Sydney (a-no)}",
        "[garbage]": "It is \\boxed{CO2 (a-garbage)}",
        "[down]": "It is \\boxed{CO2 (a-down)}",
    }
    inputs = [_marked(rows[i % 5], m) for i, m in enumerate(cases)]
    rules = JUDGE_RULES + [_policy(m, text) for m, text in cases.items()]
    server: dict = {}
    if variant == "swap_rescue_metric":
        server = {
            "check_twice_swap": True,
            "check_full_generation_on_fail": True,
            "reward_if_full_generation_succeeds": 0.5,
            "unparseable_verdict": "metric",
        }
    extra = {
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": rules}}},
        SERVER: {"resources_servers": {SERVER: server}},
    }
    with running_servers([CONFIG], extra) as helper:
        code, out, err = collect_rollouts(helper, inputs, tmp_path, AGENT, "+max_attempts=1")
        if variant == "default":  # rows without a (string) expected_answer never reach a rollout
            bad = [rows[0], {k: v for k, v in rows[1].items() if k != "expected_answer"}]
            bad.append({**rows[2], "expected_answer": 4})
            code_bad, out_bad, err_bad = collect_rollouts(helper, bad, tmp_path / "bad", AGENT)
            assert code_bad == 2 and out_bad == []
            assert "input.jsonl:2: missing field `expected_answer`" in err_bad
            assert "input.jsonl:3: field `expected_answer` must be string" in err_bad
    markers = list(cases)
    by = {markers[r["_ng_task_index"]]: r for r in out}
    failures_path = tmp_path / "output_failures.jsonl"
    failures = {
        markers[f["_ng_task_index"]]: orjson.dumps(f).decode()
        for f in map(orjson.loads, failures_path.read_bytes().splitlines())
    }
    right, wrong, rescue = by["[right]"], by["[wrong]"], by["[rescue]"]
    assert right["judge_evaluations"][0]["verdict_label"] == "[[A=B]]"
    # The answer judged is the boxed part (the row's output_regex), not the whole text.
    assert (
        "Sydney (a-no)" in rescue["judge_evaluations"][0]["responses_create_params"]["input"][-1]["content"]
    )
    # Not equal: one verdict; with the rescue on, the whole generation is judged again (still different).
    assert wrong["reward"] == 0.0 and len(wrong["judge_evaluations"]) == (1 if variant == "default" else 2)
    # An unreachable judge (503 after retries) is a failed rollout naming the judge, never a reward.
    assert "[down]" not in by and "judge_failed" in failures["[down]"] and "HTTP 503" in failures["[down]"]
    if variant == "default":
        assert right["reward"] == 1.0 and len(right["judge_evaluations"]) == 1
        assert rescue["reward"] == 0.0 and len(rescue["judge_evaluations"]) == 1
        assert "[garbage]" not in by and "no verdict label" in failures["[garbage]"]
    else:
        # Swap check: asked twice, answers swapped the second time.
        assert right["reward"] == 1.0 and len(right["judge_evaluations"]) == 2
        second = right["judge_evaluations"][1]["responses_create_params"]["input"][-1]["content"]
        assert second.index("(a-yes)") < second.index(f"Answer to grade (B):\n{rows[0]['expected_answer']}")
        # Rescue: the whole generation is judged again and earns the partial reward.
        assert rescue["reward"] == 0.5 and len(rescue["judge_evaluations"]) == 2
        garbage = by["[garbage]"]
        assert garbage["reward"] == 0.0 and garbage["judge_verdict_unparseable"] is True


def test_last_match() -> None:
    assert last_match("\\boxed{a} then \\boxed{b}", r"\\boxed\{(.*?)\}") == "b"
    assert last_match("Answer: x\nAnswer: y", r"Answer:\s*(\w+)") == "y"
    assert last_match("no match here", r"\\boxed\{(.*?)\}") == "no match here"
    assert last_match("text", "(unclosed") == "text"
