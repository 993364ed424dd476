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
* ``+mode=session`` measures sandbox sessions (:class:`nemo_gym.sandbox.SandboxSession`) instead: one
  session running each command ``+commands`` times one at a time, interleaved with the same bare
  command (the session's own cost, no queue); ``+sessions`` (64) concurrent sessions each running ``+commands`` (20) shell commands (a mix of a
  builtin, ``ls``, ``wc`` on a file and a ``python3 -c``), and the same commands as bare ``asyncio``
  subprocesses in a temp dir with the same concurrency and the same bound (the pool's slots), rounds
  alternating: p50/p99 latency per command and the ratio; a session's start time; its memory (the
  sandbox tree's proportional set size, and its memory cgroup's usage) idle and with its kernel started,
  as sessions per GiB; and for a prepared workspace of ``+fork_files`` (2,000) files and ``+fork_mib``
  (50) MiB: the one-time preparation, a snapshot after a change, each fork until it answers, and the
  disk a fork uses (its own overlay dir) before and after it changes a file.
* Nothing is asserted; the output is a table and ``+output_json_fpath`` (default sandbox_bench.json).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
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


SESSION_COMMANDS = ["echo hi", "ls -la", "wc -c data.txt", "python3 -I -c 'print(1)'"]
# The bare commands get the locale a session's commands get (LANG=C.UTF-8 costs ls/wc a few ms of locale
# loading: without it in both, the comparison would measure that, not the sandbox).
BARE_SESSION_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _tree_memory(pid: int) -> int:
    """Proportional set size of a process tree (shared pages split among their users), bytes."""
    total = 0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_full_info().pss
    return total


async def _session_latency(n: int, m: int, rounds: int = 2) -> dict[str, Any]:
    from nemo_gym.sandbox.session import SandboxSession

    data = "x" * 10_000
    limits = {"max_sessions": max(n, 1), "queue_timeout_s": 600, "memory_mib": 256}
    samples: dict[str, dict[str, list[float]]] = {
        kind: {cmd: [] for cmd in SESSION_COMMANDS} for kind in ("bare", "session")
    }
    starts: list[float] = []
    memory: dict[str, list[float]] = {
        "pss_idle": [],
        "pss_kernel": [],
        "cgroup_idle": [],
        "cgroup_kernel": [],
    }
    slots = asyncio.Semaphore(sandbox_pool_size())  # bare runs get the sessions' bound
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "data.txt").write_text(data)

        async def bare_loop() -> None:
            for i in range(m):
                cmd = SESSION_COMMANDS[i % len(SESSION_COMMANDS)]
                t0 = time.perf_counter()
                async with slots:
                    proc = await asyncio.create_subprocess_exec(
                        "/bin/sh",
                        "-c",
                        cmd,
                        cwd=tmp,
                        stdout=asyncio.subprocess.PIPE,
                        stderr=asyncio.subprocess.PIPE,
                        env=BARE_SESSION_ENV,
                    )
                    await proc.communicate()
                samples["bare"][cmd].append(time.perf_counter() - t0)

        async def session_loop(session: SandboxSession) -> None:
            for i in range(m):
                cmd = SESSION_COMMANDS[i % len(SESSION_COMMANDS)]
                t0 = time.perf_counter()
                result = await session.exec(cmd)
                if not result.ok:
                    raise RuntimeError(f"session command failed: {result}")
                samples["session"][cmd].append(time.perf_counter() - t0)

        for _ in range(rounds):
            await asyncio.gather(*(bare_loop() for _ in range(n)))

            async def start() -> SandboxSession:
                t0 = time.perf_counter()
                session = await SandboxSession.start(files={"data.txt": data}, limits=limits)
                starts.append(time.perf_counter() - t0)
                return session

            sessions = await asyncio.gather(*(start() for _ in range(n)))
            try:
                await asyncio.gather(*(session_loop(s) for s in sessions))
                for key in ("idle", "kernel"):
                    if key == "kernel":
                        await asyncio.gather(*(s.run_python("x = 1") for s in sessions))
                    for s in sessions:
                        assert s._sandbox is not None  # the sandbox tree's host pid, for its PSS
                        memory[f"pss_{key}"].append(_tree_memory(s._sandbox.proc.pid) / 2**20)
                        usage = await s.usage()
                        if usage.memory_bytes is not None:
                            memory[f"cgroup_{key}"].append(usage.memory_bytes / 2**20)
            finally:
                await asyncio.gather(*(s.close() for s in sessions))
    out: dict[str, Any] = {"sessions": n, "commands_each": m, "rounds": rounds, "per_command": {}}
    every = {kind: [v for vs in samples[kind].values() for v in vs] for kind in samples}
    for cmd in [*SESSION_COMMANDS, "all"]:
        b = every["bare"] if cmd == "all" else samples["bare"][cmd]
        s_ = every["session"] if cmd == "all" else samples["session"][cmd]
        out["per_command"][cmd] = {
            "bare_p50_ms": 1000 * _percentile(b, 0.5),
            "bare_p99_ms": 1000 * _percentile(b, 0.99),
            "session_p50_ms": 1000 * _percentile(s_, 0.5),
            "session_p99_ms": 1000 * _percentile(s_, 0.99),
            "ratio_p50": _percentile(s_, 0.5) / _percentile(b, 0.5),
            "ratio_p99": _percentile(s_, 0.99) / _percentile(b, 0.99),
        }
    out["start_ms_p50"] = 1000 * _percentile(starts, 0.5)
    out["start_ms_p99"] = 1000 * _percentile(starts, 0.99)
    out["memory_mib"] = {k: statistics.mean(v) for k, v in memory.items() if v}
    out["sessions_per_gib"] = {k: 1024 / v for k, v in out["memory_mib"].items() if v}
    return out


