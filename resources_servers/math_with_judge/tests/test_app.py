"""math_with_judge against real servers: math-verify in the pool, the judge fallback scripted both ways,
and judge / verifier failures reported as failures, never as reward 0."""

from pathlib import Path

import orjson
import pytest

from nemo_gym.openai_utils import NeMoGymResponse
from nemo_gym.tools.testing import (
    collect_rollouts,
    example_rows,
    post_json,
    running_servers,
    server_url,
    text_response,
)
from resources_servers.math_with_judge.app import (
    ANSWER_TIMEOUT,
    FALSE_EQUATION,
    math_verify_answer,
    math_verify_check,
)

CONFIG = "resources_servers/math_with_judge/configs/math_with_judge.yaml"
AGENT = "math_with_judge_simple_agent"
SERVER = "math_with_judge"


def _rule(contains: str, text: str | None = None, http_error: int | None = None) -> dict:
    turn = {"text": text} if text is not None else {"http_error": http_error}
    return {"contains": contains, "turns": [turn]}


def _models(rules: list[dict], **server: object) -> dict:
    out: dict = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": rules}}}}
    if server:
        out[SERVER] = {"resources_servers": {SERVER: server}}
    return out


def _with_question(row: dict, question: str) -> dict:
    return {
        **row,
        "question": question,
        "responses_create_params": {"input": [{"role": "user", "content": f"Solve: {question}"}]},
    }


def _failures(workdir: Path) -> list[dict]:
    path = workdir / "output_failures.jsonl"
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_scripted_right_and_wrong_answers(tmp_path: Path) -> None:
    rows = example_rows("math_with_judge")
    wrong = [_with_question(r, r["question"] + " (wrong)") for r in rows]
    rules = [_rule(r["question"], "Let me work it out... so it is \\boxed{999}.") for r in wrong]
    rules += [
        _rule(r["question"], f"Working... The answer is \\boxed{{{r['expected_answer']}}}.") for r in rows
    ]
    with running_servers([CONFIG], _models(rules)) as helper:
        code, out, err = collect_rollouts(helper, rows + wrong, tmp_path, AGENT)
        assert code == 0, err[-3000:]
        assert [r["reward"] for r in out] == [1.0] * 5 + [0.0] * 5
        assert [r["library_reward"] for r in out] == [1.0] * 5 + [0.0] * 5
        assert all(r["judge_evaluations"] is None for r in out)
        assert out[5]["extracted_answer"] == "999"
        # An expected_answer math-verify cannot read is the row's fault: a 422 naming it, never a 0 (was a 500).
        body = {**out[0], "expected_answer": "   "}
        resp = post_json(server_url(helper, SERVER) + "/verify", body)
        assert (
            resp.status_code == 422 and "bad row" in resp.text and "cannot parse expected_answer" in resp.text
        )
        # A row without expected_answer never reaches a rollout.
        bad = [rows[0], {k: v for k, v in rows[1].items() if k != "expected_answer"}]
        code, out, err = collect_rollouts(helper, bad, tmp_path / "bad", AGENT)
        assert code == 2 and out == [] and "input.jsonl:2: missing field `expected_answer`" in err


JUDGE_RULES = [
    # The judge's prompt holds the policy's answer; listed first so they win over the question rules.
    _rule("two (a-yes)", "Both are the number two. [[A=B]]"),
    _rule("two (a-no)", "These differ. [[A!=B]]"),
    _rule("two (a-garbage)", "Hard to say, honestly."),
    _rule("two (a-down)", http_error=503),
    _rule("[q-yes]", "It is two (a-yes)"),
    _rule("[q-no]", "It is two (a-no)"),
    _rule("[q-garbage]", "It is two (a-garbage)"),
    _rule("[q-down]", "It is two (a-down)"),
]


