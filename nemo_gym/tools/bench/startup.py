"""``python -m nemo_gym.tools.bench.startup``: how long ``ng_run`` takes to "servers ready", where that
time goes, and how much memory its processes hold once ready.

Contract
--------
* :func:`measure_startup` launches ``ng_run`` on a config (default: the README's example, three servers
  on the scripted model) ``runs`` times, each a fresh process tree on free ports
  (``+head_server.port=0``), and returns a JSON-ready dict:

  - ``time_to_ready_s``: from launching the ``ng_run`` process to its "All N / N servers ready!" line
    (median, min, max, every run); ``launcher_reported_s`` is the time that line itself prints.
  - ``processes``: per process (``launcher``, ``zygote`` (the fork server, :mod:`nemo_gym.run.zygote`)
    and each server instance, named as in ng_run's table), its USS and RSS (MiB) and the CPU seconds
    (user + system) it used, sampled at the ready line; medians over the runs. ``total`` sums them per
    run (medians of the sums). Processes the servers started themselves (worker pools) are counted
    under ``others``. Pages a forked server still shares with the zygote count in no one's USS.
  - ``phases``: per process, the median seconds between consecutive start-up marks
    (:func:`nemo_gym.server.startup.startup_mark`, written to ``NEMO_GYM_STARTUP_TRACE``), in the order
    of :data:`LAUNCHER_PHASES`, :data:`SERVER_PHASES` and :data:`ZYGOTE_PHASES`. A tree without marks
    gives no phases.
  - ``imports`` (``imports=True``): per module (``ng_run``'s ``nemo_gym.run.cli`` and each server's
    ``app``), what importing it alone costs (``python -X importtime``, one process after the other, so
    they do not compete): milliseconds in total and per top-level package, the slowest first.
  - ``machine``: CPU count and load average when the measurement started (the numbers depend on both).

* ``compare_roots``: other source trees of the project (e.g. an older commit unpacked with
  ``git archive``) are launched in alternating order with ``root``, run by run, so a change of load on
  the machine hits every tree alike; each one's result is under ``compare`` (keyed by its path).
* Every launch runs from its tree (working directory and ``PYTHONPATH``), so that tree's code is what
  runs. It is stopped with SIGINT once measured (SIGKILL after a bound; its servers die with it).
* Nothing is asserted: the command prints a table and writes ``+output_json_fpath``.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import psutil

from nemo_gym.config.keys import NEMO_GYM_STARTUP_TRACE_ENV_VAR_NAME, PACKAGE_PARENT_DIR

DEFAULT_CONFIG_PATHS = (
    "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml",
    "responses_api_models/scripted_model/configs/scripted_model.yaml",
)
# (phase, the mark that ends it); a phase starts at the mark written before it (the launch, for the first).
LAUNCHER_PHASES = (
    ("python_and_imports", "main"),  # interpreter start and ng_run's module imports
    ("config", "config"),  # load, merge and validate the config
    ("ports", "ports"),  # server folders, shared requirements, every port reserved
    ("head_server", "head"),  # run token published, head server built and serving
    ("spawn", "spawned"),  # every server process started
    ("config_verdicts", "verdicts"),  # every server checked its config block
    ("servers_ready", "ready_all"),  # every server built its app, serves, and answered GET /
)
SERVER_PHASES = (
    # From its spawn: exec, interpreter start, app module imports; for a server forked from the fork
    # server (nemo_gym.run.zygote, its trace's "forked" mark), the fork and its own modules' imports.
    ("python_and_imports", "imports"),
    ("config", "config"),  # read and validate its config block
    ("wait_go", "go"),  # until every server's config is valid
    ("build_app", "app"),  # the FastAPI app
    ("start_serving", "serving"),  # uvicorn up, start-up hooks run
    ("seen_ready", "ready"),  # until the launcher's health poll sees it
)
# The fork server's own marks, from the launcher's "main" mark (it is started right after it).
ZYGOTE_PHASES = (
    ("python_start", "zygote_started"),  # exec and interpreter start
    ("preload", "zygote_preloaded"),  # the shared modules imported (nemo_gym.run.zygote.PRELOAD_MODULES)
)
READY_RE = re.compile(r"All (\d+) / (\d+) servers ready!(?: \(([\d.]+) s\))?")
STOP_TIMEOUT_S = 20.0
MIB = 1 << 20


def _median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


class _Launch:
    """One ``ng_run`` process: its output read on a thread, the ready line and the server table noted."""

    def __init__(self, root: Path, args: list[str], trace: Path) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
        env[NEMO_GYM_STARTUP_TRACE_ENV_VAR_NAME] = str(trace)
        env["PYTHONUNBUFFERED"] = "1"
        cmd = [sys.executable, "-c", "from nemo_gym.run.cli import run_main; run_main()", *args]
        self.lines: list[str] = []
        self.ready_at: float | None = None
        self.reported_s: float | None = None
        self.pids: dict[str, int] = {}  # server name -> pid, from the table printed after the ready line
        self.kinds: dict[str, str] = {}  # server name -> "<server type>/<impl>", from the same table
        self.table_done = threading.Event()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            cwd=root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        expected = 0
        in_table = False
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            if self.ready_at is None:
                match = READY_RE.search(line)
                if match:
                    self.ready_at = time.monotonic()
                    expected = int(match.group(2))
                    self.reported_s = float(match.group(3)) if match.group(3) else None
                continue
            if not self.table_done.is_set():
                if line.startswith("-----"):
                    in_table = True
                elif in_table:
                    cols = line.split()
                    if len(cols) >= 4 and cols[-1].isdigit():
                        self.pids[cols[0]] = int(cols[-1])
                        self.kinds[cols[0]] = cols[1]
                    if len(self.pids) >= expected:
                        self.table_done.set()
        self.table_done.set()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # its servers die with it (parent-death signal)
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        self._reader.join(timeout=5)


def _sample(launcher_pid: int, pids: dict[str, int]) -> dict[str, dict[str, float]]:
    """USS, RSS (MiB) and CPU seconds of the launcher, each named server and their other descendants."""
    out: dict[str, dict[str, float]] = {}
    named = {pid: name for name, pid in pids.items()}
    named[launcher_pid] = "launcher"
    try:
        procs = [psutil.Process(launcher_pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return out
    for proc in procs:
        name = named.get(proc.pid) or ("zygote" if _is_zygote(proc) else "others")
        try:
            mem = proc.memory_full_info()
            cpu = proc.cpu_times()
        except psutil.Error:
            continue
        row = out.setdefault(name, {"uss_mib": 0.0, "rss_mib": 0.0, "cpu_s": 0.0})
        row["uss_mib"] += mem.uss / MIB
        row["rss_mib"] += mem.rss / MIB
        row["cpu_s"] += cpu.user + cpu.system
    out["total"] = {key: sum(row[key] for row in out.values()) for key in ("uss_mib", "rss_mib", "cpu_s")}
    return out


def _is_zygote(proc: psutil.Process) -> bool:
    """Whether ``proc`` is ng_run's fork server (:mod:`nemo_gym.run.zygote`)."""
    try:
        return any("nemo_gym.run.zygote" in part for part in proc.cmdline())
    except psutil.Error:
        return False