async def _session_sequential(m: int) -> dict[str, Any]:
    """One command at a time (one session, no queue): the session's own cost per command, bare and
    in the session interleaved command by command."""
    from nemo_gym.sandbox.session import SandboxSession

    data = "x" * 10_000
    samples: dict[str, dict[str, list[float]]] = {"bare": {}, "session": {}}
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "data.txt").write_text(data)
        session = await SandboxSession.start(files={"data.txt": data})
        try:
            for i in range(m * len(SESSION_COMMANDS)):
                cmd = SESSION_COMMANDS[i % len(SESSION_COMMANDS)]
                t0 = time.perf_counter()
                proc = await asyncio.create_subprocess_exec(
                    "/bin/sh",
                    "-c",
                    cmd,
                    cwd=tmp,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    env=BARE_SESSION_ENV,
                )
                await proc.communicate()
                samples["bare"].setdefault(cmd, []).append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                await session.exec(cmd)
                samples["session"].setdefault(cmd, []).append(time.perf_counter() - t0)
        finally:
            await session.close()
    return {
        cmd: {
            "bare_p50_ms": 1000 * _percentile(samples["bare"][cmd], 0.5),
            "session_p50_ms": 1000 * _percentile(samples["session"][cmd], 0.5),
            "ratio_p50": _percentile(samples["session"][cmd], 0.5) / _percentile(samples["bare"][cmd], 0.5),
        }
        for cmd in SESSION_COMMANDS
    }


async def _session_forks(files: int, mib: int, forks: int = 10) -> dict[str, Any]:
    from nemo_gym.sandbox.session import SandboxSession, prepare_workspace

    out: dict[str, Any] = {"files": files, "mib": mib}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "workspace")
        size = (mib << 20) // files
        for i in range(files):
            d = src / f"d{i // 100}"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"f{i}.bin").write_bytes(os.urandom(size))
        t0 = time.perf_counter()
        base_id = await prepare_workspace(src)
        out["prepare_once_ms"] = 1000 * (time.perf_counter() - t0)
        base = await SandboxSession.start(workspace=base_id)
        try:
            await base.exec("echo changed > d0/f0.bin")
            t0 = time.perf_counter()
            snap = await base.snapshot()
            out["snapshot_ms"] = 1000 * (time.perf_counter() - t0)
            times, first, disk_before, disk_after, cpu = [], [], [], [], []
            for _ in range(forks):
                t0, own0 = time.perf_counter(), _own_cpu()
                fork = await base.fork(snap)
                times.append(time.perf_counter() - t0)
                own = _own_cpu() - own0
                try:
                    usage = await fork.usage()
                    cpu.append(own + (usage.cpu_time_s or 0.0))
                    disk_before.append(usage.workspace_bytes / 2**10)
                    t0 = time.perf_counter()
                    await fork.exec("echo more >> d1/f100.bin")
                    first.append(time.perf_counter() - t0)
                    disk_after.append((await fork.usage()).workspace_bytes / 2**10)
                finally:
                    await fork.close()
            starts = []
            for _ in range(forks):
                t0 = time.perf_counter()
                s = await SandboxSession.start(workspace=base_id)
                starts.append(time.perf_counter() - t0)
                await s.close()
        finally:
            await base.close()
    out["fork_ms"] = {"p50": 1000 * _percentile(times, 0.5), "max": 1000 * max(times)}
    # CPU a fork costs (its sandbox's tree until it answered + this process): what load cannot inflate.
    out["fork_cpu_ms_p50"] = 1000 * _percentile(cpu, 0.5)
    out["start_from_prepared_ms"] = {"p50": 1000 * _percentile(starts, 0.5), "max": 1000 * max(starts)}
    out["first_command_after_fork_ms_p50"] = 1000 * _percentile(first, 0.5)
    out["fork_disk_kib"] = {"before_write": max(disk_before), "after_one_append": max(disk_after)}
    return out


