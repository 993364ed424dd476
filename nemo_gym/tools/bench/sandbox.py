"""``ng_bench_sandbox`` (or ``python -m nemo_gym.tools.bench.sandbox``): what the sandbox costs, measured in one run.

Contract
--------
* Per-run overhead: the same programs (``print(1)``; and a typical accepted competitive-programming
  solution reading 200,000 numbers from stdin and sorting them) run ``+runs`` times each as a plain
  ``asyncio`` subprocess of the sandbox's Python (``python3 -I prog.py``, same stdin, a temp work dir) and
  through :func:`nemo_gym.sandbox.run_in_sandbox`, interleaved run by run so machine load hits both alike.
  Reported: mean and median milliseconds per run and the ratio sandboxed / bare; and CPU milliseconds per
  run, so that work moved off the critical path (a sandbox pre-started while the last run ran) still
  shows: bare = the reaped child's CPU + this process's; sandboxed = the run's cpuacct cgroup (its
  sandbox's set-up, whenever it happened, and its program) + this process's (which starts the next one).
* Throughput: ``+throughput_runs`` runs of the sorting program with ``+concurrency`` in flight, bare and
  sandboxed (in alternating batches): executions per second, their ratio, and how many cores the programs kept busy (CPU time over
  wall time: reaped children for bare runs, the runs' cpuacct cgroups for sandboxed ones, since bwrap's
  namespace init does not pass its children's times up).
* code_gen verify throughput: starts ``resources_servers/code_gen`` (scripted model, not used) and posts
  ``+verify_calls`` correct solutions of its example rows to ``/verify`` with ``+concurrency`` in flight:
  verifies/s, unit tests/s, cores kept busy by the server process and its tests' sandboxes, and how full
  its sandbox slots (one per CPU) were kept (the tests' run time over wall time x slots).
* ``+prestart=false`` runs the sandboxed programs without pre-started sandboxes (the code_gen part uses
  its server's config either way).
* Nothing is asserted; the output is a table and ``+output_json_fpath`` (default sandbox_bench.json).
"""

from __future__ import annotations

import asyncio
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import psutil

from nemo_gym.config.command import command
from nemo_gym.sandbox.api import run_in_sandbox
from nemo_gym.sandbox.slots import sandbox_pool_size
from nemo_gym.sandbox.spec import SandboxProviderConfig

SORT_PROGRAM = "import sys\ndata = sys.stdin.buffer.read().split()\nnums = sorted(map(int, data[1:]))\nprint(sum(nums[::1000]))\n"
SORT_STDIN = "200000\n" + " ".join(str((i * 7919) % 1000003) for i in range(200000)) + "\n"
PROGRAMS = {"print(1)": ("print(1)\n", ""), "sort 200k ints": (SORT_PROGRAM, SORT_STDIN)}

# Correct programs for resources_servers/code_gen/data/example.jsonl (same order).
CODE_GEN_SOLUTIONS = [
    "a, b = map(int, input().split())\nprint(a + b)",
    "n = int(input())\nprint(max(map(int, input().split())))",
    "print(input()[::-1])",
    "n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\nprint(a)",
    "class Solution:\n    def countVowels(self, s: str) -> int:\n        return sum(c in 'aeiouAEIOU' for c in s)",
]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _own_cpu() -> float:
    return time.process_time()


async def _bare(python: str, workdir: str, stdin: str) -> float:
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        python,
        "-I",
        "prog.py",
        cwd=workdir,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin"},
    )
    out, err = await proc.communicate(stdin.encode())
    if proc.returncode != 0:
        raise RuntimeError(f"bare run failed: {err.decode()[-500:]}")
    return time.perf_counter() - start


_PROVIDER: dict[str, Any] = {}  # the sandbox: block for the runs (+prestart=false)
_SANDBOX_CPU = [0.0]  # CPU seconds of sandboxed process trees (their cpuacct cgroups)


async def _sandboxed(code: str, stdin: str) -> float:
    start = time.perf_counter()
    result = await run_in_sandbox(
        ["python3", "-I", "prog.py"], files={"prog.py": code}, stdin=stdin, provider=_PROVIDER
    )
    if not result.ok:
        raise RuntimeError(f"sandboxed run failed: {result}")
    _SANDBOX_CPU[0] += result.cpu_time_s or 0.0
    return time.perf_counter() - start