def _read_marks(trace: Path) -> list[dict[str, Any]]:
    if not trace.exists():
        return []
    marks = []
    for line in trace.read_bytes().splitlines():
        try:
            marks.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue
    return marks


def _phases(marks: list[dict[str, Any]], launched_at: float) -> dict[str, dict[str, float]]:
    """Seconds per phase, per process, from one launch's marks (see the module docstring)."""
    launcher: dict[str, float] = {}
    servers: dict[str, dict[str, float]] = defaultdict(dict)
    spawns: list[float] = []
    for mark in marks:
        event, server, t = mark.get("event"), mark.get("server"), float(mark.get("t", 0.0))
        if server == "launcher":
            launcher.setdefault(event, t)
        elif event in ("spawn", "ready"):  # the launcher's marks about one server
            servers[server].setdefault(event, t)
            if event == "spawn":
                spawns.append(t)
        else:
            servers[server].setdefault(event, t)
    if spawns:
        launcher["spawned"] = max(spawns)
    out: dict[str, dict[str, float]] = {}
    if launcher:
        out["launcher"] = _intervals(launcher, LAUNCHER_PHASES, launched_at)
    zygote = servers.pop("zygote", None)
    if zygote:
        out["zygote"] = _intervals(zygote, ZYGOTE_PHASES, launcher.get("main", launched_at))
    for name, events in servers.items():
        if "spawn" in events:
            out[name] = _intervals(events, SERVER_PHASES, events["spawn"])
    return out


