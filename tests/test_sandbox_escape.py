"""Escape tests: model-written code sent to a real server's sandboxed tool tries to get out.

Each test posts a program to math_with_code's ``/execute_python`` (the path a model's tool call takes,
through nemo_gym.sandbox and bubblewrap) and asserts the specific outcome; then that the server still
serves, that none of its sandbox cgroups is left, and that no process of the attempt survives anywhere on
the machine (every helper process the attack starts carries a unique marker in its argv).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from nemo_gym.cli import RunHelper
from nemo_gym.tools.testing import get, post_json, running_servers, server_url

ENV = "math_with_code"
CONFIG = f"resources_servers/{ENV}/configs/{ENV}.yaml"
REPO_FILE = Path(__file__).resolve().parents[1] / "pyproject.toml"
SECRET_NAME = "NEMO_GYM_ESCAPE_TEST_API_KEY"
SECRET_VALUE = "sk-escape-test-" + uuid.uuid4().hex
HOSTNAME = socket.gethostname()
# kernel: replay: these tests are about the one-shot sandbox (one program per call, nothing left after it);
# the persistent kernel's sandbox (SandboxSession) has its own in tests/test_sandbox_session.py, and
# math_with_code's tests send its attacks through /execute_python in kernel mode.
LIMITS = {
    "max_execution_time": 4,
    "max_cpu_time": 2,
    "memory_mib": 200,
    "max_output_chars": 5000,
    "kernel": "replay",
}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[RunHelper, str, psutil.Process]]:
    os.environ[SECRET_NAME] = SECRET_VALUE  # the servers inherit it; the sandbox must not see it
    try:
        extra = {ENV: {"resources_servers": {ENV: LIMITS}}}
        with running_servers([CONFIG], extra) as helper:
            url = server_url(helper, ENV)
            proc = next(
                p
                for p in psutil.Process().children(recursive=True)
                if any(f"{ENV}/app.py" in part for part in _cmdline(p))
            )
            yield helper, url, proc
    finally:
        os.environ.pop(SECRET_NAME, None)


def _cmdline(p: psutil.Process) -> list[str]:
    """A process's command line; [] for one that exited or is a zombie (an earlier test's unreaped child)."""
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return []


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def _run(url: str, code: str) -> dict[str, Any]:
    resp = post_json(url + "/execute_python", {"code": code}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _marked(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with_marker = any(marker in part for part in (p.info["cmdline"] or []))
        if with_marker and p.pid != os.getpid():
            found.append(p)
    return found


def _idle_prestarted(server_proc: psutil.Process) -> set[int]:
    """Pids of the server's idle pre-started sandboxes: outer bwrap -> namespace init (bwrap) -> the dash
    shim still waiting for its program (nothing else). At most one per pool slot (one per CPU)."""
    idle: set[int] = set()
    for outer in server_proc.children():
        try:
            if outer.name() != "bwrap":
                continue
            tree = outer.children(recursive=True)
            names = sorted(p.name() for p in tree)
            shim = [p for p in tree if p.name() == "dash"]
            if names == ["bwrap", "dash"] and 'eval "$s"' in " ".join(_cmdline(shim[0])):
                idle |= {outer.pid, *(p.pid for p in tree)}
        except psutil.Error:
            continue
    assert len(idle) <= 3 * (os.cpu_count() or 1), idle
    return idle


def _assert_contained(url: str, server_proc: psutil.Process, marker: str | None = None) -> None:
    assert get(url + "/").status_code == 200  # the server keeps serving
    assert server_proc.is_running()
    deadline = time.monotonic() + 5
    while True:
        idle = _idle_prestarted(server_proc)  # the next runs' sandboxes, no program in them yet
        leftovers = [
            c
            for c in server_proc.children(recursive=True)
            if _alive(c)
            and c.pid not in idle
            and not any("multiprocessing" in part for part in _cmdline(c))  # not the verify pool
        ]
        cgroups = [
            d
            for root in Path("/sys/fs/cgroup").glob(f"*/**/nemo_gym_sandbox_{server_proc.pid}")
            for d in root.glob("run_*")
            if not _cgroup_pids(d) <= idle or not _cgroup_pids(d)
        ]
        marked = _marked(marker) if marker else []
        if not (leftovers or cgroups or marked) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not leftovers, [_cmdline(c) for c in leftovers]
    assert not cgroups, cgroups
    assert not marked, [p.cmdline() for p in marked]


def _cgroup_pids(cgroup: Path) -> set[int]:
    try:
        return {int(p) for p in (cgroup / "cgroup.procs").read_text().split()}
    except (OSError, ValueError):
        return set()


def test_no_network_not_even_our_own_servers(server) -> None:
    helper, url, proc = server
    port = int(url.rsplit(":", 1)[1])
    agent_port = int(server_url(helper, f"{ENV}_simple_agent").rsplit(":", 1)[1])
    code = f"""
