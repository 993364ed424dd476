"""remote_app.py against Aviary's real TaskDatasetServer: GSM8K from the local file, over real HTTP.

Two task-dataset servers run in subprocesses on 127.0.0.1 with an API key (``serve_task_dataset.py``,
Aviary's ``TaskDatasetServer`` app under uvicorn): one serves the module, the other is stopped in the
middle of a rollout. Three remote resources servers point at them (the right key, a wrong key, the
doomed server), each with an aviary_agent, on the scripted model (turns picked by a tag in the row).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from nemo_gym.cli import RunHelper
from nemo_gym.tools.testing import collect_rollouts, get, post_json, run_rollout, running_servers, server_url

pytestmark = pytest.mark.slow  # two task-dataset servers and seven run servers: ~90 s on 2 busy cores

HERE = Path(__file__).resolve().parents[1]
REPO = HERE.parents[1]
CONFIG = "resources_servers/aviary/configs/remote_aviary.yaml"
REMOTE, AGENT = "remote_aviary_resources_server", "remote_aviary_agent"
BADKEY, BADKEY_AGENT = "remote_badkey", "remote_badkey_agent"
DOOMED, DOOMED_AGENT = "remote_doomed", "remote_doomed_agent"
API_KEY = "aviary-test-key-7f3c"  # the task-dataset servers' key (a test value, not a real secret)
START_TIMEOUT_S = 120  # importing Aviary (LiteLLM) takes 25 s on a busy 2-core machine

PROBLEMS = [json.loads(line) for line in (HERE / "data" / "gsm8k_problems.jsonl").read_text().splitlines()]
ANSWERS = [p["answer"].rsplit("####", 1)[1].strip() for p in PROBLEMS]


def _submit(answer: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "submit_answer", "arguments": {"answer": answer}}]}


def _calc(expr: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "calculator", "arguments": {"expr": expr}}]}


TAGGED: dict[str, list[dict[str, Any]]] = {
    "[right]": [_calc("3*12-7"), _submit("29")],
    "[wrong]": [_calc("3*12+7"), _submit("43")],
    "[slow]": [{"delay_s": 5.0, **_calc("3*12-7")}, _submit("29")],
}


def _scripts() -> list[dict[str, Any]]:
    rules = [{"contains": tag, "turns": turns} for tag, turns in TAGGED.items()]
    rules += [
        {"contains": p["question"], "turns": [_submit(a)]} for p, a in zip(PROBLEMS, ANSWERS, strict=True)
    ]
    return rules


def _row(task_idx: int, tag: str | None = None) -> dict[str, Any]:
    items = [{"role": "user", "content": f"Solve the problem. {tag}"}] if tag else []
    return {"task_idx": task_idx, "responses_create_params": {"input": items}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TaskDatasetProcess:
    """Aviary's TaskDatasetServer hosting the local GSM8K file, in a subprocess (``wait_ready``: bounded)."""

    def __init__(self, log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log.open("wb")
        env = {**os.environ, "AVIARY_DATASET_SERVER_API_KEY": API_KEY, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "resources_servers.aviary.serve_task_dataset", "gsm8k"]
            + ["--port", str(self.port)],
            cwd=REPO,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self) -> None:
        log = Path(self._log.name)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the task-dataset server exited: {log.read_text()[-2000:]}")
            try:
                resp = httpx.get(
                    self.url + "/info", headers={"X-API-Key": API_KEY}, timeout=2, trust_env=False
                )
                if resp.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the task-dataset server did not start in {START_TIMEOUT_S} s")
            time.sleep(0.2)

    def info(self) -> dict[str, Any]:
        resp = httpx.get(self.url + "/info", headers={"X-API-Key": API_KEY}, timeout=5, trust_env=False)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def stop(self, abruptly: bool = False) -> None:
        if self.proc.poll() is None:
            (self.proc.kill if abruptly else self.proc.terminate)()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._log.close()


