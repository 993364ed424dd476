"""The project's pytest plugin (loaded for the whole suite by ``addopts = -p nemo_gym.tools.pytest_plugin``).

Contract
--------
* A test that needs something optional (the ``local`` extra, Chromium and playwright) skips, with a
  reason naming what is missing, on a machine without it.
* Where nothing may be missing, a skip is a failure: when the environment variable ``CI`` is set
  (``.ci/run`` sets ``CI=true``) or ``NEMO_GYM_NO_SKIP=1``, every skipped test, and every module
  skipped at collection, is reported as failed with its skip reason. ``CI``/``NEMO_GYM_NO_SKIP`` set
  to ``0``, ``false``, ``no`` or ``off`` count as unset.
* A test module inside a server folder (``<server type>/<name>/...``) whose ``requirements.txt`` names a
  distribution that is not installed is skipped at collection, before it is imported, naming what is
  missing (so a machine with only ``.[test]`` runs everything else instead of stopping on import errors).
* ``pytest-asyncio`` runs the suite's ``async def`` tests; without it the run stops at once with the
  install command, instead of failing every async test one by one.
* The test processes take SIGINT as Python's default even when pytest was started with it ignored (a
  script's background job) or blocked: what the tests start inherits it.
* The runs a test session starts fork their servers from one fork server per test process, kept between
  runs (:func:`nemo_gym.run.supervision.spawning.keep_fork_servers`).
* The runs a test session starts keep their token files (:mod:`nemo_gym.auth`) in a directory of
  the session's own (``NEMO_GYM_RUN_DIR``, inherited by every process the tests start), never in
  the user's.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import tempfile
import time
from collections.abc import Generator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

NO_SKIP_ENV_VARS = ("CI", "NEMO_GYM_NO_SKIP")
_FALSE = {"", "0", "false", "no", "off"}


def skips_are_failures() -> str | None:
    """The variable that makes skips failures (e.g. ``CI=true``), or None."""
    for name in NO_SKIP_ENV_VARS:
        value = os.environ.get(name)
        if value is not None and value.strip().lower() not in _FALSE:
            return f"{name}={value}"
    return None


def pytest_configure(config: pytest.Config) -> None:
    # Test time is tallied only for the budget check (the controller judges; workers' tallies go unused).
    _ROOT[:] = [config.rootpath] if config.getoption("max_unit_share") is not None else []
    _cpu_profile_start(config)
    # Ctrl+C as Python's default, whatever started pytest: a script's background job (`bash .ci/run &`)
    # ignores SIGINT, and an ignored signal passes to every process the tests start, so a test that sends
    # SIGINT to what it started would pass or hang depending on how the suite was launched.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    # Every run a test starts forks its servers from one fork server per worker, kept between runs (the
    # ~1 CPU-second of imports a new one costs, once per worker instead of once per run).
    from nemo_gym.run.supervision.spawning import keep_fork_servers

    keep_fork_servers(True)
    if not os.environ.get("NEMO_GYM_RUN_DIR"):
        os.environ["NEMO_GYM_RUN_DIR"] = tempfile.mkdtemp(prefix="nemo_gym_test_runs-")
    if not config.pluginmanager.hasplugin("asyncio"):
        raise pytest.UsageError(
            "pytest-asyncio is not installed, and the suite's async tests need it: "
            'pip install -e ".[test]" (or ".[dev]" for everything)'
        )


def _skip_reason(longrepr: Any) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _as_failure(report: pytest.TestReport | pytest.CollectReport, cause: str) -> None:
    """Turn a skip report into a failure that gives the skip's reason (pytest prefixes the test id)."""
    reason = _skip_reason(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped ({reason}), and skips are failures here ({cause}): install what it needs"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    cause = skips_are_failures()
    if cause and report.skipped and not hasattr(report, "wasxfail"):
        _as_failure(report, cause)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, Any]:
    report = yield
    cause = skips_are_failures()
    if cause and report.skipped:
        _as_failure(report, cause)
    return report


