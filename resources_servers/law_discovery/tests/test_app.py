"""law_discovery against real servers: experiments, the law's judgement, bad input, ng_collect_rollouts.

One set of servers serves the module. The scripted model picks a trajectory by a tag appended to the
row's user message (``[variant=... row=...]``); the untagged example rows get the right trajectory.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from nemo_gym.auth import auth_headers, client_token_for_url
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
from resources_servers.law_discovery.expressions import LawSyntaxError, evaluate, parse_law, same_form
from resources_servers.law_discovery.laws import TEMPLATES
from resources_servers.law_discovery.scripts.generate_dataset import rows as generated_rows

ENV = "law_discovery"
CONFIG = f"resources_servers/{ENV}/configs/{ENV}.yaml"
AGENT = f"{ENV}_simple_agent"
ROWS = example_rows(ENV)
TEXTBOOK = {t.task_id: t.textbook for t in TEMPLATES}


def _scaled(expression: str, factor: float) -> str:
    """``expression`` with its first number multiplied by ``factor`` (a fitted constant slightly off)."""
    match = re.search(r"\d+\.?\d*(e-?\d+)?", expression)
    assert match is not None
    return expression[: match.start()] + repr(float(match.group()) * factor) + expression[match.end() :]


def _middle(row: dict[str, Any], shift: float = 0.5) -> dict[str, float]:
    return {n: v["low"] + shift * (v["high"] - v["low"]) for n, v in row["law"]["variables"].items()}


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"tool_calls": [{"name": name, "arguments": arguments}]}


DONE = {"text": "I have submitted the law."}


def _variants(row: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    truth = row["law"]["expression"]
    experiments = [_call("run_experiment", inputs=_middle(row, s)) for s in (0.25, 0.75)]
    variants = {
        "close": [*experiments, _call("submit_law", expression=_scaled(truth, 1.02)), DONE],
        "textbook": [*experiments, _call("submit_law", expression=TEXTBOOK[row["task_id"]]), DONE],
        "malformed": [_call("submit_law", expression="m1 +* (m2"), DONE],
        "unknown": [_call("submit_law", expression=f"{truth} + G"), DONE],
        "no_law": [*experiments, DONE],
        "fixed": [_call("submit_law", expression="x +* 2"), _call("submit_law", expression=truth), DONE],
        "out_of_range": [
            _call("run_experiment", inputs={n: v["high"] * 10 for n, v in row["law"]["variables"].items()}),
            _call("submit_law", expression=truth),
            DONE,
        ],
    }
    if row["task_id"] == "gravitation_force":  # r**3 -> r**2.99: fits over the range, another form
        variants["numeric_only"] = [_call("submit_law", expression=truth.replace("r**3", "r**2.99")), DONE]
    return variants


def _scripts() -> list[dict[str, Any]]:
    rules = variant_rules(ROWS, _variants)
    for row in ROWS:
        truth = row["law"]["expression"]
        experiments = [_call("run_experiment", inputs=_middle(row, s)) for s in (0.1, 0.5, 0.9)]
        turns = [
            *experiments,
            _call("fit_check", expression=truth),
            _call("submit_law", expression=truth),
            DONE,
        ]
        rules.append({"contains": row["responses_create_params"]["input"][-1]["content"], "turns": turns})
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


def test_the_example_rows_are_the_generators_and_their_laws_hold() -> None:
    assert len(ROWS) == 5
    from resources_servers.law_discovery.scripts.generate_dataset import EXAMPLE_SEED, EXAMPLE_TASKS

    assert generated_rows(EXAMPLE_SEED, EXAMPLE_TASKS) == ROWS  # the shipped rows are reproducible
    every = generated_rows(0)
    assert len(every) == len(TEMPLATES) >= 24 and len({r["domain"] for r in every}) >= 8
    assert generated_rows(0) == every and generated_rows(1) != every  # a seed fixes the constants
    for row in every:  # no task is answered by its textbook form
        template = next(t for t in TEMPLATES if t.task_id == row["task_id"])
        variables = list(row["law"]["variables"])
        assert not same_form(template.textbook, row["law"]["expression"], variables), row["task_id"]
        assert row["law"]["expression"] not in str(row["responses_create_params"])  # the model never sees it


def test_right_trajectories_score_one(helper: RunHelper) -> None:
    for row in ROWS:
        result = run_rollout(helper, AGENT, row)
        assert result["reward"] == 1.0, (row["task_id"], result["failure_reason"], result["rmsle"])
        assert result["failure_reason"] == "pass" and result["symbolic_match"] is True
        assert result["rmsle"] == pytest.approx(0.0, abs=1e-9)
        assert result["experiments_used"] == 3
        assert result["submitted_law"] == row["law"]["expression"]
        measured = _outputs(result, "run_experiment")
        truth = parse_law(row["law"]["expression"], row["law"]["variables"])
        for m in measured:  # noisy measurements, within a few standard deviations of the law
            point = {k: v for k, v in m.items() if k != row["law"]["target"]}
            exact = evaluate(truth, point)
            assert abs(m[row["law"]["target"]] / exact - 1) <= 5 * row["law"]["noise"] + 1e-5
        fit = _outputs(result, "fit_check")[0]
        assert fit["experiments"] == 3 and fit["rmsle"] <= 5 * row["law"]["noise"] + 1e-5


def test_a_slightly_off_constant_still_scores_one_and_the_textbook_form_zero(helper: RunHelper) -> None:
    for i, row in enumerate(ROWS):
        close = run_rollout(helper, AGENT, tagged_row(row, "close", i))
        assert close["reward"] == 1.0 and close["symbolic_match"] is True
        assert 0.0 < close["rmsle"] <= 0.05
        textbook = run_rollout(helper, AGENT, tagged_row(row, "textbook", i))
        assert textbook["reward"] == 0.0, (row["task_id"], textbook["rmsle"])
        assert textbook["failure_reason"] == "wrong_law" and textbook["symbolic_match"] is False
        assert textbook["experiments_used"] == 2


def test_a_law_that_fits_with_another_form_gets_partial_credit(helper: RunHelper) -> None:
    i = next(i for i, r in enumerate(ROWS) if r["task_id"] == "gravitation_force")
    result = run_rollout(helper, AGENT, tagged_row(ROWS[i], "numeric_only", i))
    assert result["failure_reason"] == "numeric_only" and result["symbolic_match"] is False
    assert result["reward"] == 0.5 and 0 < result["rmsle"] <= 0.05


def test_malformed_and_missing_laws_score_zero_with_the_reason(helper: RunHelper) -> None:
    row = ROWS[0]
    malformed = run_rollout(helper, AGENT, tagged_row(row, "malformed", 0))
    assert (malformed["reward"], malformed["failure_reason"]) == (0.0, "unparseable")
    assert (
        "not an arithmetic expression" in _outputs(malformed, "submit_law")[0]["error"]
    )  # the model was told
    unknown = run_rollout(helper, AGENT, tagged_row(row, "unknown", 0))
    assert (unknown["reward"], unknown["failure_reason"]) == (0.0, "unknown_symbols")
    assert "unknown symbol(s) G" in _outputs(unknown, "submit_law")[0]["error"]
    nothing = run_rollout(helper, AGENT, tagged_row(row, "no_law", 0))
    assert (nothing["reward"], nothing["failure_reason"], nothing["submitted_law"]) == (0.0, "no_law", None)
    fixed = run_rollout(helper, AGENT, tagged_row(row, "fixed", 0))  # only the last submission counts
    assert fixed["reward"] == 1.0 and [("error" in o) for o in _outputs(fixed, "submit_law")] == [True, False]


def test_out_of_range_inputs_are_a_tool_error_the_model_reads(helper: RunHelper) -> None:
    result = run_rollout(helper, AGENT, tagged_row(ROWS[0], "out_of_range", 0))
    (answer,) = _outputs(result, "run_experiment")
    assert "outside the apparatus range" in answer["error"]
    assert result["reward"] == 1.0 and result["experiments_used"] == 1


class _Session:
    """Direct tool calls within one session (the cookie jar keeps the session cookie)."""

    def __init__(self, helper: RunHelper, row: dict[str, Any]) -> None:
        self.base = server_url(helper, ENV)
        self.client = httpx.Client(
            headers=auth_headers(client_token_for_url(self.base)), timeout=30, trust_env=False
        )
        resp = self.client.post(self.base + "/seed_session", json=row)
        assert resp.status_code == 200, resp.text

    def call(self, tool: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = self.client.post(f"{self.base}/{tool}", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()


def test_measurements_are_reproducible_per_row_and_bounded_by_the_budget(helper: RunHelper) -> None:
    row = next(r for r in ROWS if r["law"]["noise"] > 0)
    point = _middle(row)
    first = [_Session(helper, row).call("run_experiment", {"inputs": point}) for _ in range(2)]
    assert first[0] == first[1]  # same row, same experiment index: same noise
    target = row["law"]["target"]
    session = _Session(helper, {**row, "max_experiments": 3})
    values = [session.call("run_experiment", {"inputs": point})[target] for _ in range(3)]
    assert len(set(values)) == 3  # each experiment draws its own noise
    assert "budget" in session.call("run_experiment", {"inputs": point})["error"]
    exact = _Session(helper, {**row, "law": {**row["law"], "noise": 0.0}}).call(
        "run_experiment", {"inputs": point}
    )
    assert exact[target] == pytest.approx(
        evaluate(parse_law(row["law"]["expression"], point), point), rel=1e-5
    )
    fresh = _Session(helper, row)
    for bad, says in (
        ({k: v for k, v in list(point.items())[1:]}, "missing"),
        ({**point, "zz": 1}, "unknown zz"),
        ({**point, next(iter(point)): "7"}, "must be a finite number"),
    ):
        assert says in fresh.call("run_experiment", {"inputs": bad})["error"]
    assert (
        "run an experiment first"
        in fresh.call("fit_check", {"expression": row["law"]["expression"]})["error"]
    )
    assert "not an arithmetic expression" in fresh.call("fit_check", {"expression": "2 *"})["error"]


def test_a_broken_row_is_refused_not_scored(helper: RunHelper, tmp_path: Path) -> None:
    broken = copy.deepcopy(ROWS[0])
    broken["law"]["expression"] = "m1 * import"
    resp = post_json(server_url(helper, ENV) + "/verify", {**broken, "response": {"output": []}})
    assert resp.status_code == 422 and "law.expression" in resp.text
    empty = copy.deepcopy(ROWS[0])
    empty["law"]["variables"]["r"] = {"low": 5, "high": 1}
    resp = post_json(server_url(helper, ENV) + "/seed_session", empty)
    assert resp.status_code == 422 and "low < high" in resp.text

    # Through ng_collect_rollouts: right, wrong and malformed rows scored; the broken row in the sidecar.
    rows = [ROWS[1], tagged_row(ROWS[1], "textbook", 1), tagged_row(ROWS[1], "malformed", 1), broken]
    code, out, err = collect_rollouts(helper, rows, tmp_path, AGENT, "+max_attempts=1")
    assert [r["reward"] for r in out] == [1.0, 0.0, 0.0], err[-2000:]
    assert code == 1  # a row failed: reported by the exit status, not hidden in a reward
    failures = [orjson.loads(line) for line in (tmp_path / "output_failures.jsonl").read_text().splitlines()]
    assert len(failures) == 1 and failures[0]["_ng_task_index"] == 3
    assert (failures[0]["path"], failures[0]["status"]) == ("/seed_session", 422)
    assert "law.expression" in failures[0]["error"]


def test_expressions_refuse_what_is_not_arithmetic() -> None:
    for bad in ("__import__('os').system('true')", "m1.real", "[m1]", "lambda: 1", "m1 if m2 else r", "'a'"):
        with pytest.raises(LawSyntaxError):
            parse_law(bad, ["m1", "m2", "r"])
    with pytest.raises(ValueError, match="undefined"):
        evaluate(parse_law("10.0**10**10", []), {})  # floats overflow at once: no giant integer