import errno, socket
for host, port in [("127.0.0.1", {port}), ("127.0.0.1", {agent_port}), ("1.1.1.1", 53)]:
    try:
        socket.create_connection((host, port), timeout=3)
        print("CONNECTED", host)
    except OSError as e:
        print("BLOCKED", host, errno.errorcode.get(e.errno, e.errno))
"""
    out = _run(url, code)
    assert "CONNECTED" not in out["stdout"], out
    lines = out["stdout"].split("\n")
    # Nothing listens in its own network namespace: our servers' ports are not there.
    assert lines[0] == lines[1] == "BLOCKED 127.0.0.1 ECONNREFUSED", out
    assert lines[2] in ("BLOCKED 1.1.1.1 ENETUNREACH", "BLOCKED 1.1.1.1 EHOSTUNREACH"), out
    _assert_contained(url, proc)


def test_cannot_read_the_repo_root_or_the_servers_secrets(server) -> None:
    _, url, proc = server
    code = f"""
import os
for path in [{str(REPO_FILE)!r}, "/root", "/etc/passwd", "/proc/1/environ"]:
    try:
        with open(path) as f:
            print("READ", path, repr(f.read()[:2000]))
    except OSError as e:
        print("DENIED", path, type(e).__name__)
print("ENV", sorted(os.environ))
print("HAS_SECRET", any({SECRET_VALUE!r} in v for v in os.environ.values()))
print("PROCS", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
"""
    out = _run(url, code)["stdout"]
    assert f"DENIED {REPO_FILE} FileNotFoundError" in out
    assert "DENIED /root FileNotFoundError" in out
    assert "DENIED /etc/passwd FileNotFoundError" in out
    assert SECRET_NAME not in out and "HAS_SECRET False" in out
    env_line = next(line for line in out.splitlines() if line.startswith("ENV"))
    assert set(eval(env_line[4:])) <= {  # noqa: S307 - our own printed list
        "PATH",
        "HOME",
        "LANG",
        "TMPDIR",
        "PWD",
        "PYTHONDONTWRITEBYTECODE",
        "OPENBLAS_NUM_THREADS",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "LC_CTYPE",
    }
    # Its own pid namespace: bwrap's init (1) and the program (2) are all it can see.
    assert "PROCS [1, 2]" in out, out
    # What its init (bwrap) got from the server: a bare PATH; no secret, no repo path.
    assert "READ /proc/1/environ" in out and str(REPO_FILE.parent) not in out.split("READ /proc/1/environ")[1]
    _assert_contained(url, proc)


def test_cannot_write_outside_the_work_dir(server) -> None:
    _, url, proc = server
    target = Path("/tmp") / f"escape-{uuid.uuid4().hex}"
    code = f"""
import errno, os
for path in ["/usr/escape.txt", "/escape.txt", {str(REPO_FILE.parent / "escape.txt")!r}, "/proc/sys/kernel/hostname"]:
    try:
        with open(path, "w") as f:
            f.write("x")
        print("WROTE", path)
    except OSError as e:
        print("DENIED", path, errno.errorcode.get(e.errno, e.errno))
with open({str(target)!r}, "w") as f:  # /tmp is the sandbox's own tmpfs, not the host's
    f.write("x")
with open("inside.txt", "w") as f:
    f.write("ok")
print("WORKDIR_OK", open("inside.txt").read())
"""
    out = _run(url, code)
    assert "WROTE /usr" not in out["stdout"] and "WROTE /escape" not in out["stdout"], out
    assert "DENIED /usr/escape.txt EROFS" in out["stdout"]
    assert "DENIED /escape.txt EROFS" in out["stdout"]
    assert f"DENIED {REPO_FILE.parent / 'escape.txt'} ENOENT" in out["stdout"]
    assert "WORKDIR_OK ok" in out["stdout"]
    assert not target.exists() and not (REPO_FILE.parent / "escape.txt").exists()
    # /proc/sys/kernel/hostname belongs to its own UTS namespace: writing it leaves the host's alone.
    assert socket.gethostname() == HOSTNAME
    _assert_contained(url, proc)


def test_dev_is_read_only_and_dev_shm_is_capped(server) -> None:
    """Before: bubblewrap's /dev was a writable tmpfs with no size, memory no rlimit bounds (a program could
    park gigabytes there past its memory limit where no memory cgroup charges it)."""
    _, url, proc = server
    code = """
