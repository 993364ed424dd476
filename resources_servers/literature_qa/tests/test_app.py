"""literature_qa against real servers: search, sections, the answer's judgement, abstention metrics, bad input.

One set of servers serves the module. The scripted model picks a trajectory by a tag appended to the
row's user message (``[variant=... row=...]``); the untagged example rows get the right trajectory.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from nemo_gym.cli import RunHelper
from nemo_gym.tools.testing import (
    collect_rollouts,
    example_rows,
    post_json,
    run_rollout,
    running_servers,
    server_url,
    tagged_row,
    variant_rules,
)
from resources_servers.literature_qa.app import (
    CORPUS_FIELDS,
    answer_numbers,
    committed_number,
    load_corpus,
    option_letter,
)
from resources_servers.literature_qa.questions import POOL
from resources_servers.literature_qa.scripts.generate_dataset import CORPUS, EXAMPLE_QUESTIONS, EXAMPLE_SEED
from resources_servers.literature_qa.scripts.generate_dataset import rows as generated_rows

ENV = "literature_qa"
CONFIG = f"resources_servers/{ENV}/configs/{ENV}.yaml"
AGENT = f"{ENV}_simple_agent"
ROWS = example_rows(ENV)
ABSTAIN = "insufficient information"


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"tool_calls": [{"name": name, "arguments": arguments}]}


DONE = {"text": "I have submitted my answer."}


def _right_answer(row: dict[str, Any]) -> str:
    if row["expected_answer"] is None:
        return ABSTAIN
    if row["kind"] == "multiple_choice":
        return row["expected_answer"]
    return f"{row['expected_answer']:g} (as reported)"


def _wrong_answer(row: dict[str, Any]) -> str:
    if row["expected_answer"] is None:
        return "23.71"
    if row["kind"] == "multiple_choice":
        return next(letter for letter in row["options"] if letter != row["expected_answer"])
    return f"{row['expected_answer'] * 1.5:g}"


def _question(row: dict[str, Any]) -> str:
    return row["responses_create_params"]["input"][-1]["content"]


def _variants(row: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    right, cites = _right_answer(row), row["citations"]
    search = _call("search_papers", query=_question(row).split("\n")[0])
    variants = {
        "wrong": [search, _call("submit_answer", answer=_wrong_answer(row), citations=cites), DONE],
        "abstain": [search, _call("submit_answer", answer="Insufficient information.", citations=[]), DONE],
        "no_answer": [search, DONE],
        "unreadable": [_call("submit_answer", answer="about the usual amount", citations=cites), DONE],
        "raw_arguments": [{"tool_calls": [{"name": "submit_answer", "arguments": '{"answer": 4'}]}, DONE],
    }
    if row["expected_answer"] is not None:
        variants |= {
            "no_citation": [_call("submit_answer", answer=right, citations=[]), DONE],
            "wrong_citation": [_call("submit_answer", answer=right, citations=["LQA-001"]), DONE],
            "fixed": [
                _call("submit_answer", answer=right, citations=["LQA-999"]),
                _call("submit_answer", answer=right, citations=list(reversed(cites))),
                DONE,
            ],
        }
        if len(cites) > 1:
            variants["one_of_two"] = [_call("submit_answer", answer=right, citations=cites[:1]), DONE]
    return variants


def _scripts() -> list[dict[str, Any]]:
    rules = variant_rules(ROWS, _variants)
    for row in ROWS:
        reads = [_call("read_section", paper_id=c, section="results") for c in row["citations"]]
        turns = [
            _call("search_papers", query=_question(row).split("\n")[0]),
            *reads,
            _call("submit_answer", answer=_right_answer(row), citations=row["citations"]),
            DONE,
        ]
        rules.append({"contains": _question(row), "turns": turns})
    return rules


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    extra = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": _scripts()}}}}
    with running_servers([CONFIG], extra) as h:
        yield h


def _outputs(result: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """The parsed outputs of the calls of tool ``name`` in a rollout."""
    output = result["response"]["output"]
    ids = {item["call_id"] for item in output if item["type"] == "function_call" and item["name"] == name}
    return [
        orjson.loads(item["output"])
        for item in output
        if item["type"] == "function_call_output" and item["call_id"] in ids
    ]


def _tool(helper: RunHelper, tool: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = post_json(f"{server_url(helper, ENV)}/{tool}", body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_the_corpus_pool_and_example_rows() -> None:
    corpus = load_corpus(CORPUS)
    assert len(corpus) >= 30 and len({p.field for p in corpus.values()}) >= 6
    assert len(POOL) >= 40
    unanswerable = [q for q in POOL if q.answer is None]
    assert len(unanswerable) / len(POOL) >= 0.2
    assert {q.kind for q in POOL} == {"numeric", "multiple_choice"}
    assert len(ROWS) == 5
    assert generated_rows(EXAMPLE_SEED, EXAMPLE_QUESTIONS) == ROWS  # the shipped rows are reproducible
    every = generated_rows(0)  # every question checks against its cited papers' text
    assert len(every) == len(POOL) and generated_rows(0) == every
    assert [r["question_id"] for r in generated_rows(1)] != [r["question_id"] for r in every]
    letters = [
        {
            r["question_id"]: r["expected_answer"]
            for r in generated_rows(seed)
            if r["kind"] == "multiple_choice"
        }
        for seed in (0, 1, 2)
    ]
    assert letters[0] != letters[1] or letters[0] != letters[2]  # a seed moves the right letter
    assert sum(r["expected_answer"] is None for r in ROWS) >= 1 and any(len(r["citations"]) > 1 for r in ROWS)
    for q in POOL:  # a number restated from the question is context, so no answer is one of them
        assert not isinstance(q.answer, (int, float)) or float(q.answer) not in answer_numbers(q.question)


def test_right_trajectories_score_one(helper: RunHelper) -> None:
    for row in ROWS:
        result = run_rollout(helper, AGENT, row)
        assert result["reward"] == 1.0, (row["question_id"], result["failure_reason"])
        assert result["failure_reason"] == "pass"
        assert result["searches"] == 1 and result["sections_read"] == len(row["citations"])
        if row["expected_answer"] is None:
            assert result["abstained"] is True and result["answerable"] is False
        else:
            assert result["answer_correct"] is True and result["citation_correct"] is True
            sections = _outputs(result, "read_section")
            assert [s["paper_id"] for s in sections] == row["citations"]
            found = [hit["paper_id"] for hit in _outputs(result, "search_papers")[0]["results"]]
            assert row["citations"][0] in found  # the question's own words find its paper


def test_wrong_answers_score_zero_and_citations_matter(helper: RunHelper) -> None:
    for i, row in enumerate(ROWS):
        wrong = run_rollout(helper, AGENT, tagged_row(row, "wrong", i))
        assert wrong["reward"] == 0.0
        answerable = row["expected_answer"] is not None
        assert wrong["failure_reason"] == ("wrong_answer" if answerable else "hallucinated")
        abstain = run_rollout(helper, AGENT, tagged_row(row, "abstain", i))
        assert abstain["abstained"] is True
        assert (abstain["reward"], abstain["failure_reason"]) == (
            (0.0, "abstained") if answerable else (1.0, "pass")
        )
        if not answerable:
            continue
        for variant in ("no_citation", "wrong_citation"):
            half = run_rollout(helper, AGENT, tagged_row(row, variant, i))
            assert (half["reward"], half["failure_reason"]) == (0.5, "wrong_citation"), variant
            assert half["answer_correct"] is True and half["citation_correct"] is False
        fixed = run_rollout(helper, AGENT, tagged_row(row, "fixed", i))  # only the last submission counts
        assert fixed["reward"] == 1.0
        assert ["error" in o for o in _outputs(fixed, "submit_answer")] == [True, False]
        assert "LQA-999" in _outputs(fixed, "submit_answer")[0]["error"]
        if len(row["citations"]) > 1:
            one = run_rollout(helper, AGENT, tagged_row(row, "one_of_two", i))
            assert (one["reward"], one["failure_reason"]) == (0.5, "wrong_citation")


def test_malformed_and_missing_answers_score_zero_with_the_reason(helper: RunHelper) -> None:
    i = next(i for i, r in enumerate(ROWS) if r["kind"] == "numeric" and r["expected_answer"] is not None)
    row = ROWS[i]
    for variant, reason in (
        ("no_answer", "no_answer"),
        ("unreadable", "unreadable_answer"),
        ("raw_arguments", "no_answer"),
    ):
        result = run_rollout(helper, AGENT, tagged_row(row, variant, i))
        assert (result["reward"], result["failure_reason"]) == (0.0, reason), variant
    raw = run_rollout(helper, AGENT, tagged_row(row, "raw_arguments", i))
    assert raw["submitted_answer"] is None


BY_ID = {r["question_id"]: r for r in generated_rows(0)}


def _submitted(*answers: str, citations: list[str] | None = None) -> dict[str, Any]:
    """A response whose function calls submit each of ``answers`` in turn (``/verify`` reads only these)."""
    output = [
        {
            "type": "function_call",
            "id": f"fc_{i}",
            "call_id": f"call_{i}",
            "name": "submit_answer",
            "arguments": orjson.dumps({"answer": answer, "citations": citations or []}).decode(),
        }
        for i, answer in enumerate(answers)
    ]
    return {"output": output}


def _verify(helper: RunHelper, qid: str, *answers: str, cite: bool = True) -> dict[str, Any]:
    row = BY_ID[qid]
    body = {**row, "response": _submitted(*answers, citations=row["citations"] if cite else [])}
    resp = post_json(server_url(helper, ENV) + "/verify", body)
    assert resp.status_code == 200, resp.text[:2000]
    return resp.json()


# A numeric answer is the one number it commits to, sign included. Before this rule every one of these
# scored 1.0: the sign was dropped and the first number was read.
_NUMBER_EXPLOITS = {
    ("q02", "-412 mg/L"): ("wrong_answer", "-412 is not 412"),  # the sign was ignored
    ("q02", "\u2212412 mg/L"): ("wrong_answer", "-412 is not 412"),  # a typeset minus
    ("q14", "-9.8 %"): ("wrong_answer", "-9.8 is not 9.8"),  # a magnitude is asked
    ("q02", "412, 500, 38"): ("several_numbers", "412, 500, 38"),  # first right, then the rest
    ("q02", "412 or maybe 400 mg/L"): ("several_numbers", "412, 400"),
    ("q02", "412 or \u0664\u0660\u0660"): ("several_numbers", "412, 400"),  # Arabic-Indic digits
    ("q26", "1,490 m (or 1,400 m)"): ("several_numbers", "1490, 1400"),
    ("q02", "412 " + "mg/L " * 600_000): ("unreadable_answer", "longer than"),  # 3 MB
}

# What a right answer may look like: units (with digits in them), the number repeated, a thousands
# separator, the question's own numbers restated, a paper id, full-width digits.
_RIGHT_PHRASINGS = {
    "q02": [
        "412 mg/L",
        "412",
        "about 412 mg/L (412 mg/L in the paper)",
        "+412 mg/L",
        "\uff14\uff11\uff12 mg/L",
    ],
    "q26": ["1,490 m", "1490 m", "a median of 1,490 m"],
    "q14": ["9.8 %", "a 9.8 % loss with 40 mg over 26 weeks (LQA-014)"],
    "q12": ["3.9 log10 CFU per thigh", "3.9"],
    "q15": ["10.7 hours at 36 weeks"],
    "q24": ["46 W/(m K) for the 115 nm wires at 300 K"],
    "q11": ["26 % at 1,000 micro-atmospheres pCO2", "26%"],
    "q04": ["186 mAh/g at 0.1C"],
    "q16": ["Kessler-88 b orbits in 23.71 days"],
    "q10": ["0.31 C per decade in the 200\u2013500 m layer over 2004-2019"],
    "q33": ["27 percentage points", "27 points more with 40 mg"],
    "q05": ["0.46 mm", ".46 mm"],
    "q21": ["98.6 % ee"],
}


def test_a_numeric_answer_is_the_one_number_it_commits_to_sign_included(helper: RunHelper) -> None:
    got = {}
    for (qid, answer), _ in _NUMBER_EXPLOITS.items():
        result = _verify(helper, qid, answer)
        got[qid, answer[:40]] = (result["reward"], result["failure_reason"], result["reason"])
    assert {k: v[:2] for k, v in got.items()} == {
        (qid, answer[:40]): (0.0, reason) for (qid, answer), (reason, _) in _NUMBER_EXPLOITS.items()
    }
    for (qid, answer), (_, words) in _NUMBER_EXPLOITS.items():
        assert words in got[qid, answer[:40]][2], (qid, answer[:40], got[qid, answer[:40]])
    for qid, answers in _RIGHT_PHRASINGS.items():
        for answer in answers:
            result = _verify(helper, qid, answer)
            assert (result["reward"], result["failure_reason"]) == (1.0, "pass"), (
                qid,
                answer,
                result["reason"],
            )
    # Several submissions: the last counts; a right one earlier does not.
    last = _verify(helper, "q02", "412 mg/L", "38 mg/L")
    assert (last["reward"], last["failure_reason"], last["submitted_answer"]) == (
        0.0,
        "wrong_answer",
        "38 mg/L",
    )
    # The question echoed back as the answer has no number of its own.
    echo = _verify(helper, "q02", _question(BY_ID["q02"]))
    assert (echo["reward"], echo["failure_reason"]) == (0.0, "unreadable_answer")
    # An answer only in a reasoning item, with no submit_answer call, is no answer.
    body = {
        **BY_ID["q02"],
        "response": {
            "output": [
                {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "412 mg/L"}]}
            ]
        },
    }
    result = post_json(server_url(helper, ENV) + "/verify", body).json()
    assert (result["reward"], result["failure_reason"]) == (0.0, "no_answer")


def test_tools_answer_errors_the_model_can_read(helper: RunHelper) -> None:
    hits = _tool(helper, "search_papers", {"query": "August baseflow below beaver dams"})["results"]
    assert hits[0]["paper_id"] == "LQA-003" and "baseflow" in hits[0]["snippet"].lower()
    assert len(hits) <= 5 and all(set(h) == {"paper_id", "title", "year", "snippet", "score"} for h in hits)
    assert "no searchable words" in _tool(helper, "search_papers", {"query": "the of ?!"})["error"]
    section = _tool(helper, "read_section", {"paper_id": "LQA-016", "section": "Results"})
    assert section["section"] == "results" and "23.71 days" in section["text"]
    assert (
        "unknown paper_id 'LQA-999'"
        in _tool(helper, "read_section", {"paper_id": "LQA-999", "section": "results"})["error"]
    )
    huge = _tool(helper, "read_section", {"paper_id": "X" * 100_000, "section": "results"})["error"]
    assert len(huge) < 300 and "(100,000 characters)" in huge  # a 100 KB id is not echoed back in full
    bad = _tool(helper, "read_section", {"paper_id": "LQA-016", "section": "discussion"})["error"]
    assert "unknown section 'discussion'" in bad and "abstract, methods, results" in bad
    assert (
        "citations must be a list"
        in _tool(helper, "submit_answer", {"answer": "4", "citations": "LQA-001"})["error"]
    )
    assert "non-empty string" in _tool(helper, "submit_answer", {"answer": " ", "citations": []})["error"]
    assert _tool(helper, "submit_answer", {"answer": ABSTAIN, "citations": []}) == {"recorded": True}


def test_aggregate_metrics_report_precision_and_coverage(helper: RunHelper, tmp_path: Path) -> None:
    # Per row: the right trajectory and a wrong one; then the metrics of the run's verify responses.
    rows = [r for i, row in enumerate(ROWS) for r in (row, tagged_row(row, "wrong", i))]
    code, out, err = collect_rollouts(helper, rows, tmp_path, AGENT, "+max_attempts=1")
    assert code == 0 and len(out) == 10, err[-2000:]
    resp = post_json(server_url(helper, ENV) + "/aggregate_metrics", {"verify_responses": out})
    assert resp.status_code == 200, resp.text
    metrics = resp.json()["agent_metrics"]
    answerable = sum(r["expected_answer"] is not None for r in ROWS)  # 4 of the 5
    unanswerable = len(ROWS) - answerable
    # Answers given: 2 per answerable row (1 right), 1 per unanswerable row (the wrong one, hallucinated).
    answered = 2 * answerable + unanswerable
    assert metrics["precision"] == pytest.approx(answerable / answered)
    assert metrics["coverage"] == pytest.approx(answered / len(rows))
    assert metrics["mean/is_abstain"] == pytest.approx(unanswerable / len(rows))
    # omniscience_index: right answers (one per answerable row) minus wrong ones (one per row).
    assert metrics["mean/omniscience_index"] == pytest.approx(-unanswerable / len(rows))
    assert metrics["abstention_precision"] == 1.0 and metrics["abstention_recall"] == 0.5
    assert metrics["citation_accuracy"] == 1.0
    assert metrics["mean/reward"] == pytest.approx(0.5)
    key = resp.json()["key_metrics"]
    assert set(key) == {
        "mean/reward",
        "precision",
        "coverage",
        "abstention_precision",
        "abstention_recall",
        "citation_accuracy",
    }


def test_a_broken_row_is_refused_not_scored(helper: RunHelper, tmp_path: Path) -> None:
    broken = copy.deepcopy(ROWS[0])
    broken["citations"] = ["LQA-404"]
    resp = post_json(server_url(helper, ENV) + "/verify", {**broken, "response": {"output": []}})
    assert resp.status_code == 422 and "citations" in resp.text and "LQA-404" in resp.text
    contradictory = {**copy.deepcopy(ROWS[0]), "citations": []}  # an answer with no source
    resp = post_json(server_url(helper, ENV) + "/seed_session", contradictory)
    assert resp.status_code == 422 and "citations" in resp.text
    mc = next(r for r in ROWS if r["kind"] == "multiple_choice")
    resp = post_json(server_url(helper, ENV) + "/seed_session", {**mc, "expected_answer": "Z"})
    assert resp.status_code == 422 and "not one of the options" in resp.text

    # Through ng_collect_rollouts: right, wrong and malformed rows scored; the broken row in the sidecar.
    rows = [ROWS[0], tagged_row(ROWS[0], "wrong", 0), tagged_row(ROWS[0], "raw_arguments", 0), broken]
    code, out, err = collect_rollouts(helper, rows, tmp_path, AGENT, "+max_attempts=1")
    assert [r["reward"] for r in out] == [1.0, 0.0, 0.0], err[-2000:]
    assert code == 1  # a row failed: reported by the exit status, not hidden in a reward
    failures = [orjson.loads(line) for line in (tmp_path / "output_failures.jsonl").read_text().splitlines()]
    assert len(failures) == 1 and failures[0]["_ng_task_index"] == 3
    assert (failures[0]["path"], failures[0]["status"]) == ("/seed_session", 422)
    assert "citations" in failures[0]["error"] and "LQA-404" in failures[0]["error"]


def test_answer_reading_rules() -> None:
    assert answer_numbers("412 mg/L") == [412] and answer_numbers("about 1,490 m (1490 m)") == [1490]
    assert (
        answer_numbers("-9.8 %") == [-9.8]
        and answer_numbers("3.9e-1") == [0.39]
        and answer_numbers("none") == []
    )
    assert answer_numbers("\u22129.8 % (was \u20139.8)") == [-9.8]  # typeset minus signs
    assert answer_numbers("the 200-500 m layer, 2004\u20132019") == [
        200,
        500,
        2004,
        2019,
    ]  # ranges, not signs
    assert answer_numbers("3.9 log10 CFU, pCO2, CA1, LQA-009, Kessler-88 b, m\u00b2") == [3.9]  # not numbers
    assert answer_numbers("\uff14\uff11\uff12 or \u0664\u0660\u0660") == [412, 400]  # other digits
    question = "What thermal conductivity did 115 nm silicon nanowires have at 300 K?"
    assert committed_number("46 W/(m K) for 115 nm at 300 K", question) == (46, [46])
    assert committed_number("115 nm", question) == (115, [115])  # only the question's number: it counts
    assert committed_number("46 or 47", question) == (None, [46, 47])
    for text, letter in (("B", "B"), ("(C)", "C"), ("D) no significant trend", "D"), ("A.", "A")):
        assert option_letter(text) == letter
    for text in ("b", "Both", "the answer is B", ""):
        assert option_letter(text) is None


def test_a_bad_corpus_line_is_named(tmp_path: Path) -> None:
    good = CORPUS.read_text().splitlines()[0]
    path = tmp_path / "corpus.jsonl"
    path.write_text(good + "\n" + good.replace('"results": ', '"resultz": ') + "\n")
    with pytest.raises(ValueError, match=r"corpus.jsonl:2: results: Field required"):
        load_corpus(path)
    path.write_text(good + "\n" + good + "\n")
    with pytest.raises(ValueError, match="appears twice"):
        load_corpus(path)
    assert set(CORPUS_FIELDS) <= set(orjson.loads(good))
