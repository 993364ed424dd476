"""The fork server (``nemo_gym.run.zygote``): servers forked from one process that imported the web stack.

Real ``ng_run`` and ``RunHelper`` runs of the README's example (the scripted model), real processes and
real HTTP: the servers are forked (the ``forked`` mark of the start-up trace) yet are the launcher's
children, shown as ``python app.py``, and answer; one server's secret is in its own environment only,
never in another server's nor in the (single-threaded) zygote's (``/proc/<pid>/environ``); a SIGKILLed
launcher takes the zygote and the servers with it; a run started again after a server crash forks its servers again; a server
with its own venv is spawned as before; ``+fork_server=false`` forks nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
import pytest

from nemo_gym.config.keys import NEMO_GYM_STARTUP_TRACE_ENV_VAR_NAME
from nemo_gym.run.server_venvs import READY_MARKER, venv_dir_for
from nemo_gym.run.supervision.spawning import keep_fork_servers, kept_fork_server
from nemo_gym.run.zygote import ForkedChild, Zygote, wanted_by_argv
from nemo_gym.tools.testing import example_rows, post_json, running_servers, server_url
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

ENV = "example_single_tool_call"
AGENT = "example_single_tool_call_simple_agent"
MODEL = "policy_model"
SECRET_VAR = "ZYGOTE_PROBE_API_KEY"  # secret-looking: only a server whose pass_env names it gets it
SECRET = f"sk-zygote-probe-{uuid.uuid4().hex[:12]}"


def _marks(trace: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in trace.read_bytes().splitlines() if line.strip()]


def _forked_pids(trace: Path) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for mark in _marks(trace):
        if mark["event"] == "forked":
            out.setdefault(mark["server"], set()).add(mark["pid"])
    return out


def _zygotes(pid: int) -> list[psutil.Process]:
    """The fork servers among the descendants of ``pid``."""
    found = []
    for proc in psutil.Process(pid).children(recursive=True):
        try:
            if any("nemo_gym.run.zygote" in part for part in proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _environ(pid: int) -> dict[str, str]:
    """The environment of a process as the kernel shows it."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw.split(b"\0") if item)


def _assert_rollout(resp: httpx.Response) -> None:
    """A rollout through all three servers: the scripted model's default turn calls get_weather with the
    placeholder city "example", the environment answers for it, and the verifier scores the final
    text, which names no expected city, 0.0."""
    assert resp.status_code == 200, resp.text[:2000]
    body = resp.json()
    call, result, message = body["response"]["output"]
    assert (call["name"], orjson.loads(call["arguments"])) == ("get_weather", {"city": "example"})
    assert orjson.loads(result["output"])["city"] == "example"
    assert message["content"][0]["text"].startswith("The tool returned:")
    assert body["reward"] == 0.0


def _rows(run: LaunchedProcess) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in get_json(run.head_url + "/server_instances", token=run.token)}


# ------------------------------------------------------------------------------------------------
# One ng_run of the example, its model server given a secret by pass_env.


@pytest.fixture(scope="module")
def forked_run(
    launch_module: Launcher, tmp_path_factory: pytest.TempPathFactory
) -> tuple[LaunchedProcess, Path]:
    trace = tmp_path_factory.mktemp("zygote") / "trace.jsonl"
    run = launch_module(
        EXAMPLE_CONFIG_PATHS,
        "+head_server.port=0",
        f"++{MODEL}.responses_api_models.scripted_model.pass_env=[{SECRET_VAR}]",
        env={SECRET_VAR: SECRET, NEMO_GYM_STARTUP_TRACE_ENV_VAR_NAME: str(trace)},
    )
    assert run.wait_ready() == 3
    return run, trace


def test_the_servers_are_forked_and_answer(forked_run: tuple[LaunchedProcess, Path]) -> None:
    run, trace = forked_run
    rows = _rows(run)
    assert set(rows) == set(EXAMPLE_INSTANCES)
    marks = [m for m in _marks(trace) if m["server"] == "zygote"]
    assert [m["event"] for m in marks] == ["zygote_started", "zygote_preloaded"]
    # Once every server is started the zygote has done its work: it is gone, and nothing depends on it.
    assert not _zygotes(run.proc.pid)
    assert not psutil.pid_exists(marks[0]["pid"]) or psutil.Process(marks[0]["pid"]).ppid() != run.proc.pid
    forked = _forked_pids(trace)
    for name, row in rows.items():
        assert forked.get(name) == {row["pid"]}, f"{name} was not forked: {forked}"
        server = psutil.Process(row["pid"])
        # Re-parented to the launcher, in a process group of its own, shown as `python app.py`.
        assert server.ppid() == run.proc.pid and os.getpgid(row["pid"]) == row["pid"], name
        assert server.cwd() == str(REPO)
        script = str(REPO / row["server_type"] / row["impl"] / "app.py")
        assert server.cmdline()[1:] == [script], server.cmdline()
    _assert_rollout(post_json(rows[AGENT]["url"] + "/run", example_rows(ENV)[0], token=run.token))


