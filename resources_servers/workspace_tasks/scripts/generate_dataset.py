"""Write workspace_tasks rows: every task of ``tasks.TASKS`` once, in an order drawn from ``--seed``.

    python resources_servers/workspace_tasks/scripts/generate_dataset.py --seed 7 --out tasks.jsonl
    python resources_servers/workspace_tasks/scripts/generate_dataset.py --example   # data/example.jsonl
    python resources_servers/workspace_tasks/scripts/generate_dataset.py --audit     # data/audit.jsonl

A row names its task; the workspace and the hidden tests stay on the server (``tasks.py``), which
builds every workspace when it starts. The prompt is the task's description plus how the tools work.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # the repository root: run as a plain script

from nemo_gym.kit.dataset_cli import generator_main  # noqa: E402
from resources_servers.workspace_tasks.tasks import TASKS, TASKS_BY_ID, Task  # noqa: E402

EXAMPLE_TASKS = ("pyfix_median", "cli_shout", "sh_unique_ips", "git_settings", "make_clean")

SYSTEM = (
    "You are a software engineer working in a Linux sandbox without network access. The task's files are "
    "in /workspace, the current directory of every command. Use the bash tool to run shell commands (each "
    "runs in a fresh shell; files persist, background processes do not) and str_replace_based_edit_tool "
    "to view, create and edit files under /workspace. Python 3, git, make and the usual Unix tools are "
    "installed. Work until the task is done, check your work, then reply with a one-line summary."
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "bash",
        "description": "Run a shell command (bash) in /workspace; returns its output and exit code.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The command to run"}},
            "required": ["command"],
            "additionalProperties": False,
        },
        "strict": True,
    },
    {
        "type": "function",
        "name": "str_replace_based_edit_tool",
        "description": (
            "View, create and edit files under /workspace. view: a file with line numbers (view_range "
            "[start, end], end -1 for the end) or a directory's listing; create: write file_text to path; "
            "str_replace: replace old_str (which must occur exactly once) by new_str; insert: insert new_str "
            "after line insert_line (0 for the top)."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert"]},
                "path": {
                    "type": "string",
                    "description": "Path relative to /workspace, or absolute under it",
                },
                "file_text": {"type": "string"},
                "old_str": {"type": "string"},
                "new_str": {"type": "string"},
                "insert_line": {"type": "integer"},
                "view_range": {"type": "array", "items": {"type": "integer"}},
            },
            "required": ["command", "path"],
            "additionalProperties": False,
        },
    },
]


def row(task: Task) -> dict[str, Any]:
    return {
        "task_id": task.task_id,
        "kind": task.kind,
        "responses_create_params": {
            "input": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.prompt}],
            "tools": TOOLS,
        },
    }


def rows(seed: int) -> list[dict[str, Any]]:
    order = list(TASKS)
    random.Random(seed).shuffle(order)
    return [row(t) for t in order]


def example_rows() -> list[dict[str, Any]]:
    return [row(TASKS_BY_ID[t]) for t in EXAMPLE_TASKS]


def audit_rows() -> list[dict[str, Any]]:
    """Every task once, in the order of ``tasks.TASKS`` (new tasks are appended, so a row's index stays):
    the rows ``exploits.yaml`` (ng_reward_audit) plays by index."""
    return [row(t) for t in TASKS]


def main() -> None:
    if sys.argv[1:] == ["--audit"]:
        out = HERE.parent / "data" / "audit.jsonl"
        written = audit_rows()
        out.write_text("".join(json.dumps(r) + "\n" for r in written))
        print(f"wrote {len(written)} rows to {out}")
        return
    generator_main(__doc__.split("\n\n")[0], rows, example_rows, HERE.parent / "data" / "example.jsonl")


if __name__ == "__main__":
    main()
