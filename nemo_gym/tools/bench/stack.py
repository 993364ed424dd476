"""``ng_bench``: rollouts/s of an environment on the scripted model, as a ratio of the bare HTTP limit.

Contract
--------
Starts the servers of one environment with the scripted model (through ``RunHelper``), runs N
rollouts at each concurrency, and reports per concurrency: rollouts/s, p50/p99 rollout latency,
CPU-milliseconds per rollout summed over the server processes (and the collector's own), and peak
RSS per process. In the same run it measures the bare limit: a minimal FastAPI echo stack (one
"agent" process that makes the same number of inner calls per rollout to two echo processes,
uvicorn + aiohttp like ours) driven the same way, and reports our throughput as a ratio of it.
Numbers are measured, never asserted; the output is a table and a JSON file.

``+compare_auth=true`` also starts the same servers with ``+server_auth=false`` (no run-token check)
and measures both in alternating rounds (``+rounds``, default 3; the order flips every round so a
drift of the machine's speed hits both alike). Each stack's row then holds the medians over its
rounds, and ``ours`` gets ``ratio_to_no_auth`` (rollouts/s) and ``cpu_ratio_to_no_auth`` (server
CPU per rollout): what the token check costs, measured in one run. The body limit stays on in both.
``paired_ratio_to_no_auth`` / ``paired_cpu_ratio_to_no_auth`` are the medians of the round-by-round
ratios (round i of one stack ran right before or after round i of the other, so a drift of the
machine's speed cancels within each pair): the steadier figure on a shared machine.
``+compare_metrics=true`` does the same with ``+metrics_enabled=false`` (no ``/metrics``, no metrics
middleware, no event-loop tick: :mod:`nemo_gym.server.metrics`); ``ours`` gets ``ratio_to_no_metrics`` and
``cpu_ratio_to_no_metrics``. Both comparisons may run together (three stacks in alternating rounds).

Environments whose files are not named after their folder, or whose agent is not ``<env>_simple_agent``:
``+env_config_fpath`` (default ``resources_servers/<env>/configs/<env>.yaml``) and ``+agent_name``;
``+config_paths=[...]`` adds config files whose server blocks are laid over the env's (e.g. one that
gives the scripted model a script), and ``+rows_jsonl_fpath`` replaces the env's ``data/example.jsonl``.

Each ``ours`` result also carries ``event_loop_lag_by_server``: per server, the ticks of its event-loop
lag histogram (``nemo_gym_event_loop_lag_seconds``) during that measurement, how many were more than
100 ms late, and the upper bound of the bucket of the 99th-percentile tick (``p99_ms``, ``null`` above the
last bucket), medians over rounds like the other numbers. A server that blocks its loop shows there.

``+suite=streaming`` measures ``stream: true`` (:mod:`nemo_gym.tools.bench.streaming`).
``+suite=collector`` measures the collector instead (its peak RSS and own CPU per rollout at several
row counts, against a minimal agent): :mod:`nemo_gym.tools.bench.collector`. The default suite's
output is as described above.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import psutil

from nemo_gym.client.fd_limits import raise_open_file_limit
from nemo_gym.client.server_client import ServerClient, close_shared_session
from nemo_gym.collection.dispatch import bounded_map
from nemo_gym.config.command import command
from nemo_gym.config.keys import SERVER_TYPES
from nemo_gym.config.loading import load_global_config
from nemo_gym.config.options import check_options
from nemo_gym.config.ports import reserve_listening_socket
from nemo_gym.config.problems import ConfigError
from nemo_gym.errors import response_body
from nemo_gym.tools.bench.sampling import PeakRss, spawn_module_on_socket

DEFAULT_ENV = "example_single_tool_call"
DEFAULT_CONCURRENCIES = (64, 1024, 16384)


def _cpu_s(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for name, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
            out[name] = t.user + t.system
        except psutil.Error:
            out[name] = 0.0
    return out


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


async def _drive(
    client: ServerClient, target: str, path: str, rows: list[dict[str, Any]], n: int, concurrency: int
) -> dict[str, Any]:
    latencies: list[float] = []
    errors = 0

    async def one(row: dict[str, Any]) -> None:
        t = time.perf_counter()
        resp = await client.post(target, path, json=row, timeout_s=600)
        if resp.status != 200:
            raise RuntimeError(f"{target}{path} answered {resp.status}: {response_body(resp)[:300]!r}")
        latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    async for _row, _result, exc in bounded_map((rows[i % len(rows)] for i in range(n)), one, concurrency):
        if exc is not None:
            errors += 1
            if errors == 1:
                print(f"  first error: {exc}", file=sys.stderr)
    wall = time.perf_counter() - t0
    latencies.sort()
    return {
        "rollouts": n,
        "errors": errors,
        "wall_s": wall,
        "rollouts_per_s": (n - errors) / wall if wall else 0.0,
        "p50_latency_ms": _percentile(latencies, 0.5) * 1000,
        "p99_latency_ms": _percentile(latencies, 0.99) * 1000,
    }


def _measure(
    client: ServerClient,
    target: str,
    path: str,
    rows: list[dict[str, Any]],
    n: int,
    concurrency: int,
    pids: dict[str, int],
) -> dict[str, Any]:
    all_pids = {**pids, "collector": os.getpid()}
    before = _cpu_s(all_pids)
    with PeakRss(all_pids) as rss:
        result = asyncio.run(_run_and_close(client, target, path, rows, n, concurrency))
    after = _cpu_s(all_pids)
    done = max(1, n - result["errors"])
    server_cpu = sum(after[k] - before[k] for k in pids)
    result["concurrency"] = concurrency
    result["cpu_ms_per_rollout_servers"] = server_cpu * 1000 / done
    result["cpu_ms_per_rollout_collector"] = (after["collector"] - before["collector"]) * 1000 / done
    result["cpu_ms_per_rollout_by_server"] = {k: round((after[k] - before[k]) * 1000 / done, 3) for k in pids}
    result["peak_rss_mb"] = {k: round(v / 2**20, 1) for k, v in rss.peak.items()}
    return result


async def _run_and_close(
    client: ServerClient, target: str, path: str, rows: list[dict[str, Any]], n: int, concurrency: int
) -> dict[str, Any]:
    try:
        return await _drive(client, target, path, rows, n, concurrency)
    finally:
        await close_shared_session()


# ------------------------------------------------------------------------------------------------
# The bare stack.


def _spawn_bare(role: str, sock: socket.socket, env_extra: dict[str, str]) -> subprocess.Popen:
    env = {**env_extra, "NG_BARE_FD": str(sock.fileno()), "NG_BARE_ROLE": role}
    return spawn_module_on_socket(["nemo_gym.tools.bench.bare"], sock, env)


class BareStack:
    def __init__(self, inner_calls: list[str]):
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        socks = {
            name: reserve_listening_socket("127.0.0.1", None, f"bare {name}")
            for name in ("echo_a", "echo_b", "agent")
        }
        self.ports = {name: s.getsockname()[1] for name, s in socks.items()}
        plan = ",".join(inner_calls)
        common = {
            "NG_BARE_ECHO_A": str(self.ports["echo_a"]),
            "NG_BARE_ECHO_B": str(self.ports["echo_b"]),
            "NG_BARE_PLAN": plan,
        }
        for name, sock in socks.items():
            self.procs[name] = _spawn_bare(name, sock, common)
        self._wait_ready()

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + 30
        for name, port in self.ports.items():
            while True:
                if self.procs[name].poll() is not None:
                    raise RuntimeError(
                        f"bare {name} exited: {self.procs[name].stderr.read().decode()[-2000:]}"
                    )
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/", timeout=1, trust_env=False).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"bare {name} did not start")
                time.sleep(0.05)

    @property
    def pids(self) -> dict[str, int]:
        return {f"bare_{k}": p.pid for k, p in self.procs.items()}

    def client(self) -> ServerClient:
        return ServerClient(
            global_config_dict={
                "bare_agent": {
                    "responses_api_agents": {"bare": {"host": "127.0.0.1", "port": self.ports["agent"]}}
                }
            }
        )

    def close(self) -> None:
        for p in self.procs.values():
            try:
                os.killpg(p.pid, 15)
            except ProcessLookupError:
                pass
        for p in self.procs.values():
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)


# ------------------------------------------------------------------------------------------------


def _inner_calls(result: dict[str, Any]) -> list[str]:
    """The agent's inner calls for one rollout, derived from a real result: seed, model/tool turns, verify
    (simple_agent); aviary_agent's, gymnasium_agent's and scicode_agent's results are recognised by their
    own fields."""
    steps = result["response"].get("steps")
    if isinstance(steps, list):  # aviary_agent: /seed_session, per turn model (+ /step), /close, /verify
        calls = ["a"]
        for step in steps:
            calls += ["b", "a"] if step.get("stepped_env", True) else ["b"]
        return [*calls, "a", "a"]
    episode_steps = result.get("episode_steps")
    if isinstance(episode_steps, int):  # gymnasium_agent: /reset, per turn model + /step, /close
        return ["a", *(["b", "a"] * episode_steps), "a"]
    step_answers = result.get("step_answers")
    if isinstance(step_answers, list):  # scicode_agent: /seed_session, one model call per step, /verify
        return ["a", *(["b"] * len(step_answers)), "a"]
    calls = ["a"]  # /seed_session -> resources
    output = result["response"]["output"]
    calls.append("b")  # first model call
    i = 0
    while i < len(output):
        if output[i].get("type") == "function_call_output":
            while i < len(output) and output[i].get("type") == "function_call_output":
                calls.append("a")  # one tool call each
                i += 1
            calls.append("b")  # the model call after the tool results
            continue
        i += 1
    calls.append("a")  # /verify
    return calls


def format_table(results: list[dict[str, Any]]) -> str:
    header = f"{'stack':<10} {'conc':>6} {'n':>6} {'roll/s':>8} {'ratio':>6} {'p50 ms':>8} {'p99 ms':>9} {'srv CPU ms/r':>12} {'coll CPU ms/r':>13}  peak RSS MB"
    lines = [header, "-" * len(header)]
    for r in results:
        rss = " ".join(f"{k}={v:.0f}" for k, v in r["peak_rss_mb"].items())
        ratio = f"{r['ratio_to_bare']:.2f}" if "ratio_to_bare" in r else "-"
        lines.append(
            f"{r['stack']:<10} {r['concurrency']:>6} {r['rollouts']:>6} {r['rollouts_per_s']:>8.1f} {ratio:>6} "
            f"{r['p50_latency_ms']:>8.1f} {r['p99_latency_ms']:>9.1f} {r['cpu_ms_per_rollout_servers']:>12.2f} "
            f"{r['cpu_ms_per_rollout_collector']:>13.2f}  {rss}"
        )
    for r in results:
        for other, what in (("no_auth", "run-token check"), ("no_metrics", "metrics")):
            if f"ratio_to_{other}" in r:
                lines.append(
                    f"{what} at concurrency {r['concurrency']}: rollouts/s x{r[f'ratio_to_{other}']:.3f}, "
                    f"server CPU per rollout x{r[f'cpu_ratio_to_{other}']:.3f} (medians of {r['rounds']} rounds each)"
                )
                if f"paired_cpu_ratio_to_{other}" in r:
                    cpu_pairs = r[f"paired_cpu_ratios_to_{other}"]
                    lines.append(
                        f"  round by round (adjacent rounds paired): rollouts/s x{r[f'paired_ratio_to_{other}']:.3f}, "
                        f"server CPU per rollout x{r[f'paired_cpu_ratio_to_{other}']:.3f} "
                        f"(medians of {len(cpu_pairs)} pairs; CPU pairs {min(cpu_pairs):.3f}..{max(cpu_pairs):.3f})"
                    )
    return "\n".join(lines)


@command("ng_bench")
def main(argv: list[str] | None = None) -> None:
    from omegaconf import OmegaConf

    from nemo_gym.tools.testing import example_rows, running_servers

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: ng_bench [+env=example_single_tool_call] [+concurrencies=[64,1024,16384]] [+num_rollouts=4096]\n"
            "                [+output_json_fpath=bench_results.json] [+skip_bare=false]\n"
            "                [+compare_auth=false] [+compare_metrics=false] [+rounds=1 (3 with a compare)]\n"
            "                [+env_config_fpath=resources_servers/<env>/configs/<env>.yaml]\n"
            "                [+agent_name=<env>_simple_agent] [+config_paths=[more configs]]\n"
            "                [+rows_jsonl_fpath=resources_servers/<env>/data/example.jsonl]\n"
            "Each concurrency runs max(num_rollouts, concurrency) rollouts per round.\n"
            "ng_bench +suite=collector [+row_counts=[10000,100000,1000000]] [+num_samples_in_parallel=4096]\n"
            "                [+num_repeats=1] [+resume=false] [+output_json_fpath=collector_bench.json]\n"
            "The collector at scale against a minimal agent: its peak RSS and CPU per rollout per row count.\n"
            "ng_bench +suite=all [+parts=[framework,startup,environments,collector]] [+quick=false] [+envs=[...]]\n"
            "                [+output_json_fpath=bench_suite.json]\n"
            "Every benchmark, each figure beside its aim (docs/performance.md).\n"
            "ng_bench +suite=streaming [+requests=2000] [+concurrency=16] [+rounds=3] [+local=true]\n"
            "                [+local_requests=5] [+max_tokens=64] [+output_json_fpath=streaming_bench.json]\n"
            "stream: true against plain requests on the scripted model (requests/s, cost per request), and\n"
            "local_model's time to first token."
        )
        return
    raise_open_file_limit()
    try:
        loaded = load_global_config(argv, load_env_yaml=False)
        check_options(loaded, "ng_bench", strict_cli=True)
        cfg = OmegaConf.to_container(loaded.config, resolve=True)
    except ConfigError as e:
        sys.exit(str(e))
    suite = str(cfg.get("suite", "stack"))
    if suite == "collector":
        from nemo_gym.tools.bench.collector import run_suite

        run_suite(cfg)
        return
    if suite == "all":
        from nemo_gym.tools.bench.suite import run_suite as run_all

        run_all(cfg)
        return
    if suite == "streaming":
        from nemo_gym.tools.bench.streaming import run_suite as run_streaming

        run_streaming(cfg)
        return
    if suite != "stack":
        sys.exit(f"ng_bench: +suite must be stack (the default), collector, streaming or all, got {suite!r}")
    env = str(cfg.get("env", DEFAULT_ENV))
    concurrencies = [int(c) for c in cfg.get("concurrencies", DEFAULT_CONCURRENCIES)]
    base_n = int(cfg.get("num_rollouts", 4096))
    out_path = Path(str(cfg.get("output_json_fpath", "bench_results.json")))
    env_config = str(cfg.get("env_config_fpath") or f"resources_servers/{env}/configs/{env}.yaml")
    # Server blocks from +config_paths files (merged into the loaded config): laid over the env's.
    more_servers = {k: v for k, v in cfg.items() if isinstance(v, dict) and any(t in v for t in SERVER_TYPES)}
    agent = str(cfg.get("agent_name") or f"{env}_simple_agent")
    rows_path = cfg.get("rows_jsonl_fpath")
    rows = (
        [orjson.loads(line) for line in Path(str(rows_path)).read_bytes().splitlines() if line.strip()]
        if rows_path
        else example_rows(env)
    )
    results: list[dict[str, Any]] = []

    compare_auth = bool(cfg.get("compare_auth", False))
    compare_metrics = bool(cfg.get("compare_metrics", False))
    compare = compare_auth or compare_metrics
    # label -> the config the stack differs by; "ours" is the servers as they run by default.
    variants: list[tuple[str, dict[str, Any] | None]] = [("ours", None)]
    if compare_auth:
        variants.append(("no_auth", {"server_auth": False}))
    if compare_metrics:
        variants.append(("no_metrics", {"metrics_enabled": False}))
    rounds = int(cfg.get("rounds", 3 if compare else 1))
    if rounds < 1:
        sys.exit(f"ng_bench: +rounds must be at least 1, got {rounds}")

    print(f"ng_bench: {env} on the scripted model; concurrencies {concurrencies}", flush=True)
    with contextlib.ExitStack() as started:
        # label -> (client, server pids); "no_auth" is the same servers with the token check off.
        stacks: dict[str, tuple[ServerClient, dict[str, int]]] = {}
        helpers: dict[str, Any] = {}
        for label, extra in variants:
            helper = started.enter_context(running_servers([env_config], {**more_servers, **(extra or {})}))
            helpers[label] = helper
            client = ServerClient.load_from_global_config(helper.head_server_config)
            stacks[label] = (client, {r["name"]: r["pid"] for r in helper.server_instances()})
            if compare_auth:
                _check_token_check(helper, on=label != "no_auth")
            if compare_metrics:
                _check_metrics_route(helper, on=label != "no_metrics")
            plan = _inner_calls(asyncio.run(_one_result(client, agent, rows[0])))
        for c in concurrencies:
            n = max(base_n, c)
            measured: dict[str, list[dict[str, Any]]] = {label: [] for label in stacks}
            for i in range(rounds):
                for label in list(stacks)[:: 1 if i % 2 == 0 else -1]:
                    print(
                        f"  {label}: {n} rollouts at concurrency {c} (round {i + 1}/{rounds}) ...", flush=True
                    )
                    client, servers = stacks[label]
                    lag_before = _loop_lag(helpers[label]) if label == "ours" else None
                    r = _measure(client, agent, "/run", rows, n, c, servers)
                    if lag_before is not None:
                        r["event_loop_lag_by_server"] = _loop_lag_summary(
                            lag_before, _loop_lag(helpers[label])
                        )
                    measured[label].append(r)
            combined = {label: _median_of_rounds(rs) for label, rs in measured.items()}
            for label, r in combined.items():
                r["stack"] = label
                results.append(r)
            for other in list(combined)[1:]:
                ours, open_ = combined["ours"], combined[other]
                ours[f"ratio_to_{other}"] = ours["rollouts_per_s"] / open_["rollouts_per_s"]
                ours[f"cpu_ratio_to_{other}"] = (
                    ours["cpu_ms_per_rollout_servers"] / open_["cpu_ms_per_rollout_servers"]
                )
                _paired_ratios(ours, open_, other)
    hops = 1 + len(plan)
    bare_results: dict[int, dict[str, Any]] = {}
    if not cfg.get("skip_bare", False):
        bare = BareStack(plan)
        try:
            for c in concurrencies:
                n = max(base_n, c)
                print(f"  bare: {n} rollouts at concurrency {c} ...", flush=True)
                r = _measure(bare.client(), "bare_agent", "/run", rows, n, c, bare.pids)
                r["stack"] = "bare"
                bare_results[c] = r
        finally:
            bare.close()
        for r in results:
            if r["stack"] != "ours":
                continue
            b = bare_results[r["concurrency"]]
            r["ratio_to_bare"] = (
                r["rollouts_per_s"] / b["rollouts_per_s"] if b["rollouts_per_s"] else float("nan")
            )
        results += list(bare_results.values())
    report = {
        "env": env,
        "hops_per_rollout": hops,
        "inner_calls_per_rollout": len(plan),
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "results": results,
    }
    out_path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(f"\n{env}: {hops} HTTP hops per rollout (collector->agent + {len(plan)} inner calls)")
    print(format_table(results))
    print(f"\nJSON: {out_path}")


def _loop_lag(helper: Any) -> dict[str, dict[float, float]] | None:
    """Each server's event-loop lag histogram now; None when the run has metrics off."""
    from nemo_gym.tools.loop_check import LoopLagError, read_lag

    try:
        return read_lag(helper)
    except LoopLagError:
        return None


