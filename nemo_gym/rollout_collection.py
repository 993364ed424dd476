"""Rollout collection: task rows in, verified reward-annotated trajectories out.

Contract
--------
* The input JSONL is validated in a first streaming pass before any request: every line that is
  not a JSON object, whose ``responses_create_params`` fails validation, or that names no agent is
  reported with its line number and field, all at once, and nothing is sent or written.
* Rows are expanded in place (``num_repeats``: abc -> aabbcc) with ``_ng_task_index`` and
  ``_ng_rollout_index``; the expanded rows are written to ``<stem>_materialized_inputs.jsonl``.
* At most ``num_samples_in_parallel`` rollouts are in flight; rows are read lazily, so memory does
  not grow with the input.
* Each finished rollout is one whole line in the output, written and flushed as it completes. An
  infrastructure failure (connection refused, timeout, 5xx, a 4xx from the agent) goes to
  ``<stem>_failures.jsonl`` with its kind, server, error and attempt number — never to the output.
* ``resume_from_cache`` runs exactly the (task, rollout) pairs missing from the output, retrying
  failed ones up to ``max_attempts``; it refuses if the materialized inputs no longer match.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nemo_gym.global_config import ConfigError
from nemo_gym.openai_utils import NeMoGymResponseCreateParamsNonStreaming
from nemo_gym.rollout_stats import aggregate_metrics
from nemo_gym.server_utils import BaseServerConfig, ServerClient, UpstreamError, response_body

MAX_ERRORS_SHOWN = 50


class RolloutCollectionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_jsonl_fpath: str
    output_jsonl_fpath: str
    agent_name: str | None = None
    limit: int | None = Field(default=None, ge=0)
    num_repeats: int = Field(default=1, ge=1)
    num_samples_in_parallel: int = Field(default=256, ge=1)
    responses_create_params: dict[str, Any] = Field(default_factory=dict)
    num_repeats_add_seed: bool = False
    resume_from_cache: bool = False
    overwrite: bool = False
    max_attempts: int = Field(default=3, ge=1)
    pass_threshold: float = 1.0
    request_timeout_s: float = 3600.0
    progress: bool = True


class InputError(Exception):
    """The input file has problems; the message lists them with line numbers."""


# ------------------------------------------------------------------------------------------------
# Paths.


def sidecar_paths(output: Path) -> dict[str, Path]:
    stem = output.with_suffix("") if output.suffix == ".jsonl" else output
    return {
        "materialized": Path(f"{stem}_materialized_inputs.jsonl"),
        "failures": Path(f"{stem}_failures.jsonl"),
        "metrics": Path(f"{stem}_aggregate_metrics.json"),
    }


# ------------------------------------------------------------------------------------------------
# Input: validation and materialisation (both streaming).


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _agent_of(row: dict[str, Any], default: str | None) -> str | None:
    ref = row.get("agent_ref")
    if isinstance(ref, dict) and ref.get("name"):
        return str(ref["name"])
    return default


def _iter_input(cfg: RolloutCollectionConfig) -> Iterator[tuple[int, bytes]]:
    path = Path(cfg.input_jsonl_fpath)
    taken = 0
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if cfg.limit is not None and taken >= cfg.limit:
                return
            taken += 1
            yield line_no, line


def validate_input(cfg: RolloutCollectionConfig) -> tuple[int, set[str]]:
    """One pass over the input: (number of rows, agent names used); raises InputError listing all problems."""
    path = Path(cfg.input_jsonl_fpath)
    if not path.is_file():
        raise InputError(f"Input file {path} does not exist.")
    problems: list[str] = []
    n_problems = 0
    agents: set[str] = set()
    n = 0
    for line_no, line in _iter_input(cfg):
        n += 1
        where = f"{path}:{line_no}"
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            n_problems += 1
            if len(problems) < MAX_ERRORS_SHOWN:
                problems.append(f"{where}: not valid JSON ({e})")
            continue
        if not isinstance(row, dict):
            n_problems += 1
            if len(problems) < MAX_ERRORS_SHOWN:
                problems.append(f"{where}: a row must be a JSON object, got {type(row).__name__}")
            continue
        line_problems = []
        params = row.get("responses_create_params")
        if not isinstance(params, dict):
            line_problems.append("field `responses_create_params` is missing or not an object")
        else:
            try:
                NeMoGymResponseCreateParamsNonStreaming.model_validate(_deep_merge(params, cfg.responses_create_params))
            except ValidationError as e:
                for err in e.errors()[:5]:
                    loc = ".".join(str(x) for x in err["loc"])
                    line_problems.append(f"field `responses_create_params.{loc}`: {err['msg']}")
        agent = _agent_of(row, cfg.agent_name)
        if agent is None:
            line_problems.append("no agent: the row has no `agent_ref.name` and +agent_name was not given")
        else:
            agents.add(agent)
        if line_problems:
            n_problems += 1
            if len(problems) < MAX_ERRORS_SHOWN:
                problems.extend(f"{where}: {p}" for p in line_problems)
    if n_problems:
        more = f"\n  ... and more ({n_problems} bad lines in all)" if n_problems > MAX_ERRORS_SHOWN else ""
        raise InputError(
            f"{n_problems} line(s) of {path} are not valid task rows; nothing was sent:\n  "
            + "\n  ".join(problems)
            + more
        )
    if n == 0:
        raise InputError(f"{path} has no rows" + (f" (limit={cfg.limit})" if cfg.limit is not None else "") + ".")
    return n, agents


def materialize(cfg: RolloutCollectionConfig) -> Iterator[dict[str, Any]]:
    """The rows actually sent, in order: each input row repeated in place, with indices added."""
    for task_index, (_, line) in enumerate(_iter_input(cfg)):
        row = orjson.loads(line)
        row["responses_create_params"] = _deep_merge(row["responses_create_params"], cfg.responses_create_params)
        agent = _agent_of(row, cfg.agent_name)
        row["agent_ref"] = {"type": "responses_api_agents", "name": agent}
        for rollout_index in range(cfg.num_repeats):
            out = dict(row)
            if cfg.num_repeats_add_seed:
                out["responses_create_params"] = {**row["responses_create_params"], "seed": rollout_index}
            out["_ng_task_index"] = task_index
            out["_ng_rollout_index"] = rollout_index
            yield out


def check_agents_running(agents: set[str], client: ServerClient) -> None:
    cfg = client.global_config_dict
    running = sorted(
        str(name) for name in cfg.keys() if hasattr(cfg.get(name), "keys") and "responses_api_agents" in cfg.get(name)
    )
    missing = sorted(a for a in agents if a not in running)
    if missing:
        raise InputError(
            f"Agent(s) {', '.join(repr(m) for m in missing)} are not running. "
            f"Running agents: {', '.join(running) or 'none'}."
        )


# ------------------------------------------------------------------------------------------------
# Output files.


def _scan_existing_output(path: Path) -> set[tuple[int, int]]:
    """Pairs already done; a trailing partial line (from a hard kill) is cut off."""
    done: set[tuple[int, int]] = set()
    if not path.exists():
        return done
    good_end = 0
    with open(path, "rb") as f:
        offset = 0
        for line in f:
            offset += len(line)
            if not line.endswith(b"\n"):
                break
            try:
                row = orjson.loads(line)
                done.add((int(row["_ng_task_index"]), int(row["_ng_rollout_index"])))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                break
            good_end = offset
    if good_end != path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return done


def _scan_failures(path: Path) -> dict[tuple[int, int], int]:
    attempts: dict[tuple[int, int], int] = {}
    if not path.exists():
        return attempts
    with open(path, "rb") as f:
        for line in f:
            try:
                row = orjson.loads(line)
                key = (int(row["_ng_task_index"]), int(row["_ng_rollout_index"]))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
            attempts[key] = max(attempts.get(key, 0), int(row.get("attempt", 1)))
    return attempts


class LineWriter:
    """Appends whole lines with one ``write`` system call each, so an interrupt never splits a line."""

    def __init__(self, path: Path, truncate: bool = False):
        path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
        self.fd = os.open(path, flags, 0o644)
        self.path = path

    def write(self, obj: Any) -> None:
        data = orjson.dumps(obj) + b"\n"
        view = memoryview(data)
        while view:
            written = os.write(self.fd, view)
            view = view[written:]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# ------------------------------------------------------------------------------------------------
# Running rollouts.


def classify_failure(exc: BaseException, agent: str) -> dict[str, Any]:
    if isinstance(exc, UpstreamError):
        inner = None
        if isinstance(exc.detail, dict):
            inner = (exc.detail.get("error") or {}).get("inner")
        if inner:
            return {
                "kind": inner.get("kind") or "upstream_error",
                "server": inner.get("server"),
                "path": inner.get("path"),
                "status": inner.get("status"),
                "error": str(inner.get("detail"))[:4000],
                "via": {"server": agent, "path": exc.path, "status": exc.status},
            }
        return {"kind": exc.kind, "server": exc.server, "path": exc.path, "status": exc.status, "error": str(exc.detail)[:4000]}
    return {"kind": type(exc).__name__, "server": agent, "path": "/run", "status": None, "error": str(exc)[:4000]}


async def run_one(client: ServerClient, row: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """POST one materialized row to its agent's /run; a non-2xx raises UpstreamError."""
    agent = row["agent_ref"]["name"]
    resp = await client.post(agent, "/run", json=row, timeout_s=timeout_s)
    if resp.status >= 300:
        body = response_body(resp)
        try:
            detail: Any = orjson.loads(body)
        except orjson.JSONDecodeError:
            detail = body.decode(errors="replace")[:4000]
        kind = "server_error" if resp.status >= 500 else "client_error"
        raise UpstreamError(agent, "/run", resp.status, detail, kind=kind)
    result = orjson.loads(response_body(resp))
    result["_ng_task_index"] = row["_ng_task_index"]
    result["_ng_rollout_index"] = row["_ng_rollout_index"]
    result["agent_ref"] = row["agent_ref"]
    return result


