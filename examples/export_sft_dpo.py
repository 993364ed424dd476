"""Export rollouts as SFT examples and DPO pairs, in the JSONL formats Hugging Face TRL reads.

Input: a rollouts file of ``ng_collect_rollouts`` / ``ng_e2e_collect_rollouts`` (each line the verify
response: ``responses_create_params``, ``response``, ``reward``, ``_ng_task_index``, ``agent_ref``).
A *group* is the rollouts of one task of one agent (``agent_ref.name``, ``_ng_task_index``): collect
with ``+num_repeats=K`` to get groups of K.

* ``sft.jsonl``: TRL's conversational language-modeling format, ``{"messages": [...], "tools": [...]}``
  (``tools`` only when the task offered tools), one line per rollout whose reward is at least
  ``--min-reward`` (default 1.0). ``messages`` is the task's prompt (system/user messages) followed by
  the rollout's turns (assistant messages with ``tool_calls``, ``tool`` messages with the results), as
  :mod:`nemo_gym.kit.chat_conversion` maps the Responses items to Chat Completions messages.
* ``dpo.jsonl``: TRL's conversational preference format, ``{"prompt": [...], "chosen": [...],
  "rejected": [...]}``: per group, the best rollout (highest reward) against the worst (lowest), only
  when the best's reward exceeds the worst's by more than ``--min-margin`` (default 0). Ties keep the
  earliest rollout. ``dpo_meta.jsonl`` has, line for line, which rollouts and rewards made each pair
  (TRL would take extra columns for data, so they are kept apart).
* A line that is not a rollout (no ``reward``, ``response`` or ``responses_create_params``) is an error
  naming the file and line; nothing is written then.

Run: ``python examples/export_sft_dpo.py results/rollouts.jsonl --output-dir results/trl``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson

from nemo_gym.kit.chat_conversion import responses_to_chat_messages, responses_tools_to_chat_tools

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


class ExportError(ValueError):
    """A rollouts line that cannot be exported; the message names the file and line."""


def read_rollouts(path: Path) -> list[dict[str, Any]]:
    rows = []
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise ExportError(f"{path}:{n}: not JSON ({e})") from None
        missing = [
            k
            for k in ("reward", "response", "responses_create_params")
            if not isinstance(row, dict) or k not in row
        ]
        if missing:
            raise ExportError(f"{path}:{n}: not a rollout (no {', '.join(missing)})")
        row["_line"] = n
        rows.append(row)
    return rows


def prompt_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    return responses_to_chat_messages(row["responses_create_params"])


def completion_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The rollout's own turns (the response output) as chat messages."""
    output = [
        {k: v for k, v in item.items() if k not in TOKEN_FIELDS}
        for item in row["response"].get("output") or []
    ]
    return responses_to_chat_messages({"input": output})


def sft_example(row: dict[str, Any]) -> dict[str, Any]:
    example: dict[str, Any] = {"messages": prompt_messages(row) + completion_messages(row)}
    tools = responses_tools_to_chat_tools(row["responses_create_params"].get("tools"))
    if tools:
        example["tools"] = tools
    return example


def groups_of(rows: list[dict[str, Any]]) -> dict[tuple[str, Any], list[dict[str, Any]]]:
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for row in rows:
        agent = (row.get("agent_ref") or {}).get("name", "")
        groups.setdefault((agent, row.get("_ng_task_index")), []).append(row)
    return groups


def dpo_pairs(
    rows: list[dict[str, Any]], min_margin: float = 0.0
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(pair, meta) per group whose best reward beats its worst by more than ``min_margin``."""
    out = []
    for (agent, task), group in groups_of(rows).items():
        best = max(group, key=lambda r: r["reward"])  # max/min keep the first of equals
        worst = min(group, key=lambda r: r["reward"])
        if best["reward"] - worst["reward"] <= min_margin:
            continue
        pair = {
            "prompt": prompt_messages(best),
            "chosen": completion_messages(best),
            "rejected": completion_messages(worst),
        }
        meta = {
            "agent": agent,
            "_ng_task_index": task,
            "chosen_rollout": best.get("_ng_rollout_index"),
            "rejected_rollout": worst.get("_ng_rollout_index"),
            "chosen_reward": best["reward"],
            "rejected_reward": worst["reward"],
        }
        out.append((pair, meta))
    return out


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rollouts", type=Path)
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument(
        "--min-reward", type=float, default=1.0, help="SFT keeps rollouts with at least this reward"
    )
    parser.add_argument("--min-margin", type=float, default=0.0, help="DPO pairs need best - worst > this")
    args = parser.parse_args(argv)
    try:
        rows = read_rollouts(args.rollouts)
        sft = [sft_example(r) for r in rows if r["reward"] >= args.min_reward]
        pairs = dpo_pairs(rows, args.min_margin)
    except (ExportError, ValueError) as e:
        sys.stderr.write(f"export_sft_dpo: {e}\n")
        return 2
    args.output_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.output_dir / "sft.jsonl", sft)
    write_jsonl(args.output_dir / "dpo.jsonl", [p for p, _ in pairs])
    write_jsonl(args.output_dir / "dpo_meta.jsonl", [m for _, m in pairs])
    print(
        f"{len(rows)} rollouts in {len(groups_of(rows))} groups: {len(sft)} SFT examples "
        f"(reward >= {args.min_reward}), {len(pairs)} DPO pairs; wrote {args.output_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