def _intervals(events: dict[str, float], phases: Sequence[tuple[str, str]], start: float) -> dict[str, float]:
    """Seconds of each phase whose closing mark was written, in the order the marks were written (a
    phase starts at the mark before it, or at ``start``)."""
    out: dict[str, float] = {}
    previous = start
    for phase, mark in sorted((p for p in phases if p[1] in events), key=lambda p: events[p[1]]):
        out[phase] = events[mark] - previous
        previous = events[mark]
    return out


def launch_once(
    root: Path, config_paths: Sequence[str], overrides: Sequence[str], timeout_s: float
) -> dict[str, Any]:
    """One launch of ``ng_run`` from ``root``: time to ready, per-process memory and CPU, phases."""
    with tempfile.TemporaryDirectory(prefix="ng_startup_bench_") as tmp:
        trace = Path(tmp) / "trace.jsonl"
        args = [f"+config_paths=[{','.join(config_paths)}]", "+head_server.port=0", *overrides]
        launch = _Launch(root, args, trace)
        try:
            deadline = launch.started_at + timeout_s
            while launch.ready_at is None and launch.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
            if launch.ready_at is None:
                tail = "\n".join(launch.lines[-30:])
                raise RuntimeError(f"ng_run did not get ready within {timeout_s:g} s in {root}:\n{tail}")
            launch.table_done.wait(timeout=10)
            processes = _sample(launch.proc.pid, launch.pids)
        finally:
            launch.stop()
        return {
            "time_to_ready_s": launch.ready_at - launch.started_at,
            "launcher_reported_s": launch.reported_s,
            "processes": processes,
            "phases": _phases(_read_marks(trace), launch.started_at),
            "servers": dict(launch.kinds),
        }


def _summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ready = [s["time_to_ready_s"] for s in samples]
    reported = [s["launcher_reported_s"] for s in samples if s["launcher_reported_s"] is not None]
    processes: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    phases: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for sample in samples:
        for name, row in sample["processes"].items():
            for key, value in row.items():
                processes[name][key].append(value)
        for name, row in sample["phases"].items():
            for key, value in row.items():
                phases[name][key].append(value)
    return {
        "runs": len(samples),
        "servers": samples[0]["servers"] if samples else {},
        "time_to_ready_s": {
            "median": _median(ready),
            "min": round(min(ready), 4),
            "max": round(max(ready), 4),
            "all": [round(r, 4) for r in ready],
        },
        "launcher_reported_s": _median(reported),
        "processes": {
            name: {key: _median(values) for key, values in row.items()} for name, row in processes.items()
        },
        "phases": {
            name: {key: _median(values) for key, values in row.items()} for name, row in phases.items()
        },
    }


def import_profile(root: Path, module: str, top: int = 12) -> dict[str, Any]:
    """What importing ``module`` alone costs in a fresh interpreter (``python -X importtime``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    wall = time.monotonic() - started
    per_package: Counter[str] = Counter()
    modules = 0
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, _cumulative, name = line.split(":", 1)[1].split("|")
        per_package[name.strip().split(".")[0]] += int(self_us)
        modules += 1
    return {
        "module": module,
        "ok": done.returncode == 0,
        "wall_s": round(wall, 3),
        "modules": modules,
        "total_ms": round(sum(per_package.values()) / 1000, 1),
        "top_packages_ms": {k: round(v / 1000, 1) for k, v in per_package.most_common(top)},
        "packages": sorted(per_package),
    }


def _server_modules(root: Path, kinds: dict[str, str]) -> dict[str, str]:
    """Server name -> its app module, from the ``type/impl`` column of ng_run's table."""
    return {
        name: f"{kind.replace('/', '.')}.app"
        for name, kind in kinds.items()
        if (root / kind / "app.py").exists()
    }


