"""code_gen against real servers: scripted right and wrong programs, each failure reason, bad rows, metrics."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from nemo_gym.cli import RunHelper
from nemo_gym.tools.testing import example_rows, post_json, run_rollout, running_servers, server_url

ENV = "code_gen"
CONFIG = f"resources_servers/{ENV}/configs/{ENV}.yaml"
AGENT = f"{ENV}_simple_agent"
ROWS = example_rows(ENV)


def _fenced(code: str) -> str:
    return f"Here is my solution.\n\n```python\n{code}\n```\n"


RIGHT = [
    "a, b = map(int, input().split())\nprint(a + b)",
    "n = int(input())\nprint(max(map(int, input().split())))",
    "print(input()[::-1])",
    "n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\nprint(a)",
    "class Solution:\n    def countVowels(self, s: str) -> int:\n        return sum(c in 'aeiouAEIOU' for c in s)",
]
# Wrong programs: each passes some tests and fails others.
WRONG = [
    "a, b = map(int, input().split())\nprint(a + b if a > 0 else a - b)",
    "n = int(input())\nprint(max(0, *map(int, input().split())))",
    "s = input()\nprint(s[::-1] if len(s) > 1 else s + s)",
    "n = int(input())\nprint(n if n < 2 else 55)",
    "class Solution:\n    def countVowels(self, s: str) -> int:\n        return sum(c in 'aeiou' for c in s)",
]
FAILING = {
    "syntax": ("a, b = map(int, input().split()\nprint(a + b)", "compile_error"),
    "raises": ("raise SystemExit(3)", "runtime_error"),
    "loop": ("while True:\n    pass", "timeout"),
    "memory": ("x = []\nwhile True:\n    x.append(bytearray(8 << 20))", "memory"),
    "flood": ("import sys\nwhile True:\n    sys.stdout.write('9' * 65536)", "output_limit"),
    # 1 MiB files (each under RLIMIT_FSIZE) until the time limit: before, each test wrote ~800 MB to the
    # host's disk in its 3 s and failed as `timeout`.
    "disk": ("i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(bytes(1 << 20))\n    i += 1", "disk_quota"),
}


def _user_text(row: dict[str, Any]) -> str:
    return row["responses_create_params"]["input"][0]["content"]


def _tagged(row: dict[str, Any], tag: str) -> dict[str, Any]:
    out = copy.deepcopy(row)
    out["responses_create_params"]["input"][0]["content"] += f" [{tag}]"
    return out


def _scripts() -> list[dict[str, Any]]:
    rules = [{"contains": "[no-code]", "turns": [{"text": "I think the answer is to add them."}]}]
    rules += [
        {"contains": f"[{tag}]", "turns": [{"text": _fenced(code)}]} for tag, (code, _) in FAILING.items()
    ]
    rules += [
        {"contains": f"[wrong-{i}]", "turns": [{"text": _fenced(code)}]} for i, code in enumerate(WRONG)
    ]
    rules += [
        {"contains": _user_text(r), "turns": [{"text": _fenced(c)}]} for r, c in zip(ROWS, RIGHT, strict=True)
    ]
    return rules


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    extra = {
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": _scripts()}}},
        ENV: {
            "resources_servers": {
                ENV: {
                    "unit_test_timeout_secs": 2,
                    "memory_mib": 128,
                    "max_output_bytes": 100000,
                    "disk_quota_mib": 8,
                }
            }
        },
    }
    with running_servers([CONFIG], extra) as h:
        yield h


def test_every_row_right_program_scores_one(helper: RunHelper) -> None:
    assert len(ROWS) == 5
    for row, code in zip(ROWS, RIGHT, strict=True):
        result = run_rollout(helper, AGENT, row, timeout=120)
        n = len(row["verifier_metadata"]["unit_tests"]["inputs"])
        assert result["reward"] == 1.0, result["metadata"]
        assert result["result"] == [True] * n and result["pass_fraction"] == 1.0
        assert result["extracted_model_code"].strip() == code
        assert result["failure_reason"] is None
        assert result["verifier_metadata"] == row["verifier_metadata"]  # task fields survive /run
        assert result["difficulty"] == row["verifier_metadata"]["difficulty"]


def test_every_row_wrong_program_scores_zero_with_partial_pass_fraction(helper: RunHelper) -> None:
    for i, row in enumerate(ROWS):
        result = run_rollout(helper, AGENT, _tagged(row, f"wrong-{i}"), timeout=120)
        assert result["reward"] == 0.0, result
        assert 0.0 < result["pass_fraction"] < 1.0, result["result"]
        assert result["failure_reason"] == "wrong_answer"
        assert False in result["result"] and True in result["result"]


@pytest.mark.parametrize("tag", sorted(FAILING))
def test_each_program_failure_is_zero_with_its_reason(helper: RunHelper, tag: str) -> None:
    result = run_rollout(helper, AGENT, _tagged(ROWS[0], tag), timeout=120)
    assert result["reward"] == 0.0 and result["pass_fraction"] == 0.0
    assert result["failure_reason"] == FAILING[tag][1], result["metadata"]
    assert all(t["reason"] == FAILING[tag][1] for t in result["metadata"]["tests"])


def test_no_code_block_scores_zero(helper: RunHelper) -> None:
    result = run_rollout(helper, AGENT, _tagged(ROWS[0], "no-code"), timeout=120)
    assert result["reward"] == 0.0 and result["failure_reason"] == "no_code"
    assert result["extracted_model_code"] is None


def _verify_body(row: dict[str, Any], text: str) -> dict[str, Any]:
    return {
        **row,
        "response": {
            "output": [
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "m1",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            ]
        },
    }


def test_bad_unit_tests_are_a_422_naming_the_field(helper: RunHelper) -> None:
    url = server_url(helper, ENV) + "/verify"
    row = copy.deepcopy(ROWS[0])
    row["verifier_metadata"]["unit_tests"]["outputs"] = ["3\n"]
    resp = post_json(url, _verify_body(row, _fenced(RIGHT[0])))
    assert resp.status_code == 422
    assert "unit_tests" in resp.text and "3 inputs but 1 outputs" in resp.text
    del row["verifier_metadata"]
    resp = post_json(url, _verify_body(row, _fenced(RIGHT[0])))
    assert resp.status_code == 422 and "verifier_metadata" in resp.text


def test_tests_do_not_share_files_and_numbers_compare_with_tolerance(helper: RunHelper) -> None:
    url = server_url(helper, ENV) + "/verify"
    row = copy.deepcopy(ROWS[0])
    row["verifier_metadata"]["unit_tests"] = {
        "inputs": ["1\n", "2\n", "3\n"],
        "outputs": ["first 0.3333333333\n"] * 3,
        "fn_name": None,
    }
    # Each test writes a marker file; with a shared work dir later tests would see earlier ones.
    code = (
        "import os\nseen = os.path.exists('marker')\nopen('marker', 'w').write('x')\n"
        "input()\nprint('later' if seen else 'first', 1 / 3)"
    )
    resp = post_json(url, _verify_body(row, _fenced(code)))
    assert resp.status_code == 200, resp.text
    assert resp.json()["result"] == [True, True, True] and resp.json()["reward"] == 1.0


def test_aggregate_metrics_have_pass_at_k(helper: RunHelper) -> None:
    url = server_url(helper, ENV) + "/aggregate_metrics"
    responses = [
        {
            "_ng_task_index": t,
            "_ng_rollout_index": r,
            "reward": float(t == 0 or r == 1),
            "extracted_model_code": "x",
        }
        for t in range(2)
        for r in range(2)
    ]
    resp = post_json(url, {"verify_responses": responses})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["agent_metrics"]["pass@2/accuracy"] == 100.0
    assert body["agent_metrics"]["pass@1[avg-of-2]/accuracy"] == 75.0


def test_call_based_results_compare_exactly(helper: RunHelper) -> None:
    # A bare value does not pass for an expected one-element list (nor the reverse); a tuple is a list.
    url = server_url(helper, ENV) + "/verify"
    row = copy.deepcopy(ROWS[0])
    for expected, body, passed in [
        ("[3]", "return a + b", False),
        ("3", "return [a + b]", False),
        ("[3]", "return [a + b]", True),
        ("[3]", "return (a + b,)", True),
    ]:
        row["verifier_metadata"]["unit_tests"] = {"inputs": ["1\n2"], "outputs": [expected], "fn_name": "f"}
        code = f"class Solution:\n    def f(self, a, b):\n        {body}"
        resp = post_json(url, _verify_body(row, _fenced(code)))
        assert resp.status_code == 200, resp.text
        assert resp.json()["result"] == [passed], (expected, body, resp.json()["metadata"])
