"""scientific_code against real servers: the step-by-step agent, the sandboxed tests, bad input.

One set of servers (the resources server, the scicode agent, the scripted model) serves the module.
The agent asks for one step at a time; every step request starts with the row's user message and then
``STEP <step_number> (``. The scripted model answers each step by the rule whose text the request
contains: the reference function for the untagged example rows, a variant's answer for rows tagged with
``[variant=... row=...]`` (those rules come first: a tagged request holds the untagged text too).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi import HTTPException

from nemo_gym.cli import RunHelper
from nemo_gym.sandbox import SandboxExecResult
from nemo_gym.tools.testing import (
    collect_rollouts,
    example_rows,
    numeric_differences,
    post_json,
    run_rollout,
    running_servers,
    server_url,
    tagged_row,
    variant_tag,
)
from resources_servers.scientific_code.app import harness_records
from resources_servers.scientific_code.problems import BY_ID, PROBLEMS
from resources_servers.scientific_code.scripts.generate_dataset import EXAMPLE_PROBLEMS, EXAMPLE_SEED, rows
from responses_api_agents.scicode_agent.app import step_prompt

ENV = "scientific_code"
CONFIG = f"resources_servers/{ENV}/configs/{ENV}.yaml"
AGENT = "scientific_code_agent"
ROWS = example_rows(ENV)
INDEX = {row["problem_id"]: i for i, row in enumerate(ROWS)}
STEP_TIMEOUT_S = 2.0


def _fenced(code: str) -> str:
    return f"Here is the function.\n\n```python\n{code.strip()}\n```\n"


def _reference(problem_id: str, k: int) -> str:
    return BY_ID[problem_id].steps[k].reference


def _header(problem_id: str, k: int) -> str:
    return BY_ID[problem_id].steps[k].header


# variant -> (problem, {step index: answer text}); steps not listed get the reference answer.
VARIANTS: dict[str, tuple[str, dict[int, str]]] = {
    # The last step's y has the wrong sign: steps 1 and 2 pass, step 3 does not.
    "one_step_off": (
        "kepler_newton",
        {
            2: _fenced(
                _reference("kepler_newton", 2).replace("a * np.sqrt(1 - e**2)", "-a * np.sqrt(1 - e**2)")
            )
        },
    ),
    # No code block; then a syntax error; then right code that needs step 1's function, never defined.
    "malformed": (
        "lotka_volterra_rk4",
        {
            0: "The derivative is alpha*x - beta*x*y for the prey and delta*x*y - gamma*y for the predators.",
            1: _fenced(_header("lotka_volterra_rk4", 1) + "\n    k1 = f(t, y\n    return y"),
        },
    ),
    # A function body that never returns: step 2 times out (the model's fault); steps 1 and 3 pass.
    "loop": (
        "monte_carlo_estimates",
        {1: _fenced(_header("monte_carlo_estimates", 1) + "\n    while True:\n        pass")},
    ),
    # Step 1 defines the function under another name: step 2 (independent) passes, step 3 cannot call it.
    "misnamed": (
        "qr_least_squares",
        {0: _fenced(_reference("qr_least_squares", 0).replace("def mgs_qr(", "def gram_schmidt_qr("))},
    ),
}


def _rules() -> list[dict[str, Any]]:
    rules = []
    for variant, (problem_id, answers) in VARIANTS.items():
        tag = variant_tag(variant, INDEX[problem_id])
        for k, step in enumerate(BY_ID[problem_id].steps):
            text = answers.get(k, _fenced(step.reference))
            rules.append({"contains": f"{tag}\n\nSTEP {problem_id}.{k + 1} (", "turns": [{"text": text}]})
    for problem in PROBLEMS:  # the right answers, for every problem (the reference check uses them too)
        for k, step in enumerate(problem.steps):
            rules.append(
                {
                    "contains": f"STEP {problem.problem_id}.{k + 1} (",
                    "turns": [{"text": _fenced(step.reference)}],
                }
            )
    return rules


def _variant_row(variant: str) -> dict[str, Any]:
    problem_id = VARIANTS[variant][0]
    return tagged_row(ROWS[INDEX[problem_id]], variant, INDEX[problem_id])


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    extra = {
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": _rules()}}},
        ENV: {"resources_servers": {ENV: {"step_timeout_s": STEP_TIMEOUT_S}}},
    }
    with running_servers([CONFIG], extra) as h:
        yield h


def _reasons(result: dict[str, Any]) -> list[str]:
    return [s["reason"] for s in result["step_results"]]


# How far a regenerated target may be from the stored one. The references' floating-point results differ
# in their last digits between CPUs (OpenBLAS picks its kernels by CPU: a matrix product sums in another
# order): across OpenBLAS's Haswell (which reproduces the stored data bit for bit), SkylakeX, SandyBridge,
# Cooperlake, SapphireRapids and Nehalem kernels (OPENBLAS_CORETYPE), the 12 problems' targets differ by at
# most 3e-13 relative (the normal equations of polynomial_least_squares; QR least squares 3e-15). The
# verifier's own tolerances are far wider: rtol 1e-9 to 1e-5, atol at least 1e-9 (asserted below).
GENERATOR_REL_TOL = 1e-9
GENERATOR_ABS_TOL = 1e-12


def test_the_generator_reproduces_the_stored_targets() -> None:
    """The shipped targets are the reference's: regenerated on this machine, every value is within
    GENERATOR_REL_TOL (1e-9 relative; 1e-12 absolute near zero) of the stored one, and everything else is
    equal. Not byte-equal: BLAS results differ in their last digits between CPUs (at most 3e-13 relative,
    measured over OpenBLAS's kernels), so CI passes on either vendor's CPU, while any real change of the
    generator (its inputs, a reference, a seed) moves a target by far more. That jitter is also far below
    what the verifier tolerates (every test case's rtol at least 1e-9, atol at least 1e-9, 1000 times the
    1e-12 floor here): no verdict depends on the CPU that generated the targets."""
    regenerated = rows(EXAMPLE_SEED, EXAMPLE_PROBLEMS)
    differences = numeric_differences(regenerated, ROWS, rel_tol=GENERATOR_REL_TOL, abs_tol=GENERATOR_ABS_TOL)
    assert not differences, differences
    every = rows(EXAMPLE_SEED)
    cases = [c for r in every for s in r["sub_steps"] for c in s["test_cases"]]
    assert min(c["rtol"] for c in cases) >= GENERATOR_REL_TOL  # the verifier tolerates more than this test
    assert min(c["atol"] for c in cases) >= 1000 * GENERATOR_ABS_TOL
    assert len(every) == len(PROBLEMS) >= 12
    assert all(2 <= len(r["sub_steps"]) <= 4 for r in every)
    assert rows(7) == rows(7) and rows(7) != rows(8)  # a seed fixes the test inputs and so the targets
    for row in every:  # the model is shown the headers, never a test case or a target
        steps = row["sub_steps"]
        shown = str(row["responses_create_params"]) + "".join(
            step_prompt(steps, k, [None] * k) for k in range(len(steps))
        )
        assert all(c["call"] not in shown for s in steps for c in s["test_cases"])
        assert all(s["function_header"] in shown for s in steps)


def test_right_answers_score_one_step_by_step(helper: RunHelper) -> None:
    for row in ROWS:
        result = run_rollout(helper, AGENT, row)
        n = len(row["sub_steps"])
        assert result["reward"] == 1.0, (row["problem_id"], result["step_results"])
        assert (result["substeps_passed"], result["substeps_total"]) == (n, n)
        assert result["substeps_passed_fraction"] == 1.0 and result["failure_reason"] == "pass"
        assert len(result["step_answers"]) == n
        assert all(s["tests_passed"] == s["tests_total"] > 0 for s in result["step_results"])
        # one model turn per step, each answer an assistant message of the trajectory
        messages = [i for i in result["response"]["output"] if i["type"] == "message"]
        assert len(messages) == n


def test_the_agent_shows_each_step_the_models_earlier_code() -> None:
    steps = ROWS[0]["sub_steps"]
    codes = ["def lotka_volterra_rhs(t, state, alpha, beta, delta, gamma):\n    return 1", None]
    prompt = step_prompt(steps, 2, codes)
    assert prompt.startswith(f"STEP {steps[2]['step_number']} (3 of 3)")
    assert codes[0] in prompt and f"# step {steps[1]['step_number']}: no code was given" in prompt
    assert steps[2]["function_header"] in prompt and steps[2]["return_line"] in prompt
    assert "earlier steps" not in step_prompt(steps, 0, [])


def test_one_wrong_step_scores_zero_and_counts_the_others(helper: RunHelper) -> None:
    result = run_rollout(helper, AGENT, _variant_row("one_step_off"))
    assert result["reward"] == 0.0
    assert (result["substeps_passed"], result["substeps_total"]) == (2, 3)
    assert result["substeps_passed_fraction"] == pytest.approx(2 / 3)
    assert _reasons(result) == ["pass", "pass", "wrong_answer"] and result["failure_reason"] == "wrong_answer"
    assert "value off the target" in result["step_results"][2]["detail"]


def test_malformed_answers_fail_their_step_with_the_reason(helper: RunHelper) -> None:
    malformed = run_rollout(helper, AGENT, _variant_row("malformed"))
    assert malformed["reward"] == 0.0 and malformed["substeps_passed"] == 0
    assert _reasons(malformed) == ["no_code", "syntax_error", "runtime_error"]
    assert "NameError" in malformed["step_results"][2]["detail"]  # steps 1 and 2 are missing
    misnamed = run_rollout(helper, AGENT, _variant_row("misnamed"))
    assert _reasons(misnamed) == ["missing_function", "pass", "runtime_error"]
    assert "mgs_qr" in misnamed["step_results"][0]["detail"] and misnamed["substeps_passed"] == 1


def test_a_function_that_never_returns_is_the_models_timeout(helper: RunHelper) -> None:
    result = run_rollout(helper, AGENT, _variant_row("loop"))
    assert _reasons(result) == ["pass", "timeout", "pass"]
    assert result["reward"] == 0.0 and result["substeps_passed"] == 2
    assert f"{STEP_TIMEOUT_S}" in result["step_results"][1]["detail"]


def _verify(helper: RunHelper, row: dict[str, Any], answers: list[str]) -> dict[str, Any]:
    body = {**row, "response": {"output": []}, "step_answers": answers}
    resp = post_json(server_url(helper, ENV) + "/verify", body, timeout=120)
    assert resp.status_code == 200, resp.text[:2000]
    return resp.json()


def test_every_reference_passes_and_trivial_code_fails(helper: RunHelper) -> None:
    """The targets discriminate: on every problem (all 12, one seed) the reference passes every test,
    and a body that raises or returns 0 fails every step. One sandbox run per verification, in parallel."""
    answer: dict[str, Callable[[Any], str]] = {
        "reference": lambda step: _fenced(step.reference),
        "raises": lambda step: _fenced(step.header + "\n    raise NotImplementedError"),
        "zero": lambda step: _fenced(step.header + "\n    return 0"),
    }
    jobs = [(row, kind) for row in rows(EXAMPLE_SEED) for kind in answer]
    with ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(
                lambda job: _verify(
                    helper, job[0], [answer[job[1]](s) for s in BY_ID[job[0]["problem_id"]].steps]
                ),
                jobs,
            )
        )
    for (row, kind), result in zip(jobs, results, strict=True):
        n = len(row["sub_steps"])
        if kind == "reference":
            assert result["reward"] == 1.0 and result["substeps_passed"] == n, (
                row["problem_id"],
                result["step_results"],
            )
        else:
            assert result["reward"] == 0.0 and result["substeps_passed"] == 0, (
                row["problem_id"],
                kind,
                result["step_results"],
            )
            assert all(s["tests_passed"] == 0 for s in result["step_results"]), (row["problem_id"], kind)


def test_answers_from_the_trajectory_and_missing_answers(helper: RunHelper) -> None:
    row = ROWS[INDEX["kepler_newton"]]
    steps = BY_ID["kepler_newton"].steps
    output = [
        {
            "type": "message",
            "id": f"m{k}",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": _fenced(s.reference), "annotations": []}],
        }
        for k, s in enumerate(steps[:2])
    ]  # without step_answers: one assistant message per step, in order; the third step has none
    resp = post_json(
        server_url(helper, ENV) + "/verify", {**row, "response": {"output": output}}, timeout=120
    )
    assert resp.status_code == 200, resp.text[:2000]
    assert _reasons(resp.json()) == ["pass", "pass", "no_answer"]
    nothing = _verify(helper, row, [])
    assert nothing["reward"] == 0.0 and _reasons(nothing) == ["no_answer"] * 3


def _broken_rows() -> list[tuple[dict[str, Any], str]]:
    no_steps = {**copy.deepcopy(ROWS[0]), "sub_steps": []}
    no_target = copy.deepcopy(ROWS[0])
    del no_target["sub_steps"][0]["test_cases"][0]["target"]
    bad_header = copy.deepcopy(ROWS[0])
    bad_header["sub_steps"][1]["function_header"] = "rk4_step(f, t, y, h)"
    nan_target = copy.deepcopy(ROWS[0])
    nan_target["sub_steps"][0]["test_cases"][0]["target"] = [1.0, "x"]
    return [
        (no_steps, "sub_steps"),
        (no_target, "target"),
        (bad_header, "function_header"),
        (nan_target, "target"),
    ]


def test_a_broken_row_is_refused_not_scored(helper: RunHelper, tmp_path: Path) -> None:
    for broken, field in _broken_rows():
        for path in ("/seed_session", "/verify"):
            body = {**broken, "response": {"output": []}} if path == "/verify" else broken
            resp = post_json(server_url(helper, ENV) + path, body)
            assert resp.status_code == 422 and field in resp.text, (path, field, resp.text[:500])

    # Through ng_collect_rollouts: right, one-step-off and malformed rows scored; the broken row in the
    # sidecar; a row whose dependencies the sandbox cannot import is a 503 there too (never a 0).
    unimportable = copy.deepcopy(ROWS[INDEX["kepler_newton"]])
    unimportable["required_dependencies"] = "import numpy as np\nimport no_such_module_here"
    rows_in = [
        ROWS[INDEX["kepler_newton"]],
        _variant_row("one_step_off"),
        _variant_row("malformed"),
        _broken_rows()[0][0],
        unimportable,
    ]
    code, out, err = collect_rollouts(helper, rows_in, tmp_path, AGENT, "+max_attempts=1")
    assert [(r["reward"], r["substeps_passed"]) for r in out] == [(1.0, 3), (0.0, 2), (0.0, 0)], err[-2000:]
    assert code == 1  # rows failed: reported by the exit status, not hidden in a reward
    failures = [orjson.loads(line) for line in (tmp_path / "output_failures.jsonl").read_text().splitlines()]
    by_index = {f["_ng_task_index"]: f for f in failures}
    assert sorted(by_index) == [3, 4]
    assert (by_index[3]["path"], by_index[3]["status"]) == ("/seed_session", 422)
    assert "sub_steps" in by_index[3]["error"]
    assert (by_index[4]["path"], by_index[4]["status"]) == ("/verify", 503)
    assert "no_such_module_here" in by_index[4]["error"]


def test_how_a_run_ended_decides_between_infrastructure_and_the_model() -> None:
    def run(stdout: str, **kw: Any) -> SandboxExecResult:
        return SandboxExecResult(
            stdout=stdout, stderr=kw.pop("stderr", ""), return_code=kw.pop("rc", 1), **kw
        )

    with pytest.raises(HTTPException) as caught:  # never ready: the sandbox's Python, not the model
        harness_records(run("", timed_out=True), "n0", [1, 1])
    assert caught.value.status_code == 503
    forged = 'n0 {"ready": true}\nfake {"step": 0, "code": "ok"}\n'  # lines without the nonce are ignored
    records = harness_records(run(forged, timed_out=True), "n0", [1, 1])
    assert [r["code"] for r in records] == [None, None] and records[0]["ended"][0] == "timeout"
    assert harness_records(run('n0 {"ready": true}\n', oom_killed=True), "n0", [1])[0]["ended"][0] == "memory"
    assert harness_records(run('n0 {"ready": true}\n', rc=3), "n0", [1])[0]["ended"][0] == "crashed"
    # Killed at its work dir's disk quota (before: "crashed", code 137, the sandbox's kill unnamed).
    quota = run('n0 {"ready": true}\n', rc=137, error_type="disk_quota")
    assert harness_records(quota, "n0", [1])[0]["ended"][0] == "disk_quota"


def test_the_harness_lines_are_read_as_the_exact_sequence_it_writes() -> None:
    def records(*lines: str, end: str = "\n") -> list[dict[str, Any]]:
        text = "\n".join(["n0 " + line for line in ('{"ready": true}', *lines)]) + end
        return harness_records(SandboxExecResult(stdout=text, stderr="", return_code=0), "n0", [2, 1])

    step0 = '{"step": 0, "code": "ok", "detail": ""}'
    tests0 = [
        '{"step": 0, "test": 0, "value": [1.0, NaN]}',
        '{"step": 0, "test": 1, "error": "timeout", "detail": "x"}',
    ]
    step1 = '{"step": 1, "code": "syntax_error", "detail": "bad"}'
    whole = records(step0, *tests0, step1, '{"done": true}')
    assert [r["tampered"] for r in whole] == [None, None] and whole[1]["code"] == "syntax_error"
    assert whole[0]["tests"][0]["value"].shape == (2,) and whole[0]["tests"][1]["error"] == "timeout"
    cut = records(step0, tests0[0], end="")  # the run ended in the middle of a line: not read
    assert cut[0]["tests"] == {} and cut[0]["tampered"] is None
    for bad, at in (
        ((step0, *tests0, step1, '{"done": true}', step1), 1),  # a line after the last one
        ((step0, tests0[1], tests0[0]), 0),  # out of order
        ((step0, '{"step": 0, "test": true, "value": 1}'), 0),  # a bool for an index
        ((step0, '{"step": 0, "test": 0, "value": [true]}'), 0),  # not numbers
        ((step0, '{"step": 0, "test": 0, "value": 1, "extra": 1}'), 0),  # another key
        ((step0, '{"step": 0, "test": 0, "error": "pass", "detail": ""}'), 0),  # not an error of the harness
        (('{"step": 0, "code": "ok"}',), 0),  # a key missing
        ((step0, *tests0, '{"step": 1, "code": "ok", "detail": ""}', '{"done": true}'), 1),  # a test missing
    ):
        got = records(*bad)
        assert [r["tampered"] is not None for r in got] == [at == 0, True], bad
        assert "tampered with" in got[at]["tampered"] and "not judged" in (
            got[1]["tampered"] if at == 0 else "not judged"
        )


def test_the_dry_run_config_answers_every_example_step_with_the_reference() -> None:
    import yaml

    from resources_servers.scientific_code.app import extract_code

    path = (
        Path(__file__).parents[3]
        / "responses_api_models/scripted_model/configs/scripted_model_scientific_code.yaml"
    )
    rules = yaml.safe_load(path.read_text())["policy_model"]["responses_api_models"]["scripted_model"][
        "scripts_by_input"
    ]
    answers = {rule["contains"]: extract_code(rule["turns"][0]["text"]) for rule in rules}
    expected = {
        f"STEP {row['problem_id']}.{k + 1} (": step.reference.strip("\n") + "\n"
        for row in ROWS
        for k, step in enumerate(BY_ID[row["problem_id"]].steps)
    }
    assert answers == expected


# A step's code can read the harness's nonce (``import __main__``) and write to its real stdout: every
# line it forges must be the model's 0 (``tampered_output``), never a 500 and never a pass.
_FORGE = (
    "\nimport __main__\n__main__.OUT.write(__main__.NONCE + ' ' + {line!r} + '\\n')\n__main__.OUT.flush()\n"
)
# name -> (the step whose code forges, the forged line)
FORGED_LINES: dict[str, tuple[int, str]] = {
    "a step that does not exist": (0, '{"step": 99, "test": 0, "value": 1}'),
    "a step that is not a number": (0, '{"step": "x", "test": 0, "value": 1}'),
    "a negative step": (0, '{"step": -1, "code": "ok", "detail": ""}'),
    "not an object": (0, "[1, 2]"),
    "a record without its code": (0, '{"step": 1}'),
    "an unhashable test index": (0, '{"step": 0, "test": [1], "value": 1}'),
    "an integer of 5000 digits": (0, '{"step": 0, "test": 0, "value": ' + "9" * 5000 + "}"),
    "JSON nested 100000 deep": (0, '{"step": 0, "test": 0, "value": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    "the step's own record, twice": (0, '{"step": 0, "code": "ok", "detail": ""}'),
    "a second ready line": (1, '{"ready": true}'),
    # Over an earlier step's real records (a later record would replace the real one).
    "a test without a value": (2, '{"step": 0, "test": 0}'),
    "a value that is text": (2, '{"step": 0, "test": 0, "value": "abc"}'),
    "a ragged value": (2, '{"step": 0, "test": 0, "value": [1, [2, 3]]}'),
    "an error that is not a reason": (2, '{"step": 0, "test": 0, "error": 5}'),
    "a value that is not finite": (2, '{"step": 0, "test": 0, "value": NaN}'),
}


def test_forged_result_lines_are_the_models_zero_never_a_500(helper: RunHelper) -> None:
    """Right code for every step, plus one line forged with the harness's nonce: reward 0 with
    ``tampered_output``, the step where the forgery was seen naming it."""
    row = ROWS[INDEX["kepler_newton"]]
    steps = BY_ID["kepler_newton"].steps

    def verify(case: tuple[int, str]) -> Any:
        forger, line = case
        answers = [
            _fenced(s.reference + (_FORGE.format(line=line) if k == forger else ""))
            for k, s in enumerate(steps)
        ]
        body = {**row, "response": {"output": []}, "step_answers": answers}
        return post_json(server_url(helper, ENV) + "/verify", body, timeout=200)

    with ThreadPoolExecutor(8) as pool:
        answers = dict(zip(FORGED_LINES, pool.map(verify, FORGED_LINES.values()), strict=True))
    for name, resp in answers.items():
        assert resp.status_code == 200, (name, resp.status_code, resp.text[:300])
        result = resp.json()
        assert (result["reward"], result["failure_reason"]) == (0.0, "tampered_output"), (name, result)
        tampered = [s for s in result["step_results"] if s["reason"] == "tampered_output"]
        assert tampered and "tampered" in tampered[0]["detail"], (name, result["step_results"])
