"""Ray tasks on a real 2-node Ray cluster started for this module on this machine (tests/ray_cluster.py):
verification (run_in_verify_pool) and sandboxed programs (sandbox: {run_on: ray}) run as Ray tasks on the
nodes, a run joins the cluster and leaves it running, and a node that is missing or killed is an
infrastructure failure, never a score.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from nemo_gym.kit.verify_pool import (
    VerifyTimeoutError,
    VerifyWorkerCrashedError,
    run_in_verify_pool,
    set_verify_ray_address,
)
from nemo_gym.tools.testing import get, run_rollout, running_servers, server_url
from tests.ray_cluster import (
    ENV_CONFIG,
    OBJECT_STORE_BYTES,
    SO_CONFIG,
    SO_RIGHT,
    json_row_with_marker,
    node_with,
    where,
)

ray = pytest.importorskip("ray", reason="the `ray` extra is not installed (pip install -e '.[ray]')")


def _raise_value_error(text: str) -> None:
    raise ValueError(text)


def _crash() -> None:
    os._exit(7)


async def test_verification_runs_as_ray_tasks_on_both_nodes(ray_driver: Any) -> None:
    import asyncio

    results = await asyncio.gather(*(run_in_verify_pool(where, 1.5, timeout=60) for _ in range(2)))
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    # Two 1-CPU tasks at once on two 1-CPU nodes: one on each node, in Ray workers, on their main threads.
    assert {r["node"] for r in results} == nodes
    assert all(r["main_thread"] and r["pid"] != os.getpid() for r in results)

    with pytest.raises(ValueError, match="bad answer"):
        await run_in_verify_pool(_raise_value_error, "bad answer", timeout=60)
    with pytest.raises(VerifyTimeoutError, match="ran past its 1 s timeout"):
        await run_in_verify_pool(where, 30.0, timeout=1)
    with pytest.raises(VerifyWorkerCrashedError, match="_crash"):
        await run_in_verify_pool(_crash, timeout=60)
    # The cluster still serves after a timeout and a crash.
    assert (await run_in_verify_pool(where, timeout=60))["node"] in nodes


@pytest.mark.slow
def test_run_helper_joins_the_cluster_and_leaves_it_running(ray_cluster: Any) -> None:
    assert not ray.is_initialized()
    extra = {"ray_head_node_address": ray_cluster.address}
    with running_servers([ENV_CONFIG], extra) as helper:
        connection = helper.supervisor.ray_connection
        assert connection is not None and not connection.started_local
        assert ray.is_initialized() and connection.gcs_address.endswith(
            ray_cluster.address.rpartition(":")[2]
        )
        assert len(connection.nodes()) == 2
        # Every server (and every outside client) is told the cluster's address.
        head = f"http://127.0.0.1:{helper.head_server_config.port}"
        served = yaml.safe_load(get(head + "/global_config_dict_yaml").text)
        assert served["ray_head_node_address"] == connection.gcs_address
        row = {
            "responses_create_params": {"input": [{"role": "user", "content": "weather in Paris?"}]},
            "expected_city": "Paris",
        }
        agent = "example_single_tool_call_simple_agent"
        assert server_url(helper, agent)
        result = run_rollout(helper, agent, row)
        assert "reward" in result
    assert not ray.is_initialized()  # disconnected ...
    ray.init(address=ray_cluster.address, log_to_driver=False)  # ... and the cluster still runs
    try:
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    finally:
        ray.shutdown()


SO_WRONG = '{"title": "The Left Hand of Darkness", "author": "Ursula K. Le Guin", "year": "1969"}'


# A resources server of the user's that declares NeMo Gym 0.7's ``ray_enabled = False``: it never uses the
# run's cluster, so its run_in_verify_pool runs in its local pool; the answer says which process ran it.
LOCAL_POOL_APP = """\
import os

from nemo_gym.base_resources_server import BaseResourcesServerConfig, BaseVerifyRequest, BaseVerifyResponse
from nemo_gym.base_resources_server import SimpleResourcesServer
from nemo_gym.kit.verify_pool import run_in_verify_pool


class LocalPoolConfig(BaseResourcesServerConfig):
    pass


class LocalPoolResponse(BaseVerifyResponse):
    verified_in_pid: int


class LocalPoolServer(SimpleResourcesServer):
    ray_enabled = False
    config: LocalPoolConfig

    async def verify(self, body: BaseVerifyRequest) -> LocalPoolResponse:
        pid = await run_in_verify_pool(os.getpid, timeout=60)
        return LocalPoolResponse(**body.model_dump(), reward=1.0, verified_in_pid=pid)


