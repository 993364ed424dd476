"""GRPO data path: a group of rollouts per task, group-relative advantages, token-level training samples.

What a GRPO trainer does with NeMo Gym, end to end and on a real model (docs/trainers.md, "GRPO data
path"):

1. start the servers from Python (``RunHelper``) with the model returning token information
   (``return_token_id_information: true``: every model turn's last output item carries
   ``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs``);
2. run ``--group-size`` rollouts of each of ``--tasks`` task rows through
   ``RolloutCollectionHelper.run_examples`` (sampling at ``--temperature``: each rollout of a group has its own seed);
3. per group, the advantage of each rollout is ``(reward - mean) / (std + eps)`` (0 when every reward
   of the group is equal: nothing to learn from the group);
4. each rollout becomes one training sample: ``input_ids`` (the last turn's prompt and generation,
   which holds every earlier turn token for token), ``loss_mask`` (1 on tokens the model generated),
   ``logprobs`` (the sampling log-probs on generated tokens, 0 elsewhere) and the advantage. The
   assembly refuses a rollout whose turns are not contiguous (a turn's prompt must start with every
   earlier prompt and generation token), as NeMo RL does;
5. the step-level variant (one sample per model turn, for agents whose environment is stepped turn by
   turn, as the Aviary agent does): ``prompt_ids`` / ``generation_ids`` / ``generation_logprobs`` of
   each turn, each carrying its rollout's advantage.

Writes ``<output-dir>/rollouts.jsonl``, ``grpo_samples.jsonl``, ``grpo_step_samples.jsonl`` and
``summary.json``. Run: ``python examples/grpo_data_path.py --output-dir /tmp/grpo`` (local_model:
``pip install -e ".[local]"``; ``--model scripted`` uses the scripted test model instead).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import math
import sys
from pathlib import Path
from typing import Any

import orjson

from nemo_gym.cli import RunHelper
from nemo_gym.config.keys import PACKAGE_PARENT_DIR
from nemo_gym.global_config import GlobalConfigDictParserConfig
from nemo_gym.rollout_collection import RolloutCollectionHelper

ENV = "example_single_tool_call"
AGENT = f"{ENV}_simple_agent"
MODELS = {
    "local": ("responses_api_models/local_model/configs/local_model.yaml", "local_model"),
    "scripted": ("responses_api_models/scripted_model/configs/scripted_model.yaml", "scripted_model"),
}
EPS = 1e-6
ROLLOUT_TIMEOUT_S = 600.0


def group_relative_advantages(rewards: list[float]) -> list[float]:
    """GRPO's advantages of one group: rewards standardised within the group (they sum to 0)."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    if std < EPS:
        return [0.0 for _ in rewards]
    return [(r - mean) / (std + EPS) for r in rewards]


