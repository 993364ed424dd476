"""Write scientific_code task rows: every problem of ``problems.PROBLEMS`` with test inputs drawn from ``--seed``.

    python resources_servers/scientific_code/scripts/generate_dataset.py --seed 7 --out tasks.jsonl
    python resources_servers/scientific_code/scripts/generate_dataset.py --example   # data/example.jsonl

The targets are what this team's reference solutions (the functions written in ``problems.py``) return
on each test case, computed here, in this process: the references are ours, never a model's. A seed
changes the test inputs, so the targets of one seed cannot be reused for another. The rows carry the
targets; the model sees only ``responses_create_params`` and the step headers the agent shows it.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # the repository root: run as a plain script

from nemo_gym.kit.dataset_cli import generator_main  # noqa: E402
from resources_servers.scientific_code.problems import PROBLEMS, Case, Problem  # noqa: E402

EXAMPLE_PROBLEMS = (
    "lotka_volterra_rk4",
    "monte_carlo_estimates",
    "qr_least_squares",
    "kepler_newton",
    "numerical_quadrature",
)
EXAMPLE_SEED = 2026

SYSTEM = (
    "You are a scientist who writes careful numerical Python. A problem is solved as a sequence of "
    "steps; each step is one function. You are shown the problem, the code you wrote for the earlier "
    "steps, and the header of the next function (its signature and docstring). Answer with exactly one "
    "```python``` code block holding the complete function for that step, with the given header and "
    "return line. You may call the functions of earlier steps. The listed dependencies are already "
    "imported: do not import anything else, and do not print."
)


def _user_prompt(problem: Problem) -> str:
    return (
        f"PROBLEM: {problem.name}\n{problem.description}\n\n"
        f"DEPENDENCIES (already imported):\n{problem.dependencies}\n\n"
        f"The problem has {len(problem.steps)} steps; you will write them one at a time."
    )


def _json_value(value: Any) -> float | list[Any]:
    """A reference result as JSON: a number or nested lists of numbers (checked to be finite)."""
    array = np.asarray(value, dtype=float)
    if not np.all(np.isfinite(array)):
        raise ValueError(f"a reference result is not finite: {value!r}")
    return array.tolist()


def run_reference(problem: Problem, cases: list[list[Case]]) -> list[list[float | list[Any]]]:
    """The reference's value on every case of every step. Step k's cases run in a namespace holding the
    dependencies and the reference functions of steps 1..k (as the model's code will be tested)."""
    namespace: dict[str, Any] = {}
    exec(problem.dependencies, namespace)  # noqa: S102 - our own reference code, never a model's
    targets = []
    for step, step_cases in zip(problem.steps, cases, strict=True):
        exec(step.reference, namespace)  # noqa: S102
        values = []
        for case in step_cases:
            scope = dict(namespace)
            if case.setup:
                exec(case.setup, scope)  # noqa: S102
            values.append(_json_value(eval(case.call, scope)))  # noqa: S307
        targets.append(values)
    return targets


def row(problem: Problem, seed: int) -> dict[str, Any]:
    rng = random.Random(f"{seed}:{problem.problem_id}")
    cases = [step.cases(rng) for step in problem.steps]
    targets = run_reference(problem, cases)
    sub_steps = []
    for k, (step, step_cases, step_targets) in enumerate(zip(problem.steps, cases, targets, strict=True), 1):
        sub_steps.append(
            {
                "step_number": f"{problem.problem_id}.{k}",
                "step_description_prompt": step.description,
                "function_header": step.header,
                "return_line": step.return_line,
                "test_cases": [
                    {"setup": c.setup, "call": c.call, "target": t, "rtol": c.rtol, "atol": c.atol}
                    for c, t in zip(step_cases, step_targets, strict=True)
                ],
            }
        )
    return {
        "problem_id": problem.problem_id,
        "problem_name": problem.name,
        "domain": problem.domain,
        "problem_description_main": problem.description,
        "required_dependencies": problem.dependencies,
        "sub_steps": sub_steps,
        "responses_create_params": {
            "input": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": _user_prompt(problem)},
            ]
        },
    }


def rows(seed: int, problem_ids: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    return [row(p, seed) for p in PROBLEMS if problem_ids is None or p.problem_id in problem_ids]


def main() -> None:
    generator_main(
        __doc__.split("\n\n")[0],
        rows,
        lambda: rows(EXAMPLE_SEED, EXAMPLE_PROBLEMS),
        HERE.parent / "data" / "example.jsonl",
    )


if __name__ == "__main__":
    main()
