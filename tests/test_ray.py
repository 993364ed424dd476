"""Ray support (nemo_gym.run.ray) without a shared cluster: its settings, nothing importing ray without
a Ray config, an unreachable cluster, verification staying local, a cluster that a run starts and stops
itself, sealed secrets, and Ray's noise filtered. The tests on a shared 2-node cluster are in
tests/test_ray_tasks.py (Ray tasks) and tests/test_ray_replicas.py (server replicas placed on nodes);
what the three files share is tests/ray_cluster.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from nemo_gym.global_config import ConfigError
from nemo_gym.kit.verify_pool import (
    run_in_verify_pool,
    set_verify_ray_address,
)
from nemo_gym.run.ray import ray_settings
from nemo_gym.tools.testing import running_servers
from tests.ray_cluster import (
    ENV_CONFIG,
    REPO,
    SO_CONFIG,
    SO_RIGHT,
    alive,
    descendants,
    wait_gone,
    where,
)

ray = pytest.importorskip("ray", reason="the `ray` extra is not installed (pip install -e '.[ray]')")


def test_nothing_imports_ray_without_a_ray_config() -> None:
    """ng_run's modules, and a whole RunHelper start/stop of a config without Ray keys, import no ray."""
    code = f"""
import sys
import nemo_gym.cli, nemo_gym.run.cli, nemo_gym.client.server_client, nemo_gym.kit.verify_pool, nemo_gym.rollout_collection, nemo_gym.run.ray
assert "ray" not in sys.modules, "importing nemo_gym's launcher modules imported ray"
from nemo_gym.tools.testing import running_servers
with running_servers([{ENV_CONFIG!r}]) as helper:
    assert len(helper.server_instances()) == 3
assert "ray" not in sys.modules, "starting servers without a Ray config imported ray"
print("NO-RAY-OK")
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0 and "NO-RAY-OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


def test_ray_settings_read_the_keys_and_reject_bad_ones() -> None:
    assert ray_settings({}) is None
    assert ray_settings({"ray_head_node_address": None, "ray_start_local": False}) is None
    joined = ray_settings({"ray_head_node_address": "10.0.0.5:6379"})
    assert joined is not None and joined.address == "10.0.0.5:6379" and not joined.start_local
    local = ray_settings({"ray_start_local": "true", "ray_local_num_cpus": 2})
    assert local is not None and local.start_local and local.address is None and local.local_num_cpus == 2
    with pytest.raises(ConfigError, match="not both"):
        ray_settings({"ray_head_node_address": "h:1", "ray_start_local": True})
    with pytest.raises(ConfigError, match="must be host:port"):
        ray_settings({"ray_head_node_address": "no-port"})
    with pytest.raises(ConfigError, match="ray://"):
        ray_settings({"ray_head_node_address": "ray://h:10001"})
    with pytest.raises(ConfigError, match="'ray_local_num_cpus' must be a positive integer"):
        ray_settings({"ray_start_local": True, "ray_local_num_cpus": 0})


def test_an_unreachable_cluster_fails_within_the_bound_naming_the_address(tmp_path: Path) -> None:
    # In a fresh interpreter: the abandoned connect attempt must not linger in this test process.
    code = """
import os, sys
from nemo_gym.run.ray import ray_settings
from nemo_gym.run.supervision.children import StartupError
from nemo_gym.run.ray.cluster import RayConnectError, connect
try:
    connect(ray_settings({"ray_head_node_address": "127.0.0.1:1"}), timeout_s=3)
except RayConnectError as e:
    print("ERROR:", e, flush=True)
os._exit(0)
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_TMPDIR": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert (
        "ERROR: Could not join the Ray cluster at ray_head_node_address=127.0.0.1:1 within 3 s" in out.stdout
    ), out.stdout + out.stderr[-2000:]


