"""ng_bench smoke test: one small concurrency end to end; the report has every field. Speeds are not asserted."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson

NG_BENCH = str(Path(sys.executable).parent / "ng_bench")
SERVERS = {"example_single_tool_call", "example_single_tool_call_simple_agent", "policy_model"}
BARE = {"bare_echo_a", "bare_echo_b", "bare_agent"}


def test_ng_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.Popen(
        [NG_BENCH, "+concurrencies=[8]", "+num_rollouts=50", f"+output_json_fpath={out}"],
        cwd=tmp_path,  # works from any directory
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
    assert proc.returncode == 0, stderr[-3000:]

    report = orjson.loads(out.read_bytes())
    assert report["env"] == "example_single_tool_call"
    # seed, model, tool, model, verify behind the agent, plus the collector's call to the agent.
    assert report["inner_calls_per_rollout"] == 5 and report["hops_per_rollout"] == 6
    assert report["machine"]["cpus"] >= 1
    by_stack = {r["stack"]: r for r in report["results"]}
    assert sorted(by_stack) == ["bare", "ours"] and len(report["results"]) == 2
    for stack, processes in (("ours", SERVERS), ("bare", BARE)):
        r = by_stack[stack]
        assert r["concurrency"] == 8 and r["rollouts"] == 50 and r["errors"] == 0, r
        assert r["rollouts_per_s"] > 0 and r["wall_s"] > 0
        assert 0 < r["p50_latency_ms"] <= r["p99_latency_ms"]
        assert r["cpu_ms_per_rollout_servers"] > 0 and r["cpu_ms_per_rollout_collector"] >= 0
        assert set(r["peak_rss_mb"]) == processes | {"collector"}
        assert all(mb > 0 for mb in r["peak_rss_mb"].values()), r["peak_rss_mb"]
    ours, bare = by_stack["ours"], by_stack["bare"]
    assert ours["ratio_to_bare"] == ours["rollouts_per_s"] / bare["rollouts_per_s"]
    assert "ratio_to_bare" not in bare
    # Each server's event-loop ticks during the measurement (the lag histogram read before and after).
    lag = ours["event_loop_lag_by_server"]
    assert set(lag) == SERVERS and "event_loop_lag_by_server" not in bare
    for per_server in lag.values():
        assert set(per_server) == {"ticks", "late_100ms", "p99_ms"} and per_server["ticks"] >= 0
        assert 0 <= per_server["late_100ms"] <= per_server["ticks"]

    assert "ours" in stdout and "bare" in stdout and "roll/s" in stdout and str(out) in stdout


def test_ng_bench_compare_auth_measures_both_stacks_in_alternating_rounds(tmp_path: Path) -> None:
    """``+compare_auth``: the same servers with and without the token check (the bench checks each
    stack refuses / serves a tokenless request), medians over rounds, and the ratios between them."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            NG_BENCH,
            "+concurrencies=[4]",
            "+num_rollouts=20",
            "+compare_auth=true",
            "+rounds=2",
            "+skip_bare=true",
            f"+output_json_fpath={out}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["stack"]: r for r in orjson.loads(out.read_bytes())["results"]}
    assert sorted(results) == ["no_auth", "ours"]
    for r in results.values():
        assert r["rounds"] == 2 and r["rollouts"] == 40 and r["errors"] == 0 and r["concurrency"] == 4
        assert len(r["rollouts_per_s_by_round"]) == 2 and all(x > 0 for x in r["rollouts_per_s_by_round"])
        assert r["rollouts_per_s"] == sum(r["rollouts_per_s_by_round"]) / 2  # the median of two
    ours, open_ = results["ours"], results["no_auth"]
    assert ours["ratio_to_no_auth"] == ours["rollouts_per_s"] / open_["rollouts_per_s"]
    assert (
        ours["cpu_ratio_to_no_auth"]
        == ours["cpu_ms_per_rollout_servers"] / open_["cpu_ms_per_rollout_servers"]
    )
    assert "ratio_to_no_auth" not in open_
    # The rounds alternate their order, so neither stack always runs first.
    assert proc.stdout.index("ours: 20 rollouts at concurrency 4 (round 1/2)") < proc.stdout.index(
        "no_auth: 20 rollouts at concurrency 4 (round 1/2)"
    )
    assert proc.stdout.index("no_auth: 20 rollouts at concurrency 4 (round 2/2)") < proc.stdout.index(
        "ours: 20 rollouts at concurrency 4 (round 2/2)"
    )
    assert "run-token check at concurrency 4" in proc.stdout


def test_ng_bench_derives_the_inner_calls_of_each_agent_from_a_result() -> None:
    """The bare stack makes the calls the real agent made: simple_agent's from its output items,
    aviary_agent's from ``response.steps``, gymnasium_agent's from ``episode_steps``."""
    from nemo_gym.tools.bench.stack import _inner_calls

    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    out = {"type": "function_call_output", "call_id": "c1", "output": "{}"}
    message = {"type": "message", "role": "assistant", "content": []}
    # seed, model, tool, model, verify
    assert _inner_calls({"response": {"output": [call, out, message]}}) == ["a", "b", "a", "b", "a"]
    # seed, (model, step), model that did not step the env, close, verify
    aviary = {"response": {"output": [], "steps": [{"stepped_env": True}, {"stepped_env": False}]}}
    assert _inner_calls(aviary) == ["a", "b", "a", "b", "a", "a"]
    # reset, (model, step) x 3, close
    assert _inner_calls({"response": {"output": []}, "episode_steps": 3}) == ["a", *(["b", "a"] * 3), "a"]
