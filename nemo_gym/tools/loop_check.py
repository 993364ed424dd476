"""Does an environment block its servers' event loops under load? A helper for tests.

Contract
--------
* :func:`check_loop_lag` drives ``num_rollouts`` rollouts (more if they end before ``min_seconds``; at
  most ``4 * num_rollouts``) through an agent's ``/run`` at ``concurrency`` in flight, on a run that is
  already up (``running_servers``), then reads every server's ``GET /metrics`` and looks at the
  event-loop **blocked** histogram (``nemo_gym_event_loop_blocked_seconds``: how late each 100 ms tick
  fired, less the time the loop's thread waited for a CPU; see ``docs/observability.md``) over the load
  only: the histogram is read before and after and the difference is judged, so start-up and the
  warm-up rollouts (``warmup_rollouts``, which pay first-use imports and caches) do not count. What a
  busy machine adds (the scheduler not running the server) is not blocking and is not judged: a
  healthy server passes beside CPU hogs, and a handler that runs or sleeps on the loop fails.
* A server fails when more than ``max_late_fraction`` (default 10%) of its ticks, and at least
  ``min_late_ticks`` (default 2), were later than ``bound_s`` (default 100 ms; it must be one of the
  histogram's bucket bounds, so "later" is exact): its 90th-percentile tick is over the bound. A handler
  that blocks does so on every rollout that reaches it (or every n-th), so it makes most ticks late (the
  tests' planted ``time.sleep(0.2)`` verifier: nearly all); a few late ticks come with any busy Python
  server on a shared machine: a full garbage collection (50-240 ms measured in these servers on 2 busy
  cores) or the OS not scheduling the process. Failing raises :class:`LoopLagError` (an
  ``AssertionError``) naming each server over the bound with its worst bucket, its p99 and how many
  ticks were late, and what to do; so does a server whose loop was blocked for more than half of the
  load in all (its ticks' blocked seconds summed) or hardly ticked at all, and a failed rollout (an
  environment that fails under load has not shown anything).
* The load is a closed loop of ``concurrency`` rollouts (default 8). Kept low on purpose: the busiest
  server of a closed loop holds most of the rollouts in flight, and a tick waits behind every request
  that is ready at once, so at 64 in flight on 2 busy cores a loop that is only *busy* (handlers of
  < 1 ms, example_single_tool_call) already lags 100-500 ms. A handler that blocks shows at any
  concurrency; throughput at 64 in flight is ``ng_bench``'s job.
* :func:`check_environment_loop` starts an environment's servers with the scripted model and runs the
  check: ``check_environment_loop([config], agent_name, rows)``.
* Nothing here asserts throughput: the machine's speed changes how long the load lasts, not whether a
  handler blocks the loop.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from nemo_gym.client.server_client import ServerClient, close_shared_session
from nemo_gym.errors import response_body
from nemo_gym.run.cli import RunHelper
from nemo_gym.server.metrics.loop_lag import DEFAULT_INTERVAL_S as TICK_INTERVAL_S
from nemo_gym.tools.testing import get, running_servers

LAG_METRIC = "nemo_gym_event_loop_blocked_seconds"
DEFAULT_BOUND_S = 0.1
DEFAULT_MAX_LATE_FRACTION = 0.1
DEFAULT_MIN_LATE_TICKS = 2

# bucket upper bound ("le", +inf last) -> cumulative tick count
Buckets = dict[float, float]


class LoopLagError(AssertionError):
    """An environment's server lagged beyond the bound under load (or the load itself failed)."""


@dataclass(frozen=True)
class LagSummary:
    """One server's event-loop ticks during the load."""

    server: str
    ticks: int
    late_ticks: int  # ticks in buckets above ``bound_s``
    bound_s: float
    p99_s: float  # upper bound of the bucket that holds the 99th-percentile tick (inf: above the last bound)
    worst_s: tuple[float, float]  # (lower, upper] bounds of the highest bucket with a tick; (0, 0): no tick
    blocked_s: float = 0.0  # the ticks' blocked seconds, summed

    def too_late(
        self,
        max_late_fraction: float = DEFAULT_MAX_LATE_FRACTION,
        min_late_ticks: int = DEFAULT_MIN_LATE_TICKS,
    ) -> bool:
        """More than ``max_late_fraction`` of the ticks, and at least ``min_late_ticks``, were late."""
        return self.late_ticks >= min_late_ticks and self.late_ticks > max_late_fraction * self.ticks

    def describe(self) -> str:
        lo, hi = self.worst_s
        worst = "none" if hi == 0 else f"> {lo:g} s" if math.isinf(hi) else f"{lo * 1000:g}-{hi * 1000:g} ms"
        p99 = (
            "none"
            if not self.ticks
            else "above the last bucket"
            if math.isinf(self.p99_s)
            else f"<= {self.p99_s * 1000:g} ms"
        )
        return (
            f"{self.server}: {self.late_ticks} of {self.ticks} event-loop ticks blocked more than "
            f"{self.bound_s * 1000:g} ms; worst tick {worst}, p99 {p99}, {self.blocked_s:.2f} s blocked in all"
        )