@pytest.mark.slow
@pytest.mark.parametrize("unparseable", ["error", "metric"])
def test_judge_fallback_scripted_both_ways(tmp_path: Path, unparseable: str) -> None:
    base = example_rows("math_with_judge")[0]
    rows = [
        _with_question({**base, "expected_answer": "2"}, f"What is 1+1? {m}")
        for m in ("[q-yes]", "[q-no]", "[q-garbage]", "[q-down]")
    ]
    extra = _models(JUDGE_RULES, should_use_judge=True, unparseable_verdict=unparseable)
    with running_servers([CONFIG], extra) as helper:
        code, out, err = collect_rollouts(helper, rows, tmp_path, AGENT, "+max_attempts=1")
    by_q = {r["question"].split()[-1]: r for r in out}
    yes, no = by_q["[q-yes]"], by_q["[q-no]"]
    assert yes["reward"] == 1.0 and yes["library_reward"] == 0.0 and len(yes["judge_evaluations"]) == 2
    assert "[[A=B]]" in yes["judge_evaluations"][1]["response"]["output"][0]["content"][0]["text"]
    assert no["reward"] == 0.0 and len(no["judge_evaluations"]) == 1 and not no["judge_verdict_unparseable"]
    markers = [r["question"].split()[-1] for r in rows]
    failures = {markers[f["_ng_task_index"]]: orjson.dumps(f).decode() for f in _failures(tmp_path)}
    # An unreachable (here: always 503) judge is a failed rollout naming the judge, never a reward.
    assert "[q-down]" not in by_q and "[q-down]" in failures, (out, err[-2000:])
    assert "judge_failed" in failures["[q-down]"] and "HTTP 503" in failures["[q-down]"]
    if unparseable == "error":
        assert "[q-garbage]" not in by_q and "no verdict label" in failures["[q-garbage]"]
    else:
        garbage = by_q["[q-garbage]"]
        assert garbage["reward"] == 0.0 and garbage["judge_verdict_unparseable"] is True


@pytest.mark.parametrize(
    ("expected", "answer", "reward"),
    [
        ("\\frac{7}{12}", "so \\boxed{7/12}", 1.0),
        ("$x^2$", "\\boxed{x \\cdot x}", 1.0),
        ("\\(\\sqrt{2}\\)", "\\boxed{\\sqrt 2}", 1.0),
        ("2, 3", "the roots are \\boxed{3, 2}", 1.0),
        ("13", "\\boxed{12}", 0.0),
        ("13", "I could not solve it", 0.0),
        # Equations: math-verify compares the right side; one between two numbers must also be true.
        ("720", "\\boxed{x = 720}", 1.0),
        ("720", "\\boxed{6 \\times 120 = 720}", 1.0),
        ("13", "\\boxed{\\sqrt{5^2+12^2} = 13}", 1.0),
        ("\\frac{7}{12}", "\\boxed{7/12 = 0.583333333333333333333333333333}", 1.0),
        ("720", "\\boxed{360 = 720}", 0.0),  # upstream: 1.0
        ("720", "\\boxed{x = 360 = 720}", 0.0),  # upstream: 1.0
        ("720", "\\boxed{\\infty = 720}", 0.0),  # upstream: 1.0
        # The same answer boxed twice is one answer; two roots in two boxes are the expected set.
        ("720", "\\boxed{720}, so \\boxed{720}", 1.0),
        ("2, 3", "\\boxed{2} and \\boxed{3}", 1.0),
        ("720", "\\boxed{360} or \\boxed{720}", 0.0),
    ],
)
def test_math_verify_equivalence(expected: str, answer: str, reward: float) -> None:
    assert math_verify_answer(expected, answer)[0] == reward


def test_false_equations_and_answers_past_the_bound_are_noted() -> None:
    assert math_verify_check("720", "\\boxed{360 = 720}")[2] == (
        FALSE_EQUATION,
        "the answer states a false equation: 360 = 720",
    )
    reward, extracted, note = math_verify_check("720", "\\boxed{9^{9^{9}}}", 1)
    assert (reward, extracted, note[0]) == (0.0, "9^{9^{9}}", ANSWER_TIMEOUT)
    assert "ran out of time (1 s) comparing" in note[1]


# (2+sqrt3)^(2n) = (7+4 sqrt3)^n: equal, but far past a 1 s math-verify bound (n = 2500 took 37 s
# unbounded on this 2-core machine; n = 25000 is ten times the work).
HARD_EXPECTED = "(2+\\sqrt{3})^{50000}+(2-\\sqrt{3})^{50000}"
HARD_ANSWER = "(7+4\\sqrt{3})^{25000}+(7-4\\sqrt{3})^{25000}"
TIMEOUT_RULES = [
    _rule("(a-hard)", "Both are the same number. [[A=B]]"),  # the judge's prompt holds the answer
    _rule("[q-hard]", f"It is (a-hard) \\boxed{{{HARD_ANSWER}}}"),
]


