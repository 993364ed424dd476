"""The whole collection job (:func:`collect_rollouts`) and its end-of-run report.

Contract
--------
* :func:`collect_rollouts` validates the input, checks that its agents run and that the rows carry
  what their environments need (one streaming pass, :func:`~.row_schema.check_input`), all before
  anything is sent; writes the materialized inputs; then
  runs the (task, rollout) pairs not yet done (on resume: retrying failed ones up to
  ``max_attempts``) with at most ``num_samples_in_parallel`` in flight. Each finished rollout is one
  whole line in the output, written as it completes; each infrastructure failure (or a verify
  response without a numeric ``reward``) is a line in the failures file, never in the output. Both
  files are scrubbed of the secret values this process knows (a 200 answer may quote one too). With model-call capture on, each rollout's model calls go to ``<stem>_model_calls.jsonl``.
* Memory is O(``num_samples_in_parallel``) + O(distinct agents, metric keys, failure kinds), whatever
  the number of rows: rows are sent from the materialized inputs as slots free up
  (:func:`~.dispatch.bounded_map`); on resume, the earlier runs' pairs (:class:`~.output_files.ResumeState`)
  are walked beside them in key order from a spill to temporary files, and the attempt numbers of
  the rows in flight alone are held; the report's aggregate metrics stream the output too
  (:func:`~nemo_gym.kit.rollout_stats.aggregate_metrics`).
* The circuit breaker stops dispatch to agents whose server is down (rows not sent are "not
  attempted", not failures); ``stop`` cancels the rollouts in flight (not failures either).
* It runs in three steps, each row going through them top to bottom: plan (check the input, the
  outputs and, on resume, what is done; write the materialized inputs), run (send, record each
  outcome and the breaker's decisions), report.
* It returns the summary, a :class:`~.summary.CollectionSummary` (counts, failure kinds, down
  servers, aggregate metrics from :mod:`nemo_gym.kit.rollout_stats`), and writes its ``to_dict()`` to
  ``<stem>_aggregate_metrics.json`` (its last block, ``live``, this run's numbers as
  :mod:`.live_stats` counted them while it ran: also the progress bar's postfix and, with
  ``+metrics_port``, ``GET /metrics``);
  :func:`format_summary` renders it for people (its last line is ``Average reward: <mean>``).
"""

from __future__ import annotations

import asyncio
import functools
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from nemo_gym.client.replicas import replicated_instances
from nemo_gym.client.server_client import ServerClient, live_replicas
from nemo_gym.collection.circuit_breaker import CircuitBreaker, _error_text, classify_failure, describe_down
from nemo_gym.collection.dispatch import bounded_map, run_one
from nemo_gym.collection.input_rows import materialize
from nemo_gym.collection.live_stats import LiveMetricsServer, LiveStats, failure_label
from nemo_gym.collection.options import (
    MASK_SAMPLE_KEY,
    MASKED_SAMPLE_KIND,
    NG_FAILURE_CLASS_KEY,
    NG_NO_PERSIST_KEY,
    NG_TERMINAL_KEY,
    InputError,
    RolloutCollectionConfig,
)
from nemo_gym.collection.output_files import (
    LineWriter,
    PairStatus,
    ResumeState,
    _check_materialized_matches,
    _check_output_paths,
    sidecar_paths,
)
from nemo_gym.collection.policy_lag import PolicyLagFilter, check_model_server
from nemo_gym.collection.routing import Route, environment_route
from nemo_gym.collection.row_schema import CheckedInput, check_input
from nemo_gym.collection.summary import CollectionSummary, RunCounts
from nemo_gym.errors import UpstreamError
from nemo_gym.kit.rollout_stats import aggregate_metrics, k_values
from nemo_gym.server.model_calls import ModelCallSink, capture_wanted, model_calls_path

# The fields that group this run's failures into kinds for the end-of-run report.
_KIND_FIELDS = ("kind", "server", "status", "via")


