"""NeMo Gym inside a trainer's Ray cluster, started the way NeMo RL starts it (docs/trainers.md, "(b)").

What happens, in order:

1. The "trainer" (this script) starts a private local Ray cluster, as a trainer owns its cluster:
   ``ray.init(num_cpus=..., object_store_memory=<capped>, include_dashboard=False)`` with
   ``RAY_TMPDIR`` (a fresh private directory), ``RAY_USAGE_STATS_ENABLED=0`` and
   ``RAY_AUTH_MODE=disabled`` set first.
2. As NeMo RL's ``NemoGym`` environment does, a Ray actor (:class:`GymEnvironment`) builds the initial
   config (``config_paths``, ``policy_model_name`` / ``policy_api_key`` / ``policy_base_url``,
   ``default_host``, ``port_range_low`` / ``port_range_high``, the client pool limits,
   ``head_server: {host: 0.0.0.0, port}``) and sets ``ray_head_node_address`` to the cluster it runs
   in (``ray.get_runtime_context().gcs_address``), then ``RunHelper().start(
   GlobalConfigDictParserConfig(dotenv_path=..., initial_global_config_dict=..., skip_load_from_cli=True))``.
   The servers join the cluster: CPU-heavy verification runs as Ray tasks there
   (``structured_outputs`` with ``pool_threshold_chars: 0`` verifies every answer that way).
3. ``--group-size`` rollouts of each of two tasks go through ``RolloutCollectionHelper.run_examples``
   (rows carry ``agent_ref`` and NeMo RL's ``_rowidx``; sampling parameters overwritten as NeMo RL does),
   with the scripted model: one task is answered right (reward 1), the other wrong (reward 0).
4. Checked: every result has its reward, row index and agent; the rewards of each group; the head server
   serves the cluster's address to outside clients; the environment server started no local
   verification worker (the work went to the cluster); ``rh.poll()`` finds every server alive.
5. Shut down exactly what was started: ``RunHelper.shutdown()`` in the actor, the actor, then
   ``ray.shutdown()`` (which stops the cluster this process started); every process started here is
   checked to be gone within a bound. Never ``ray stop`` (it kills every Ray cluster on the machine).

Run: ``pip install -e ".[ray]" && python examples/ray_trainer_cluster.py [--group-size 4] [--output-dir DIR]``.
Exit status 0 when every check passed; prints one line per group and writes ``summary.json`` when
``--output-dir`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import psutil

REPO = Path(__file__).resolve().parents[1]
ENV = "structured_outputs"
AGENT = f"{ENV}_simple_agent"
ENV_CONFIG = f"resources_servers/{ENV}/configs/{ENV}.yaml"
MODEL_CONFIG = "responses_api_models/scripted_model/configs/scripted_model.yaml"
WRONG_MARKER = "[answer wrongly]"
RIGHT = (
    '{"title": "The Left Hand of Darkness", "author": "Ursula K. Le Guin", "year": 1969, "genres": ["sf"]}'
)
WRONG = '{"title": "The Left Hand of Darkness", "author": "Ursula K. Le Guin", "year": "1969"}'
ROLLOUT_TIMEOUT_S = 300.0
GONE_BOUND_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def nemo_rl_initial_config(gcs_address: str, head_port: int) -> dict[str, Any]:
    """The ``initial_global_config_dict`` NeMo RL's wrapper builds (the scripted model stands in for vLLM)."""
    return {
        "config_paths": [ENV_CONFIG, MODEL_CONFIG],
        # NeMo RL points vllm_model at its own generation workers with these three; the scripted model
        # reads none of them, they are here to show the keys.
        "policy_model_name": "trained-policy",
        "policy_api_key": "dummy_key",
        "policy_base_url": ["http://127.0.0.1:1/v1"],  # one per data-parallel rank
        "default_host": "127.0.0.1",  # NeMo RL: the node's IP
        "global_aiohttp_connector_limit_per_host": 16384,
        "global_aiohttp_connector_limit": 65536,
        "head_server": {"host": "0.0.0.0", "port": head_port},
        # The trainer's own cluster: the servers join it instead of starting one.
        "ray_head_node_address": gcs_address,
        # Scripted answers: the task marked WRONG_MARKER is answered wrongly, the other one right.
        "policy_model": {
            "responses_api_models": {
                "scripted_model": {
                    "scripts_by_input": [
                        {"contains": WRONG_MARKER, "turns": [{"text": WRONG}]},
                        {"contains": "Le Guin", "turns": [{"text": RIGHT}]},
                    ]
                }
            }
        },
        # Every answer is verified in the verification pool, which is Ray tasks on the joined cluster.
        ENV: {"resources_servers": {ENV: {"pool_threshold_chars": 0}}},
    }


