"""ng_collect_rollouts end to end: real servers on 127.0.0.1, the real CLI in a subprocess.

What is proven here (each test says which part):
* 1,000 rollouts of each example environment on the scripted model: every (task, rollout) pair
  exactly once, task fields kept, num_repeats expanded in place, +responses_create_params merged,
  +num_repeats_add_seed, and exact aggregate metrics / printed summary for known rewards.
* Infrastructure failures (a killed resources server, a killed agent, a model answering 503, a
  collector-side timeout) go to the failures file with kind, server and attempt, never to the
  output; resume reruns exactly the missing pairs, up to +max_attempts.
* Bad input is reported all at once (line numbers and fields), exit status 2, nothing written.
* Ctrl+C leaves only whole lines; resume completes the rest exactly once and refuses when the
  input or num_repeats changed.
* Validation and materialisation stream the input (peak memory far below the file size).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest

from nemo_gym.cli import RunHelper
from nemo_gym.client.server_client import close_shared_session
from nemo_gym.collection.circuit_breaker import classify_failure
from nemo_gym.collection.dispatch import run_one
from nemo_gym.collection.output_files import _scan_existing_output, sidecar_paths
from nemo_gym.config.keys import PACKAGE_PARENT_DIR
from nemo_gym.errors import UpstreamError
from nemo_gym.kit.rollout_stats import k_values
from nemo_gym.rollout_collection import collect_main
from nemo_gym.server_utils import ServerClient
from nemo_gym.tools.testing import example_rows, refusing_port, running_servers
from resources_servers.example_single_tool_call.app import weather_report

REPO = Path(PACKAGE_PARENT_DIR)
BIN = Path(sys.executable).parent
COLLECT = str(BIN / "ng_collect_rollouts")
ENVS = ["example_single_tool_call", "example_multi_step", "example_session_state_mgmt"]
WEATHER = "example_single_tool_call"
WEATHER_AGENT = f"{WEATHER}_simple_agent"
SUBPROCESS_TIMEOUT_S = 180


# ------------------------------------------------------------------------------------------------
# Helpers.


def config_of(env: str) -> str:
    return f"resources_servers/{env}/configs/{env}.yaml"


def model_extra(**scripted: Any) -> dict[str, Any]:
    """Config overrides for the scripted model instance ``policy_model``."""
    return {"policy_model": {"responses_api_models": {"scripted_model": scripted}}}


def user_text(row: dict[str, Any]) -> str:
    return next(m["content"] for m in row["responses_create_params"]["input"] if m.get("role") == "user")


def with_marker(row: dict[str, Any], marker: str) -> dict[str, Any]:
    """A copy of ``row`` whose user message ends with ``marker`` (which selects a scripted-model rule)."""
    out = copy.deepcopy(row)
    for message in out["responses_create_params"]["input"]:
        if message.get("role") == "user":
            message["content"] = f"{message['content']} {marker}"
    return out


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), f"{path} ends with a partial line"
    return [orjson.loads(line) for line in data.splitlines() if line.strip()]


def pairs(rows: list[dict[str, Any]]) -> list[tuple[int, int]]:
    return [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows]


def head_port(helper: RunHelper) -> int:
    return helper.head_server_config.port


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def start_collect(args: list[str], port: int | None, cwd: Path) -> subprocess.Popen:
    """Start ng_collect_rollouts in its own process group (stdout/stderr to files in ``cwd``)."""
    argv = [COLLECT, *args] + ([f"+head_server.port={port}"] if port is not None else [])
    with open(cwd / "collect.stdout", "wb") as stdout, open(cwd / "collect.stderr", "wb") as stderr:
        return subprocess.Popen(
            argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, start_new_session=True
        )


def finish(proc: subprocess.Popen, cwd: Path, timeout: float = SUBPROCESS_TIMEOUT_S) -> tuple[int, str, str]:
    """Wait (bounded) for a started collector; returns (exit status, stdout, stderr)."""
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            _kill_group(proc)
    return code, (cwd / "collect.stdout").read_text(), (cwd / "collect.stderr").read_text()


def collect(
    args: list[str], port: int | None, cwd: Path, timeout: float = SUBPROCESS_TIMEOUT_S
) -> tuple[int, str, str]:
    """Run ng_collect_rollouts to the end (bounded); returns (exit status, stdout, stderr)."""
    proc = start_collect(args, port, cwd)
    try:
        return finish(proc, cwd, timeout)
    finally:
        if proc.poll() is None:
            _kill_group(proc)


def collect_here(
    args: list[str], port: int | None, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    """Run the ng_collect_rollouts entry point in this process (saves an interpreter start per call).

    Used where no signal is involved; returns (exit status, stdout, stderr) like :func:`collect`.
    """
    capsys.readouterr()
    argv = [*args] + ([] if "+progress=false" in args else ["+progress=false"])
    argv += [f"+head_server.port={port}"] if port is not None else []
    with pytest.raises(SystemExit) as exc:
        collect_main(argv)
    captured = capsys.readouterr()
    return int(exc.value.code or 0), captured.out, captured.err


def wait_for_lines(path: Path, n: int, proc: subprocess.Popen, timeout: float = 60) -> int:
    """Wait until ``path`` has at least ``n`` lines (bounded); returns the count seen."""
    deadline = time.monotonic() + timeout
    count = 0
    while time.monotonic() < deadline:
        count = path.read_bytes().count(b"\n") if path.exists() else 0
        if count >= n:
            return count
        assert proc.poll() is None, (
            f"the collector ended early with status {proc.returncode} after {count} lines"
        )
        time.sleep(0.05)
    raise AssertionError(f"only {count} lines in {path} after {timeout} s")


def base_args(
    input_path: Path, output_path: Path, *extra: str, agent: str | None = WEATHER_AGENT
) -> list[str]:
    args = [f"+input_jsonl_fpath={input_path}", f"+output_jsonl_fpath={output_path}"]
    if agent:
        args.append(f"+agent_name={agent}")
    return args + list(extra)


def server_pid(helper: RunHelper, name: str) -> int:
    return next(r["pid"] for r in helper.server_instances() if r["name"] == name)


def kill9(pid: int) -> None:
    """SIGKILL one server process and wait (bounded) until it is gone (a zombie counts as gone)."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} still alive after SIGKILL")


