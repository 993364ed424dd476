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
    # Round i of one stack paired with round i of the other: the median of the pairs' ratios.
    pairs = [
        a / b for a, b in zip(ours["rollouts_per_s_by_round"], open_["rollouts_per_s_by_round"], strict=True)
    ]
    assert ours["paired_ratios_to_no_auth"] == [round(x, 4) for x in pairs]
    assert ours["paired_ratio_to_no_auth"] == sum(pairs) / 2
    cpu = [
        a / b
        for a, b in zip(
            ours["cpu_ms_per_rollout_servers_by_round"],
            open_["cpu_ms_per_rollout_servers_by_round"],
            strict=True,
        )
    ]
    assert ours["paired_cpu_ratio_to_no_auth"] == sum(cpu) / 2
    assert "adjacent rounds paired" in proc.stdout
    # The rounds alternate their order, so neither stack always runs first.
    assert proc.stdout.index("ours: 20 rollouts at concurrency 4 (round 1/2)") < proc.stdout.index(
        "no_auth: 20 rollouts at concurrency 4 (round 1/2)"
    )
    assert proc.stdout.index("no_auth: 20 rollouts at concurrency 4 (round 2/2)") < proc.stdout.index(
        "ours: 20 rollouts at concurrency 4 (round 2/2)"
    )
    assert "run-token check at concurrency 4" in proc.stdout


def test_ng_bench_collector_suite_reports_peak_rss_and_cpu_per_row_count(tmp_path: Path) -> None:
    """``+suite=collector``: the real collector at two (small) row counts and a resume of half; every
    field of the report is there. Memory and speed are measured, never asserted."""
    out = tmp_path / "collector.json"
    proc = subprocess.run(
        [
            NG_BENCH,
            "+suite=collector",
            "+row_counts=[300,600]",
            "+num_samples_in_parallel=64",
            "+num_repeats=2",
            "+resume=true",
            f"+output_json_fpath={out}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = orjson.loads(out.read_bytes())
    assert report["suite"] == "collector" and [r["rows"] for r in report["results"]] == [300, 600]
    for r in report["results"]:
        assert r["rollouts"] == r["rollouts_ok"] == 2 * r["rows"] and r["exit"] == 0
        assert r["num_samples_in_parallel"] == 64
        assert r["peak_rss_mb"] >= r["rss_mb_after_start"] > 0 and r["cpu_ms_per_rollout"] > 0
        assert set(r["steps"]) == {"check", "plan", "run", "report"}
        resume = r["resume"]
        assert resume["rollouts_done_before"] == resume["rollouts_sent"] == r["rows"]  # half of 2 x rows
        assert resume["rollouts_ok"] == r["rollouts"] and resume["peak_rss_mb"] > 0
    assert "peak RSS MB" in proc.stdout and str(out) in proc.stdout


def test_suite_rows_say_whether_each_aim_is_met() -> None:
    from nemo_gym.tools.bench.suite import figure_row, format_table

    assert figure_row("framework ratio to bare at 64", 0.85)["met"] is True
    assert figure_row("framework ratio to bare at 1024", 0.7)["met"] is False
    assert figure_row("start-up: ng_run to servers ready (s)", 1.2)["met"] is False
    assert figure_row("start-up: USS of head + 3 servers (MiB)", 110.0)["met"] is True
    no_aim = figure_row("collector CPU ms per rollout at 64", 0.3)
    assert no_aim["aim"] is None and no_aim["met"] is None
    failed = figure_row("environment ratio to bare at 64: mcqa", None, "exited 1")
    assert failed["met"] is None and failed["note"] == "exited 1"
    table = format_table([figure_row("framework ratio to bare at 64", 0.5), failed])
    assert " NO " in table and ">= 0.5" in table and "exited 1" in table


def test_ng_bench_suite_all_runs_the_chosen_parts_into_one_report(tmp_path: Path) -> None:
    out = tmp_path / "suite.json"
    proc = subprocess.run(
        [NG_BENCH, "+suite=all", "+quick=true", "+parts=[collector]", f"+output_json_fpath={out}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = orjson.loads(out.read_bytes())
    assert report["suite"] == "all" and report["quick"] is True and list(report["parts"]) == ["collector"]
    rows = {r["figure"]: r for r in report["figures"]}
    flat = rows["collector peak RSS, most rows / fewest rows"]
    assert flat["aim"] == "<= 1.1" and flat["value"] > 0 and flat["met"] in (True, False)
    assert [r["rows"] for r in report["parts"]["collector"]["results"]] == [10000, 20000]
    assert "collector peak RSS" in proc.stdout and str(out) in proc.stdout
    bad = subprocess.run(
        [NG_BENCH, "+suite=all", "+parts=[speed]"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode != 0 and "unknown +parts ['speed']" in bad.stderr


def test_ng_bench_derives_the_inner_calls_of_each_agent_from_a_result() -> None:
    """The bare stack makes the calls the real agent made: simple_agent's from its output items,
    aviary_agent's from ``response.steps``, gymnasium_agent's from ``episode_steps``, scicode_agent's
    from ``step_answers``."""
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
    # scicode_agent: seed, one model call per step, verify
    assert _inner_calls({"response": {"output": []}, "step_answers": ["", "", ""]}) == [
        "a",
        "b",
        "b",
        "b",
        "a",
    ]
