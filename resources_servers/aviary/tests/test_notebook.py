"""The notebook env (aviary-notebook, local ipykernel) against real servers and real kernels.

Checks that a rollout runs cells in a kernel and submits; that the agent's bounded context shows only
the latest notebook view (read back from the scripted model's prompt token ids, which are the UTF-8
bytes of the prompt it was sent); that the kernel runs with rlimits and without the server's
environment; and that no kernel outlives its session: closed, abandoned (idle reaper), dropped by the
client mid-rollout, or orphaned by a server killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from nemo_gym.cli import RunHelper
from nemo_gym.sandbox.backend_base import _BackendBase
from nemo_gym.sandbox.cgroup_mode import parse_mountinfo
from nemo_gym.tools.export_transitions import transitions
from nemo_gym.tools.testing import get, post_json, run_rollout, running_servers, server_url

pytestmark = pytest.mark.slow

CONFIG = "resources_servers/aviary/configs/notebook_aviary.yaml"
NB, NB_AGENT = "notebook_aviary_resources_server", "notebook_aviary_agent"
SHORT, SHORT_AGENT = "notebook_short", "notebook_short_agent"
REAPED = "notebook_reaped"  # a one-second idle timeout, for the reaper's test only
LIMIT_AS = 1024**3

REVENUE = "import pandas as pd\ndf = pd.read_csv('sales.csv')\nprint((df.units * df.price).sum())"


# A port that listens on this machine's loopback: reachable from an unsandboxed kernel, not from one in
# its own network namespace (there, 127.0.0.1 is a different, empty loopback).
_LISTENER = socket.socket()
_LISTENER.bind(("127.0.0.1", 0))
_LISTENER.listen()
# The task file with the answers, in this checkout: the kernel must not see it.
TASKS = Path(__file__).resolve().parents[1] / "data" / "notebook_tasks.jsonl"
REPO = Path(__file__).resolve().parents[3]
SANDBOX_PROBE = f"""import os, signal, socket, time
s = socket.socket()
s.settimeout(2)
try:
    s.connect(("127.0.0.1", {_LISTENER.getsockname()[1]}))
    print("NET open")
except OSError as e:
    print("NET blocked", e.errno)
try:
    open("/usr/escape.txt", "w")
    print("FS writable")
except OSError as e:
    print("FS blocked", e.errno)
try:
    print("KEY read", open({str(TASKS)!r}).readline())
except OSError as e:
    print("KEY hidden", e.errno)
print("PIDS", len([p for p in os.listdir("/proc") if p.isdigit()]), "PPID", os.getppid())
for path in ("/tmp", "/dev/shm"):
    st = os.statvfs(path)
    print("SIZE", path, st.f_blocks * st.f_frsize)
kids = []
try:
    for _ in range(700):
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        kids.append(pid)
except OSError as e:
    print("FORK blocked", e.errno)
for kid in kids:
    os.kill(kid, signal.SIGKILL)
    os.waitpid(kid, 0)
print("FORKS", len(kids))
"""


# The work dir's disk quota of the SHORT server (kernel_limits.work_dir_quota_mib).
QUOTA_MIB = 16
# 200 files of 1 MiB, each under RLIMIT_FSIZE (bounded, so that the unfixed server wrote 200 MiB, no more).
FILL = """import time
n = 0
for n in range(1, 201):
    with open(f'fill{n}', 'wb') as f:
        f.write(bytes(1 << 20))
    time.sleep(0.01)
print('wrote', n)
"""
CLEAN = "import glob, os\nfor f in glob.glob('fill*'):\n    os.remove(f)\nopen('small', 'wb').write(bytes(1000))\nprint('cleaned')"
# A thread the cell leaves behind writes after the cell returned, while the model thinks.
BACKGROUND = """import threading, time
def write():
    time.sleep(1)
    for i in range(200):
        with open(f'bg{i}', 'wb') as f:
            f.write(bytes(1 << 20))
        time.sleep(0.01)
threading.Thread(target=write, daemon=True).start()
print('started')
"""
# Host paths a cell must not reach through the server: a file the server would write the notebook over
# (through a symlink the cell puts in place of notebook.ipynb / notebook.md), a dir the server would list.
HOST_DIR = Path(tempfile.mkdtemp(prefix="nb-host-"))
HOST_MARK = f"host-only-{uuid.uuid4().hex[:8]}.txt"
(HOST_DIR / HOST_MARK).write_text("x")
for _victim in ("victim.ipynb", "victim.md"):
    (HOST_DIR / _victim).write_text("original")
THROUGH_LINKS = f"""import os
for name, target in (("notebook.ipynb", "victim.ipynb"), ("notebook.md", "victim.md"), ("peek", "")):
    if os.path.lexists(name):
        os.remove(name)
    os.symlink(os.path.join({str(HOST_DIR)!r}, target), name)