@pytest.fixture(scope="module")
def remotes(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[TaskDatasetProcess, TaskDatasetProcess]]:
    logs = tmp_path_factory.mktemp("task_dataset_servers")
    # Both start at once (importing Aviary takes most of a start); each wait is bounded.
    main, doomed = TaskDatasetProcess(logs / "main.log"), TaskDatasetProcess(logs / "doomed.log")
    try:
        main.wait_ready()
        doomed.wait_ready()
        yield main, doomed
    finally:
        main.stop()
        doomed.stop()


def _agent(resources: str) -> dict[str, Any]:
    return {
        "responses_api_agents": {
            "aviary_agent": {
                "entrypoint": "app.py",
                "resources_server": {"type": "resources_servers", "name": resources},
                "model_server": {"type": "responses_api_models", "name": "policy_model"},
                "max_steps": 5,
            }
        }
    }


@pytest.fixture(scope="module")
def helper(remotes: tuple[TaskDatasetProcess, TaskDatasetProcess]) -> Iterator[RunHelper]:
    main, doomed = remotes
    block = {"entrypoint": "remote_app.py", "domain": "other", "request_timeout_s": 20}
    extra = {
        # The run's secrets: what env.yaml would set.
        "aviary_dataset_server_url": main.url,
        "aviary_dataset_server_api_key": API_KEY,
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": _scripts()}}},
        BADKEY: {
            "resources_servers": {
                "aviary": {**block, "dataset_server_url": main.url, "dataset_server_api_key": "not-the-key"}
            }
        },
        BADKEY_AGENT: _agent(BADKEY),
        DOOMED: {
            "resources_servers": {
                "aviary": {**block, "dataset_server_url": doomed.url, "dataset_server_api_key": API_KEY}
            }
        },
        DOOMED_AGENT: _agent(DOOMED),
    }
    with running_servers([CONFIG], extra) as h:
        yield h


def _outputs(result: dict[str, Any]) -> list[str]:
    return [o["output"] for o in result["response"]["output"] if o.get("type") == "function_call_output"]


def _stats(helper: RunHelper, server: str) -> dict[str, Any]:
    resp = get(server_url(helper, server) + "/env_stats")
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_right_and_wrong_answers_get_aviarys_rewards_over_http(
    helper: RunHelper, remotes: tuple[TaskDatasetProcess, TaskDatasetProcess]
) -> None:
    right = run_rollout(helper, AGENT, _row(0, "[right]"))
    assert right["reward"] == 1.0 and right["step_rewards"] == [0.0, 1.0] and right["env_done"]
    assert _outputs(right) == ["29", "True"]
    assert right["response"]["output"][0]["content"] == PROBLEMS[0]["question"]
    assert {t["name"] for t in right["response"]["tools"]} == {"calculator", "submit_answer"}
    wrong = run_rollout(helper, AGENT, _row(0, "[wrong]"))
    assert wrong["reward"] == 0.0 and wrong["step_rewards"] == [0.0, 0.0]
    assert _outputs(wrong) == ["43", "False"]
    # Every rollout closed its env, here and on the task-dataset server.
    assert _stats(helper, REMOTE)["live"] == 0
    assert remotes[0].info()["running_env_ids"] == []


def test_every_example_row_scores_one(helper: RunHelper) -> None:
    rows = [orjson.loads(line) for line in (HERE / "data" / "gsm8k_example.jsonl").read_text().splitlines()]
    for row in rows:
        result = run_rollout(helper, AGENT, row)
        assert result["reward"] == 1.0, (row, _outputs(result))
        assert result["response"]["output"][0]["content"] == PROBLEMS[row["task_idx"]]["question"]