def test_ng_run_names_a_bad_ray_setting_and_starts_nothing() -> None:
    """``+ray_head_node_address=...`` on the command line is read (no longer "no effect"); a bad value
    stops ng_run with an error naming the key, before any server starts."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    base = [
        sys.executable,
        "-c",
        "import sys; from nemo_gym.run.cli import run_main; run_main(sys.argv[1:])",
        f"+config_paths=[{ENV_CONFIG},responses_api_models/scripted_model/configs/scripted_model.yaml]",
        "+head_server.port=0",
    ]
    for args, expected in (
        (["+ray_head_node_address=nonsense"], "'ray_head_node_address' must be host:port"),
        (["+ray_head_node_address=127.0.0.1:6379", "+ray_start_local=true"], "not both"),
    ):
        out = subprocess.run(base + args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and expected in out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
        assert "no effect here" not in out.stderr and "servers ready" not in out.stdout


async def test_verification_stays_local_without_a_cluster() -> None:
    set_verify_ray_address("")
    try:
        result = await run_in_verify_pool(where, timeout=60)
    finally:
        set_verify_ray_address(None)
    assert result["pid"] != os.getpid() and result["main_thread"]


@pytest.mark.slow
def test_ray_start_local_starts_and_stops_exactly_its_cluster(ray_env: None) -> None:
    assert not ray.is_initialized()
    before = descendants()
    with running_servers([ENV_CONFIG], {"ray_start_local": True, "ray_local_num_cpus": 1}) as helper:
        connection = helper.supervisor.ray_connection
        assert connection is not None and connection.started_local
        names = {psutil.Process(p).name() for p in alive(descendants() - before)}
        assert {"gcs_server", "raylet"} <= names
        started = descendants() - before
    assert not ray.is_initialized()
    assert not wait_gone(started), "the local Ray cluster outlived the run"


def test_sealed_secrets_open_only_with_the_actors_key() -> None:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    from nemo_gym.run.ray.replicas import seal, unseal

    actor_key, other_key = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    public = actor_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    secret = b'{"NEMO_GYM_AUTH_TOKEN": "tok-0123456789abcdef"}'
    ephemeral, nonce, sealed = seal(public, secret)
    assert b"tok-0123456789abcdef" not in ephemeral + nonce + sealed
    assert unseal(actor_key, ephemeral, nonce, sealed) == secret
    with pytest.raises(InvalidTag):
        unseal(other_key, ephemeral, nonce, sealed)


# ------------------------------------------------------------------------------------------------
# A normal start and stop with Ray prints no crash-like output.


def test_ng_run_with_ray_starts_and_stops_quietly(ray_env: None, tmp_path: Path) -> None:
    """ng_run +ray_start_local=true, one rollout whose verification runs as a Ray task (so the resources
    server joined the cluster too), then Ctrl+C: no traceback, no Ray "SIGTERM received" stack, no Ray
    warning about signal handlers; the run reports a clean stop. (Errors are not filtered: only Ray's
    not-main-thread warning and its SIGTERM stack for a normal stop are, see nemo_gym.kit.ray_quiet.)"""
    from nemo_gym.tools.testing import collect_rollouts, example_rows

    overrides = tmp_path / "overrides.yaml"
    overrides.write_text(
        yaml.safe_dump(
            {
                "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": [
                    {"contains": "Le Guin", "turns": [{"text": SO_RIGHT}]}]}}},
                "structured_outputs": {"resources_servers": {"structured_outputs": {"pool_threshold_chars": 0}}},
            }
        )
    )  # fmt: skip
    configs = f"{SO_CONFIG},responses_api_models/scripted_model/configs/scripted_model.yaml,{overrides}"
    proc = subprocess.Popen(
        [sys.executable, "-c", "from nemo_gym.run.cli import run_main; run_main()", f"+config_paths=[{configs}]",
         "+ray_start_local=true", "+ray_local_num_cpus=1", "+head_server.port=0"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("servers ready" in x for x in lines) and proc.poll() is None:
            assert time.monotonic() < deadline, "ng_run did not start within 120 s:\n" + "".join(lines)
            time.sleep(0.2)
        assert proc.poll() is None, "ng_run exited during start-up:\n" + "".join(lines)
        port = int(next(x for x in lines if x.startswith("Head server:")).rsplit(":", 1)[1])

        class _Head:  # what collect_rollouts needs of a RunHelper
            head_server_config = type("H", (), {"port": port})()

        code, out, err = collect_rollouts(
            _Head(), [example_rows("structured_outputs")[0]], tmp_path, "structured_outputs_simple_agent"
        )  # type: ignore[arg-type]
        assert code == 0 and [r["reward"] for r in out] == [1.0], err[-3000:]
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    reader.join(timeout=10)
    text = "".join(lines)
    assert proc.returncode == 0, text
    assert "ng_run: all servers stopped." in text, text
    for noise in ("Traceback", "SIGTERM received", "PC: @", "SIGTERM handler is not set"):
        assert noise not in text, f"{noise!r} in the output of a normal start/stop:\n{text}"


def test_only_rays_not_main_thread_warning_is_filtered(caplog: pytest.LogCaptureFixture) -> None:
    """Real problems Ray logs still show; only the one warning about signal handlers is dropped."""
    import logging

    from nemo_gym.kit.ray_quiet import (
        NOT_MAIN_THREAD_WARNING,
        drop_not_main_thread_warning,
        restore_python_sigterm_handler,
    )

    drop_not_main_thread_warning()
    drop_not_main_thread_warning()  # idempotent
    logger = logging.getLogger("ray._private.worker")
    with caplog.at_level(logging.WARNING, logger="ray._private.worker"):
        logger.warning(NOT_MAIN_THREAD_WARNING + ".")
        logger.error("Failed to connect to GCS at 10.0.0.1:6379")
    assert [r.getMessage() for r in caplog.records] == ["Failed to connect to GCS at 10.0.0.1:6379"]
    assert sum(type(f).__name__ == "_DropNotMainThreadWarning" for f in logger.filters) == 1
    result: list[bool] = []
    worker = threading.Thread(target=lambda: result.append(restore_python_sigterm_handler()))
    worker.start()
    worker.join(timeout=10)
    assert result == [False]  # signal handlers can only be set on the main thread: left alone there
    before = signal.getsignal(signal.SIGTERM)
    assert restore_python_sigterm_handler() and signal.getsignal(signal.SIGTERM) is before