async def _overhead(python: str, runs: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (code, stdin) in PROGRAMS.items():
            Path(tmp, "prog.py").write_text(code)
            await _bare(python, tmp, stdin)  # warm caches for both
            await _sandboxed(code, stdin)
            bare, boxed = [], []
            bare_cpu = boxed_cpu = 0.0
            for _ in range(runs):
                children0, own0 = _children_cpu(), _own_cpu()
                bare.append(await _bare(python, tmp, stdin))
                own1, cgroups1 = _own_cpu(), _SANDBOX_CPU[0]
                bare_cpu += (_children_cpu() - children0) + (own1 - own0)
                boxed.append(await _sandboxed(code, stdin))
                boxed_cpu += (_own_cpu() - own1) + (_SANDBOX_CPU[0] - cgroups1)
            out[name] = {
                "bare_cpu_ms_per_run": 1000 * bare_cpu / runs,
                "sandbox_cpu_ms_per_run": 1000 * boxed_cpu / runs,
                "cpu_ratio": boxed_cpu / bare_cpu if bare_cpu > 0 else None,
                "bare_ms_mean": 1000 * statistics.mean(bare),
                "bare_ms_median": 1000 * statistics.median(bare),
                "sandbox_ms_mean": 1000 * statistics.mean(boxed),
                "sandbox_ms_median": 1000 * statistics.median(boxed),
                "ratio_mean": statistics.mean(boxed) / statistics.mean(bare),
                "ratio_median": statistics.median(boxed) / statistics.median(bare),
            }
    return out


async def _throughput(python: str, n: int, concurrency: int, rounds: int = 3) -> dict[str, Any]:
    """Bare and sandboxed batches alternate (``rounds`` each) so drifting machine load hits both alike."""
    code, stdin = PROGRAMS["sort 200k ints"]
    totals = {kind: {"runs": 0, "wall": 0.0, "cpu": 0.0} for kind in ("bare", "sandbox")}
    per_round = max(1, n // rounds)
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "prog.py").write_text(code)
        for _ in range(rounds):
            for kind in ("bare", "sandbox"):
                sem = asyncio.Semaphore(concurrency)

                async def one(kind: str = kind, sem: asyncio.Semaphore = sem) -> None:
                    async with sem:
                        if kind == "bare":
                            await _bare(python, tmp, stdin)
                        else:
                            await _sandboxed(code, stdin)

                cpu0, t0 = _children_cpu() + _SANDBOX_CPU[0], time.perf_counter()
                await asyncio.gather(*(one() for _ in range(per_round)))
                totals[kind]["wall"] += time.perf_counter() - t0
                totals[kind]["cpu"] += _children_cpu() + _SANDBOX_CPU[0] - cpu0
                totals[kind]["runs"] += per_round
    out: dict[str, Any] = {
        kind: {"runs": t["runs"], "per_s": t["runs"] / t["wall"], "cores_busy": t["cpu"] / t["wall"]}
        for kind, t in totals.items()
    }
    out["ratio"] = out["sandbox"]["per_s"] / out["bare"]["per_s"]
    return out


def _code_gen_verify(calls: int, concurrency: int) -> dict[str, Any]:
    import httpx

    from nemo_gym.auth import auth_headers, client_token_for_url
    from nemo_gym.tools.testing import example_rows, running_servers, server_url

    rows = example_rows("code_gen")
    bodies = []
    for row, code in zip(rows, CODE_GEN_SOLUTIONS, strict=True):
        text = f"```python\n{code}\n```"
        message = {"type": "message", "role": "assistant", "id": "m", "status": "completed"}
        message["content"] = [{"type": "output_text", "text": text, "annotations": []}]
        bodies.append({**row, "response": {"output": [message]}})
    with running_servers(["resources_servers/code_gen/configs/code_gen.yaml"]) as helper:
        url = server_url(helper, "code_gen") + "/verify"
        pid = next(r["pid"] for r in helper.server_instances() if r["name"] == "code_gen")
        server = psutil.Process(pid)
        headers = {"content-type": "application/json", **auth_headers(client_token_for_url(url))}

        async def drive() -> tuple[float, int, float]:
            sem = asyncio.Semaphore(concurrency)
            tests, test_cpu, test_wall = 0, 0.0, 0.0
            async with httpx.AsyncClient(timeout=120, trust_env=False) as client:

                async def one(i: int) -> None:
                    nonlocal tests, test_cpu, test_wall
                    body = bodies[i % len(bodies)]
                    async with sem:
                        resp = await client.post(url, content=orjson.dumps(body), headers=headers)
                    data = resp.json()
                    if resp.status_code != 200 or data["reward"] != 1.0:
                        raise RuntimeError(f"verify failed: {resp.status_code} {resp.text[:500]}")
                    tests += len(data["result"])
                    test_cpu += sum(t["cpu_time_s"] or 0.0 for t in data["metadata"]["tests"])
                    test_wall += sum(t["wall_time_s"] for t in data["metadata"]["tests"])

                t0 = time.perf_counter()
                await asyncio.gather(*(one(i) for i in range(calls)))
                return time.perf_counter() - t0, tests, test_cpu, test_wall

        asyncio.run(drive())  # warm-up
        before = server.cpu_times()
        wall, tests, test_cpu, test_wall = asyncio.run(drive())
        after = server.cpu_times()
    cpu = (after.user + after.system - before.user - before.system) + test_cpu  # the server + its sandboxes
    return {
        "verify_calls": calls,
        "verifies_per_s": calls / wall,
        "tests_per_s": tests / wall,
        "cores_busy": cpu / wall,
        # Fraction of the server's sandbox slots (one per CPU) holding a running test: 1.0 = always full.
        "sandbox_slots_busy": test_wall / (wall * sandbox_pool_size()),
    }


@command("ng_bench_sandbox")
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: ng_bench_sandbox [+runs=40] [+throughput_runs=60] [+concurrency=8] [+verify_calls=40]\n"
            "                        [+prestart=true|false] [+output_json_fpath=sandbox_bench.json]"
        )
        return
    opts: dict[str, str] = {}
    for a in argv:
        key, sep, value = a.lstrip("+").partition("=")
        if not sep or key not in (
            "runs",
            "throughput_runs",
            "concurrency",
            "verify_calls",
            "prestart",
            "output_json_fpath",
        ):
            sys.exit(f"ng_bench_sandbox: unknown option {a!r} (see --help)")
        opts[key] = value
    runs, n = int(opts.get("runs", 40)), int(opts.get("throughput_runs", 60))
    concurrency, calls = int(opts.get("concurrency", 8)), int(opts.get("verify_calls", 40))
    if opts.get("prestart", "true").lower() not in ("true", "false"):
        sys.exit(f"ng_bench_sandbox: +prestart must be true or false, got {opts['prestart']!r}")
    _PROVIDER["prestart"] = opts.get("prestart", "true").lower() == "true"
    python = SandboxProviderConfig().python
    print(
        f"ng_bench_sandbox: {os.cpu_count()} CPUs, sandbox pool {sandbox_pool_size()}, python {python}, "
        f"prestart {_PROVIDER['prestart']}",
        flush=True,
    )

    overhead = asyncio.run(_overhead(python, runs))
    load = os.getloadavg()
    print(f"\nper-run latency, {runs} runs each, interleaved (ms); load average {load[0]:.2f} {load[1]:.2f}")
    print(
        f"{'program':<16}{'bare mean':>10}{'bwrap mean':>12}{'ratio':>7}{'bare p50':>10}{'bwrap p50':>11}{'ratio':>7}"
        f"{'bare cpu':>10}{'bwrap cpu':>11}{'ratio':>7}"
    )
    for name, r in overhead.items():
        cpu_ratio = f"{r['cpu_ratio']:>7.2f}" if r["cpu_ratio"] is not None else f"{'-':>7}"
        print(
            f"{name:<16}{r['bare_ms_mean']:>10.1f}{r['sandbox_ms_mean']:>12.1f}{r['ratio_mean']:>7.2f}"
            f"{r['bare_ms_median']:>10.1f}{r['sandbox_ms_median']:>11.1f}{r['ratio_median']:>7.2f}"
            f"{r['bare_cpu_ms_per_run']:>10.1f}{r['sandbox_cpu_ms_per_run']:>11.1f}{cpu_ratio}"
        )
    print("(cpu: CPU ms per run, the program's tree and this process; the sandbox's includes its set-up)")
    throughput = asyncio.run(_throughput(python, n, concurrency))
    print(f"\nthroughput, sort program, {n} runs, {concurrency} in flight")
    for kind in ("bare", "sandbox"):
        t = throughput[kind]
        print(f"  {kind:<8} {t['per_s']:7.1f} executions/s, {t['cores_busy']:.2f} cores busy")
    print(f"  sandboxed / bare throughput: {throughput['ratio']:.2f}")
    verify = _code_gen_verify(calls, concurrency)
    print(
        f"\ncode_gen /verify, {calls} calls, {concurrency} in flight: {verify['verifies_per_s']:.1f} verifies/s, "
        f"{verify['tests_per_s']:.1f} unit tests/s, {verify['cores_busy']:.2f} cores busy (server + sandboxes), "
        f"sandbox slots busy {100 * verify['sandbox_slots_busy']:.0f}%"
    )
    path = Path(opts.get("output_json_fpath", "sandbox_bench.json"))
    path.write_bytes(
        orjson.dumps(
            {
                "prestart": _PROVIDER["prestart"],
                "load_average": os.getloadavg(),
                "overhead": overhead,
                "throughput": throughput,
                "code_gen_verify": verify,
            },
            option=orjson.OPT_INDENT_2,
        )
    )
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
