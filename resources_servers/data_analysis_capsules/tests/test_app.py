"""data_analysis_capsules: the generator's proofs, the grading, and rollouts on real servers and kernels.

The generator tests need no server. The rollout tests start one set of servers (the capsule server with
real sandboxed kernels, aviary_agent, the scripted model) and keep kernel start-ups few: each right
trajectory runs the capsule's solution cell in the kernel (its printed value is checked against the
stored answer) and submits; ng_collect_rollouts then scores right, wrong and malformed rows and refuses
a broken one.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import re
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest

from nemo_gym.cli import RunHelper
from nemo_gym.tools.testing import (
    collect_rollouts,
    example_rows,
    numeric_differences,
    post_json,
    running_servers,
    server_url,
)
from resources_servers.data_analysis_capsules.app import CapsuleRow, grade
from resources_servers.data_analysis_capsules.capsules import BY_ID, SPECS
from resources_servers.data_analysis_capsules.scripts.generate_dataset import (
    CAPSULES_DIR,
    DATA,
    EXAMPLE_CAPSULES,
    SHIPPED_SEED,
    build,
)

ENV = "data_analysis_capsules"
CONFIG = f"resources_servers/{ENV}/configs/{ENV}.yaml"
AGENT = f"{ENV}_agent"
ROWS = example_rows(ENV)
ALL = [orjson.loads(line) for line in (DATA / "capsules.jsonl").read_bytes().splitlines()]
BY_CAPSULE = {r["capsule_id"]: r for r in ALL}


# ------------------------------------------------------------------------------------------------
# The generator: reproducible, and every planted effect really there.


# How far a regenerated answer may be from the stored one. Floating-point results differ in their last
# digits between CPUs (OpenBLAS picks its kernels by CPU), measured over OpenBLAS's Haswell (which
# reproduces the stored data bit for bit), SkylakeX, SandyBridge, Cooperlake, SapphireRapids and Nehalem
# kernels (OPENBLAS_CORETYPE): the closed-form statistics (t, chi-square, F, slopes, medians) agree to the
# last digit or two, far inside 1e-9. A least-squares fit is only determined to about the square root of
# the machine epsilon (its cost is flat at the minimum: tighter ftol/xtol/gtol move it no closer), and
# dose_response_ec50's curve_fit parameters (the EC50 answer among them) differ by up to 1e-8 relative
# between those kernels: they get FITTED_REL_TOL. The CSVs hold rounded draws (no BLAS): equal everywhere.
GENERATOR_REL_TOL = 1e-9
FITTED_REL_TOL = 1e-6
FITTED_CAPSULES = frozenset({"dose_response_ec50"})


def _csv_cells(text: str) -> list[list[Any]]:
    """A CSV's cells, numbers as floats (compared within a tolerance), the rest as text."""

    def cell(value: str) -> Any:
        try:
            return float(value)
        except ValueError:
            return value

    return [[cell(v) for v in line.split(",")] for line in text.splitlines()]


