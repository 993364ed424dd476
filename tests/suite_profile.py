"""Where the suite's time goes: tables for docs/testing.md from a run's ``--durations=0`` report.

    python -m pytest -q -n 4 --dist loadfile --durations=0 > run.txt
    python tests/suite_profile.py run.txt
    python tests/suite_profile.py --unit-seconds run.txt > tests/unit_seconds.json
    python -m pytest -q -n 4 --dist loadfile --cpu-profile cpu/ && python tests/suite_profile.py --cpu cpu/

Prints two markdown tables: test time by kind of work (each file counted under the kind that dominates
it, :data:`KINDS`) and by phase (set-up is mostly module fixtures starting servers), then the 25 files
that take the most. Times are summed over workers, so they add up to more than the wall time.

With ``--unit-seconds`` it prints instead the test time of every unit of work (a file, or one test of a
file that splits across workers) as JSON: the profile the project's pytest plugin deals units by, the
longest first (``UNIT_SECONDS_FILE``).

With ``--cpu DIR`` (a run with the plugin's ``--cpu-profile DIR``) it prints the units of work by CPU
time, their servers and child processes included, with their wall time: on 2 cores the suite is
CPU-bound, so CPU time is what a unit costs the others.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

from nemo_gym.tools.pytest_plugin import work_unit

LINE = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(\S+)")

# The first pattern a file's path matches names its kind.
KINDS: list[tuple[str, str]] = [
    (
        "reward audits (every environment's servers, the battery played through its agent)",
        r"test_reward_audit",
    ),
    ("documents run as pasted (each in a fresh copy of the repo)", r"test_docs_run"),
    ("Ray cluster (two nodes per module)", r"test_ray(_tasks|_replicas)?\.py"),
    ("Chromium (ng_viewer in a real browser)", r"test_viewer_browser"),
    (
        "local model generation (llama.cpp on the CPU)",
        r"local_model/|test_trainer_startup|test_examples|test_harness_tokens|test_messages_api|"
        r"test_model_call_capture|test_quickstart|test_local",
    ),
    (
        "sandboxes (bubblewrap runs and sessions, notebook kernels)",
        r"test_sandbox|aviary/tests/test_notebook|data_analysis_capsules|workspace_tasks|math_with_code|"
        r"code_gen|scientific_code|harness_agent|file_edit_tasks",
    ),
    (
        "load and concurrency checks (many rollouts in flight)",
        r"test_env_event_loop|test_fd_limits|test_bench|test_loop_check|test_concurrency|test_load",
    ),
    ("servers started per test or module (ng_run, scripted model, HTTP)", r""),
]


def read(path: Path) -> list[tuple[float, str, str]]:
    """``(seconds, phase, file)`` of every line of the report."""
    return [(seconds, phase, nodeid.split("::", 1)[0]) for seconds, phase, nodeid in read_tests(path)]


def read_tests(path: Path) -> list[tuple[float, str, str]]:
    """``(seconds, phase, test id)`` of every line of the report."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        match = LINE.match(line)
        if match:
            seconds, phase, nodeid = match.groups()
            out.append((float(seconds), phase, nodeid))
    return out


def unit_seconds(rows: list[tuple[float, str, str]], root: Path) -> dict[str, float]:
    """Test time by unit of work (:func:`nemo_gym.tools.pytest_plugin.work_unit`), rounded to 0.1 s."""
    out: Counter[str] = Counter()
    for seconds, _, nodeid in rows:
        out[work_unit(nodeid, root)] += seconds
    return {unit: round(s, 1) for unit, s in sorted(out.items(), key=lambda kv: (-kv[1], kv[0]))}


def kind_of(file: str) -> str:
    return next(name for name, pattern in KINDS if re.search(pattern, file))


def tables(rows: list[tuple[float, str, str]]) -> str:
    total = sum(s for s, _, _ in rows) or 1.0
    by_file: Counter[str] = Counter()
    by_phase: Counter[str] = Counter()
    for seconds, phase, file in rows:
        by_file[file] += seconds
        by_phase[phase] += seconds
    by_kind: Counter[str] = Counter()
    files_of: Counter[str] = Counter()
    for file, seconds in by_file.items():
        by_kind[kind_of(file)] += seconds
        files_of[kind_of(file)] += 1
    out = [f"Test time summed over workers: {total:,.0f} s in {len(by_file)} files.", ""]
    out += ["| kind of work | files | seconds | share |", "|---|---:|---:|---:|"]
    out += [f"| {k} | {files_of[k]} | {s:,.0f} | {100 * s / total:.1f}% |" for k, s in by_kind.most_common()]
    out += ["", "| phase | seconds | share |", "|---|---:|---:|"]
    out += [f"| {p} | {s:,.0f} | {100 * s / total:.1f}% |" for p, s in by_phase.most_common()]
    out += ["", "| file | seconds | share |", "|---|---:|---:|"]
    out += [f"| `{f}` | {s:,.0f} | {100 * s / total:.1f}% |" for f, s in by_file.most_common(25)]
    return "\n".join(out)


def read_cpu(directory: Path) -> list[tuple[str, float, float]]:
    """``(test id, CPU seconds, wall seconds)`` of every test in a ``--cpu-profile`` directory."""
    out = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            out.append((row["nodeid"], float(row["cpu_s"]), float(row["wall_s"])))
    return out


def cpu_table(rows: list[tuple[str, float, float]], root: Path, top: int = 40) -> str:
    cpu: Counter[str] = Counter()
    wall: Counter[str] = Counter()
    for nodeid, cpu_s, wall_s in rows:
        unit = work_unit(nodeid, root)
        cpu[unit] += cpu_s
        wall[unit] += wall_s
    total_cpu, total_wall = sum(cpu.values()) or 1.0, sum(wall.values())
    out = [
        f"CPU time of {len(rows)} tests: {total_cpu:,.0f} CPU-s ({total_wall:,.0f} s of test time summed).",
        "",
    ]
    out += ["| unit of work | CPU-s | share | wall s |", "|---|---:|---:|---:|"]
    out += [
        f"| `{unit}` | {s:,.0f} | {100 * s / total_cpu:.1f}% | {wall[unit]:,.0f} |"
        for unit, s in cpu.most_common(top)
    ]
    return "\n".join(out)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--unit-seconds"] and len(args) == 2:
        root = Path(__file__).resolve().parent.parent
        print(json.dumps(unit_seconds(read_tests(Path(args[1])), root), indent=1))
    elif args[:1] == ["--cpu"] and len(args) == 2:
        print(cpu_table(read_cpu(Path(args[1])), Path(__file__).resolve().parent.parent))
    elif len(args) == 1:
        print(tables(read(Path(args[0]))))
    else:
        sys.exit(
            "usage: python tests/suite_profile.py [--unit-seconds] <pytest output with --durations=0> | --cpu <dir>"
        )
