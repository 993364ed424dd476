"""The suite's skip policy, run through the project's own pytest configuration (``pyproject.toml``).

Without ``CI``: a test whose optional dependency is missing skips and says why. With ``CI=true``
(``.ci/run``) or ``NEMO_GYM_NO_SKIP=1``: the same skip is a failure naming the test and the reason,
so nothing is silently left out where everything must be installed. Without pytest-asyncio the run
stops at once with the install command.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
RUN_BOUND_S = 120.0

SKIPPING_TEST = """
import pytest

def test_runs():
    pass

@pytest.mark.skipif(True, reason="needs the frobnicator extra")
def test_needs_an_extra():
    pass
"""

SKIPPING_MODULE = """
import pytest

pytest.importorskip("nemo_gym_no_such_module", reason="needs nemo_gym_no_such_module (an optional extra)")

def test_never_runs():
    pass
"""


def _pytest(
    folder: Path, source: str, env_extra: dict[str, str], *args: str, preexec_fn: Any = None
) -> subprocess.CompletedProcess[str]:
    (folder / "test_sample.py").write_text(source)
    (folder / "test_other.py").write_text("def test_other():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "NEMO_GYM_NO_SKIP")}
    env.update(env_extra)
    env["COLUMNS"] = "400"  # summary lines unshortened
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    config = ["-c", str(REPO / "pyproject.toml"), f"--rootdir={folder}"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", *config, "-rA", *args, str(folder)],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_BOUND_S,
        preexec_fn=preexec_fn,
    )


@pytest.mark.parametrize(
    "env", [{}, {"CI": "false"}, {"NEMO_GYM_NO_SKIP": "0"}], ids=["unset", "CI=false", "NO_SKIP=0"]
)
def test_outside_ci_a_missing_extra_is_a_skip_with_its_reason(tmp_path: Path, env: dict[str, str]) -> None:
    run = _pytest(tmp_path, SKIPPING_TEST, env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 passed, 1 skipped" in run.stdout and "needs the frobnicator extra" in run.stdout, run.stdout


@pytest.mark.parametrize("env", [{"CI": "true"}, {"NEMO_GYM_NO_SKIP": "1"}], ids=["CI=true", "NO_SKIP=1"])
def test_in_ci_a_skipped_test_fails_naming_it_and_the_reason(tmp_path: Path, env: dict[str, str]) -> None:
    run = _pytest(tmp_path, SKIPPING_TEST, env)
    assert run.returncode == pytest.ExitCode.TESTS_FAILED, run.stdout + run.stderr
    assert "2 passed, 1 error in" in run.stdout, run.stdout  # (a failure in set-up counts as an error)
    assert (
        "ERROR test_sample.py::test_needs_an_extra - skipped (needs the frobnicator extra)" in run.stdout
    ), run.stdout
    assert "skips are failures here" in run.stdout


def test_in_ci_a_skipped_module_fails_naming_it_and_the_reason(tmp_path: Path) -> None:
    run = _pytest(tmp_path, SKIPPING_MODULE, {})
    assert run.returncode == 0 and "1 passed, 1 skipped" in run.stdout, run.stdout + run.stderr
    run = _pytest(tmp_path, SKIPPING_MODULE, {"CI": "true"})
    assert run.returncode == pytest.ExitCode.INTERRUPTED, run.stdout + run.stderr  # a collection error
    assert (
        "ERROR test_sample.py - skipped (needs nemo_gym_no_such_module (an optional extra))" in run.stdout
    ), run.stdout


def test_without_pytest_asyncio_the_run_stops_at_once_with_the_fix(tmp_path: Path) -> None:
    run = _pytest(tmp_path, SKIPPING_TEST, {}, "-p", "no:asyncio")
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout + run.stderr
    assert "pytest-asyncio is not installed" in run.stderr and 'pip install -e ".[test]"' in run.stderr, (
        run.stderr
    )


@pytest.mark.parametrize("env", [{}, {"CI": "true"}], ids=["unset", "CI=true"])
def test_a_server_folder_whose_requirements_are_missing_is_skipped_before_import(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """Its test module imports the missing package at the top: it must not even be imported."""
    folder = tmp_path / "resources_servers" / "needs_extra"
    (folder / "tests").mkdir(parents=True)
    (folder / "requirements.txt").write_text("# what this environment needs\nnemo-gym-no-such-dist>=1.0\n")
    (folder / "tests" / "test_env.py").write_text(
        "import nemo_gym_no_such_dist\n\ndef test_env():\n    pass\n"
    )
    run = _pytest(tmp_path, SKIPPING_TEST.replace("True", "False"), env)
    reason = "needs_extra needs nemo-gym-no-such-dist>=1.0 (its requirements.txt), not installed"
    assert reason in run.stdout and "ModuleNotFoundError" not in run.stdout, run.stdout
    if env:
        assert (
            run.returncode == pytest.ExitCode.INTERRUPTED and "skips are failures here" in run.stdout
        )  # collection
    else:
        assert run.returncode == 0 and "3 passed, 1 skipped" in run.stdout, run.stdout


SLOW_FILE = """
import time

