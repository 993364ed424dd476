"""Run the sandbox session checks as an unprivileged user (started by
tests/test_sandbox_session_unprivileged.py; a script, not a test module).

Started as root with the suite's interpreter, it imports everything the checks need while root can still
read that interpreter's files (a venv whose Python lives under /root, which no other user may enter),
then drops to the user in place (setgroups, setgid, setuid: no exec, so nothing needs reading again) and
runs, as that user:

* ``killed_holder``: a process holding two sessions (one running a command, one with a kernel) is
  SIGKILLed: every process of their sandboxes dies, and the next process to start one removes their dirs;
* every test of tests/test_sandbox_session.py but ``test_nothing_outlives_a_killed_server`` (it starts the
  interpreter again, which this user cannot: ``killed_holder`` checks the same with a fork);
* workspace_tasks' in-process tests of its hidden-test runner (every task fails untouched and passes
  after its reference solution; the runner is out of the workspace's reach);
* every test of tests/test_sandbox_changes.py (changesets between sessions, binds);
* ``math_with_code_kernel``: math_with_code's cell protocol in a session's kernel under its default
  limits (numpy, scipy and sympy imported there; state kept between cells).

One JSON line per check on stdout (``check``, ``ok``, ``seconds``, ``error``), then one with the mode
the sessions ran in. Without ``--user`` (not root) it runs as the current user.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import inspect
import json
import os
import select
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Imported before the privileges go (the session tests, the sandbox, what they load lazily).
import asyncio.base_subprocess  # noqa: E402,F401
import asyncio.subprocess  # noqa: E402,F401
import asyncio.unix_events  # noqa: E402,F401
import concurrent.futures.thread  # noqa: E402,F401
import gzip  # noqa: E402,F401
import tarfile  # noqa: E402,F401

import psutil  # noqa: E402

from nemo_gym.sandbox import SandboxSession, SessionLimits  # noqa: E402
from nemo_gym.sandbox.bwrap import BubblewrapBackend  # noqa: E402
from nemo_gym.sandbox.session_mount import workspace_mount  # noqa: E402

LEFT_OUT = {"test_nothing_outlives_a_killed_server": "starts the interpreter again: killed_holder instead"}


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _drop_to(user: str) -> None:
    import pwd

    entry = pwd.getpwnam(user)
    os.setgroups([])
    os.setgid(entry.pw_gid)
    os.setuid(entry.pw_uid)
    if os.geteuid() == 0 or os.getuid() == 0:
        raise SystemExit("could not drop root")


def _emit(**item: Any) -> None:
    print(json.dumps(item), flush=True)


def _run(name: str, fn: Any, home: Path) -> None:
    start = time.monotonic()
    try:
        kwargs = {}
        if "tmp_path" in inspect.signature(fn).parameters:
            kwargs["tmp_path"] = Path(tempfile.mkdtemp(prefix=f"{name[:40]}-", dir=home))
        if inspect.iscoroutinefunction(fn):
            asyncio.run(fn(**kwargs))
        else:
            fn(**kwargs)
        _emit(check=name, ok=True, seconds=round(time.monotonic() - start, 2))
    except BaseException as exc:  # noqa: BLE001 (a failed check is reported, the others still run)
        if isinstance(exc, KeyboardInterrupt):
            raise
        tail = "".join(traceback.format_exception(exc))[-3000:]
        _emit(check=name, ok=False, seconds=round(time.monotonic() - start, 2), error=tail)


def killed_holder(home: Path) -> None:
    """A holder of two sessions SIGKILLed: its sandboxes' processes all die; the next start removes its dirs."""
    root = home / "killed"
    root.mkdir()
    provider = {"workdir_root": str(root)}
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the holder
        os.close(read_end)

        async def hold() -> None:
            a = await SandboxSession.start(provider=provider)
            b = await SandboxSession.start(provider=provider)
            await b.run_python("x = 1")
            assert a._sandbox is not None and b._sandbox is not None
            os.write(write_end, f"{a._sandbox.proc.pid} {b._sandbox.proc.pid}\n".encode())
            await a.exec("sleep 300")

        try:
            asyncio.run(hold())
        finally:
            os._exit(1)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 60)
        line = os.read(read_end, 200).decode() if ready else ""
        assert line.strip(), "the holder never reported its sessions"
        outers = [psutil.Process(int(p)) for p in line.split()]
        tree = [q for o in outers for q in [o, *o.children(recursive=True)]]
        assert len(tree) >= 7, tree  # outer bwrap, init, agent (x2), sleep's shell, the kernel
        time.sleep(0.5)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read_end)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(tree):
        time.sleep(0.05)
    assert not _alive(tree), f"left running: {_alive(tree)}"
    assert list(root.glob(f"nemo-gym-sessions-{pid}-*")), "the holder's dir should still be there"

    async def next_start() -> None:
        session = await SandboxSession.start(provider=provider)
        await session.close()

    asyncio.run(next_start())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and list(root.glob(f"*{pid}*")):
        time.sleep(0.1)
    assert not list(root.glob(f"*{pid}*")), f"left: {list(root.iterdir())}"


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def math_with_code_kernel(app: ModuleType) -> None:
    """math_with_code's cells, through its own cell protocol, in a kernel under its default limits."""
    config = app.PythonExecutorResourcesServerConfig.model_fields
    limits = SessionLimits(
        memory_mib=config["memory_mib"].default,
        command_wall_time_s=float(config["max_execution_time"].default),
        command_cpu_time_s=config["max_cpu_time"].default,
    )
    token = "\x00nemo-gym-cell-test\x00"

    async def main() -> None:
        session = await SandboxSession.start(limits=limits)
        try:
            cells = [
                "import numpy as np, scipy.linalg, sympy as sp\nm = np.eye(3) * 2\nfloat(scipy.linalg.det(m))",
                "x = sp.symbols('x')\nsp.integrate(x**2, (x, 0, 3)) + int(m.sum())",
            ]
            outputs = []
            for code in cells:
                run = await session.run_python(app._cell_call(code, [], token))
                assert run.ok, run
                outputs.append(json.loads(run.stdout[run.stdout.rfind(token) + len(token) :])["result"])
            assert outputs == ["8.0", "15"], outputs
        finally:
            await session.close()

    asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--user", help="drop to this user (the script must then start as root)")
    parser.add_argument("--home", required=True, help="a dir of the user's own (HOME, TMPDIR, tmp_path)")
    parser.add_argument("--only", default="", help="comma-separated check names (default: all)")
    args = parser.parse_args()
    home = Path(args.home)
    only = {n for n in args.only.split(",") if n}

    session_tests = _load(REPO / "tests" / "test_sandbox_session.py", "sandbox_session_tests")
    workspace_tests = _load(
        REPO / "resources_servers" / "workspace_tasks" / "tests" / "test_app.py", "workspace_tasks_tests"
    )
    changes_tests = _load(REPO / "tests" / "test_sandbox_changes.py", "sandbox_changes_tests")
    math_app = _load(REPO / "resources_servers" / "math_with_code" / "app.py", "math_with_code_app")
    checks: dict[str, Any] = {"killed_holder": lambda: killed_holder(home)}
    for name, fn in vars(session_tests).items():
        if name.startswith("test_") and callable(fn) and name not in LEFT_OUT:
            checks[name] = fn
    for name in (
        "test_every_task_fails_untouched_and_passes_after_its_reference_solution",
        "test_the_runner_and_its_tests_are_out_of_the_workspaces_reach",
    ):
        checks[f"workspace_tasks::{name}"] = getattr(workspace_tests, name)
    for name, fn in vars(changes_tests).items():
        if name.startswith("test_") and callable(fn):
            checks[f"changes::{name}"] = fn
    checks["math_with_code_kernel"] = lambda: math_with_code_kernel(math_app)
    unknown = only - set(checks)
    if unknown:
        raise SystemExit(f"unknown checks: {sorted(unknown)}")

    if args.user:
        _drop_to(args.user)
    os.environ.update(HOME=str(home), TMPDIR=str(home))
    tempfile.tempdir = str(home)
    os.chdir(home)
    os.umask(0o022)

    for name, fn in checks.items():  # killed_holder first: it forks, before any thread exists
        if not only or name in only:
            _run(name, fn, home)
    mount = workspace_mount()
    driver = BubblewrapBackend.cgroup_driver()
    _emit(mode={"uid": os.geteuid(), "mount": mount.kind, "cgroups": driver.mode, "reason": driver.reason})


if __name__ == "__main__":
    main()
