"""ng_run end to end: real processes, real ports, real HTTP.

Covers the head server routes, one process group per server, log prefixes and log files,
ng_status, failure of any child (kill -9 of each kind), graceful SIGINT/SIGTERM, children dying
with a SIGKILLed ng_run, a server that crashes at start-up, the start-up timeout, and RunHelper
started from a short-lived thread.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from nemo_gym.auth import auth_headers
from nemo_gym.cli import RunHelper
from nemo_gym.global_config import GlobalConfigDictParserConfig
from nemo_gym.redaction import REDACTED
from nemo_gym.tools.testing import example_rows, post_json
from tests.conftest import (
    EXAMPLE_CONFIG,
    EXAMPLE_CONFIG_PATHS,
    EXAMPLE_INSTANCES,
    HANG_BOUND_S,
    READY_WAIT_S,
    REPO,
    SCRIPTED_MODEL_CONFIG,
    LaunchedProcess,
    Launcher,
    get_json,
    simple_resources_app,
    write_instance_config,
    write_server_folder,
)

SECRET = "sk-secret123"
AGENT = "example_single_tool_call_simple_agent"


def _instances(run: LaunchedProcess) -> dict[str, dict]:
    return {row["name"]: row for row in get_json(run.head_url + "/server_instances", token=run.token)}


def _assert_nothing_left(run: LaunchedProcess) -> None:
    left = run.wait_no_processes(HANG_BOUND_S)
    assert not left, f"processes left after {HANG_BOUND_S} s: {[(p.pid, p.cmdline()) for p in left]}"


# ------------------------------------------------------------------------------------------------
# One shared run for the read-only checks.


@pytest.fixture(scope="module")
def example_run(launch_module: Launcher) -> LaunchedProcess:
    run = launch_module(EXAMPLE_CONFIG_PATHS, "+head_server.port=0", f"+policy_api_key={SECRET}")
    assert run.wait_ready() == 3
    return run


def test_ready_output_lists_every_server(example_run: LaunchedProcess) -> None:
    rows = _instances(example_run)
    for name in EXAMPLE_INSTANCES:
        row = rows[name]
        table_line = rf"^{name}\s+{row['server_type']}/{row['impl']}\s+{row['url']}\s+{row['pid']}\s*$"
        assert example_run.wait_for_line(table_line, 10) is not None, example_run.stdout


def test_head_server_root(example_run: LaunchedProcess) -> None:
    assert get_json(example_run.head_url + "/", token=example_run.token)["status"] == "ok"


def test_head_server_config_is_complete_and_redacted(example_run: LaunchedProcess) -> None:
    resp = httpx.get(
        example_run.head_url + "/global_config_dict_yaml",
        timeout=10,
        trust_env=False,
        headers=auth_headers(example_run.token),
    )
    assert resp.status_code == 200
    assert SECRET not in resp.text
    cfg = yaml.safe_load(resp.text)
    assert cfg["policy_api_key"] == REDACTED
    rows = _instances(example_run)
    block = cfg["example_single_tool_call"]["resources_servers"]["example_single_tool_call"]
    assert block["port"] == rows["example_single_tool_call"]["port"]
    head_port = int(example_run.head_url.rsplit(":", 1)[1])
    assert cfg["head_server"]["port"] == head_port


def test_server_instances_one_process_group_each(example_run: LaunchedProcess) -> None:
    rows = _instances(example_run)
    assert set(rows) == set(EXAMPLE_INSTANCES)
    ng_run_pgid = os.getpgid(example_run.proc.pid)
    for name, row in rows.items():
        assert row["alive"] is True, name
        pid = row["pid"]
        assert os.getpgid(pid) == pid, f"{name} is not the leader of its own process group"
        assert os.getpgid(pid) != ng_run_pgid
        assert psutil.Process(pid).ppid() == example_run.proc.pid
        assert row["url"] == f"http://{row['host']}:{row['port']}"
        assert get_json(row["url"] + "/", token=example_run.token) is not None


def test_rollout_through_the_agent(example_run: LaunchedProcess) -> None:
    agent = _instances(example_run)[AGENT]
    row = example_rows("example_single_tool_call")[0]
    resp = post_json(agent["url"] + "/run", row, token=example_run.token)
    assert resp.status_code == 200, resp.text[:2000]
    assert "reward" in resp.json()


def test_ng_status_lists_running_servers(example_run: LaunchedProcess, launch: Launcher) -> None:
    port = example_run.head_url.rsplit(":", 1)[1]
    status = launch(f"+head_server.port={port}", cmd="ng_status")
    assert status.wait_exit(60) == 0, status.output
    assert "3 / 3 servers healthy" in status.stdout
    for name in EXAMPLE_INSTANCES:
        line = next(ln for ln in status.stdout.splitlines() if ln.startswith(name + " "))
        assert line.rstrip().endswith("ok"), line


def test_ng_status_with_nothing_running_fails_clearly(launch: Launcher) -> None:
    # A port bound but not listening: connections to it are refused, and nobody else can take it.
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
        status = launch(f"+head_server.port={port}", cmd="ng_status")
        code = status.wait_exit(60)
    assert code == 1, status.output
    assert f"No head server answers at http://127.0.0.1:{port}" in status.stderr
    assert "Is ng_run running?" in status.stderr
    assert "Traceback" not in status.output


def test_ng_status_against_something_else_fails_clearly(launch: Launcher) -> None:
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            self.send_error(404)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=other.serve_forever, daemon=True)
    thread.start()
    try:
        status = launch(f"+head_server.port={other.server_address[1]}", cmd="ng_status")
        code = status.wait_exit(60)
    finally:
        other.shutdown()
        other.server_close()
    assert code == 1, status.output
    assert "HTTP 404" in status.stderr and "not an ng_run head server" in status.stderr
    assert "Traceback" not in status.output


# ------------------------------------------------------------------------------------------------
# Logs.


def test_log_lines_prefixed_and_written_to_log_dir(tmp_path: Path, launch: Launcher) -> None:
    write_server_folder(
        tmp_path,
        "resources_servers",
        "chatty_probe",
        simple_resources_app(
            prelude='print("chatty says hello", flush=True)\n'
            'print("chatty warns on stderr", file=sys.stderr, flush=True)'
        ),
    )
    config = write_instance_config(tmp_path, "chatty", "resources_servers", "chatty_probe")
    log_dir = tmp_path / "logs"
    run = launch(
        f"+config_paths=[{config},{REPO / SCRIPTED_MODEL_CONFIG}]",
        "+head_server.port=0",
        f"+log_dir={log_dir}",
        cwd=tmp_path,
    )
    run.wait_ready()
    assert run.wait_for_line(r"^\[chatty\] chatty says hello$", 10) is not None, run.output
    assert run.wait_for_line(r"^\[chatty\] chatty warns on stderr$", 10) is not None, run.output
    log = (log_dir / "chatty.log").read_text()
    assert "chatty says hello\n" in log and "chatty warns on stderr\n" in log
    assert "[chatty]" not in log  # the file is the server's own output, unprefixed
    assert (log_dir / "policy_model.log").is_file()


# ------------------------------------------------------------------------------------------------
# Failure and stopping.


@pytest.mark.parametrize("victim", EXAMPLE_INSTANCES)
def test_child_killed_makes_ng_run_exit(victim: str, launch: Launcher) -> None:
    run = launch(EXAMPLE_CONFIG_PATHS, "+head_server.port=0")
    run.wait_ready()
    pid = _instances(run)[victim]["pid"]
    os.kill(pid, signal.SIGKILL)
    code = run.wait_exit(HANG_BOUND_S)
    assert code is not None, f"ng_run still running {HANG_BOUND_S} s after {victim} was killed"
    assert code != 0
    assert f"Server '{victim}'" in run.stderr and "SIGKILL" in run.stderr, run.stderr
    _assert_nothing_left(run)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_stops_gracefully(sig: signal.Signals, launch: Launcher) -> None:
    run = launch(EXAMPLE_CONFIG_PATHS, "+head_server.port=0")
    run.wait_ready()
    head = run.head_url
    run.send_signal(sig)
    code = run.wait_exit(HANG_BOUND_S)
    assert code == 0, f"exit code {code}\n{run.output}"
    assert f"received {sig.name}" in run.stdout
    assert "all servers stopped" in run.stdout
    _assert_nothing_left(run)
    with pytest.raises(httpx.HTTPError):
        httpx.get(head + "/", timeout=2, trust_env=False)


def test_children_die_when_ng_run_is_sigkilled(launch: Launcher) -> None:
    run = launch(EXAMPLE_CONFIG_PATHS, "+head_server.port=0")
    run.wait_ready()
    # Held as processes (pid + start time): a pid the kernel hands to an unrelated new process later (a
    # busy machine) is not taken for a survivor.
    servers = [psutil.Process(row["pid"]) for row in _instances(run).values()]
    run.send_signal(signal.SIGKILL)
    assert run.wait_exit(HANG_BOUND_S) == -signal.SIGKILL
    _assert_nothing_left(run)
    # A killed server may still be exiting (its memory torn down; slow on a busy machine): bounded wait.
    _, alive = psutil.wait_procs(servers, timeout=HANG_BOUND_S)
    for server in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            assert server.status() == psutil.STATUS_ZOMBIE, server


def test_server_crashing_at_startup(tmp_path: Path, launch: Launcher) -> None:
    write_server_folder(
        tmp_path,
        "resources_servers",
        "crashy_probe",
        'print("crashy: reading its config", flush=True)\nraise RuntimeError("boom at start-up")\n',
    )
    config = write_instance_config(tmp_path, "crashy", "resources_servers", "crashy_probe")
    run = launch(
        f"+config_paths=[{config},{REPO / SCRIPTED_MODEL_CONFIG}]", "+head_server.port=0", cwd=tmp_path
    )
    code = run.wait_exit(READY_WAIT_S)
    assert code == 1, f"exit code {code}\n{run.output}"
    err = run.stderr
    assert "start-up failed" in err
    assert "Server 'crashy'" in err and "during start-up" in err
    assert "last log lines of crashy" in err
    assert "crashy: reading its config" in err and "RuntimeError: boom at start-up" in err
    assert "servers ready" not in run.stdout
    _assert_nothing_left(run)


def test_startup_timeout_is_bounded(tmp_path: Path, launch: Launcher) -> None:
    write_server_folder(
        tmp_path,
        "resources_servers",
        "sleepy_probe",
        'import time\nprint("sleepy: never going to serve", flush=True)\ntime.sleep(600)\n',
    )
    config = write_instance_config(tmp_path, "sleepy", "resources_servers", "sleepy_probe")
    run = launch(
        f"+config_paths=[{config},{REPO / SCRIPTED_MODEL_CONFIG}]",
        "+head_server.port=0",
        "+startup_timeout_s=3",
        cwd=tmp_path,
    )
    code = run.wait_exit(READY_WAIT_S)
    assert code == 1, f"exit code {code}\n{run.output}"
    assert "Timed out after 3 s waiting for sleepy" in run.stderr
    assert "policy_model" not in run.stderr.split("waiting for", 1)[1].split("\n", 1)[0]
    assert "sleepy: never going to serve" in run.stderr
    _assert_nothing_left(run)


# ------------------------------------------------------------------------------------------------
# RunHelper from Python.


def test_run_helper_started_from_a_short_lived_thread() -> None:
    """Linux's parent-death signal fires when the forking *thread* exits; the servers must not care."""
    helper = RunHelper()
    errors: list[BaseException] = []

    def start() -> None:
        try:
            helper.start(
                GlobalConfigDictParserConfig(
                    initial_global_config_dict={
                        "config_paths": [EXAMPLE_CONFIG, SCRIPTED_MODEL_CONFIG],
                        "head_server": {"host": "127.0.0.1", "port": 0},
                    },
                    skip_load_from_cli=True,
                    skip_load_from_env_yaml=True,
                )
            )
        except BaseException as e:
            errors.append(e)

    try:
        t = threading.Thread(target=start)
        t.start()
        t.join(READY_WAIT_S)
        assert not t.is_alive() and not errors, errors
        # The starting thread is gone; give a parent-death signal time to act, then check.
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            assert helper.supervisor.dead_server() is None, helper.supervisor.describe_exit(
                helper.supervisor.dead_server()
            )
            time.sleep(0.1)
        for row in helper.server_instances():
            assert get_json(row["url"] + "/", token=helper.supervisor.auth_token) is not None
    finally:
        helper.shutdown()
    for child in helper.supervisor.children:
        assert child.process is not None and child.process.poll() is not None


