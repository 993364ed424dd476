"""``ng_bench +suite=all``: every benchmark of the project in one command, each figure beside its aim.

Contract
--------
* Runs, each in a process of its own (one's servers never share a machine moment with another's):
  the framework bench (``ng_bench`` on example_single_tool_call against the bare stack, at each of
  ``+concurrencies``), start-up and memory (:func:`nemo_gym.tools.bench.startup.measure_startup`), every
  environment of :data:`ENVIRONMENTS` at 64 in flight against the bare stack, and the collector at
  scale (``ng_bench +suite=collector``). ``+parts=[...]`` picks some of ``framework``, ``startup``,
  ``environments``, ``collector``; ``+quick=true`` makes every part small (a smoke run: its figures
  mean little).
* Writes one JSON (``+output_json_fpath``, default ``bench_suite.json``): each part's own report under
  ``parts`` and the rows of the table under ``figures`` (``figure``, ``value``, ``aim``, ``met``:
  true, false or null when the figure has no aim), and prints the table. Nothing is asserted: a missed
  aim is a row that says so. A part that fails is a row with its error, and the others still run.
* The aims are issue 25's (:data:`AIMS`); docs/performance.md keeps the latest table and how to read it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from nemo_gym.config.keys import PACKAGE_PARENT_DIR

PARTS = ("framework", "startup", "environments", "collector")


# Environments that run on the scripted model with their example rows and no outside service, and the
# ng_bench options that start each (the same set as tests/test_env_event_loop.py, but for the LLM judge's,
# which needs the scripted model to play the judge too).
def _aviary(task: str) -> list[str]:
    return [
        "+env=aviary",
        f"+env_config_fpath=resources_servers/aviary/configs/{task}_aviary.yaml",
        f"+agent_name={task}_aviary_agent",
        f"+rows_jsonl_fpath=resources_servers/aviary/data/{task}_example.jsonl",
    ]


ENVIRONMENTS: dict[str, list[str]] = {
    **{
        name: [f"+env={name}"]
        for name in (
            "example_single_tool_call",
            "example_multi_step",
            "example_session_state_mgmt",
            "calendar",
            "instruction_following",
            "math_with_judge",
            "mcqa",
            "reasoning_gym",
            "single_step_tool_use_with_argument_comparison",
            "structured_outputs",
            "workplace_assistant",
            "xlam_fc",
            "code_gen",
            "math_with_code",
            "law_discovery",
            "chemistry",
            "literature_qa",
            "workspace_tasks",
        )
    },
    "aviary_gsm8k": _aviary("gsm8k"),
    "aviary_hotpotqa": _aviary("hotpotqa"),
    "gymnasium": ["+env=gymnasium", "+agent_name=gymnasium_agent"],
}
# figure -> (comparison, bound); ">=": at least, "<=": at most.
AIMS: dict[str, tuple[str, float]] = {
    "framework ratio to bare": (">=", 0.8),
    "framework server CPU per rollout / bare": ("<=", 1.25),
    "start-up: ng_run to servers ready (s)": ("<=", 1.0),
    "start-up: USS of head + 3 servers (MiB)": ("<=", 120.0),
    "environment ratio to bare at 64": (">=", 0.5),
    "collector peak RSS, most rows / fewest rows": ("<=", 1.1),
}


def _aim(figure: str) -> tuple[str, float] | None:
    for prefix, aim in AIMS.items():
        if figure.startswith(prefix):
            return aim
    return None


def figure_row(figure: str, value: float | None, note: str = "") -> dict[str, Any]:
    """One row of the table: the figure, its value, its aim and whether the value meets it."""
    aim = _aim(figure)
    met = None
    if aim is not None and value is not None:
        op, bound = aim
        met = value >= bound if op == ">=" else value <= bound
    row: dict[str, Any] = {"figure": figure, "value": value, "aim": f"{aim[0]} {aim[1]:g}" if aim else None}
    row["met"] = met
    if note:
        row["note"] = note
    return row


def _run(argv: list[str], out: Path, timeout_s: float) -> dict[str, Any]:
    """Run a bench command writing ``out``; its report, or an ``error`` naming how it failed."""
    proc = subprocess.run(
        argv, cwd=PACKAGE_PARENT_DIR, capture_output=True, text=True, timeout=timeout_s, env=os.environ.copy()
    )
    if proc.returncode != 0 or not out.is_file():
        return {"error": f"{' '.join(argv[:4])} ... exited {proc.returncode}: {proc.stderr[-1500:]}"}
    return orjson.loads(out.read_bytes())


def _ng_bench(args: list[str], out: Path, timeout_s: float) -> dict[str, Any]:
    return _run(
        [sys.executable, "-m", "nemo_gym.tools.bench.stack", *args, f"+output_json_fpath={out}"],
        out,
        timeout_s,
    )


def _framework(
    tmp: Path, quick: bool, concurrencies: list[int]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    n = 200 if quick else 4096
    report = _ng_bench(
        [f"+concurrencies=[{','.join(map(str, concurrencies))}]", f"+num_rollouts={n}"],
        tmp / "framework.json",
        3600,
    )
    rows = []
    if "error" in report:
        return report, [figure_row("framework ratio to bare", None, report["error"])]
    by = {(r["stack"], r["concurrency"]): r for r in report["results"]}
    for c in concurrencies:
        ours, bare = by.get(("ours", c)), by.get(("bare", c))
        if ours is None or bare is None:
            continue
        note = f"{ours['rollouts_per_s']:.0f} vs {bare['rollouts_per_s']:.0f} rollouts/s"
        rows.append(figure_row(f"framework ratio to bare at {c}", round(ours["ratio_to_bare"], 3), note))
        cpu = ours["cpu_ms_per_rollout_servers"] / bare["cpu_ms_per_rollout_servers"]
        note = f"{ours['cpu_ms_per_rollout_servers']:.2f} vs {bare['cpu_ms_per_rollout_servers']:.2f} ms"
        rows.append(figure_row(f"framework server CPU per rollout / bare at {c}", round(cpu, 3), note))
        rows.append(
            figure_row(f"collector CPU ms per rollout at {c}", round(ours["cpu_ms_per_rollout_collector"], 3))
        )
    return report, rows


def _startup(quick: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from nemo_gym.tools.bench.startup import measure_startup

    try:
        report = measure_startup(runs=1 if quick else 5)
    except Exception as exc:  # noqa: BLE001 - one part's failure is a row, the others still run
        return {"error": str(exc)}, [figure_row("start-up: ng_run to servers ready (s)", None, str(exc))]
    total = report["processes"].get("total", {})
    servers = {k: v for k, v in report["processes"].items() if k not in ("total", "others")}
    uss = sum(v["uss_mib"] for v in servers.values())
    return report, [
        figure_row("start-up: ng_run to servers ready (s)", round(report["time_to_ready_s"]["median"], 3)),
        figure_row(
            "start-up: USS of head + 3 servers (MiB)",
            round(uss, 1),
            f"RSS {total.get('rss_mib', 0):.0f} MiB; processes: {', '.join(servers)}",
        ),
    ]


def _environments(tmp: Path, quick: bool, envs: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    reports: dict[str, Any] = {}
    rows = []
    n = 100 if quick else 1000
    for env in envs:
        args = ENVIRONMENTS.get(env, [f"+env={env}"])
        report = _ng_bench(
            [*args, "+concurrencies=[64]", f"+num_rollouts={n}"], tmp / f"env_{env}.json", 1800
        )
        reports[env] = report
        if "error" in report:
            rows.append(figure_row(f"environment ratio to bare at 64: {env}", None, report["error"][-300:]))
            continue
        ours = next(r for r in report["results"] if r["stack"] == "ours")
        rows.append(
            figure_row(
                f"environment ratio to bare at 64: {env}",
                round(ours["ratio_to_bare"], 3),
                f"{ours['rollouts_per_s']:.0f} rollouts/s, {ours['cpu_ms_per_rollout_servers']:.2f} server CPU ms",
            )
        )
    return reports, rows


def _collector(
    tmp: Path, quick: bool, counts: list[int] | None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    counts = counts or ([10000, 20000] if quick else [10000, 100000, 1000000])
    out = tmp / "collector.json"
    report = _ng_bench(["+suite=collector", f"+row_counts=[{','.join(map(str, counts))}]"], out, 7200)
    if "error" in report:
        return report, [figure_row("collector peak RSS, most rows / fewest rows", None, report["error"])]
    results = sorted(report["results"], key=lambda r: r["rows"])
    first, last = results[0], results[-1]
    return report, [
        figure_row(
            "collector peak RSS, most rows / fewest rows",
            round(last["peak_rss_mb"] / first["peak_rss_mb"], 3),
            f"{first['peak_rss_mb']} MB at {first['rows']} rows, {last['peak_rss_mb']} MB at {last['rows']}",
        ),
        figure_row(
            f"collector CPU ms per rollout at {last['rows']} rows (minimal agent)",
            last["cpu_ms_per_rollout_after_start"],
        ),
    ]


def format_table(rows: list[dict[str, Any]]) -> str:
    width = max(len(r["figure"]) for r in rows) if rows else 10
    lines = [f"{'figure':<{width}}  {'value':>9}  {'aim':>8}  met  note", "-" * (width + 40)]
    for r in rows:
        value = "-" if r["value"] is None else f"{r['value']:g}"
        met = {True: "yes", False: "NO", None: "-"}[r["met"]]
        lines.append(
            f"{r['figure']:<{width}}  {value:>9}  {r['aim'] or '-':>8}  {met:>3}  {r.get('note', '')}"
        )
    return "\n".join(lines)


def run_suite(cfg: dict[str, Any]) -> dict[str, Any]:
    """The whole suite (``cfg``: ng_bench's options, already checked); writes the JSON, prints the table."""
    parts = [str(p) for p in cfg.get("parts", PARTS)]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        sys.exit(f"ng_bench +suite=all: unknown +parts {unknown}; choose from {list(PARTS)}")
    quick = bool(cfg.get("quick", False))
    concurrencies = [int(c) for c in cfg.get("concurrencies", (64, 1024, 16384) if not quick else (64,))]
    envs = [
        str(e) for e in cfg.get("envs", list(ENVIRONMENTS) if not quick else ["example_single_tool_call"])
    ]
    out_path = Path(str(cfg.get("output_json_fpath", "bench_suite.json")))
    started = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="ng_bench_suite_"))
    runners: dict[str, Callable[[], tuple[dict[str, Any], list[dict[str, Any]]]]] = {
        "framework": lambda: _framework(tmp, quick, concurrencies),
        "startup": lambda: _startup(quick),
        "environments": lambda: _environments(tmp, quick, envs),
        "collector": lambda: _collector(tmp, quick, [int(n) for n in cfg.get("row_counts", ())]),
    }
    reports: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for part in parts:
        print(f"ng_bench +suite=all: {part} ...", flush=True)
        reports[part], part_rows = runners[part]()
        rows += part_rows
    report = {
        "suite": "all",
        "quick": quick,
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
        "wall_s": round(time.time() - started, 1),
        "machine": {
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "load_average": os.getloadavg(),
        },
        "figures": rows,
        "parts": reports,
    }
    out_path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(format_table(rows))
    print(f"\nJSON: {out_path}")
    return report
