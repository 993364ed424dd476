"""``ng_bench`` for gsm8k_aviary: rollouts/s on the scripted model, as a ratio of the bare HTTP limit.

``ng_bench`` assumes an environment named like its folder with a ``simple_agent``; this variant runs
the same measurement (``nemo_gym.tools.bench.stack``'s driver and bare stack) on ``configs/gsm8k_aviary.yaml``
with ``gsm8k_aviary_agent``. The bare stack makes the same inner calls per rollout as aviary_agent
does: ``/seed_session``, per model turn ``/v1/responses`` + ``/step``, then ``/close`` and ``/verify``.
The scripted model answers every turn with a correct ``submit_answer``, so each rollout is one turn.

    python -m resources_servers.aviary.bench_gsm8k [+concurrencies=[64,256]] [+num_rollouts=2000]
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from nemo_gym.client.fd_limits import raise_open_file_limit
from nemo_gym.client.server_client import ServerClient
from nemo_gym.tools.bench.stack import BareStack, _measure, _one_result, format_table
from nemo_gym.tools.testing import running_servers

CONFIG = "resources_servers/aviary/configs/gsm8k_aviary.yaml"
AGENT = "gsm8k_aviary_agent"
DATA = Path(__file__).resolve().parent / "data"


def _options(argv: list[str]) -> dict[str, Any]:
    opts: dict[str, Any] = {"concurrencies": [64, 256], "num_rollouts": 2000}
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        if key not in opts:
            raise SystemExit(f"unknown option {arg!r}; known: {sorted(opts)}")
        opts[key] = json.loads(value)
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = _options(sys.argv[1:] if argv is None else argv)
    raise_open_file_limit()
    problems = [json.loads(line) for line in (DATA / "gsm8k_problems.jsonl").read_text().splitlines()]
    scripts = [
        {
            "contains": p["question"],
            "turns": [
                {
                    "tool_calls": [
                        {
                            "name": "submit_answer",
                            "arguments": {"answer": p["answer"].rsplit("####", 1)[1].strip()},
                        }
                    ]
                }
            ],
        }
        for p in problems
    ]
    rows = [{"task_idx": i, "responses_create_params": {"input": []}} for i in range(len(problems))]
    extra = {
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": scripts}}},
        "gsm8k_aviary_resources_server": {"resources_servers": {"aviary": {"max_live_envs": 1024}}},
    }
    results: list[dict[str, Any]] = []
    with running_servers([CONFIG], extra) as helper:
        servers = {r["name"]: r["pid"] for r in helper.server_instances()}
        client = ServerClient.load_from_global_config(helper.head_server_config)
        warm = asyncio.run(_one_result(client, AGENT, rows[0]))
        turns = len(warm["response"]["steps"])
        assert warm["reward"] == 1.0, warm["reward"]
        for c in opts["concurrencies"]:
            n = max(int(opts["num_rollouts"]), c)
            print(f"  ours: {n} rollouts at concurrency {c} ...", flush=True)
            r = _measure(client, AGENT, "/run", rows, n, c, servers)
            r["stack"] = "ours"
            results.append(r)
    plan = ["a"] + ["b", "a"] * turns + ["a", "a"]  # seed, (model, step) per turn, close, verify
    bare = BareStack(plan)
    bare_results: dict[int, dict[str, Any]] = {}
    try:
        for c in opts["concurrencies"]:
            n = max(int(opts["num_rollouts"]), c)
            print(f"  bare: {n} rollouts at concurrency {c} ...", flush=True)
            r = _measure(bare.client(), "bare_agent", "/run", rows, n, c, bare.pids)
            r["stack"] = "bare"
            bare_results[c] = r
    finally:
        bare.close()
    for r in results:
        b = bare_results[r["concurrency"]]
        r["ratio_to_bare"] = (
            r["rollouts_per_s"] / b["rollouts_per_s"] if b["rollouts_per_s"] else float("nan")
        )
    results += list(bare_results.values())
    print(
        f"\ngsm8k_aviary: {1 + len(plan)} HTTP hops per rollout (collector->agent + {len(plan)} inner calls)"
    )
    print(format_table(results))


if __name__ == "__main__":
    main()