def task_rows() -> list[dict[str, Any]]:
    """Two tasks from the environment's example data: as it is, and marked to be answered wrongly."""
    first = orjson.loads(
        (REPO / "resources_servers" / ENV / "data" / "example.jsonl").read_bytes().split(b"\n")[0]
    )
    wrong = copy.deepcopy(first)
    wrong["responses_create_params"]["input"][-1]["content"] += f" {WRONG_MARKER}"
    return [first, wrong]


class GymEnvironment:
    """What NeMo RL's ``NemoGym`` actor does: start the servers in its own process, run rollouts, stop."""

    def __init__(self) -> None:
        self.helper: Any = None

    def start(self, dotenv_path: str) -> dict[str, Any]:
        import ray
        from omegaconf import DictConfig

        from nemo_gym.cli import GlobalConfigDictParserConfig, RunHelper

        gcs_address = ray.get_runtime_context().gcs_address
        head_port = free_port()
        initial = nemo_rl_initial_config(gcs_address, head_port)
        self.helper = RunHelper()
        self.helper.start(
            global_config_dict_parser_config=GlobalConfigDictParserConfig(
                dotenv_path=Path(dotenv_path),
                initial_global_config_dict=DictConfig(initial),
                skip_load_from_cli=True,
            )
        )
        return {
            "gcs_address": gcs_address,
            "head_port": head_port,
            "actor_pid": os.getpid(),
            "servers": self.helper.server_instances(),
        }

    def served_ray_address(self, head_port: int) -> str:
        """``ray_head_node_address`` as the head server serves the config to outside clients."""
        from nemo_gym.client.server_client import BaseServerConfig, ServerClient

        client = ServerClient.load_from_global_config(BaseServerConfig(host="127.0.0.1", port=head_port))
        return str(client.global_config_dict["ray_head_node_address"])

    def run_rollouts(self, examples: list[dict[str, Any]], head_port: int) -> list[list[dict[str, Any]]]:
        """``[row, result]`` of every example, through ``RolloutCollectionHelper.run_examples``."""
        from nemo_gym.rollout_collection import RolloutCollectionHelper
        from nemo_gym.server_utils import BaseServerConfig

        async def collect() -> list[list[dict[str, Any]]]:
            rch = RolloutCollectionHelper()
            head = BaseServerConfig(host="127.0.0.1", port=head_port)  # NeMo RL: the node's IP
            out = []
            try:
                for task in rch.run_examples(examples=examples, head_server_config=head):
                    row, result = await asyncio.wait_for(task, ROLLOUT_TIMEOUT_S)
                    out.append([row, result])
            finally:
                await rch.aclose()
            return out

        return asyncio.run(collect())

    def local_verify_workers(self) -> int:
        """Processes the environment server started itself (the local verification pool would be some)."""
        self.helper.poll()  # raises if any server died
        pid = next(s["pid"] for s in self.helper.server_instances() if s["name"] == ENV)
        return len(psutil.Process(pid).children(recursive=True))

    def shutdown(self) -> None:
        if self.helper is not None:
            self.helper.shutdown()
            self.helper = None