def test_the_generator_reproduces_the_shipped_data_and_answers() -> None:
    """The shipped CSVs and answers are the generator's: rebuilt on this machine, every number is within
    GENERATOR_REL_TOL (1e-9 relative) of the stored one, or FITTED_REL_TOL (1e-6) for the numbers of a
    least-squares fit, and everything else is equal. Not byte-equal: floating-point results differ in their
    last digits between CPUs (a fit by up to 1e-8 relative, measured over OpenBLAS's kernels), so CI passes
    on either vendor's CPU, while a real change of the generator (a draw, a planted effect, a reference
    analysis, the seed) moves the data and answers far more. That jitter is also far below what the
    verifier tolerates (every row's tolerance is at least 1e-3 of the answer, asserted below, 1000 times
    FITTED_REL_TOL): no verdict depends on the CPU that generated the answers."""
    built = build(SHIPPED_SEED)
    assert [row["capsule_id"] for row, _ in built] == [r["capsule_id"] for r in ALL]
    assert len(ALL) == len(SPECS) >= 10
    for (row, files), stored in zip(built, ALL, strict=True):
        fitted = row["capsule_id"] in FITTED_CAPSULES
        tol = FITTED_REL_TOL if fitted else GENERATOR_REL_TOL
        differences = numeric_differences(row, stored, rel_tol=tol, path=row["capsule_id"])
        assert not differences, differences
        for name, text in files.items():
            shipped = (CAPSULES_DIR / row["data_folder"] / name).read_text()
            differences = numeric_differences(
                _csv_cells(text), _csv_cells(shipped), rel_tol=GENERATOR_REL_TOL, path=name
            )
            assert not differences, (row["capsule_id"], differences)
            assert text.count("\n") <= 400  # a few hundred rows at most
        if row["eval_mode"] == "range_verifier":  # the verifier's tolerance dwarfs the CPU's jitter
            tolerance = row["tolerance"]
            allowed = tolerance.get("abs") or tolerance["rel"] * abs(row["ideal"])
            assert allowed >= 1000 * FITTED_REL_TOL * abs(row["ideal"]), row["capsule_id"]
    assert ROWS == [r for r in ALL if r["capsule_id"] in EXAMPLE_CAPSULES] and len(ROWS) == 5
    assert {r["eval_mode"] for r in ALL} == {"range_verifier", "mcq"}
    questions = [r["question"] for r in ALL]  # each is the scripted model's key for its row: none in another
    assert not [(a, b) for a in questions for b in questions if a != b and a in b]
    for row in ALL:  # the answer is never in what the model is shown
        assert str(row["ideal"]) not in str(row["responses_create_params"]) + row["question"]


def test_every_planted_effect_is_there() -> None:
    ref = {r["capsule_id"]: r["reference"] for r in ALL}
    assert ref["ttest_pvalue"]["p"] < 0.01 and ref["mean_difference"]["p"] < 0.01
    assert ref["regression_slope"]["p"] < 1e-3
    assert (
        abs(ref["regression_slope"]["slope"] - ref["regression_slope"]["planted_slope"])
        < 3 * ref["regression_slope"]["stderr"]
    )
    for survival in ("survival_median", "survival_logrank"):
        assert ref[survival]["p"] < 0.01 and ref[survival]["median_new"] > ref[survival]["median_standard"]
    # Confounding: a strong raw correlation that adjusting for age removes (and no other candidate does).
    assert ref["partial_correlation"]["raw_r"] > 0.3 and abs(ref["partial_correlation"]["partial_r"]) < 0.15
    choice = ref["confounder_choice"]["partial_r"]
    assert abs(choice["age"]) < 0.1 and min(abs(v) for k, v in choice.items() if k != "age") > 0.3
    assert BY_CAPSULE["confounder_choice"]["ideal"] == "age"
    assert ref["anova_diets"]["p"] < 0.01 and ref["chi_square_genotype"]["p"] < 0.01
    assert abs(ref["dose_response_ec50"]["ec50"] / ref["dose_response_ec50"]["planted_ec50"] - 1) < 0.15
    assert ref["paired_ldl"]["p"] < 0.01 < 0.1 < ref["paired_ldl"]["unpaired_p"]  # pairing matters
    robust = ref["robust_median_difference"]
    assert robust["median_difference"] < 0 < robust["mean_difference"]  # outliers flip the mean
    genes = ref["de_gene_choice"]["bonferroni_p"]
    assert [g for g, p in genes.items() if p < 0.05] == [BY_CAPSULE["de_gene_choice"]["ideal"]]
    # Another seed: other data, every capsule still proven (draw_capsule raises otherwise).
    other = [row for row, _ in build(1)]
    assert [r["ideal"] for r in other] != [r["ideal"] for r in ALL]


