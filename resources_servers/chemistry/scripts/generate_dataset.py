"""Write chemistry task rows from the team-written pool (``tasks.py``), checked with rdkit.

    python resources_servers/chemistry/scripts/generate_dataset.py --seed 7 --out tasks.jsonl
    python resources_servers/chemistry/scripts/generate_dataset.py --example   # data/example.jsonl

Every item of the pool becomes one row. The seed shuffles the options of the multiple-choice questions
(so a letter cannot be remembered); the answer letter is computed by rdkit. Each row is checked as it
is written: every reference parses and the row's own reference answer solves it (``chem.check_task``).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # the repository root: run as a plain script

from nemo_gym.kit.dataset_cli import generator_main  # noqa: E402
from resources_servers.chemistry import tasks  # noqa: E402
from resources_servers.chemistry.chem import DESCRIPTOR_MEANING, check_task, extreme_option  # noqa: E402

EXAMPLE_TASKS = (
    "reaction_product_00",
    "name_to_smiles_14",
    "formula_design_04",
    "logp_edit_00",
    "property_mcq_00",
)
EXAMPLE_SEED = 2026
# The rows ng_reward_audit plays (exploits.yaml, data/audit.jsonl = rows(EXAMPLE_SEED, AUDIT_TASKS)): every
# fragment template, and the formula and logP rows whose exploits need them.
AUDIT_TASKS = (
    *(f"fragment_completion_{i:02d}" for i in range(len(tasks.FRAGMENTS))),
    "formula_design_00",
    "formula_design_04",
    "logp_edit_00",
    "logp_edit_06",
)
LETTERS = "ABCD"

SYSTEM = (
    "You are an expert chemist. Think briefly, then end your reply with your final answer inside "
    "<answer></answer> tags: one SMILES string when the question asks for a molecule, or one letter when "
    "it asks you to choose. Give one answer: different answers in several <answer> tags score 0; write "
    "nothing else inside the tags."
)
ASK_SMILES = "End your reply with the molecule's SMILES inside <answer></answer> tags."
ASK_LETTER = "End your reply with the letter inside <answer></answer> tags."


def _bounds(constraints: dict[str, dict[str, float]]) -> str:
    parts = []
    for name, b in constraints.items():
        meaning = DESCRIPTOR_MEANING[name]
        if "min" in b and "max" in b:
            parts.append(f"{meaning} between {b['min']:g} and {b['max']:g}")
        elif "min" in b:
            parts.append(f"{meaning} at least {b['min']:g}")
        else:
            parts.append(f"{meaning} at most {b['max']:g}")
    return " and ".join(parts)


def _task(kind: str, item: Any, rng: random.Random) -> tuple[dict[str, Any], str]:
    """(the row's ``task``, the question the model reads)."""
    if kind == "fragment_completion":
        fragment, constraints, reference = item
        task = {"fragment": fragment, "constraints": constraints, "reference_answer": reference}
        return task, (
            f"Complete the fragment {fragment}: write any valid molecule that contains it as a substructure "
            f"and has {_bounds(constraints)} (as computed by rdkit)."
        )
    if kind == "formula_design":
        formula, names, reference = item
        groups = {name: tasks.GROUPS[name] for name in names}
        wanted = "; ".join(f"{name} (SMARTS {smarts})" for name, smarts in groups.items())
        task = {"formula": formula, "groups": groups, "reference_answer": reference}
        return task, f"Design a molecule with the molecular formula {formula} that contains: {wanted}."
    if kind == "reaction_product":
        family, reactants, conditions, product = item
        task = {"reactants": list(reactants), "conditions": conditions, "product": product}
        return task, (
            f"Predict the main organic product ({family}). Reactants: {' + '.join(reactants)}. "
            f"Conditions: {conditions}. Give the product only, as SMILES (stereochemistry is not asked)."
        )
    if kind == "name_to_smiles":
        name, smiles = item
        return {"name": name, "smiles": smiles}, f"Write the SMILES of {name}."
    if kind == "logp_edit":
        start, direction, change, sim, reference = item
        task = {
            "smiles": start,
            "direction": direction,
            "min_change": change,
            "min_similarity": sim,
            "reference_answer": reference,
        }
        verb = "raise" if direction == "up" else "lower"
        return task, (
            f"Edit the molecule {start} to {verb} its computed logP (rdkit Crippen) by at least {change:g}, "
            f"keeping it similar: the Tanimoto similarity of Morgan fingerprints (radius 2, 2048 bits) to "
            f"{start} must be at least {sim:g}. Give the edited molecule."
        )
    if kind == "property_mcq":
        prop, extreme, molecules = item
        shuffled = list(molecules)
        rng.shuffle(shuffled)
        options = dict(zip(LETTERS, shuffled, strict=True))
        task = {"property": prop, "extreme": extreme, "options": options}
        task["answer"], _ = extreme_option(task)
        word = "highest" if extreme == "max" else "lowest"
        listing = "\n".join(f"{letter}) {smiles}" for letter, smiles in options.items())
        return task, (
            f"Which molecule has the {word} {DESCRIPTOR_MEANING[prop]} (as computed by rdkit)?\n{listing}"
        )
    raise ValueError(f"unknown task type {kind!r}")


def rows(seed: int, task_ids: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out, counts = [], {}
    for kind, item in tasks.items():
        index = counts[kind] = counts.get(kind, -1) + 1
        task, question = _task(kind, item, rng)
        task = {"task_type": kind, **task}
        problem = check_task(task)
        if problem:
            raise ValueError(f"{kind} {index}: {problem}")
        task_id = f"{kind}_{index:02d}"
        if task_ids is not None and task_id not in task_ids:
            continue
        out.append(
            {
                "task_id": task_id,
                "task": task,
                "responses_create_params": {
                    "input": [
                        {"role": "system", "content": SYSTEM},
                        {
                            "role": "user",
                            "content": f"{question}\n{ASK_LETTER if kind == 'property_mcq' else ASK_SMILES}",
                        },
                    ]
                },
            }
        )
    return out


def main() -> None:
    generator_main(
        __doc__.split("\n\n")[0],
        rows,
        lambda: rows(EXAMPLE_SEED, EXAMPLE_TASKS),
        HERE.parent / "data" / "example.jsonl",
    )


if __name__ == "__main__":
    main()