def measure_startup(
    runs: int = 5,
    config_paths: Sequence[str] = DEFAULT_CONFIG_PATHS,
    overrides: Sequence[str] = (),
    root: Path | str | None = None,
    compare_roots: Sequence[Path | str] = (),
    imports: bool = False,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Launch ``ng_run`` ``runs`` times (per tree, interleaved) and return what the module docstring says."""
    trees = [Path(root or PACKAGE_PARENT_DIR).resolve(), *(Path(r).resolve() for r in compare_roots)]
    load = os.getloadavg()
    samples: dict[Path, list[dict[str, Any]]] = {tree: [] for tree in trees}
    for i in range(runs):
        for tree in trees if i % 2 == 0 else reversed(trees):
            samples[tree].append(launch_once(tree, config_paths, overrides, timeout_s))
    results = {}
    for tree in trees:
        result = _summarize(samples[tree])
        result["root"] = str(tree)
        if imports:
            modules = {"launcher": "nemo_gym.run.cli"}
            modules.update(_server_modules(tree, samples[tree][0]["servers"]))
            result["imports"] = {name: import_profile(tree, module) for name, module in modules.items()}
        results[tree] = result
    out = results[trees[0]]
    out["config_paths"] = list(config_paths)
    out["overrides"] = list(overrides)
    out["machine"] = {"cpus": os.cpu_count(), "load_average": [round(x, 2) for x in load]}
    if len(trees) > 1:
        out["compare"] = {str(tree): results[tree] for tree in trees[1:]}
    return out


# ------------------------------------------------------------------------------------------------
# The command.

OPTIONS = ("runs", "compare_roots", "imports", "output_json_fpath", "config_paths", "root")


def format_report(result: dict[str, Any]) -> str:
    """The tables the command prints: time to ready, memory and CPU per process, phases per process."""
    trees = [result] + list(result.get("compare", {}).values())
    lines = []
    for tree in trees:
        ready = tree["time_to_ready_s"]
        lines.append(
            f"\n{tree['root']}: {tree['runs']} runs, time to ready median {ready['median']:.3f} s "
            f"(min {ready['min']:.3f}, max {ready['max']:.3f}); ng_run's own count "
            f"{tree['launcher_reported_s']} s"
        )
        lines.append(f"  {'process':<40}{'USS MiB':>9}{'RSS MiB':>9}{'CPU s':>8}")
        for name, row in tree["processes"].items():
            lines.append(f"  {name:<40}{row['uss_mib']:>9.1f}{row['rss_mib']:>9.1f}{row['cpu_s']:>8.2f}")
        for name, row in tree["phases"].items():
            text = ", ".join(f"{phase} {seconds * 1000:.0f}" for phase, seconds in row.items())
            lines.append(f"  phases (ms) {name}: {text}")
        for name, prof in tree.get("imports", {}).items():
            top = ", ".join(f"{k} {v:.0f}" for k, v in list(prof["top_packages_ms"].items())[:8])
            lines.append(
                f"  imports of {prof['module']} ({name}): {prof['total_ms']:.0f} ms, {prof['modules']} modules; {top}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: python -m nemo_gym.tools.bench.startup [+runs=5] [+imports=true]\n"
            "           [+compare_roots=<tree>,<tree>] [+root=<tree>] [+config_paths=[a.yaml,b.yaml]]\n"
            "           [+output_json_fpath=startup_bench.json] [other +key=value: passed to ng_run]"
        )
        return
    opts: dict[str, str] = {}
    overrides: list[str] = []
    for a in argv:
        key, sep, value = a.lstrip("+").partition("=")
        if sep and key in OPTIONS:
            opts[key] = value
        else:
            overrides.append(a)
    config_paths = (
        [p.strip() for p in opts["config_paths"].strip("[]").split(",") if p.strip()]
        if "config_paths" in opts
        else list(DEFAULT_CONFIG_PATHS)
    )
    result = measure_startup(
        runs=int(opts.get("runs", 5)),
        config_paths=config_paths,
        overrides=overrides,
        root=opts.get("root") or None,
        compare_roots=[r for r in opts.get("compare_roots", "").split(",") if r],
        imports=opts.get("imports", "false").lower() == "true",
    )
    print(format_report(result))
    out = Path(opts.get("output_json_fpath", "startup_bench.json"))
    out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    print(f"\nwritten: {out}")


if __name__ == "__main__":
    main()
