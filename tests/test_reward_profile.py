"""ng_reward_profile and the statistics behind it, on synthetic rollouts files (no servers)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from nemo_gym.kit.rollout_stats import aggregate_metrics, k_values, pass_at_k, reward_profile

REWARD_PROFILE = str(Path(sys.executable).parent / "ng_reward_profile")

# task -> rewards of its rollouts, in rollout order
TASKS: dict[int, list[float]] = {
    0: [1.0, 1.0, 1.0, 1.0],  # always solved
    1: [0.0, 0.0, 0.0, 0.0],  # never solved
    2: [1.0, 0.0, 0.0, 1.0],  # mixed: 2 of 4
    3: [0.0, 0.5, 1.0, 0.0],  # mixed: 1 of 4 at threshold 1.0; 2 of 4 at threshold 0.5
}


def _rollout(task: int, index: int, reward: Any) -> dict[str, Any]:
    usage = {"input_tokens": 10, "output_tokens": 3, "total_tokens": 13}
    return {
        "_ng_task_index": task,
        "_ng_rollout_index": index,
        "reward": reward,
        "response": {"usage": usage},
    }


def _write(path: Path) -> Path:
    lines = []
    for task, rewards in TASKS.items():
        lines += [orjson.dumps(_rollout(task, i, r)) for i, r in enumerate(rewards)]
    lines.insert(3, b"this is not json")
    lines.insert(7, orjson.dumps(_rollout(1, 9, "high")))  # reward not a number
    lines.insert(9, orjson.dumps(["not", "an", "object"]))
    lines.insert(11, orjson.dumps({**_rollout(2, 9, 1.0), "_ng_task_index": "two"}))  # bad task index
    lines.insert(
        12, orjson.dumps({**_rollout(2, 8, 1.0), "response": "oops"})
    )  # odd response: still a rollout
    path.write_bytes(b"\n".join(lines) + b'\n{"reward": 1.0, "_ng_task_in')  # and a cut-off last line
    return path


def test_pass_at_k_and_k_values() -> None:
    assert pass_at_k(4, 2, 1) == 0.5
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)
    assert pass_at_k(4, 2, 3) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(5, 1, 2) == pytest.approx(1 - 6 / 10)  # 1 - C(4,2)/C(5,2)
    assert math.isnan(pass_at_k(2, 1, 3))
    assert k_values(1) == [1] and k_values(4) == [1, 2, 4] and k_values(5) == [1, 2, 4, 5]
    assert k_values(200) == [1, 2, 4, 8, 16, 32, 64, 128, 200]


def test_reward_profile_cli(tmp_path: Path) -> None:
    path = _write(tmp_path / "rollouts.jsonl")
    proc = subprocess.run(
        [REWARD_PROFILE, f"+jsonl_fpath={path}"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    out_path = tmp_path / "rollouts_reward_profiling.jsonl"
    rows = {r["_ng_task_index"]: r for r in map(orjson.loads, out_path.read_bytes().splitlines())}
    assert sorted(rows) == [0, 1, 2, 3]

    expected = {
        # task: (n, passed, mean, std, {k: pass@k}, solved)
        0: (4, 4, 1.0, 0.0, {1: 1.0, 2: 1.0, 4: 1.0}, "always"),
        1: (4, 0, 0.0, 0.0, {1: 0.0, 2: 0.0, 4: 0.0}, "never"),
        2: (5, 3, 0.6, math.sqrt(0.24), {1: 0.6, 2: 1 - 1 / 10, 4: 1.0, 5: 1.0}, "mixed"),
        3: (
            4,
            1,
            0.375,
            math.sqrt(((0.375**2) * 2 + 0.125**2 + 0.625**2) / 4),
            {1: 0.25, 2: 0.5, 4: 1.0},
            "mixed",
        ),
    }
    for task, (n, passed, mean, std, ks, solved) in expected.items():
        row = rows[task]
        assert (row["num_rollouts"], row["num_passed"], row["solved"]) == (n, passed, solved), task
        assert row["mean_reward"] == pytest.approx(mean) and row["std_reward"] == pytest.approx(std), task
        assert {k: row[f"pass@{k}"] for k in ks} == pytest.approx(ks), task
        assert not any(f"pass@{k}" in row for k in (3, 6)), task  # k in 1, 2, 4, ..., max only
    assert "pass@5" not in rows[0]  # no pass@k beyond a task's rollouts

    assert "4 tasks, 17 rollouts" in proc.stdout
    assert "always solved 25.0%  never solved 25.0%  mixed 50.0% (2 tasks useful for GRPO)" in proc.stdout
    assert "5 malformed line(s) skipped" in proc.stdout
    assert f"Wrote {out_path}" in proc.stdout

    # A lower threshold counts task 3's 0.5 as a pass.
    low_rows, summary = reward_profile(path, pass_threshold=0.5)
    assert [r["num_passed"] for r in low_rows] == [4, 0, 3, 2]
    assert low_rows[3]["pass@1"] == 0.5 and summary["pass_threshold"] == 0.5
    assert summary["num_tasks"] == 4 and summary["num_rollouts"] == 17 and summary["malformed_lines"] == 5
    assert summary["share_always_solved"] == 0.25 and summary["share_mixed"] == 0.5


def test_reward_profile_cli_errors(tmp_path: Path) -> None:
    missing = subprocess.run(
        [REWARD_PROFILE, f"+jsonl_fpath={tmp_path / 'nope.jsonl'}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "nope.jsonl is not a file" in missing.stderr
    assert not (tmp_path / "nope_reward_profiling.jsonl").exists()
    no_arg = subprocess.run([REWARD_PROFILE], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert no_arg.returncode == 2 and "+jsonl_fpath" in no_arg.stderr


def test_aggregate_metrics_skips_malformed_lines(tmp_path: Path) -> None:
    path = _write(tmp_path / "rollouts.jsonl")
    m = aggregate_metrics(path, max_k=4)
    assert m["num_rollouts"] == 17 and m["malformed_lines"] == 5 and m["num_tasks"] == 4
    rewards = [r for rs in TASKS.values() for r in rs] + [1.0]
    mean = sum(rewards) / len(rewards)
    assert m["mean/reward"] == pytest.approx(mean)
    assert m["std/reward"] == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)))
    # The odd response (a string) counts as a rollout without token usage.
    assert m["tokens"] == {"input_tokens": 160, "output_tokens": 48, "total_tokens": 208}
    assert m["pass@1"] == pytest.approx((1.0 + 0.0 + 0.6 + 0.25) / 4)
    assert m["pass@4"] == pytest.approx((1.0 + 0.0 + 1.0 + 1.0) / 4)
    assert m["per_task"]["2"]["num_rollouts"] == 5


def test_aggregate_pass_at_k_only_where_every_task_reaches_k(tmp_path: Path) -> None:
    # An interrupted run: task 0 has 4 rollouts, task 1 only 1. pass@2 and pass@4 would be means
    # over task 0 alone, so they are not reported for the whole run (they are per task).
    path = tmp_path / "partial.jsonl"
    rows = [_rollout(0, i, 1.0) for i in range(4)] + [_rollout(1, 0, 0.0)]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    m = aggregate_metrics(path, max_k=4)
    assert m["pass@1"] == 0.5
    assert "pass@2" not in m and "pass@4" not in m
    assert m["per_task"]["0"]["pass@4"] == 1.0 and "pass@2" not in m["per_task"]["1"]
