"""The trainer examples under ``examples/``, run as a user runs them, checked on what they write.

* ``grpo_data_path.py`` on local_model (a real LLM, so the token ids are real): advantages sum to 0
  within each group; every sample's ``input_ids`` hold each model turn's prompt and generation token
  for token (contiguous), the loss mask covers exactly the generated tokens and the log-probs are
  the model's; the step samples are the turns. The advantage formula and the contiguity refusal are
  also checked on their own (a real rollout's ids tampered with must be refused).
* ``export_sft_dpo.py`` on real rollouts of two policies (scripted: one answers the Paris task right):
  the DPO pair is best vs worst with chosen reward > rejected reward, in TRL's conversational format;
  SFT keeps only rollouts that pass; a line that is not a rollout is refused naming file and line.
* ``ray_trainer_cluster.py``: servers started from a Ray actor inside a private Ray cluster the script
  owns, joined to it through ``ray_head_node_address``: each group's rewards are the scripted ones,
  verification ran on the cluster (no local pool worker), the head server serves the cluster's address,
  and every process the script started is gone at the end.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from nemo_gym.rollout_collection import collect_main
from nemo_gym.tools.testing import running_servers

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

import export_sft_dpo  # noqa: E402
import grpo_data_path  # noqa: E402

from resources_servers.example_single_tool_call.app import weather_report  # noqa: E402

BOUND_S = 900
WEATHER = "example_single_tool_call"


def _lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()]


def _run_example(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=BOUND_S, check=False
    )


def test_group_relative_advantages() -> None:
    assert grpo_data_path.group_relative_advantages([1.0, 0.0]) == pytest.approx([1.0, -1.0], abs=1e-5)
    adv = grpo_data_path.group_relative_advantages([0.0, 0.5, 1.0, 1.0])
    assert sum(adv) == pytest.approx(0.0, abs=1e-9) and adv[0] < adv[1] < adv[2] == adv[3]
    assert grpo_data_path.group_relative_advantages([0.3, 0.3]) == [0.0, 0.0]


@pytest.mark.slow
def test_grpo_example_on_local_model(tmp_path: Path) -> None:
    done = _run_example(
        "examples/grpo_data_path.py", "--output-dir", str(tmp_path), "--max-output-tokens", "40"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = orjson.loads((tmp_path / "summary.json").read_bytes())
    assert summary["model"] == "local" and len(summary["groups"]) == 2
    for group in summary["groups"]:
        assert len(group["rewards"]) == 2
        assert sum(group["advantages"]) == pytest.approx(0.0, abs=1e-6)
        assert group["advantages"] == pytest.approx(
            grpo_data_path.group_relative_advantages(group["rewards"])
        )
    rollouts = {(r["_ng_task_index"], r["_ng_rollout_index"]): r for r in _lines(tmp_path / "rollouts.jsonl")}
    samples = _lines(tmp_path / "grpo_samples.jsonl")
    steps = _lines(tmp_path / "grpo_step_samples.jsonl")
    assert len(samples) == 4 and len(rollouts) == 4
    for s in samples:
        turns = grpo_data_path.model_turns(rollouts[(s["_ng_task_index"], s["_ng_rollout_index"])])
        assert turns and s["num_turns"] == len(turns)
        ids, mask, logprobs = s["input_ids"], s["loss_mask"], s["logprobs"]
        assert len(ids) == len(mask) == len(logprobs)
        # Contiguous: each turn's prompt is a prefix of the sequence and its generation follows it.
        for item in turns:
            p, g = item["prompt_token_ids"], item["generation_token_ids"]
            assert ids[: len(p)] == p and ids[len(p) : len(p) + len(g)] == g
            assert mask[len(p) : len(p) + len(g)] == [1] * len(g)
            assert logprobs[len(p) : len(p) + len(g)] == pytest.approx(item["generation_log_probs"])
        last = turns[-1]
        assert ids == last["prompt_token_ids"] + last["generation_token_ids"]
        assert sum(mask) == sum(len(t["generation_token_ids"]) for t in turns)
        assert all(x <= 0.0 for x, m in zip(logprobs, mask, strict=True) if m) and any(
            x < 0 for x in logprobs
        )
        mine = [
            t
            for t in steps
            if (t["_ng_task_index"], t["_ng_rollout_index"]) == (s["_ng_task_index"], s["_ng_rollout_index"])
        ]
        assert [t["generation_ids"] for t in mine] == [t["generation_token_ids"] for t in turns]
        assert {t["advantage"] for t in mine} == {s["advantage"]}
    # Tampered ids (a turn whose prompt does not extend the earlier tokens) are refused.
    multi = next((r for r in rollouts.values() if len(grpo_data_path.model_turns(r)) >= 2), None)
    one = next(iter(rollouts.values()))
    broken = multi or one
    turn = grpo_data_path.model_turns(broken)[-1]
    if multi is not None:
        turn["prompt_token_ids"][0] += 1
        with pytest.raises(ValueError, match="does not start with"):
            grpo_data_path.trajectory_sample(broken)
    turn["generation_log_probs"] = turn["generation_log_probs"][:-1]
    with pytest.raises(ValueError):
        grpo_data_path.trajectory_sample(broken)


def _collect(port: int, out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [f"+agent_name={WEATHER}_simple_agent", f"+input_jsonl_fpath=resources_servers/{WEATHER}/data/example.jsonl",
            f"+output_jsonl_fpath={out}", "+progress=false", f"+head_server.port={port}"]  # fmt: skip
    with pytest.raises(SystemExit) as done:
        collect_main(argv)
    assert done.value.code == 0, capsys.readouterr().err


@pytest.mark.slow
def test_export_sft_and_dpo_pairs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    paris_right = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": [
        {"contains": "Paris", "turns": [{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
                                        {"text": weather_report("Paris")}]}]}}}}  # fmt: skip
    config = [f"resources_servers/{WEATHER}/configs/{WEATHER}.yaml"]
    with running_servers(config, paris_right) as helper:
        _collect(helper.head_server_config.port, tmp_path / "a.jsonl", capsys)
    with running_servers(config) as helper:
        _collect(helper.head_server_config.port, tmp_path / "b.jsonl", capsys)
    # Two policies' rollouts of the same tasks: one group of two per task.
    merged = _lines(tmp_path / "a.jsonl") + [
        {**r, "_ng_rollout_index": 1} for r in _lines(tmp_path / "b.jsonl")
    ]
    (tmp_path / "groups.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in merged))

    out = tmp_path / "trl"
    done = _run_example(
        "examples/export_sft_dpo.py", str(tmp_path / "groups.jsonl"), "--output-dir", str(out)
    )
    assert done.returncode == 0, done.stderr
    assert "10 rollouts in 5 groups: 1 SFT examples" in done.stdout and "1 DPO pairs" in done.stdout
    pairs, meta = _lines(out / "dpo.jsonl"), _lines(out / "dpo_meta.jsonl")
    assert len(pairs) == len(meta) == 1
    assert meta[0]["chosen_reward"] > meta[0]["rejected_reward"]
    assert (meta[0]["chosen_reward"], meta[0]["chosen_rollout"], meta[0]["rejected_rollout"]) == (1.0, 0, 1)
    pair = pairs[0]
    assert set(pair) == {"prompt", "chosen", "rejected"}
    assert [m["role"] for m in pair["prompt"]] == ["system", "user"] and "Paris" in pair["prompt"][1][
        "content"
    ]
    assert [m["role"] for m in pair["chosen"]] == ["assistant", "tool", "assistant"]
    call = pair["chosen"][0]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and orjson.loads(call["arguments"]) == {"city": "Paris"}
    assert pair["chosen"][-1]["content"] == weather_report("Paris")
    assert pair["rejected"] != pair["chosen"]
    sft = _lines(out / "sft.jsonl")
    assert (
        len(sft) == 1
        and sft[0]["messages"][:2] == pair["prompt"]
        and sft[0]["messages"][2:] == pair["chosen"]
    )
    assert sft[0]["tools"][0]["function"]["name"] == "get_weather"
    assert len(export_sft_dpo.dpo_pairs(merged, min_margin=1.0)) == 0  # a margin the pair does not clear

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(orjson.dumps(merged[0]) + b"\n" + b'{"reward": 1}\n')
    done = _run_example("examples/export_sft_dpo.py", str(bad), "--output-dir", str(tmp_path / "none"))
    assert done.returncode == 2 and f"{bad}:2: not a rollout" in done.stderr
    assert not (tmp_path / "none").exists()


@pytest.mark.slow
def test_ray_trainer_cluster_example(tmp_path: Path) -> None:
    pytest.importorskip("ray")  # the [ray] extra (in [dev], so CI runs this)
    done = _run_example("examples/ray_trainer_cluster.py", "--group-size", "3", "--output-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    summary = orjson.loads((tmp_path / "summary.json").read_bytes())
    assert summary["groups"] == [{"task": 0, "rewards": [1.0] * 3}, {"task": 1, "rewards": [0.0] * 3}]
    assert summary["served_ray_head_node_address"] == summary["gcs_address"]
    assert summary["local_verify_workers"] == 0 and summary["ray_nodes"] == 1
    assert {s["name"] for s in summary["servers"]} == {
        "structured_outputs",
        "structured_outputs_simple_agent",
        "policy_model",
    }
    # Ray's processes, the actor and the three servers were started, and all of them were stopped.
    assert summary["processes_started_and_stopped"] >= 5
    assert "none left" in done.stdout
