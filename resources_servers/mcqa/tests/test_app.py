"""mcqa against real servers (scripted model) and its answer extraction, mode by mode."""

import copy
from pathlib import Path

import pytest

from nemo_gym.tools.testing import (
    collect_rollouts,
    example_rows,
    post_json,
    running_servers,
    server_url,
    text_response,
)
from resources_servers.mcqa.app import extract_answer

CONFIG = "resources_servers/mcqa/configs/mcqa.yaml"
AGENT = "mcqa_simple_agent"
OPTS = [{"A": "Venus"}, {"B": "Mercury"}, {"C": "Mars"}, {"D": "Earth"}]


def _answer_text(row: dict, letter: str) -> str:
    if row["grading_mode"] == "lenient_answer_colon":
        return f"Let me think it through.\nAnswer: {letter}"
    return f"Reasoning first: option {letter} fits. \\boxed{{{letter}}}"


def _wrong(letter: str) -> str:
    return "A" if letter != "A" else "B"


def _script(rows: list[dict], pick) -> dict:
    rules = [
        {
            "contains": row["responses_create_params"]["input"][0]["content"][-40:],
            "turns": [{"text": pick(row)}],
        }
        for row in rows
    ]
    return {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": rules}}}}


def _marked(row: dict, marker: str) -> dict:
    out = copy.deepcopy(row)
    out["responses_create_params"]["input"][0]["content"] += f" {marker}"
    return out


@pytest.mark.slow
def test_collect_rollouts_scores_scripted_answers(tmp_path: Path) -> None:
    rows = example_rows("mcqa")
    wrong_rows = [_marked(r, "[wrong]") for r in rows]
    rules = [
        {
            "contains": f"{r['responses_create_params']['input'][0]['content'][-40:]}",
            "turns": [{"text": _answer_text(r, _wrong(r["expected_answer"]))}],
        }
        for r in wrong_rows
    ]
    rules += [
        {
            "contains": r["responses_create_params"]["input"][0]["content"][-40:],
            "turns": [{"text": _answer_text(r, r["expected_answer"])}],
        }
        for r in rows
    ]
    extra = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": rules}}}}
    with running_servers([CONFIG], extra) as helper:
        code, out, err = collect_rollouts(helper, rows + wrong_rows, tmp_path, AGENT, "+num_repeats=2")
        assert code == 0, err[-3000:]
        assert len(out) == 20
        for result in out:
            row = (rows + wrong_rows)[result["_ng_task_index"]]
            right = result["_ng_task_index"] < 5
            assert result["reward"] == (1.0 if right else 0.0)
            want = row["expected_answer"] if right else _wrong(row["expected_answer"])
            assert result["extracted_answer"] == want
            assert result["expected_answer"] == row["expected_answer"] and result["options"] == row["options"]
        # Rows the verifier cannot grade are refused, with file, line and field, before any rollout.
        bad = [
            rows[0],
            {k: v for k, v in rows[1].items() if k != "expected_answer"},
            {**rows[2], "grading_mode": "vibes"},
        ]
        code, out, err = collect_rollouts(helper, bad, tmp_path / "bad", AGENT)
        assert code == 2 and out == []
        assert "input.jsonl:2: missing field `expected_answer`" in err
        assert "input.jsonl:3: field `grading_mode`" in err and "vibes" in err
        assert "input.jsonl:1:" not in err


@pytest.mark.parametrize(
    ("text", "mode", "want"),
    [
        ("so \\boxed{B}", "strict_single_letter_boxed", "B"),
        # Boxes naming different options are a hedge, never the last one's letter (upstream: C).
        ("\\boxed{A} first, then \\boxed{\\text{(C)}}", "strict_single_letter_boxed", None),
        ("\\boxed{B} and again \\boxed{\\text{(B)}}", "strict_single_letter_boxed", "B"),
        ("\\boxed{A. B. C. D.}", "strict_single_letter_boxed", None),  # upstream: A
        ("\\boxed{B) or C)}", "strict_single_letter_boxed", None),  # upstream: B
        ("\\boxed{B-D}", "strict_single_letter_boxed", None),  # upstream: B
        ("\\boxed{A \\boxed{B}}", "strict_single_letter_boxed", None),  # upstream: B
        ("\\boxed{\\boxed{B}}", "strict_single_letter_boxed", "B"),
        ("\\boxed{B. A planet}", "strict_single_letter_boxed", "B"),  # "A" is an article here
        ("\\boxed{B: Vitamin C}", "strict_single_letter_boxed", "B"),  # an option's text, not a label
        ("\\boxed{D: Earth}", "strict_single_letter_boxed", "D"),
        ("\\boxed{Mercury}", "strict_single_letter_boxed", None),
        ("\\boxed{Z}", "strict_single_letter_boxed", None),  # not an option letter
        ("the answer is B", "strict_single_letter_boxed", None),  # no box
        ("\\boxed{Mercury}", "lenient_boxed", "B"),
        ("\\boxed{Mars or Earth}", "lenient_boxed", None),  # two options' texts: ambiguous
        ("\\boxed{Venus} \\boxed{Mercury}", "lenient_boxed", None),  # upstream: B
        ("\\boxed{Marshland}", "lenient_boxed", None),  # Mars only inside a longer word (upstream: C)
        ("\\boxed{the planet Mercury}", "lenient_boxed", "B"),
        ("Answer: c", "lenient_answer_colon", "C"),
        ("Answer:  venus ", "lenient_answer_colon", "A"),
        ("Answer: Jupiter", "lenient_answer_colon", None),
        ("Answer: B\nAnswer: A", "lenient_answer_colon", None),  # upstream: B (the first)
        # Every "Answer:" is an answer: one that names nothing beside one that names B is no answer
        # (upstream reads the first, which names nothing, too).
        ("The answer: let me see.\nAnswer: B", "lenient_answer_colon", None),
        ("Answer: <think>\n**Answer:** B", "lenient_answer_colon_md", None),
        ("\\boxed{<action>[{ ... \\boxed{B}", "strict_single_letter_boxed", None),  # a box left open
        ("**Answer:** B because it is closest", "lenient_answer_colon_md", "B"),
        ("Answer: A, C", "lenient_answer_colon_md", None),
        ("Answer: B\n**Answer:** A, C", "lenient_answer_colon_md", None),  # upstream: B
        ("Answer: (A) but it could be (C)", "lenient_answer_colon_md", None),  # upstream: C
        ("Answer: C is right, or maybe A", "lenient_answer_colon_md", None),  # upstream: C
        ("Answer: C (A prime number)", "lenient_answer_colon_md", "C"),
        ("Answer: C. A is wrong.", "lenient_answer_colon_md", "C"),
        ("", "strict_single_letter_boxed", None),
    ],
)
def test_extraction_by_grading_mode(text: str, mode: str, want: str | None) -> None:
    assert extract_answer(text, OPTS, mode) == want


def test_output_regex_is_tried_first() -> None:
    assert extract_answer("Final choice -> [d]", OPTS, "strict_single_letter_boxed", r"\[([A-J])\]") == "D"
    assert extract_answer("\\boxed{B}", OPTS, "strict_single_letter_boxed", [r"\[([A-J])\]"]) == "B"


def _upstream_shaped_params(content: str) -> dict:
    """responses_create_params as upstream's recorded rollouts dump them: every field, unset ones null
    (``parallel_tool_calls`` and ``tool_choice`` included)."""
    nulls = ["background", "include", "instructions", "max_output_tokens", "max_tool_calls", "metadata"]
    nulls += ["model", "parallel_tool_calls", "previous_response_id", "prompt", "reasoning", "service_tier"]
    nulls += ["store", "stream", "temperature", "text", "tool_choice", "top_logprobs", "top_p", "truncation"]
    return {
        **dict.fromkeys(nulls),
        "input": [{"content": content, "role": "user", "type": "message"}],
        "tools": [],
        "user": None,
    }


@pytest.mark.slow
def test_upstream_shaped_rows_are_accepted_and_echoed_as_given(tmp_path: Path) -> None:
    row = example_rows("mcqa")[0]
    content = row["responses_create_params"]["input"][0]["content"] + " [upstream-shaped]"
    shaped = {**row, "responses_create_params": _upstream_shaped_params(content)}
    answer = _answer_text(row, row["expected_answer"])
    extra = _script([shaped], lambda r: answer)
    with running_servers([CONFIG], extra) as helper:
        # Through the collector, the agent and the model: a null parallel_tool_calls is the default.
        code, out, err = collect_rollouts(helper, [shaped], tmp_path, AGENT)
        assert code == 0 and len(out) == 1, err[-3000:]
        assert out[0]["reward"] == 1.0 and out[0]["response"]["parallel_tool_calls"] is True
        # Straight to /verify, with a response the way upstream records one: no `status` key.
        response = text_response(answer)
        resp = post_json(server_url(helper, "mcqa") + "/verify", {**shaped, "response": response})
        assert resp.status_code == 200, resp.text[:1000]
        body = resp.json()
        assert body["reward"] == 1.0 and body["extracted_answer"] == row["expected_answer"]
        assert body["responses_create_params"]["parallel_tool_calls"] is None  # kept as given
        assert body["response"].get("status") is None  # left unset, as upstream's Response leaves it
        assert body["failure_reason"] is None
        # Every 0 says why: several different answers, no answer, a wrong one.
        for text, reason in [
            (
                "\\boxed{A} or rather \\boxed{B}",
                "several different answers (A, B): an answer must pick one option",
            ),
            ("B", "no answer: expected a \\boxed{} holding one option letter"),
            ("\\boxed{C}", "wrong answer: C"),
            (
                "\\boxed{ \\boxed{B}",
                "no answer: a \\boxed{ is left open, so the answer's boxes cannot be told apart",
            ),
        ]:
            resp = post_json(
                server_url(helper, "mcqa") + "/verify", {**shaped, "response": text_response(text)}
            )
            assert resp.status_code == 200, resp.text[:1000]
            assert (resp.json()["reward"], resp.json()["failure_reason"]) == (0.0, reason)
        # A row without its grading fields is refused, naming them (never a 0).
        resp = post_json(
            server_url(helper, "mcqa") + "/verify",
            {"responses_create_params": {"input": "q"}, "response": response},
        )
        assert resp.status_code == 422
        assert {tuple(e["loc"])[-1] for e in resp.json()["detail"]} == {"options", "expected_answer"}


def test_upstream_helper_names_for_environments_built_on_mcqa() -> None:
    """gpqa_diamond and bunsenbench_chemistry_mcq import these names from mcqa and subclass its server
    with a verify that reads the choices elsewhere: both work here unchanged."""
    from nemo_gym.server.resources import task_row_schema
    from resources_servers.mcqa.app import (
        MCQAResourcesServer,
        MCQAVerifyRequest,
        MCQAVerifyResponse,
        _extract_options_and_expected,
        _get_allowed_letters_from_options,
        _parse_answer_with_custom_regex,
        _parse_answer_with_custom_regexes,
    )

    row = MCQAVerifyRequest.model_validate(
        {"responses_create_params": {"input": "q"}, "response": text_response("x"), "uuid": "u1"}
    )
    assert _extract_options_and_expected(row) == (None, None)
    assert _get_allowed_letters_from_options(None) == set()
    assert _get_allowed_letters_from_options([{"a": "x"}, {"B": None}, {"C": "z"}]) == {"A", "C"}
    # Every match counts (matches naming different letters are no answer; upstream takes the last); an
    # option's text maps to its letter; a lone letter is trusted as upstream does.
    assert (
        _parse_answer_with_custom_regex("Answer: [B] ... Answer: [c]", r"\[([A-Z])\]", {"A", "B", "C"}, OPTS)
        is None
    )
    assert _parse_answer_with_custom_regex("[c] ... so: [C]", r"\[([A-Z])\]", {"A", "B", "C"}, OPTS) == "C"
    assert _parse_answer_with_custom_regex("pick: mars", r"pick: (\w+)", {"A", "B", "C", "D"}, OPTS) == "C"
    assert _parse_answer_with_custom_regex("pick: Z", r"pick: (\w)", {"A", "B"}, None) == "Z"
    assert _parse_answer_with_custom_regex("no match", r"pick: (\w)", {"A"}, None) is None
    assert _parse_answer_with_custom_regexes("x [D]", [r"pick: (\w)", r"\[([A-Z])\]"], {"D"}, OPTS) == "D"

    class ChoicesInTheQuestion(MCQAResourcesServer):
        async def verify(self, body: MCQAVerifyRequest) -> MCQAVerifyResponse:  # type: ignore[override]
            raise NotImplementedError

    # mcqa's own rows must carry the grading fields; a subclass's verify decides for its rows.
    assert {"options", "expected_answer"} <= set(task_row_schema(MCQAResourcesServer)["required"])
    assert {"options", "expected_answer"}.isdisjoint(task_row_schema(ChoicesInTheQuestion)["required"])
