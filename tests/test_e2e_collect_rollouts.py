"""``ng_e2e_collect_rollouts`` run as a user runs it: a real subprocess that starts real servers.

Proven here: the datasets of the split that every agent declares are collected with per-agent repeats,
per-agent and overall metrics are right (scripted answers make one weather task pass); Ctrl+C
(SIGINT) stops cleanly with exit 130, every whole line kept and every server gone; a resume finishes
exactly the missing rollouts and keeps the earlier lines; bad input (missing or unknown split, unknown
agent, a split no agent declares, a missing dataset file, rollouts already there) is refused with exit
2 before any server starts, and nothing is written or overwritten.
"""

from __future__ import annotations

import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from nemo_gym.tools.eval.e2e import main as e2e_main
from tests.conftest import REPO, Launcher

WEATHER = "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml"
MULTI = "resources_servers/example_multi_step/configs/example_multi_step.yaml"
MODEL = "responses_api_models/scripted_model/configs/scripted_model.yaml"
CONFIGS = f"+config_paths=[{WEATHER},{MULTI},{MODEL}]"
WEATHER_AGENT = "example_single_tool_call_simple_agent"
MULTI_AGENT = "example_multi_step_simple_agent"
# The Paris task is answered right (tool call with the expected city, then text); the others are not.
PARIS = (
    "+policy_model.responses_api_models.scripted_model.scripts_by_input=[{contains: Paris, turns: "
    "[{tool_calls: [{name: get_weather, arguments: {city: Paris}}]}, {text: It is snowy in Paris right now at 7 degrees Celsius}]}]"
)
BOUND_S = 240.0


def _lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()]


def _scrape(url: str) -> dict[str, float]:
    """A ``GET /metrics`` as {series: value}."""
    resp = httpx.get(url, timeout=5, trust_env=False)
    assert resp.status_code == 200, resp.text[:500]
    return {
        line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
        for line in resp.text.splitlines()
        if line and not line.startswith("#")
    }


def _e2e(launch: Launcher, *args: str) -> Any:
    return launch(
        "-m",
        "nemo_gym.tools.eval.e2e",
        CONFIGS,
        "+head_server.port=0",
        "+progress=false",
        *args,
        cmd=sys.executable,
    )