def test_slow():
    time.sleep(0.6)  # at least 0.6 s, whatever the machine: the file's share is far past the others'
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadfile"]], ids=["serial", "xdist-2"])
def test_a_file_past_its_share_of_the_suite_fails_the_run_naming_it(
    tmp_path: Path, workers: list[str]
) -> None:
    """``--max-unit-share`` (``.ci/run``): the table of units (files) by test time is printed and a file
    past the bound fails an otherwise green run, naming the file; under pytest-xdist the controller sums
    every worker's reports. With a bound it is within, the same run passes and prints the table."""
    (tmp_path / "test_slow.py").write_text(SLOW_FILE)
    over = _pytest(tmp_path, "def test_quick():\n    pass\n", {}, "--max-unit-share", "60", *workers)
    assert over.returncode == pytest.ExitCode.TESTS_FAILED, over.stdout + over.stderr
    assert "3 passed" in over.stdout, over.stdout
    assert "BUDGET: test_slow.py takes" in over.stdout and "past the bound of 60%" in over.stdout, over.stdout
    assert "BUDGET: test_sample.py" not in over.stdout and "BUDGET: test_other.py" not in over.stdout
    within = _pytest(tmp_path, "def test_quick():\n    pass\n", {}, "--max-unit-share", "100", *workers)
    assert within.returncode == 0, within.stdout + within.stderr
    assert "test time by unit of work:" in within.stdout and "test_slow.py" in within.stdout, within.stdout
    assert "BUDGET:" not in within.stdout, within.stdout


RECORDING_FILE = """
import os
import time
from pathlib import Path
{flag}

import pytest

@pytest.mark.parametrize("i", range(6))
def test_records_its_worker(i):
    time.sleep({pause})  # the split file's tests last, so that both workers take some (they are dealt first)
    with Path({out!r}).open("a") as f:
        f.write(f"{{__name__.rsplit('.', 1)[-1]}} {{os.environ['PYTEST_XDIST_WORKER']}}\\n")
"""


def test_a_files_tests_share_one_worker_unless_it_is_marked_split(tmp_path: Path) -> None:
    """Under ``--dist loadfile`` (``.ci/run``) a file's tests run on one worker (they may share
    module-scoped servers); a file that sets ``SPLIT_ACROSS_WORKERS = True`` has its tests spread."""
    out = tmp_path / "workers.txt"
    (tmp_path / "test_kept.py").write_text(RECORDING_FILE.format(flag="", out=str(out), pause=0))
    (tmp_path / "test_a_split.py").write_text(
        RECORDING_FILE.format(flag="SPLIT_ACROSS_WORKERS = True", out=str(out), pause=0.3)
    )
    run = _pytest(tmp_path, "def test_quick():\n    pass\n", {}, "-n", "2", "--dist", "loadfile")
    assert run.returncode == 0, run.stdout + run.stderr
    seen: dict[str, set[str]] = {}
    for line in out.read_text().splitlines():
        module, worker = line.split()
        seen.setdefault(module, set()).add(worker)
    assert len(seen["test_kept"]) == 1, seen
    assert seen["test_a_split"] == {"gw0", "gw1"}, seen


TWO_SLOW_TESTS = """
import time
{flag}

def test_one():
    time.sleep(0.5)

def test_two():
    time.sleep(0.5)
"""


@pytest.mark.parametrize("split", [False, True], ids=["kept-whole", "split"])
def test_a_file_that_splits_is_judged_test_by_test(tmp_path: Path, split: bool) -> None:
    """A worker is dealt a split file's tests one by one, so the bound applies to each of them: two
    half-second tests are ~50% each (within 70%), while the same file kept whole is ~100% (past it)."""
    flag = "SPLIT_ACROSS_WORKERS = True" if split else ""
    (tmp_path / "test_pair.py").write_text(TWO_SLOW_TESTS.format(flag=flag))
    run = _pytest(tmp_path, "def test_quick():\n    pass\n", {}, "--max-unit-share", "70")
    if split:
        assert run.returncode == 0, run.stdout + run.stderr
        assert "test_pair.py::test_one" in run.stdout and "BUDGET:" not in run.stdout, run.stdout
    else:
        assert run.returncode == pytest.ExitCode.TESTS_FAILED, run.stdout + run.stderr
        assert "BUDGET: test_pair.py takes" in run.stdout, run.stdout


SIGINT_PROBE = """\
import signal, subprocess, sys

def test_sigint_is_the_default_here_and_in_what_it_starts():
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    probe = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout == "True\\n"
"""


def _ignore_and_block_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a script's background job (`bash .ci/run &`) starts
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])


@pytest.mark.parametrize("workers", [(), ("-n", "1")], ids=["in-process", "xdist"])
def test_a_suite_started_with_sigint_ignored_runs_its_tests_with_it_at_the_default(
    tmp_path: Path, workers: tuple[str, ...]
) -> None:
    run = _pytest(tmp_path, SIGINT_PROBE, {}, *workers, preexec_fn=_ignore_and_block_sigint)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "2 passed" in run.stdout, run.stdout[-3000:]