if __name__ == "__main__":
    LocalPoolServer.run_webserver()
"""
LOCAL_POOL_CONFIG = """\
local_pool:
  resources_servers:
    local_pool:
      entrypoint: app.py
local_pool_agent:
  responses_api_agents:
    simple_agent:
      entrypoint: app.py
      resources_server: {type: resources_servers, name: local_pool}
      model_server: {type: responses_api_models, name: policy_model}
"""


@pytest.mark.slow
def test_servers_of_a_run_verify_as_ray_tasks_on_the_cluster(ray_cluster: Any, tmp_path: Path) -> None:
    """ng_run hands the cluster's address to every server; a server's run_in_verify_pool then runs on
    the cluster (no local pool worker is started) and rewards are the same as locally. A server class
    that sets ``ray_enabled = False`` keeps its verification in its local pool in the same run."""
    from nemo_gym.tools.testing import collect_rollouts, example_rows

    work = tmp_path / "work"
    (work / "resources_servers" / "local_pool").mkdir(parents=True)
    (work / "resources_servers" / "local_pool" / "app.py").write_text(LOCAL_POOL_APP)
    (work / "local_pool.yaml").write_text(LOCAL_POOL_CONFIG)
    row = example_rows("structured_outputs")[0]
    wrong = json_row_with_marker(row, "[wrong]")
    rules = [
        {"contains": "[wrong]", "turns": [{"text": SO_WRONG}]},
        {"contains": "Le Guin", "turns": [{"text": SO_RIGHT}]},
        {"contains": "local pool", "turns": [{"text": "done"}]},
    ]
    extra = {
        "ray_head_node_address": ray_cluster.address,
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": rules}}},
        "structured_outputs": {"resources_servers": {"structured_outputs": {"pool_threshold_chars": 0}}},
    }
    cwd = os.getcwd()
    os.chdir(work)  # the user's folder is found in the working directory
    try:
        with running_servers([SO_CONFIG, str(work / "local_pool.yaml")], extra) as helper:
            code, out, err = collect_rollouts(
                helper, [row, wrong], tmp_path / "so", "structured_outputs_simple_agent"
            )
            assert code == 0, err[-3000:]
            assert [r["reward"] for r in out] == [1.0, 0.0]
            assert out[1]["error_type"] == "validation_error"
            pids = {r["name"]: r["pid"] for r in helper.server_instances()}
            # The local verify pool would have started worker processes under the server: there are none.
            assert psutil.Process(pids["structured_outputs"]).children(recursive=True) == []
            local_row = {"responses_create_params": {"input": "verify in the local pool"}}
            code, out, err = collect_rollouts(helper, [local_row], tmp_path / "local", "local_pool_agent")
            assert code == 0 and out[0]["reward"] == 1.0, err[-3000:]
            workers = {p.pid for p in psutil.Process(pids["local_pool"]).children(recursive=True)}
            assert out[0]["verified_in_pid"] in workers, (out[0]["verified_in_pid"], workers)
    finally:
        os.chdir(cwd)


# ------------------------------------------------------------------------------------------------
# Sandboxed programs as Ray tasks (sandbox: {run_on: ray}).

SANDBOX_PROGRAM = """
import os, sys
data = sys.stdin.read()
print("got", data.strip(), open("in.txt").read().strip())
open("out.txt", "w").write("answer=" + str(sum(int(x) for x in data.split())))
os.remove("gone.txt")
os.symlink("/etc/passwd", "link.txt")
"""


async def test_sandbox_runs_programs_as_ray_tasks_on_the_pinned_node(ray_driver: Any) -> None:
    """An AsyncSandbox with run_on: ray runs each program under bubblewrap on the node its custom
    resource pins it to; files and stdin travel with the task, and what the program wrote (and
    deleted) is back in the local work dir afterwards; symlinks are never sent back."""
    from nemo_gym.sandbox import AsyncSandbox, SandboxSpec
    from nemo_gym.sandbox.ray_exec import node_counts

    before = node_counts()
    provider = {"run_on": "ray", "ray_resources": {"node_b": 1}}
    spec = SandboxSpec(files={"prog.py": SANDBOX_PROGRAM, "in.txt": "hello", "gone.txt": "x"})
    async with AsyncSandbox(provider=provider, spec=spec) as sandbox:
        run = await sandbox.exec(["python3", "-I", "prog.py"], stdin="20 22\n")
        assert run.ok and run.stdout == "got 20 22 hello\n", run
        assert (await sandbox.read_file("out.txt")) == b"answer=42"
        assert sorted(p.name for p in sandbox.host_workdir.iterdir()) == ["in.txt", "out.txt", "prog.py"]
        # Files persist between programs, as in a local sandbox; a failing program is its own outcome.
        again = await sandbox.exec(
            ["python3", "-I", "-c", "print(open('out.txt').read()); raise SystemExit(3)"]
        )
        assert again.stdout == "answer=42\n" and again.return_code == 3 and again.error_type is None
        # The same limits apply on the node: past the wall-clock limit the program is killed.
        slow = await sandbox.exec(["python3", "-I", "-c", "import time; time.sleep(30)"], timeout_s=1)
        assert slow.timed_out and slow.error_type == "timeout"
    after = node_counts()
    ran = {node: after[node] - before.get(node, 0) for node in after if after[node] != before.get(node, 0)}
    assert ran == {node_with("node_b"): 3}, ran
    # Nothing is left in the Ray workers: no sandbox started ahead for a next task that may never come.
    deadline = time.monotonic() + 10
    node_b = next(n for n in ray_driver.worker_nodes if n.node_id == node_with("node_b"))
    raylet_b = psutil.Process(next(p.pid for name, p in node_b.live_processes() if name == "raylet"))
    while (left := [p.pid for p in raylet_b.children(recursive=True) if p.name() == "bwrap"]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert not left, "a Ray task left sandbox processes behind in its worker"


async def test_sandbox_on_ray_refuses_what_it_cannot_send_and_needs_a_cluster(ray_driver: Any) -> None:
    from nemo_gym.sandbox import (
        AsyncSandbox,
        SandboxError,
        SandboxSpec,
        SandboxUnavailableError,
        check_sandbox_available,
    )

    spec = SandboxSpec(files={"big.bin": b"\0" * (2 * 2**20)})
    async with AsyncSandbox(provider={"run_on": "ray", "ray_max_payload_mib": 1}, spec=spec) as sandbox:
        with pytest.raises(SandboxError, match=r"ray_max_payload_mib=1 MiB .*big\.bin"):
            await sandbox.exec(["true"])
    set_verify_ray_address("")  # this process has no cluster now
    with pytest.raises(SandboxUnavailableError, match="no Ray cluster"):
        check_sandbox_available({"run_on": "ray"})
    check_sandbox_available({"run_on": "auto"})  # auto: the local bubblewrap, which is installed


async def test_sandbox_on_a_node_without_bwrap_or_a_dead_node_is_an_infrastructure_failure(
    ray_driver: Any,
) -> None:
    """node_c runs without bubblewrap on its PATH: a program pinned there fails with the node's
    SandboxUnavailableError. A program running there when the node is killed fails as SandboxError:
    never as a program outcome. (A node that is gone altogether: the code_gen test below.)"""
    import asyncio

    from nemo_gym.sandbox import AsyncSandbox, SandboxError, SandboxSpec, SandboxUnavailableError

    ray_cluster = ray_driver
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", str(Path(sys.executable).parent))  # the venv's bin: python, no bwrap
        node_c = ray_cluster.add_node(
            num_cpus=1,
            object_store_memory=OBJECT_STORE_BYTES,
            include_dashboard=False,
            resources={"node_c": 1},
        )
    try:
        ray_cluster.wait_for_nodes(timeout=60)
        pinned = {"run_on": "ray", "ray_resources": {"node_c": 1}}
        async with AsyncSandbox(provider=pinned, spec=SandboxSpec(files={"a.py": "print(1)"})) as sandbox:
            with pytest.raises(SandboxUnavailableError, match="install the Debian package `bubblewrap`"):
                await sandbox.exec(["python3", "-I", "a.py"])
        # The unsafe backend needs no bwrap: a program that runs until its node is killed.
        unsafe = {**pinned, "backend": "unsafe_local_subprocess"}
        spec = SandboxSpec(resources={"wall_time_s": 120, "cpu_time_s": 120})
        async with AsyncSandbox(provider=unsafe, spec=spec) as sandbox:
            running = asyncio.ensure_future(
                sandbox.exec([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(100)"])
            )
            await asyncio.sleep(4)
            assert not running.done()
            await asyncio.to_thread(ray_cluster.remove_node, node_c, False)
            node_c = None
            with pytest.raises(SandboxError, match="Ray task failed"):
                await asyncio.wait_for(running, 60)
    finally:
        if node_c is not None:
            ray_cluster.remove_node(node_c)


CODE_GEN_CONFIG = "resources_servers/code_gen/configs/code_gen.yaml"


def _code_gen_extra(
    address: str, sandbox: dict[str, Any], **block: Any
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows 0 of code_gen, right (slowed a little, so its programs can be watched) and tagged [wrong]."""
    from nemo_gym.tools.testing import example_rows

    row = example_rows("code_gen")[0]
    wrong = json_row_with_marker(row, "[wrong]")
    right_code = "import time\ntime.sleep(0.5)\na, b = map(int, input().split())\nprint(a + b)"
    wrong_code = "a, b = map(int, input().split())\nprint(a - b)"
    rules = [
        {"contains": "[wrong]", "turns": [{"text": f"```python\n{wrong_code}\n```"}]},
        {"contains": "print their sum", "turns": [{"text": f"```python\n{right_code}\n```"}]},
    ]
    extra = {
        "ray_head_node_address": address,
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": rules}}},
        "code_gen": {"resources_servers": {"code_gen": {"sandbox": sandbox, **block}}},
    }
    return [row, wrong], extra