def test_grading_numbers_options_and_malformed_answers() -> None:
    rel = CapsuleRow.model_validate(BY_CAPSULE["ttest_pvalue"])
    p = rel.ideal
    assert grade(rel, f"{p * 1.005:.6g}").correct and not grade(rel, f"{p * 1.02:.6g}").correct
    assert grade(rel, f"p = {p:.4g}.").correct
    bad = grade(rel, "very small")
    assert (bad.parse_status, bad.failure_reason) == (
        "unparseable",
        "unparseable",
    ) and "no number" in bad.reason
    assert "2 numbers" in grade(rel, "between 0.01 and 0.02").reason
    absolute = CapsuleRow.model_validate(BY_CAPSULE["robust_median_difference"])
    assert grade(absolute, f"{absolute.ideal + 0.009:.3f}").correct
    assert grade(absolute, f"{absolute.ideal - 0.02:.3f}").failure_reason == "wrong_answer"
    assert grade(absolute, "\u22124.71").correct  # a typographic minus
    mcq = CapsuleRow.model_validate(BY_CAPSULE["confounder_choice"])
    letter = "ABCD"[mcq.options.index("age")]
    assert grade(mcq, letter).correct and grade(mcq, f"({letter.lower()})").correct
    assert grade(mcq, "Age").correct and grade(mcq, f"{letter}. age").correct
    wrong = "ABCD"[mcq.options.index("clinic")]
    assert grade(mcq, wrong).failure_reason == "wrong_answer"
    assert grade(mcq, "Z").parse_status == "unparseable" and grade(mcq, f"{letter}. clinic").parse_status == (
        "unparseable"
    )
    with pytest.raises(ValueError, match="tolerance"):
        CapsuleRow.model_validate({**BY_CAPSULE["ttest_pvalue"], "tolerance": None})
    with pytest.raises(ValueError, match="not one of the options"):
        CapsuleRow.model_validate({**BY_CAPSULE["confounder_choice"], "ideal": "weight"})


# ------------------------------------------------------------------------------------------------
# Rollouts on real servers and kernels.


def _cell(code: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "edit_cell", "arguments": {"contents": code}}]}


def _submit(answer: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "submit_answer", "arguments": {"answer": answer}}]}


def _answer_text(row: dict[str, Any]) -> str:
    if row["eval_mode"] == "mcq":
        return "ABCDEFGHIJ"[row["options"].index(row["ideal"])]
    return repr(row["ideal"])


def _wrong_text(row: dict[str, Any]) -> str:
    if row["eval_mode"] == "mcq":
        return "ABCDEFGHIJ"[next(i for i, o in enumerate(row["options"]) if o != row["ideal"])]
    return repr(row["ideal"] * 1.5 + 1.0)


def _tagged(row: dict[str, Any], tag: str) -> dict[str, Any]:
    out = copy.deepcopy(row)
    out["responses_create_params"]["input"] = [{"role": "user", "content": f"Work carefully. [{tag}]"}]
    return out


# The work dir's disk quota of the tests' server (kernel_limits.work_dir_quota_mib).
QUOTA_MIB = 16
# A cell that ignores the interrupt and writes 1 MiB files (each under RLIMIT_FSIZE) for ~10 s: 200 MiB in
# all, so that the unfixed server wrote that much and no more.
DISK_NO_SIGINT = """import signal, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
for n in range(200):
    with open(f'fill{n}', 'wb') as f:
        f.write(bytes(1 << 20))
    time.sleep(0.05)
print('wrote all')
"""


