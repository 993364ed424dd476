"""reasoning_gym against real servers (scripted right and wrong answers scored by each task's own
scorer in the verify pool), failures as failures, and offline row generation."""

import copy
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_gym.tools.testing import collect_rollouts, example_rows, post_json, running_servers, server_url
from resources_servers.reasoning_gym.app import (
    extract_model_answer,
    score_in_worker,
    several_answers,
    unreadable_markup,
)
from resources_servers.reasoning_gym.scripts.create_dataset import generate_rows

CONFIG = "resources_servers/reasoning_gym/configs/reasoning_gym.yaml"
AGENT = "reasoning_gym_simple_agent"
SCRIPT = "resources_servers/reasoning_gym/scripts/create_dataset.py"


def _marked(row: dict, marker: str) -> dict:
    out = copy.deepcopy(row)
    out["responses_create_params"]["input"][-1]["content"] += f" {marker}"
    return out


@pytest.mark.slow
def test_scripted_right_and_wrong_answers(tmp_path: Path) -> None:
    rows = example_rows("reasoning_gym")
    wrong = [_marked(r, "[wrong]") for r in rows]
    unknown = {
        **_marked(rows[1], "[unknown]"),
        "metadata": {**rows[1]["metadata"], "source_dataset": "no_such_task"},
    }
    rules = [{"contains": "[wrong]", "turns": [{"text": "I am not sure. <answer>zzz</answer>"}]}]
    rules += [{"contains": "[unknown]", "turns": [{"text": f"<answer>{rows[1]['answer']}</answer>"}]}]
    rules += [
        {"contains": r["question"][-80:], "turns": [{"text": f"Thinking... <answer>{r['answer']}</answer>"}]}
        for r in rows
    ]
    extra = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": rules}}}}
    with running_servers([CONFIG], extra) as helper:
        code, out, err = collect_rollouts(
            helper, rows + wrong + [unknown], tmp_path, AGENT, "+max_attempts=1"
        )
        assert [r["reward"] for r in out] == [1.0] * 5 + [0.0] * 5, err[-3000:]
        assert [r["task_name"] for r in out[:5]] == [r["metadata"]["source_dataset"] for r in rows]
        assert out[5]["extracted_answer"] == "zzz" and out[0]["score"] == out[0]["reward"]
        assert (
            out[5]["failure_reason"] == "wrong answer: the task's score is 0"
            and out[0]["failure_reason"] is None
        )
        # A task the package does not know is the row's fault: a 422 naming it, a failure, not a 0.
        failures = (tmp_path / "output_failures.jsonl").read_text()
        assert len(out) == 10 and "no_such_task" in failures and "bad row" in failures and code != 0

        bad = [rows[0], {k: v for k, v in rows[1].items() if k != "metadata"}, {**rows[2], "answer": 3}]
        code, out, err = collect_rollouts(helper, bad, tmp_path / "bad", AGENT)
        assert code == 2 and out == []
        assert "input.jsonl:2: missing field `metadata`" in err
        assert "input.jsonl:3: field `answer` must be" in err


def test_several_different_answers_are_a_hedge() -> None:
    assert several_answers("<answer>7</answer> or <answer> 8 </answer>") == (
        "several different answers in <answer> blocks ('7', '8'): an answer must give one"
    )
    assert several_answers("so \\boxed{7} and \\boxed{8}").startswith("several different answers in boxes")
    assert several_answers("\\boxed{A \\boxed{B}}").startswith("several different answers in boxes")
    # One answer given twice, an empty block, boxes beside an answer block, a box in a box: one answer.
    assert several_answers("<answer>7</answer>, again: <answer> 7 </answer>") is None
    assert several_answers("e.g. <answer></answer> ... <answer>7</answer>") is None
    assert several_answers("\\boxed{6} <answer>7</answer>") is None
    assert several_answers("\\boxed{\\boxed{\\frac{1}{2}}}") is None
    assert several_answers("just 9") is None


def test_markup_left_open_is_no_answer() -> None:
    assert unreadable_markup("<answer>x <answer>55</answer>").startswith("no answer: an <answer> tag")
    assert unreadable_markup("\\boxed{x \\boxed{55}").startswith("no answer: a \\boxed{ is left open")
    assert unreadable_markup("\\boxed{ then <answer>55</answer>") is None  # the block is the answer
    assert unreadable_markup("so <answer>\\boxed{55}</answer>") is None


