"""tests/suite_profile.py: docs/testing.md's tables from a ``--durations=0`` report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_gym.tools.pytest_plugin import UNIT_SECONDS_FILE, UNKNOWN_UNIT_SECONDS, longest_units_first
from tests.suite_profile import cpu_table, kind_of, read, read_cpu, read_tests, tables, unit_seconds

ROOT = Path(__file__).resolve().parent.parent

REPORT = """\
============================== slowest durations ===============================
40.00s call     tests/test_reward_audit.py::test_environment_passes_its_reward_audit[aviary]
30.00s call     responses_api_models/local_model/tests/test_app.py::test_a[n_batch_8]
20.00s setup    tests/test_ray.py::test_b
6.00s call      tests/test_config.py::test_c
4.00s teardown  tests/test_config.py::test_c
not a duration line
"""


def test_tables_sum_by_kind_phase_and_file(tmp_path: Path) -> None:
    report = tmp_path / "run.txt"
    report.write_text(REPORT)
    rows = read(report)
    assert len(rows) == 5 and rows[-1] == (4.0, "teardown", "tests/test_config.py")
    out = tables(rows)
    assert "Test time summed over workers: 100 s in 4 files." in out
    assert "| local model generation (llama.cpp on the CPU) | 1 | 30 | 30.0% |" in out
    assert "| Ray cluster (two nodes per module) | 1 | 20 | 20.0% |" in out
    assert "| servers started per test or module (ng_run, scripted model, HTTP) | 1 | 10 | 10.0% |" in out
    assert "| call | 76 | 76.0% |" in out and "| setup | 20 | 20.0% |" in out
    assert "| `tests/test_config.py` | 10 | 10.0% |" in out
    # Kinds: the first pattern that matches; everything else is a server test.
    assert kind_of("tests/test_viewer_browser.py").startswith("Chromium")
    assert kind_of("resources_servers/workspace_tasks/tests/test_app.py").startswith("sandboxes")
    assert kind_of("tests/test_anything_else.py").startswith("servers started")


def test_unit_seconds_sum_by_unit_of_work(tmp_path: Path) -> None:
    report = tmp_path / "run.txt"
    report.write_text(REPORT)
    seconds = unit_seconds(read_tests(report), ROOT)
    # A test of a file that splits across workers is its own unit; any other test counts to its file.
    assert seconds == {
        "tests/test_reward_audit.py::test_environment_passes_its_reward_audit[aviary]": 40.0,
        "responses_api_models/local_model/tests/test_app.py": 30.0,
        "tests/test_ray.py": 20.0,
        "tests/test_config.py": 10.0,
    }
    assert list(seconds) == sorted(seconds, key=lambda u: -seconds[u])


def test_units_are_dealt_longest_first_each_keeping_its_tests_in_order() -> None:
    split = "tests/test_reward_audit.py::test_environment_passes_its_reward_audit"
    ids = [
        "tests/test_a.py::t1",
        "tests/test_a.py::t2",
        f"{split}[x]",
        f"{split}[y]",
        "tests/test_b.py::t1",
        "tests/test_new.py::t1",
    ]
    seconds = {"tests/test_a.py": 5.0, f"{split}[y]": 300.0, "tests/test_b.py": 60.0, f"{split}[x]": 1.0}
    assert longest_units_first(ids, ROOT, seconds) == [
        f"{split}[y]",
        "tests/test_b.py::t1",
        "tests/test_new.py::t1",  # not in the profile: UNKNOWN_UNIT_SECONDS
        "tests/test_a.py::t1",
        "tests/test_a.py::t2",
        f"{split}[x]",
    ]
    assert UNKNOWN_UNIT_SECONDS == 30.0


def _order_on_one_worker(project: Path) -> list[str]:
    """Run ``project``'s tests on one xdist worker; the files in the order they ran."""
    order = project / "order.txt"
    order.unlink(missing_ok=True)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "1",
            "--dist",
            "loadfile",
            "-p",
            "nemo_gym.tools.pytest_plugin",
        ],
        cwd=project,
        env={**os.environ, "ORDER_FILE": str(order), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return order.read_text().split()


def test_xdist_workers_run_the_recorded_longest_unit_first(tmp_path: Path) -> None:
    """A project of three files on one worker: they run in the profile's order, not as collected."""
    for name in ("test_a.py", "test_b.py", "test_c.py"):
        (tmp_path / name).write_text(
            "import os\n\ndef test_one():\n"
            f"    with open(os.environ['ORDER_FILE'], 'a') as f:\n        f.write('{name}\\n')\n"
        )
    (tmp_path / "tests").mkdir()
    (tmp_path / UNIT_SECONDS_FILE).write_text(json.dumps({"test_c.py": 90, "test_a.py": 10, "test_b.py": 50}))
    assert _order_on_one_worker(tmp_path) == ["test_c.py", "test_b.py", "test_a.py"]
    (tmp_path / UNIT_SECONDS_FILE).unlink()  # without a profile: as collected
    assert _order_on_one_worker(tmp_path) == ["test_a.py", "test_b.py", "test_c.py"]


# A test that burns ~0.6 CPU-s in a child process (a server's CPU is a child's too) and one that sleeps.
CPU_PROJECT = """\
import subprocess, sys, time

def test_child_burns():
    subprocess.run([sys.executable, "-c", "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.6: pass"], check=True)

def test_sleeps():
    time.sleep(0.5)
"""


def _cgroup_writable() -> bool:
    for base in (Path("/sys/fs/cgroup/cpuacct"), Path("/sys/fs/cgroup")):
        if (base / "cgroup.procs").is_file():
            return os.access(base, os.W_OK)
    return False


@pytest.mark.skipif(not _cgroup_writable(), reason="--cpu-profile needs a writable cgroup (root)")
@pytest.mark.parametrize("workers", [None, "2"])
def test_cpu_profile_counts_child_processes_and_not_waiting(tmp_path: Path, workers: str | None) -> None:
    (tmp_path / "test_cpu.py").write_text(CPU_PROJECT)
    out = tmp_path / "cpu"
    args = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "nemo_gym.tools.pytest_plugin",
        "--cpu-profile",
        str(out),
    ]
    done = subprocess.run(
        args + (["-n", workers] if workers else []),
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    files = sorted(p.name for p in out.glob("*.jsonl"))
    # One file per process that ran tests: the run itself, or each worker (never the xdist controller).
    assert files == ["main.jsonl"] if workers is None else files and set(files) <= {"gw0.jsonl", "gw1.jsonl"}
    rows = {nodeid.split("::")[1]: (cpu, wall) for nodeid, cpu, wall in read_cpu(out)}
    assert set(rows) == {"test_child_burns", "test_sleeps"}
    assert rows["test_child_burns"][0] >= 0.5  # the child's CPU, counted
    assert rows["test_sleeps"][0] < 0.2 and rows["test_sleeps"][1] >= 0.5  # waiting is wall time, not CPU
    table = cpu_table(read_cpu(out), tmp_path)
    assert "CPU time of 2 tests" in table and "| `test_cpu.py` |" in table
