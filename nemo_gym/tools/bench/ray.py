"""Measure heavy verification on a 2-node Ray cluster started here: 1 node vs 2 nodes, local pool vs Ray.

``python -m nemo_gym.tools.bench.ray [--calls N] [--work-ms MS]`` starts a private 2-node cluster on this
machine (``ray.cluster_utils.Cluster``: one CPU and one custom resource per node, capped object
store, private ``RAY_TMPDIR``), runs ``N`` CPU-bound verification calls (a pure-Python loop of about
``MS`` ms each) through

* ``ray_1_node``: :func:`nemo_gym.kit.verify_pool.ray_tasks.run_as_ray_task` pinned to one node (``node_a``),
* ``ray_2_nodes``: the same, spread over both nodes,
* ``local_pool_1`` / ``local_pool_2``: :class:`nemo_gym.kit.verify_pool.VerifyPool` with 1 / 2 workers,

all in one run; then rollouts/s of a CPU-bound environment (:mod:`nemo_gym.tools.bench.ray_server`:
example_single_tool_call whose verify burns ``--verify-ms`` of CPU in the resources server) with its
resources server as 1 replica (on ``node_a``) vs 2 replicas (``node_a`` + ``node_b``), each placed
by its actor (``--rollouts`` rollouts each, scripted model). It prints the rates, the ratios, the
machine's load average and the CPU milliseconds per rollout of every process in the replica runs
(replicas, agent, model, this process as the collector), and stops the cluster (never ``ray stop``).
Numbers from a shared 2-core machine are noisy: compare ratios of one run, not absolute rates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from typing import Any


def burn(work_ms: float) -> int:
    """CPU-bound stand-in for a verification: a pure-Python loop of about ``work_ms`` of CPU time."""
    end = time.process_time() + work_ms / 1000.0
    n = 0
    while time.process_time() < end:
        n += sum(i * i for i in range(200))
    return n


async def _rate(calls: int, run_one: Any) -> float:
    await asyncio.gather(*(run_one() for _ in range(2)))  # warm-up: workers started, function shipped
    t0 = time.perf_counter()
    await asyncio.gather(*(run_one() for _ in range(calls)))
    return calls / (time.perf_counter() - t0)


async def _measure(address: str, calls: int, work_ms: float) -> dict[str, float]:
    from nemo_gym.kit.verify_pool.local import VerifyPool
    from nemo_gym.kit.verify_pool.ray_tasks import run_as_ray_task

    out: dict[str, float] = {}
    for workers in (1, 2):
        pool = VerifyPool(max_workers=workers)
        try:
            out[f"local_pool_{workers}"] = await _rate(
                calls, lambda p=pool: p.run(burn, work_ms, timeout=120)
            )
        finally:
            pool.close()
    out["ray_1_node"] = await _rate(
        calls, lambda: run_as_ray_task(address, burn, (work_ms,), {}, 120, resources={"node_a": 0.001})
    )
    out["ray_2_nodes"] = await _rate(calls, lambda: run_as_ray_task(address, burn, (work_ms,), {}, 120))
    return out


def _cpu_s(pid: int) -> float:
    import psutil

    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return times.user + times.system + times.children_user + times.children_system


def _replica_rate(
    address: str, replicas: int, rollouts: int, verify_ms: float
) -> tuple[float, dict[str, float]]:
    """Rollouts/s of the CPU-bound environment with its resources server as ``replicas`` replicas, and
    the CPU milliseconds per rollout each process spent (this process is the collector): where the
    machine's CPU went, and whether the replicas shared the work evenly."""
    from pathlib import Path

    from nemo_gym.tools.testing import collect_rollouts, example_rows, running_servers
    from resources_servers.example_single_tool_call.app import weather_report

    env = "example_single_tool_call"
    rows = example_rows(env)
    scripts = [
        {
            "contains": r["expected_city"],
            "turns": [
                {"tool_calls": [{"name": "get_weather", "arguments": {"city": r["expected_city"]}}]},
                {"text": weather_report(r["expected_city"])},
            ],
        }
        for r in rows
    ]
    block = {
        "entrypoint": "../../nemo_gym/ray/bench_server.py",
        "verify_work_ms": verify_ms,
        "num_replicas": replicas,
        "ray_resources": [{"CPU": 1, "node_a": 1}, {"CPU": 1, "node_b": 1}][:replicas],
    }
    extra = {
        "ray_head_node_address": address,
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": scripts}}},
        env: {"resources_servers": {env: block}},
    }
    config = f"resources_servers/{env}/configs/{env}.yaml"
    with running_servers([config], extra) as helper:
        procs = {
            (f"{r['name']}[{r['replica']}]" if "replica" in r else r["name"]): r["pid"]
            for r in helper.server_instances()
        }
        procs["collector"] = os.getpid()
        before = {name: _cpu_s(pid) for name, pid in procs.items()}
        work = Path(tempfile.mkdtemp(prefix=f"nemo_gym_replica_bench_{replicas}_"))
        t0 = time.perf_counter()
        code, out, err = collect_rollouts(
            helper,
            rows,
            work,
            f"{env}_simple_agent",
            f"+num_repeats={rollouts // len(rows)}",
            "+num_samples_in_parallel=32",
        )
        elapsed = time.perf_counter() - t0
        cpu_ms = {
            name: round(1000 * (_cpu_s(pid) - before[name]) / max(1, len(out)), 2)
            for name, pid in procs.items()
        }
    if code != 0 or not all(r.get("reward") == 1.0 for r in out):
        raise SystemExit(f"replica benchmark with {replicas} replica(s) failed (exit {code}):\n{err[-2000:]}")
    return len(out) / elapsed, cpu_ms


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--work-ms", type=float, default=100.0)
    parser.add_argument("--rollouts", type=int, default=300)
    parser.add_argument("--verify-ms", type=float, default=20.0)
    args = parser.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="nemo_gym_ray_bench_")
    os.environ.update(RAY_TMPDIR=tmp, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    import ray
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "object_store_memory": 100 * 2**20, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "resources": {"node_a": 1}})
    try:
        cluster.add_node(**{**node, "resources": {"node_b": 1}})
        cluster.wait_for_nodes(timeout=60)
        ray.init(address=cluster.address, log_to_driver=False)
        rates = asyncio.run(_measure(cluster.address, args.calls, args.work_ms))
        ray.shutdown()
        cpu: dict[str, dict[str, float]] = {}
        for n in (1, 2):
            rates[f"replicas_{n}_rollouts_per_s"], cpu[f"replicas_{n}"] = _replica_rate(
                cluster.address, n, args.rollouts, args.verify_ms
            )
        rates["replicas_2_over_1"] = rates["replicas_2_rollouts_per_s"] / rates["replicas_1_rollouts_per_s"]
        rates["load_average_1m"] = os.getloadavg()[0]
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    rates["ray_2_over_1_node"] = rates["ray_2_nodes"] / rates["ray_1_node"]
    rates["local_2_over_1_worker"] = rates["local_pool_2"] / rates["local_pool_1"]
    rates["ray_2_nodes_over_local_2"] = rates["ray_2_nodes"] / rates["local_pool_2"]
    print(json.dumps({k: round(v, 3) for k, v in rates.items()}, indent=1))
    print("CPU ms per rollout, per process:", json.dumps(cpu, indent=1))


if __name__ == "__main__":
    main()