def _scripts() -> list[dict[str, Any]]:
    rules = []
    for row in ALL:
        cid, solution = row["capsule_id"], BY_ID[row["capsule_id"]].solution
        rules += [
            {"contains": f"[wrong {cid}]", "turns": [_cell(solution), _submit(_wrong_text(row))]},
            {"contains": f"[malformed {cid}]", "turns": [_submit("I could not decide")]},
            {
                "contains": f"[crash {cid}]",
                "turns": [_cell("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")],
            },
            {  # a cell leaves a timer that kills the kernel after it returned; the next cell finds it dead.
                # The timer gives the cell's reply 1.5 s to reach the server (0.2 s was too little on a busy
                # CI machine: the kernel died before the reply, which is the other path), the next cell 5 s.
                "contains": f"[late crash {cid}]",
                "turns": [
                    _cell(
                        "import os, signal, threading\nthreading.Timer(1.5, os.kill, (os.getpid(), signal.SIGKILL)).start()"
                    ),
                    {**_cell("print('still here?')"), "delay_s": 5.0},
                ],
            },
        ]
    # One model turn of several calls (Aviary runs them all, in order): only the first answer counts.
    mcq = BY_CAPSULE["confounder_choice"]
    letters = "ABCDEFGHIJ"[: len(mcq["options"])]
    right = _answer_text(mcq)
    number = BY_CAPSULE["ttest_pvalue"]["ideal"]
    several = {
        "every letter": [*(c for c in letters if c != right), right],  # the right one last
        "right twice": [repr(number)] * 2,
        "a sweep": [repr(number * f) for f in (0.5, 0.9, 1.0, 1.1)],
    }
    for tag, answers in several.items():
        calls = [{"name": "submit_answer", "arguments": {"answer": a}} for a in answers]
        rules.append({"contains": f"[{tag}]", "turns": [{"tool_calls": calls}]})
    ttest = BY_CAPSULE["ttest_pvalue"]
    rules.append({"contains": "[disk]", "turns": [_cell(DISK_NO_SIGINT), _submit(_answer_text(ttest))]})
    kill = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"
    rules.append(
        {
            "contains": "[kill and answer]",
            "turns": [
                {
                    "tool_calls": [
                        {"name": "edit_cell", "arguments": {"contents": kill}},
                        {"name": "submit_answer", "arguments": {"answer": right}},
                    ]
                }
            ],
        }
    )
    for row in ALL:  # untagged rows: the right trajectory (matched on the capsule's question)
        turns = [
            {"tool_calls": [{"name": "list_workdir", "arguments": {}}]},
            _cell(BY_ID[row["capsule_id"]].solution),
        ]
        rules.append({"contains": row["question"], "turns": [*turns, _submit(_answer_text(row))]})
    return rules


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    extra = {
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": _scripts()}}},
        ENV: {"resources_servers": {ENV: {"kernel_limits": {"work_dir_quota_mib": QUOTA_MIB}}}},
    }
    with running_servers([CONFIG], extra) as h:
        yield h


def _printed_value(result: dict[str, Any]) -> str:
    """The last notebook view's output of the solution cell."""
    views = [o["content"] for o in result["response"]["output"] if o.get("is_env_state")]
    return views[-1]


def test_right_wrong_malformed_and_broken_rows_through_ng_collect_rollouts(
    helper: RunHelper, tmp_path: Path
) -> None:
    kinds = ["ttest_pvalue", "survival_median", "confounder_choice", "dose_response_ec50"]
    right = [BY_CAPSULE[k] for k in kinds]
    wrong = _tagged(BY_CAPSULE["chi_square_genotype"], "wrong chi_square_genotype")
    malformed = _tagged(BY_CAPSULE["regression_slope"], "malformed regression_slope")
    broken = {**BY_CAPSULE["anova_diets"], "data_folder": "seed0/../../../aviary"}
    code, out, err = collect_rollouts(
        helper, [*right, wrong, malformed, broken], tmp_path, AGENT, "+max_attempts=1"
    )
    assert [r["reward"] for r in out] == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0], err[-3000:]
    for row, result in zip(right, out, strict=False):
        assert result["failure_reason"] == "pass" and result["answer_parse_status"] == "parsed"
        assert result["cells_run"] == 1 and result["capsule_id"] == row["capsule_id"]
        view = _printed_value(result)
        if row["eval_mode"] == "range_verifier":  # the kernel computed the stored answer from the CSV
            printed = float(re.findall(r"[-+]?\d+\.\d+(?:e[-+]?\d+)?", view)[-1])
            assert math.isclose(printed, row["ideal"], rel_tol=1e-6), (row["capsule_id"], view[-400:])
        else:
            assert "'age': 0.0" in view or "'age': -0.0" in view, view[-400:]
    assert (out[4]["failure_reason"], out[4]["answer_parse_status"]) == ("wrong_answer", "parsed")
    assert "not within the tolerance" in out[4]["reason"] and out[4]["cells_run"] == 1
    assert (out[5]["failure_reason"], out[5]["answer_parse_status"]) == ("unparseable", "unparseable")
    assert "no number" in out[5]["reason"] and out[5]["cells_run"] == 0
    assert code == 1  # the broken row failed: reported, not scored
    failures = [orjson.loads(line) for line in (tmp_path / "output_failures.jsonl").read_text().splitlines()]
    assert len(failures) == 1 and failures[0]["_ng_task_index"] == 6
    assert (failures[0]["path"], failures[0]["status"]) == ("/seed_session", 422)
    assert "data_folder" in failures[0]["error"]


