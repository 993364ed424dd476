"""math_with_code against real servers: rollouts with a scripted model, notebook state, verify errors.

The escape tests (model-written code trying to get out of the sandbox) are in test_escape.py.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from typing import Any

import pytest

from nemo_gym.cli import RunHelper
from nemo_gym.server.asgi.sessions import cookie_name_for
from nemo_gym.tools.testing import example_rows, post_json, run_rollout, running_servers, server_url

ENV = "math_with_code"
CONFIG = f"resources_servers/{ENV}/configs/{ENV}.yaml"
AGENT = f"{ENV}_simple_agent"
ROWS = example_rows(ENV)

# Programs that compute each example row's answer (same order as data/example.jsonl).
PROGRAMS = [
    "print(sum(i for i in range(1, 251) if i % 7 == 0))",
    "import sympy\nprint(len(list(sympy.primerange(1, 200))))",
    "x = sympy.symbols('x')\nroots = sympy.solve(x**2 - 13*x + 40, x)\nprint(max(roots))",
    "from math import comb\nprint(comb(15, 4))",
    "print(pow(3, 100, 17))",
]


def _user_text(row: dict[str, Any]) -> str:
    return next(m["content"] for m in row["responses_create_params"]["input"] if m["role"] == "user")


def _tagged(row: dict[str, Any], tag: str) -> dict[str, Any]:
    out = copy.deepcopy(row)
    for m in out["responses_create_params"]["input"]:
        if m["role"] == "user":
            m["content"] += f" [{tag}]"
    return out


def _scripts() -> list[dict[str, Any]]:
    def call(code: str) -> dict[str, Any]:
        return {"tool_calls": [{"name": "execute_python", "arguments": {"code": code}}]}

    rules = [
        # Notebook state: the second call uses a variable the first defined.
        {
            "contains": "[two-cells]",
            "turns": [
                call("n = 6\nvalues = [k * k for k in range(n)]"),
                call("sum(values)"),
                {"text": "\\boxed{55}"},
            ],
        },
        # The program raises; the model then answers wrongly.
        {"contains": "[crash]", "turns": [call("1 / 0"), {"text": "I could not compute it: \\boxed{0}"}]},
        # Right number but no box: nothing to grade.
        {"contains": "[no-box]", "turns": [{"text": "The answer is 46."}]},
    ]
    for i, (row, program) in enumerate(zip(ROWS, PROGRAMS, strict=True)):
        expected = row["expected_result"]
        rules.append(
            {
                "contains": f"[wrong-{i}]",
                "turns": [call(program), {"text": f"\\boxed{{{int(expected) + 1}}}"}],
            }
        )
        rules.append(
            {
                "contains": _user_text(row),
                "turns": [call(program), {"text": f"So the answer is \\boxed{{{expected}}}."}],
            }
        )
    return rules


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    extra = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": _scripts()}}}}
    with running_servers([CONFIG], extra) as h:
        yield h


def _tool_outputs(result: dict[str, Any]) -> list[str]:
    return [o["output"] for o in result["response"]["output"] if o["type"] == "function_call_output"]


def test_every_row_right_program_scores_one(helper: RunHelper) -> None:
    assert len(ROWS) == 5
    for row in ROWS:
        result = run_rollout(helper, AGENT, row, timeout=120)
        assert result["reward"] == 1.0, result
        assert result["accuracy"] is True and result["used_python"] is True
        assert result["extracted_answer"] == row["expected_result"]
        # The sandboxed program really ran: its stdout carries the answer.
        assert row["expected_result"] in _tool_outputs(result)[0]
        assert result["expected_result"] == row["expected_result"]  # task fields survive /run


def test_every_row_wrong_answer_scores_zero(helper: RunHelper) -> None:
    for i, row in enumerate(ROWS):
        result = run_rollout(helper, AGENT, _tagged(row, f"wrong-{i}"), timeout=120)
        assert result["reward"] == 0.0 and result["accuracy"] is False
        assert result["extracted_answer"] == str(int(row["expected_result"]) + 1)


def test_state_carries_over_between_calls(helper: RunHelper) -> None:
    row = copy.deepcopy(ROWS[0])
    row["expected_result"] = "55"
    result = run_rollout(helper, AGENT, _tagged(row, "two-cells"), timeout=120)
    outputs = _tool_outputs(result)
    assert '"result":"55"' in outputs[1].replace(" ", ""), outputs
    assert result["reward"] == 1.0


def test_a_crashing_program_is_shown_to_the_model(helper: RunHelper) -> None:
    result = run_rollout(helper, AGENT, _tagged(ROWS[0], "crash"), timeout=120)
    output = _tool_outputs(result)[0]
    assert "ZeroDivisionError" in output and '"success":false' in output.replace(" ", "")
    assert "driver.py" not in output  # only the model's own frames
    assert result["reward"] == 0.0


def test_no_boxed_answer_scores_zero(helper: RunHelper) -> None:
    result = run_rollout(helper, AGENT, _tagged(ROWS[1], "no-box"), timeout=120)
    assert result["reward"] == 0.0 and result["extracted_answer"] is None


def test_verify_equivalent_forms(helper: RunHelper) -> None:
    url = server_url(helper, ENV) + "/verify"
    row = {k: v for k, v in ROWS[0].items()}
    for expected, answer, reward in [
        ("\\frac{1}{2}", "0.5", 1.0),
        ("\\(\\sqrt{2}\\)", "2^{1/2}", 1.0),
        ("4410", "4,410", 1.0),
        ("4410", "4411", 0.0),
    ]:
        body = {
            **row,
            "expected_result": expected,
            "response": {
                "output": [
                    {
                        "type": "message",
                        "role": "assistant",
                        "id": "m1",
                        "status": "completed",
                        "content": [
                            {"type": "output_text", "text": f"\\boxed{{{answer}}}", "annotations": []}
                        ],
                    }
                ]
            },
        }
        resp = post_json(url, body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["reward"] == reward, (expected, answer, resp.json())


def test_session_state_is_per_session_and_ends(helper: RunHelper) -> None:
    url = server_url(helper, ENV)
    cookie = cookie_name_for(ENV)
    first = post_json(url + "/execute_python", {"code": "secret_value = 41"})
    assert first.status_code == 200 and first.json()["success"] is True
    jar = {cookie: first.cookies[cookie]}
    same = post_json(url + "/execute_python", {"code": "secret_value + 1"}, cookies=jar)
    assert same.json()["result"] == "42"
    other = post_json(url + "/execute_python", {"code": "secret_value"})  # another session
    assert other.json()["success"] is False and "NameError" in other.json()["error_message"]
    assert post_json(url + "/end_session", {}, cookies=jar).status_code == 200
    after = post_json(url + "/execute_python", {"code": "secret_value"}, cookies=jar)
    assert "NameError" in after.json()["error_message"]


# (2+sqrt3)^(2n) = (7+4 sqrt3)^n: equal, but sympy needs far longer than math-verify's 5 s to show it
# (n = 2500 took 37 s unbounded on this 2-core machine; n = 25000 is ten times the work).
HARD_EXPECTED = "(2+\\sqrt{3})^{50000}+(2-\\sqrt{3})^{50000}"
HARD_ANSWER = "(7+4\\sqrt{3})^{25000}+(7-4\\sqrt{3})^{25000}"
# A text whose parse alone outlasts math-verify's bound.
UNPARSABLE = "{" * 3000 + "1" + "}" * 3000


def _answer_body(expected: str, answer_text: str) -> dict[str, Any]:
    return {
        **ROWS[0],
        "expected_result": expected,
        "response": {
            "output": [
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": answer_text, "annotations": []}],
                }
            ]
        },
    }


def test_an_answer_that_makes_the_check_time_out_is_a_zero_with_the_reason(helper: RunHelper) -> None:
    # math-verify swallows its own timeout and answers "not equal"; the answer made the check slow, so it
    # is the answer's 0 (with the reason), never a 503 a policy could use to drop a rollout it would fail.
    url = server_url(helper, ENV) + "/verify"
    for expected, answer in [(HARD_EXPECTED, HARD_ANSWER), ("4410", UNPARSABLE), ("4410", "9^{9^{9}}")]:
        resp = post_json(url, _answer_body(expected, f"\\boxed{{{answer}}}"), timeout=120)
        assert resp.status_code == 200, resp.text[:500]
        body = resp.json()
        assert body["reward"] == 0.0 and body["failure_reason"].startswith("answer_check_timeout: "), body


def test_an_expected_result_that_cannot_be_parsed_in_time_is_a_503(helper: RunHelper) -> None:
    # The row's expected_result alone outlasts the bound: the model cannot cause that, so it is not scored.
    resp = post_json(server_url(helper, ENV) + "/verify", _answer_body(UNPARSABLE, "\\boxed{1}"), timeout=120)
    assert resp.status_code == 503, resp.text[:500]
    error = resp.json()["error"]
    assert (error["kind"], error["server"], error["path"]) == ("verify_timeout", ENV, "/verify")
    assert "math-verify timed out parsing expected_result" in error["message"]


def test_several_boxed_answers_earn_only_when_every_one_is_right(helper: RunHelper) -> None:
    url = server_url(helper, ENV) + "/verify"
    for text, reward, reason in [
        ("\\boxed{4410} and again \\boxed{4,410}", 1.0, None),
        ("\\boxed{4411} no, \\boxed{4410}", 0.0, "several_answers"),
        ("\\boxed{4410} or \\boxed{4411}", 0.0, "several_answers"),
        (" ".join(f"\\boxed{{{n}}}" for n in range(4400, 4420)), 0.0, "too_many_answers"),
        ("no box: 4410", 0.0, "no_boxed_answer"),
        ("\\boxed{4411}", 0.0, "wrong_answer"),
    ]:
        resp = post_json(url, _answer_body("4410", text), timeout=60)
        assert resp.status_code == 200, resp.text[:500]
        body = resp.json()
        assert body["reward"] == reward, (text, body)
        assert (body["failure_reason"] or "").split(":")[0] == (reason or ""), (text, body)


def _cell(
    url: str, code: str, jar: dict[str, str] | None = None
) -> tuple[dict[str, Any], float, dict[str, str]]:
    """One execute_python call: its answer, its wall seconds, and the cookie jar of its session."""
    start = time.monotonic()
    resp = post_json(url + "/execute_python", {"code": code}, cookies=jar, timeout=60)
    elapsed = time.monotonic() - start
    assert resp.status_code == 200, resp.text
    cookie = cookie_name_for(ENV)
    return resp.json(), elapsed, jar or {cookie: resp.cookies[cookie]}


def test_cells_run_once_in_a_persistent_kernel(helper: RunHelper) -> None:
    # Cell 1 is slow and random; cells 2-4 append; cell 5 reads both. A replay would re-run cell 1 at every
    # call (each call >= 1 s, and a new random number each time): the kernel runs it once.
    url = server_url(helper, ENV)
    first, first_s, jar = _cell(
        url, "import random, time\ntime.sleep(1.0)\nr = random.random()\nitems = [1]\nr"
    )
    assert first["success"] is True and first_s >= 1.0
    for k in range(2, 5):
        out, elapsed, _ = _cell(url, f"items.append({k})\nlen(items)", jar)
        assert out["result"] == str(k) and elapsed < 1.0, (k, out, elapsed)
    last, elapsed, _ = _cell(url, "print(items)\nr", jar)
    assert last["stdout"] == "[1, 2, 3, 4]\n" and elapsed < 1.0
    assert last["result"] == first["result"]  # the same random number: cell 1 did not run again
    # A failing cell keeps the kernel (and what ran before it); a file written stays in the workspace.
    assert _cell(url, "open('notes.txt', 'w').write('kept')\nundefined_name", jar)[0]["success"] is False
    out = _cell(url, "open('notes.txt').read(), len(items)", jar)[0]
    assert out["result"] == "('kept', 4)", out
    assert post_json(url + "/end_session", {}, cookies=jar).status_code == 200


SMALL = {"max_kernels": 1, "max_execution_time": 3, "memory_mib": 200, "max_output_chars": 5000}


@pytest.fixture(scope="module")
def small() -> Iterator[RunHelper]:
    with running_servers([CONFIG], {ENV: {"resources_servers": {ENV: SMALL}}}) as h:
        yield h


def test_an_evicted_kernel_comes_back_by_replay(small: RunHelper) -> None:
    # max_kernels=1: session B's first call closes session A's idle kernel; A's next call gets a new kernel
    # with its successful cells replayed (output discarded), so its variables are back.
    url = server_url(small, ENV)
    a1, _, jar_a = _cell(url, "print('once')\nvalue = 41")
    b1, _, jar_b = _cell(url, "other = 1\nother")
    assert a1["success"] and b1["result"] == "1"
    a2, _, _ = _cell(url, "value + 1", jar_a)
    assert a2["success"] is True and a2["result"] == "42" and a2["stdout"] == "", a2
    assert _cell(url, "other + 1", jar_b)[0]["result"] == "2"


def test_bad_cells_in_a_kernel_are_the_models_errors_and_the_session_goes_on(small: RunHelper) -> None:
    # The attacks of tests/test_sandbox_escape.py that end differently in a kernel than in a one-shot
    # run: each is a failed cell the model reads (never a 503), and the next cell has the state back.
    url = server_url(small, ENV)
    _, _, jar = _cell(url, "kept = 7")
    bad = {
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nimport time\ntime.sleep(5)": "kernel died",
        "while True:\n    pass": "timed out",
        "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 * 1024))": "Out of memory",
        "import sys\nblock = 'x' * (1 << 20)\nfor _ in range(64):\n    sys.stdout.write(block)": "Output limit",
        "import os\nos._exit(3)": "exit code",
    }
    for code, error in bad.items():
        out, _, _ = _cell(url, code, jar)
        assert out["success"] is False and error in out["error_message"], (code, out)
        assert len(out["stdout"]) <= SMALL["max_output_chars"]
        assert _cell(url, "kept", jar)[0]["result"] == "7", code


@pytest.fixture(scope="module")
def replay() -> Iterator[RunHelper]:
    with running_servers([CONFIG], {ENV: {"resources_servers": {ENV: {"kernel": "replay"}}}}) as h:
        yield h


def test_replay_mode_still_carries_state(replay: RunHelper) -> None:
    # kernel: replay (what a machine without sandbox sessions falls back to) re-runs earlier cells.
    url = server_url(replay, ENV)
    first, _, jar = _cell(url, "import random\nr = random.random()\nn = 20\nr")
    again, _, _ = _cell(url, "n + 1, r", jar)
    assert again["success"] is True and again["result"].startswith("(21, ")
    assert again["result"] != f"(21, {first['result']})"  # cell 1 ran again: a new random number
    crash, _, _ = _cell(url, "1 / 0", jar)
    assert "ZeroDivisionError" in crash["error_message"] and "driver.py" not in crash["stderr"]


@pytest.fixture(scope="module")
def no_sessions() -> Iterator[RunHelper]:
    # Sandbox sessions need bubblewrap and a workspace mount (root, or a user namespace): a backend without
    # them makes SandboxSession.start raise SandboxUnavailableError, which kernel: auto (the default) turns
    # into replay (logged), as where no mount works.
    extra = {ENV: {"resources_servers": {ENV: {"sandbox": {"backend": "unsafe_local_subprocess"}}}}}
    with running_servers([CONFIG], extra) as h:
        yield h


def test_without_sessions_auto_falls_back_to_replay(no_sessions: RunHelper) -> None:
    url = server_url(no_sessions, ENV)
    first, _, jar = _cell(url, "import random\nr = random.random()\nn = 20\nr")
    again, _, _ = _cell(url, "n + 1, r", jar)
    assert again["success"] is True and again["result"].startswith("(21, ")
    assert again["result"] != f"(21, {first['result']})"  # replayed, not kept in a kernel