def _session_main(opts: dict[str, str]) -> None:
    n, m = int(opts.get("sessions", 64)), int(opts.get("commands", 20))
    files, mib = int(opts.get("fork_files", 2000)), int(opts.get("fork_mib", 50))
    print(
        f"ng_bench_sandbox +mode=session: {os.cpu_count()} CPUs, sandbox pool {sandbox_pool_size()}",
        flush=True,
    )
    sequential = asyncio.run(_session_sequential(m))
    print(f"\none command at a time, {m} of each, interleaved (ms)")
    print(f"{'command':<28}{'bare p50':>9}{'session p50':>12}{'ratio':>7}")
    for cmd, r in sequential.items():
        print(f"{cmd:<28}{r['bare_p50_ms']:>9.1f}{r['session_p50_ms']:>12.1f}{r['ratio_p50']:>7.2f}")
    latency = asyncio.run(_session_latency(n, m))
    load = os.getloadavg()
    print(
        f"\n{n} sessions x {m} commands, {latency['rounds']} rounds alternating with bare runs (ms); "
        f"load average {load[0]:.2f} {load[1]:.2f}"
    )
    print(f"{'command':<28}{'bare p50':>9}{'p99':>8}{'session p50':>12}{'p99':>8}{'ratio p50':>10}{'p99':>7}")
    for cmd, r in latency["per_command"].items():
        print(
            f"{cmd:<28}{r['bare_p50_ms']:>9.1f}{r['bare_p99_ms']:>8.1f}{r['session_p50_ms']:>12.1f}"
            f"{r['session_p99_ms']:>8.1f}{r['ratio_p50']:>10.2f}{r['ratio_p99']:>7.2f}"
        )
    print(
        f"session start: p50 {latency['start_ms_p50']:.1f} ms, p99 {latency['start_ms_p99']:.1f} ms ({n} at once)"
    )
    for key, value in latency["memory_mib"].items():
        print(
            f"memory per session ({key}): {value:.1f} MiB = {latency['sessions_per_gib'][key]:.0f} sessions/GiB"
        )
    forks = asyncio.run(_session_forks(files, mib))
    print(
        f"\nfork of a {mib} MiB / {files}-file workspace: p50 {forks['fork_ms']['p50']:.1f} ms, max "
        f"{forks['fork_ms']['max']:.1f} ms (until it answers), CPU {forks['fork_cpu_ms_p50']:.1f} ms; first command "
        f"after it {forks['first_command_after_fork_ms_p50']:.1f} ms; start from the prepared workspace p50 "
        f"{forks['start_from_prepared_ms']['p50']:.1f} ms\n"
        f"prepared once in {forks['prepare_once_ms']:.0f} ms; snapshot after one change "
        f"{forks['snapshot_ms']:.0f} ms; a fork's own disk: {forks['fork_disk_kib']['before_write']:.0f} KiB, "
        f"{forks['fork_disk_kib']['after_one_append']:.0f} KiB after appending to one file"
    )
    path = Path(opts.get("output_json_fpath", "sandbox_bench.json"))
    path.write_bytes(
        orjson.dumps(
            {
                "mode": "session",
                "load_average": os.getloadavg(),
                "load_average_latency": load,
                "sequential": sequential,
                "latency": latency,
                "forks": forks,
            },
            option=orjson.OPT_INDENT_2,
        )
    )
    print(f"\nwritten: {path}")


@command("ng_bench_sandbox")
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: ng_bench_sandbox [+runs=40] [+throughput_runs=60] [+concurrency=8] [+verify_calls=40]\n"
            "                        [+prestart=true|false] [+output_json_fpath=sandbox_bench.json]\n"
            "       ng_bench_sandbox +mode=session [+sessions=64] [+commands=20] [+fork_files=2000] [+fork_mib=50]\n"
            "                        [+output_json_fpath=sandbox_bench.json]"
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
            "mode",
            "sessions",
            "commands",
            "fork_files",
            "fork_mib",
        ):
            sys.exit(f"ng_bench_sandbox: unknown option {a!r} (see --help)")
        opts[key] = value
    if opts.get("mode", "oneshot") not in ("oneshot", "session"):
        sys.exit(f"ng_bench_sandbox: +mode must be oneshot or session, got {opts['mode']!r}")
    if opts.get("mode") == "session":
        _session_main(opts)
        return
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
