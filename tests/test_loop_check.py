"""nemo_gym.tools.loop_check: the event-loop check fails on a verifier that blocks its loop (sleeping on it,
or burning 200 ms of CPU on it) and passes one that waits the same time without blocking, also while two
CPU hogs keep the machine busy, over real servers and HTTP. Speeds are not asserted."""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nemo_gym.tools.loop_check import (
    LAG_METRIC,
    LoopLagError,
    check_environment_loop,
    check_loop_lag,
    lag_buckets,
    summarize,
)
from nemo_gym.tools.testing import running_servers
from tests.conftest import write_server_folder

PROBE = "loop_probe"
AGENT = "loop_probe_agent"
# A verifier that takes `verify_s` per rollout: on the loop (time.sleep) when `block` is set, else
# awaiting (asyncio.sleep) as a verifier waiting on a judge or the verify pool does.
PROBE_APP = """
import asyncio
import time

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)


class ProbeConfig(BaseResourcesServerConfig):
    block: bool = False
    burn: bool = False
    verify_s: float = 0.2


class ProbeServer(SimpleResourcesServer):
    config: ProbeConfig

    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse:
        if self.config.burn:  # CPU on the loop: 200 ms of this thread's own CPU time
            start = time.thread_time()
            while time.thread_time() - start < self.config.verify_s:
                pass
        elif self.config.block:
            time.sleep(self.config.verify_s)
        else:
            await asyncio.sleep(self.config.verify_s)
        return BaseVerifyResponse(**body.model_dump(), reward=1.0)


if __name__ == "__main__":
    ProbeServer.run_webserver()
"""
ROWS = [
    {"responses_create_params": {"input": [{"role": "user", "content": f"Say hello to number {i}."}]}}
    for i in range(4)
]


def _probe_config(block: bool, burn: bool = False) -> dict[str, Any]:
    return {
        PROBE: {
            "resources_servers": {
                PROBE: {"entrypoint": "app.py", "domain": "other", "block": block, "burn": burn}
            }
        },
        AGENT: {
            "responses_api_agents": {
                "simple_agent": {
                    "entrypoint": "app.py",
                    "resources_server": {"type": "resources_servers", "name": PROBE},
                    "model_server": {"type": "responses_api_models", "name": "policy_model"},
                    "max_steps": 2,
                }
            }
        },
    }


@pytest.fixture
def probe_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    write_server_folder(tmp_path, "resources_servers", PROBE, PROBE_APP)
    monkeypatch.chdir(tmp_path)  # the probe's folder is found under the working directory
    return tmp_path


# ------------------------------------------------------------------------------------------------
# The histogram arithmetic, on metrics text as a server writes it.

BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


def _metrics_text(per_bucket: dict[float, int], blocked_s: float = 1.0) -> str:
    """A /metrics answer whose lag histogram holds ``per_bucket[le]`` ticks in the bucket ending at ``le``."""
    lines = [f"# TYPE {LAG_METRIC} histogram"]
    total = 0
    for b in (*BOUNDS, math.inf):
        total += per_bucket.get(b, 0)
        le = "+Inf" if math.isinf(b) else repr(float(b))
        lines.append(f'{LAG_METRIC}_bucket{{le="{le}"}} {total}.0')
    lines += [f"{LAG_METRIC}_count {total}.0", f"{LAG_METRIC}_sum {blocked_s}"]
    return "\n".join(lines) + "\n"


def test_summary_counts_only_the_ticks_between_two_readings() -> None:
    before = lag_buckets(_metrics_text({0.001: 50, 2.5: 1}))  # start-up's slow tick is not judged
    after = lag_buckets(_metrics_text({0.001: 70, 0.025: 9, 0.25: 1, 2.5: 1}))
    s = summarize("env", before, after, bound_s=0.1)
    assert (s.ticks, s.late_ticks, s.worst_s, s.p99_s) == (30, 1, (0.1, 0.25), 0.25)
    assert s.describe() == (
        "env: 1 of 30 event-loop ticks blocked more than 100 ms; worst tick 100-250 ms, p99 <= 250 ms, "
        "0.00 s blocked in all"
    )
    later = summarize("env", before, lag_buckets(_metrics_text({0.001: 70, 2.5: 1}, blocked_s=3.5)))
    assert later.blocked_s == 2.5  # the sums' difference: the seconds blocked between the readings
    # One late tick can be a garbage collection or the OS: it takes two, and more than 10% of the ticks.
    assert not s.too_late() and s.too_late(max_late_fraction=0.01, min_late_ticks=1)
    four = summarize("env", before, lag_buckets(_metrics_text({0.001: 70, 0.025: 6, 0.25: 4, 2.5: 1})))
    assert four.late_ticks == 4 and four.too_late() and not four.too_late(max_late_fraction=0.2)
    two = summarize("env", before, lag_buckets(_metrics_text({0.001: 70, 0.025: 8, 0.25: 2, 2.5: 1})))
    assert not two.too_late() and two.too_late(max_late_fraction=0.05)
    # The same four late ticks among 500 are within 10%.
    many = summarize("env", before, lag_buckets(_metrics_text({0.001: 520, 0.025: 6, 0.25: 4, 2.5: 1})))
    assert (many.ticks, many.late_ticks, many.p99_s) == (480, 4, 0.025) and not many.too_late()
    idle = summarize("env", after, after)
    assert (idle.ticks, idle.late_ticks, idle.worst_s, idle.too_late()) == (0, 0, (0.0, 0.0), False)
    assert idle.describe().endswith("worst tick none, p99 none, 0.00 s blocked in all")