def model_turns(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The output items that carry a model turn's token information, in order."""
    return [item for item in result["response"]["output"] if item.get("generation_token_ids")]


def trajectory_sample(result: dict[str, Any]) -> dict[str, Any]:
    """One rollout as one sequence; raises ValueError when its turns are not contiguous."""
    turns = model_turns(result)
    if not turns:
        raise ValueError("the rollout has no token information (is return_token_id_information on?)")
    input_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    for n, item in enumerate(turns):
        prompt, generation = item["prompt_token_ids"], item["generation_token_ids"]
        if prompt[: len(input_ids)] != input_ids:
            raise ValueError(f"model turn {n}: its prompt does not start with the earlier turns' tokens")
        if len(item["generation_log_probs"]) != len(generation):
            raise ValueError(
                f"model turn {n}: {len(generation)} generated ids but a different number of log-probs"
            )
        new_prompt = prompt[len(input_ids) :]  # tool results and the template text between turns
        input_ids += list(new_prompt) + list(generation)
        loss_mask += [0] * len(new_prompt) + [1] * len(generation)
        logprobs += [0.0] * len(new_prompt) + [float(x) for x in item["generation_log_probs"]]
    return {"input_ids": input_ids, "loss_mask": loss_mask, "logprobs": logprobs, "num_turns": len(turns)}


def step_samples(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The step-level variant: one sample per model turn."""
    return [
        {
            "step": n,
            "prompt_ids": list(item["prompt_token_ids"]),
            "generation_ids": list(item["generation_token_ids"]),
            "generation_logprobs": [float(x) for x in item["generation_log_probs"]],
        }
        for n, item in enumerate(model_turns(result))
    ]


def task_rows(n_tasks: int, max_output_tokens: int, temperature: float) -> list[dict[str, Any]]:
    path = PACKAGE_PARENT_DIR / "resources_servers" / ENV / "data" / "example.jsonl"
    rows = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()][:n_tasks]
    for row in rows:
        row["responses_create_params"].update(max_output_tokens=max_output_tokens, temperature=temperature)
        row["agent_ref"] = {"type": "responses_api_agents", "name": AGENT}
    return rows


async def collect_groups(
    helper: RunHelper, rows: list[dict[str, Any]], group_size: int
) -> list[list[dict[str, Any]]]:
    """``group_size`` rollouts per row (each with its own seed); results grouped per task, in order."""
    examples = []
    for task, row in enumerate(rows):
        for k in range(group_size):
            example = copy.deepcopy(row)
            example["responses_create_params"]["seed"] = 1000 * task + k
            example["_ng_task_index"], example["_ng_rollout_index"] = task, k
            examples.append(example)
    rch = RolloutCollectionHelper(num_samples_in_parallel=4)
    groups: list[list[dict[str, Any]]] = [[None] * group_size for _ in rows]  # type: ignore[list-item]
    try:
        for future in rch.run_examples(examples, head_server_config=helper.head_server_config):
            row, result = await asyncio.wait_for(future, ROLLOUT_TIMEOUT_S)
            groups[row["_ng_task_index"]][row["_ng_rollout_index"]] = {
                **result,
                "_ng_task_index": row["_ng_task_index"],
                "_ng_rollout_index": row["_ng_rollout_index"],
            }
    finally:
        await rch.aclose()
    return groups


def build(groups: list[list[dict[str, Any]]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The trajectory samples and the step samples of every group."""
    samples, steps = [], []
    for group in groups:
        advantages = group_relative_advantages([float(r["reward"]) for r in group])
        for result, advantage in zip(group, advantages, strict=True):
            ids = {k: result[k] for k in ("_ng_task_index", "_ng_rollout_index")}
            reward = float(result["reward"])
            samples.append({**ids, "reward": reward, "advantage": advantage, **trajectory_sample(result)})
            steps += [{**ids, "reward": reward, "advantage": advantage, **s} for s in step_samples(result)]
    return samples, steps


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--model", choices=sorted(MODELS), default="local")
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--max-output-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args(argv)
    model_config, impl = MODELS[args.model]
    helper = RunHelper()
    helper.start(
        GlobalConfigDictParserConfig(
            initial_global_config_dict={
                "config_paths": [f"resources_servers/{ENV}/configs/{ENV}.yaml", model_config],
                "head_server": {"host": "127.0.0.1", "port": 0},
                "policy_model": {"responses_api_models": {impl: {"return_token_id_information": True}}},
            },
            skip_load_from_cli=True,
            skip_load_from_env_yaml=True,
        )
    )
    try:
        groups = asyncio.run(
            collect_groups(
                helper, task_rows(args.tasks, args.max_output_tokens, args.temperature), args.group_size
            )
        )
    finally:
        helper.shutdown()
    samples, steps = build(groups)
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "rollouts.jsonl", [r for g in groups for r in g])
    write_jsonl(out / "grpo_samples.jsonl", samples)
    write_jsonl(out / "grpo_step_samples.jsonl", steps)
    summary = {
        "model": args.model,
        "groups": [
            {
                "task": t,
                "rewards": [s["reward"] for s in samples if s["_ng_task_index"] == t],
                "advantages": [s["advantage"] for s in samples if s["_ng_task_index"] == t],
            }
            for t in range(len(groups))
        ],
        "samples": len(samples),
        "step_samples": len(steps),
        "trained_tokens": sum(sum(s["loss_mask"]) for s in samples),
        "total_tokens": sum(len(s["input_ids"]) for s in samples),
    }
    (out / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    for g in summary["groups"]:
        print(
            f"task {g['task']}: rewards {g['rewards']} -> advantages {[round(a, 3) for a in g['advantages']]}"
        )
    print(
        f"{summary['samples']} samples ({summary['step_samples']} step samples), "
        f"{summary['trained_tokens']} / {summary['total_tokens']} tokens trained; wrote {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