def test_scores_in_the_worker_are_bounded_and_checked() -> None:
    rows = example_rows("reasoning_gym")
    row = rows[1]
    entry = {"question": row["question"], "answer": row["answer"], "metadata": row["metadata"]}
    assert score_in_worker("basic_arithmetic", "-1043", entry, 5) == ("ok", 1.0, "")
    outcome, _, detail = score_in_worker("no_such_task", "-1043", entry, 5)
    assert outcome == "unknown_task" and "no_such_task" in detail
    factors = generate_rows(["prime_factorization"], size=1, seed=7, instruction="")[0]
    entry = {"question": factors["question"], "answer": factors["answer"], "metadata": factors["metadata"]}
    outcome, score, detail = score_in_worker("prime_factorization", "two times three", entry, 5)
    assert (outcome, score) == ("raised", 0.0) and detail.startswith("ValueError: invalid literal")
    countdown = generate_rows(["countdown"], size=1, seed=7, instruction="")[0]
    entry = {
        "question": countdown["question"],
        "answer": countdown["answer"],
        "metadata": countdown["metadata"],
    }
    # The scorer catches every Exception; the bound's is a BaseException it cannot turn into a score.
    assert score_in_worker("countdown", "83**94**74 - 90 + 40", entry, 1) == (
        "timeout",
        0.0,
        "the task's scorer ran past 1 s on the answer",
    )


def test_answer_extraction() -> None:
    assert extract_model_answer("a <answer>1</answer> b <answer> 2 </answer>") == "2"
    assert extract_model_answer("so \\boxed{7} and \\boxed{8}") == "7"
    assert extract_model_answer("so \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"  # braces balanced
    assert extract_model_answer("\\boxed{} then \\boxed{ \\{1, 2\\} }") == "\\{1, 2\\}"
    assert extract_model_answer("  just 9 ") == "just 9"


def test_generation_is_offline_and_reproducible(tmp_path: Path) -> None:
    rows = generate_rows(["gcd", "basic_arithmetic"], size=3, seed=11, instruction="")
    assert [r["metadata"]["source_dataset"] for r in rows] == ["gcd", "basic_arithmetic"] * 3
    assert rows == generate_rows(["gcd", "basic_arithmetic"], size=3, seed=11, instruction="")
    assert rows != generate_rows(["gcd", "basic_arithmetic"], size=3, seed=12, instruction="")
    assert all(r["responses_create_params"]["input"][0]["content"] == r["question"] for r in rows)

    out = tmp_path / "rows.jsonl"
    done = subprocess.run(
        [sys.executable, SCRIPT, "--tasks", "gcd", "--size", "2", "--seed", "1", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(written) == 2 and "<answer>" in written[0]["responses_create_params"]["input"][0]["content"]
    done = subprocess.run(
        [sys.executable, SCRIPT, "--tasks", "gcd,nope", "--size", "2", "--output", str(tmp_path / "x.jsonl")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "unknown reasoning_gym task(s) ['nope']" in done.stderr


@pytest.mark.slow
def test_a_boxed_fraction_is_read_whole_over_http() -> None:
    # \boxed{\dfrac{242}{311}} is \dfrac{242}{311}, not \dfrac{242 (cut at the first closing brace).
    row = generate_rows(["fraction_simplification"], size=2, seed=3, instruction="")[1]
    assert row["answer"] == "$\\dfrac{242}{311}$"
    text = "Dividing both by 14: \\boxed{\\dfrac{242}{311}}"
    response = {
        "output": [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ]
    }
    with running_servers([CONFIG]) as helper:
        resp = post_json(
            server_url(helper, "reasoning_gym") + "/verify", {**row, "response": response}, timeout=120
        )
    assert resp.status_code == 200, resp.text[:1000]
    body = resp.json()
    assert body["extracted_answer"] == "\\dfrac{242}{311}" and body["reward"] == 1.0, body["extracted_answer"]


def test_each_tasks_scorer_is_made_once_and_scores_as_a_fresh_one() -> None:
    """A pool worker builds a task's scorer (its dataset object) once; the scores equal those of a
    scorer made for the call, right and wrong answers alike, however often it is used."""
    import reasoning_gym

    from resources_servers.reasoning_gym.app import _score_fn, score_answer

    _score_fn.cache_clear()
    rows = example_rows("reasoning_gym")
    for _ in range(2):
        for row in rows:
            task = row["metadata"]["source_dataset"]
            entry = {"question": row["question"], "answer": row["answer"], "metadata": row["metadata"]}
            for answer in (row["answer"], "certainly not " + row["answer"]):
                fresh = reasoning_gym.get_score_answer_fn(task)(answer=answer, entry=entry)
                assert score_answer(task, answer, entry) == float(fresh), (task, answer)
    tasks = {row["metadata"]["source_dataset"] for row in rows}
    assert _score_fn.misses == len(tasks) and len(_score_fn) == len(tasks)
    # Sent to another process (a Ray task pickles score_answer by value), the cache travels empty.
    clone = pickle.loads(pickle.dumps(_score_fn))
    assert len(clone) == 0 and clone.fn is _score_fn.fn
    with pytest.raises(ValueError, match="not registered"):
        score_answer("no_such_task", "x", {})
