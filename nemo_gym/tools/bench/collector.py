"""``ng_bench +suite=collector``: the collector at scale, its peak memory and its own CPU per rollout.

Contract
--------
``ng_bench +suite=collector [+row_counts=[10000,100000,1000000]] [+num_samples_in_parallel=4096]
[+num_repeats=1] [+resume=false] [+output_json_fpath=collector_bench.json]`` (also ``python -m
nemo_gym.tools.bench.collector`` with the same options). For each row count it writes that many task
rows to a temporary JSONL and runs the real ``ng_collect_rollouts`` code (its CLI function, in a
process of its own) against a minimal agent: one aiohttp process that serves the head server's
``GET /global_config_dict_yaml`` and answers each ``POST /run`` at once with the row, a reward and a
token usage. It reports per row count: the collector process's peak RSS (the kernel's high-water
mark, ``ru_maxrss``, also after each step: check, plan, run, report), its RSS right after start-up,
its CPU milliseconds per rollout (the whole process, and each step), the wall time and rollouts/s,
and that every rollout landed (from the aggregate metrics file). Peak RSS flat across row counts is
what "constant memory" means here; nothing is asserted. The output is a table and a JSON file.
``+resume=true`` then drops every other line of each output and runs ``+resume_from_cache=true`` (the
resume bookkeeping: half the pairs done, scattered), reported as each result's ``resume`` block.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from nemo_gym.tools.bench.sampling import PeakRss, spawn_module_on_socket

DEFAULT_ROW_COUNTS = (10_000, 100_000, 1_000_000)
DEFAULT_IN_FLIGHT = 4096
AGENT = "bench_agent"
STEPS = ("check", "plan", "run", "report")


# ------------------------------------------------------------------------------------------------
# The input.


def write_rows(path: Path, n: int) -> None:
    """``n`` task rows (a prompt, a numeric and a string field of the task's own), streamed to ``path``."""
    with open(path, "wb", buffering=1 << 20) as f:
        for i in range(n):
            f.write(
                orjson.dumps(
                    {
                        "responses_create_params": {
                            "input": [{"role": "user", "content": f"What is {i} + {i % 97}? Answer briefly."}]
                        },
                        "id": f"task-{i}",
                        "expected": i + i % 97,
                    }
                )
                + b"\n"
            )


# ------------------------------------------------------------------------------------------------
# The minimal agent (and head server), run as ``python -m nemo_gym.tools.bench.collector serve``.


def _agent_config(port: int, in_flight: int) -> str:
    """The global config the fake head server hands the collector: one agent, and a connection pool
    as large as the rollouts in flight (so that many requests are really on the wire)."""
    return (
        f"{AGENT}:\n  responses_api_agents:\n    fast_agent:\n      host: 127.0.0.1\n      port: {port}\n"
        f"global_aiohttp_connector_limit: {max(in_flight, 1024)}\n"
    )


def serve_fast_agent() -> None:
    """Serve the minimal agent on the listening socket ``NG_BENCH_AGENT_FD`` until killed."""
    from aiohttp import web

    from nemo_gym.client.fd_limits import raise_open_file_limit

    raise_open_file_limit()
    sock = socket.socket(fileno=int(os.environ["NG_BENCH_AGENT_FD"]))
    config = _agent_config(sock.getsockname()[1], int(os.environ["NG_BENCH_IN_FLIGHT"])).encode()
    usage = {"input_tokens": 12, "output_tokens": 3, "total_tokens": 15}

    async def global_config(_request: web.Request) -> web.Response:
        return web.Response(body=config, content_type="text/plain")

    async def run(request: web.Request) -> web.Response:
        row = orjson.loads(await request.read())
        task, rollout = row.get("_ng_task_index", 0), row.get("_ng_rollout_index", 0)
        result = {
            **row,
            "response": {"id": f"resp-{task}-{rollout}", "output": [], "usage": usage},
            "reward": 1.0 if (task + rollout) % 3 else 0.0,
            "num_steps": 1 + task % 4,
        }
        return web.Response(body=orjson.dumps(result), content_type="application/json")

    app = web.Application(client_max_size=1 << 24)
    app.router.add_get("/global_config_dict_yaml", global_config)
    app.router.add_get("/", global_config)
    app.router.add_post("/run", run)
    web.run_app(app, sock=sock, print=None, access_log=None, backlog=8192)


class FastAgent:
    """The minimal agent in a process of its own (so its CPU and memory are not the collector's)."""

    def __init__(self, in_flight: int) -> None:
        from nemo_gym.config.ports import reserve_listening_socket

        sock = reserve_listening_socket("127.0.0.1", None, "ng_bench collector agent")
        self.port: int = sock.getsockname()[1]
        env = {"NG_BENCH_AGENT_FD": str(sock.fileno()), "NG_BENCH_IN_FLIGHT": str(in_flight)}
        self.proc = spawn_module_on_socket(["nemo_gym.tools.bench.collector", "serve"], sock, env)
        self._wait_ready()

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode()[-2000:] if self.proc.stderr else ""
                raise RuntimeError(f"the bench agent exited: {err}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{self.port}/", timeout=1, trust_env=False).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError("the bench agent did not start within 60 s")
            time.sleep(0.05)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


# ------------------------------------------------------------------------------------------------
# The collector, run as ``python -m nemo_gym.tools.bench.collector child <result.json> <args>``.


def _usage() -> dict[str, float]:
    """This process's CPU seconds, peak RSS (bytes) so far and current RSS (bytes)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return {
        "cpu_s": ru.ru_utime + ru.ru_stime,
        "peak_rss": ru.ru_maxrss * 1024,
        "rss": rss_pages * os.sysconf("SC_PAGE_SIZE"),
    }


def run_child(result_path: Path, argv: list[str]) -> None:
    """Run ``ng_collect_rollouts`` (its CLI function) here and write this process's numbers per step.

    The steps are marked by wrapping the collector's own functions (the input check, plan, run and
    report steps of :mod:`nemo_gym.collection.collector`); nothing else is changed."""
    from nemo_gym.collection import cli, collector

    marks: dict[str, dict[str, float]] = {"start": _usage()}

    def mark_after(name: str, fn: Any) -> Any:
        if name == "report":

            def sync(*args: Any, **kwargs: Any) -> Any:
                out = fn(*args, **kwargs)
                marks[name] = _usage()
                return out

            return sync

        async def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = await fn(*args, **kwargs)
            marks[name] = _usage()
            return out

        return wrapped

    cli.check_input = mark_after("check", cli.check_input)
    collector._plan = mark_after("plan", collector._plan)
    collector._run = mark_after("run", collector._run)
    collector._report = mark_after("report", collector._report)
    t0 = time.monotonic()
    code: Any = 0
    try:
        cli.collect_main(argv)
    except SystemExit as e:
        code = e.code
    marks["end"] = _usage()
    result_path.write_bytes(orjson.dumps({"exit": code, "wall_s": time.monotonic() - t0, "marks": marks}))


# ------------------------------------------------------------------------------------------------
# One measurement and the suite.


def _collect(run_dir: Path, argv: list[str], tag: str) -> tuple[dict[str, Any], float]:
    """Run the collector child with ``argv`` in ``run_dir``; (its numbers, its sampled peak RSS)."""
    result_path = run_dir / f"{tag}.json"
    with open(run_dir / f"{tag}.stdout", "wb") as stdout, open(run_dir / f"{tag}.stderr", "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nemo_gym.tools.bench.collector", "child", str(result_path), *argv],
            cwd=run_dir,  # no env.yaml of the caller's directory is read
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
        try:
            with PeakRss({"collector": proc.pid}, interval_s=0.5) as sampled:
                proc.wait()
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    if proc.returncode != 0 or not result_path.is_file():
        err = (run_dir / f"{tag}.stderr").read_text()[-3000:]
        raise RuntimeError(f"the collector ({tag}) exited {proc.returncode} in {run_dir}:\n{err}")
    return orjson.loads(result_path.read_bytes()), sampled.peak["collector"]


def _numbers(child: dict[str, Any], sampled_peak: float, rollouts: int) -> dict[str, Any]:
    """Peak RSS, CPU per rollout (whole and per step) of one collector run."""
    marks = child["marks"]
    mb = 2**20
    steps: dict[str, Any] = {}
    before = marks["start"]
    for step in STEPS:
        if step in marks:
            after = marks[step]
            steps[step] = {
                "cpu_ms_per_rollout": round((after["cpu_s"] - before["cpu_s"]) * 1000 / max(1, rollouts), 4),
                "peak_rss_mb_so_far": round(after["peak_rss"] / mb, 1),
                "rss_mb_after": round(after["rss"] / mb, 1),
            }
            before = after
    end = marks["end"]
    return {
        "exit": child["exit"],
        "wall_s": round(child["wall_s"], 2),
        "peak_rss_mb": round(end["peak_rss"] / mb, 1),
        "peak_rss_mb_sampled": round(sampled_peak / mb, 1),
        "rss_mb_after_start": round(marks["start"]["rss"] / mb, 1),
        "peak_rss_growth_mb": round((end["peak_rss"] - marks["start"]["rss"]) / mb, 1),
        "cpu_ms_per_rollout": round(end["cpu_s"] * 1000 / max(1, rollouts), 4),
        "cpu_ms_per_rollout_after_start": round(
            (end["cpu_s"] - marks["start"]["cpu_s"]) * 1000 / max(1, rollouts), 4
        ),
        "steps": steps,
    }


def _keep_every_other_line(path: Path) -> int:
    """Drop every other line of ``path`` (streaming), as if those rollouts never finished; how many kept."""
    tmp = path.with_name(path.name + ".half")
    kept = 0
    with open(path, "rb") as src, open(tmp, "wb", buffering=1 << 20) as dst:
        for i, line in enumerate(src):
            if i % 2 == 0:
                dst.write(line)
                kept += 1
    os.replace(tmp, path)
    return kept


def measure(
    agent: FastAgent, n_rows: int, in_flight: int, num_repeats: int, workdir: Path, resume: bool = False
) -> dict[str, Any]:
    """Collect ``n_rows`` x ``num_repeats`` rollouts in a fresh collector process; its numbers. With
    ``resume``, then drop every other output line and run ``+resume_from_cache=true`` (half the rollouts
    done, scattered over the file, the other half sent again) and report that run too."""
    run_dir = workdir / f"rows_{n_rows}"
    run_dir.mkdir()
    inp = run_dir / "input.jsonl"
    write_rows(inp, n_rows)
    out = run_dir / "rollouts.jsonl"
    metrics_path = run_dir / "rollouts_aggregate_metrics.json"
    argv = [
        f"+agent_name={AGENT}",
        f"+input_jsonl_fpath={inp}",
        f"+output_jsonl_fpath={out}",
        f"+num_samples_in_parallel={in_flight}",
        f"+num_repeats={num_repeats}",
        "+progress=false",
        "+head_server.host=127.0.0.1",
        f"+head_server.port={agent.port}",
    ]
    rollouts = n_rows * num_repeats
    child, sampled = _collect(run_dir, argv, "collect")
    metrics = orjson.loads(metrics_path.read_bytes())
    result: dict[str, Any] = {
        "rows": n_rows,
        "num_repeats": num_repeats,
        "rollouts": rollouts,
        "num_samples_in_parallel": in_flight,
        "rollouts_ok": metrics["rollouts_ok"],
        "run_rollouts_per_s": round(metrics["this_run"]["rollouts_per_s"], 1),
        **_numbers(child, sampled, rollouts),
    }
    if resume:
        kept = _keep_every_other_line(out)
        child, sampled = _collect(run_dir, [*argv, "+resume_from_cache=true"], "resume")
        metrics = orjson.loads(metrics_path.read_bytes())
        result["resume"] = {
            "rollouts_done_before": kept,
            "rollouts_sent": metrics["this_run"]["ok"] + metrics["this_run"]["failed"],
            "rollouts_ok": metrics["rollouts_ok"],
            **_numbers(child, sampled, rollouts),
        }
    return result


def format_table(results: list[dict[str, Any]]) -> str:
    header = (
        f"{'rows':>9} {'rollouts':>9} {'in flight':>9} {'wall s':>8} {'run roll/s':>10} {'peak RSS MB':>11} "
        f"{'growth MB':>9} {'CPU ms/r':>9}  CPU ms/r by step"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        by_step = " ".join(f"{s}={v['cpu_ms_per_rollout']:.3f}" for s, v in r["steps"].items())
        lines.append(
            f"{r['rows']:>9} {r['rollouts']:>9} {r['num_samples_in_parallel']:>9} {r['wall_s']:>8.1f} "
            f"{r['run_rollouts_per_s']:>10.1f} {r['peak_rss_mb']:>11.1f} {r['peak_rss_growth_mb']:>9.1f} "
            f"{r['cpu_ms_per_rollout_after_start']:>9.3f}  {by_step}"
        )
        if "resume" in r:
            lines.append(
                f"{'resume':>9} {r['resume']['rollouts_sent']:>9} {'':>9} {r['resume']['wall_s']:>8.1f} {'':>10} "
                f"{r['resume']['peak_rss_mb']:>11.1f} {r['resume']['peak_rss_growth_mb']:>9.1f}"
            )
    return "\n".join(lines)


def run_suite(cfg: dict[str, Any]) -> None:
    """The collector suite of ``ng_bench`` (``cfg``: its options, already checked)."""
    row_counts = [int(n) for n in cfg.get("row_counts", DEFAULT_ROW_COUNTS)]
    in_flight = int(cfg.get("num_samples_in_parallel", DEFAULT_IN_FLIGHT))
    num_repeats = int(cfg.get("num_repeats", 1))
    resume = bool(cfg.get("resume", False))
    out_path = Path(str(cfg.get("output_json_fpath", "collector_bench.json")))
    if not row_counts or min(row_counts) < 1 or in_flight < 1 or num_repeats < 1:
        sys.exit("ng_bench: +row_counts, +num_samples_in_parallel and +num_repeats must be positive")
    print(
        f"ng_bench collector: rows {row_counts} x {num_repeats}, {in_flight} in flight, against a minimal agent",
        flush=True,
    )
    workdir = Path(tempfile.mkdtemp(prefix="ng_bench_collector_"))
    results: list[dict[str, Any]] = []
    agent = FastAgent(in_flight)
    try:
        for n in row_counts:
            print(f"  {n} rows ...", flush=True)
            r = measure(agent, n, in_flight, num_repeats, workdir, resume)
            print(
                f"    peak RSS {r['peak_rss_mb']} MB, {r['cpu_ms_per_rollout_after_start']} CPU ms/rollout, "
                f"{r['wall_s']} s"
                + (f"; resume of half: peak RSS {r['resume']['peak_rss_mb']} MB" if resume else ""),
                flush=True,
            )
            results.append(r)
            shutil.rmtree(workdir / f"rows_{n}", ignore_errors=True)
    finally:
        agent.close()
        shutil.rmtree(workdir, ignore_errors=True)
    report = {
        "suite": "collector",
        "agent": "minimal aiohttp agent answering /run at once (nemo_gym.tools.bench.collector)",
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "results": results,
    }
    out_path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(format_table(results))
    print(f"\nJSON: {out_path}")


def main(argv: list[str]) -> None:
    """``python -m nemo_gym.tools.bench.collector [+option=value ...]``: ``ng_bench +suite=collector``."""
    from omegaconf import OmegaConf

    from nemo_gym.client.fd_limits import raise_open_file_limit
    from nemo_gym.config.loading import load_global_config
    from nemo_gym.config.options import check_options
    from nemo_gym.config.problems import ConfigError

    raise_open_file_limit()
    try:
        loaded = load_global_config(argv, load_env_yaml=False)
        check_options(loaded, "ng_bench", strict_cli=True)
        cfg = OmegaConf.to_container(loaded.config, resolve=True)
    except ConfigError as e:
        sys.exit(str(e))
    if str(cfg.get("suite", "collector")) != "collector":
        sys.exit(
            "python -m nemo_gym.tools.bench.collector runs +suite=collector only (ng_bench runs the others)"
        )
    run_suite(cfg)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve_fast_agent()
    elif sys.argv[1:2] == ["child"]:
        run_child(Path(sys.argv[2]), sys.argv[3:])
    else:
        main(sys.argv[1:])