class _Progress:
    """A tqdm bar on stderr whose postfix is the run's live numbers (:meth:`LiveStats.postfix`), or nothing."""

    def __init__(self, total: int, enabled: bool, stats: LiveStats) -> None:
        self.bar = None
        self.stats = stats
        self._last = 0.0
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="rollout", dynamic_ncols=True, file=sys.stderr)

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update(1)
            now = time.monotonic()
            if now - self._last > 0.5:  # the postfix is rebuilt at most twice a second
                self._last = now
                self.bar.set_postfix(self.stats.postfix(), refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.set_postfix(self.stats.postfix(), refresh=True)
            self.bar.close()


@dataclass
class _Plan:
    """What this run will do, decided before anything is sent (the plan step)."""

    n_rows: int
    agents: set[str]
    out_path: Path
    side: dict[str, Path]
    calls_path: Path
    capture: bool
    fresh: bool
    # On resume: each pair's record in the output and failures files, in key order (spilled to disk).
    resume: ResumeState | None
    n_done: int
    n_exhausted: int
    unreadable: int
    total: int
    todo: int
    # The environment server each row goes through (None: its agent), nemo_gym.collection.routing.
    route: Route

    def statuses(self) -> Iterator[PairStatus]:
        """The earlier runs' :class:`PairStatus` per pair, in key order (none on a fresh run)."""
        return self.resume.statuses() if self.resume is not None else iter(())

    def close(self) -> None:
        if self.resume is not None:
            self.resume.close()


@dataclass
class _RunResult:
    """What the run step did (this run only)."""

    breaker: CircuitBreaker
    sink: ModelCallSink | None
    live: LiveStats
    n_ok: int = 0
    n_failed: int = 0
    n_unpersisted: int = 0
    wall: float = 0.0
    kinds: Counter[tuple[Any, ...]] = field(default_factory=Counter)
    kind_paths: dict[tuple[Any, ...], set[str]] = field(default_factory=dict)
    lag_filter: PolicyLagFilter | None = None


def _read_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a JSONL file we wrote, one at a time."""
    with open(path, "rb") as f:
        for line in f:
            yield orjson.loads(line)


async def collect_rollouts(
    cfg: RolloutCollectionConfig,
    client: ServerClient,
    stop: asyncio.Event | None = None,
    checked: CheckedInput | None = None,
    live: LiveStats | None = None,
) -> CollectionSummary:
    """The whole job: plan, run, report; returns the summary (also written to the metrics file).

    ``checked`` is the result of :func:`check_input` when the caller already ran it (the CLI does,
    to report a bad input before it connects to the head server). ``live`` receives this run's counts
    too (``ng_e2e_collect_rollouts`` sums its agents' runs there). With ``cfg.metrics_port`` set, this
    run's numbers are served on ``GET /metrics`` from start to end (:mod:`.live_stats`).
    """
    stats = LiveStats(parent=live)
    server = None
    if cfg.metrics_port is not None:
        server = LiveMetricsServer(stats, cfg.metrics_port)
        print(f"Live collection stats: {server.url}", flush=True)
    plan = None
    try:
        plan = await _plan(cfg, client, checked)
        run = await _run(cfg, client, plan, stop, stats)
        return _report(cfg, plan, run, stop)
    finally:
        if plan is not None:
            plan.close()
        if server is not None:
            server.close()


async def _plan(cfg: RolloutCollectionConfig, client: ServerClient, checked: CheckedInput | None) -> _Plan:
    """Check everything and decide which rollouts to run; writes only the materialized inputs."""
    if checked is None:
        checked = await check_input(cfg, client)
    n_rows, agents = checked.n_rows, checked.agents
    out_path = Path(cfg.output_jsonl_fpath)
    side = sidecar_paths(out_path)
    calls_path = model_calls_path(out_path)
    _check_output_paths(cfg, out_path, {**side, "model_calls": calls_path})
    route = environment_route(cfg, client.global_config_dict, agents)
    try:
        capture = capture_wanted(client, cfg.observability_enabled)
        if cfg.max_policy_lag is not None:
            check_model_server(client.global_config_dict, cfg.policy_version_model)
    except ValueError as e:
        raise InputError(str(e)) from None

    if out_path.exists() and out_path.stat().st_size and not (cfg.resume_from_cache or cfg.overwrite):
        raise InputError(
            f"{out_path} already has rollouts. Pass +resume_from_cache=true to complete it, "
            "+overwrite=true to start over, or choose another +output_jsonl_fpath."
        )
    fresh = not cfg.resume_from_cache
    resume = None
    if not fresh:
        # Check before touching anything, so a refused resume leaves every file as it was.
        _check_materialized_matches(cfg, side["materialized"])
        resume = ResumeState(out_path, side["failures"], cfg.max_attempts)
    try:
        if fresh or not side["materialized"].exists():
            writer = LineWriter(side["materialized"], truncate=True)
            try:
                for row in materialize(cfg):
                    writer.write(row)
            finally:
                writer.close()
    except BaseException:
        if resume is not None:
            resume.close()
        raise

    n_done = resume.n_done if resume is not None else 0
    n_exhausted = resume.n_exhausted if resume is not None else 0
    total = n_rows * cfg.num_repeats
    return _Plan(
        n_rows=n_rows,
        agents=agents,
        out_path=out_path,
        side=side,
        calls_path=calls_path,
        capture=capture,
        fresh=fresh,
        resume=resume,
        n_done=n_done,
        n_exhausted=n_exhausted,
        unreadable=resume.unreadable if resume is not None else 0,
        total=total,
        todo=total - n_done - n_exhausted,
        route=route,
    )


async def _run(
    cfg: RolloutCollectionConfig,
    client: ServerClient,
    plan: _Plan,
    stop: asyncio.Event | None,
    stats: LiveStats,
) -> _RunResult:
    """Send the planned rows (the breaker holding back those of down servers); write each outcome."""
    breaker = CircuitBreaker(cfg.circuit_breaker_threshold, replicated_instances(client.global_config_dict))
    probe = functools.partial(live_replicas, client)
    fresh = plan.fresh
    # The attempts recorded by earlier runs of the rows in flight (for the failures file's `attempt`):
    # filled as a row is handed out, emptied as its outcome arrives, so O(in flight).
    prior_attempts: dict[tuple[int, int], int] = {}

    def rows_to_send(dispatch: bool = True) -> Iterator[dict[str, Any]]:
        # From the materialized inputs the plan step wrote (or, on resume, checked against the input):
        # the same rows, without reading the input file again. Both it and the earlier runs' statuses
        # are in (task, rollout) order, so they are walked side by side.
        statuses = plan.statuses()
        status = next(statuses, None)
        for r in _read_rows(plan.side["materialized"]):
            key = (r["_ng_task_index"], r["_ng_rollout_index"])
            while status is not None and status.key < key:
                status = next(statuses, None)
            mine = status if status is not None and status.key == key else None
            if mine is not None and (mine.done or mine.exhausted):
                continue
            if breaker.blocked and breaker.blocking(r["agent_ref"]["name"]) is not None:
                continue  # its agent needs a server that is down: not attempted, left for a resume
            if dispatch and mine is not None and mine.failed:
                prior_attempts[key] = mine.attempts
            yield r

    def all_agents_blocked() -> bool:
        return bool(breaker.blocked) and plan.agents.issubset(breaker.blocked)

    # Both scrubbed of known secrets: a 200 answer may quote one (a model echoing its Authorization header).
    out = LineWriter(plan.out_path, truncate=fresh, scrubbed=True)
    failures = LineWriter(plan.side["failures"], truncate=fresh, scrubbed=True)
    route = plan.route
    worker = lambda r: run_one(client, r, cfg.request_timeout_s, route(r))  # noqa: E731
    # Each rollout's policy versions, and the max_policy_lag judgement (nemo_gym.collection.policy_lag).
    lag_filter = PolicyLagFilter(client, cfg.max_policy_lag, cfg.stale_policy, cfg.policy_version_model)
    worker = lag_filter.wrap(worker)
    sink = (
        ModelCallSink.for_client(client, LineWriter(plan.calls_path, truncate=fresh))
        if plan.capture
        else None
    )
    if sink is not None:  # each rollout's model calls, pulled as it ends (nemo_gym.server.model_calls)
        worker = sink.wrap(worker)
    tally = _RunResult(breaker=breaker, sink=sink, live=stats, lag_filter=lag_filter)
    kinds, kind_paths = tally.kinds, tally.kind_paths
    stats.start()
    stats.plan(plan.todo)
    progress = _Progress(plan.todo, cfg.progress, stats)
    t0 = time.monotonic()
    try:
        if sink is not None:
            await sink.discard(rows_to_send(dispatch=False))  # calls an interrupted earlier run left
        async for row, result, exc in bounded_map(
            rows_to_send(),
            worker,
            cfg.num_samples_in_parallel,
            stop,
            halt=all_agents_blocked,
        ):
            key = (row["_ng_task_index"], row["_ng_rollout_index"])
            attempts_before = prior_attempts.pop(key, 0)
            agent = row["agent_ref"]["name"]
            reward = result.get("reward") if isinstance(result, dict) else None
            if exc is None and isinstance(result, dict) and result.get(NG_NO_PERSIST_KEY):
                tally.n_unpersisted += 1  # the environment asked: written nowhere, a resume runs it again
                stats.rollout_not_persisted()
                progress.update()
                continue
            reported = reported_failure(result) if exc is None and isinstance(result, dict) else None
            if reported is not None:
                # The environment says this rollout failed (e.g. its judge did): a failure, never a reward.
                details = {
                    k: v
                    for k, v in result.items()
                    if (k.startswith("_ng_failure_") and k != NG_TERMINAL_KEY) or k == "failure_reason"
                }
                failure = {
                    "kind": str(reported),
                    "server": agent,
                    "path": "/run",
                    "status": None,
                    "error": _error_text(
                        details or f"the /run answer carries {NG_FAILURE_CLASS_KEY}={reported!r}"
                    ),
                }
                if result.get(NG_TERMINAL_KEY):
                    failure[NG_TERMINAL_KEY] = True
            elif exc is None and isinstance(reward, (int, float)) and not isinstance(reward, bool):
                out.write(result)
                tally.n_ok += 1
                stats.rollout_ok(float(reward), result)
                breaker.success(agent)
                progress.update()
                continue
            else:
                if exc is None:
                    no_reward = "the verify response has no numeric `reward`"
                    exc = UpstreamError(agent, "/run", 200, no_reward, kind="bad_response")
                failure = classify_failure(exc, agent)
                await breaker.record_failure(agent, failure, probe)
            via = (failure.get("via") or {}).get("server")
            kind = (failure["kind"], failure["server"], failure["status"], via)  # as _KIND_FIELDS
            kinds[kind] += 1
            kind_paths.setdefault(kind, set()).add(str(failure["path"]))
            failures.write(
                {
                    "_ng_task_index": key[0],
                    "_ng_rollout_index": key[1],
                    "agent_ref": row["agent_ref"],
                    "attempt": attempts_before + 1,
                    **failure,
                }
            )
            tally.n_failed += 1
            stats.rollout_failed(failure_label(failure["kind"], reported=reported is not None))
            progress.update()
    finally:
        progress.close()
        out.close()
        failures.close()
        if sink is not None:
            sink.close()
    tally.wall = time.monotonic() - t0
    stats.finish()
    return tally


def reported_failure(result: dict[str, Any]) -> str | None:
    """The failure a ``/run`` answer reports about itself (its kind), or None for a result: upstream's
    ``_ng_failure_class``, or 0.7's ``mask_sample: true`` (kind ``failure_kind``, else "masked_sample")."""
    reported = result.get(NG_FAILURE_CLASS_KEY)
    if reported is None and result.get(MASK_SAMPLE_KEY) is True:
        kind = result.get("failure_kind")
        reported = kind if isinstance(kind, str) and kind else MASKED_SAMPLE_KIND
    return reported


def _report(
    cfg: RolloutCollectionConfig, plan: _Plan, run: _RunResult, stop: asyncio.Event | None
) -> CollectionSummary:
    """The summary of the output as it now stands and of this run; written to the metrics file."""
    metrics = aggregate_metrics(
        plan.out_path,
        pass_threshold=cfg.pass_threshold,
        max_k=cfg.num_repeats,
        task_rows_path=plan.side["materialized"],
    )
    done_after = metrics["num_rollouts"]
    wall, n_ok = run.wall, run.n_ok
    files = {"output": str(plan.out_path), **{k: str(v) for k, v in plan.side.items()}}
    if run.sink is not None:
        files["model_calls"] = str(plan.calls_path)
    summary = CollectionSummary(
        input_jsonl_fpath=cfg.input_jsonl_fpath,
        rows=plan.n_rows,
        num_repeats=cfg.num_repeats,
        expected_rollouts=plan.total,
        rollouts_ok=done_after,
        rollouts_missing=plan.total - done_after,
        this_run=RunCounts(
            ok=n_ok, failed=run.n_failed, wall_time_s=wall, rollouts_per_s=n_ok / wall if wall > 0 else 0.0
        ),
        interrupted=bool(stop and stop.is_set()),
        not_attempted=plan.todo - n_ok - run.n_failed - run.n_unpersisted,
        not_persisted=run.n_unpersisted,
        down_servers=run.breaker.report(),
        replica_losses=run.breaker.replica_losses,
        failure_kinds=[
            {**dict(zip(_KIND_FIELDS, k, strict=True)), "paths": sorted(run.kind_paths[k]), "count": n}
            for k, n in run.kinds.most_common()
        ],
        skipped_after_max_attempts=plan.n_exhausted,
        max_attempts=cfg.max_attempts,
        unreadable_output_lines=plan.unreadable,
        files=files,
        metrics=metrics,
        model_calls=run.sink.summary(str(plan.calls_path)) if run.sink is not None else None,
        live=run.live.to_dict(),
        policy_lag=run.lag_filter.summary()
        if run.lag_filter is not None and run.lag_filter.max_policy_lag is not None
        else None,
    )
    plan.side["metrics"].write_bytes(orjson.dumps(summary.to_dict(), option=orjson.OPT_INDENT_2))
    return summary


def format_summary(summary: CollectionSummary) -> str:
    """The human-readable end-of-run report (the last line is ``Average reward: <mean>``)."""
    this, metrics, files = summary.this_run, summary.metrics, summary.files
    lines = [
        f"Rollouts: {summary.rollouts_ok} / {summary.expected_rollouts} ok"
        + (f", {summary.rollouts_missing} missing" if summary.rollouts_missing else "")
        + (" (INTERRUPTED: rerun with +resume_from_cache=true to finish)" if summary.interrupted else ""),
        f"This run: {this.ok} ok, {this.failed} failed in {this.wall_time_s:.1f} s "
        f"({this.rollouts_per_s:.1f} rollouts/s)",
    ]
    for key in sorted(k for k in metrics if k.startswith("mean/")):
        name = key[5:]
        lines.append(f"  {name:<24} mean {metrics[key]:.4f}  std {metrics.get('std/' + name, 0.0):.4f}")
    k_lines = [
        f"pass@{k}={metrics[f'pass@{k}']:.3f}"
        for k in k_values(summary.num_repeats)
        if f"pass@{k}" in metrics
    ]
    if k_lines:
        lines.append(f"  tasks: {metrics['num_tasks']}  " + "  ".join(k_lines))
    tok = metrics["tokens"]
    lines.append(
        f"  tokens: input {tok['input_tokens']}, output {tok['output_tokens']}, total {tok['total_tokens']}"
    )
    if this.failed:
        lines.append(f"  {this.failed} infrastructure failure(s) this run: see {files['failures']}")
    for k in summary.failure_kinds:
        status = f" HTTP {k['status']}" if k["status"] is not None else ""
        via = f" via {k['via']}" if k["via"] else ""
        paths = ", ".join(k["paths"])
        lines.append(f"    {k['count']} x {k['kind']}{status} from {k['server']} ({paths}){via}")
    down = summary.down_servers
    for d in down:
        agents = ", ".join(d["blocked_agents"])
        lines.append(f"  STOPPED: {describe_down(d)}; stopped sending rows to {agents}")
    if down and not summary.interrupted:
        lines.append(
            f"  {summary.not_attempted} rollout(s) not attempted (not failures; they do not count towards "
            "+max_attempts). Restart the server(s), then rerun with +resume_from_cache=true."
        )
    if summary.skipped_after_max_attempts:
        lines.append(
            f"  {summary.skipped_after_max_attempts} rollout(s) skipped: they failed "
            f"{summary.max_attempts} time(s) already (+max_attempts); see {files['failures']}"
        )
    lag = summary.policy_lag
    if lag is not None and lag["stale"]:
        done = (
            "dropped (written nowhere; a resume runs them again)" if lag["dropped"] else "marked stale_policy"
        )
        lines.append(
            f"  {lag['stale']} rollout(s) older than max_policy_lag={lag['max_policy_lag']} versions behind "
            f"{lag['policy_version_model']}: {done}"
        )
    if summary.rollouts_missing and not summary.interrupted and not down:
        lines.append("  Rerun with +resume_from_cache=true to retry the missing rollouts.")
    if metrics.get("malformed_lines") or summary.unreadable_output_lines:
        lines.append(
            f"  {metrics.get('malformed_lines', 0)} unreadable line(s) in {files['output']} were skipped"
        )
    lines.append("Files: " + ", ".join(files.values()))
    if "mean/reward" in metrics:
        lines.append(f"Average reward: {metrics['mean/reward']:.4f}")
    return "\n".join(lines)
