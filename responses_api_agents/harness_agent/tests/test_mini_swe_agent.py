"""A real third-party coding agent from the package registry, unchanged: mini-swe-agent (the `harness`
extra), run by harness_agent (responses_api_agents/harness_agent/configs/mini_swe_agent.yaml) on the
file-editing tasks of resources_servers/file_edit_tasks, through ``ng_collect_rollouts`` against real
servers on 127.0.0.1. The scripted model plays mini's model over LiteLLM: a ``bash`` tool call with a
``sed`` that edits the file, then mini's submit command. The edit is rewarded from the file's final
text; every call mini made is recorded with its token ids (one contiguous sample per rollout); a
harness that fails (the model server down, a model name LiteLLM refuses) is in the failures file,
never a reward."""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from nemo_gym.collection.output_files import sidecar_paths
from nemo_gym.run.cli import RunHelper
from nemo_gym.tools.testing import collect_rollouts, example_rows, running_servers

# Looked up, not imported: importing minisweagent prints a banner and makes a config folder in $HOME.
if importlib.util.find_spec("minisweagent") is None:
    pytest.skip("the `harness` extra is not installed (pip install -e '.[harness]')", allow_module_level=True)

ENV = "resources_servers/file_edit_tasks/configs/file_edit_tasks.yaml"
MINI = "responses_api_agents/harness_agent/configs/mini_swe_agent.yaml"
WS_ENV = "resources_servers/workspace_tasks/configs/workspace_tasks.yaml"
WS_MINI = "responses_api_agents/harness_agent/configs/mini_swe_agent_workspace_tasks.yaml"
WS_AGENT = "workspace_tasks_mini_swe_agent"
SCRIPTED = "responses_api_models/scripted_model/configs/scripted_model_file_edit_tasks.yaml"
AGENT = "file_edit_mini_swe_agent"
BAD_MODEL_AGENT = "mini_with_a_bad_model_name"
WRONG, MODEL_DOWN = "[edit it wrongly]", "[model server down]"
SUBMIT = {"name": "bash", "arguments": {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}}


def _bash(command: str) -> dict[str, Any]:
    return {"name": "bash", "arguments": {"command": command}}


def _config(path: str) -> dict[str, Any]:
    return yaml.safe_load(Path(path).read_text())


@pytest.fixture(scope="module")
def stack() -> Iterator[RunHelper]:
    scripts = _config(SCRIPTED)["policy_model"]["responses_api_models"]["scripted_model"]["scripts_by_input"]
    more = [
        {  # multiplies where the task asks for an area... of a sum: the file ends wrong
            "contains": WRONG,
            "turns": [
                {"tool_calls": [{"name": "bash", "arguments": {"command": "sed -i 's/ + / - /' shapes.py"}}]},
                {"tool_calls": [SUBMIT]},
            ],
        },
        {"contains": MODEL_DOWN, "turns": [{"http_error": 503}]},
        {  # workspace_tasks' git_settings: resolve the conflict and commit the merge, in mini's sandbox
            "contains": "conflict in settings.ini",
            "turns": [
                {
                    "tool_calls": [
                        _bash(
                            "printf '[server]\\nport = 8080\\ntimeout = 30\\nretries = 5\\n' > settings.ini"
                            " && git add settings.ini && git commit -q --no-edit && git status --short"
                        )
                    ]
                },
                {"tool_calls": [SUBMIT]},
            ],
        },
        {  # workspace_tasks' pyfix_median: the module deleted, not fixed (a deletion crosses over too)
            "contains": "`stats.median.median`",
            "turns": [{"tool_calls": [_bash("rm stats/median.py")]}, {"tool_calls": [SUBMIT]}],
        },
    ]
    # The same mini, asked for a model with no LiteLLM provider: LiteLLM refuses it, mini exits non-zero.
    bad = copy.deepcopy(_config(MINI)[AGENT])
    harness = bad["responses_api_agents"]["harness_agent"]
    harness["command"] = [part.replace('"openai/$NG_MODEL"', '"$NG_MODEL"') for part in harness["command"]]
    harness["model_name"] = "no-such-provider-model"
    extra = {
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": more + scripts}}},
        BAD_MODEL_AGENT: bad,
    }
    with running_servers([ENV, MINI, WS_ENV, WS_MINI, SCRIPTED], extra, with_scripted_model=False) as helper:
        yield helper


def _marked(row: dict[str, Any], marker: str) -> dict[str, Any]:
    out = copy.deepcopy(row)
    out["responses_create_params"]["input"][0]["content"] += f" {marker}"
    return out


