"""chemistry against real servers: every task type right, wrong and malformed; broken rows; the pool.

One set of servers serves the module. The scripted model picks an answer by a tag appended to the
row's user message (``[variant=... row=...]``); the untagged rows get the right answer.
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
    text_response,
    variant_rules,
    variant_tag,
)
from resources_servers.chemistry import tasks
from resources_servers.chemistry.app import TASK_TYPES, extract_answers, metrics_by_type
from resources_servers.chemistry.chem import MAX_ANSWER_CHARS, check_task, judge
from resources_servers.chemistry.scripts.generate_dataset import AUDIT_TASKS, EXAMPLE_SEED, EXAMPLE_TASKS
from resources_servers.chemistry.scripts.generate_dataset import rows as generated_rows

ENV = "chemistry"
CONFIG = f"resources_servers/{ENV}/configs/{ENV}.yaml"
AGENT = f"{ENV}_simple_agent"
EXAMPLES = example_rows(ENV)
ALL = generated_rows(EXAMPLE_SEED)
# The example rows, plus the first row of every task type they lack: all six types end to end.
ROWS = EXAMPLES + [
    next(r for r in ALL if r["task"]["task_type"] == kind)
    for kind in TASK_TYPES
    if kind not in {r["task"]["task_type"] for r in EXAMPLES}
]


def right_answer(row: dict[str, Any]) -> str:
    task = row["task"]
    return {"reaction_product": task.get("product"), "name_to_smiles": task.get("smiles")}.get(
        task["task_type"], task.get("answer") or task.get("reference_answer")
    )


def wrong_answer(row: dict[str, Any]) -> str:
    """A valid answer that does not solve the row."""
    task = row["task"]
    kind = task["task_type"]
    if kind == "property_mcq":
        return next(letter for letter in task["options"] if letter != task["answer"])
    if kind == "reaction_product":
        return task["reactants"][0]
    if kind == "logp_edit":
        return task["smiles"]
    return "CCCCCCCCCCCCCCCCCCCC"  # icosane: no fragment, wrong formula, not a named molecule here


def _say(answer: str) -> dict[str, str]:
    return {"text": f"Reasoning about it briefly.\n<answer>{answer}</answer>"}


def _variants(row: dict[str, Any]) -> dict[str, list[dict[str, str]]]:
    mcq = row["task"]["task_type"] == "property_mcq"
    return {
        "wrong": [_say(wrong_answer(row))],
        "malformed": [_say("E" if mcq else "C1CC(=O")],
        "valence": [_say("C(C)(C)(C)(C)C")],
        "no_answer": [{"text": f"It is {right_answer(row)}, I think."}],
        "fenced_last": [
            {
                "text": f"<answer>{wrong_answer(row)}</answer> no, rather <ANSWER> `{right_answer(row)}` </ANSWER>"
            }
        ],
        "said_twice": [
            {
                "text": f"<answer></answer> then <answer>{right_answer(row)}</answer>, "
                f"<ANSWER> `{right_answer(row)}` </ANSWER>"
            }
        ],
    }


def _scripts() -> list[dict[str, Any]]:
    rules = variant_rules(ROWS, _variants)
    rules += [
        {"contains": variant_tag("say", i) + f" {answer}]", "turns": [_say(answer)]}
        for i, answer in _EXTRA_ANSWERS
    ]
    rules += [
        {
            "contains": row["responses_create_params"]["input"][-1]["content"],
            "turns": [_say(right_answer(row))],
        }
        for row in ROWS
    ]
    return rules


def _index(kind: str) -> int:
    return next(i for i, r in enumerate(ROWS) if r["task"]["task_type"] == kind)


# Specific answers per task type: (row index, answer) -> expected failure_reason.
_SPECIFIC = {
    # fragment O=Cc1ccccc1 with 10..14 heavy atoms: acetophenone has 9; benzaldehyde is the fragment itself
    (_index("fragment_completion"), "CC(=O)c1ccccc1"): "constraint_failed",
    (_index("fragment_completion"), "O=Cc1ccccc1"): "unchanged",
    (_index("fragment_completion"), "CC(=O)c1ccc(CC)cc1"): "pass",
    # formula C7H6O2 with an acid and a benzene ring: phenyl formate has the formula, not the acid
    (_index("formula_design"), "O=COc1ccccc1"): "missing_group",
    (_index("formula_design"), "OC(=O)c1ccccc1C"): "wrong_formula",
    # esterification: written another way, still ethyl acetate
    (_index("reaction_product"), "O=C(OCC)C"): "pass",
    (_index("reaction_product"), "CCOC(=O)CC"): "wrong_product",
    # logP up by 0.5 from benzoic acid: 4-methyl gains too little, a long chain is too dissimilar
    (_index("logp_edit"), "OC(=O)c1ccc(C)cc1"): "too_little_change",
    (_index("logp_edit"), "CCCCCCCCCCCCCCCCCCCC"): "too_dissimilar",
    (_index("logp_edit"), "OC(=O)c1ccc(Br)cc1"): "pass",
    # a letter written in parentheses is that letter
    (_index("property_mcq"), "(" + ROWS[_index("property_mcq")]["task"]["answer"] + ")"): "pass",
    # aspirin written from the other end
    (_index("name_to_smiles"), "OC(=O)c1ccccc1OC(C)=O"): "pass",
}
_EXTRA_ANSWERS = list(_SPECIFIC)


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    extra = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": _scripts()}}}}
    with running_servers([CONFIG], extra) as h:
        yield h


def _with_answer(index: int, answer: str) -> dict[str, Any]:
    out = copy.deepcopy(ROWS[index])
    out["responses_create_params"]["input"][-1]["content"] += f" {variant_tag('say', index)} {answer}]"
    return out


def test_the_example_rows_are_the_generators_and_the_pool_is_sound() -> None:
    assert len(EXAMPLES) == 5 and {r["task_id"] for r in EXAMPLES} == set(EXAMPLE_TASKS)
    assert generated_rows(EXAMPLE_SEED, EXAMPLE_TASKS) == EXAMPLES  # the shipped rows are reproducible
    audit = Path(__file__).resolve().parents[1] / "data" / "audit.jsonl"  # the rows exploits.yaml plays
    assert [orjson.loads(line) for line in audit.read_text().splitlines()] == generated_rows(
        EXAMPLE_SEED, AUDIT_TASKS
    )
    every = generated_rows(0)
    assert len(every) == tasks.pool_size() >= 40
    assert {r["task"]["task_type"] for r in every} == set(TASK_TYPES)
    assert generated_rows(0) == every and generated_rows(1) != every  # the seed shuffles the options
    for row in every:
        assert check_task(row["task"]) is None  # every reference parses and solves its own task
        if row["task"]["task_type"] != "property_mcq":  # the model never sees a reference answer
            assert right_answer(row) not in row["responses_create_params"]["input"][-1]["content"], row[
                "task_id"
            ]


def test_right_answers_score_one_on_every_task_type(helper: RunHelper) -> None:
    seen = set()
    for row in ROWS:
        result = run_rollout(helper, AGENT, row)
        kind = row["task"]["task_type"]
        assert result["reward"] == 1.0, (row["task_id"], result["failure_reason"], result["reason"])
        assert (result["failure_reason"], result["task_type"]) == ("pass", kind)
        assert result["valid_smiles"] is (None if kind == "property_mcq" else True)
        assert result["answer"] == right_answer(row)
        seen.add(kind)
    assert seen == set(TASK_TYPES)


def test_wrong_and_malformed_answers_score_zero_with_the_reason(helper: RunHelper) -> None:
    wrong_reason = {
        "fragment_completion": "missing_fragment",
        "formula_design": "wrong_formula",
        "reaction_product": "wrong_product",
        "name_to_smiles": "wrong_molecule",
        "logp_edit": "unchanged",
        "property_mcq": "wrong_choice",
    }
    for i, row in enumerate(ROWS):
        kind = row["task"]["task_type"]
        wrong = run_rollout(helper, AGENT, tagged_row(row, "wrong", i))
        assert (wrong["reward"], wrong["failure_reason"]) == (0.0, wrong_reason[kind]), row["task_id"]
        malformed = run_rollout(helper, AGENT, tagged_row(row, "malformed", i))
        if kind == "property_mcq":
            assert (malformed["reward"], malformed["failure_reason"]) == (0.0, "not_a_choice")
        else:
            assert (malformed["reward"], malformed["failure_reason"]) == (0.0, "invalid_smiles")
            assert malformed["valid_smiles"] is False and "C1CC(=O" in malformed["reason"]
            valence = run_rollout(helper, AGENT, tagged_row(row, "valence", i))
            assert (valence["reward"], valence["failure_reason"]) == (0.0, "invalid_smiles")
            assert "valence" in valence["reason"].lower()
        missing = run_rollout(helper, AGENT, tagged_row(row, "no_answer", i))
        assert (missing["reward"], missing["failure_reason"], missing["answer"]) == (0.0, "no_answer", None)
        # A wrong answer, then the right one: a hedge, no answer (it used to be the last that counted).
        hedge = run_rollout(helper, AGENT, tagged_row(row, "fenced_last", i))
        assert (hedge["reward"], hedge["failure_reason"], hedge["answer"]) == (0.0, "several_answers", None)
        assert (
            "different answers in <answer> tags" in hedge["reason"] and right_answer(row) in hedge["reason"]
        )
        # The same answer twice (fenced, another case) and an empty tag: one answer.
        twice = run_rollout(helper, AGENT, tagged_row(row, "said_twice", i))
        assert (twice["reward"], twice["answer"]) == (1.0, right_answer(row)), row["task_id"]


def test_each_check_tells_its_failures_apart(helper: RunHelper) -> None:
    for (index, answer), reason in _SPECIFIC.items():
        result = run_rollout(helper, AGENT, _with_answer(index, answer))
        assert result["failure_reason"] == reason, (ROWS[index]["task_id"], answer, result["reason"])
        assert result["reward"] == (1.0 if reason == "pass" else 0.0)
    logp = run_rollout(helper, AGENT, _with_answer(_index("logp_edit"), "OC(=O)c1ccc(Br)cc1"))
    assert logp["measured"]["logp_change"] >= 0.5 and logp["measured"]["similarity"] >= 0.3


BY_ID = {r["task_id"]: r for r in ALL}

# What a policy tries on the form of the answer (task, answer) -> (failure_reason, words of the reason).
# Before the one-molecule rule, every one of these scored 1.0 except the two marked (already 0, by another
# reason): a right fragment plus junk that keeps the bounds, the fragment itself, the start molecule plus a
# solvent or a chlorine atom, a formula split over two molecules, an ion and a radical.
_FORM_EXPLOITS: dict[tuple[str, str], tuple[str, str]] = {
    ("fragment_completion_00", "O=Cc1ccccc1.C1CC1"): ("mixture", "2 disconnected parts"),
    ("fragment_completion_01", "CC(=O)N.c1ccccc1"): ("mixture", "2 disconnected parts"),
    ("fragment_completion_02", "c1ccncc1.CO"): ("mixture", "2 disconnected parts"),
    ("fragment_completion_03", "C1CCNCC1.C1CC1"): ("mixture", "2 disconnected parts"),
    ("fragment_completion_04", "OC(=O).c1ccccc1"): ("mixture", "2 disconnected parts"),
    ("fragment_completion_05", "NS(=O)=O.CO"): ("mixture", "2 disconnected parts"),
    ("fragment_completion_06", "C#N.C1CC1"): ("mixture", "2 disconnected parts"),
    ("fragment_completion_07", "c1ccc2ccccc2c1.OCCO"): ("mixture", "2 disconnected parts"),
    ("fragment_completion_00", "O=Cc1ccccc1.[Na+].[Cl-]"): ("mixture", "3 disconnected parts"),
    ("fragment_completion_05", "NS(=O)=O"): ("unchanged", "itself: complete it"),
    ("fragment_completion_05", "[2H]NS(=O)=O"): ("unchanged", "itself: complete it"),
    ("fragment_completion_02", "[NH3+]c1ccncc1"): ("charged", "net charge +1"),
    ("fragment_completion_05", "[CH2]NS(=O)=O"): ("radical", "unpaired electron"),
    ("logp_edit_00", "OC(=O)c1ccccc1.CCCCCC"): ("mixture", "2 disconnected parts"),
    ("logp_edit_00", "OC(=O)c1ccccc1.[Cl]"): ("mixture", "2 disconnected parts"),
    ("logp_edit_01", "CCCCCCO.O"): ("mixture", "2 disconnected parts"),
    ("logp_edit_06", "CC(C)Cc1ccc(C(C)C(=O)[O-])cc1"): ("charged", "net charge -1"),
    ("formula_design_00", "OC=O.C=C"): ("mixture", "2 disconnected parts"),
    ("reaction_product_00", "CCOC(C)=O.O"): ("mixture", "2 disconnected parts"),  # was wrong_product
    ("name_to_smiles_00", "CCO.[Na+].[Cl-]"): ("mixture", "3 disconnected parts"),  # was wrong_molecule
}


def test_an_answer_is_one_connected_neutral_molecule_that_does_the_task(helper: RunHelper) -> None:
    url = server_url(helper, ENV) + "/verify"
    got = {}
    for (task_id, answer), _ in _FORM_EXPLOITS.items():
        body = {**BY_ID[task_id], "response": text_response(f"Done.\n<answer>{answer}</answer>")}
        resp = post_json(url, body)
        assert resp.status_code == 200, resp.text
        result = resp.json()
        got[task_id, answer] = (result["reward"], result["failure_reason"], result["reason"])
    assert {k: v[:2] for k, v in got.items()} == {k: (0.0, v[0]) for k, v in _FORM_EXPLOITS.items()}
    for key, (_, words) in _FORM_EXPLOITS.items():
        assert words in got[key][2], (key, got[key])
    # Every fragment template is covered, and a real completion of each still passes.
    fragments = [r for r in ALL if r["task"]["task_type"] == "fragment_completion"]
    assert {r["task_id"] for r in fragments} <= {k[0] for k in _FORM_EXPLOITS}
    for row in fragments:
        body = {**row, "response": text_response(f"<answer>{row['task']['reference_answer']}</answer>")}
        assert post_json(url, body).json()["failure_reason"] == "pass", row["task_id"]
    # nitrobenzene is charge-separated but neutral: still the right molecule
    nitro = {**BY_ID["name_to_smiles_19"], "response": text_response("<answer>[O-][N+](=O)c1ccccc1</answer>")}
    assert post_json(url, nitro).json()["failure_reason"] == "pass"


def test_a_huge_reply_or_an_answer_only_in_reasoning_scores_zero(helper: RunHelper) -> None:
    url = server_url(helper, ENV) + "/verify"
    row = BY_ID["name_to_smiles_00"]  # ethanol
    for text, reason, says in (
        # 3.2 MB of opening tags (under verify_max_model_chars): the old tag regex rescanned to the end of
        # the text for each one (over an hour on the event loop); now the text is read once.
        ("<answer>" * 400_000, "no_answer", "no <answer>"),
        # 3 MB of SMILES: refused unparsed; it went to the verify pool whole (a 503: the pipe's EAGAIN)
        ("<answer>" + "C" * 3_000_000 + "</answer>", "invalid_smiles", f"longer than {MAX_ANSWER_CHARS}"),
    ):
        resp = post_json(url, {**row, "response": text_response(text)})
        assert resp.status_code == 200, resp.text[:2000]
        result = resp.json()
        assert (result["reward"], result["failure_reason"]) == (0.0, reason)
        assert says in result["reason"]
    # The answer inside a reasoning item is not an answer: only the assistant's messages count.
    response = text_response("I have thought about it.")
    response["output"].insert(
        0,
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [{"type": "summary_text", "text": "<answer>CCO</answer>"}],
            "content": [{"type": "reasoning_text", "text": "<answer>CCO</answer>"}],
        },
    )
    result = post_json(url, {**row, "response": response}).json()
    assert (result["reward"], result["failure_reason"]) == (0.0, "no_answer")
    # Look-alike letters in the tag (Cyrillic a, e) are not the tag; several different answers are none.
    for text, reason in (
        ("<\u0430nswer>CCO</\u0430nswer>", "no_answer"),
        ("<answ\u0435r>CCO</answ\u0435r>", "no_answer"),
        ("<answer>CCN</answer> or rather <answer>CCO</answer>", "several_answers"),
        ("<answer>CCO</answer> or <answer>CCN</answer> or <answer>CO</answer> ...", "several_answers"),
        ("<answer>CCO.CCN</answer>", "mixture"),
    ):
        result = post_json(url, {**row, "response": text_response(text)}).json()
        assert (result["reward"], result["failure_reason"]) == (0.0, reason), text


def test_a_broken_row_is_refused_not_scored(helper: RunHelper, tmp_path: Path) -> None:
    url = server_url(helper, ENV)
    reaction = ROWS[_index("reaction_product")]
    for field, value, says in (
        ("product", "C1CC", "task.product"),
        ("reactants", ["CC(=O)O", "C(C)(C)(C)(C)C"], "task.reactants[1]"),
    ):
        broken = copy.deepcopy(reaction)
        broken["task"][field] = value
        resp = post_json(url + "/verify", {**broken, "response": text_response("<answer>CCO</answer>")})
        assert resp.status_code == 422 and says in resp.text, resp.text
    formula = copy.deepcopy(ROWS[_index("formula_design")])
    formula["task"]["groups"]["carboxylic acid"] = "[CX3"
    for path in ("/seed_session", "/seed_session", "/verify"):  # remembered as broken, refused every time
        body = (
            formula
            if path == "/seed_session"
            else {**formula, "response": text_response("<answer>C</answer>")}
        )
        resp = post_json(url + path, body)
        assert resp.status_code == 422 and "task.groups.carboxylic acid" in resp.text, (path, resp.text)
    mcq = copy.deepcopy(ROWS[_index("property_mcq")])
    mcq["task"]["answer"] = next(k for k in mcq["task"]["options"] if k != mcq["task"]["answer"])
    resp = post_json(url + "/seed_session", mcq)
    assert resp.status_code == 422 and "task.answer" in resp.text
    unsolved = copy.deepcopy(ROWS[_index("logp_edit")])
    unsolved["task"]["min_change"] = 5.0
    resp = post_json(url + "/seed_session", unsolved)
    assert resp.status_code == 422 and "task.reference_answer does not solve its own task" in resp.text
    resp = post_json(url + "/seed_session", {"task": {"task_type": "name_to_smiles", "name": "x"}})
    assert resp.status_code == 422 and "smiles" in resp.text  # the row schema

    # Through ng_collect_rollouts: right, wrong and malformed rows scored; the broken row in the sidecar.
    broken = copy.deepcopy(reaction)
    broken["task"]["product"] = "C1CC"
    i = _index("reaction_product")
    rows = [reaction, tagged_row(reaction, "wrong", i), tagged_row(reaction, "malformed", i), broken]
    code, out, err = collect_rollouts(helper, rows, tmp_path, AGENT, "+max_attempts=1")
    assert [r["reward"] for r in out] == [1.0, 0.0, 0.0], err[-2000:]
    assert code == 1  # a row failed: reported by the exit status, not hidden in a reward
    failures = [orjson.loads(line) for line in (tmp_path / "output_failures.jsonl").read_text().splitlines()]
    assert len(failures) == 1 and failures[0]["_ng_task_index"] == 3
    assert (failures[0]["path"], failures[0]["status"]) == ("/seed_session", 422)
    assert "task.product" in failures[0]["error"]


def test_answer_extraction_and_the_checks_without_servers() -> None:
    assert extract_answers("no tag") is None and extract_answers("<answer>CCO") is None
    assert extract_answers("<answer>A</answer> then <Answer>\n `CCO`\n</Answer>") == ["A", "CCO"]
    assert extract_answers("<answer></answer>") == [""]
    assert extract_answers("<answer></answer> <answer> CCO</answer><ANSWER>`CCO`</ANSWER>") == ["CCO"]
    assert extract_answers("".join(f"<answer>C{i}</answer>" for i in range(9))) == ["C0", "C1", "C2"]
    name = next(r for r in ALL if r["task"].get("name") == "ethanol")["task"]
    assert judge(name, "OCC")["failure_reason"] == "pass"
    assert judge(name, None)["failure_reason"] == "no_answer"
    assert judge({**name, "smiles": "xyz"}, "CCO", row_checked=True) == {
        "bad_row": "task.smiles 'xyz' is not a molecule: not SMILES syntax"
    }  # a reference the pool parses anyway is still refused
    assert judge(name, "")["failure_reason"] == "invalid_smiles"
    assert judge(name, "C C O")["failure_reason"] == "invalid_smiles"
    huge = judge(name, "C" * (MAX_ANSWER_CHARS + 1))
    assert huge["failure_reason"] == "invalid_smiles" and "longer than" in huge["reason"]
    kekule = judge(name, "c1cccc1")
    assert kekule["failure_reason"] == "invalid_smiles" and "kekulize" in kekule["reason"].lower()
    assert judge({**name, "smiles": "xyz"}, "CCO") == {
        "bad_row": "task.smiles 'xyz' is not a molecule: not SMILES syntax"
    }


def test_aggregate_metrics_are_reported_per_task_type(helper: RunHelper) -> None:
    rollouts = [
        {
            "_ng_task_index": 0,
            "_ng_rollout_index": 0,
            "task_type": "logp_edit",
            "reward": 1.0,
            "valid_smiles": True,
        },
        {
            "_ng_task_index": 0,
            "_ng_rollout_index": 1,
            "task_type": "logp_edit",
            "reward": 0.0,
            "valid_smiles": False,
        },
        {
            "_ng_task_index": 1,
            "_ng_rollout_index": 0,
            "task_type": "property_mcq",
            "reward": 1.0,
            "valid_smiles": None,
        },
    ]
    expected = {
        "logp_edit/reward": 0.5,
        "logp_edit/rollouts": 2,
        "logp_edit/valid_smiles": 0.5,
        "property_mcq/reward": 1.0,
        "property_mcq/rollouts": 1,
    }
    assert metrics_by_type(rollouts) == expected
    resp = post_json(server_url(helper, ENV) + "/aggregate_metrics", {"verify_responses": rollouts})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert {k: body["agent_metrics"][k] for k in expected} == expected
    assert body["key_metrics"]["logp_edit/reward"] == 0.5 and "logp_edit/rollouts" not in body["key_metrics"]
