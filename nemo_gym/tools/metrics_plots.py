"""Plots of a run's key series, read back from Prometheus: ``python -m nemo_gym.tools.metrics_plots``.

Grafana is the way to watch a run (docs/grafana/nemo_gym.json); this draws a handful of the same
series into one PNG, so a run can be shown where no Grafana is (docs/observability.md, a report, an
issue). It asks Prometheus's ``/api/v1/query_range`` for each panel's queries over the time range given
and draws one subplot per panel, one line per series, labelled by instance.

Needs matplotlib (the ``plots`` extra: ``pip install 'nemo-gym[plots]'``).
"""

from __future__ import annotations

import argparse
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class Query:
    """A PromQL expression and its legend: ``{label}`` is replaced by that label's value."""

    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    """One subplot: its title, the y axis's unit, a factor applied to every value, and its queries."""

    title: str
    unit: str
    queries: tuple[Query, ...]
    scale: float = 1.0


@dataclass
class Series:
    """One line: its legend and its points (Unix seconds, value; Prometheus's NaN stays NaN)."""

    legend: str
    times: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


def key_panels(window: str = "30s") -> tuple[Panel, ...]:
    """The dashboard's key panels; ``window`` is the range of every rate() and quantile.

    The dashboard uses 1m/5m windows for runs of hours; a run of a few minutes reads better with less.
    """
    q = "histogram_quantile({p}, sum by (instance_name, le) (rate({m}_bucket[{w}])))"
    lat, lag = "nemo_gym_http_request_duration_seconds", "nemo_gym_event_loop_lag_seconds"
    return (
        Panel(
            "Throughput",
            "rollouts/s",
            (
                Query(
                    f"sum by (instance_name) (rate(nemo_gym_rollouts_finished_total[{window}]))",
                    "{instance_name}",
                ),
                Query(f"sum(rate(nemo_gym_collection_rollouts_ok_total[{window}]))", "collector (written)"),
            ),
        ),
        Panel(
            "Reward (mean)",
            "reward",
            (
                Query(
                    f"sum by (instance_name) (rate(nemo_gym_verify_reward_sum[{window}]))"
                    f" / sum by (instance_name) (rate(nemo_gym_verify_reward_count[{window}]))",
                    "{instance_name} (last " + window + ")",
                ),
                Query("nemo_gym_collection_reward_mean", "collector (since start)"),
            ),
        ),
        Panel(
            "Request latency per server",
            "ms",
            (
                Query(q.format(p=0.5, m=lat, w=window), "{instance_name} p50"),
                Query(q.format(p=0.99, m=lat, w=window), "{instance_name} p99"),
            ),
            scale=1000.0,
        ),
        Panel(
            "Event-loop lag p99 per server",
            "ms",
            (Query(q.format(p=0.99, m=lag, w=window), "{instance_name}"),),
            1000.0,
        ),
        Panel(
            "Tokens/s",
            "tokens/s",
            (
                Query(
                    f"sum by (instance_name) (rate(nemo_gym_model_completion_tokens_total[{window}]))",
                    "{instance_name} completion",
                ),
                Query(
                    f"sum by (type) (rate(nemo_gym_collection_tokens_total[{window}]))", "collector {type}"
                ),
            ),
        ),
        Panel(
            "Memory (RSS) per process",
            "MiB",
            (Query("sum by (instance_name) (process_resident_memory_bytes)", "{instance_name}"),),
            1 / 2**20,
        ),
    )


def legend_for(template: str, labels: dict[str, str]) -> str:
    """``template`` with each ``{label}`` replaced by the series' value of it (empty when absent)."""
    return re.sub(r"\{(\w+)\}", lambda m: labels.get(m.group(1), ""), template)


def parse_matrix(body: dict[str, Any], legend: str, scale: float = 1.0) -> list[Series]:
    """The series of a ``query_range`` answer (``resultType`` matrix), values times ``scale``."""
    if body.get("status") != "success":
        raise ValueError(f"Prometheus answered {body.get('status')}: {body.get('error', body)}")
    data = body["data"]
    if data["resultType"] != "matrix":
        raise ValueError(f"expected a matrix, got {data['resultType']}")
    out = []
    for result in data["result"]:
        series = Series(legend_for(legend, result["metric"]))
        for t, v in result["values"]:
            series.times.append(float(t))
            series.values.append(float(v) * scale)  # "NaN" (a quantile of no requests) parses as nan
        out.append(series)
    return sorted(out, key=lambda s: s.legend)


def query_range(
    prom_url: str, query: Query, start: float, end: float, step: float, scale: float = 1.0
) -> list[Series]:
    """One query over [start, end] from Prometheus at ``prom_url``."""
    resp = httpx.get(
        f"{prom_url.rstrip('/')}/api/v1/query_range",
        params={"query": query.expr, "start": start, "end": end, "step": step},
        timeout=30,
        trust_env=False,
    )
    if not resp.headers.get("content-type", "").startswith("application/json"):
        resp.raise_for_status()  # a bad query is a JSON answer naming the error: parse_matrix raises it
    return parse_matrix(resp.json(), query.legend, scale)


def fetch(
    prom_url: str, panels: Sequence[Panel], start: float, end: float, step: float
) -> list[list[Series]]:
    """Every panel's series, in the order of ``panels``."""
    return [
        [s for q in panel.queries for s in query_range(prom_url, q, start, end, step, panel.scale)]
        for panel in panels
    ]


def draw(panels: Sequence[Panel], data: Sequence[Sequence[Series]], start: float, title: str) -> Figure:
    """One figure, two panels a row; x is seconds since ``start``. No pyplot: no global state, no display."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise SystemExit("plots need matplotlib: pip install 'nemo-gym[plots]'") from exc
    rows = math.ceil(len(panels) / 2)
    fig = Figure(figsize=(12, 3.3 * rows), dpi=80, layout="constrained")
    axes = fig.subplots(rows, 2, squeeze=False).flatten()
    for ax, panel, series in zip(axes, panels, data, strict=False):
        for s in series:
            ax.plot([t - start for t in s.times], s.values, label=s.legend, linewidth=1.2)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("time since start (s)", fontsize=8)
        ax.set_ylabel(panel.unit, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=6, loc="best")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=11)
    return fig


def _when(text: str) -> float:
    """Unix seconds, or an ISO 8601 time (a time without zone is local)."""
    try:
        return float(text)
    except ValueError:
        return datetime.fromisoformat(text).timestamp()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_gym.tools.metrics_plots", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus's URL")
    parser.add_argument(
        "--start", type=_when, help="Unix seconds or ISO 8601 (default: --end minus 5 minutes)"
    )
    parser.add_argument("--end", type=_when, help="Unix seconds or ISO 8601 (default: now)")
    parser.add_argument("--step", type=float, default=2.0, help="seconds between points (default 2)")
    parser.add_argument("--window", default="30s", help="range of every rate() and quantile (default 30s)")
    parser.add_argument("--title", default="NeMo Gym run", help="the figure's title")
    parser.add_argument("--out", type=Path, default=Path("metrics.png"), help="the PNG to write")
    args = parser.parse_args(argv)
    end = args.end if args.end is not None else time.time()
    start = args.start if args.start is not None else end - 300
    if start >= end:
        parser.error("--start must be before --end")
    panels = key_panels(args.window)
    fig = draw(panels, fetch(args.prometheus, panels, start, end, args.step), start, args.title)
    fig.savefig(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