def _alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def run(group_size: int, num_cpus: int, object_store_mb: int, output_dir: Path | None) -> dict[str, Any]:
    ray_tmp = Path(tempfile.mkdtemp(prefix="ngray_"))  # short: Ray's socket paths have a length limit
    os.environ["RAY_TMPDIR"] = str(ray_tmp)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # The actor's process must import nemo_gym and the server folders, as on any Ray cluster.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    import ray

    before = _descendants()
    started: set[int] = set()
    ray.init(
        num_cpus=num_cpus,
        object_store_memory=object_store_mb * 2**20,
        include_dashboard=False,
        log_to_driver=False,
    )
    env = None
    try:
        # num_cpus=0: the actor only waits on servers, leaving the CPUs to verification tasks.
        env = ray.remote(num_cpus=0)(GymEnvironment).remote()
        dotenv = ray_tmp / "nemo_gym_env.yaml"  # NeMo RL passes its repo's nemo_gym_env.yaml
        dotenv.write_text("policy_api_key: dummy_key\n")
        info = ray.get(env.start.remote(str(dotenv)), timeout=300)
        started = _alive(_descendants() - before)
        served = ray.get(env.served_ray_address.remote(info["head_port"]), timeout=60)
        assert served.rpartition(":")[2] == info["gcs_address"].rpartition(":")[2], (served, info)

        examples = []
        for task_index, row in enumerate(task_rows()):
            for _ in range(group_size):
                example = {**copy.deepcopy(row), "agent_ref": {"type": "responses_api_agents", "name": AGENT}}
                example["_rowidx"] = len(examples)
                example["_task"] = task_index  # ours, to group the results
                params = example["responses_create_params"]
                params.update({"temperature": 1.0, "top_p": 1.0, "max_output_tokens": 256})  # as NeMo RL
                examples.append(example)
        pairs = ray.get(env.run_rollouts.remote(examples, info["head_port"]), timeout=ROLLOUT_TIMEOUT_S + 60)
        assert len(pairs) == len(examples), f"{len(pairs)} results for {len(examples)} rows"
        groups: dict[int, list[float]] = {}
        for row, result in pairs:
            assert isinstance(result.get("reward"), float), result
            assert result["_rowidx"] == row["_rowidx"] and result["agent_ref"]["name"] == AGENT
            groups.setdefault(row["_task"], []).append(result["reward"])
        assert sorted(len(g) for g in groups.values()) == [group_size, group_size], groups
        assert groups[0] == [1.0] * group_size and groups[1] == [0.0] * group_size, groups
        local_workers = ray.get(env.local_verify_workers.remote(), timeout=60)
        assert local_workers == 0, f"{ENV} started {local_workers} local verification worker(s)"
        nodes = [n for n in ray.nodes() if n["Alive"]]
        summary = {
            "gcs_address": info["gcs_address"],
            "served_ray_head_node_address": served,
            "ray_nodes": len(nodes),
            "servers": [{k: s.get(k) for k in ("name", "host", "port")} for s in info["servers"]],
            "groups": [{"task": t, "rewards": rewards} for t, rewards in sorted(groups.items())],
            "local_verify_workers": local_workers,
        }
        for group in summary["groups"]:
            print(f"task {group['task']}: rewards {group['rewards']}", flush=True)
        ray.get(env.shutdown.remote(), timeout=120)
    finally:
        started |= _alive(_descendants() - before)
        for pid in list(started):
            try:
                started |= {p.pid for p in psutil.Process(pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
        if env is not None:
            try:
                ray.get(env.shutdown.remote(), timeout=120)  # idempotent; a no-op after success
            except Exception as e:  # noqa: BLE001 - reported, then the actor is killed anyway
                print(f"ray_trainer_cluster: shutting the servers down failed: {e}", file=sys.stderr)
            ray.kill(env)
        ray.shutdown()  # stops the cluster this process started, and only that one
        deadline = time.monotonic() + GONE_BOUND_S
        left = _alive(started)
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = _alive(left)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    if left:
        raise AssertionError(f"processes this script started are still running: {sorted(left)}")
    summary["processes_started_and_stopped"] = len(started)
    print(f"stopped {len(started)} processes (Ray cluster, actor, servers); none left", flush=True)
    if output_dir is not None:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group-size", type=int, default=4, help="rollouts per task (default 4)")
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs of the private Ray cluster (default 2)")
    parser.add_argument("--object-store-mb", type=int, default=128, help="Ray object store cap (default 128)")
    parser.add_argument("--output-dir", type=Path, default=None, help="write summary.json there")
    args = parser.parse_args(argv)
    if args.group_size < 1 or args.num_cpus < 1 or args.object_store_mb < 80:
        parser.error(
            "--group-size and --num-cpus must be >= 1, --object-store-mb >= 80 (Ray's minimum is ~75 MB)"
        )
    os.chdir(REPO)  # config_paths are relative to the repository, as in NeMo RL's checkout
    run(args.group_size, args.num_cpus, args.object_store_mb, args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
