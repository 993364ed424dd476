"""Write the data-analysis capsules of a seed: each capsule's CSV files and its task row.

    python resources_servers/data_analysis_capsules/scripts/generate_dataset.py --seed 0 --out resources_servers/data_analysis_capsules/data/capsules.jsonl
    python resources_servers/data_analysis_capsules/scripts/generate_dataset.py --example   # data/example.jsonl

The CSV files go to ``data/capsules/seed<N>/<capsule_id>/`` (the row's ``data_folder``). Every row's
answer (``ideal``) comes from the reference analysis of ``capsules.py`` on those files as written, and
the row keeps that analysis's evidence (``reference``) that the planted effect is there.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # the repository root: run as a plain script

import numpy as np  # noqa: E402

from nemo_gym.kit.dataset_cli import generator_main  # noqa: E402
from resources_servers.data_analysis_capsules.capsules import SPECS, csv_text, draw_capsule  # noqa: E402

DATA = HERE.parent / "data"
CAPSULES_DIR = DATA / "capsules"
SHIPPED_SEED = 0
EXAMPLE_CAPSULES = (
    "ttest_pvalue",
    "regression_slope",
    "survival_median",
    "confounder_choice",
    "chi_square_genotype",
)


def _plain(value: Any) -> Any:
    """``value`` with numpy scalars as Python numbers (JSON-ready)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def build(seed: int) -> list[tuple[dict[str, Any], dict[str, str]]]:
    """Every capsule of ``seed``: its row and its files (name -> CSV text). Pure: writes nothing."""
    out = []
    for task_idx, spec in enumerate(SPECS):
        frames, analysis, draw = draw_capsule(spec, seed)
        row: dict[str, Any] = {
            "task_idx": task_idx,
            "question_id": f"{spec.capsule_id}-q1",
            "capsule_id": spec.capsule_id,
            "category": spec.category,
            "data_folder": f"seed{seed}/{spec.capsule_id}",
            "hypothesis": spec.hypothesis,
            "question": spec.question,
            "eval_mode": spec.eval_mode,
            "ideal": analysis.ideal,
        }
        if spec.eval_mode == "range_verifier":
            row["tolerance"] = dict(spec.tolerance)
        else:
            options = list(spec.options)
            random.Random(f"{seed}:{spec.capsule_id}").shuffle(options)
            row["options"] = options
        row["reference"] = _plain({**analysis.reference, "draw": draw, "seed": seed})
        row["responses_create_params"] = {"input": []}
        out.append((row, {name: csv_text(frame) for name, frame in frames.items()}))
    return out


def rows(seed: int) -> list[dict[str, Any]]:
    """The rows of ``seed``, after writing each capsule's files under ``data/capsules/seed<seed>/``."""
    written = []
    for row, files in build(seed):
        folder = CAPSULES_DIR / row["data_folder"]
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (folder / name).write_text(text)
        written.append(row)
    return written


def example_rows() -> list[dict[str, Any]]:
    return [r for r in rows(SHIPPED_SEED) if r["capsule_id"] in EXAMPLE_CAPSULES]


def main() -> None:
    generator_main(__doc__.split("\n\n")[0], rows, example_rows, DATA / "example.jsonl")


if __name__ == "__main__":
    main()
