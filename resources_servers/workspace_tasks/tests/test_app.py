"""workspace_tasks against real servers (scripted model): right trajectories of every kind score 1, wrong
ones 0, the tools' errors are text the model reads, nothing leaves the workspace, the hidden tests stay
hidden, broken rows are refused; and every task's hidden tests fail on its untouched workspace and pass
after its reference solution (so each task is solvable and none passes by doing nothing).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from nemo_gym.cli import RunHelper
from nemo_gym.config.keys import PACKAGE_PARENT_DIR
from nemo_gym.kit.text import head_tail
from nemo_gym.sandbox import SandboxSession
from nemo_gym.tools.testing import (
    collect_rollouts,
    example_rows,
    post_json,
    run_rollout,
    running_servers,
    server_url,
    tagged_row,
    variant_rules,
)
from resources_servers.workspace_tasks.app import run_hidden_tests, workspace_path
from resources_servers.workspace_tasks.scripts.generate_dataset import EXAMPLE_TASKS
from resources_servers.workspace_tasks.scripts.generate_dataset import example_rows as generated_examples
from resources_servers.workspace_tasks.scripts.generate_dataset import rows as generated_rows
from resources_servers.workspace_tasks.tasks import KINDS, TASKS, TASKS_BY_ID, Task, build_workspace

ENV = "workspace_tasks"
CONFIG = f"resources_servers/{ENV}/configs/{ENV}.yaml"
AGENT = f"{ENV}_simple_agent"
ROWS = generated_rows(0)
INDEX = {row["task_id"]: i for i, row in enumerate(ROWS)}
DONE = {"text": "Done."}
# One task of each kind, solved through the tools by its reference solution.
RIGHT = ("pyfix_median", "cli_limit", "sh_top_words", "csv_people", "git_discount", "make_stats")


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"tool_calls": [{"name": name, "arguments": arguments}]}


def _bash(command: str) -> dict[str, Any]:
    return _call("bash", command=command)


def _edit(command: str, path: str, **arguments: Any) -> dict[str, Any]:
    return _call("str_replace_based_edit_tool", command=command, path=path, **arguments)


def _solution_turns(task: Task) -> list[dict[str, Any]]:
    return [
        _edit("create", step[1], file_text=step[2]) if step[0] == "write" else _bash(step[1])
        for step in task.solution
    ]


def _variants(row: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    task = TASKS_BY_ID[row["task_id"]]
    variants = {"right": [*_solution_turns(task), DONE], "nothing": [_bash("ls -la"), DONE]}
    if task.task_id == "pyfix_median":  # even lengths fixed, the empty list forgotten: 3 of 4 tests
        variants["partial"] = [
            _edit(
                "str_replace",
                "stats/median.py",
                old_str="    return ordered[len(ordered) // 2]",
                new_str="    mid = len(ordered) // 2\n    return ordered[mid] if len(ordered) % 2 else "
                "(ordered[mid - 1] + ordered[mid]) / 2",
            ),
            DONE,
        ]
    if task.task_id == "pyfix_slugify":  # the editor's view / str_replace / insert, then a check
        variants["editor"] = [
            _edit("view", "/workspace"),
            _edit("view", "textutil/slug.py", view_range=[1, -1]),
            _edit(
                "str_replace",
                "/workspace/textutil/slug.py",
                old_str='return title.replace(" ", "-")',
                new_str='return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")',
            ),
            _edit("insert", "textutil/slug.py", insert_line=0, new_str="import re\n"),
            _bash("python3 -c 'from textutil.slug import slugify; print(slugify(\"  Hello, World!! \"))'"),
            DONE,
        ]
    if task.task_id == "sh_unique_ips":  # the model kills its own sandbox, then solves it in a new one
        variants["killed"] = [
            _bash("echo hi > mine.txt; kill -9 -1"),
            _bash("ls mine.txt"),
            *_solution_turns(task),
            DONE,
        ]
    if task.task_id == "cli_shout":  # solved, then the model stalls past the sandbox's idle timeout
        variants["stall"] = [*_solution_turns(task), {"delay_s": 2.5, "text": "Done."}]
    if task.task_id == "git_settings":  # the model's mistakes and escape attempts, each a tool result
        variants["mistakes"] = [
            _edit("view", "/etc/passwd"),
            _edit("create", "../escape.txt", file_text="x"),
            _bash("ln -s /etc/passwd link && ln -s / rootlink && echo linked"),
            _edit("view", "link"),
            _edit("create", "rootlink/tmp/x", file_text="x"),
            _edit("str_replace", "settings.ini", old_str="no such text", new_str="x"),
            _edit("str_replace", "settings.ini", old_str="=", new_str=":"),
            _edit("insert", "settings.ini", insert_line=99, new_str="x"),
            _edit("create", "notes.txt"),
            _edit("delete", "settings.ini"),
            {"tool_calls": [{"name": "bash", "arguments": {"cmd": "ls"}}]},
            {"tool_calls": [{"name": "bash", "arguments": "{not json"}]},
            _bash(
                "ls /; ls -a /workspace; ls /work /tmp 2>&1; echo '---'; "
                "grep -rl test_merge_committed / --exclude-dir=proc --exclude-dir=sys --exclude-dir=usr "
                "--exclude-dir=dev 2>/dev/null; echo grep-exit=$?"
            ),
            _bash("sleep 100"),
            _bash("yes | head -c 50000"),
            _bash("yes"),  # endless output: stopped at the sandbox's output cap
            _bash("sleep 60 & echo started"),
            _bash("jobs -l; ps -e -o comm= | grep -c sleep"),  # a background process dies with its command
            DONE,
        ]
    return variants


def _scripts() -> list[dict[str, Any]]:
    rules = variant_rules(ROWS, _variants)
    for row in ROWS:  # the untagged rows: the right trajectory
        task = TASKS_BY_ID[row["task_id"]]
        rules.append({"contains": task.prompt, "turns": [*_solution_turns(task), DONE]})
    return rules


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    extra = {
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": _scripts()}}},
        ENV: {"resources_servers": {ENV: {"command_timeout_s": 3}}},
    }
    with running_servers([CONFIG], extra) as h:
        yield h


@pytest.fixture(scope="module")
def idle_helper() -> Iterator[RunHelper]:
    """Servers whose sandboxes close after 1 s idle (a rollout that stalls loses its workspace)."""
    extra = {
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": _scripts()}}},
        ENV: {"resources_servers": {ENV: {"idle_timeout_s": 1}}},
    }
    with running_servers([CONFIG], extra) as h:
        yield h


def _row(task_id: str, variant: str | None = None) -> dict[str, Any]:
    row = ROWS[INDEX[task_id]]
    return row if variant is None else tagged_row(row, variant, INDEX[task_id])


def _outputs(result: dict[str, Any]) -> list[str]:
    return [item["output"] for item in result["response"]["output"] if item["type"] == "function_call_output"]


def test_the_tasks_and_rows() -> None:
    assert len(TASKS) >= 20
    kinds = [t.kind for t in TASKS]
    assert set(kinds) == set(KINDS) and all(kinds.count(k) >= 3 for k in KINDS)
    assert generated_examples() == example_rows(ENV)  # the shipped rows are reproducible
    assert [r["task_id"] for r in example_rows(ENV)] == list(EXAMPLE_TASKS)
    assert generated_rows(0) == ROWS and generated_rows(1) != ROWS
    assert sorted(r["task_id"] for r in ROWS) == sorted(TASKS_BY_ID)
    for row in ROWS:  # the model never sees the hidden tests
        assert "def test_" not in orjson.dumps(row).decode()
    assert workspace_path("a/../b.txt") == "b.txt" and workspace_path("/workspace") == "."
    assert head_tail("x" * 50 + "y" * 50, 20) == "x" * 10 + "\n[... 80 characters omitted ...]\n" + "y" * 10


def test_every_task_fails_untouched_and_passes_after_its_reference_solution(tmp_path: Path) -> None:
    """One sandbox per task: the hidden tests on the built workspace (some fail), the reference solution
    applied as the tools would (a file written, a bash command), the hidden tests again (all pass)."""

    async def check(task: Task) -> tuple[int, int, int]:
        build_workspace(task, tmp_path / task.task_id)
        session = await SandboxSession.start(workspace=tmp_path / task.task_id)
        try:
            before = await run_hidden_tests(session, task, 20, 120)
            for step in task.solution:
                if step[0] == "write":
                    await session.write_file(step[1], step[2])
                else:
                    run = await session.exec(["/bin/bash", "-c", step[1]])
                    assert run.return_code == 0, (task.task_id, run.stdout, run.stderr)
            after = await run_hidden_tests(session, task, 20, 120)
        finally:
            await session.close()
        assert before.complete and after.complete, task.task_id
        assert before.failed, f"{task.task_id}: the untouched workspace passes its hidden tests"
        assert not after.failed, f"{task.task_id}: the reference solution fails {after.failed}"
        return len(before.passed), len(after.passed), after.total

    async def main() -> None:
        for task in TASKS:
            _, passed, total = await check(task)
            assert passed == total == len(task.test_names) >= 1

    asyncio.run(main())


def test_right_trajectories_of_every_kind_score_one(helper: RunHelper) -> None:
    assert {TASKS_BY_ID[t].kind for t in RIGHT} == set(KINDS)
    for task_id in RIGHT:
        result = run_rollout(helper, AGENT, _row(task_id), timeout=120)
        assert result["reward"] == 1.0, (task_id, result["failed_tests"], _outputs(result))
        assert result["tests_passed"] == 1.0 and result["passed_count"] == result["test_count"] > 0
        assert result["failed_tests"] == {} and result["kind"] == TASKS_BY_ID[task_id].kind
    result = run_rollout(helper, AGENT, _row("pyfix_slugify", "editor"), timeout=120)
    outputs = [orjson.loads(o) for o in _outputs(result)]
    assert (
        "/workspace/textutil/slug.py" in outputs[0]["output"]
        and "     1\tdef slugify" in outputs[1]["output"]
    )
    assert not any(o.get("is_error") for o in outputs[:4]), outputs
    assert outputs[4] == {"output": "hello-world\n", "exit_code": 0, "timed_out": False}
    assert result["reward"] == 1.0 and result["edits_made"] == 2 and result["commands_run"] == 1


def test_wrong_trajectories_score_zero(helper: RunHelper) -> None:
    result = run_rollout(helper, AGENT, _row("pyfix_median", "partial"), timeout=120)
    assert result["reward"] == 0.0 and result["tests_passed"] == 0.75
    assert (
        list(result["failed_tests"]) == ["test_empty"]
        and "IndexError" in result["failed_tests"]["test_empty"]
    )
    for task_id in ("git_settings", "make_clean", "csv_emails"):
        result = run_rollout(helper, AGENT, _row(task_id, "nothing"), timeout=120)
        assert result["reward"] == 0.0 and result["tests_passed"] < 1.0, task_id


def test_tool_mistakes_and_escapes_are_tool_errors_and_hidden_tests_stay_hidden(helper: RunHelper) -> None:
    result = run_rollout(helper, AGENT, _row("git_settings", "mistakes"), timeout=120)
    out = _outputs(result)
    edits = {i: orjson.loads(out[i]) for i in (0, 1, 3, 4, 5, 6, 7, 8)}
    assert all(e["is_error"] for e in edits.values()), edits
    assert "'/etc/passwd' is outside /workspace" in edits[0]["output"]
    assert "'../escape.txt' is outside /workspace" in edits[1]["output"]
    assert orjson.loads(out[2])["output"] == "linked\n"
    assert edits[3]["output"].startswith(
        "Error: cannot read /workspace/link"
    )  # a symlink out is not followed
    assert "ValueError" not in edits[3]["output"]
    assert edits[4]["output"].startswith("Error: cannot write /workspace/rootlink/tmp/x")
    assert "did not appear verbatim" in edits[5]["output"]
    assert "Multiple occurrences" in edits[6]["output"] and "lines [2, 4, 5, 6, 7]" in edits[6]["output"]
    assert "lines of the file: [0, 8]" in edits[7]["output"]
    assert "`file_text` is required" in edits[8]["output"]
    assert (
        out[9].startswith("Error: invalid arguments for tool 'str_replace_based_edit_tool'")
        and "command" in out[9]
    )
    assert out[10].startswith("Error: invalid arguments for tool 'bash'") and "command" in out[10]
    assert out[11].startswith("Error: the arguments for tool 'bash' are not valid JSON")
    listing = orjson.loads(out[12])["output"]
    assert "settings.ini" in listing and ".git" in listing and "No such file or directory" in listing
    assert listing.rstrip().endswith("grep-exit=1")  # nothing outside /proc, /sys, /usr, /dev holds the tests
    assert "test_" not in listing.split("---")[1]
    slow = orjson.loads(out[13])
    assert slow["timed_out"] is True and slow["exit_code"] is None and "killed" in slow["output"]
    loud = orjson.loads(out[14])
    assert loud["exit_code"] == 0 and "characters omitted" in loud["output"] and len(loud["output"]) < 10_200
    endless = orjson.loads(out[15])
    assert "characters omitted" in endless["output"] and "[output truncated" in endless["output"]
    assert len(endless["output"]) < 10_200
    assert orjson.loads(out[16])["output"] == "started\n"
    assert orjson.loads(out[17])["output"].strip() == "0"
    assert result["reward"] == 0.0  # nothing was resolved; the escapes changed nothing outside


def test_broken_rows_are_refused_before_any_rollout(helper: RunHelper, tmp_path: Path) -> None:
    url = server_url(helper, ENV)
    missing = {k: v for k, v in ROWS[0].items() if k != "task_id"}
    resp = post_json(url + "/seed_session", missing)
    assert resp.status_code == 422 and "task_id" in resp.text
    unknown = {**copy.deepcopy(ROWS[0]), "task_id": "no_such_task"}
    resp = post_json(url + "/verify", {**unknown, "response": {"output": []}})
    assert resp.status_code == 422 and "unknown task_id 'no_such_task'" in resp.text
    resp = post_json(url + "/bash", {"command": "ls"})  # a tool before /seed_session: a readable 400
    assert resp.status_code == 400 and "/seed_session" in resp.text

    # ng_collect_rollouts: a row without the task field stops the run before anything is sent ...
    code, out, err = collect_rollouts(helper, [_row("cli_shout"), missing], tmp_path / "a", AGENT)
    assert code != 0 and out == [] and "input.jsonl:2: missing field `task_id`" in err, err[-2000:]
    # ... and a row naming no task is scored by no one: 422 at /seed_session, in the failures sidecar.
    rows = [_row("cli_shout"), _row("cli_shout", "nothing"), unknown]
    code, out, err = collect_rollouts(helper, rows, tmp_path / "b", AGENT, "+max_attempts=1")
    assert [r["reward"] for r in out] == [1.0, 0.0], err[-2000:]
    assert code == 1
    lines = (tmp_path / "b" / "output_failures.jsonl").read_text().splitlines()
    failures = [orjson.loads(line) for line in lines]
    assert len(failures) == 1 and failures[0]["_ng_task_index"] == 2
    assert (failures[0]["path"], failures[0]["status"]) == ("/seed_session", 422)
    assert "unknown task_id" in failures[0]["error"]


def test_a_sandbox_killed_by_its_command_is_reported_and_replaced(helper: RunHelper) -> None:
    result = run_rollout(helper, AGENT, _row("sh_unique_ips", "killed"), timeout=120)
    killed, listing = (orjson.loads(o) for o in _outputs(result)[:2])
    assert killed["exit_code"] is None and "the sandbox died under this command" in killed["output"]
    assert "No such file" in listing["output"] and listing["exit_code"] == 2  # a fresh workspace
    assert result["reward"] == 1.0


def test_a_lost_workspace_is_a_503_in_the_failures_sidecar_not_a_zero(
    idle_helper: RunHelper, tmp_path: Path
) -> None:
    """The rollout's sandbox closed at its idle timeout before /verify: its workspace is gone, so there
    is nothing to score (a 503, filed as a failure), never a reward computed on the untouched task."""
    rows = [_row("cli_shout"), _row("cli_shout", "stall")]
    code, out, err = collect_rollouts(idle_helper, rows, tmp_path, AGENT, "+max_attempts=1")
    assert [r["reward"] for r in out] == [1.0], err[-2000:]
    assert code == 1
    lines = (tmp_path / "output_failures.jsonl").read_text().splitlines()
    failures = [orjson.loads(line) for line in lines]
    assert len(failures) == 1 and failures[0]["_ng_task_index"] == 1
    assert (failures[0]["path"], failures[0]["status"]) == ("/verify", 503)
    assert "workspace was lost" in failures[0]["error"] and "idle for 1 s" in failures[0]["error"]


def test_verify_and_end_session_close_the_rollouts_sandbox(helper: RunHelper) -> None:
    url = server_url(helper, ENV)
    row = _row("sh_unique_ips")
    for end in ("/verify", "/end_session"):
        cookies = dict(post_json(url + "/seed_session", row).cookies)
        fixed = post_json(
            url + "/bash", {"command": "sed -i 's/| uniq |/| sort -u |/' unique_ips.sh"}, cookies
        )
        assert fixed.json()["exit_code"] == 0
        body = {**row, "response": {"output": []}} if end == "/verify" else {}
        resp = post_json(url + end, body, cookies, timeout=120)
        assert resp.status_code == 200, resp.text
        if end == "/verify":  # the fork saw the rollout's own edit
            assert resp.json()["reward"] == 1.0 and resp.json()["commands_run"] == 1
        after = post_json(url + "/bash", {"command": "ls"}, cookies)
        assert after.status_code == 400 and "/seed_session" in after.text  # the rollout is gone


def test_the_dry_run_config_plays_each_example_rows_reference_solution() -> None:
    """The README's dry run (no model) plays the same turns as the right trajectories scored 1 above."""
    path = (
        PACKAGE_PARENT_DIR / "responses_api_models/scripted_model/configs/scripted_model_workspace_tasks.yaml"
    )
    rules = yaml.safe_load(path.read_text())["policy_model"]["responses_api_models"]["scripted_model"]
    examples = [row["task_id"] for row in generated_examples()]
    assert len(rules["scripts_by_input"]) == len(examples) == 5
    for rule, task_id in zip(rules["scripts_by_input"], examples, strict=True):
        task = TASKS_BY_ID[task_id]
        assert rule["contains"] == task.prompt, task_id
        assert rule["turns"] == [*_solution_turns(task), DONE], task_id