SERVER_TYPE_DIRS = ("resources_servers", "responses_api_agents", "responses_api_models")
_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


@functools.cache
def missing_requirements(requirements_file: Path) -> tuple[str, ...]:
    """The requirement lines of ``requirements_file`` whose distribution is not installed."""
    if not requirements_file.is_file():
        return ()
    missing = []
    for line in requirements_file.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        match = _REQUIREMENT_NAME.match(line)
        if not line or line.startswith("-") or match is None:
            continue
        try:
            metadata.distribution(match.group(1))
        except metadata.PackageNotFoundError:
            missing.append(line)
    return tuple(missing)


def _server_folder(path: Path) -> Path | None:
    parts = path.parts
    for i, part in enumerate(parts[:-2]):
        if part in SERVER_TYPE_DIRS:
            return Path(*parts[: i + 2])
    return None


class _MissingRequirementsModule(pytest.Module):
    """A test module of a server folder whose requirements are not installed: skipped, never imported."""

    skip_reason = ""

    def collect(self) -> list[Any]:
        pytest.skip(self.skip_reason, allow_module_level=True)


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent: Any) -> pytest.Module | None:
    folder = _server_folder(Path(module_path))
    if folder is None:
        return None
    missing = missing_requirements(folder / "requirements.txt")
    if not missing:
        return None
    module = _MissingRequirementsModule.from_parent(parent, path=Path(module_path))
    module.skip_reason = (
        f"{folder.name} needs {', '.join(missing)} (its requirements.txt), not installed: "
        f'pip install -r {folder / "requirements.txt"} (or pip install -e ".[dev]" for everything)'
    )
    return module


# -- where tests run under pytest-xdist (docs/testing.md) ---------------------------------------------
# ``.ci/run`` runs the suite with ``-n <workers> --dist loadfile``: a test file's tests stay together on
# one worker (they share module-scoped servers, clusters and loaded models, started once), unless the
# file sets ``SPLIT_ACROSS_WORKERS = True`` (a line of its own at module level): its tests share nothing
# costly, so each may run on any worker, and a long file of independent tests no longer decides when the
# suite ends. (Not pytest-xdist's ``loadgroup``: its groups are lost under pytest 9.2, whose test ids no
# longer read the ``_nodeid`` that xdist rewrites.)

SPLIT_FLAG = "SPLIT_ACROSS_WORKERS"
_SPLIT_LINE = re.compile(rf"^{SPLIT_FLAG}\s*=\s*True\b", re.MULTILINE)


@functools.cache
def splits_across_workers(path: Path) -> bool:
    """Whether the test file at ``path`` declares ``SPLIT_ACROSS_WORKERS = True``."""
    try:
        return _SPLIT_LINE.search(path.read_text(encoding="utf-8")) is not None
    except OSError:
        return False


# The longest units first. Workers are dealt units in the order they were collected; pytest-xdist
# reorders them by their number of tests, which dealt the 33 one-test reward audits (minutes each) last,
# to a suite whose other workers had finished. Units are dealt longest first instead, by their test time
# in the last recorded profile (UNIT_SECONDS_FILE, written by ``tests/suite_profile.py --unit-seconds``);
# a unit not in it counts as UNKNOWN_UNIT_SECONDS. Within a unit, the tests keep their order. The
# profile only orders the work: a stale one costs time, never a result.
UNIT_SECONDS_FILE = "tests/unit_seconds.json"
UNKNOWN_UNIT_SECONDS = 30.0