import errno, os
try:
    open("/dev/parked", "wb").write(b"x")
    print("WROTE /dev")
except OSError as e:
    print("DENIED /dev", errno.errorcode.get(e.errno, e.errno))
written = 0
try:
    for i in range(64):  # files of 16 MiB (under the file-size limit), up to 1 GiB in all
        with open(f"/dev/shm/big{i}", "wb") as f:
            for _ in range(16):
                f.write(b"x" * (1 << 20))
                f.flush()
                written += 1
    print("SHM", written)
except OSError as e:
    print("SHM STOPPED", written, errno.errorcode.get(e.errno, e.errno))
"""
    out = _run(url, code)
    assert "DENIED /dev EROFS" in out["stdout"], out
    stopped = [line for line in out["stdout"].splitlines() if line.startswith("SHM STOPPED")]
    assert stopped and stopped[0].endswith("ENOSPC") and int(stopped[0].split()[2]) < 1024, out
    _assert_contained(url, proc)


def test_fork_bomb_hits_the_process_limit(server) -> None:
    _, url, proc = server
    marker = f"forkbomb-{uuid.uuid4().hex}"
    code = f"""
import os, subprocess, sys
children = []
try:
    while True:
        children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", {marker!r}]))
except OSError as e:
    print("LIMITED", len(children), type(e).__name__)
while True:
    os.fork()
"""
    out = _run(url, code)
    assert out["pids_limit_hit"] is True, out
    assert "LIMITED" in out["stdout"] and out["success"] is False
    _assert_contained(url, proc, marker)


def test_memory_bomb_is_oom_killed(server) -> None:
    _, url, proc = server
    out = _run(url, "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 * 1024))")
    assert out["oom_killed"] is True and out["success"] is False, out
    assert "Out of memory" in out["error_message"]
    _assert_contained(url, proc)


def test_infinite_loop_times_out(server) -> None:
    _, url, proc = server
    out = _run(url, "while True:\n    pass")
    assert out["timed_out"] is True and out["success"] is False, out
    assert "timed out" in out["error_message"]
    _assert_contained(url, proc)


def test_a_gigabyte_of_output_is_cut_off(server) -> None:
    _, url, proc = server
    out = _run(url, "import sys\nblock = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(block)")
    assert out["output_truncated"] is True and out["success"] is False, {
        k: v for k, v in out.items() if k != "stdout"
    }
    assert len(out["stdout"]) <= LIMITS["max_output_chars"]
    assert "Output limit" in out["error_message"]
    _assert_contained(url, proc)


def test_sigterm_ignoring_daemon_does_not_outlive_the_call(server) -> None:
    _, url, proc = server
    marker = f"daemon-{uuid.uuid4().hex}"
    child = "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    code = f"""
import os, subprocess, sys, time
# Double fork + setsid: the grandchild leaves the program's session and process group.
subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, '-c', {child!r}, {marker!r}], start_new_session=True)", {marker!r}])
time.sleep(1)
print("DAEMON_STARTED")
"""
    out = _run(url, code)
    assert out["success"] is True and "DAEMON_STARTED" in out["stdout"], out
    _assert_contained(url, proc, marker)
    # Same, but the program itself outlives the timeout too.
    out = _run(url, code.replace('print("DAEMON_STARTED")', "time.sleep(600)"))
    assert out["timed_out"] is True, out
    _assert_contained(url, proc, marker)


def test_killing_its_parent_or_the_server_does_nothing(server) -> None:
    _, url, proc = server
    code = f"""
import errno, os, signal
for name, pid in [("parent", os.getppid()), ("server", {proc.pid}), ("init", 1)]:
    try:
        os.kill(pid, signal.SIGKILL)
        print("SENT", name, pid)
    except OSError as e:
        print("FAILED", name, errno.errorcode.get(e.errno, e.errno))
print("STILL_ALIVE")
"""
    out = _run(url, code)
    assert out["success"] is True and "STILL_ALIVE" in out["stdout"], out
    # Its parent is the namespace's init, which ignores the signal; the server's pid does not exist there.
    assert "SENT parent 1" in out["stdout"] and "SENT init 1" in out["stdout"]
    assert "FAILED server ESRCH" in out["stdout"]
    assert proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    _assert_contained(url, proc)