def test_a_servers_secret_is_in_its_own_environment_only(forked_run: tuple[LaunchedProcess, Path]) -> None:
    run, _ = forked_run
    rows = _rows(run)
    model_env = _environ(rows[MODEL]["pid"])
    assert model_env[SECRET_VAR] == SECRET  # named in its pass_env, given after the fork
    assert run.token not in "\0".join(model_env.values())  # the run's secrets are in its launch file
    for name in (AGENT, ENV):
        env = _environ(rows[name]["pid"])
        whole = "\0".join(f"{k}={v}" for k, v in env.items())
        assert SECRET not in whole and SECRET_VAR not in env, name
        assert env["NEMO_GYM_CONFIG_PATH"] == name and "NEMO_GYM_CONFIG_DICT" not in env
        assert not Path(env["NEMO_GYM_LAUNCH_FILE"]).exists()  # read by the server, then removed


PROBE_SCRIPT = """
import os, sys, time
print("probe", os.environ.get("ZYGOTE_PROBE_API_KEY"), sys.argv[0] == __file__, sys.path[0], flush=True)
time.sleep(60)
"""


def test_the_zygote_holds_no_secret_and_each_forked_process_only_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes forked from one zygote, each given its own secret after the fork: the zygote's
    environment (single-threaded, started without the launcher's secret variables) holds neither."""
    monkeypatch.setenv(SECRET_VAR, SECRET)  # the launcher's: not passed to the zygote
    script = tmp_path / "probe.py"
    script.write_text(PROBE_SCRIPT)
    zygote = Zygote.start(str(tmp_path))
    children: list[ForkedChild] = []
    try:
        secrets = [f"sk-first-{uuid.uuid4().hex}", f"sk-second-{uuid.uuid4().hex}"]
        for i, secret in enumerate(secrets):
            env = {**zygote.env, SECRET_VAR: secret}
            assert zygote.compatible(sys.executable, env, str(tmp_path))
            children.append(zygote.spawn(str(script), str(tmp_path), env, (), lambda _n: {}, f"probe{i}", 60))
        zygote_proc = psutil.Process(zygote.pid)
        assert zygote_proc.num_threads() == 1 and zygote_proc.ppid() == os.getpid()
        zygote_env = "\0".join(f"{k}={v}" for k, v in _environ(zygote.pid).items())
        assert SECRET not in zygote_env and not any(s in zygote_env for s in secrets)
        for child, secret, other in zip(children, secrets, reversed(secrets), strict=True):
            assert child.stdout is not None
            line = child.stdout.readline().decode()
            assert line == f"probe {secret} True {tmp_path}\n", line
            env = _environ(child.pid)
            assert env[SECRET_VAR] == secret and other not in "\0".join(env.values())
            assert psutil.Process(child.pid).ppid() == os.getpid()  # this process's child, not the zygote's
            assert psutil.Process(child.pid).cmdline() == [sys.executable, str(script)]
        for child in children:
            os.kill(child.pid, signal.SIGKILL)
            assert child.wait(timeout=HANG_BOUND_S) == -signal.SIGKILL
    finally:
        for child in children:
            if child.poll() is None:
                os.kill(child.pid, signal.SIGKILL)
                child.wait(timeout=HANG_BOUND_S)
        zygote.stop()
    assert zygote.process is not None and zygote.process.returncode is not None


# ------------------------------------------------------------------------------------------------
# Stopping and starting again.


def test_a_sigkilled_launcher_takes_the_zygote_and_the_servers_with_it(
    tmp_path: Path, launch: Launcher
) -> None:
    trace = tmp_path / "trace.jsonl"
    run = launch(
        EXAMPLE_CONFIG_PATHS, "+head_server.port=0", env={NEMO_GYM_STARTUP_TRACE_ENV_VAR_NAME: str(trace)}
    )
    # Killed while the zygote imports (it is alive then), and again once the servers run.
    deadline = time.monotonic() + READY_WAIT_S
    while not (trace.exists() and any(m["event"] == "zygote_started" for m in _marks(trace))):
        assert time.monotonic() < deadline and run.proc.poll() is None, run.output
        time.sleep(0.01)
    (zygote,) = _zygotes(run.proc.pid)
    run.send_signal(signal.SIGKILL)
    assert run.wait_exit(HANG_BOUND_S) == -signal.SIGKILL
    left = run.wait_no_processes(HANG_BOUND_S)
    assert not left, [(p.pid, p.cmdline()) for p in left]
    assert not zygote.is_running() or zygote.status() == psutil.STATUS_ZOMBIE

    run = launch(EXAMPLE_CONFIG_PATHS, "+head_server.port=0")
    run.wait_ready()
    servers = [psutil.Process(row["pid"]) for row in _rows(run).values()]
    run.send_signal(signal.SIGKILL)
    assert run.wait_exit(HANG_BOUND_S) == -signal.SIGKILL
    left = run.wait_no_processes(HANG_BOUND_S)
    assert not left, [(p.pid, p.cmdline()) for p in left]
    # Each server ends on its parent-death signal, through its graceful shutdown: a bounded wait for that,
    # not an instant look (on a busy machine the shutdown takes a moment).
    _, alive = psutil.wait_procs(servers, timeout=HANG_BOUND_S)
    assert all(p.status() == psutil.STATUS_ZOMBIE for p in alive if p.is_running()), alive


def test_a_run_started_again_after_a_server_crash_forks_its_servers_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv(NEMO_GYM_STARTUP_TRACE_ENV_VAR_NAME, str(trace))
    with running_servers([EXAMPLE_CONFIG]) as helper:
        assert all(isinstance(c.process, ForkedChild) for c in helper.supervisor.children)
        victim = next(c for c in helper.supervisor.children if c.name == "example_single_tool_call")
        os.kill(victim.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + HANG_BOUND_S
        while helper.supervisor.dead_server() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match=r"Server 'example_single_tool_call'.*SIGKILL"):
            helper.poll()
    assert victim.process.poll() == -signal.SIGKILL
    first = _forked_pids(trace)
    with running_servers([EXAMPLE_CONFIG]) as helper:
        rows = {r["name"]: r for r in helper.server_instances()}
        forked = _forked_pids(trace)
        for name, row in rows.items():
            assert row["pid"] in forked[name] - first[name], name
            assert psutil.Process(row["pid"]).ppid() == os.getpid()
        _assert_rollout(post_json(rows[AGENT]["url"] + "/run", example_rows(ENV)[0]))
    for child in helper.supervisor.children:
        assert child.process is not None and child.process.poll() is not None


def test_a_kept_fork_server_serves_run_after_run_and_stops_when_no_longer_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """keep_fork_servers(True) (the suite's plugin turns it on): one fork server forks the servers of
    every run of this process; off, each run's own fork server stops once its servers are started."""
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv(NEMO_GYM_STARTUP_TRACE_ENV_VAR_NAME, str(trace))
    keep_fork_servers(True)
    try:
        pids = []
        for _ in range(2):
            with running_servers([EXAMPLE_CONFIG]) as helper:
                root = os.path.realpath(helper.supervisor.loaded.root_dir)
                kept = kept_fork_server(root)
                assert kept is not None and kept.pid is not None
                pids.append(kept.pid)
                rows = {r["name"]: r for r in helper.server_instances()}
                forked = _forked_pids(trace)
                assert all(row["pid"] in forked[name] for name, row in rows.items()), (rows, forked)
                _assert_rollout(post_json(rows[AGENT]["url"] + "/run", example_rows(ENV)[0]))
            # The run is over; the fork server is not.
            assert psutil.Process(pids[-1]).status() != psutil.STATUS_ZOMBIE
        assert pids[0] == pids[1]
        # Replaced, and every server still forked, when it died, or when this process's environment no longer
        # starts servers as it would (a test that sets PYTHONPATH for its module, as tests/test_ray.py does).
        os.kill(pids[0], signal.SIGKILL)
        with running_servers([EXAMPLE_CONFIG]) as helper:
            assert all(isinstance(c.process, ForkedChild) for c in helper.supervisor.children)
            replaced = kept_fork_server(root)
            assert replaced is not None and replaced.pid not in pids
        pids.append(replaced.pid)
        monkeypatch.setenv(
            "PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
        )
        with running_servers([EXAMPLE_CONFIG]) as helper:
            assert all(isinstance(c.process, ForkedChild) for c in helper.supervisor.children)
            again = kept_fork_server(root)
            assert again is not None and again.pid not in pids
            _assert_rollout(post_json(server_url(helper, AGENT) + "/run", example_rows(ENV)[0]))
        assert not psutil.pid_exists(pids[-1]) or psutil.Process(pids[-1]).status() == psutil.STATUS_ZOMBIE
        pids.append(again.pid)
        keep_fork_servers(False)
        assert kept_fork_server(root) is None
        assert not psutil.pid_exists(pids[-1]) or psutil.Process(pids[-1]).status() == psutil.STATUS_ZOMBIE
        with running_servers([EXAMPLE_CONFIG]) as helper:
            assert all(isinstance(c.process, ForkedChild) for c in helper.supervisor.children)
            assert _zygotes(os.getpid()) == []  # its own fork server, stopped once the servers started
    finally:
        keep_fork_servers(True)


# ------------------------------------------------------------------------------------------------
# Who is not forked.


def test_a_server_with_its_own_venv_is_spawned_and_the_others_forked(
    tmp_path: Path, launch: Launcher
) -> None:
    folder = write_server_folder(
        tmp_path, "resources_servers", "venv_probe", simple_resources_app(), requirements="orjson\n"
    )
    config = write_instance_config(tmp_path, "venvprobe", "resources_servers", "venv_probe")
    cache = tmp_path / "venv-cache"
    venv_dir = venv_dir_for(folder, cache)
    assert venv_dir is not None
    # A venv taken as built: the launcher's interpreter under another path, as a real venv's is.
    (venv_dir / "bin").mkdir(parents=True)
    (venv_dir / "bin" / "python").symlink_to(sys.executable)
    (venv_dir / "pyvenv.cfg").write_text((Path(sys.prefix) / "pyvenv.cfg").read_text())
    site = venv_dir / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    site.mkdir(parents=True)
    # The launcher's packages, and this repository (an editable install's finder in the launcher's
    # site-packages is a .pth there, which a path added by a .pth does not run).
    paths = [str(REPO), *(p for p in sys.path if p.endswith("site-packages"))]
    (site / "launcher.pth").write_text("".join(f"{p}\n" for p in paths))
    (venv_dir / READY_MARKER).write_text("ready\n")
    trace = tmp_path / "trace.jsonl"
    run = launch(
        f"+config_paths=[{config},{REPO / SCRIPTED_MODEL_CONFIG}]",
        "+head_server.port=0",
        "+isolate_server_venvs=true",
        f"+venv_cache_dir={cache}",
        cwd=tmp_path,
        env={NEMO_GYM_STARTUP_TRACE_ENV_VAR_NAME: str(trace)},
    )
    run.wait_ready()
    rows = _rows(run)
    forked = _forked_pids(trace)
    assert "venvprobe" not in forked and forked[MODEL] == {rows[MODEL]["pid"]}
    probe = psutil.Process(rows["venvprobe"]["pid"])
    assert probe.cmdline()[0] == str(venv_dir / "bin" / "python") and probe.ppid() == run.proc.pid
    info = get_json(rows["venvprobe"]["url"] + "/env_info", token=run.token)
    assert Path(info["prefix"]) == venv_dir
    run.send_signal(signal.SIGINT)
    assert run.wait_exit(READY_WAIT_S) == 0, run.output


def test_fork_server_false_forks_nothing(tmp_path: Path, launch: Launcher) -> None:
    trace = tmp_path / "trace.jsonl"
    run = launch(
        EXAMPLE_CONFIG_PATHS,
        "+head_server.port=0",
        "+fork_server=false",
        env={NEMO_GYM_STARTUP_TRACE_ENV_VAR_NAME: str(trace)},
    )
    assert run.wait_ready() == 3
    assert not _zygotes(run.proc.pid)
    assert not _forked_pids(trace)
    for name, row in _rows(run).items():
        cmdline = psutil.Process(row["pid"]).cmdline()
        assert Path(cmdline[0]).name.startswith("python") and cmdline[1].endswith("/app.py"), (name, cmdline)
        assert get_json(row["url"] + "/", token=run.token) is not None
    run.send_signal(signal.SIGINT)
    assert run.wait_exit(READY_WAIT_S) == 0, run.output


def test_the_command_line_switch_is_read_before_the_config() -> None:
    assert wanted_by_argv(["+config_paths=[a.yaml]"])
    assert not wanted_by_argv(["+fork_server=false"]) and not wanted_by_argv(["++fork_server=0"])
    assert wanted_by_argv(["+fork_server=true"]) and wanted_by_argv(["+fork_server_x=false"])