def test_rows_missing_fields_are_refused_before_any_rollout(helper: RunHelper, tmp_path: Path) -> None:
    base = server_url(helper, ENV)
    missing = {k: v for k, v in ROWS[0].items() if k != "ideal"}
    resp = post_json(base + "/seed_session", missing)
    assert resp.status_code == 422 and "ideal" in resp.text
    no_tolerance = {k: v for k, v in ROWS[0].items() if k != "tolerance"}
    resp = post_json(base + "/seed_session", no_tolerance)
    assert resp.status_code == 422 and "tolerance" in resp.text
    # ng_collect_rollouts checks rows against the server's row schema before it sends anything.
    code, out, err = collect_rollouts(helper, [ROWS[0], missing], tmp_path, AGENT)
    assert code != 0 and out == [] and "ideal" in err, err[-2000:]


def test_a_cell_that_kills_its_own_kernel_is_the_models_zero(helper: RunHelper) -> None:
    """The model's cell kills its kernel (SIGKILL to its own process) before it answers: the model
    caused it, so the rollout is scored 0 with the reason, never an infrastructure error (503). So is
    a kernel that a timer of an earlier cell killed after that cell returned (the next cell finds it
    dead): once the model's code has run in a kernel, its death may be the model's doing."""
    rows = [
        _tagged(BY_CAPSULE["anova_diets"], "crash anova_diets"),
        _tagged(BY_CAPSULE["paired_ldl"], "late crash paired_ldl"),
    ]
    with ThreadPoolExecutor(2) as pool:
        answers = list(
            pool.map(lambda row: post_json(server_url(helper, AGENT) + "/run", row, timeout=180), rows)
        )
    results = []
    for resp in answers:
        assert resp.status_code == 200, resp.text[:2000]
        results.append(resp.json())
        assert (results[-1]["reward"], results[-1]["failure_reason"]) == (0.0, "kernel_died")
        assert results[-1]["answer_parse_status"] == "no_answer" and results[-1]["submitted_answer"] is None
        assert "the model's code killed or crashed it" in results[-1]["reason"]
    crash, late = results
    assert "kernel died while the model's cell ran" in crash["reason"] and crash["cells_run"] == 1
    assert "kernel died after the model's earlier cells ran" in late["reason"] and late["cells_run"] == 2


def test_a_cell_that_fills_the_work_dir_and_ignores_the_interrupt_is_the_models_zero(
    helper: RunHelper,
) -> None:
    """The kernel's work dir has a disk quota (``kernel_limits.work_dir_quota_mib``, 16 MiB here): a cell
    past it is interrupted; this one ignores SIGINT and keeps writing, so its kernel is killed, which is
    the model's doing: 0, ``kernel_died``, the reason names the quota. Before: nothing bounded the dir's
    total, the cell wrote its 200 MiB ("wrote all") and the right answer after it earned 1 (a cell that
    writes until its time bound fills the host's disk)."""
    resp = post_json(
        server_url(helper, AGENT) + "/run", _tagged(BY_CAPSULE["ttest_pvalue"], "disk"), timeout=180
    )
    assert resp.status_code == 200, resp.text[:2000]
    result = resp.json()
    assert (result["reward"], result["failure_reason"]) == (0.0, "kernel_died"), result["reason"]
    assert "disk quota" in result["reason"] and "did not stop when interrupted" in result["reason"]
    assert result["submitted_answer"] is None and result["cells_run"] == 1