@pytest.mark.slow
def test_e2e_collect_interrupt_and_resume(tmp_path: Path, launch: Launcher) -> None:
    out = tmp_path / "eval.jsonl"
    common = ["+split=example", f"+output_jsonl_fpath={out}", f"+agent_num_repeats.{MULTI_AGENT}=2", PARIS]
    # Slow model turns so that Ctrl+C lands in the middle of the collection.
    slow = "+policy_model.responses_api_models.scripted_model.script=[{delay_s: 0.4}]"
    first = _e2e(launch, *common, slow, "+num_samples_in_parallel=1", "+metrics_port=0")
    weather_out = tmp_path / "eval" / "rollouts" / f"{WEATHER_AGENT}.jsonl"
    deadline = time.monotonic() + BOUND_S
    while not (weather_out.is_file() and weather_out.read_bytes().count(b"\n") >= 2):
        assert first.proc.poll() is None, first.output
        assert time.monotonic() < deadline, first.output
        time.sleep(0.05)
    # +metrics_port=0: the live stats on a free port, printed at the start, scraped mid-run.
    line = first.wait_for_line(r"Live collection stats: http://127\.0\.0\.1:\d+/metrics", 10)
    assert line is not None, first.output
    url = line.split("Live collection stats: ", 1)[1].strip()
    before = weather_out.read_bytes().count(b"\n")
    live_now = _scrape(url)
    after = weather_out.read_bytes().count(b"\n")
    assert (
        before - 1 <= live_now["nemo_gym_collection_rollouts_ok_total"] <= after
    )  # -1: a line being counted
    assert live_now["nemo_gym_collection_rollouts_planned"] == 5  # the weather agent's; the other not yet
    first.send_signal(signal.SIGINT)
    assert first.wait_exit(BOUND_S) == 130, first.output
    assert first.wait_no_processes() == []  # every server stopped with it
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as sock, pytest.raises(ConnectionRefusedError):  # the live stats server too
        sock.connect(("127.0.0.1", port))
    kept = weather_out.read_bytes()
    assert kept.endswith(b"\n") and 2 <= kept.count(b"\n") < 5
    metrics = orjson.loads((tmp_path / "eval_aggregate_metrics.json").read_bytes())
    assert metrics["overall"]["interrupted"] is True
    assert metrics["overall"]["live"]["rollouts_ok"] == kept.count(b"\n")
    assert metrics["per_agent"][WEATHER_AGENT]["live"]["rollouts_ok"] == kept.count(b"\n")
    assert metrics["per_agent"][MULTI_AGENT] == {"started": False, "num_repeats": 2}
    assert len(_lines(out)) == kept.count(b"\n")  # the combined file has what is done
    assert "resume_from_cache" in first.stderr

    # Without +resume_from_cache the rollouts already there are refused, before any server starts.
    again = _e2e(launch, *common)
    assert again.wait_exit(BOUND_S) == 2 and "already exist" in again.stderr
    assert "servers ready" not in again.stdout and weather_out.read_bytes() == kept

    mlruns = tmp_path / "mlruns"
    done = _e2e(
        launch, *common, "+resume_from_cache=true", "+tracker=mlflow", f"+mlflow_tracking_uri={mlruns}"
    )
    assert done.wait_exit(BOUND_S) == 0, done.output
    assert done.wait_no_processes() == []
    assert weather_out.read_bytes().startswith(kept)  # earlier lines kept, the rest appended
    n_kept = kept.count(b"\n")
    assert f"This run: {5 - n_kept} ok, 0 failed" in done.stdout  # only the missing ones ran
    weather = _lines(weather_out)
    multi = _lines(tmp_path / "eval" / "rollouts" / f"{MULTI_AGENT}.jsonl")
    assert sorted((r["_ng_task_index"], r["_ng_rollout_index"]) for r in weather) == [
        (t, 0) for t in range(5)
    ]
    assert sorted((r["_ng_task_index"], r["_ng_rollout_index"]) for r in multi) == [
        (t, k) for t in range(5) for k in range(2)
    ]
    assert [r["reward"] for r in weather if r["expected_city"] == "Paris"] == [1.0]
    assert sum(r["reward"] for r in weather) == 1.0 and sum(r["reward"] for r in multi) == 0.0
    combined = _lines(out)
    assert len(combined) == 15
    assert {r["agent_ref"]["name"] for r in combined} == {WEATHER_AGENT, MULTI_AGENT}

    metrics = orjson.loads((tmp_path / "eval_aggregate_metrics.json").read_bytes())
    overall, per_agent = metrics["overall"], metrics["per_agent"]
    assert overall["rollouts_ok"] == overall["expected_rollouts"] == 15 and overall["rollouts_missing"] == 0
    assert per_agent[WEATHER_AGENT]["mean/reward"] == pytest.approx(0.2)
    assert per_agent[MULTI_AGENT]["num_repeats"] == 2 and per_agent[MULTI_AGENT]["expected_rollouts"] == 10
    assert overall["mean/reward"] == pytest.approx(1 / 15)  # over rollouts
    assert overall["mean_over_agents/reward"] == pytest.approx(0.1)  # over agents
    assert per_agent[MULTI_AGENT]["pass@2"] == 0.0
    collated = _lines(tmp_path / "eval" / "preprocessed_datasets" / "example.jsonl")
    assert len(collated) == 10 and {r["agent_ref"]["name"] for r in collated} == {WEATHER_AGENT, MULTI_AGENT}
    assert "Overall mean reward 0.0667" in done.stdout
    # The live blocks: this run's rollouts (the resumed ones only), per agent and overall.
    fresh_weather = weather[n_kept:]
    assert per_agent[WEATHER_AGENT]["live"]["rollouts_ok"] == 5 - n_kept
    assert per_agent[MULTI_AGENT]["live"]["rollouts_ok"] == 10
    assert per_agent[WEATHER_AGENT]["live"]["tokens"]["total_tokens"] == sum(
        r["response"]["usage"]["total_tokens"] for r in _lines(weather_out)[n_kept:]
    )
    live = overall["live"]
    assert live["rollouts_ok"] == 15 - n_kept and live["rollouts_failed"] == 0
    assert live["tokens"]["output_tokens"] == sum(
        r["response"]["usage"]["output_tokens"] for r in fresh_weather + multi
    )
    assert live["reward"]["mean"] == pytest.approx(sum(r["reward"] for r in fresh_weather) / (15 - n_kept))
    # +tracker=mlflow: the overall and per-agent metrics in a local MLflow file store.
    tracked = mlflow_runs(mlruns)
    assert len(tracked) == 1 and tracked[0].info.run_name == "eval"
    assert tracked[0].data.metrics["mean/reward"] == pytest.approx(1 / 15)
    assert tracked[0].data.metrics[f"{WEATHER_AGENT}/mean/reward"] == pytest.approx(0.2)
    assert tracked[0].data.params["split"] == "example"