@pytest.mark.slow  # mini starts LiteLLM in each rollout: ~10-20 s each on a shared 2-core machine
def test_mini_swe_agent_edits_files_and_is_rewarded_with_its_exact_tokens(
    stack: RunHelper, tmp_path: Path
) -> None:
    rows = example_rows("file_edit_tasks")
    inputs = [
        rows[0],  # fixes calc.py: reward 1
        _marked(rows[3], WRONG),  # breaks shapes.py otherwise: reward 0
        _marked(rows[2], MODEL_DOWN),  # the model server answers 503: a failure, no reward
        {**rows[4], "agent_ref": {"name": BAD_MODEL_AGENT}},  # mini cannot start its model: a failure
    ]
    code, out, stderr = collect_rollouts(
        stack, inputs, tmp_path, AGENT, "+max_attempts=1", "+num_samples_in_parallel=4"
    )
    assert code == 1, stderr[-3000:]  # two rollouts are missing: they failed
    assert [(r["_ng_task_index"], r["reward"]) for r in out] == [(0, 1.0), (1, 0.0)], stderr[-3000:]
    right, wrong = out
    assert right["files_matched"] == {"calc.py": True}
    assert "return a + b" in right["final_files"]["calc.py"]
    assert (
        wrong["failure_reason"],
        wrong["final_files"]["shapes.py"].strip().endswith("width - height"),
    ) == (
        "wrong_content",
        True,
    )
    for result in out:  # mini's two calls (the edit, the submit), recorded and merged into one sample
        assert result["harness"]["exit_code"] == 0 and result["harness"]["model_calls"] == 2
        training = result["training"]
        assert training["calls_without_token_ids"] == []
        [sample] = training["samples"]
        assert sample["call_indices"] == [0, 1] and sample["rewrote_history"] is False
        n = len(sample["token_ids"])
        assert n == len(sample["loss_mask"]) == len(sample["log_probs"]) > sample["prompt_length"] > 0
        generated = bytes(t for t, m in zip(sample["token_ids"], sample["loss_mask"], strict=True) if m)
        assert b"bash(" in generated and b"COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in generated
        # The scripted model's log-probabilities are a function of the token: ids and mask line up.
        for tid, mask, lp in zip(sample["token_ids"], sample["loss_mask"], sample["log_probs"], strict=True):
            assert lp == (-round(0.01 * (tid % 97 + 1), 2) if mask else 0.0)
        # The prompt of the second call carried mini's own instructions and the edit's tool result.
        prompt = bytes(
            t for t, m in zip(sample["token_ids"], sample["loss_mask"], strict=True) if not m and t < 256
        )
        assert b"COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in prompt and b'"returncode": 0' in prompt

    failures = {
        f["_ng_task_index"]: f
        for f in map(
            orjson.loads, sidecar_paths(tmp_path / "output.jsonl")["failures"].read_bytes().splitlines()
        )
    }
    assert sorted(failures) == [2, 3], failures
    for index, said in ((2, "scripted HTTP 503"), (3, "LLM Provider NOT provided")):
        failure = failures[index]
        assert (failure["kind"], failure["status"]) == ("harness_failed", 502), failure
        assert "exited with status 1" in failure["error"] and said in failure["error"], failure
        assert "reward" not in failure


@pytest.mark.slow  # two more mini rollouts, in parallel
def test_mini_swe_agent_solves_a_workspace_task_in_its_sandbox_and_the_hidden_tests_judge_it(
    stack: RunHelper, tmp_path: Path
) -> None:
    """mini works in a sandbox of its own on the task's workspace (POST /export_workspace: files and a git
    repository in the middle of a merge); what it changed (new git objects, a commit, MERGE_HEAD deleted;
    a deleted module) crosses to workspace_tasks as `workspace_changes`, which applies it to a fresh copy
    of the task's workspace and runs the hidden tests in a fork."""
    rows = {r["task_id"]: r for r in example_rows("workspace_tasks")}
    inputs = [rows["git_settings"], rows["pyfix_median"]]
    code, out, stderr = collect_rollouts(
        stack, inputs, tmp_path, WS_AGENT, "+max_attempts=1", "+num_samples_in_parallel=2"
    )
    assert code == 0, stderr[-3000:]
    merged, deleted = out
    assert (merged["task_id"], merged["reward"], merged["failure_reason"]) == ("git_settings", 1.0, None), (
        merged
    )
    assert merged["tests_passed"] == 1.0 and "workspace_changes" not in merged
    assert merged["harness"]["exit_code"] == 0 and merged["harness"]["model_calls"] == 2
    [sample] = merged["training"]["samples"]
    assert sample["call_indices"] == [0, 1]
    # The commit ran in mini's sandbox (its bash tool's output came back in the second call's prompt).
    prompt = bytes(
        t for t, m in zip(sample["token_ids"], sample["loss_mask"], strict=True) if not m and t < 256
    )
    assert b'"returncode": 0' in prompt
    assert (deleted["task_id"], deleted["reward"]) == ("pyfix_median", 0.0), deleted
    assert deleted["failure_reason"] == "4 of 4 hidden tests failed", deleted
    assert deleted["commands_run"] == 0  # nothing ran through the environment's own tools