print('linked')
"""

# 3 MB of output in 3,000 flushed prints: the server keeps OUTPUT_CHARS of it (and says so).
OUTPUT_CHARS = 100_000
FLOOD = "import sys\nfor i in range(3000):\n    print('x' * 1000, flush=True)"
# A child that leaves the kernel's process group (setsid) and outlives the cell: closing the env kills it.
DAEMON_MARK = "2345.678"
DAEMON = f"""import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sleep", ["sleep", "{DAEMON_MARK}"])
    os._exit(0)
time.sleep(0.5)
print("started")
"""


def _marked(mark: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            if mark in p.cmdline() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def _cell(code: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "edit_cell", "arguments": {"contents": code}}]}


def _submit(answer: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "submit_answer", "arguments": {"answer": answer}}]}


SCRIPTS = [
    {
        "contains": "[limits]",
        "turns": [
            _cell("x = bytearray(3 * 1024**3)"),
            _cell("import os\nprint(sorted(os.environ))"),
            _cell(SANDBOX_PROBE),
            _cell(FLOOD),
            _submit("0"),
        ],
    },
    {"contains": "[daemon]", "turns": [_cell(DAEMON), _submit("0")]},
    {
        "contains": "[disk]",
        "turns": [
            _cell(FILL),
            _cell(CLEAN),
            _cell(BACKGROUND),
            {**_cell("print('still here?')"), "delay_s": 3.0},
            _submit("0"),
        ],
    },
    {
        "contains": "[host]",
        "turns": [
            _cell(THROUGH_LINKS),
            {"tool_calls": [{"name": "list_workdir", "arguments": {}}]},
            _submit("0"),
        ],
    },
    {
        "contains": "[slow]",
        "turns": [_cell("print(1)"), {"delay_s": 60.0, **_cell("print(2)")}, _cell("print(3)")],
    },
    {"contains": "[wrong]", "turns": [_cell(REVENUE), _submit("11100")]},
    {  # one turn, a right answer twice and a cell after it: only the first call is run
        "contains": "[twice]",
        "turns": [
            {
                "tool_calls": [
                    {"name": "submit_answer", "arguments": {"answer": "11046"}},
                    {"name": "submit_answer", "arguments": {"answer": "11046"}},
                    {"name": "edit_cell", "arguments": {"contents": "print(1)"}},
                ]
            }
        ],
    },
    {
        "contains": "total revenue",
        "turns": [
            {"tool_calls": [{"name": "list_workdir", "arguments": {}}]},
            _cell(REVENUE),
            _submit("11046"),
        ],
    },
]


def _row(task_idx: int, tag: str | None = None) -> dict[str, Any]:
    items = [{"role": "user", "content": f"Work carefully. {tag}"}] if tag else []
    return {"task_idx": task_idx, "responses_create_params": {"input": items}}


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    extra = {
        "policy_model": {
            "responses_api_models": {
                "scripted_model": {"scripts_by_input": SCRIPTS, "return_token_id_information": True}
            }
        },
        # The production idle timeout: a dropped rollout's kernel must be stopped by the agent, not the reaper.
        SHORT: {
            "resources_servers": {
                "aviary": {
                    "entrypoint": "notebook_app.py",
                    "idle_timeout_s": 300.0,
                    "kernel_limits": {
                        "address_space_bytes": LIMIT_AS,
                        "output_chars": OUTPUT_CHARS,
                        "work_dir_quota_mib": QUOTA_MIB,
                    },
                }
            }
        },
        REAPED: {"resources_servers": {"aviary": {"entrypoint": "notebook_app.py", "idle_timeout_s": 1.0}}},
        SHORT_AGENT: {
            "responses_api_agents": {
                "aviary_agent": {
                    "entrypoint": "app.py",
                    "resources_server": {"type": "resources_servers", "name": SHORT},
                    "model_server": {"type": "responses_api_models", "name": "policy_model"},
                    "max_steps": 6,
                    "collapse_old_env_states": True,
                }
            }
        },
    }
    try:
        with running_servers([CONFIG], extra) as h:
            yield h
    finally:
        shutil.rmtree(HOST_DIR, ignore_errors=True)


def _function_outputs(result: dict[str, Any]) -> list[str]:
    return [o["output"] for o in result["response"]["output"] if o.get("type") == "function_call_output"]


def test_the_work_dirs_disk_quota_stops_a_filling_cell_and_a_writer_left_behind(helper: RunHelper) -> None:
    """RLIMIT_FSIZE caps each file, and nothing capped how many a cell writes. Before: FILL wrote its 200
    MiB ("wrote 200") and BACKGROUND's thread 200 MiB more after its cell returned (a cell that writes
    until its time bound fills the host's disk). Now the work dir is watched while the kernel lives: the
    filling cell is interrupted past the quota (the model reads why, and the episode goes on: it deletes
    files and works again), and a writer left behind, with no cell running, gets the kernel killed (the
    next cell says why)."""
    result = run_rollout(helper, SHORT_AGENT, _row(0, "[disk]"), timeout=180)
    outputs = _function_outputs(result)
    views = [o["content"] for o in result["response"]["output"] if o.get("is_env_state")]
    assert "disk quota" in outputs[0] and "interrupted" in outputs[0], outputs[0][-600:]
    assert f"past its disk quota of {QUOTA_MIB} MiB" in outputs[0], outputs[0][-600:]
    assert "wrote 200" not in views[1] and "disk quota" in views[1], views[1][-600:]
    assert outputs[1] == "Appended new cell (#1)." and "cleaned" in views[2], (outputs[1], views[2][-400:])
    assert outputs[2] == "Appended new cell (#2)." and "started" in views[3], views[3][-400:]
    assert "kernel was killed at its work dir's disk quota" in outputs[3], outputs[3][-600:]
    assert "kept writing while no cell ran" in outputs[3], outputs[3][-600:]
    assert result["reward"] == 0.0
    # Closed with the rollout: nothing it wrote is left on the host (the server's episode dirs).
    (root,) = Path(tempfile.gettempdir()).glob(f"nemo-gym-kernels-{_pid(helper, SHORT)}-*")
    assert _wait_until(lambda: not any(root.iterdir()), 30), list(root.iterdir())


def test_a_cell_reaches_no_host_path_through_the_servers_file_operations(helper: RunHelper) -> None:
    """The server reads and writes the notebook and lists the work dir on the host, as root: a cell that
    put symlinks there had the server follow them. Before: the notebook's JSON was written over
    ``victim.ipynb`` and its Markdown over ``victim.md`` (any file of the host), and list_workdir listed
    the host dir behind ``peek``. Now the notebook lives beside the work dir, out of the kernel's reach, and
    the listing never follows a symlink."""
    result = run_rollout(helper, SHORT_AGENT, _row(0, "[host]"), timeout=180)
    outputs = _function_outputs(result)
    views = [o["content"] for o in result["response"]["output"] if o.get("is_env_state")]
    assert "linked" in views[1], views[1][-400:]
    assert (HOST_DIR / "victim.ipynb").read_text() == "original"
    assert (HOST_DIR / "victim.md").read_text() == "original"
    assert HOST_MARK not in outputs[1] and "peek" in outputs[1], outputs[1][-600:]


def _pid(helper: RunHelper, name: str) -> int:
    return next(r["pid"] for r in helper.server_instances() if r["name"] == name)


def _kernels(server_pid: int) -> list[psutil.Process]:
    """The ipykernel processes started by a server process."""
    try:
        children = psutil.Process(server_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in children:
        try:
            # The kernel's python (bubblewrap's own processes, which wrap it, name it in their command line).
            if p.name() != "bwrap" and any("ipykernel" in part for part in p.cmdline()):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return out


def _wait_until(predicate: Any, bound_s: float = 60.0) -> bool:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def _outputs(result: dict[str, Any]) -> list[str]:
    return [o["output"] for o in result["response"]["output"] if o.get("type") == "function_call_output"]


def test_rollout_runs_a_cell_and_submits(helper: RunHelper) -> None:
    result = run_rollout(helper, NB_AGENT, _row(0), timeout=180)
    assert result["reward"] == 1.0 and result["step_rewards"] == [0.0, 0.0, 1.0]
    listing, appended, verdict = _outputs(result)
    assert "sales.csv" in listing and appended == "Appended new cell (#0)." and verdict == "Correct."
    views = [o["content"] for o in result["response"]["output"] if o.get("is_env_state")]
    assert "11046.0" in views[-1]  # the cell ran in the kernel and its output is in the notebook view
    assert {t["name"] for t in result["response"]["tools"]} == {"edit_cell", "list_workdir", "submit_answer"}
    wrong = run_rollout(helper, NB_AGENT, _row(0, "[wrong]"), timeout=180)
    assert wrong["reward"] == 0.0 and _outputs(wrong)[-1] == "Incorrect."
    twice = run_rollout(helper, NB_AGENT, _row(0, "[twice]"), timeout=180)  # one answer per episode
    assert twice["reward"] == 1.0 and twice["step_rewards"] == [1.0]
    assert _outputs(twice)[0] == "Correct." and all("already ended" in o for o in _outputs(twice)[1:])
    assert _wait_until(lambda: not _kernels(_pid(helper, NB)), 30)


def test_bounded_context_shows_only_the_latest_notebook_view(helper: RunHelper) -> None:
    result = run_rollout(helper, NB_AGENT, _row(0), timeout=180)
    steps = result["response"]["steps"]
    prompts = [bytes(s["prompt_token_ids"]).decode() for s in steps]
    placeholder = "[Previous environment state - hidden]"
    assert placeholder not in prompts[0]
    assert prompts[1].count(placeholder) == 1 and prompts[2].count(placeholder) == 2
    # The last prompt holds the cell's output once (the latest view), and every earlier action.
    assert prompts[2].count("11046.0") == 1
    assert "list_workdir" in prompts[2] and "edit_cell" in prompts[2]
    assert result["response"]["context_policy"]["collapse_old_env_states"] is True
    # The step export rebuilds the same collapsed prompts: each text of a rebuilt prompt is in the
    # prompt the model was sent, in order, with the same number of placeholders.
    for exported, prompt in zip(transitions(result), prompts, strict=True):
        items = exported["responses_create_params"]["input"]
        texts = [str(i.get("content") or i.get("output") or i.get("arguments")) for i in items]
        assert texts.count(placeholder) == prompt.count(placeholder)
        pos = 0
        for text in texts:
            pos = prompt.find(text, pos)
            assert pos >= 0, text[:200]
            pos += len(text)


def test_kernel_has_rlimits_and_no_server_environment(helper: RunHelper) -> None:
    base = server_url(helper, SHORT)
    seeded_resp = post_json(base + "/seed_session", {"task_idx": 0})
    seeded = seeded_resp.json()
    try:
        assert _wait_until(lambda: len(_kernels(_pid(helper, SHORT))) == 1)
        (kernel,) = _kernels(_pid(helper, SHORT))
        assert kernel.rlimit(psutil.RLIMIT_AS) == (LIMIT_AS, LIMIT_AS)
        assert kernel.rlimit(psutil.RLIMIT_CPU)[0] > 0
        # Its whole tree is in a pids cgroup (where this machine has one): a fork bomb stops at its limit.
        if "pids" in _BackendBase.cgroup_roots():
            assert _pids_max(kernel.pid) == "512"
        # Sandboxed: no network, read-only filesystem outside its work dir (checked from inside below).
        assert any(p.name() == "bwrap" for p in kernel.parents())
    finally:
        post_json(base + "/close", {"env_id": seeded["env_id"]}, cookies=dict(seeded_resp.cookies))
    result = run_rollout(helper, SHORT_AGENT, _row(0, "[limits]"), timeout=180)
    views = [o["content"] for o in result["response"]["output"] if o.get("is_env_state")]
    assert "MemoryError" in views[1]
    assert "NEMO_GYM" not in views[2] and "HOME" in views[2]
    # 111 (ECONNREFUSED): the host's listening port is not there; 30 (EROFS): read-only outside the work dir;
    # 2 (ENOENT): the repository (its task file with the answers) is not in the kernel's file system at all;
    # its own pid namespace (its parent is the namespace's init, a few processes); 11 (EAGAIN): the pids
    # cgroup stops forking at its bound (512 processes and threads).
    probe = views[3].rsplit("### Output", 1)[-1]  # the probe cell's output, not its source
    assert "NET blocked 111" in probe and "FS blocked 30" in probe, probe[-900:]
    assert "KEY hidden 2" in probe and "KEY read" not in probe, probe[-900:]
    pids = int(probe.split("PIDS ")[1].split()[0])
    assert pids < 20 and "PPID 1\n" in probe, probe[-900:]
    assert "FORK blocked 11" in probe and int(probe.split("FORKS ")[1].split()[0]) < 512, probe[-900:]
    # /tmp and /dev/shm are tmpfs (memory) of a bounded size (before: half the machine's memory each).
    for path in ("/tmp", "/dev/shm"):
        assert int(probe.split(f"SIZE {path} ")[1].split()[0]) == 256 << 20, probe[-900:]
    assert not Path("/usr/escape.txt").exists()
    # 3 MB printed: the server kept about OUTPUT_CHARS of it, and the notebook says the rest was dropped.
    assert f"the output past {OUTPUT_CHARS} characters was not kept" in views[4], views[4][-600:]


def _pids_max(pid: int) -> str:
    """``pids.max`` of the v1 pids cgroup of process ``pid``."""
    path = next(
        line.split(":", 2)[2]
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        if ":pids:" in line
    )
    mount = next(
        m.point
        for m in parse_mountinfo(Path("/proc/self/mountinfo").read_text())
        if "pids" in m.super_options
    )
    limit = mount / path.lstrip("/") / "pids.max"
    return limit.read_text().strip() if limit.is_file() else "max"  # the root cgroup has no limit file


def test_a_child_that_leaves_the_kernels_process_group_dies_with_the_env(helper: RunHelper) -> None:
    """A cell starts a daemon (double fork, setsid, exec sleep): it is out of the kernel's process group,
    and outlived the closed env before; the kernel's cgroup takes it down with the kernel."""
    if "pids" not in _BackendBase.cgroup_roots():
        pytest.skip(
            "this machine gives the server no pids cgroup: the kernel tree is bounded by its group only"
        )
    result = run_rollout(helper, NB_AGENT, _row(0, "[daemon]"), timeout=180)
    views = [o["content"] for o in result["response"]["output"] if o.get("is_env_state")]
    assert "started" in views[1], views[1][-400:]
    assert _wait_until(lambda: not _marked(DAEMON_MARK), 30), [p.cmdline() for p in _marked(DAEMON_MARK)]


