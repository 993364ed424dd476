"""harness_agent end to end: real servers (mcqa, the scripted model with token ids, harness agents) on
127.0.0.1, real harness processes on the official openai and anthropic SDKs (examples/harnesses/), in
real bubblewrap sandboxes, their calls recorded by the model server and turned into training samples;
every way a harness fails ending as a 502 ``harness_failed`` naming the command, never a reward; and what
a harness's commands can reach from its sandbox (tests/probe_harness.py), beside the same probe run on
the host (``unsafe_host: true``), which reaches all of it."""

from __future__ import annotations

import glob
import json
import os
import signal
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from nemo_gym.auth import token_file_for
from nemo_gym.kit.harness_trajectory import merge_samples
from nemo_gym.run.cli import RunHelper
from nemo_gym.tools.testing import example_rows, post_json, running_servers, server_url
from responses_api_agents.harness_agent.app import HarnessAgentConfig, glob_matches
from responses_api_models.local_model import weights

MCQA = "resources_servers/mcqa/configs/mcqa.yaml"
HARNESS = "responses_api_agents/harness_agent/configs/mcqa_harness.yaml"
LOCAL_MODEL = "responses_api_models/local_model/configs/local_model.yaml"
RIGHT, WRONG = "shortest year", "chemical symbol for sodium"  # rows 0 (B) and 1 (C) of mcqa's examples
MARK = f"ngtest{os.getpid()}"  # in the argv of the processes the harnesses leave, to find them on the host
PROBE = "responses_api_agents/harness_agent/tests/probe_harness.py"
# The base installation's site-packages (what else is installed there) when the venv leaves them out.
BASE_SITE = sysconfig.get_path("purelib", vars={"base": sys.base_prefix, "platbase": sys.base_prefix})
CALL = (
    "import sys, openai, os; openai.OpenAI().chat.completions.create(model=os.environ['NG_MODEL'], "
    "messages=[{'role': 'user', 'content': sys.stdin.read()}])"
)


def _agent(command: list[str], **more: Any) -> dict[str, Any]:
    return {
        "responses_api_agents": {
            "harness_agent": {
                "entrypoint": "app.py",
                "resources_server": {"type": "resources_servers", "name": "mcqa"},
                "model_server": {"type": "responses_api_models", "name": "policy_model"},
                "command": command,
                **more,
            }
        }
    }


SCRIPTS = [
    {  # a tool call the harness runs itself, then the right letter
        "contains": RIGHT,
        "turns": [
            {"tool_calls": [{"name": "calculator", "arguments": {"expression": "6 * 7"}}]},
            {"text": "\\boxed{B}"},
        ],
    },
    {"contains": WRONG, "turns": [{"text": "\\boxed{A}"}]},
    {"contains": "[probe]", "turns": [{"text": "\\boxed{B}"}]},
]


