"""Experiment tracking from ``ng_collect_rollouts``: a real local MLflow store, read back with MLflow's client.

Proven here: ``+tracker=mlflow`` exports the aggregate metrics (names MLflow accepts: ``pass_at_1``),
the options as parameters (no server config, no secrets), the reward histogram and a sample of
trajectories; an absent package turns tracking off with one clear line (exit status and files
unchanged); a tracker that fails is a warning, never a failed collection; W&B offline mode writes a
local run with no network (when wandb is installed).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import orjson
import pytest

from nemo_gym.collection import tracking
from nemo_gym.rollout_collection import collect_main
from nemo_gym.tools.testing import running_servers
from resources_servers.example_single_tool_call.app import weather_report
from tests.test_e2e_collect_rollouts import PARIS, mlflow_runs

WEATHER = "example_single_tool_call"


def _collect(port: int, out: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    argv = [f"+agent_name={WEATHER}_simple_agent", f"+input_jsonl_fpath=resources_servers/{WEATHER}/data/example.jsonl",
            f"+output_jsonl_fpath={out}", "+progress=false", f"+head_server.port={port}", "+num_repeats=2", *extra]  # fmt: skip
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        collect_main(argv)
    captured = capsys.readouterr()
    return int(done.value.code or 0), captured.out, captured.err


def test_histogram_and_flat_names() -> None:
    h = tracking.reward_histogram([0.0, 0.0, 0.5, 1.0], bins=2)
    assert h["counts"] == [2, 2] and h["edges"] == [0.0, 0.5, 1.0]
    assert tracking.reward_histogram([1.0, 1.0])["counts"] == [2]
    flat = tracking.flat_metrics(
        {"pass@4": 0.5, "tokens": {"output_tokens": 3}, "per_task": {"0": {"x": 1}}, "ok": True}
    )
    assert flat == {"pass_at_4": 0.5, "tokens/output_tokens": 3.0}


def test_collect_rollouts_to_mlflow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    paris = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": [
        {"contains": "Paris", "turns": [{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
                                        {"text": weather_report("Paris")}]}]}}}}  # fmt: skip
    assert PARIS  # the same scripted answer the e2e test uses
    mlruns = tmp_path / "mlruns"
    with running_servers([f"resources_servers/{WEATHER}/configs/{WEATHER}.yaml"], paris) as helper:
        port = helper.head_server_config.port
        out = tmp_path / "weather.jsonl"
        code, stdout, err = _collect(port, out, capsys, "+tracker=mlflow", f"+mlflow_tracking_uri={mlruns}",
                                     "+mlflow_experiment_name=nemo_gym", "+tracker_num_trajectories=3")  # fmt: skip
        assert code == 0, err
        assert "Tracked in mlflow" in stdout
        [run] = mlflow_runs(mlruns)
        assert run.info.run_name == "weather" and run.info.status == "FINISHED"
        metrics, params = run.data.metrics, run.data.params
        assert metrics["mean/reward"] == pytest.approx(0.2) and metrics["pass_at_2"] == pytest.approx(0.2)
        assert metrics["num_rollouts"] == 10 and metrics["tokens/total_tokens"] > 0
        assert params["num_repeats"] == "2" and params["output_jsonl_fpath"] == str(out)
        assert set(params) <= set(tracking.PARAM_KEYS)  # the options only: no server config, no secrets

        import mlflow

        client = mlflow.MlflowClient(tracking_uri=mlruns.resolve().as_uri())
        assert {a.path for a in client.list_artifacts(run.info.run_id)} == {
            "reward_histogram.json",
            "trajectories_sample.jsonl",
        }
        local = Path(
            client.download_artifacts(run.info.run_id, "reward_histogram.json", str(tmp_path / "dl"))
        )
        hist = orjson.loads(local.read_bytes())
        assert (
            hist["n"] == 10 and sum(hist["counts"]) == 10 and hist["counts"][-1] == 2
        )  # the two Paris rollouts
        sample_path = client.download_artifacts(
            run.info.run_id, "trajectories_sample.jsonl", str(tmp_path / "dl")
        )
        sample = [orjson.loads(x) for x in Path(sample_path).read_bytes().splitlines()]
        assert len(sample) == 3 and {s["agent"] for s in sample} == {f"{WEATHER}_simple_agent"}
        assert all(isinstance(s["reward"], float) and s["prompt"] and s["output"] for s in sample)

        # No mlflow package: tracking off with one clear line; the collection itself is unaffected.
        monkeypatch.setitem(sys.modules, "mlflow", None)
        assert importlib.util.find_spec("mlflow") is None
        code, stdout, err = _collect(port, tmp_path / "no_pkg.jsonl", capsys, "+tracker=mlflow",
                                     f"+mlflow_tracking_uri={tmp_path / 'unused'}")  # fmt: skip
        assert code == 0 and "the mlflow package is not installed" in err and "tracking is off" in err
        assert len((tmp_path / "no_pkg.jsonl").read_bytes().splitlines()) == 10
        assert not (tmp_path / "unused").exists()
        monkeypatch.delitem(sys.modules, "mlflow")

        # A tracker that fails (a store that cannot be written) is a warning, not a failed collection.
        blocked = tmp_path / "not_a_dir"
        blocked.write_text("a file where the store should be")
        code, stdout, err = _collect(port, tmp_path / "fails.jsonl", capsys, "+tracker=mlflow",
                                     f"+mlflow_tracking_uri={blocked / 'mlruns'}")  # fmt: skip
        assert code == 0 and "mlflow export failed" in err and "files are complete" in err

        code, _, err = _collect(port, tmp_path / "typo.jsonl", capsys, "+tracker=mlfow")
        assert code == 2 and "tracker" in err and not (tmp_path / "typo.jsonl").exists()


@pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None, reason="wandb (the tracking extra) is not installed"
)
def test_wandb_offline_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    rollouts = tmp_path / "r.jsonl"
    rows = [{"_ng_task_index": i, "_ng_rollout_index": 0, "reward": float(i % 2), "agent_ref": {"name": "a"},
             "responses_create_params": {"input": f"q{i}"}, "response": {"output": []}} for i in range(4)]  # fmt: skip
    rollouts.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    config = {"wandb_dir": str(tmp_path), "wandb_project": "p", "num_repeats": 1}
    where = tracking.track_run("wandb", config, {"mean/reward": 0.5, "pass@1": 0.5}, rollouts, "r", e2e=False)
    assert where is not None and str(tmp_path) in where
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def _rollouts_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"_ng_task_index": i, "_ng_rollout_index": 0, "reward": float(i % 2), "agent_ref": {"name": "a"},
             "responses_create_params": {"input": f"q{i}"}, "response": {"output": []}} for i in range(4)]  # fmt: skip
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


@pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None, reason="mlflow (the tracking extra) is not installed"
)
def test_tracker_output_lands_beside_the_results_not_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source_tree = tmp_path / "checkout"
    source_tree.mkdir()
    monkeypatch.chdir(source_tree)  # where a user runs the commands from: nothing may land here
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    rollouts = _rollouts_file(tmp_path / "results" / "r.jsonl")
    metrics = {"mean/reward": 0.5}
    assert tracking.track_run("mlflow", {}, metrics, rollouts, "r", e2e=False) is not None
    assert len(mlflow_runs(tmp_path / "results" / "mlruns")) == 1
    assert list(source_tree.iterdir()) == []

    # An explicit setting wins: the option, else MLflow's own environment variable.
    chosen = tmp_path / "chosen"
    tracking.track_run("mlflow", {"mlflow_tracking_uri": str(chosen)}, metrics, rollouts, "r", e2e=False)
    assert len(mlflow_runs(chosen)) == 1
    from_env = tmp_path / "from_env"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", from_env.as_uri())
    tracking.track_run("mlflow", {}, metrics, rollouts, "r", e2e=False)
    assert len(mlflow_runs(from_env)) == 1 and len(mlflow_runs(tmp_path / "results" / "mlruns")) == 1
    assert list(source_tree.iterdir()) == []

    if importlib.util.find_spec("wandb") is not None:
        monkeypatch.setenv("WANDB_SILENT", "true")
        monkeypatch.delenv("WANDB_DIR", raising=False)
        tracking.track_run("wandb", {}, metrics, rollouts, "r", e2e=False)
        assert list((tmp_path / "results" / "wandb").glob("offline-run-*"))
        assert list(source_tree.iterdir()) == []


def test_tracker_stores_are_git_ignored() -> None:
    ignored = {line.strip() for line in Path(".gitignore").read_text().splitlines()}
    assert {"mlruns/", "wandb/", "results/"} <= ignored