# Scripts per environment: a trajectory that earns reward 1.0 and one that earns 0.0.


def passing_turns(env: str, row: dict[str, Any]) -> list[dict[str, Any]]:
    if env == "example_single_tool_call":
        city = row["expected_city"]
        return [
            {"tool_calls": [{"name": "get_weather", "arguments": {"city": city}}]},
            {"text": weather_report(city)},
        ]
    if env == "example_multi_step":
        lookups = [
            {"name": "get_synonym_value", "arguments": {"synonym": w}} for w in row["expected_synonyms"]
        ]
        extract = [
            {
                "name": "extract_synonym_values",
                "arguments": {"synonym_values": row["expected_synonym_values"]},
            }
        ]
        return [{"tool_calls": lookups}, {"tool_calls": extract}, {"text": "Reported."}]
    if env == "example_session_state_mgmt":
        delta = row["expected_count"] - row["initial_count"]
        get = {"tool_calls": [{"name": "get_counter_value", "arguments": {}}]}
        return [
            {"tool_calls": [{"name": "increment_counter", "arguments": {"count": delta}}]},
            get,
            {"text": f"The counter now reads {row['expected_count']}."},
        ]
    raise ValueError(env)


def failing_turns(env: str, row: dict[str, Any]) -> list[dict[str, Any]]:
    if env == "example_single_tool_call":
        return [
            {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Atlantis"}}]},
            {"text": "Done."},
        ]
    if env == "example_multi_step":
        extract = [{"name": "extract_synonym_values", "arguments": {"synonym_values": [1000]}}]
        return [{"tool_calls": extract}, {"text": "Reported."}]
    if env == "example_session_state_mgmt":
        delta = row["expected_count"] - row["initial_count"] + 1
        return [
            {"tool_calls": [{"name": "increment_counter", "arguments": {"count": delta}}]},
            {"text": "Done."},
        ]
    raise ValueError(env)


PASSING_TASKS = {0, 1, 2}  # of the 5 example rows; tasks 3 and 4 are scripted to fail


def known_reward_scripts(env: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    texts = [user_text(r) for r in rows]
    for i, a in enumerate(texts):  # each rule must select exactly its own row
        assert all(a not in b for j, b in enumerate(texts) if j != i), f"user text of row {i} is not unique"
    return [
        {"contains": text, "turns": (passing_turns if i in PASSING_TASKS else failing_turns)(env, row)}
        for i, (text, row) in enumerate(zip(texts, rows, strict=True))
    ]


# ------------------------------------------------------------------------------------------------
# 1. 1,000 rollouts per example environment through the CLI.


@pytest.mark.parametrize("env", ENVS)
def test_thousand_rollouts_per_environment(env: str, tmp_path: Path) -> None:
    rows = example_rows(env)
    assert len(rows) == 5
    repeats = 200
    total = len(rows) * repeats
    input_path = write_jsonl(tmp_path / "input.jsonl", rows)
    out = tmp_path / "out" / "rollouts.jsonl"  # the output folder does not exist yet
    agent = f"{env}_simple_agent"
    with running_servers(
        [config_of(env)], model_extra(scripts_by_input=known_reward_scripts(env, rows))
    ) as helper:
        code, stdout, stderr = collect(
            base_args(
                input_path,
                out,
                f"+num_repeats={repeats}",
                "+responses_create_params.temperature=0.3",
                "+num_repeats_add_seed=true",
                agent=agent,
            ),
            head_port(helper),
            tmp_path,
        )
    assert code == 0, stderr[-3000:]
    side = sidecar_paths(out)

    # The materialized inputs: abc -> aabbcc, with the merged params and the seed.
    materialized = read_jsonl(side["materialized"])
    assert pairs(materialized) == [(t, r) for t in range(len(rows)) for r in range(repeats)]
    for m in materialized:
        src = rows[m["_ng_task_index"]]
        assert m["responses_create_params"]["temperature"] == 0.3
        assert m["responses_create_params"]["seed"] == m["_ng_rollout_index"]
        assert m["responses_create_params"]["input"] == src["responses_create_params"]["input"]
        assert {k: v for k, v in m.items() if k in src and k != "responses_create_params"} == {
            k: v for k, v in src.items() if k != "responses_create_params"
        }
        assert m["agent_ref"] == {"type": "responses_api_agents", "name": agent}

    # The output: exactly 1,000 lines, every pair once, all fields there.
    lines = out.read_bytes().splitlines()
    assert len(lines) == total
    results = [orjson.loads(line) for line in lines]
    assert Counter(pairs(results)) == Counter({(t, r): 1 for t in range(len(rows)) for r in range(repeats)})
    token_sum = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
    for res in results:
        t, r = res["_ng_task_index"], res["_ng_rollout_index"]
        src = rows[t]
        assert isinstance(res["reward"], float)
        assert res["reward"] == (1.0 if t in PASSING_TASKS else 0.0), (t, res["response"]["output"])
        assert res["agent_ref"] == {"type": "responses_api_agents", "name": agent}
        for key, value in src.items():
            if key != "responses_create_params":
                assert res[key] == value, key
        params = res["responses_create_params"]
        assert params["temperature"] == 0.3 and params["seed"] == r
        assert res["response"]["temperature"] == 0.3  # it reached the model
        for key in token_sum:
            token_sum[key] += res["response"]["usage"][key]
    assert side["failures"].read_bytes() == b""

    # Aggregate metrics: known rewards give exact numbers.
    metrics = orjson.loads(side["metrics"].read_bytes())
    share = len(PASSING_TASKS) / len(rows)
    assert metrics["expected_rollouts"] == metrics["rollouts_ok"] == metrics["num_rollouts"] == total
    assert metrics["rollouts_missing"] == 0 and metrics["interrupted"] is False
    assert metrics["this_run"]["ok"] == total and metrics["this_run"]["failed"] == 0
    assert metrics["this_run"]["rollouts_per_s"] > 0
    assert metrics["mean/reward"] == pytest.approx(share)
    assert metrics["std/reward"] == pytest.approx(math.sqrt(share * (1 - share)))
    assert metrics["tokens"] == token_sum and token_sum["total_tokens"] > 0
    assert metrics["num_tasks"] == len(rows)
    ks = k_values(repeats)
    assert ks == [1, 2, 4, 8, 16, 32, 64, 128, 200]
    for t in range(len(rows)):
        task = metrics["per_task"][str(t)]
        passed = t in PASSING_TASKS
        assert task["num_rollouts"] == repeats and task["num_passed"] == (repeats if passed else 0)
        assert task["mean_reward"] == (1.0 if passed else 0.0) and task["std_reward"] == 0.0
        assert [task[f"pass@{k}"] for k in ks] == [1.0 if passed else 0.0] * len(ks)
    assert [metrics[f"pass@{k}"] for k in ks] == [pytest.approx(share)] * len(ks)
    assert metrics["files"] == {"output": str(out), **{k: str(v) for k, v in side.items()}}

    # The printed summary.
    assert f"Rollouts: {total} / {total} ok" in stdout
    assert re.search(rf"This run: {total} ok, 0 failed in [0-9.]+ s \(([0-9.]+) rollouts/s\)", stdout)
    assert re.search(r"reward\s+mean 0\.6000  std 0\.4899", stdout)
    assert "pass@1=0.600" in stdout and "pass@200=0.600" in stdout and "pass@3=" not in stdout
    tok = token_sum
    assert (
        f"tokens: input {tok['input_tokens']}, output {tok['output_tokens']}, total {tok['total_tokens']}"
        in stdout
    )
    for path in (out, *side.values()):
        assert str(path) in stdout
    assert stdout.rstrip().splitlines()[-1] == "Average reward: 0.6000"


# ------------------------------------------------------------------------------------------------
# 2. A resources server killed mid-run; restart and resume.


def test_killed_resources_server_then_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = example_rows(WEATHER)
    input_path = write_jsonl(tmp_path / "input.jsonl", rows)
    out = tmp_path / "rollouts.jsonl"
    side = sidecar_paths(out)
    everything = {(t, r) for t in range(5) for r in range(200)}
    slow = [
        {"delay_s": 0.2, "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
        {"text": "ok"},
    ]
    args = base_args(input_path, out, "+num_repeats=200", "+num_samples_in_parallel=500", "+progress=false")

    with running_servers([config_of(WEATHER)], model_extra(script=slow)) as helper:
        proc = start_collect(args, head_port(helper), tmp_path)
        try:
            wait_for_lines(out, 500, proc)
            kill9(server_pid(helper, WEATHER))
            code, stdout, stderr = finish(proc, tmp_path)
        finally:
            _kill_group(proc)
    assert code == 3, stderr[-3000:]  # stopped early: the resources server is down
    done = read_jsonl(out)
    failed = read_jsonl(side["failures"])
    done_pairs, failed_pairs = pairs(done), pairs(failed)
    assert len(done_pairs) == len(set(done_pairs)) >= 500
    assert len(failed_pairs) == len(set(failed_pairs)) > 0
    assert set(done_pairs).isdisjoint(failed_pairs)  # a failed rollout is never in the output
    not_attempted = orjson.loads(side["metrics"].read_bytes())["not_attempted"]
    assert len(done_pairs) + len(failed_pairs) + not_attempted == len(everything)
    assert all(isinstance(r["reward"], float) for r in done)
    for f in failed:
        assert f["kind"] == "connection_error", f
        assert f["server"] == WEATHER, f
        assert f["path"] in ("/seed_session", "/get_weather", "/verify"), f
        assert f["attempt"] == 1
        assert f["via"]["server"] == WEATHER_AGENT and f["via"]["status"] == 502
        assert f["agent_ref"]["name"] == WEATHER_AGENT
    assert f"{len(everything) - len(done_pairs)} missing" in stdout and "resume_from_cache=true" in stdout

    # New servers (a new head port); the resume runs exactly the failed pairs.
    quick = [{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}, {"text": "ok"}]
    with running_servers([config_of(WEATHER)], model_extra(script=quick)) as helper:
        code, stdout, stderr = collect_here([*args, "+resume_from_cache=true"], head_port(helper), capsys)
        assert code == 0, stderr[-3000:]
        final = read_jsonl(out)
        assert Counter(pairs(final)) == Counter(dict.fromkeys(everything, 1))
        assert pairs(final)[: len(done_pairs)] == done_pairs  # earlier lines untouched
        assert read_jsonl(side["failures"]) == failed  # nothing failed this time
        summary = orjson.loads(side["metrics"].read_bytes())
        missing = len(everything) - len(done_pairs)
        assert summary["this_run"] == summary["this_run"] | {"ok": missing, "failed": 0}
        assert summary["rollouts_ok"] == 1000 and summary["rollouts_missing"] == 0

        # A dead agent: every rollout fails with a connection error naming the agent.
        kill9(server_pid(helper, WEATHER_AGENT))
        out2 = tmp_path / "dead_agent.jsonl"
        code, stdout, stderr = collect_here(base_args(input_path, out2), head_port(helper), capsys)
    assert code == 3, stderr[-3000:]
    assert out2.read_bytes() == b""
    failed2 = read_jsonl(sidecar_paths(out2)["failures"])
    assert sorted(pairs(failed2)) == [(t, 0) for t in range(5)]
    assert {(f["kind"], f["server"], f["path"], f["attempt"]) for f in failed2} == {
        ("connection_error", WEATHER_AGENT, "/run", 1)
    }


# ------------------------------------------------------------------------------------------------
# Shared servers for the remaining CLI tests: the scripted model picks a behaviour by a marker in
# the user message.

SLOW = "[slow]"
FAIL_503 = "[fail503]"
HANG = "[hang]"


@pytest.fixture(scope="module")
def weather() -> Iterator[RunHelper]:
    call = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    rules = [
        {"contains": SLOW, "turns": [{**call, "delay_s": 0.25}, {"text": "ok"}]},
        {"contains": FAIL_503, "turns": [{"http_error": 503}]},
        {"contains": HANG, "turns": [{"delay_s": 6.0, "text": "late"}]},
    ]
    with running_servers([config_of(WEATHER)], model_extra(scripts_by_input=rules)) as helper:
        yield helper


# ------------------------------------------------------------------------------------------------
# 3. Malformed input and refused outputs.


def test_malformed_input_reported_all_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = example_rows(WEATHER)[0]
    lines = [
        orjson.dumps({**good, "agent_ref": {"type": "responses_api_agents", "name": WEATHER_AGENT}}).decode(),
        '{"responses_create_params": {"input": "hi"',  # not JSON (cut short)
        orjson.dumps(
            {**good, "responses_create_params": {**good["responses_create_params"], "temperatur": 0.3}}
        ).decode(),
        "",  # blank lines are skipped but still counted
        orjson.dumps({**good, "responses_create_params": {"input": "hi", "temperature": "hot"}}).decode(),
        orjson.dumps(good).decode(),  # no agent_ref and no +agent_name
        '["a list"]',
    ]
    input_path = tmp_path / "tasks.jsonl"
    input_path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    # No server answers at this port: bad input is reported before anything is contacted.
    code, _, stderr = collect_here(base_args(input_path, out, agent=None), refusing_port(), capsys)
    assert code == 2
    where = str(input_path)
    assert "5 line(s)" in stderr and "nothing was sent" in stderr
    assert f"{where}:2: not valid JSON" in stderr
    assert f"{where}:3: field `responses_create_params.temperatur`" in stderr
    assert f"{where}:5: field `responses_create_params.temperature`" in stderr
    assert f"{where}:6: no agent" in stderr
    assert f"{where}:7: a row must be a JSON object" in stderr
    assert f"{where}:1:" not in stderr and f"{where}:4:" not in stderr
    assert not out.exists()
    assert not any(p.exists() for p in sidecar_paths(out).values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tasks.jsonl"]


def test_unknown_agent_missing_input_and_bad_options(
    weather: RunHelper, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    input_path = write_jsonl(tmp_path / "tasks.jsonl", example_rows(WEATHER))
    out = tmp_path / "out.jsonl"
    port = head_port(weather)

    code, _, stderr = collect_here(base_args(input_path, out, agent="no_such_agent"), port, capsys)
    assert code == 2
    assert "'no_such_agent'" in stderr and f"Running agents: {WEATHER_AGENT}" in stderr
    assert not out.exists() and not any(p.exists() for p in sidecar_paths(out).values())

    code, _, stderr = collect_here(base_args(tmp_path / "nope.jsonl", out), port, capsys)
    assert code == 2 and f"Input file {tmp_path / 'nope.jsonl'} does not exist" in stderr
    assert "Traceback" not in stderr

    code, _, stderr = collect_here([*base_args(input_path, out), "+num_repeat=3"], port, capsys)
    assert code == 2 and "unknown option(s): +num_repeat" in stderr

    code, _, stderr = collect_here([*base_args(input_path, out), "+num_repeats=0"], port, capsys)
    assert code == 2 and "+num_repeats" in stderr
    assert not out.exists()

    code, _, stderr = collect_here(base_args(input_path, input_path, "+overwrite=true"), port, capsys)
    assert code == 2 and "is the input file" in stderr
    assert read_jsonl(input_path) == example_rows(WEATHER)


def test_existing_output_is_refused_and_untouched(
    weather: RunHelper, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    input_path = write_jsonl(tmp_path / "tasks.jsonl", example_rows(WEATHER))
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"reward": 1.0, "_ng_task_index": 0, "_ng_rollout_index": 0}\n')
    before = out.read_bytes()
    code, _, stderr = collect_here(base_args(input_path, out), head_port(weather), capsys)
    assert code == 2 and "already has rollouts" in stderr and "+resume_from_cache=true" in stderr
    assert out.read_bytes() == before
    assert not any(p.exists() for p in sidecar_paths(out).values())


# ------------------------------------------------------------------------------------------------
# 4. Ctrl+C, resume, and refused resumes.


def test_interrupt_then_resume(
    weather: RunHelper, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [with_marker(r, SLOW) for r in example_rows(WEATHER)]
    input_path = write_jsonl(tmp_path / "tasks.jsonl", rows)
    out = tmp_path / "rollouts.jsonl"
    side = sidecar_paths(out)
    port = head_port(weather)
    args = base_args(input_path, out, "+num_repeats=100", "+progress=false")

    proc = start_collect([*args, "+num_samples_in_parallel=20"], port, tmp_path)
    try:
        wait_for_lines(out, 40, proc)
        proc.send_signal(signal.SIGINT)
        code, stdout, stderr = finish(proc, tmp_path, timeout=60)
    finally:
        _kill_group(proc)
    assert code == 130, stderr[-3000:]
    assert "INTERRUPTED" in stdout
    data = out.read_bytes()
    assert data.endswith(b"\n")
    first = [orjson.loads(line) for line in data.splitlines()]  # every line whole and parseable
    assert 40 <= len(first) < 500
    assert len(set(pairs(first))) == len(first)
    assert side["failures"].read_bytes() == b""  # cancelled rollouts are not failures
    assert orjson.loads(side["metrics"].read_bytes())["interrupted"] is True

    # Refused resumes: num_repeats changed; the input file changed. Nothing is touched.
    snapshot = {p: p.read_bytes() for p in (out, side["materialized"], side["failures"])}
    code, _, stderr = collect_here(
        [*base_args(input_path, out, "+num_repeats=50"), "+resume_from_cache=true"], port, capsys
    )
    assert code == 2 and "Cannot resume" in stderr and "num_repeats" in stderr
    original_input = input_path.read_bytes()
    write_jsonl(input_path, rows[:4] + [with_marker(rows[4], "(edited)")])
    code, _, stderr = collect_here([*args, "+resume_from_cache=true"], port, capsys)
    assert code == 2 and "Cannot resume" in stderr and "line 401" in stderr
    assert {p: p.read_bytes() for p in snapshot} == snapshot
    input_path.write_bytes(original_input)

    code, stdout, stderr = collect(
        [*args, "+resume_from_cache=true", "+num_samples_in_parallel=250"], port, tmp_path
    )
    assert code == 0, stderr[-3000:]
    final = read_jsonl(out)
    assert final[: len(first)] == first
    assert Counter(pairs(final)) == Counter({(t, r): 1 for t in range(5) for r in range(100)})
    summary = orjson.loads(side["metrics"].read_bytes())
    assert summary["this_run"]["ok"] == 500 - len(first) and summary["rollouts_ok"] == 500
    assert "Rollouts: 500 / 500 ok" in stdout


def test_failures_retried_up_to_max_attempts(
    weather: RunHelper, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = example_rows(WEATHER)
    # Task 0 and 1 run normally; task 2's model answers 503; task 3's rollout outlives the timeout.
    rows = [base[0], base[1], with_marker(base[2], FAIL_503), with_marker(base[3], HANG)]
    input_path = write_jsonl(tmp_path / "tasks.jsonl", rows)
    out = tmp_path / "rollouts.jsonl"
    side = sidecar_paths(out)
    port = head_port(weather)
    args = base_args(input_path, out, "+num_repeats=2", "+request_timeout_s=2", "+max_attempts=2")

    code, stdout, stderr = collect_here(args, port, capsys)
    assert code == 1, stderr[-3000:]
    assert sorted(pairs(read_jsonl(out))) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    failed = read_jsonl(side["failures"])
    by_pair = {(f["_ng_task_index"], f["_ng_rollout_index"]): f for f in failed}
    assert sorted(by_pair) == [(2, 0), (2, 1), (3, 0), (3, 1)] and len(failed) == 4
    for r in (0, 1):
        f503, hang = by_pair[(2, r)], by_pair[(3, r)]
        assert (f503["kind"], f503["server"], f503["path"], f503["status"], f503["attempt"]) == (
            "http_error",
            "policy_model",
            "/v1/responses",
            503,
            1,
        )
        assert f503["via"] == {"server": WEATHER_AGENT, "path": "/run", "status": 502}
        assert (hang["kind"], hang["server"], hang["path"], hang["attempt"]) == (
            "timeout",
            WEATHER_AGENT,
            "/run",
            1,
        )
    assert "4 infrastructure failure(s)" in stdout

    code, stdout, stderr = collect_here([*args, "+resume_from_cache=true"], port, capsys)
    assert code == 1, stderr[-3000:]
    failed = read_jsonl(side["failures"])
    assert len(failed) == 8 and sorted(f["attempt"] for f in failed) == [1] * 4 + [2] * 4
    summary = orjson.loads(side["metrics"].read_bytes())
    assert summary["this_run"]["ok"] == 0 and summary["this_run"]["failed"] == 4

    code, stdout, stderr = collect_here([*args, "+resume_from_cache=true"], port, capsys)
    assert code == 1, stderr[-3000:]
    summary = orjson.loads(side["metrics"].read_bytes())
    assert summary["this_run"]["ok"] == summary["this_run"]["failed"] == 0
    assert summary["skipped_after_max_attempts"] == 4 and summary["rollouts_missing"] == 4
    assert "4 rollout(s) skipped" in stdout
    assert len(read_jsonl(side["failures"])) == 8 and len(read_jsonl(out)) == 4

    # A higher +max_attempts lets them run again.
    code, _, stderr = collect_here([*args[:-1], "+max_attempts=3", "+resume_from_cache=true"], port, capsys)
    assert code == 1, stderr[-3000:]
    assert sorted(f["attempt"] for f in read_jsonl(side["failures"])) == [1] * 4 + [2] * 4 + [3] * 4


def test_agent_own_http_error_is_classified(weather: RunHelper) -> None:
    # The collector validates rows, so a row the agent itself refuses (422) is sent directly here.
    row = {
        **example_rows(WEATHER)[0],
        "responses_create_params": {"input": "hi", "not_a_param": 1},
        "agent_ref": {"type": "responses_api_agents", "name": WEATHER_AGENT},
        "_ng_task_index": 0,
        "_ng_rollout_index": 0,
    }

    async def attempt() -> BaseException:
        client = ServerClient.load_from_global_config(weather.head_server_config)
        try:
            await run_one(client, row, timeout_s=30)
        except UpstreamError as e:
            return e
        finally:
            await close_shared_session()
        raise AssertionError("the agent accepted an unknown responses_create_params key")

    exc = asyncio.run(attempt())
    failure = classify_failure(exc, WEATHER_AGENT)
    assert (failure["kind"], failure["server"], failure["path"], failure["status"]) == (
        "validation_error",
        WEATHER_AGENT,
        "/run",
        422,
    )
    assert "not_a_param" in failure["error"]


# ------------------------------------------------------------------------------------------------
# Live collection stats: +metrics_port's GET /metrics while it runs, the progress postfix, the live block.


def scrape(url: str) -> dict[str, float]:
    """The collector's ``GET /metrics`` as {series (name and labels as exposed): value}."""
    import httpx

    resp = httpx.get(url, timeout=5, trust_env=False)
    assert resp.status_code == 200, resp.text[:500]
    out = {}
    for line in resp.text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            out[series] = float(value)
    return out


def test_live_stats_on_metrics_port_progress_and_aggregate_file(weather: RunHelper, tmp_path: Path) -> None:
    base = example_rows(WEATHER)
    # In this order, one at a time: two rollouts that succeed, one whose model answers 503, one that
    # outlives +request_timeout_s (a window in which the counts must be exactly 2 ok and 1 failed).
    rows = [base[0], base[1], with_marker(base[2], FAIL_503), with_marker(base[3], HANG)]
    input_path = write_jsonl(tmp_path / "tasks.jsonl", rows)
    out = tmp_path / "rollouts.jsonl"
    side = sidecar_paths(out)
    args = base_args(
        input_path,
        out,
        "+num_samples_in_parallel=1",
        "+request_timeout_s=5",
        "+max_attempts=1",
        "+metrics_port=0",
    )
    proc = start_collect(args, head_port(weather), tmp_path)
    try:
        deadline = time.monotonic() + 60
        url = None
        while url is None:
            found = re.search(
                r"Live collection stats: (http://127\.0\.0\.1:\d+/metrics)",
                (tmp_path / "collect.stdout").read_text(),
            )
            url = found.group(1) if found else None
            assert proc.poll() is None and time.monotonic() < deadline, (
                tmp_path / "collect.stderr"
            ).read_text()
            time.sleep(0.05)
        wait_for_lines(out, 2, proc)
        wait_for_lines(side["failures"], 1, proc)
        seen: dict[str, float] = {}
        while time.monotonic() < deadline:  # the hanging rollout is in flight for 5 s
            seen = scrape(url)
            if seen.get('nemo_gym_collection_rollouts_failed_total{kind="http_error"}') == 1:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the collector ended before the mid-run scrape"
        assert seen["nemo_gym_collection_rollouts_ok_total"] == 2
        assert seen['nemo_gym_collection_rollouts_failed_total{kind="http_error"}'] == 1
        assert seen["nemo_gym_collection_rollouts_planned"] == 4
        assert seen["process_resident_memory_bytes"] > 0
        code, stdout, stderr = finish(proc, tmp_path)
    finally:
        _kill_group(proc)
    assert code == 1, stderr[-3000:]  # two rollouts missing
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):  # the server stopped with the run
        s.connect(("127.0.0.1", port))

    written = read_jsonl(out)
    rewards = [float(r["reward"]) for r in written]
    usage = [r["response"]["usage"] for r in written]
    assert len(written) == 2 and all(u["total_tokens"] > 0 for u in usage)
    live = orjson.loads(side["metrics"].read_bytes())["live"]
    assert live["rollouts_ok"] == 2 and live["rollouts_failed"] == 2 and live["rollouts_not_persisted"] == 0
    assert live["failures_by_kind"] == {"http_error": 1, "timeout": 1}
    assert live["reward"]["count"] == 2
    assert live["reward"]["mean"] == pytest.approx(sum(rewards) / 2)
    assert live["reward"]["std"] == pytest.approx(abs(rewards[0] - rewards[1]) / 2)
    for key in ("input_tokens", "output_tokens", "total_tokens"):
        assert live["tokens"][key] == sum(u[key] for u in usage), key
    assert live["rollouts_per_s"] == pytest.approx(2 / live["wall_time_s"])
    assert live["tokens_per_s"] == pytest.approx(live["tokens"]["total_tokens"] / live["wall_time_s"])
    # The progress bar's last postfix: the same numbers.
    assert "failed=2 (http_error 1, timeout 1)" in stderr, stderr[-2000:]
    assert f"reward={live['reward']['mean']:.3f}±{live['reward']['std']:.3f}" in stderr


# ------------------------------------------------------------------------------------------------
# Resume bookkeeping on a damaged output file (no servers needed).


def test_scan_existing_output_repairs_only_the_tail(tmp_path: Path) -> None:
    def row(t: int, r: int) -> bytes:
        return orjson.dumps({"reward": 1.0, "_ng_task_index": t, "_ng_rollout_index": r})

    path = tmp_path / "out.jsonl"
    path.write_bytes(row(0, 0) + b"\n" + b"garbage\n" + row(0, 1) + b"\n" + row(0, 2)[:-7])
    done, bad = _scan_existing_output(path)
    assert done == {(0, 0), (0, 1)} and bad == 1
    assert (
        path.read_bytes() == row(0, 0) + b"\n" + b"garbage\n" + row(0, 1) + b"\n"
    )  # only the cut-off tail goes

    path.write_bytes(row(1, 0) + b"\n" + row(1, 1))  # a whole rollout that lost only its newline
    done, bad = _scan_existing_output(path)
    assert done == {(1, 0), (1, 1)} and bad == 0
    assert path.read_bytes() == row(1, 0) + b"\n" + row(1, 1) + b"\n"


# ------------------------------------------------------------------------------------------------
# 5. Memory: the input is streamed.

MEMORY_SCRIPT = textwrap.dedent(
    """
    import resource, sys
    import psutil
    from nemo_gym.collection.input_rows import materialize, validate_input
    from nemo_gym.collection.options import RolloutCollectionConfig

    def cfg(path):
        return RolloutCollectionConfig(
            input_jsonl_fpath=path, output_jsonl_fpath=path + ".out", agent_name="agent", num_repeats=2
        )

    # Warm up (pydantic builds its validators lazily) on a tiny file, then measure the big one.
    validate_input(cfg(sys.argv[2]))
    sum(1 for _ in materialize(cfg(sys.argv[2])))
    before = max(psutil.Process().memory_info().rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    n, agents = validate_input(cfg(sys.argv[1]))
    count = sum(1 for _ in materialize(cfg(sys.argv[1])))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(n, count, sorted(agents), peak - before)
    """
)


def test_validation_and_materialization_stream_the_input(tmp_path: Path) -> None:
    big = tmp_path / "big.jsonl"
    n_rows = 200_000
    with open(big, "wb") as f:
        for i in range(n_rows):
            f.write(
                orjson.dumps({"responses_create_params": {"input": f"question {i} " + "x" * 150}, "id": i})
                + b"\n"
            )
    small = write_jsonl(tmp_path / "small.jsonl", [{"responses_create_params": {"input": "warm-up"}}])
    size = big.stat().st_size
    assert size > 40_000_000
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(big), str(small)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    n, count, agents, growth = proc.stdout.split(maxsplit=3)
    assert (int(n), int(count), agents.strip()) == (n_rows, 2 * n_rows, "['agent']")
    # Holding the rows would take several times the file size; streaming takes a few MB at most.
    assert int(growth) < size / 8, (
        f"peak RSS grew by {int(growth) / 2**20:.1f} MiB for a {size / 2**20:.0f} MiB file"
    )
