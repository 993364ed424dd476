"""The command line of an environment's seeded dataset generator (``scripts/generate_dataset.py``).

    python resources_servers/<env>/scripts/generate_dataset.py --seed 7 --out tasks.jsonl
    python resources_servers/<env>/scripts/generate_dataset.py --example   # rewrites data/example.jsonl

An environment supplies how to make its rows for a seed and its example rows; this module is the one
argument parser and JSONL writer they share.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Rows = list[dict[str, Any]]


def generator_main(
    description: str,
    rows_for_seed: Callable[[int], Rows],
    example_rows: Callable[[], Rows],
    example_path: Path,
    argv: Sequence[str] | None = None,
) -> None:
    """Parse ``--seed``/``--out``/``--example`` and write the rows as JSONL (parent dirs made)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--example", action="store_true", help=f"write {example_path.name} (the shipped example rows)"
    )
    args = parser.parse_args(argv)
    if args.example:
        out, written = example_path, example_rows()
    else:
        if args.out is None:
            parser.error("--out is required (or --example)")
        out, written = args.out, rows_for_seed(args.seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in written))
    print(f"wrote {len(written)} rows to {out}")
