"""The collector's aggregate metrics average metrics, not task data.

A numeric field of the task row (an id, an index, a ground-truth number) passes through ``/run`` into
each rollout line; ``<stem>_aggregate_metrics.json`` must not report ``mean/<field>`` of it, while a
numeric field the verifier added (here example_multi_step's ``set_overlap``) is averaged, as is
``reward``. Real servers (the scripted model stands in for the LLM).
"""

from __future__ import annotations

from pathlib import Path

import orjson

from nemo_gym.kit.rollout_stats import aggregate_metrics
from nemo_gym.rollout_collection import collect_main
from nemo_gym.tools.testing import running_servers

ENV = "example_multi_step"


def test_task_fields_are_not_averaged_verifier_metrics_are(tmp_path: Path) -> None:
    rows = [
        {**orjson.loads(line), "task_idx": i, "ground_truth_total": 10.5 * i}
        for i, line in enumerate(
            Path(f"resources_servers/{ENV}/data/example.jsonl").read_bytes().splitlines()
        )
        if line.strip()
    ]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    out = tmp_path / "rollouts.jsonl"
    with running_servers([f"resources_servers/{ENV}/configs/{ENV}.yaml"]) as helper:
        try:
            collect_main(
                [f"+agent_name={ENV}_simple_agent", f"+input_jsonl_fpath={tasks}", f"+output_jsonl_fpath={out}",
                 "+num_repeats=2", "+progress=false", f"+head_server.port={helper.head_server_config.port}"]
            )  # fmt: skip
        except SystemExit as exc:
            assert not exc.code, exc.code
    lines = [orjson.loads(x) for x in out.read_bytes().splitlines() if x.strip()]
    assert len(lines) == 2 * len(rows) and all("task_idx" in r and "set_overlap" in r for r in lines)

    summary = orjson.loads((tmp_path / "rollouts_aggregate_metrics.json").read_bytes())
    assert "mean/reward" in summary and "std/reward" in summary
    assert "mean/set_overlap" in summary and "mean/num_extract_calls" in summary  # the verifier's metrics
    assert not any(k.endswith(("/task_idx", "/ground_truth_total")) for k in summary), sorted(summary)
    mean_overlap = sum(r["set_overlap"] for r in lines) / len(lines)
    assert abs(summary["mean/set_overlap"] - mean_overlap) < 1e-9

    # Without the task rows (a rollouts file on its own) there is nothing to tell data from metrics.
    alone = aggregate_metrics(out)
    assert "mean/task_idx" in alone and alone["mean/reward"] == summary["mean/reward"]