@pytest.fixture(scope="module")
def stack() -> Iterator[RunHelper]:
    extra = {
        "policy_model": {
            "responses_api_models": {
                "scripted_model": {"return_token_id_information": True, "scripts_by_input": SCRIPTS}
            }
        },
        "streaming_harness": _agent(["python", "examples/harnesses/openai_tool_agent.py"], env={"STREAM": "1"}),
        "no_such_command": _agent(["/nonexistent/harness-binary"]),
        "exits_nonzero": _agent(["python", "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"]),
        "never_calls": _agent(["python", "-c", "print('\\\\boxed{B}')"]),
        # Calls the model (it answers), then dies as a model's command could make it (kill $PPID, exit 4).
        "ends_after_answers": _agent(
            ["python", "-c", "import sys, openai, os; "
             "openai.OpenAI().chat.completions.create(model=os.environ['NG_MODEL'], messages=[{'role': 'user', 'content': sys.stdin.read()}]); "
             "sys.exit(4)"]
        ),
        "runs_too_long": _agent(
            ["python", "-c", f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', '{MARK}-hang']); time.sleep(300)"],
            timeout_s=3,
        ),
        # Calls the model (it answers), then does what a model's command could make it do.
        "floods_its_output": _agent(
            ["python", "-c", f"{CALL}; print('x' * 50000)"], max_output_bytes=10000
        ),
        "fills_its_workspace": _agent(
            ["python", "-c", f"{CALL}; open('big.txt', 'w').write('x' * 50000)"],
            final_files=["*.txt"],
            max_workspace_changes_bytes=10000,
        ),
        "probe_sandboxed": _agent(["python", PROBE]),
        "probe_on_host": _agent(["python", PROBE], unsafe_host=True),
        # Keeps its sandbox (and its workspace's files on the host) until the test releases it.
        "holder": _agent(
            ["python", "-c", "import os, sys, time, openai; t = time.monotonic()\n"
             "while not os.path.exists('/run/ng-harness/release') and time.monotonic() < t + 120: time.sleep(0.1)\n"
             "openai.OpenAI().chat.completions.create(model=os.environ['NG_MODEL'], messages=[{'role': 'user', 'content': sys.stdin.read()}])\n"
             "print('\\\\boxed{B}')"]
        ),
        "answers_in_a_file": _agent(
            ["python", "-c", "import sys, openai, os; "
             "openai.OpenAI().chat.completions.create(model=os.environ['NG_MODEL'], messages=[{'role': 'user', 'content': sys.stdin.read()}]); "
             "open('out/answer.txt', 'w').write(open('notes.txt').read())"],
            final_answer="file",
            answer_file="out/answer.txt",
        ),
    }  # fmt: skip
    with running_servers([MCQA, HARNESS], extra) as helper:
        yield helper


def _row(contains: str) -> dict[str, Any]:
    return next(r for r in example_rows("mcqa") if contains in str(r["responses_create_params"]))


def _run(stack: RunHelper, agent: str, row: dict[str, Any]) -> Any:
    return post_json(server_url(stack, agent) + "/run", row, timeout=120)


def _check_contiguous(result: dict[str, Any], calls: int) -> dict[str, Any]:
    training = result["training"]
    assert training["calls_without_token_ids"] == []
    [sample] = training["samples"]  # every call extended the one before: one merged sample
    assert sample["call_indices"] == list(range(calls)) and sample["rewrote_history"] is False
    n = len(sample["token_ids"])
    assert n == len(sample["loss_mask"]) == len(sample["log_probs"]) > sample["prompt_length"] > 0
    assert sample["loss_mask"][: sample["prompt_length"]] == [0] * sample["prompt_length"]
    assert sum(sample["loss_mask"]) > 0
    # The scripted model's log-probabilities are a function of the token (its fake_log_probs): each
    # generated token's value is where the mask says, so the ids and the log-probs line up.
    for tid, mask, lp in zip(sample["token_ids"], sample["loss_mask"], sample["log_probs"], strict=True):
        assert lp == (-round(0.01 * (tid % 97 + 1), 2) if mask else 0.0)
    return sample


def test_an_openai_sdk_harness_with_its_own_tool_is_rewarded_with_its_exact_tokens(stack: RunHelper) -> None:
    resp = _run(stack, "mcqa_openai_harness", _row(RIGHT))
    assert resp.status_code == 200, resp.text
    result = resp.json()
    assert result["reward"] == 1.0
    assert result["harness"]["exit_code"] == 0 and result["harness"]["model_calls"] == 2
    sample = _check_contiguous(result, calls=2)
    # The second call's prompt carried the tool's result (6 * 7 = 42) the harness computed itself.
    assert b"42" in bytes(
        t for t, m in zip(sample["token_ids"], sample["loss_mask"], strict=True) if m == 0 and t < 256
    )


def test_a_harness_that_streams_is_recorded_with_its_exact_tokens(stack: RunHelper) -> None:
    resp = _run(stack, "streaming_harness", _row(RIGHT))
    assert resp.status_code == 200, resp.text
    result = resp.json()
    assert result["reward"] == 1.0 and result["harness"]["model_calls"] == 2
    _check_contiguous(result, calls=2)


def test_a_wrong_answer_scores_zero(stack: RunHelper) -> None:
    resp = _run(stack, "mcqa_openai_harness", _row(WRONG))
    assert resp.status_code == 200, resp.text
    assert resp.json()["reward"] == 0.0 and resp.json()["harness"]["model_calls"] == 1


def test_an_anthropic_sdk_harness_through_the_messages_api(stack: RunHelper) -> None:
    resp = _run(stack, "mcqa_anthropic_harness", _row(RIGHT))
    assert resp.status_code == 200, resp.text
    result = resp.json()
    assert result["reward"] == 1.0 and result["harness"]["model_calls"] == 2
    _check_contiguous(result, calls=2)


def test_the_answer_from_a_file_and_the_rows_files_in_the_working_directory(stack: RunHelper) -> None:
    row = {**_row(RIGHT), "harness_files": {"notes.txt": "\\boxed{B}", "out/.keep": ""}}
    resp = _run(stack, "answers_in_a_file", row)
    assert resp.status_code == 200, resp.text
    assert resp.json()["reward"] == 1.0


def test_the_policy_version_of_each_call_is_on_its_sample_and_the_rollout(stack: RunHelper) -> None:
    model = server_url(stack, "policy_model")
    assert post_json(model + "/policy_version", {"policy_version": 7}).status_code == 200
    try:
        resp = _run(stack, "mcqa_openai_harness", _row(RIGHT))
    finally:
        post_json(model + "/policy_version", {"policy_version": 0})
    assert resp.status_code == 200, resp.text
    result = resp.json()
    assert result["policy_versions"] == [7]  # what max_policy_lag judges the rollout by
    assert [s["policy_versions"] for s in result["training"]["samples"]] == [[7]]


@pytest.mark.parametrize(
    ("agent", "said"),
    [
        ("no_such_command", "could not start"),
        ("exits_nonzero", "exited with status 3; its stderr ends: boom"),
        ("never_calls", "never called the model"),
        ("runs_too_long", "ran past timeout_s=3.0"),
    ],
)
def test_a_failing_harness_is_a_502_naming_it_never_a_reward(stack: RunHelper, agent: str, said: str) -> None:
    resp = _run(stack, agent, _row(RIGHT))
    assert resp.status_code == 502, resp.text
    error = resp.json()["error"]
    assert error["kind"] == "harness_failed" and said in error["message"], error
    assert "reward" not in resp.text
    if agent == "runs_too_long":  # the harness's whole sandbox was killed, its child too
        assert _left_behind(f"{MARK}-hang") == []


def test_a_harness_ended_after_its_model_calls_answered_scores_zero_with_the_reason(stack: RunHelper) -> None:
    # Every model call answered; then the harness exited non-zero (what a model's `kill $PPID` or an answer
    # the harness cannot take does): the model's doing, scored 0 with the reason, not a 502 that would drop
    # the rollout from training. Its calls are recorded under the row's own rollout id.
    row = {**_row(RIGHT), "_ng_rollout_id": "harness-test-ends-after-answers"}
    resp = _run(stack, "ends_after_answers", row)
    assert resp.status_code == 200, resp.text
    result = resp.json()
    assert result["reward"] == 0.0, result
    assert result["failure_reason"].startswith("the harness exited with status 4 after 1 model calls"), result
    assert result["harness"]["rollout_id"] == "harness-test-ends-after-answers"
    assert result["harness"]["model_calls"] == 1 and result["training"]["samples"]


@pytest.mark.parametrize(
    ("agent", "said"),
    [
        (
            "floods_its_output",
            "killed by signal 9 (its output passed max_output_bytes=10000 and it was stopped)",
        ),
        (
            "fills_its_workspace",
            "cannot be sent to /verify: the workspace's file 'big.txt' alone has 50000 bytes",
        ),
    ],
)
def test_a_harness_spoiled_after_its_model_calls_answered_scores_zero_with_the_reason(
    stack: RunHelper, agent: str, said: str
) -> None:
    resp = _run(stack, agent, _row(RIGHT))
    assert resp.status_code == 200, resp.text
    result = resp.json()
    assert result["reward"] == 0.0 and said in result["failure_reason"], result["failure_reason"]
    assert result["harness"]["model_calls"] == 1


def _left_behind(marker: str) -> list[int]:
    """Live processes on the host whose command line holds ``marker`` (bounded wait for them to go)."""
    deadline = time.monotonic() + 10
    while True:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker.encode() in cmdline and state != "Z":
                found.append(int(pid))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_merge_samples_marks_a_call_that_rewrote_history() -> None:
    def call(i: int, prompt: list[int], gen: list[int]) -> dict[str, Any]:
        message = {
            "prompt_token_ids": prompt,
            "generation_token_ids": gen,
            "generation_log_probs": [-0.5] * len(gen),
        }
        return {"call_index": i, "status_code": 200, "response": {"choices": [{"message": message}]}}

    calls = [
        call(0, [1, 2], [3]),
        call(1, [1, 2, 3, 4], [5, 6]),  # extends: only [4] (prompt) and [5, 6] (generated) are added
        call(2, [1, 9], [7]),  # the harness summarised its history: a new sample
        {"call_index": 3, "status_code": 500, "response": {"error": "x"}},
    ]
    out = merge_samples(calls)
    first, second = out["samples"]
    assert first["token_ids"] == [1, 2, 3, 4, 5, 6] and first["loss_mask"] == [0, 0, 1, 0, 1, 1]
    assert first["log_probs"] == [0.0, 0.0, -0.5, 0.0, -0.5, -0.5] and first["call_indices"] == [0, 1]
    assert second["token_ids"] == [1, 9, 7] and second["rewrote_history"] is True
    assert out["calls_without_token_ids"] == [3]


@pytest.mark.skipif(
    weights.default_model_unavailable() is not None,
    reason=f"needs the default local model: {weights.default_model_unavailable()}",
)
def test_the_openai_harness_on_the_local_model_gets_the_models_own_token_ids() -> None:
    """A real model (the embedded GGUF on CPU): whatever it answers (no assertion on its words; greedy
    output differs between CPUs), the rollout is scored and every recorded call's ids are the model's."""
    extra = {
        "policy_model": {"responses_api_models": {"local_model": {"return_token_id_information": True}}},
        "mcqa_openai_harness": {"responses_api_agents": {"harness_agent": {"env": {"MAX_TOKENS": "48"}}}},
    }
    with running_servers([MCQA, HARNESS, LOCAL_MODEL], extra, with_scripted_model=False) as helper:
        resp = _run(helper, "mcqa_openai_harness", _row(RIGHT))
    assert resp.status_code == 200, resp.text
    result = resp.json()
    assert result["reward"] in (0.0, 1.0) and result["harness"]["exit_code"] == 0
    training = result["training"]
    assert training["calls_without_token_ids"] == [] and training["samples"]
    calls = sorted(i for s in training["samples"] for i in s["call_indices"])
    assert calls == list(range(result["harness"]["model_calls"]))
    # The harness resends its history as text; the server puts each earlier answer's exact ids back
    # (nemo_gym.server.rollout_tokens), so however many calls it made, they extend each other: one sample.
    [sample] = training["samples"]
    assert sample["rewrote_history"] is False
    for sample in training["samples"]:
        n = len(sample["token_ids"])
        assert n == len(sample["loss_mask"]) == len(sample["log_probs"]) > sample["prompt_length"] > 0
        assert 0 < sum(sample["loss_mask"]) <= 48 * len(sample["call_indices"])
        assert all(lp <= 0.0 for lp in sample["log_probs"])


@pytest.mark.parametrize("pattern", ["../outside.py", "/etc/*", ""])
def test_final_files_patterns_must_stay_in_the_working_directory(pattern: str) -> None:
    base = _agent(["python", "x.py"])["responses_api_agents"]["harness_agent"]
    config = {**base, "name": "h", "host": "127.0.0.1", "port": 1, "final_files": [pattern]}
    with pytest.raises(ValidationError, match="final_files"):
        HarnessAgentConfig.model_validate(config)


def _probe_row(stack: RunHelper, marker: str, globs: list[str], question_of: str = RIGHT) -> dict[str, Any]:
    head = stack.head_server_config
    addresses = [f"{head.host}:{head.port}"] + [
        server_url(stack, name).split("//", 1)[1] for name in ("policy_model", "mcqa")
    ]
    token_file = token_file_for(head.port)
    assert token_file.is_file()  # what a harness on the host reads (the run token: every server, every path)
    row = _row(question_of)
    probe = {
        "marker": marker,
        "paths": [
            str(Path.cwd() / "resources_servers/mcqa/data/example.jsonl"),  # the answer key
            str(Path.cwd() / "resources_servers/file_edit_tasks/data/example.jsonl"),
            str(token_file),
            str(Path.home() / ".cache"),
        ],
        "globs": globs,
        "home": str(Path.home()),
        "list": [BASE_SITE],
        "addresses": addresses,
        "question": "[probe] which letter?",
    }
    return {**row, "responses_create_params": {"input": json.dumps(probe)}}


def _probe_report(result: dict[str, Any]) -> dict[str, Any]:
    line = next(x for x in result["harness"]["stderr"].splitlines() if x.startswith("PROBE "))
    return json.loads(line.removeprefix("PROBE "))


def test_a_sandboxed_harness_reaches_its_own_rollouts_model_calls_and_nothing_else(stack: RunHelper) -> None:
    # Another rollout's harness holds its sandbox (its workspace's files on the host) while the probe runs.
    held = f"{MARK}-held.txt"
    where = [
        f"{tempfile.gettempdir()}/nemo-gym-sessions-*/sessions/*/upper/{held}",  # a sandboxed rollout's files
        f"{tempfile.gettempdir()}/ng_harness_*/{held}",  # an unsafe_host rollout's
    ]
    holder: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: holder.update(
            resp=_run(stack, "holder", {**_row(RIGHT), "harness_files": {held: "secret"}})
        )
    )
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not glob.glob(where[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert glob.glob(where[0]), "the holder's sandbox never started"

        resp = _run(stack, "probe_sandboxed", _probe_row(stack, f"{MARK}-sandboxed", where))
        assert glob.glob(where[0])  # the other rollout's files were there all along
        host_resp = _run(stack, "probe_on_host", _probe_row(stack, f"{MARK}-host", where))
    finally:
        for run_dir in glob.glob(f"{tempfile.gettempdir()}/ng-harness-run-*/"):
            Path(run_dir, "release").touch()
        thread.join(timeout=120)
    assert holder["resp"].status_code == 200 and holder["resp"].json()["reward"] == 1.0

    # In its sandbox: scored as usual (its own rollout's model call works), and nothing else is reachable.
    assert resp.status_code == 200, resp.text
    result = resp.json()
    assert result["reward"] == 1.0 and result["harness"]["model_calls"] == 1, result
    report = _probe_report(result)
    assert not any(report["readable"].values()), report["readable"]  # answer keys, token file, ~/.cache
    assert report["found"] == [], report  # another rollout's files
    assert report["home"] == [".pyenv"] or report["home"] is None, report  # at most the venv's base Python
    if sys.prefix != sys.base_prefix and os.listdir(BASE_SITE):  # a venv: the base's own packages hidden
        assert report["listings"][BASE_SITE] in ([], None), report
    assert "resources_servers" not in (report["top"] or []) and "workspace" in report["top"], report
    assert all(not cwd.startswith(str(Path.cwd())) for cwd in report["cwds"]), report  # no server's cwd
    assert report["policy_version"] == "HTTP 401", report  # the rollout credential sets nothing
    assert report["pop"] == "HTTP 401", report  # nor reads what the model server recorded
    assert report["other_rollout"] == "HTTP 401", report  # nor makes another rollout's model calls
    assert report["connect"] == {a: False for a in report["connect"]}, report  # no server of the host
    assert _left_behind(f"{MARK}-sandboxed") == []  # its `setsid sleep 1000 &` died with the rollout

    # The same probe on the host (unsafe_host: true) reaches all of it: what the sandbox takes away.
    assert host_resp.status_code == 200, host_resp.text
    host = _probe_report(host_resp.json())
    try:
        assert all(host["readable"].values()), host["readable"]
        assert host["listings"][BASE_SITE] == sorted(os.listdir(BASE_SITE))
        assert host["found"] and any(cwd.startswith(str(Path.cwd())) for cwd in host["cwds"]), host
        assert all(host["connect"].values()), host
        assert host["policy_version"] == "HTTP 401"  # the trainer credential guards it even there
    finally:
        left = _left_behind(f"{MARK}-host")
        for pid in left:  # the setsid child a harness on the host leaves behind outlives its rollout
            os.kill(pid, signal.SIGKILL)
    assert left, "a setsid child of a harness on the host survives it (what the sandbox's cgroup prevents)"


@pytest.mark.parametrize(
    ("more", "said"),
    [
        ({"workspace": "resources_server", "unsafe_host": True}, "sandbox only"),
        ({"workspace": "resources_server", "final_files": ["*.py"]}, "workspace_changes"),
        ({"sandbox": {"backend": "unsafe_local_subprocess"}}, "unsafe_host: true"),
        ({"sandbox_limits": {"memory": 5}}, "Unknown session limit keys"),
    ],
)
def test_configs_that_would_not_sandbox_the_harness_as_asked_are_refused(
    more: dict[str, Any], said: str
) -> None:
    base = _agent(["python", "x.py"])["responses_api_agents"]["harness_agent"]
    with pytest.raises(ValidationError, match=said):
        HarnessAgentConfig.model_validate({**base, "name": "h", "host": "127.0.0.1", "port": 1, **more})


def test_final_files_patterns_match_as_path_glob_does(tmp_path: Path) -> None:
    for rel in ("a.py", "b.txt", "pkg/c.py", "pkg/sub/d.py", ".hidden/e.py", "x1.py", "x22.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    files = [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()]
    for pattern in (
        "**/*.py",
        "*.py",
        "pkg/*.py",
        "pkg/**/*.py",
        "**/d.py",
        "x?.py",
        "x[0-9]*.py",
        "**",
        "*/*",
    ):
        expected = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.glob(pattern) if p.is_file())
        assert sorted(f for f in files if glob_matches(pattern, f)) == expected, pattern
