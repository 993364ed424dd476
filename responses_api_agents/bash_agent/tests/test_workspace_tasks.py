"""bash_agent on resources_servers/workspace_tasks, end to end (real sandboxes, hidden tests): the same
fixes score the same whether simple_agent makes them with tool calls or bash_agent with commands in
bash blocks. Right = 1, doing nothing = 0, a partial fix = 0 with the same ``tests_passed``.

One run of ng's servers: workspace_tasks with its simple_agent, responses_api_agents/bash_agent/configs/
workspace_tasks_bash_agent.yaml, and the scripted model playing, per tagged row, either agent's turns.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from nemo_gym.config.keys import PACKAGE_PARENT_DIR
from nemo_gym.run.cli import RunHelper
from nemo_gym.tools.testing import run_rollout, running_servers, tagged_row, variant_rules
from resources_servers.workspace_tasks.scripts.generate_dataset import example_rows
from resources_servers.workspace_tasks.scripts.generate_dataset import rows as generated_rows
from resources_servers.workspace_tasks.tasks import TASKS_BY_ID, Task

ENV = "workspace_tasks"
CONFIGS = [
    f"resources_servers/{ENV}/configs/{ENV}.yaml",
    "responses_api_agents/bash_agent/configs/workspace_tasks_bash_agent.yaml",
]
BASH_AGENT, SIMPLE_AGENT = f"{ENV}_bash_agent", f"{ENV}_simple_agent"
MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
FENCE = "```"
ROWS = generated_rows(0)
INDEX = {row["task_id"]: i for i, row in enumerate(ROWS)}
# A Python fix (with a partial fix: 3 of its 4 hidden tests) and a git merge conflict.
TASK_IDS = ("pyfix_median", "git_discount")
PARTIAL_OLD = "    return ordered[len(ordered) // 2]"
PARTIAL_NEW = (
    "    mid = len(ordered) // 2\n"
    "    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2"
)


def say(command: str) -> dict[str, Any]:
    """bash_agent's model turn: a thought and one bash block."""
    return {"text": f"Next step.\n\n{FENCE}bash\n{command}\n{FENCE}"}


def tool(name: str, **arguments: Any) -> dict[str, Any]:
    """simple_agent's model turn: one tool call."""
    return {"tool_calls": [{"name": name, "arguments": arguments}]}


def as_command(step: tuple[str, ...]) -> str:
    """A reference-solution step as one shell command: a ``write`` becomes printf of the exact text."""
    if step[0] == "bash":
        return step[1]
    _, path, content = step
    return f"mkdir -p \"$(dirname {shlex.quote(path)})\" && printf '%s' {shlex.quote(content)} > {shlex.quote(path)}"


def as_tool_call(step: tuple[str, ...]) -> dict[str, Any]:
    if step[0] == "bash":
        return tool("bash", command=step[1])
    return tool("str_replace_based_edit_tool", command="create", path=step[1], file_text=step[2])


def _variants(row: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    task: Task = TASKS_BY_ID[row["task_id"]]
    submit, done = say(f"echo {MARKER}"), {"text": "Done."}
    variants = {
        "bash-right": [*(say(as_command(s)) for s in task.solution), submit],
        "tools-right": [*(as_tool_call(s) for s in task.solution), done],
        "bash-nothing": [say("ls -la"), submit],
        "tools-nothing": [tool("bash", command="ls -la"), done],
    }
    if task.task_id == "pyfix_median":  # even lengths fixed, the empty list forgotten
        replace = (
            "python3 - <<'EOF'\nimport pathlib\np = pathlib.Path('stats/median.py')\n"
            f"p.write_text(p.read_text().replace({PARTIAL_OLD!r}, {PARTIAL_NEW!r}))\nEOF"
        )
        variants["bash-partial"] = [say(replace), submit]
        variants["tools-partial"] = [
            tool(
                "str_replace_based_edit_tool",
                command="str_replace",
                path="stats/median.py",
                old_str=PARTIAL_OLD,
                new_str=PARTIAL_NEW,
            ),
            done,
        ]
    return variants


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    rows = [ROWS[INDEX[t]] for t in TASK_IDS]
    rules = variant_rules(rows, _variants)
    extra = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": rules}}}}
    with running_servers(CONFIGS, extra) as h:
        yield h


def rollout(helper: RunHelper, task_id: str, variant: str) -> dict[str, Any]:
    index = TASK_IDS.index(task_id)
    agent = BASH_AGENT if variant.startswith("bash-") else SIMPLE_AGENT
    return run_rollout(helper, agent, tagged_row(ROWS[INDEX[task_id]], variant, index), timeout=180)


@pytest.mark.parametrize(
    ("task_id", "fix", "reward", "tests_passed"),
    [
        ("pyfix_median", "right", 1.0, 1.0),
        ("pyfix_median", "partial", 0.0, 0.75),
        ("pyfix_median", "nothing", 0.0, None),
        ("git_discount", "right", 1.0, 1.0),
        ("git_discount", "nothing", 0.0, None),
    ],
)
def test_the_same_fix_scores_the_same_with_commands_and_with_tool_calls(
    helper: RunHelper, task_id: str, fix: str, reward: float, tests_passed: float | None
) -> None:
    by_bash = rollout(helper, task_id, f"bash-{fix}")
    by_tools = rollout(helper, task_id, f"tools-{fix}")
    assert by_bash["reward"] == by_tools["reward"] == reward, (
        by_bash["failed_tests"],
        by_tools["failed_tests"],
    )
    assert by_bash["tests_passed"] == by_tools["tests_passed"]
    assert by_bash["failed_tests"].keys() == by_tools["failed_tests"].keys()
    if tests_passed is not None:
        assert by_bash["tests_passed"] == tests_passed
    else:
        assert by_bash["tests_passed"] < 1.0
    steps = len(TASKS_BY_ID[task_id].solution) + 1 if fix == "right" else 2
    assert (by_bash["stop_reason"], by_bash["num_steps"], by_bash["num_format_errors"]) == (
        "submitted",
        steps,
        0,
    )
    # The server counts what ran, whichever agent drove it: every step was one command here.
    assert by_bash["commands_run"] == by_bash["num_steps"] and by_bash["edits_made"] == 0
    # Every command ran and exited 0: each observation before the submission says so.
    observations = [
        item["content"]
        for item in by_bash["response"]["output"]
        if item.get("type") == "message" and item.get("role") == "user"
    ]
    assert len(observations) == steps - 1
    assert all(o.startswith("<returncode>0</returncode>") for o in observations), observations


def test_the_dry_run_config_writes_each_example_rows_reference_solution_by_commands() -> None:
    """The README's dry run (no model) plays the same turns as the bash-right trajectories scored 1 above."""
    path = PACKAGE_PARENT_DIR / (
        "responses_api_models/scripted_model/configs/scripted_model_workspace_tasks_bash_agent.yaml"
    )
    rules = yaml.safe_load(path.read_text())["policy_model"]["responses_api_models"]["scripted_model"]
    examples = [row["task_id"] for row in example_rows()]
    assert len(rules["scripts_by_input"]) == len(examples) == 5
    for rule, task_id in zip(rules["scripts_by_input"], examples, strict=True):
        task = TASKS_BY_ID[task_id]
        assert rule["contains"] == task.prompt, task_id
        assert rule["turns"] == [*(say(as_command(s)) for s in task.solution), say(f"echo {MARKER}")], task_id