async def bounded_map(
    rows: Iterable[dict[str, Any]], worker: Any, limit: int, stop: asyncio.Event | None = None
) -> AsyncIterator[tuple[dict[str, Any], Any, BaseException | None]]:
    """Run ``worker(row)`` with at most ``limit`` in flight, reading ``rows`` lazily; yield as each ends.

    Completions arrive through a queue (O(1) each), so 16k rollouts in flight cost no more per
    completion than 16. When ``stop`` is set, nothing new starts and in-flight work is cancelled.
    """
    pending: dict[asyncio.Future, dict[str, Any]] = {}
    finished: asyncio.Queue[asyncio.Future | None] = asyncio.Queue()
    it = iter(rows)
    exhausted = False
    watcher = None
    if stop is not None:
        watcher = asyncio.ensure_future(stop.wait())
        watcher.add_done_callback(lambda _: finished.put_nowait(None))

    def fill() -> None:
        nonlocal exhausted
        while not exhausted and len(pending) < limit and not (stop and stop.is_set()):
            try:
                row = next(it)
            except StopIteration:
                exhausted = True
                return
            task = asyncio.ensure_future(worker(row))
            pending[task] = row
            task.add_done_callback(finished.put_nowait)

    try:
        fill()
        while pending:
            task = await finished.get()
            if task is None:  # stop requested
                return
            row = pending.pop(task)
            if task.cancelled():
                continue
            exc = task.exception()
            yield row, (None if exc else task.result()), exc
            fill()
    finally:
        if watcher is not None:
            watcher.cancel()
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.bar = None
        self.reward_sum, self.n_ok, self.n_failed = 0.0, 0, 0
        self._last = 0.0
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="rollout", dynamic_ncols=True, file=sys.stderr)

    def update(self, reward: float | None) -> None:
        if reward is None:
            self.n_failed += 1
        else:
            self.n_ok += 1
            self.reward_sum += reward
        if self.bar is not None:
            self.bar.update(1)
            now = time.monotonic()
            if now - self._last > 0.5:
                self._last = now
                mean = self.reward_sum / self.n_ok if self.n_ok else float("nan")
                self.bar.set_postfix(mean_reward=f"{mean:.3f}", failed=self.n_failed, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            mean = self.reward_sum / self.n_ok if self.n_ok else float("nan")
            self.bar.set_postfix(mean_reward=f"{mean:.3f}", failed=self.n_failed, refresh=True)
            self.bar.close()


async def collect_rollouts(
    cfg: RolloutCollectionConfig, client: ServerClient, stop: asyncio.Event | None = None
) -> dict[str, Any]:
    """The whole job; returns the summary (also written to the metrics file)."""
    n_rows, agents = validate_input(cfg)
    check_agents_running(agents, client)
    out_path = Path(cfg.output_jsonl_fpath)
    side = sidecar_paths(out_path)

    if out_path.exists() and out_path.stat().st_size and not (cfg.resume_from_cache or cfg.overwrite):
        raise InputError(
            f"{out_path} already has rollouts. Pass +resume_from_cache=true to complete it, "
            "+overwrite=true to start over, or choose another +output_jsonl_fpath."
        )
    fresh = not cfg.resume_from_cache
    done: set[tuple[int, int]] = set()
    attempts: dict[tuple[int, int], int] = {}
    if not fresh:
        done = _scan_existing_output(out_path)
        attempts = _scan_failures(side["failures"])
        _check_materialized_matches(cfg, side["materialized"])
    if fresh or not side["materialized"].exists():
        writer = LineWriter(side["materialized"], truncate=True)
        try:
            for row in materialize(cfg):
                writer.write(row)
        finally:
            writer.close()

    exhausted = {k for k, a in attempts.items() if a >= cfg.max_attempts and k not in done}
    total = n_rows * cfg.num_repeats
    todo = total - len(done) - len(exhausted)
    rows = (
        r for r in materialize(cfg)
        if (r["_ng_task_index"], r["_ng_rollout_index"]) not in done
        and (r["_ng_task_index"], r["_ng_rollout_index"]) not in exhausted
    )
    out = LineWriter(out_path, truncate=fresh)
    failures = LineWriter(side["failures"], truncate=fresh)
    progress = _Progress(todo, cfg.progress)
    t0 = time.monotonic()
    n_ok = n_failed = 0
    try:
        async for row, result, exc in bounded_map(
            rows, lambda r: run_one(client, r, cfg.request_timeout_s), cfg.num_samples_in_parallel, stop
        ):
            key = (row["_ng_task_index"], row["_ng_rollout_index"])
            if exc is None and isinstance(result.get("reward"), (int, float)) and not isinstance(result.get("reward"), bool):
                out.write(result)
                n_ok += 1
                progress.update(float(result["reward"]))
            else:
                if exc is None:
                    exc = UpstreamError(row["agent_ref"]["name"], "/run", 200, "the verify response has no numeric `reward`", kind="bad_response")
                attempt = attempts.get(key, 0) + 1
                failures.write(
                    {
                        "_ng_task_index": key[0],
                        "_ng_rollout_index": key[1],
                        "agent_ref": row["agent_ref"],
                        "attempt": attempt,
                        **classify_failure(exc, row["agent_ref"]["name"]),
                    }
                )
                n_failed += 1
                progress.update(None)
    finally:
        progress.close()
        out.close()
        failures.close()
    wall = time.monotonic() - t0
    interrupted = bool(stop and stop.is_set())
    metrics = aggregate_metrics(out_path, pass_threshold=cfg.pass_threshold, max_k=cfg.num_repeats)
    done_after = metrics["num_rollouts"]
    summary = {
        "input_jsonl_fpath": cfg.input_jsonl_fpath,
        "rows": n_rows,
        "num_repeats": cfg.num_repeats,
        "expected_rollouts": total,
        "rollouts_ok": done_after,
        "rollouts_missing": total - done_after,
        "this_run": {"ok": n_ok, "failed": n_failed, "wall_time_s": wall, "rollouts_per_s": n_ok / wall if wall > 0 else 0.0},
        "interrupted": interrupted,
        "skipped_after_max_attempts": len(exhausted),
        "files": {"output": str(out_path), **{k: str(v) for k, v in side.items()}},
        **metrics,
    }
    side["metrics"].write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    return summary


def _check_materialized_matches(cfg: RolloutCollectionConfig, path: Path) -> None:
    if not path.exists():
        return
    with open(path, "rb") as f:
        for n, row in enumerate(materialize(cfg), start=1):
            line = f.readline()
            if not line or orjson.loads(line) != orjson.loads(orjson.dumps(row)):
                raise InputError(
                    f"Cannot resume: the rows to send no longer match {path} (first difference at line {n}). "
                    "The input file, +limit, +num_repeats, +responses_create_params or +agent_name changed since "
                    "the first run. Use a new +output_jsonl_fpath, or +overwrite=true to start over."
                )
        if f.readline():
            raise InputError(
                f"Cannot resume: {path} has more rows than the current input and repeats produce. "
                "Use a new +output_jsonl_fpath, or +overwrite=true to start over."
            )


def format_summary(summary: dict[str, Any]) -> str:
    this = summary["this_run"]
    lines = [
        f"Rollouts: {summary['rollouts_ok']} / {summary['expected_rollouts']} ok"
        + (f", {summary['rollouts_missing']} missing" if summary["rollouts_missing"] else "")
        + (" (INTERRUPTED: rerun with +resume_from_cache=true to finish)" if summary["interrupted"] else ""),
        f"This run: {this['ok']} ok, {this['failed']} failed in {this['wall_time_s']:.1f} s ({this['rollouts_per_s']:.1f} rollouts/s)",
    ]
    for key in sorted(k for k in summary if k.startswith("mean/")):
        name = key[5:]
        lines.append(f"  {name:<24} mean {summary[key]:.4f}  std {summary.get('std/' + name, 0.0):.4f}")
    k_lines = [f"pass@{k}={summary[f'pass@{k}']:.3f}" for k in range(1, summary["num_repeats"] + 1) if f"pass@{k}" in summary]
    if k_lines:
        lines.append(f"  tasks: {summary['num_tasks']}  " + "  ".join(k_lines))
    tok = summary["tokens"]
    lines.append(f"  tokens: input {tok['input_tokens']}, output {tok['output_tokens']}, total {tok['total_tokens']}")
    if this["failed"]:
        lines.append(f"  {this['failed']} infrastructure failure(s): see {summary['files']['failures']}")
    lines.append("Files: " + ", ".join(summary["files"].values()))
    if "mean/reward" in summary:
        lines.append(f"Average reward: {summary['mean/reward']:.4f}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Python API for trainers.


class RolloutCollectionHelper:
    """Run task rows through running agents from Python.

    ``for future in RolloutCollectionHelper().run_examples(rows, head_server_config=...):``
    ``    row, result = await future`` — futures complete in any order; at most
    ``num_samples_in_parallel`` rollouts are in flight. ``result`` is the verify response (with
    ``reward`` and every output item's token-id fields, when the model returns them).
    """

    def __init__(self, num_samples_in_parallel: int = 256, request_timeout_s: float = 3600.0):
        self.num_samples_in_parallel = num_samples_in_parallel
        self.request_timeout_s = request_timeout_s
        self._clients: dict[tuple[str, int], ServerClient] = {}

    def _client(self, head: BaseServerConfig | None) -> ServerClient:
        key = (head.host, head.port) if head else ("", 0)
        if key not in self._clients:
            self._clients[key] = ServerClient.load_from_global_config(head)
        return self._clients[key]

    def run_examples(
        self, examples: list[dict[str, Any]], head_server_config: BaseServerConfig | None = None
    ) -> Iterator[Awaitable[tuple[dict[str, Any], dict[str, Any]]]]:
        client = self._client(head_server_config)
        semaphore = asyncio.Semaphore(self.num_samples_in_parallel)

        async def one(row: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
            if not isinstance(row.get("agent_ref"), dict) or "name" not in row["agent_ref"]:
                raise ValueError("each example needs agent_ref: {name: <agent instance>}")
            row = {"_ng_task_index": row.get("_ng_task_index", 0), "_ng_rollout_index": row.get("_ng_rollout_index", 0), **row}
            async with semaphore:
                return row, await run_one(client, row, self.request_timeout_s)

        return asyncio.as_completed([asyncio.ensure_future(one(r)) for r in examples])


# ------------------------------------------------------------------------------------------------
# CLI.


def collect_main(argv: list[str] | None = None) -> None:
    from omegaconf import OmegaConf

    from nemo_gym.global_config import HEAD_SERVER_KEY_NAME, load_global_config

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: ng_collect_rollouts +agent_name=<agent> +input_jsonl_fpath=<in.jsonl> +output_jsonl_fpath=<out.jsonl>\n"
            "  [+limit=N] [+num_repeats=K] [+num_samples_in_parallel=P] [+num_repeats_add_seed=true]\n"
            "  [+responses_create_params.temperature=0.7 ...] [+resume_from_cache=true] [+max_attempts=3]\n"
            "  [+head_server.host=127.0.0.1 +head_server.port=11000]"
        )
        return
    try:
        loaded = load_global_config(argv)
        container = OmegaConf.to_container(loaded.config, resolve=True)
    except ConfigError as e:
        sys.stderr.write(str(e) + "\n")
        sys.exit(2)
    head = container.pop(HEAD_SERVER_KEY_NAME, None) or {}
    fields = {k: v for k, v in container.items() if k in RolloutCollectionConfig.model_fields}
    unknown = sorted(k for k in container if k not in RolloutCollectionConfig.model_fields and not isinstance(container[k], dict))
    if unknown:
        sys.stderr.write(f"ng_collect_rollouts: unknown option(s): {', '.join('+' + u for u in unknown)}. See --help.\n")
        sys.exit(2)
    try:
        cfg = RolloutCollectionConfig.model_validate(fields)
    except ValidationError as e:
        msgs = [f"+{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()]
        sys.stderr.write("ng_collect_rollouts: invalid options:\n  " + "\n  ".join(msgs) + "\n")
        sys.exit(2)
    head_cfg = BaseServerConfig(host=head.get("host", "127.0.0.1"), port=int(head.get("port", 11000)))
    try:
        summary = asyncio.run(_collect_with_signals(cfg, head_cfg))
    except (InputError, ConnectionError) as e:
        sys.stderr.write(f"ng_collect_rollouts: {e}\n")
        sys.exit(2)
    print(format_summary(summary), flush=True)
    sys.exit(130 if summary["interrupted"] else 0)


async def _collect_with_signals(cfg: RolloutCollectionConfig, head: BaseServerConfig) -> dict[str, Any]:
    client = ServerClient.load_from_global_config(head, timeout_s=cfg.request_timeout_s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        return await collect_rollouts(cfg, client, stop)
    finally:
        await client.aclose()
