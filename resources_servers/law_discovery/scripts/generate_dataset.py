"""Write law_discovery task rows: every law of ``laws.TEMPLATES`` with constants drawn from ``--seed``.

    python resources_servers/law_discovery/scripts/generate_dataset.py --seed 7 --out tasks.jsonl
    python resources_servers/law_discovery/scripts/generate_dataset.py --example   # data/example.jsonl

Each seed gives new constants (and new measurement noise), so a dataset of many seeds cannot be
answered from memory. Rows are checked as they are written: the law parses, and it is a finite,
positive number at the corners and the middle of its input ranges.
"""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # the repository root: run as a plain script

from nemo_gym.kit.dataset_cli import generator_main  # noqa: E402
from resources_servers.law_discovery.expressions import evaluate, parse_law  # noqa: E402
from resources_servers.law_discovery.laws import TEMPLATES, LawTemplate, instantiate  # noqa: E402

EXAMPLE_TASKS = (
    "gravitation_force",
    "optics_dispersion",
    "oscillation_pendulum",
    "kinetics_rate",
    "fluids_drag",
)
EXAMPLE_SEED = 2026
MAX_EXPERIMENTS = 40

SYSTEM = (
    "You are a physicist in a lab whose laws may differ from the textbook. Find the law that gives the "
    "measured quantity from the variables you control. Use run_experiment to take measurements (each has "
    "the noise of the apparatus; inputs must stay inside the given ranges), fit_check to see how well a "
    "candidate law matches your measurements (root mean squared log error), and submit_law once with your "
    "final law: an expression in the variables with fitted numeric constants, in Python syntax "
    "(+ - * / **, exp, log, sqrt, sin, cos), for example 0.5*x**2/y. Do not write the name of the measured "
    "quantity or an equals sign."
)


def _tools(template: LawTemplate) -> list[dict[str, Any]]:
    inputs = {
        "type": "object",
        "properties": {
            v.name: {"type": "number", "description": f"{v.meaning} in {v.unit}, {v.low} to {v.high}"}
            for v in template.variables
        },
        "required": [v.name for v in template.variables],
        "additionalProperties": False,
    }
    expression = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "The law, e.g. 0.5*x**2/y"}},
        "required": ["expression"],
        "additionalProperties": False,
    }
    return [
        {
            "type": "function",
            "name": "run_experiment",
            "description": f"Measure {template.target_meaning} ({template.target}) at the given inputs.",
            "parameters": {
                "type": "object",
                "properties": {"inputs": inputs},
                "required": ["inputs"],
                "additionalProperties": False,
            },
            "strict": True,
        },
        {
            "type": "function",
            "name": "fit_check",
            "description": "How well a candidate law fits your measurements so far (RMSLE; 0 is perfect).",
            "parameters": expression,
            "strict": True,
        },
        {
            "type": "function",
            "name": "submit_law",
            "description": f"Submit your final law for {template.target}.",
            "parameters": expression,
            "strict": True,
        },
    ]


def _prompt(template: LawTemplate) -> str:
    lines = [
        f"System: {template.system}.",
        f"Measured quantity: {template.target} = {template.target_meaning}, in {template.target_unit}.",
        "Variables you control:",
        *(f"- {v.name}: {v.meaning}, {v.low} to {v.high} {v.unit}" for v in template.variables),
        f"You have at most {MAX_EXPERIMENTS} experiments. Find the law for {template.target} and submit it.",
    ]
    return "\n".join(lines)


def _check(template: LawTemplate, expression: str) -> None:
    law = parse_law(expression, [v.name for v in template.variables], template.target)
    ranges = [(v.low, (v.low + v.high) / 2, v.high) for v in template.variables]
    for values in itertools.product(*ranges):
        point = {v.name: x for v, x in zip(template.variables, values, strict=True)}
        value = evaluate(law, point)
        if not value > 0:
            raise ValueError(f"{template.task_id}: {expression} is {value} at {point}")


def row(template: LawTemplate, rng: random.Random) -> dict[str, Any]:
    expression, _ = instantiate(template, rng)
    _check(template, expression)
    return {
        "task_id": template.task_id,
        "domain": template.domain,
        "law": {
            "target": template.target,
            "expression": expression,
            "variables": {v.name: {"low": v.low, "high": v.high, "unit": v.unit} for v in template.variables},
            "noise": template.noise,
            "seed": rng.randrange(2**31),
        },
        "max_experiments": MAX_EXPERIMENTS,
        "responses_create_params": {
            "input": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _prompt(template)}],
            "tools": _tools(template),
        },
    }


def rows(seed: int, task_ids: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    chosen = [t for t in TEMPLATES if task_ids is None or t.task_id in task_ids]
    return [row(t, rng) for t in chosen]


def main() -> None:
    generator_main(
        __doc__.split("\n\n")[0],
        rows,
        lambda: rows(EXAMPLE_SEED, EXAMPLE_TASKS),
        HERE.parent / "data" / "example.jsonl",
    )


if __name__ == "__main__":
    main()