@pytest.mark.slow
def test_code_gen_runs_its_programs_on_the_other_node_and_a_missing_node_is_not_a_zero(
    ray_cluster: Any, tmp_path: Path
) -> None:
    """code_gen with sandbox.run_on: ray pinned to node_b: every unit-test program runs under bwrap
    started by a Ray worker of node_b's raylet (never by the code_gen server), right and wrong programs
    score 1 and 0. Pinned to a node no live machine offers, the rows are infrastructure failures in the
    sidecar, not rewards of 0."""
    from nemo_gym.tools.testing import collect_rollouts

    rows, extra = _code_gen_extra(ray_cluster.address, {"run_on": "ray", "ray_resources": {"node_b": 1}})
    with running_servers([CODE_GEN_CONFIG], extra) as helper:
        node_b = next(n for n in ray_cluster.worker_nodes if n.node_id == node_with("node_b"))
        raylet_b = next(p.pid for name, p in node_b.live_processes() if name == "raylet")
        server_pid = next(r["pid"] for r in helper.server_instances() if r["name"] == "code_gen")
        seen: list[set[int]] = []
        stop = threading.Event()

        def watch() -> None:  # the ancestors of every bwrap process this test started (others run tests too)
            while not stop.is_set():
                for proc in psutil.process_iter(["name"]):
                    if proc.info["name"] == "bwrap":
                        try:
                            ancestors = {p.pid for p in proc.parents()}
                        except psutil.Error:
                            continue
                        if os.getpid() in ancestors:
                            seen.append(ancestors)
                time.sleep(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            code, out, err = collect_rollouts(helper, rows, tmp_path / "b", "code_gen_simple_agent")
        finally:
            stop.set()
            watcher.join(timeout=10)
        assert code == 0, err[-3000:]
        assert [r["reward"] for r in out] == [1.0, 0.0], out
        assert out[1]["failure_reason"] == "wrong_answer"
        # Other tests of this process may hold idle pre-started sandboxes of their own: look only at
        # bwrap processes under this run's server or under one of the cluster's raylets.
        raylets = {
            p.pid
            for node in ray_cluster.worker_nodes
            for name, p in node.live_processes()
            if name == "raylet"
        } | {p.pid for name, p in ray_cluster.head_node.live_processes() if name == "raylet"}
        on_b = [a for a in seen if raylet_b in a]
        assert on_b, "no sandboxed program was seen running on node_b"
        assert not [a for a in seen if server_pid in a], "a program ran under the code_gen server itself"
        assert not [a for a in seen if (a & raylets) - {raylet_b}], "a program ran on another node"

    rows, extra = _code_gen_extra(
        ray_cluster.address,
        {"run_on": "ray", "ray_resources": {"node_z": 1}, "queue_timeout_s": 1},
        unit_test_timeout_secs=1,
    )
    with running_servers([CODE_GEN_CONFIG], extra) as helper:
        code, out, err = collect_rollouts(helper, rows, tmp_path / "z", "code_gen_simple_agent")
        assert code != 0 and out == [], (code, out, err[-2000:])
        failures = [
            yaml.safe_load(line)
            for line in (tmp_path / "z" / "output_failures.jsonl").read_text().splitlines()
        ]
        assert len(failures) == 2, failures
        assert all("no node of the Ray cluster ran the program" in str(f) for f in failures), failures