def mlflow_runs(mlruns: Path) -> list[Any]:
    """The runs of the ``nemo_gym`` experiment in a local MLflow store (read with MLflow's own client)."""
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=mlruns.resolve().as_uri())
    experiment = client.get_experiment_by_name("nemo_gym")
    assert experiment is not None, f"no nemo_gym experiment in {mlruns}"
    return client.search_runs([experiment.experiment_id])


def _run_in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    capsys.readouterr()
    try:
        e2e_main(argv)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    return code, capsys.readouterr().err


def test_e2e_bad_input_is_refused_before_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    out = tmp_path / "eval.jsonl"
    base = [CONFIGS, f"+output_jsonl_fpath={out}", "+head_server.port=0"]

    code, err = _run_in_process(base, capsys)
    assert code == 2 and "+split is required" in err
    code, err = _run_in_process([*base, "+split=test"], capsys)
    assert code == 2 and "+split" in err and "validation" in err
    code, err = _run_in_process([*base, "+split=example", "+agent_name=example_multi_step_agent"], capsys)
    assert code == 2 and "'example_multi_step_agent' is not an agent" in err and f"'{MULTI_AGENT}'" in err
    code, err = _run_in_process([*base, "+split=validation"], capsys)
    assert code == 2 and "declares a dataset of type 'validation'" in err
    assert f"{WEATHER_AGENT}: example (example)" in err
    code, err = _run_in_process([*base, "+split=example", "+splitt=example"], capsys)
    assert code == 2 and "splitt" in err
    code, err = _run_in_process([*base, "+split=example", "+agent_num_repeats.nobody=2"], capsys)
    assert code == 2 and "'nobody' is not an agent" in err
    missing = f"++{WEATHER_AGENT}.responses_api_agents.simple_agent.datasets.0.jsonl_fpath=nowhere/x.jsonl"
    code, err = _run_in_process([*base, "+split=example", missing], capsys)
    assert code == 2 and "'nowhere/x.jsonl' does not exist" in err
    bad_rows = tmp_path / "bad.jsonl"
    bad_rows.write_text('{"responses_create_params": {"input": "hi"}}\n{"no_params": 1}\n')
    bad = f"++{WEATHER_AGENT}.responses_api_agents.simple_agent.datasets.0.jsonl_fpath={bad_rows}"
    code, err = _run_in_process([*base, "+split=example", bad], capsys)
    assert code == 2 and f"{bad_rows}:2: responses_create_params" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # nothing written

    out.write_text('{"reward": 1.0}\n')
    code, err = _run_in_process([*base, "+split=example"], capsys)
    assert code == 2 and "already exist" in err and "+resume_from_cache=true" in err
    assert out.read_text() == '{"reward": 1.0}\n' and not (tmp_path / "eval").exists()


@pytest.mark.slow
def test_e2e_sigterm_during_start_up_stops_everything(tmp_path: Path, launch: Launcher) -> None:
    out = tmp_path / "eval.jsonl"
    run = _e2e(launch, "+split=example", f"+output_jsonl_fpath={out}")
    collated = tmp_path / "eval" / "preprocessed_datasets" / "example.jsonl"  # written just before start-up
    deadline = time.monotonic() + BOUND_S
    while not collated.is_file():
        assert run.proc.poll() is None, run.output
        assert time.monotonic() < deadline, run.output
        time.sleep(0.02)
    run.send_signal(signal.SIGTERM)
    assert run.wait_exit(BOUND_S) == 130, run.output
    assert run.wait_no_processes() == []  # no server outlives the command
    assert "interrupted" in run.stderr