@pytest.mark.slow
@pytest.mark.parametrize("use_judge", [False, True])
def test_math_verify_timeout_goes_to_the_judge_or_is_a_zero(tmp_path: Path, use_judge: bool) -> None:
    """An answer math-verify runs out of time on is the model's doing: the judge decides (as upstream),
    or without one it scores 0 with its reason (it was a 503, never scored, before)."""
    base = example_rows("math_with_judge")[0]
    hard = _with_question({**base, "expected_answer": HARD_EXPECTED}, "Simplify the sum. [q-hard]")
    easy_rule = _rule(base["question"], f"So it is \\boxed{{{base['expected_answer']}}}.")
    extra = _models([*TIMEOUT_RULES, easy_rule], should_use_judge=use_judge, math_verify_timeout_seconds=1)
    with running_servers([CONFIG], extra) as helper:
        args = ("+max_attempts=1", "+num_samples_in_parallel=1")
        code, out, err = collect_rollouts(helper, [hard, base], tmp_path, AGENT, *args)
        assert code == 0 and len(out) == 2 and _failures(tmp_path) == [], err[-3000:]
        r, easy = out
        assert easy["question"] == base["question"] and easy["reward"] == 1.0
        assert r["library_reward"] == 0.0 and r["library_verify_timed_out"] is True
        if use_judge:  # as upstream: no verdict from math-verify, so the judge decides
            assert r["reward"] == 1.0 and r["failure_reason"] is None
            assert r["extracted_answer"] is None and len(r["judge_evaluations"]) == 2
            return
        assert r["reward"] == 0.0 and r["judge_evaluations"] is None
        assert "math-verify ran out of time (1 s) comparing" in r["failure_reason"]
        assert "not shown equal" in r["failure_reason"]
        # A box left open before the right one: no answer, nothing run (math-verify read the last box).
        body = {**base, "response": text_response("\\boxed{<think>[{ ... \\boxed{720}")}
        resp = post_json(server_url(helper, SERVER) + "/verify", body)
        assert resp.status_code == 200 and resp.json()["reward"] == 0.0, resp.text[:500]
        assert resp.json()["failure_reason"].startswith("no answer: a \\boxed{ is left open")


def test_upstream_hooks_are_the_verify_so_subclasses_override_them() -> None:
    """physics_judge, math_with_autograder and ugphysics_judge subclass upstream's server and override
    ``_verify_answer`` / ``_generate_judge_evaluation``, calling ``_verify_answer_with_library_async``
    and ``_verify_answer_with_judge``: here verify runs through those same hooks (math-verify for real)."""
    import asyncio

    from nemo_gym.client.server_client import ServerClient
    from resources_servers.math_with_judge.app import (
        JudgeEvaluation,
        LibraryJudgeMathResourcesServer,
        LibraryJudgeMathResourcesServerConfig,
        LibraryJudgeMathVerifyRequest,
    )

    row = example_rows("math_with_judge")[0]
    config = {"host": "127.0.0.1", "port": 1, "entrypoint": "app.py", "name": SERVER}
    judge = {"judge_model_server": {"type": "responses_api_models", "name": "policy_model"}}
    # Upstream's default: a configured judge is used unless should_use_judge says otherwise.
    assert LibraryJudgeMathResourcesServerConfig(**config, **judge).should_use_judge is True
    assert LibraryJudgeMathResourcesServerConfig(**config).should_use_judge is False

    asked: list[tuple[str, str]] = []

    class AlwaysSame(LibraryJudgeMathResourcesServer):
        async def _generate_judge_evaluation(self, question, first_answer, second_answer):
            asked.append((first_answer, second_answer))
            params = self.config.judge_responses_create_params
            return True, JudgeEvaluation(
                responses_create_params=params,
                response=NeMoGymResponse.model_validate(text_response("[[A=B]]")),
            )

    class Shortcut(LibraryJudgeMathResourcesServer):
        async def _verify_answer(self, question, expected_answer, generated_answer):
            library, extracted = await self._verify_answer_with_library_async(
                expected_answer, generated_answer
            )
            return 0.25, f"{extracted}!", library, None

    def verify(server_class, text: str) -> dict:
        client = ServerClient(global_config_dict={})  # never called: the judge hook is overridden
        server = server_class(
            config=LibraryJudgeMathResourcesServerConfig(**config, **judge), server_client=client
        )
        body = LibraryJudgeMathVerifyRequest.model_validate({**row, "response": text_response(text)})
        return asyncio.run(server.verify(body)).model_dump()

    expected = row["expected_answer"]
    out = verify(AlwaysSame, "so it is \\boxed{999}")
    assert out["reward"] == 1.0 and out["library_reward"] == 0.0 and out["extracted_answer"] == "999"
    assert asked == [(expected, "999"), ("999", expected)] and len(out["judge_evaluations"]) == 2
    out = verify(Shortcut, f"\\boxed{{{expected}}}")
    assert (out["reward"], out["library_reward"], out["extracted_answer"]) == (0.25, 1.0, f"{expected}!")