def recorded_unit_seconds(rootpath: Path) -> dict[str, float] | None:
    """The recorded test time of each unit of work, or None when there is no profile to read."""
    try:
        data = json.loads((rootpath / UNIT_SECONDS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    return {str(k): float(v) for k, v in data.items() if isinstance(v, (int, float))}


def longest_units_first(nodeids: list[str], rootpath: Path, seconds: dict[str, float]) -> list[str]:
    """``nodeids`` grouped by unit of work, the units in descending recorded time (ties: as collected),
    each unit's tests in their collected order."""
    units: dict[str, list[str]] = {}
    for nodeid in nodeids:
        units.setdefault(work_unit(nodeid, rootpath), []).append(nodeid)
    order = sorted(units, key=lambda unit: -seconds.get(unit, UNKNOWN_UNIT_SECONDS))
    return [nodeid for unit in order for nodeid in units[unit]]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[Any]) -> None:
    if not _is_worker(config):  # (a worker's own dist option reads 'no')
        return
    seconds = recorded_unit_seconds(config.rootpath)
    if seconds is None:
        return
    position = {
        nodeid: i
        for i, nodeid in enumerate(longest_units_first([i.nodeid for i in items], config.rootpath, seconds))
    }
    items.sort(key=lambda item: position[item.nodeid])


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    if recorded_unit_seconds(config.rootpath) is not None:
        config.option.loadscopereorder = False  # the workers collected the units longest first

    rootpath = config.rootpath

    class FileOrTestScheduling(LoadFileScheduling):
        """pytest-xdist's ``loadfile``, but a file that declares the flag is split into its tests."""

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid, rootpath)

    return FileOrTestScheduling(config, log)


# -- the suite's budget (docs/testing.md) -------------------------------------------------------------
# ``--max-unit-share PERCENT`` (``.ci/run`` passes it): after the run, the test time (set-up + call +
# tear-down, on whichever worker ran it) of every unit of work the workers are dealt (a file, or one
# test of a file that splits) is reported as a share of the suite's summed test time, the largest first,
# and a unit past PERCENT fails the run, naming it. With W workers a unit past 1/W of the suite alone
# decides the wall time; the bound keeps every unit well under that. A check on the suite's shape, not a
# timed test: a slow new test is noticed in the change that adds it, whatever the machine's speed.

_UNIT_SECONDS: dict[str, float] = {}
_BUDGET_FAILURE = "nemo_gym_budget_failure"
_ROOT: list[Path] = []  # the run's root dir when the budget is checked (set at configure), else empty


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("nemo_gym").addoption(
        "--max-unit-share",
        type=float,
        default=None,
        metavar="PERCENT",
        help="fail the run when one file (or one test of a file that splits across workers) takes more "
        "than PERCENT of the suite's summed test time",
    )
    parser.getgroup("nemo_gym").addoption(
        "--cpu-profile",
        default=None,
        metavar="DIR",
        help="write the CPU time of every test, its servers and other child processes included, to "
        "DIR/<worker>.jsonl (each worker joins a cgroup of its own: needs a writable cpuacct cgroup)",
    )


def work_unit(nodeid: str, rootpath: Path) -> str:
    """What a worker is dealt whole: the test's file, or the test itself when its file splits."""
    path = nodeid.split("::", 1)[0]
    return nodeid if splits_across_workers(rootpath / path) else path


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _ROOT:
        unit = work_unit(report.nodeid, _ROOT[0])
        _UNIT_SECONDS[unit] = _UNIT_SECONDS.get(unit, 0.0) + report.duration


def unit_shares(seconds: dict[str, float]) -> list[tuple[str, float, float]]:
    """``(unit, seconds, percent of the total)``, the largest first."""
    total = sum(seconds.values()) or 1.0
    rows = [(unit, s, 100.0 * s / total) for unit, s in seconds.items()]
    return sorted(rows, key=lambda row: -row[1])


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")  # a pytest-xdist worker: the controller judges the whole run


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    limit = session.config.getoption("max_unit_share")
    if limit is None or _is_worker(session.config) or not _UNIT_SECONDS:
        return
    over = [(unit, share) for unit, _, share in unit_shares(_UNIT_SECONDS) if share > limit]
    if over:
        setattr(session.config, _BUDGET_FAILURE, over)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    limit = config.getoption("max_unit_share")
    if limit is None or _is_worker(config) or not _UNIT_SECONDS:
        return
    rows = unit_shares(_UNIT_SECONDS)
    total = sum(s for _, s, _ in rows)
    tr = terminalreporter
    tr.section(
        f"test time by unit of work: {total:.0f} s summed over {len(rows)} units (bound {limit:g}% each)"
    )
    for unit, seconds, share in rows[:15]:
        tr.write_line(f"{share:5.1f}%  {seconds:7.1f} s  {unit}")
    for unit, share in getattr(config, _BUDGET_FAILURE, []):
        tr.write_line(
            f"BUDGET: {unit} takes {share:.1f}% of the suite's test time, past the bound of {limit:g}% "
            "(docs/testing.md: share its servers between tests, or split its file across workers)",
            red=True,
            bold=True,
        )