SUM_KEY = -1.0  # where a Buckets mapping keeps the histogram's sum (no bucket bound is negative)


def lag_buckets(metrics_text: str) -> Buckets:
    """The cumulative bucket counts of the event-loop blocked histogram in a ``/metrics`` answer, and its
    sum of seconds under :data:`SUM_KEY`."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name != LAG_METRIC:
            continue
        out = {
            float(s.labels["le"]): s.value
            for s in family.samples
            if s.name.endswith("_bucket") and "le" in s.labels
        }
        if out:
            total = next((s.value for s in family.samples if s.name.endswith("_sum")), 0.0)
            return {SUM_KEY: total, **dict(sorted(out.items()))}
    raise LoopLagError(
        f"no {LAG_METRIC} histogram in the /metrics answer (metrics off? +metrics_enabled=false)"
    )


def read_lag(helper: RunHelper, servers: Iterable[str] | None = None) -> dict[str, Buckets]:
    """Each server's lag buckets now (every server of the run, or those named)."""
    wanted = None if servers is None else set(servers)
    out: dict[str, Buckets] = {}
    for row in helper.server_instances():
        if wanted is not None and row["name"] not in wanted:
            continue
        resp = get(row["url"] + "/metrics", timeout=30)
        if resp.status_code != 200:
            raise LoopLagError(f"{row['name']}: GET /metrics answered {resp.status_code}: {resp.text[:300]}")
        out[row["name"]] = lag_buckets(resp.text)
    if wanted is not None and wanted - set(out):
        raise LoopLagError(f"no server named {sorted(wanted - set(out))} in this run; have {sorted(out)}")
    return out


def summarize(server: str, before: Buckets, after: Buckets, bound_s: float = DEFAULT_BOUND_S) -> LagSummary:
    """The ticks between two readings of one server's histogram, counted against ``bound_s``."""
    bounds = sorted(b for b in after if b != SUM_KEY)
    if bound_s not in bounds:
        raise ValueError(
            f"bound_s={bound_s} is not a bucket bound of {LAG_METRIC}; pick one of {bounds[:-1]}"
        )
    cum = [after[b] - before.get(b, 0.0) for b in bounds]
    ticks = int(cum[-1])
    late = int(ticks - cum[bounds.index(bound_s)])
    rank = max(1, math.ceil(0.99 * ticks))
    p99 = next((b for b, c in zip(bounds, cum, strict=True) if c >= rank), 0.0) if ticks else 0.0
    worst = (0.0, 0.0)
    below = 0.0
    for i, b in enumerate(bounds):
        if cum[i] > below:
            worst = (bounds[i - 1] if i else 0.0, b)
        below = cum[i]
    blocked_s = after.get(SUM_KEY, 0.0) - before.get(SUM_KEY, 0.0)
    return LagSummary(server, ticks, late, bound_s, p99, worst, blocked_s)


async def _drive(
    client: ServerClient,
    agent_name: str,
    rows: list[dict[str, Any]],
    num_rollouts: int,
    concurrency: int,
    min_seconds: float,
    max_rollouts: int,
    timeout_s: float,
) -> tuple[int, list[str]]:
    """Run rollouts, ``concurrency`` at a time; returns (rollouts answered, error messages)."""
    started = 0
    answered = 0
    errors: list[str] = []
    t0 = time.monotonic()

    def next_index() -> int | None:
        nonlocal started
        if started >= max_rollouts or (started >= num_rollouts and time.monotonic() - t0 >= min_seconds):
            return None
        started += 1
        return started - 1

    async def worker() -> None:
        nonlocal answered
        while (i := next_index()) is not None and len(errors) < 5:
            row = rows[i % len(rows)]
            try:
                resp = await client.post(agent_name, "/run", json=row, timeout_s=timeout_s)
                if resp.status != 200:
                    errors.append(f"{agent_name}/run answered {resp.status}: {response_body(resp)[:500]!r}")
            except Exception as e:  # a rollout that cannot finish is a failure of the check, said plainly
                errors.append(f"{agent_name}/run raised {type(e).__name__}: {e}")
            answered += 1

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await close_shared_session()
    return answered, errors