def _loop_lag_summary(
    before: dict[str, dict[float, float]] | None, after: dict[str, dict[float, float]] | None
) -> dict[str, dict[str, float | None]]:
    """Per server: ticks, ticks more than 100 ms late, and the p99 tick's bucket bound (ms) between two readings."""
    from nemo_gym.tools.loop_check import summarize

    if before is None or after is None:
        return {}
    out: dict[str, dict[str, float | None]] = {}
    for name in before:
        s = summarize(name, before[name], after[name], bound_s=0.1)
        p99 = None if s.p99_s == float("inf") else round(s.p99_s * 1000, 1)
        out[name] = {"ticks": s.ticks, "late_100ms": s.late_ticks, "p99_ms": p99}
    return out


def _check_token_check(helper: Any, on: bool) -> None:
    """Make sure a comparison compares what it says: a request without the token is refused (401) by
    every server of the stack with the check on, and served by every server of the one without."""
    import httpx

    for row in helper.server_instances():
        status = httpx.get(row["url"] + "/", timeout=30, trust_env=False).status_code
        if (status == 401) != on:
            raise RuntimeError(
                f"ng_bench: {row['name']} answered {status} to a request without the run token; expected "
                f"{'401' if on else '200'} in the stack with the token check {'on' if on else 'off'}"
            )