# -- CPU time per test (docs/testing.md) --------------------------------------------------------------
# ``--cpu-profile DIR``: the suite is CPU-bound on 2 cores, so what a test costs is its CPU time, the
# servers, sandboxes, models and clusters it starts included, not its wall time (which counts the time it
# waited for the other workers). Each worker (or a run without workers) moves itself into a cgroup of its
# own, which every process it starts inherits, and writes one line per test: the cgroup's CPU time
# consumed from the test's set-up to the end of its tear-down (a module's shared servers are charged to
# the test that started them), its wall time and when it started. ``tests/suite_profile.py --cpu DIR``
# sums them by unit.

CGROUP_V1_CPUACCT = Path("/sys/fs/cgroup/cpuacct")
CGROUP_V2 = Path("/sys/fs/cgroup")


class CpuCgroup:
    """A cgroup of this process's own, read for the CPU time of everything started inside it."""

    def __init__(self, name: str) -> None:
        if (CGROUP_V1_CPUACCT / "cpuacct.usage").is_file():
            self.dir, self._v2 = CGROUP_V1_CPUACCT / name, False
        elif (CGROUP_V2 / "cgroup.controllers").is_file():
            self.dir, self._v2 = CGROUP_V2 / name, True
        else:
            raise pytest.UsageError("--cpu-profile needs a cgroup v1 cpuacct or a cgroup v2 hierarchy")
        try:
            self.dir.mkdir(exist_ok=True)
            (self.dir / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as exc:
            raise pytest.UsageError(f"--cpu-profile: cannot join a cgroup at {self.dir}: {exc}") from exc

    def seconds(self) -> float:
        """CPU seconds (user + system) used by every process that has been in the cgroup."""
        if self._v2:
            for line in (self.dir / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) / 1e6
            return 0.0
        return int((self.dir / "cpuacct.usage").read_text()) / 1e9


_CPU: dict[str, Any] = {}


def _cpu_profile_start(config: pytest.Config) -> None:
    out = config.getoption("cpu_profile")
    if out is None or (not _is_worker(config) and getattr(config.option, "numprocesses", None)):
        return  # the controller of an xdist run runs no test
    worker = getattr(config, "workerinput", {}).get("workerid", "main")
    Path(out).mkdir(parents=True, exist_ok=True)
    _CPU["cgroup"] = CpuCgroup(f"nemo_gym_tests_{os.getpid()}")
    _CPU["file"] = open(Path(out) / f"{worker}.jsonl", "a", encoding="utf-8")  # noqa: SIM115


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Generator[None, Any, Any]:
    cgroup = _CPU.get("cgroup")
    if cgroup is None:
        return (yield)
    cpu0, wall0, started = cgroup.seconds(), time.monotonic(), time.time()
    result = yield
    line = {
        "nodeid": item.nodeid,
        "cpu_s": round(cgroup.seconds() - cpu0, 3),
        "wall_s": round(time.monotonic() - wall0, 3),
        "started": round(started, 3),
    }
    _CPU["file"].write(json.dumps(line) + "\n")
    _CPU["file"].flush()
    return result


def pytest_unconfigure(config: pytest.Config) -> None:
    cgroup = _CPU.pop("cgroup", None)
    if cgroup is None:
        return
    _CPU.pop("file").close()
    try:  # back to the parent cgroup; the test's cgroup goes when nothing is left in it
        (cgroup.dir.parent / "cgroup.procs").write_text(str(os.getpid()))
        cgroup.dir.rmdir()
    except OSError:
        pass  # a process a test left running still holds it
