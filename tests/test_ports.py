"""Ports: assigned by the launcher before anything starts, never shared, busy ports a clear error."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from nemo_gym.config.ports import reserve_listening_socket
from nemo_gym.global_config import ConfigError
from nemo_gym.tools.testing import example_rows, post_json
from tests.conftest import EXAMPLE_CONFIG_PATHS, READY_WAIT_S, LaunchedProcess, Launcher, get_json

AGENT = "example_single_tool_call_simple_agent"


# ------------------------------------------------------------------------------------------------
# reserve_listening_socket


def test_free_port_socket_is_listening_and_inheritable() -> None:
    sock = reserve_listening_socket("127.0.0.1", None, "test")
    try:
        port = sock.getsockname()[1]
        assert port > 0 and sock.get_inheritable()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # accepted into the backlog: the port is listening before any server runs
    finally:
        sock.close()


def test_free_ports_are_distinct() -> None:
    socks = [reserve_listening_socket("127.0.0.1", 0, "test") for _ in range(50)]
    try:
        assert len({s.getsockname()[1] for s in socks}) == 50
    finally:
        for s in socks:
            s.close()


def test_auto_port_cannot_be_shared_even_with_reuseaddr() -> None:
    sock = reserve_listening_socket("127.0.0.1", 0, "test")
    port = sock.getsockname()[1]
    try:
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
    finally:
        sock.close()


def test_busy_explicit_port_is_a_config_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError) as err:
            reserve_listening_socket("127.0.0.1", port, "server 'x'")
    msg = str(err.value)
    assert f"127.0.0.1:{port}" in msg and "server 'x'" in msg and "Another process is using that port" in msg


def test_explicit_free_port_is_used() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sock = reserve_listening_socket("127.0.0.1", port, "test")
    try:
        assert sock.getsockname()[1] == port
    finally:
        sock.close()


def test_bad_host_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="Check the host address"):
        reserve_listening_socket("192.0.2.1", 0, "server 'x'")  # TEST-NET-1: not a local address


# ------------------------------------------------------------------------------------------------
# Through ng_run


def _ports(run: LaunchedProcess) -> list[int]:
    head_port = int(run.head_url.rsplit(":", 1)[1])
    return [head_port] + [
        row["port"] for row in get_json(run.head_url + "/server_instances", token=run.token)
    ]


def test_two_ng_runs_started_together_never_collide(launch: Launcher) -> None:
    runs = [launch(EXAMPLE_CONFIG_PATHS, "+head_server.port=0") for _ in range(2)]
    for run in runs:
        run.wait_ready(READY_WAIT_S)
    ports = _ports(runs[0]) + _ports(runs[1])
    assert len(ports) == 8 and len(set(ports)) == 8, ports
    row = example_rows("example_single_tool_call")[0]
    for run in runs:
        agent = next(
            r for r in get_json(run.head_url + "/server_instances", token=run.token) if r["name"] == AGENT
        )
        resp = post_json(agent["url"] + "/run", row, token=run.token)
        assert resp.status_code == 200, resp.text[:2000]
        assert "reward" in resp.json()


@pytest.mark.parametrize(
    "key, who",
    [
        (
            "example_single_tool_call.resources_servers.example_single_tool_call.port",
            "server 'example_single_tool_call'",
        ),
        ("head_server.port", "the head server"),
    ],
    ids=["server", "head"],
)
def test_busy_explicit_port_fails_before_anything_starts(
    key: str, who: str, tmp_path: Path, launch: Launcher
) -> None:
    log_dir = tmp_path / "logs"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        overrides = [EXAMPLE_CONFIG_PATHS, f"+log_dir={log_dir}", f"++{key}={port}"]
        if key != "head_server.port":
            overrides.append("+head_server.port=0")
        run = launch(*overrides)
        code = run.wait_exit(READY_WAIT_S)
    assert code == 2, f"exit code {code}\n{run.output}"
    assert f"127.0.0.1:{port}" in run.stderr and who in run.stderr, run.stderr
    assert "Traceback" not in run.output
    assert "servers ready" not in run.stdout
    assert not run.our_processes()
    # No server was ever spawned: spawning creates its log file.
    assert not log_dir.exists() or not list(log_dir.glob("*.log"))


def test_same_explicit_port_twice_in_one_config(launch: Launcher) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run = launch(
        EXAMPLE_CONFIG_PATHS,
        "+head_server.port=0",
        f"++example_single_tool_call.resources_servers.example_single_tool_call.port={port}",
        f"++policy_model.responses_api_models.scripted_model.port={port}",
    )
    code = run.wait_exit(READY_WAIT_S)
    assert code == 2, f"exit code {code}\n{run.output}"
    assert f"Port {port} is set for both server 'example_single_tool_call'" in run.stderr
    assert "server 'policy_model'" in run.stderr
    assert "servers ready" not in run.stdout and "Traceback" not in run.output


def _hold_port(port: int) -> socket.socket | None:
    """A listening socket on 127.0.0.1:``port``, or None when something else holds it already."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen()
    except OSError:
        sock.close()
        return None
    return sock


def test_busy_default_head_port_says_how_to_choose_another(tmp_path: Path, launch: Launcher) -> None:
    """Unset, the head server port is 11000 (where trainers and the collector look), not a free one."""
    holder = _hold_port(11000)  # None: busy already, which is what this test needs
    try:
        run = launch(EXAMPLE_CONFIG_PATHS, f"+log_dir={tmp_path / 'logs'}")
        code = run.wait_exit(READY_WAIT_S)
    finally:
        if holder is not None:
            holder.close()
    assert code == 2, f"exit code {code}\n{run.output}"
    err = run.stderr
    assert "127.0.0.1:11000" in err and "the default head server port" in err, err
    assert "leave it unset" not in err, err  # unset is what it is: the message must not suggest it
    assert "+head_server.port=0 picks one and prints it" in err, err
    assert "give ng_collect_rollouts, ng_status and trainers the same +head_server.port" in err, err
    assert "servers ready" not in run.stdout and "Traceback" not in run.output
    assert not (tmp_path / "logs").exists() and not run.our_processes()


def test_head_port_of_a_running_ng_run_is_named_as_such(launch: Launcher) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    first = launch(EXAMPLE_CONFIG_PATHS, f"+head_server.port={port}")
    first.wait_ready(READY_WAIT_S)
    second = launch(EXAMPLE_CONFIG_PATHS, f"+head_server.port={port}")
    assert second.wait_exit(READY_WAIT_S) == 2, second.output
    assert f"127.0.0.1:{port}" in second.stderr and "the head server port you set" in second.stderr
    assert "Another ng_run's head server answers there (see ng_status)" in second.stderr, second.stderr