def _check_metrics_route(helper: Any, on: bool) -> None:
    """Make sure a metrics comparison compares what it says: ``GET /metrics`` answers 200 on every server
    of the stack with metrics on, and 404 on every server of the one without."""
    import httpx

    from nemo_gym.auth import auth_headers, client_token_for_url

    for row in helper.server_instances():
        url = row["url"]
        headers = auth_headers(client_token_for_url(url))
        status = httpx.get(url + "/metrics", headers=headers, timeout=30, trust_env=False).status_code
        if (status == 200) != on:
            raise RuntimeError(
                f"ng_bench: {row['name']} answered {status} to GET /metrics; expected "
                f"{'200' if on else '404'} in the stack with metrics {'on' if on else 'off'}"
            )


def _median_of_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several rounds of the same measurement: the median of every number (per
    server and per process too), the per-round rollouts/s kept beside it."""
    if len(rounds) == 1:
        return rounds[0]
    out: dict[str, Any] = dict(rounds[0])
    for key, value in rounds[0].items():
        if key == "event_loop_lag_by_server":
            out[key] = {
                server: {k: _median_or_none(r[key].get(server, {}).get(k) for r in rounds) for k in fields}
                for server, fields in value.items()
            }
        elif isinstance(value, dict):
            out[key] = {k: statistics.median(r[key][k] for r in rounds) for k in value}
        elif key == "concurrency":
            continue
        elif key in ("rollouts", "errors"):
            out[key] = sum(r[key] for r in rounds)  # counts add up; rates and times are medians
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in rounds)
    out["rounds"] = len(rounds)
    out["rollouts_per_s_by_round"] = [r["rollouts_per_s"] for r in rounds]
    out["cpu_ms_per_rollout_servers_by_round"] = [r["cpu_ms_per_rollout_servers"] for r in rounds]
    return out


def _paired_ratios(ours: dict[str, Any], other: dict[str, Any], label: str) -> None:
    """Round-by-round ratios of two stacks measured in alternating rounds: round i of one ran right
    before or after round i of the other, so a drift of the machine's speed cancels in each pair. Sets
    ``paired_ratio_to_<label>`` / ``paired_cpu_ratio_to_<label>`` (medians of the pairs) and their lists."""
    for key, name in (("rollouts_per_s", "paired_ratio"), ("cpu_ms_per_rollout_servers", "paired_cpu_ratio")):
        a, b = ours.get(f"{key}_by_round"), other.get(f"{key}_by_round")
        if not a or not b or len(a) != len(b):
            continue
        pairs = [x / y for x, y in zip(a, b, strict=True) if y]
        if pairs:
            ours[f"{name}_to_{label}"] = statistics.median(pairs)
            ours[f"{name}s_to_{label}"] = [round(r, 4) for r in pairs]


def _median_or_none(values: Any) -> float | None:
    """The median of the numbers among ``values`` (None: above the histogram's last bucket, or missing)."""
    numbers = [v for v in values if v is not None]
    return statistics.median(numbers) if numbers else None


async def _one_result(client: ServerClient, agent: str, row: dict[str, Any]) -> dict[str, Any]:
    try:
        resp = await client.post(agent, "/run", json=row, timeout_s=60)
        if resp.status != 200:
            raise RuntimeError(f"warm-up rollout failed: {resp.status} {response_body(resp)[:500]!r}")
        return orjson.loads(response_body(resp))
    finally:
        await close_shared_session()


if __name__ == "__main__":
    main()
