"""Step-level training data: one row per model turn of multi-step rollouts (``ng_export_transitions``).

Contract
--------
* Input: a rollouts JSONL written by ``ng_collect_rollouts`` whose responses carry per-turn ``steps``
  records and a ``context_policy`` (``aviary_agent`` writes both; see
  ``resources_servers/aviary/schemas.py``). Rows without ``steps`` are counted and skipped.
* Output: one JSON line per model turn: ``responses_create_params`` whose ``input`` is exactly the
  context the model saw at that turn (rebuilt with :func:`render_step_context`, the function the
  agent itself uses, so collapsed environment states come out collapsed), ``response.output`` the
  model's items of that turn (token ids as the model returned them), ``reward`` (by default the
  reward-to-go: the sum of this and later steps' rewards; ``+reward=step`` or ``+reward=trajectory``
  choose the step's own reward or the rollout's), ``step_reward``, ``trajectory_reward``, ``done``,
  ``step`` and ``num_steps``, plus ``group_id`` so GRPO can group the steps of one task's rollouts
  (``<group_id of the rollout>`` or ``<...>:step<k>`` with ``+group_by=task_step``), and the
  rollout's ``_ng_task_index``/``_ng_rollout_index``/task fields.
* Usage: ``ng_export_transitions +input_jsonl_fpath=rollouts.jsonl +output_jsonl_fpath=steps.jsonl
  [+reward=return|step|trajectory] [+group_by=task|task_step]``. A bad line names the file and line.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from nemo_gym.config.command import command
from nemo_gym.jsonl import iter_jsonl_objects

ENV_STATE_KEY = "is_env_state"
TOKEN_KEYS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
REWARD_MODES = ("return", "step", "trajectory")
GROUP_MODES = ("task", "task_step")
_RESERVED = {"responses_create_params", "response", "reward"}


def render_step_context(
    items: list[dict[str, Any]], collapse: bool, placeholder: str, keep_token_ids: bool
) -> list[dict[str, Any]]:
    """The model input for ``items``: env-state markers stripped; with ``collapse``, every env-state
    message but the last replaced by a user message ``placeholder``; token ids dropped unless
    ``keep_token_ids``."""
    last_state = max((i for i, it in enumerate(items) if it.get(ENV_STATE_KEY)), default=-1)
    out = []
    for i, it in enumerate(items):
        if it.get(ENV_STATE_KEY):
            if collapse and i != last_state:
                out.append({"type": "message", "role": "user", "content": placeholder})
                continue
            it = {k: v for k, v in it.items() if k != ENV_STATE_KEY}
        if not keep_token_ids and any(k in it for k in TOKEN_KEYS):
            it = {k: v for k, v in it.items() if k not in TOKEN_KEYS}
        out.append(it)
    return out


def transitions(
    row: dict[str, Any], reward_mode: str = "return", group_by: str = "task"
) -> list[dict[str, Any]]:
    """The step rows of one rollout row (empty when it has no ``steps``)."""
    resp = row.get("response") or {}
    steps = resp.get("steps") or []
    if not steps:
        return []
    params = dict(row.get("responses_create_params") or {})
    raw = params.get("input") or []
    prefix = [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw)
    policy = resp.get("context_policy") or {}
    collapse = bool(policy.get("collapse_old_env_states"))
    placeholder = str(policy.get("old_env_state_message", ""))
    keep_ids = bool(policy.get("token_ids_in_context", True))
    output = resp.get("output") or []
    rewards = [float(s.get("reward") or 0.0) for s in steps]
    task_fields = {k: v for k, v in row.items() if k not in _RESERVED}
    base_group = str(resp.get("group_id", row.get("_ng_task_index", "")))
    out = []
    for k, step in enumerate(steps):
        start, action_end = int(step["output_start"]), int(step["action_end"])
        context = render_step_context(prefix + output[:start], collapse, placeholder, keep_ids)
        reward = {"return": sum(rewards[k:]), "step": rewards[k], "trajectory": row.get("reward")}[
            reward_mode
        ]
        out.append(
            {
                **task_fields,
                "group_id": base_group if group_by == "task" else f"{base_group}:step{step['step']}",
                "step": step["step"],
                "num_steps": len(steps),
                "responses_create_params": {**params, "input": context, "tools": resp.get("tools") or []},
                "response": {"output": output[start:action_end], "env_id": resp.get("env_id")},
                "reward": reward,
                "step_reward": rewards[k],
                "trajectory_reward": row.get("reward"),
                "done": bool(step.get("done")),
                **{key: step[key] for key in TOKEN_KEYS if step.get(key) is not None},
            }
        )
    return out


def _read(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    return iter_jsonl_objects(path)


def export(src: Path, dst: Path, reward_mode: str = "return", group_by: str = "task") -> dict[str, int]:
    """Write the step rows of every rollout in ``src`` to ``dst``; returns counts."""
    counts = {"rollouts": 0, "steps": 0, "skipped_without_steps": 0}
    dst.parent.mkdir(parents=True, exist_ok=True)
    with dst.open("wb") as f:
        for line_no, row in _read(src):
            try:
                rows = transitions(row, reward_mode, group_by)
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(
                    f"{src}:{line_no}: malformed steps record ({type(e).__name__}: {e})"
                ) from None
            counts["rollouts"] += 1
            if not rows:
                counts["skipped_without_steps"] += 1
            for r in rows:
                f.write(orjson.dumps(r) + b"\n")
            counts["steps"] += len(rows)
    return counts


USAGE = (
    "usage: ng_export_transitions +input_jsonl_fpath=<rollouts.jsonl> +output_jsonl_fpath=<steps.jsonl> "
    "[+reward=return|step|trajectory] [+group_by=task|task_step]"
)


@command("ng_export_transitions")
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return
    opts: dict[str, str] = {}
    for arg in argv:
        key, eq, value = arg.lstrip("+").partition("=")
        if not eq or key not in ("input_jsonl_fpath", "output_jsonl_fpath", "reward", "group_by"):
            sys.stderr.write(f"ng_export_transitions: unknown or malformed option {arg!r}\n{USAGE}\n")
            sys.exit(2)
        opts[key] = value
    if "input_jsonl_fpath" not in opts or "output_jsonl_fpath" not in opts:
        sys.stderr.write(
            f"ng_export_transitions: +input_jsonl_fpath and +output_jsonl_fpath are required\n{USAGE}\n"
        )
        sys.exit(2)
    reward_mode, group_by = opts.get("reward", "return"), opts.get("group_by", "task")
    if reward_mode not in REWARD_MODES or group_by not in GROUP_MODES:
        sys.stderr.write(
            f"ng_export_transitions: +reward must be one of {REWARD_MODES}, +group_by one of {GROUP_MODES}\n"
        )
        sys.exit(2)
    src = Path(opts["input_jsonl_fpath"])
    if not src.is_file():
        sys.stderr.write(f"ng_export_transitions: {src} is not a file (+input_jsonl_fpath)\n")
        sys.exit(2)
    try:
        counts = export(src, Path(opts["output_jsonl_fpath"]), reward_mode, group_by)
    except ValueError as e:
        sys.stderr.write(f"ng_export_transitions: {e}\n")
        sys.exit(2)
    print(
        f"{counts['steps']} step rows from {counts['rollouts']} rollouts "
        f"({counts['skipped_without_steps']} without step records) -> {opts['output_jsonl_fpath']}"
    )


if __name__ == "__main__":
    main()