def test_the_bound_must_be_a_bucket_bound() -> None:
    buckets = lag_buckets(_metrics_text({0.001: 3}))
    with pytest.raises(ValueError, match="not a bucket bound"):
        summarize("env", buckets, buckets, bound_s=0.2)


def test_metrics_without_the_histogram_is_a_clear_error() -> None:
    with pytest.raises(LoopLagError, match="no nemo_gym_event_loop_blocked_seconds histogram"):
        lag_buckets("# TYPE process_open_fds gauge\nprocess_open_fds 12.0\n")


# ------------------------------------------------------------------------------------------------
# Real servers.


def test_a_verifier_that_blocks_the_loop_fails_the_check(probe_dir: Path) -> None:
    with running_servers([], _probe_config(block=True)) as helper:
        with pytest.raises(LoopLagError) as failed:
            check_loop_lag(
                helper, AGENT, ROWS, num_rollouts=24, concurrency=8, warmup_rollouts=2, min_seconds=0
            )
    message = str(failed.value)
    assert message.startswith(
        "event loop blocked under load (24 rollouts of 'loop_probe_agent' at 8 in flight"
    )
    lines = [line.strip() for line in message.splitlines()]
    # Only the blocking server is named: the agent and the model wait on it without blocking.
    named = [line for line in lines if line.startswith(f"{PROBE}:")]
    assert len(named) == 1 and not [line for line in lines if line.startswith((AGENT, "policy_model"))], (
        message
    )
    assert "event-loop ticks blocked more than 100 ms; worst tick" in named[0]
    assert "asyncio.to_thread" in message


def test_a_verifier_that_burns_cpu_on_the_loop_fails_the_check(probe_dir: Path) -> None:
    with running_servers([], _probe_config(block=False, burn=True)) as helper:
        with pytest.raises(LoopLagError) as failed:
            check_loop_lag(
                helper, AGENT, ROWS, num_rollouts=24, concurrency=8, warmup_rollouts=2, min_seconds=0
            )
    named = [line.strip() for line in str(failed.value).splitlines() if line.strip().startswith(f"{PROBE}:")]
    assert len(named) == 1 and "event-loop ticks blocked more than 100 ms" in named[0], str(failed.value)


@contextlib.contextmanager
def _cpu_hogs(n: int) -> Iterator[None]:
    """``n`` processes that spin on a CPU each: a machine busy with other work."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(timeout=10)


def test_a_verifier_that_waits_without_blocking_passes_even_beside_cpu_hogs(probe_dir: Path) -> None:
    """On a machine busy with two CPU hogs the scheduler alone delays ticks by 100-500 ms: that is the
    machine, not the server, and the check passes (it failed for healthy servers on busy machines)."""
    with running_servers([], _probe_config(block=False)) as helper, _cpu_hogs(2):
        summaries = check_loop_lag(helper, AGENT, ROWS, num_rollouts=24, concurrency=8, warmup_rollouts=2)
    assert set(summaries) == {PROBE, AGENT, "policy_model"}
    # The waits took as long as the blocking ones above, so the servers ticked all along.
    assert all(s.ticks > 0 and not s.too_late() for s in summaries.values()), summaries


def test_a_failing_rollout_fails_the_check_with_its_error(probe_dir: Path) -> None:
    config = _probe_config(block=False)
    config["policy_model"] = {"responses_api_models": {"scripted_model": {"script": [{"http_error": 500}]}}}
    with pytest.raises(
        LoopLagError, match=r"rollout\(s\) failed under load .* first: loop_probe_agent/run answered 5"
    ):
        check_environment_loop([], AGENT, ROWS, config, num_rollouts=4, concurrency=2)
