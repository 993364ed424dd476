"""ng_quickstart end to end with the real model: 5 rollouts, real tool calls, the summary, clean stop."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import psutil
import pytest

from nemo_gym.tools.quickstart import run_quickstart
from responses_api_models.local_model.weights import default_model_unavailable

WAIT_S = 600.0  # bound on every wait (a whole quickstart takes ~50 s here)

QUICKSTART_WEIGHTS = "qwen2.5-coder-1.5b-instruct-q4_k_m"
pytestmark = pytest.mark.skipif(
    default_model_unavailable(weights=QUICKSTART_WEIGHTS) is not None,
    reason=f"needs the quickstart's local model: {default_model_unavailable(weights=QUICKSTART_WEIGHTS)}",
)


def test_quickstart_collects_five_rollouts_and_prints_each_and_the_average(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What ng_quickstart guarantees on any machine; not what the model chooses to do.

    Whether the model calls the tool or answers well differs between CPUs (greedy decoding rounds
    differently), so this checks the job: five rollouts written, each a valid trajectory scored by
    the verifier, each shown, and the printed average equal to the rewards written.
    """
    output = tmp_path / "quickstart_rollouts.jsonl"
    assert run_quickstart([], output=output) == 0
    printed = capsys.readouterr().out
    rows = [orjson.loads(line) for line in output.read_bytes().splitlines()]
    assert sorted(r["_ng_task_index"] for r in rows) == [0, 1, 2, 3, 4]
    for row in rows:
        items = row["response"]["output"]
        assert items and row["reward"] in (0.0, 1.0)
        assert row["reward"] == float(row["called_for_expected_city"] and row["answer_reports_weather"])
        # Every call the model made was answered by the environment, call by call.
        calls = [i["call_id"] for i in items if i["type"] == "function_call"]
        results = [i["call_id"] for i in items if i["type"] == "function_call_output"]
        assert results == calls[: len(results)]
        assert row["response"]["usage"]["output_tokens"] > 0
        assert row["response"]["model"] == "qwen2.5-coder-1.5b-instruct-q4_k_m"
    for index, row in enumerate(sorted(rows, key=lambda r: r["_ng_task_index"]), start=1):
        assert f"[{index}] Q: " in printed and f"reward    : {row['reward']:.1f}" in printed
    mean = sum(r["reward"] for r in rows) / len(rows)
    assert f"Average reward: {mean:.4f}" in printed


def test_ctrl_c_stops_every_server(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "nemo_gym.tools.quickstart"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    lines: list[str] = []
    collecting = threading.Event()
    output_ended = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace")
            lines.append(line)
            if "collecting 5 rollouts" in line:
                collecting.set()
        output_ended.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    children: list[psutil.Process] = []
    try:
        # Wait for the collection to start, but not past the end of the output (a failed start-up).
        deadline = time.monotonic() + WAIT_S
        while not collecting.is_set() and not output_ended.is_set() and time.monotonic() < deadline:
            collecting.wait(0.2)
        assert collecting.is_set(), "".join(lines[-40:])
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 3  # model, environment, agent
        proc.send_signal(signal.SIGINT)
        assert proc.wait(WAIT_S) == 130, "".join(lines[-40:])
        _gone, alive = psutil.wait_procs(children, timeout=30)
        assert alive == [], f"servers still running after Ctrl+C: {alive}"
        reader.join(10)
        text = "".join(lines)
        assert re.search(r"INTERRUPTED|interrupted", text), text[-2000:]
    finally:
        for p in [*children, psutil.Process(proc.pid)] if proc.poll() is None else children:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait(10)
