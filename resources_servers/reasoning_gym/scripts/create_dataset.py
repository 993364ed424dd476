"""Generate reasoning_gym task rows offline, in this environment's row format (no network).

usage: python resources_servers/reasoning_gym/scripts/create_dataset.py --tasks knights_knaves,basic_arithmetic \
           --size 100 --seed 42 --output resources_servers/reasoning_gym/data/train.jsonl
       [--config '{"n_people": 3}'] [--instruction TEXT | --no-instruction] [--list-tasks]

* ``--tasks``: comma-separated reasoning-gym task names (``--list-tasks`` prints all of them).
  ``--size`` rows per task; ``--seed`` makes the output reproducible (task i uses seed + i).
  ``--config``: a JSON object of generator options, applied to every task (e.g. difficulty).
* Each row: ``{"responses_create_params": {"input": [{"role": "user", "content": question + instruction}]},
  "question", "answer", "metadata"}``; ``metadata.source_dataset`` names the task (what ``/verify``
  scores with). Rows of several tasks are interleaved. The default instruction asks for the final
  answer inside ``<answer></answer>``; ``--no-instruction`` gives the bare question (as upstream's
  published rows).
* Exit status 2 on an unknown task or bad option, naming it.
"""

from __future__ import annotations

import argparse
import json
import sys
from itertools import zip_longest
from pathlib import Path
from typing import Any

DEFAULT_INSTRUCTION = (
    "\n\nGive only your final answer inside <answer></answer> tags, e.g. <answer>42</answer>."
)


def generate_rows(
    tasks: list[str], size: int, seed: int, config: dict[str, Any] | None = None, instruction: str = ""
) -> list[dict[str, Any]]:
    """``size`` rows per task, interleaved task by task; raises ValueError on an unknown task."""
    import reasoning_gym
    import reasoning_gym.factory

    unknown = [t for t in tasks if t not in reasoning_gym.factory.DATASETS]
    if unknown:
        raise ValueError(
            f"unknown reasoning_gym task(s) {unknown}; --list-tasks shows the {len(reasoning_gym.factory.DATASETS)} known"
        )
    per_task = []
    for i, task in enumerate(tasks):
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed + i, **(config or {}))
        per_task.append([(task, dataset[j]) for j in range(size)])
    rows = []
    for group in zip_longest(*per_task):
        for task, entry in (pair for pair in group if pair is not None):
            metadata = {**entry["metadata"], "source_dataset": entry["metadata"].get("source_dataset", task)}
            rows.append(
                {
                    "responses_create_params": {
                        "input": [{"role": "user", "content": entry["question"] + instruction}]
                    },
                    "question": entry["question"],
                    "answer": None if entry["answer"] is None else str(entry["answer"]),
                    "metadata": metadata,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", help="comma-separated task names")
    parser.add_argument("--size", type=int, default=100, help="rows per task")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--config", default=None, help="JSON object of generator options")
    parser.add_argument("--output", help="the JSONL file to write")
    parser.add_argument("--instruction", default=DEFAULT_INSTRUCTION)
    parser.add_argument("--no-instruction", action="store_true")
    parser.add_argument("--list-tasks", action="store_true")
    args = parser.parse_args(argv)
    if args.list_tasks:
        import reasoning_gym.factory

        print("\n".join(sorted(reasoning_gym.factory.DATASETS)))
        return
    if not args.tasks or not args.output or args.size < 1:
        parser.error("--tasks, --output and --size >= 1 are required")
    try:
        config = json.loads(args.config) if args.config else None
        if config is not None and not isinstance(config, dict):
            raise ValueError("--config must be a JSON object")
        rows = generate_rows(
            [t.strip() for t in args.tasks.split(",") if t.strip()],
            args.size,
            args.seed,
            config,
            "" if args.no_instruction else args.instruction,
        )
    except (ValueError, TypeError) as e:
        sys.stderr.write(f"create_dataset: {e}\n")
        sys.exit(2)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    tmp.replace(out)
    print(f"Wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