def drive_rollouts(
    helper: RunHelper,
    agent_name: str,
    rows: list[dict[str, Any]],
    num_rollouts: int,
    concurrency: int,
    min_seconds: float = 0.0,
    max_rollouts: int | None = None,
    timeout_s: float = 300.0,
) -> int:
    """Run rollouts of ``rows`` (cycled) through ``agent_name``'s ``/run``; raises :class:`LoopLagError`
    on the first failures, else returns how many ran."""
    if not rows:
        raise ValueError("no rows to run")
    client = ServerClient.load_from_global_config(helper.head_server_config)
    done, errors = asyncio.run(
        _drive(
            client,
            agent_name,
            rows,
            num_rollouts,
            concurrency,
            min_seconds,
            max_rollouts or num_rollouts,
            timeout_s,
        )
    )
    if errors:
        raise LoopLagError(f"{len(errors)} rollout(s) failed under load ({done} ran); first: {errors[0]}")
    return done


def check_loop_lag(
    helper: RunHelper,
    agent_name: str,
    rows: list[dict[str, Any]],
    *,
    num_rollouts: int = 200,
    concurrency: int = 8,
    bound_s: float = DEFAULT_BOUND_S,
    max_late_fraction: float = DEFAULT_MAX_LATE_FRACTION,
    min_late_ticks: int = DEFAULT_MIN_LATE_TICKS,
    warmup_rollouts: int | None = None,
    min_seconds: float = 3.0,
    servers: Iterable[str] | None = None,
) -> dict[str, LagSummary]:
    """See the module docstring. Returns each server's summary when none is over the bound."""
    warmup = min(len(rows), 8) if warmup_rollouts is None else warmup_rollouts
    if warmup:
        drive_rollouts(helper, agent_name, rows, warmup, min(concurrency, warmup))
    before = read_lag(helper, servers)
    t0 = time.monotonic()
    done = drive_rollouts(
        helper,
        agent_name,
        rows,
        num_rollouts,
        concurrency,
        min_seconds=min_seconds,
        max_rollouts=4 * num_rollouts,
    )
    elapsed = time.monotonic() - t0
    after = read_lag(helper, list(before))
    summaries = {name: summarize(name, before[name], after[name], bound_s) for name in before}
    # A loop blocked for most of the load: its ticks' blocked seconds add up to most of it, or it hardly
    # ticked at all (a tick still blocked when the second reading is taken is not counted). Not a count of
    # ticks against the elapsed time: on a busy machine a healthy loop also ticks less often.
    min_ticks = 2
    over = {
        name: s.describe()
        + (
            f"; only {s.ticks} ticks in {elapsed:.1f} s (one is due every {TICK_INTERVAL_S * 1000:g} ms)"
            if s.ticks < min_ticks
            else ""
        )
        for name, s in summaries.items()
        if s.too_late(max_late_fraction, min_late_ticks) or s.ticks < min_ticks or s.blocked_s > elapsed / 2
    }
    if over:
        lines = "\n  ".join(over.values())
        raise LoopLagError(
            f"event loop blocked under load ({done} rollouts of {agent_name!r} at {concurrency} in flight, "
            f"{elapsed:.1f} s):\n  {lines}\n"
            "A handler runs blocking work on the event loop (a synchronous sleep or HTTP call, a CPU-heavy "
            "verifier or reset): move it off the loop (asyncio.to_thread, or the verify pool of "
            "docs/writing_an_environment.md), or profile the server under load (py-spy top --pid <pid>)."
        )
    return summaries


def check_environment_loop(
    config_paths: list[str],
    agent_name: str,
    rows: list[dict[str, Any]],
    extra_config: dict[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, LagSummary]:
    """Start an environment's servers on the scripted model and run :func:`check_loop_lag` on them."""
    with running_servers(config_paths, extra_config) as helper:
        return check_loop_lag(helper, agent_name, rows, **kwargs)
