"""Measure heavy verification on a 2-node Ray cluster started here: 1 node vs 2 nodes, local pool vs Ray.

``python -m nemo_gym.ray.bench [--calls N] [--work-ms MS]`` starts a private 2-node cluster on this
machine (``ray.cluster_utils.Cluster``: one CPU and one custom resource per node, capped object
store, private ``RAY_TMPDIR``), runs ``N`` CPU-bound verification calls (a pure-Python loop of about
``MS`` ms each) through

* ``ray_1_node``: :func:`nemo_gym.ray.tasks.run_as_ray_task` pinned to one node (``node_a``),
* ``ray_2_nodes``: the same, spread over both nodes,
* ``local_pool_1`` / ``local_pool_2``: :class:`nemo_gym.verify_pool.VerifyPool` with 1 / 2 workers,

all in one run, prints calls/s per mode and the ratios, and stops the cluster (never ``ray stop``).
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
    from nemo_gym.ray.tasks import run_as_ray_task
    from nemo_gym.verify_pool import VerifyPool

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--work-ms", type=float, default=100.0)
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
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    rates["ray_2_over_1_node"] = rates["ray_2_nodes"] / rates["ray_1_node"]
    rates["local_2_over_1_worker"] = rates["local_pool_2"] / rates["local_pool_1"]
    rates["ray_2_nodes_over_local_2"] = rates["ray_2_nodes"] / rates["local_pool_2"]
    print(json.dumps({k: round(v, 3) for k, v in rates.items()}, indent=1))


if __name__ == "__main__":
    main()
