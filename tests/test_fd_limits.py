"""Open-file limits: reaching the limit means queueing, never "Too many open files".

* A server short of descriptors holds the connections that fit; the others wait in the listen
  backlog until places free up, also when ``accept()`` itself fails for lack of descriptors.
* A whole stack with every process started at a soft ``RLIMIT_NOFILE`` of 1,024 runs 16,384
  rollouts in flight, all successfully: on a machine whose hard limit is higher (each process
  raises its soft limit to it) and on one whose hard limit is 1,024 too (pools and accepted
  connections are sized from the budget left). Limits are set by ``preexec_fn`` in each launched
  child before it execs.
"""

from __future__ import annotations

import asyncio
import re
import resource
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import psutil
import pytest

from nemo_gym.tools.testing import example_rows
from tests.conftest import EXAMPLE_CONFIG_PATHS, EXAMPLE_INSTANCES, REPO, Launcher, get_json

MACHINE_HARD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
LOW = 1024 if MACHINE_HARD == resource.RLIM_INFINITY else min(1024, MACHINE_HARD)
IN_FLIGHT = 16_384
COLLECT_BOUND_S = 420.0  # a bound on a run that takes well under a minute when it works
AGENT = "example_single_tool_call_simple_agent"


def _nofile(soft: int, hard: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return apply


def _soft_limit(proc: psutil.Process) -> int:
    return proc.rlimit(psutil.RLIMIT_NOFILE)[0]


async def _requests_on_open_connections(port: int, n: int, bound_s: float) -> list[tuple[int, bool] | str]:
    """Open ``n`` connections at once, one ``GET /`` on each, every connection kept open until all are
    answered; returns (status, whether the response said ``Connection: close``) for each, or the
    error as text."""
    writers: list[asyncio.StreamWriter] = []

    async def one() -> tuple[int, bool]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writers.append(writer)
        writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"(?i)content-length: *(\d+)", head)
        await reader.readexactly(int(length.group(1)) if length else 0)
        return int(head.split(b" ", 2)[1]), re.search(rb"(?i)\r\nconnection: *close", head) is not None

    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(one() for _ in range(n)), return_exceptions=True), bound_s
        )
    finally:
        for writer in writers:
            writer.close()
    return [r if isinstance(r, tuple) else f"{type(r).__name__}: {r}" for r in results]


def test_a_server_queues_connections_beyond_its_descriptor_budget(launch: Launcher) -> None:
    # Servers with 256 descriptors in all; 1,000 clients connect at once and keep their connections
    # open. The server holds what fits and leaves the rest in the listen backlog until places free up.
    # (``server_auth``: the raw clients below carry no run token where runs have one. No places kept for
    # token bearers: this test's own client, 1,000 connections on one busy event loop, can take longer than
    # the eviction grace between its connect and its write, and would be closed as a silent client; that
    # eviction is tests/test_slow_clients.py's subject, the descriptor budget is this one's.)
    run = launch(
        EXAMPLE_CONFIG_PATHS,
        "+head_server.port=0",
        "+server_auth=false",
        "+reserved_connection_fraction=0",
        preexec_fn=_nofile(256, 256),
    )
    assert run.wait_ready() == len(EXAMPLE_INSTANCES)
    model = next(r for r in get_json(run.head_url + "/server_instances") if r["name"] == "policy_model")
    results = asyncio.run(_requests_on_open_connections(model["port"], 1000, 120.0))
    errors = [r for r in results if not isinstance(r, tuple) or r[0] != 200]
    assert errors == [], f"{len(errors)} of 1000 failed, e.g. {errors[:3]}\n{run.output[-3000:]}"
    # Fewer than 256 connections fit, and each kept-alive one stays open (the client holds it): so
    # the server served the others by answering "Connection: close" at its cap, freeing the place.
    closing = sum(1 for r in results if isinstance(r, tuple) and r[1])
    assert closing >= 1000 - 256, closing
    assert "Too many open files" not in run.output, run.output[-3000:]
    assert get_json(f"http://127.0.0.1:{model['port']}/")["status"] == "ok"


# A BoundedServer whose cap is far above what its descriptors allow, so accept() itself fails.
TINY_SERVER = textwrap.dedent("""
    import socket, sys
    import uvicorn
    from nemo_gym.server.accept_limit import BoundedServer

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=1)
    BoundedServer(config, max_accepted=100_000).run(sockets=[sock])
""")