def test_a_turn_of_several_answers_counts_only_the_first(helper: RunHelper) -> None:
    """Aviary runs every call of a model turn. Once one has ended the episode, the later calls are not
    run: every option's letter in one turn is the first letter's verdict, a right answer twice is 1 (not
    2), a sweep of numbers is its first number's verdict, and an answer after a cell that killed the
    kernel is not taken (the kernel's death is the model's 0)."""
    cases = {
        "every letter": (BY_CAPSULE["confounder_choice"], 0.0, "wrong_answer"),
        "right twice": (BY_CAPSULE["ttest_pvalue"], 1.0, "pass"),
        "a sweep": (BY_CAPSULE["ttest_pvalue"], 0.0, "wrong_answer"),
        "kill and answer": (BY_CAPSULE["confounder_choice"], 0.0, "kernel_died"),
    }
    rows = [_tagged(row, tag) for tag, (row, _, _) in cases.items()]
    with ThreadPoolExecutor(len(rows)) as pool:
        answers = list(
            pool.map(lambda row: post_json(server_url(helper, AGENT) + "/run", row, timeout=180), rows)
        )
    for (tag, (_, reward, reason)), resp in zip(cases.items(), answers, strict=True):
        assert resp.status_code == 200, (tag, resp.text[:1000])
        result = resp.json()
        assert (result["reward"], result["failure_reason"]) == (reward, reason), (tag, result["reason"])
        outputs = [
            o["output"] for o in result["response"]["output"] if o.get("type") == "function_call_output"
        ]
        assert outputs[1:] and all("episode has already ended" in o for o in outputs[1:]), (tag, outputs)
        if reason != "kernel_died":
            assert result["submitted_answer"] is not None and result["answer_parse_status"] == "parsed"
    mcq = BY_CAPSULE["confounder_choice"]
    first_wrong = next(c for c in "ABCDEFGHIJ" if c != _answer_text(mcq))
    assert answers[0].json()["submitted_answer"] == first_wrong  # the first letter, not the right one (last)


def _kernel_processes(helper: RunHelper) -> set[int]:
    """Pids of the capsule server's kernel processes (bubblewrap and the ipykernel in it)."""
    server_pid = next(r["pid"] for r in helper.server_instances() if r["name"] == ENV)
    return {
        p.pid
        for p in psutil.Process(server_pid).children(recursive=True)
        if "ipykernel" in " ".join(p.cmdline())
    }


def test_a_kernel_that_dies_before_any_model_code_ran_is_an_infrastructure_error(helper: RunHelper) -> None:
    """A kernel killed from outside before the model's first cell (the model cannot have caused it): the
    cell finds it dead, and /verify answers 503 (not scored), never a 0."""
    base, row = server_url(helper, ENV), ROWS[0]
    before = _kernel_processes(helper)
    seeded = post_json(base + "/seed_session", row)
    assert seeded.status_code == 200, seeded.text[:500]
    env_id, cookies = seeded.json()["env_id"], dict(seeded.cookies)
    try:
        kernel = _kernel_processes(helper) - before
        assert kernel, "the seeded env's kernel process was not found"
        for pid in kernel:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        psutil.wait_procs([psutil.Process(pid) for pid in kernel if psutil.pid_exists(pid)], timeout=30)
        call = {
            "type": "function_call",
            "call_id": "c1",
            "name": "edit_cell",
            "arguments": '{"contents": "1"}',
        }
        step = post_json(base + "/step", {"env_id": env_id, "action": [call]}, cookies=cookies, timeout=120)
        assert step.status_code == 200 and "before any of the model's code ran" in step.text, step.text[:500]
        verify = {**row, "response": {"env_id": env_id, "group_id": "0", "output": []}}
        resp = post_json(base + "/verify", verify, cookies=cookies)
        assert resp.status_code == 503, resp.text[:500]
        assert "not scored" in resp.text and "before any of the model's code ran" in resp.text
    finally:
        post_json(base + "/close", {"env_id": env_id}, cookies=cookies)


def test_the_dry_run_config_plays_the_right_trajectory_on_each_example_row() -> None:
    import yaml

    path = Path("responses_api_models/scripted_model/configs/scripted_model_data_analysis_capsules.yaml")
    if not path.is_file():
        from nemo_gym.config.keys import PACKAGE_PARENT_DIR

        path = PACKAGE_PARENT_DIR / path
    rules = yaml.safe_load(path.read_text())["policy_model"]["responses_api_models"]["scripted_model"]
    right = {r["contains"]: r["turns"] for r in _scripts() if not r["contains"].startswith("[")}
    assert len(rules["scripts_by_input"]) == len(ROWS) == 5
    for rule, row in zip(rules["scripts_by_input"], ROWS, strict=True):
        assert rule["contains"] == row["question"] and rule["turns"] == right[rule["contains"]]