def test_closed_abandoned_and_dropped_sessions_leave_no_kernel(helper: RunHelper) -> None:
    # Abandoned: seeded, never closed -> the idle reaper (1 s) stops the kernel.
    reaped_pid, reaped = _pid(helper, REAPED), server_url(helper, REAPED)
    post_json(reaped + "/seed_session", {"task_idx": 1})
    assert _wait_until(lambda: len(_kernels(reaped_pid)) == 1)
    assert _wait_until(lambda: not _kernels(reaped_pid)), get(reaped + "/env_stats").json()
    assert get(reaped + "/env_stats").json()["closed_idle"] >= 1
    # Dropped: the client gives up mid-rollout, while the model thinks (its second turn takes 60 s). The
    # agent notices at once, cancels the rollout and closes the env; the server's idle timeout is 300 s.
    server_pid, base = _pid(helper, SHORT), server_url(helper, SHORT)
    before = get(base + "/env_stats").json()
    with pytest.raises(httpx.ReadTimeout):
        post_json(server_url(helper, SHORT_AGENT) + "/run", _row(2, "[slow]"), timeout=3)
    assert _wait_until(
        lambda: not _kernels(server_pid) and get(base + "/env_stats").json()["live"] == 0, 10
    ), (
        get(base + "/env_stats").json(),
        [k.cmdline() for k in _kernels(server_pid)],
    )
    after = get(base + "/env_stats").json()
    assert after["seeded"] == before["seeded"] + 1
    assert (
        after["closed_client_disconnected"] == before["closed_client_disconnected"] + 1
        and after["closed_idle"] == 0
    )


def test_kernel_dies_with_a_killed_server(helper: RunHelper) -> None:
    """Last in the module: it kills one server of the run."""
    server_pid = _pid(helper, SHORT)
    post_json(server_url(helper, SHORT) + "/seed_session", {"task_idx": 3})
    # The kernel's python appears once bubblewrap has exec'ed it (bounded wait).
    assert _wait_until(lambda: len(_kernels(server_pid)) == 1)
    (kernel,) = _kernels(server_pid)
    work_dir = Path(kernel.cwd())
    assert work_dir.is_dir()
    os.kill(server_pid, signal.SIGKILL)
    assert _wait_until(lambda: not kernel.is_running() or kernel.status() == psutil.STATUS_ZOMBIE, 30)
    # Its work dir (what its cells wrote) is still on the host: the dead server never closed the env. The
    # next process that starts a kernel removes the dirs of servers that died (before: /tmp/tmpXXXX, left
    # for ever).
    assert work_dir.exists()
    next_server = "from resources_servers.aviary.notebook_app import _kernels_root\n_kernels_root()"
    subprocess.run([sys.executable, "-c", next_server], cwd=REPO, check=True, timeout=120)
    assert _wait_until(lambda: not work_dir.exists(), 30), work_dir