def test_contract_errors_are_the_in_process_servers(
    helper: RunHelper, remotes: tuple[TaskDatasetProcess, TaskDatasetProcess]
) -> None:
    url = server_url(helper, REMOTE)
    n = len(PROBLEMS)
    resp = post_json(url + "/seed_session", {"task_idx": n})
    assert resp.status_code == 422 and f"this dataset has {n} tasks" in resp.text
    resp = post_json(url + "/step", {"env_id": "nope", "action": []})
    assert resp.status_code == 404 and "unknown env_id" in resp.text
    # An env the remote dropped behind our back: a 404 for that env, not a reward or a tool error.
    seeded = post_json(url + "/seed_session", {"task_idx": 1})
    assert seeded.status_code == 200, seeded.text
    env_id, cookies = seeded.json()["env_id"], dict(seeded.cookies)
    (remote_id,) = remotes[0].info()["running_env_ids"]
    dropped = httpx.post(
        remotes[0].url + "/close", json={"env_id": remote_id}, headers={"X-API-Key": API_KEY}, trust_env=False
    )
    assert dropped.status_code == 200, dropped.text
    call = {"type": "function_call", "call_id": "c1", "name": "calculator", "arguments": '{"expr": "1+1"}'}
    resp = post_json(url + "/step", {"env_id": env_id, "action": [call]}, cookies=cookies)
    assert resp.status_code == 404 and "does not know this env" in resp.text, resp.text
    closed = post_json(url + "/close", {"env_id": env_id}, cookies=cookies)
    assert closed.status_code == 200 and closed.json()["success"], closed.text


def test_an_env_raising_in_the_remote_step_is_the_models_tool_error(helper: RunHelper) -> None:
    # Aviary's task-dataset server answers an env raising inside step() with a 500 (here: the calculator
    # called without its argument). That is the model's action, not the remote failing: a tool error the
    # model reads, as with the in-process servers (it was a 502 that dropped the rollout from scoring).
    url = server_url(helper, REMOTE)
    seeded = post_json(url + "/seed_session", {"task_idx": 0})
    assert seeded.status_code == 200, seeded.text
    env_id, cookies = seeded.json()["env_id"], dict(seeded.cookies)
    try:
        call = {"type": "function_call", "call_id": "c1", "name": "calculator", "arguments": "{}"}
        resp = post_json(url + "/step", {"env_id": env_id, "action": [call]}, cookies=cookies)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["reward"] == 0.0 and not body["done"], body
        (output,) = [o["output"] for o in body["obs"] if o.get("type") == "function_call_output"]
        assert output.startswith("Error: RemoteEnvStepError: ") and "expr" in output, output
        assert "Traceback" not in output
    finally:
        post_json(url + "/close", {"env_id": env_id}, cookies=cookies)


def test_a_wrong_api_key_is_a_clear_error_not_a_reward(helper: RunHelper, tmp_path: Path) -> None:
    resp = post_json(server_url(helper, BADKEY) + "/seed_session", {"task_idx": 0})
    assert resp.status_code == 502 and "refused our API key" in resp.text, resp.text
    assert "not-the-key" not in resp.text and API_KEY not in resp.text
    code, out, err = collect_rollouts(helper, [_row(0, "[right]")], tmp_path, BADKEY_AGENT, "+max_attempts=1")
    assert code == 1 and out == [], err[-2000:]
    (failure,) = [
        orjson.loads(line) for line in (tmp_path / "output_failures.jsonl").read_text().splitlines()
    ]
    assert "refused our API key" in failure["error"] and "not-the-key" not in json.dumps(failure)


def test_the_remote_stopping_mid_run_is_a_failure_not_a_reward(
    helper: RunHelper, remotes: tuple[TaskDatasetProcess, TaskDatasetProcess], tmp_path: Path
) -> None:
    doomed = remotes[1]

    def stop_once_seeded() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _stats(helper, DOOMED)["seeded"] < 1:
            time.sleep(0.1)
        doomed.stop(abruptly=True)  # while the model thinks ([slow]: 5 s): the next /step finds no server

    stopper = threading.Thread(target=stop_once_seeded, daemon=True)
    stopper.start()
    code, out, err = collect_rollouts(helper, [_row(0, "[slow]")], tmp_path, DOOMED_AGENT, "+max_attempts=1")
    stopper.join(timeout=60)
    assert not stopper.is_alive()
    assert code == 1 and out == [], err[-2000:]
    (failure,) = [
        orjson.loads(line) for line in (tmp_path / "output_failures.jsonl").read_text().splitlines()
    ]
    assert failure["path"] == "/step" and failure["status"] in (502, 503), failure
    assert "could not be reached" in failure["error"], failure
    assert "reward" not in failure or failure.get("reward") is None
    # The env was closed here even though the remote could not be told.
    assert _stats(helper, DOOMED)["live"] == 0
