"""``ng_reverify``: score saved rollouts again with the current verifiers, old and new reward side by side.

Contract
--------
* Input: a rollouts file written by ``ng_collect_rollouts`` (``+input_jsonl_fpath``); servers running
  (``ng_run``), found through the head server as the collector finds them. Each line's
  ``agent_ref.name`` names its agent; the agent's ``resources_server`` is the verifier asked.
* What is posted to ``/verify`` is upstream NeMo Gym's re-verification payload: the task row the
  rollout came from plus its recorded ``response``. The row comes from the collector's
  ``<stem>_materialized_inputs.jsonl`` next to the input (or ``+inputs_jsonl_fpath``), matched by
  ``(_ng_task_index, _ng_rollout_index)``. ``+inputs_jsonl_fpath`` may also be the plain task file the
  rollouts were collected from (rows without those indices): row ``n`` (0-based, blank lines skipped)
  is task ``n``. For upstream's layout, ``<name>_rollouts.jsonl`` next to ``<name>.jsonl`` (e.g.
  ``data/example_rollouts.jsonl`` and ``data/example.jsonl``), that task file is found by itself.
  Without any of these, the line itself minus its ``reward`` is posted and a warning says so: task
  fields the verifier did not echo into its response (upstream's string_match drops
  ``extraction_mode``) then take their defaults, and the reward can differ.
* ``+where.<field>=<value>`` (repeatable, all must hold) re-verifies only lines whose top-level field
  equals the value; the other lines are copied unchanged. Default: every line.
* Output (``+output_jsonl_fpath``, never the input; an existing file only with ``+overwrite=true``):
  every line in input order; a re-verified line is the old line with the new verify response laid
  over it, plus ``previous_reward`` (its reward before). The file appears whole at the end (written
  to a temporary file, then renamed): an interruption or error leaves no partial output and never
  touches the input.
* Before anything is posted, each resources server's ``GET /reverify_mode`` is asked: ``unsupported``
  (verify needs the rollout's live session state) refuses to run unless ``+force=true``; ``unknown``
  warns. A line whose ``/verify`` fails (unreachable, 5xx, judge down) is an infrastructure failure:
  it goes to ``<output stem>_failures.jsonl`` with the error and is left out of the output, never
  scored 0; the exit status is then 1.
* A summary: lines re-verified, rewards changed (up, down), mean reward before and after, and the
  first changed lines. Exit status: 0 done, 1 some lines failed, 2 bad input or options (nothing
  posted or written), 130 interrupted (nothing written).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

from nemo_gym.global_config import (
    HEAD_SERVER_KEY_NAME,
    ROLLOUT_INDEX_KEY_NAME,
    TASK_INDEX_KEY_NAME,
    ConfigError,
    load_global_config,
    parse_cli_overrides,
)
from nemo_gym.rollout_collection import bounded_map
from nemo_gym.server_client import (
    BaseServerConfig,
    ServerClient,
    UpstreamError,
    _find_instance_block,
    close_shared_session,
    response_body,
)

OPTIONS = (
    "input_jsonl_fpath",
    "output_jsonl_fpath",
    "inputs_jsonl_fpath",
    "where",
    "overwrite",
    "force",
    "num_samples_in_parallel",
    HEAD_SERVER_KEY_NAME,
)
USAGE = (
    "usage: ng_reverify +input_jsonl_fpath=<rollouts.jsonl> +output_jsonl_fpath=<new.jsonl>\n"
    "  [+inputs_jsonl_fpath=<materialized inputs, or the task file>] [+where.<field>=<value> ...] [+overwrite=true]\n"
    "  [+force=true] [+num_samples_in_parallel=64] [+head_server.host=127.0.0.1 +head_server.port=11000]\n"
    "exit status: 0 done, 1 some lines failed (see the failures file), 2 bad input or options, 130 interrupted"
)
SHOWN_CHANGES = 10


class ReverifyError(Exception):
    """Bad input or options: nothing was posted or written."""


def _key(row: dict[str, Any]) -> tuple[Any, Any] | None:
    task, rollout = row.get(TASK_INDEX_KEY_NAME), row.get(ROLLOUT_INDEX_KEY_NAME)
    return None if task is None or rollout is None else (task, rollout)


def read_jsonl(path: Path, what: str) -> list[dict[str, Any]]:
    """The objects of a JSONL file; any line that is not a JSON object is an error naming file and line."""
    rows: list[dict[str, Any]] = []
    bad: list[str] = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                bad.append(f"{path}:{number}: not JSON ({e})")
                continue
            if not isinstance(value, dict):
                bad.append(f"{path}:{number}: not a JSON object")
                continue
            rows.append(value)
    if bad:
        raise ReverifyError(f"{len(bad)} bad line(s) in the {what}:\n  " + "\n  ".join(bad[:20]))
    return rows


def default_inputs_path(source: Path) -> Path | None:
    """The task rows of a rollouts file found next to it, or None.

    The collector's ``<stem>_materialized_inputs.jsonl`` first; else, for upstream NeMo Gym's layout,
    ``<name>.jsonl`` beside ``<name>_rollouts.jsonl``.
    """
    stem = source.with_suffix("") if source.suffix == ".jsonl" else source
    materialized = Path(f"{stem}_materialized_inputs.jsonl")
    if materialized.is_file():
        return materialized
    if stem.name.endswith("_rollouts"):
        task_file = stem.with_name(stem.name.removesuffix("_rollouts") + ".jsonl")
        if task_file.is_file():
            return task_file
    return None


def _matches(row: dict[str, Any], where: dict[str, Any]) -> bool:
    return all(row.get(k) == v for k, v in where.items())


def plan(
    lines: list[dict[str, Any]],
    inputs: list[dict[str, Any]] | None,
    where: dict[str, Any],
    source: Path,
) -> list[tuple[int, dict[str, Any]]]:
    """``(line index, /verify payload)`` for each line to re-verify; errors name the line and field."""
    keyed = [r for r in inputs or [] if _key(r) is not None]
    if inputs and keyed and len(keyed) != len(inputs):
        raise ReverifyError(
            f"the inputs file mixes rows with and without {TASK_INDEX_KEY_NAME}/{ROLLOUT_INDEX_KEY_NAME}: "
            "give either the collector's materialized inputs or the plain task file"
        )
    by_key = {_key(r): r for r in keyed}
    by_task = dict(enumerate(inputs)) if inputs and not keyed else None  # a plain task file: row n is task n
    todo: list[tuple[int, dict[str, Any]]] = []
    problems: list[str] = []
    for i, line in enumerate(lines):
        if not _matches(line, where):
            continue
        where_at = f"{source}: line {i + 1}"
        if not isinstance(line.get("response"), dict):
            problems.append(f"{where_at}: no recorded 'response' to verify")
            continue
        if not isinstance((line.get("agent_ref") or {}).get("name"), str):
            problems.append(f"{where_at}: no 'agent_ref.name' (which agent's environment scored it?)")
            continue
        if by_task is not None:
            row = by_task.get(line.get(TASK_INDEX_KEY_NAME))  # type: ignore[arg-type]
            if row is None:
                problems.append(f"{where_at}: its {TASK_INDEX_KEY_NAME} {line.get(TASK_INDEX_KEY_NAME)!r} is not a "
                                f"row of the task file ({len(by_task)} rows)")  # fmt: skip
                continue
            payload = {**row, "response": line["response"]}
        elif inputs is not None:
            row = by_key.get(_key(line))
            if row is None:
                problems.append(f"{where_at}: no task row with its {TASK_INDEX_KEY_NAME}/{ROLLOUT_INDEX_KEY_NAME} "
                                f"{_key(line)} in the inputs file")  # fmt: skip
                continue
            payload = {**row, "response": line["response"]}
        else:
            payload = {k: v for k, v in line.items() if k != "reward"}
        todo.append((i, payload))
    if problems:
        raise ReverifyError(
            f"{len(problems)} line(s) cannot be re-verified:\n  " + "\n  ".join(problems[:20])
        )
    return todo


def _resources_server_of(config: Any, agent: str) -> str:
    found = _find_instance_block(config, agent)
    if found is None or found[0] != "responses_api_agents":
        raise ReverifyError(f"agent '{agent}' (agent_ref.name) is not an agent of the running servers")
    ref = found[2].get("resources_server") if hasattr(found[2], "get") else None
    name = ref.get("name") if hasattr(ref, "get") else None
    if not name:
        raise ReverifyError(f"agent '{agent}' has no resources_server to verify with")
    return str(name)


async def reverify(
    lines: list[dict[str, Any]],
    todo: list[tuple[int, dict[str, Any]]],
    client: ServerClient,
    output: Path,
    failures_path: Path,
    force: bool = False,
    parallel: int = 64,
    stop: asyncio.Event | None = None,
) -> dict[str, Any]:
    """Post each payload to its verifier; write the whole output file (atomically) and the failures."""
    servers = {lines[i]["agent_ref"]["name"]: "" for i, _ in todo}
    for agent in servers:
        servers[agent] = _resources_server_of(client.global_config_dict, agent)
    for name in sorted(set(servers.values())):
        resp = await client.get(name, "/reverify_mode")
        mode = orjson.loads(response_body(resp)) if resp.status == 200 else "unknown"
        if mode == "unsupported" and not force:
            raise ReverifyError(
                f"resources server '{name}' says its /verify needs the rollout's live session state "
                "(reverify_mode: unsupported), so re-verifying stored rollouts would score them wrongly; "
                "+force=true runs it anyway"
            )
        if mode != "stateless":
            sys.stderr.write(f"ng_reverify: resources server '{name}' reverify_mode is {mode!r}\n")

    async def one(item: dict[str, Any]) -> dict[str, Any]:
        i, payload = item["i"], item["payload"]
        resp = await client.post(servers[lines[i]["agent_ref"]["name"]], "/verify", json=payload)
        body = response_body(resp)
        if resp.status >= 400:
            raise UpstreamError(servers[lines[i]["agent_ref"]["name"]], "/verify", resp.status, body[:2000])
        return orjson.loads(body)

    new: dict[int, dict[str, Any]] = {}
    failed: list[dict[str, Any]] = []
    items = [{"i": i, "payload": p} for i, p in todo]
    async for item, result, error in bounded_map(items, one, max(1, parallel), stop=stop):
        line = lines[item["i"]]
        if error is not None:
            if isinstance(error, asyncio.CancelledError):
                continue
            failed.append({"line": item["i"] + 1, **{k: line.get(k) for k in (TASK_INDEX_KEY_NAME,
                           ROLLOUT_INDEX_KEY_NAME, "agent_ref")}, "error": f"{type(error).__name__}: {error}"})  # fmt: skip
            continue
        new[item["i"]] = {**line, **result, "previous_reward": line.get("reward")}
    if stop is not None and stop.is_set():
        return {"interrupted": True}
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{output.name}.", dir=output.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for i, line in enumerate(lines):
                if i in new:
                    f.write(orjson.dumps(new[i]) + b"\n")
                elif not any(fr["line"] == i + 1 for fr in failed):
                    f.write(orjson.dumps(line) + b"\n")
        os.replace(tmp, output)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if failed:
        with open(failures_path, "wb") as f:
            for fr in failed:
                f.write(orjson.dumps(fr) + b"\n")
    return summarize(new, failed)


def summarize(new: dict[int, dict[str, Any]], failed: list[dict[str, Any]]) -> dict[str, Any]:
    def number(v: Any) -> float | None:
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    before = [number(r.get("previous_reward")) for r in new.values()]
    after = [number(r.get("reward")) for r in new.values()]
    changed = [(i + 1, b, a) for (i, _), b, a in zip(new.items(), before, after, strict=True) if b != a]
    mean = lambda xs: math.fsum(x for x in xs if x is not None) / max(1, sum(x is not None for x in xs))  # noqa: E731
    return {
        "interrupted": False,
        "reverified": len(new),
        "failed": len(failed),
        "changed": len(changed),
        "up": sum(1 for _, b, a in changed if b is not None and a is not None and a > b),
        "down": sum(1 for _, b, a in changed if b is not None and a is not None and a < b),
        "mean_before": mean(before),
        "mean_after": mean(after),
        "first_changes": sorted(changed)[:SHOWN_CHANGES],
    }


def format_summary(s: dict[str, Any], output: Path) -> str:
    text = (
        f"re-verified {s['reverified']} line(s): {s['changed']} reward(s) changed ({s['up']} up, {s['down']} down); "
        f"mean reward {s['mean_before']:.4f} -> {s['mean_after']:.4f}; failed {s['failed']}. Wrote {output}"
    )
    for line, b, a in s["first_changes"]:
        text += f"\n  line {line}: {b} -> {a}"
    return text


def main(argv: list[str] | None = None) -> None:
    """``ng_reverify`` (see the module docstring)."""
    from omegaconf import OmegaConf

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return
    try:
        unknown = sorted(
            {o.key.split(".")[0] for o in parse_cli_overrides(argv) if not o.delete} - set(OPTIONS)
        )
        if unknown:
            raise ReverifyError(f"unknown option(s): {', '.join('+' + k for k in unknown)}. See --help.")
        cfg = OmegaConf.to_container(load_global_config(argv).config, resolve=True)
        source = Path(str(cfg.get("input_jsonl_fpath") or ""))
        output = Path(str(cfg.get("output_jsonl_fpath") or ""))
        if not cfg.get("input_jsonl_fpath") or not cfg.get("output_jsonl_fpath"):
            raise ReverifyError(
                "pass +input_jsonl_fpath=<rollouts.jsonl> and +output_jsonl_fpath=<new.jsonl>"
            )
        if not source.is_file():
            raise ReverifyError(f"{source} is not a file (+input_jsonl_fpath)")
        if output.resolve() == source.resolve():
            raise ReverifyError(
                "+output_jsonl_fpath must differ from +input_jsonl_fpath (the input is never rewritten)"
            )
        if output.exists() and not cfg.get("overwrite"):
            raise ReverifyError(f"{output} exists; pass +overwrite=true to replace it")
        where = cfg.get("where") or {}
        if not isinstance(where, dict):
            raise ReverifyError("+where takes fields: +where.<field>=<value>")
        stem = source.with_suffix("") if source.suffix == ".jsonl" else source
        inputs_path = Path(str(cfg["inputs_jsonl_fpath"])) if cfg.get("inputs_jsonl_fpath") else None
        if inputs_path is not None and not inputs_path.is_file():
            raise ReverifyError(f"{inputs_path} is not a file (+inputs_jsonl_fpath)")
        inputs_path = inputs_path or default_inputs_path(source)
        if inputs_path is None:
            sys.stderr.write(
                f"ng_reverify: warning: no task rows for {source} (no {stem.name}_materialized_inputs.jsonl "
                "next to it, no +inputs_jsonl_fpath): each line is verified as recorded, so task fields the "
                "verifier did not echo back take their defaults. Pass +inputs_jsonl_fpath=<the task JSONL> "
                "for the exact rows.\n"
            )
        else:
            sys.stderr.write(f"ng_reverify: task rows from {inputs_path}\n")
        lines = read_jsonl(source, "rollouts file")
        inputs = read_jsonl(inputs_path, "inputs file") if inputs_path else None
        todo = plan(lines, inputs, where, source)
        head = cfg.get(HEAD_SERVER_KEY_NAME) or {}
        head_cfg = BaseServerConfig(host=head.get("host") or "127.0.0.1", port=int(head.get("port") or 11000))
        parallel = int(cfg.get("num_samples_in_parallel") or 64)
    except (ConfigError, ReverifyError, ValueError) as e:
        sys.stderr.write(f"ng_reverify: {e}\n")
        sys.exit(2)
    out_stem = output.with_suffix("") if output.suffix == ".jsonl" else output
    failures_path = Path(f"{out_stem}_failures.jsonl")

    async def run() -> dict[str, Any]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        client = ServerClient.load_from_global_config(head_cfg)
        try:
            return await reverify(
                lines, todo, client, output, failures_path, bool(cfg.get("force")), parallel, stop
            )
        finally:
            await close_shared_session()

    try:
        summary = asyncio.run(run())
    except (ReverifyError, ConnectionError) as e:
        sys.stderr.write(f"ng_reverify: {e}\n")
        sys.exit(2)
    if summary["interrupted"]:
        sys.stderr.write("ng_reverify: interrupted; nothing written\n")
        sys.exit(130)
    print(format_summary(summary, output), flush=True)
    if summary["failed"]:
        sys.stderr.write(f"ng_reverify: {summary['failed']} line(s) failed, left out; see {failures_path}\n")
        sys.exit(1)