def test_out_of_descriptors_in_accept_pauses_accepting_and_nothing_is_lost() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", TINY_SERVER],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_nofile(128, 128),
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        # 400 held-open connections against ~110 free descriptors: accept() fails with EMFILE; the
        # rest wait in the backlog and are served as idle connections time out (1 s keep-alive).
        results = asyncio.run(_requests_on_open_connections(port, 400, 120.0))
        errors = [r for r in results if not isinstance(r, tuple) or r[0] != 200]
        assert errors == [], f"{len(errors)} of 400 failed, e.g. {errors[:3]}"
        assert proc.poll() is None
    finally:
        proc.kill()
        _, stderr = proc.communicate(timeout=10)
    assert "accept() failed (Too many open files)" in stderr.decode(), stderr.decode()[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "hard, in_flight",
    [
        # With the hard limit kept, every process raises its soft limit to it: 16k in flight would only
        # repeat the case below with room to spare, so a few thousand show the raise (and save 2 minutes).
        pytest.param(MACHINE_HARD, 4_096, id="soft-1024-hard-kept"),
        pytest.param(LOW, IN_FLIGHT, id="hard-1024"),  # 16k in flight through 1,024 descriptors
    ],
)
def test_16k_rollouts_in_flight_under_a_1024_open_file_limit(
    launch: Launcher, tmp_path: Path, hard: int, in_flight: int
) -> None:
    limit = _nofile(LOW, hard)
    # What the soft limit is raised to: the hard limit (the kernel's cap when that is "unlimited").
    raised = hard if hard != resource.RLIM_INFINITY else int(Path("/proc/sys/fs/nr_open").read_text())
    run = launch(EXAMPLE_CONFIG_PATHS, "+head_server.port=0", preexec_fn=limit)
    assert run.wait_ready() == len(EXAMPLE_INSTANCES)
    head_port = run.head_url.rsplit(":", 1)[1]

    rows = example_rows("example_single_tool_call")
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"".join(orjson.dumps(rows[i % len(rows)]) + b"\n" for i in range(in_flight)))
    out = tmp_path / "out.jsonl"
    collector = launch(
        f"+agent_name={AGENT}",
        f"+input_jsonl_fpath={source}",
        f"+output_jsonl_fpath={out}",
        f"+num_samples_in_parallel={in_flight}",
        "+progress=false",
        f"+head_server.port={head_port}",
        cmd="ng_collect_rollouts",
        cwd=tmp_path,
        preexec_fn=limit,
    )
    # Every process of ours runs with its soft limit raised to the hard limit (read while they run).
    servers = run.our_processes()
    assert len(servers) == 1 + len(EXAMPLE_INSTANCES), servers
    assert all(_soft_limit(p) == raised for p in servers), [
        (p.cmdline(), p.rlimit(psutil.RLIMIT_NOFILE)) for p in servers
    ]
    collector_soft = None
    deadline = time.monotonic() + 30
    while collector_soft != raised and collector.proc.poll() is None and time.monotonic() < deadline:
        try:
            collector_soft = _soft_limit(psutil.Process(collector.proc.pid))
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    assert collector_soft == raised

    code = collector.wait_exit(COLLECT_BOUND_S)
    context = f"--- collector ---\n{collector.output[-4000:]}\n--- ng_run ---\n{run.output[-4000:]}"
    assert code == 0, f"exit {code}\n{context}"
    results = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert len(results) == in_flight, context
    assert sorted(r["_ng_task_index"] for r in results) == list(range(in_flight))
    # The scripted model is deterministic: every repeat of an example row earns that row's reward.
    by_row: dict[int, set[float]] = {}
    for r in results:
        by_row.setdefault(r["_ng_task_index"] % len(rows), set()).add(r["reward"])
    assert all(len(rewards) == 1 for rewards in by_row.values()) and len(by_row) == len(rows), by_row
    failures = tmp_path / "out_failures.jsonl"
    assert not failures.exists() or failures.read_bytes() == b"", failures.read_text()[:4000]
    assert "Too many open files" not in run.output + collector.output, context
    # Each server logged the limit it runs with.
    lines = run.output.splitlines()
    for name in EXAMPLE_INSTANCES:
        assert any(
            line.startswith(f"[{name}] ") and f"open-file limit {raised} " in line for line in lines
        ), context
    assert run.proc.poll() is None, "ng_run died under load"


def test_run_helper_starts_in_a_process_holding_more_than_1024_files() -> None:
    """A trainer process often holds thousands of descriptors; start-up must not use select(), which
    refuses descriptors >= 1024 ("filedescriptor out of range in select()")."""
    import os

    from nemo_gym.tools.testing import run_rollout, running_servers

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        assert max(held) >= 1024
        with running_servers(
            ["resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml"]
        ) as helper:
            row = example_rows("example_single_tool_call")[0]
            assert "reward" in run_rollout(helper, "example_single_tool_call_simple_agent", row)
    finally:
        for fd in held:
            os.close(fd)