def test_the_stop_flag_is_set_by_a_real_signal_and_wakes_a_waiting_main_thread() -> None:
    """ng_run's stop request (``StopFlag``) is set from a SIGINT handler without taking a lock
    (``threading.Event.set`` does: a signal landing while the main thread holds the event's lock
    deadlocked ng_run once in CI) and ends a ``wait`` in progress."""
    script = (
        "import os, signal, threading, time\n"
        "from nemo_gym.run.supervision.stop import StopFlag\n"
        "flag = StopFlag()\n"
        "signal.signal(signal.SIGINT, lambda *a: flag.set())\n"
        "threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
        "assert flag.wait(60) and flag.is_set()  # False only if the handler never set it\n"
        "print('woke')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "woke", done.stderr


def test_a_large_config_reaches_every_server_in_its_launch_file_not_its_environment() -> None:
    """A server's config and secrets come in a private file (nemo_gym.launch): a 4 MB value, past the
    kernel's limit on one environment variable (128 KiB), starts every server, and a process a server
    starts (a sandbox, a harness) gets a small environment. Before, an 80 KB value killed a sandboxed
    environment at start (``Argument list too long``) and 3.6 MB crashed ng_run."""
    from nemo_gym.tools.testing import running_servers, server_url

    big = "n" * 4_000_000
    with running_servers([EXAMPLE_CONFIG], {"operator_notes": big}) as helper:
        launch_dir = helper.supervisor._launch_files
        assert launch_dir is not None and launch_dir.is_dir()
        resp = post_json(server_url(helper, AGENT) + "/run", example_rows("example_single_tool_call")[0])
        assert resp.status_code == 200, resp.text[:500]
        for row in helper.server_instances():
            handed = yaml.safe_load(helper.supervisor.launch_values[row["name"]]["NEMO_GYM_CONFIG_DICT"])
            assert handed["operator_notes"] == big, row["name"]
            environ = psutil.Process(row["pid"]).environ()
            assert sum(len(k) + len(v) for k, v in environ.items()) < 64_000, row["name"]
            assert not Path(environ["NEMO_GYM_LAUNCH_FILE"]).exists()  # read by the server, then removed
        assert not any(launch_dir.iterdir())  # every server has read its file
    assert not launch_dir.exists()  # the run's launch directory goes at stop


def test_a_clean_stop_leaves_nothing_in_the_temp_dir() -> None:
    """Before: a server ended by ng_run's SIGTERM shut down gracefully, then died by the signal uvicorn
    raised again, so no exit handler ran and each sandboxed server left its ``nemo-gym-sessions-<pid>-*``
    dir (and pre-started sandboxes' dirs) behind. Now servers exit normally after the graceful stop."""
    import tempfile

    from nemo_gym.tools.testing import running_servers, server_url

    tmp = Path(tempfile.gettempdir())
    env = "math_with_code"
    with running_servers([f"resources_servers/{env}/configs/{env}.yaml"]) as helper:
        resp = post_json(
            server_url(helper, f"{env}_simple_agent") + "/run", example_rows(env)[0], timeout=120
        )
        assert resp.status_code == 200, resp.text[:500]
        pids = {row["name"]: row["pid"] for row in helper.server_instances()}
        made = sorted(tmp.glob(f"nemo-gym-sessions-{pids[env]}-*"))
        assert made  # the sandboxed server made its sessions dir
        launch_dir = helper.supervisor._launch_files
    codes = {c.name: c.process.returncode for c in helper.supervisor.children}
    assert codes == dict.fromkeys(pids, 0), codes  # ended normally, not by the signal
    for pid in pids.values():
        left = [
            p.name
            for p in tmp.iterdir()
            if f"-{pid}-" in p.name and p.name.lstrip(".").startswith("nemo-gym")
        ]
        assert not left, left
    assert launch_dir is not None and not launch_dir.exists()
