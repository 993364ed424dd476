"""The collector and the trainer API when a server dies mid-run (real servers, the real CLI).

What is proven here:
* An agent killed with SIGKILL mid-run (2,000 rollouts, 100 in flight): the collector stops sending
  once the agent is unreachable past its retry budget. The rollouts attempted are bounded by those
  done or in flight at the kill plus the breaker threshold, the rest are "not attempted" (not in
  the failures file), a handful of retry warnings are printed instead of one per retry, one summary
  line per failure kind, exit status 3 naming the agent; after a restart a resume completes exactly
  the missing (task, rollout) pairs, each once.
* A resources server killed mid-run (the agent stays up and answers 502 naming it): the same, with
  the failures and the stop naming the resources server, reported by the agent.
* Two environments in one run, one resources server killed: only the agent that needs it is
  stopped; every rollout of the other environment still runs.
* ``RolloutCollectionHelper.run_examples`` against a dead agent: a bounded number of rows is sent,
  the rest raise :class:`ServerDownError` naming the agent, without being sent.
* The breaker's bookkeeping on classified failures (which failures count, resets, blocking).

Every assertion is on counts, never on wall-clock time.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from nemo_gym.client import server_client
from nemo_gym.client.server_client import RETRY_WARNING_BURST, close_shared_session
from nemo_gym.collection.circuit_breaker import CircuitBreaker, ServerDownError
from nemo_gym.collection.cli import EXIT_SERVER_DOWN
from nemo_gym.collection.output_files import sidecar_paths
from nemo_gym.errors import UpstreamError
from nemo_gym.path_utils import failures_path_for
from nemo_gym.rollout_collection import RolloutCollectionHelper
from nemo_gym.tools.testing import example_rows, running_servers
from tests.test_rollout_collection import (
    WEATHER,
    WEATHER_AGENT,
    _kill_group,
    base_args,
    collect_here,
    config_of,
    finish,
    head_port,
    kill9,
    model_extra,
    pairs,
    read_jsonl,
    server_pid,
    start_collect,
    wait_for_lines,
    write_jsonl,
)
from tests.test_server_client import bound_but_not_listening, client_for

REPEATS = 400  # 5 example rows x 400 = 2,000 rollouts
TOTAL = 5 * REPEATS
PARALLEL = 100
THRESHOLD = 3  # the default +circuit_breaker_threshold
SLOW = [
    {"delay_s": 0.2, "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
    {"text": "ok"},
]
QUICK = [{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}, {"text": "ok"}]
EVERYTHING = {(t, r) for t in range(5) for r in range(REPEATS)}
# A dead server costs at most one burst of retry warnings per window (two if a window turns over).
MAX_WARNING_LINES = 2 * RETRY_WARNING_BURST


def _kill_mid_run(tmp_path: Path, victim: str) -> dict[str, Any]:
    """Collect 2,000 slow rollouts, SIGKILL ``victim`` after 300 are done, wait for the collector.

    Returns what the checks need: exit status, output, failures, the summary, and so on.
    """
    input_path = write_jsonl(tmp_path / "input.jsonl", example_rows(WEATHER))
    out = tmp_path / "rollouts.jsonl"
    args = base_args(
        input_path, out, f"+num_repeats={REPEATS}", f"+num_samples_in_parallel={PARALLEL}", "+progress=false"
    )
    with running_servers([config_of(WEATHER)], model_extra(script=SLOW)) as helper:
        proc = start_collect(args, head_port(helper), tmp_path)
        try:
            wait_for_lines(out, 300, proc)
            kill9(server_pid(helper, victim))
            code, stdout, stderr = finish(proc, tmp_path)
        finally:
            _kill_group(proc)
    side = sidecar_paths(out)
    return {
        "args": args,
        "out": out,
        "side": side,
        "code": code,
        "stdout": stdout,
        "stderr": stderr,
        "done": read_jsonl(out),
        "failed": read_jsonl(side["failures"]),
        "summary": orjson.loads(side["metrics"].read_bytes()),
    }


def _check_stopped(run: dict[str, Any], down: str, extra_after_kill: int) -> None:
    """The checks shared by both kills: bounded attempts, not-attempted rows, one line per kind, exit 3."""
    done_pairs, failed_pairs = pairs(run["done"]), pairs(run["failed"])
    assert len(done_pairs) == len(set(done_pairs)) and len(failed_pairs) == len(set(failed_pairs))
    assert set(done_pairs).isdisjoint(failed_pairs)
    attempted = set(done_pairs) | set(failed_pairs)
    # Every success frees a slot for one more row: so at most one row per success (counted at the end:
    # a rollout the agent answered just before the kill may be written just after it), plus the PARALLEL
    # in flight, plus a few started before the breaker opened. Without the breaker all 2,000 are attempted.
    assert len(attempted) <= len(done_pairs) + PARALLEL + extra_after_kill
    assert len(re.findall(r"Cannot reach", run["stderr"])) <= MAX_WARNING_LINES, run["stderr"][-3000:]
    assert run["code"] == EXIT_SERVER_DOWN, run["stderr"][-3000:]
    not_attempted = EVERYTHING - attempted
    assert len(not_attempted) >= TOTAL - len(done_pairs) - PARALLEL - extra_after_kill > 0
    summary = run["summary"]
    assert summary["not_attempted"] == len(not_attempted)
    assert summary["rollouts_missing"] == TOTAL - len(done_pairs)
    assert [d["server"] for d in summary["down_servers"]] == [down]
    assert summary["down_servers"][0]["blocked_agents"] == [WEATHER_AGENT]
    assert summary["down_servers"][0]["consecutive_failures"] == THRESHOLD

    # One line per failure kind with its count, then the stop, naming the server; no retry storm.
    kinds = Counter((f["kind"], f["server"]) for f in run["failed"])
    assert [(k["kind"], k["server"], k["count"]) for k in summary["failure_kinds"]] == [
        (kind, server, n) for (kind, server), n in kinds.most_common()
    ]
    for k in summary["failure_kinds"]:
        assert re.search(rf"^    {k['count']} x {k['kind']}.* from {k['server']} \(", run["stdout"], re.M), (
            run["stdout"]
        )
    assert f"STOPPED: server '{down}' is down" in run["stdout"]
    assert f"{len(not_attempted)} rollout(s) not attempted" in run["stdout"]
    assert f"ng_collect_rollouts: stopped early: server '{down}' is down" in run["stderr"]
    assert "+resume_from_cache=true" in run["stderr"]


def _resume_completes_exactly_the_missing(run: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """After a restart (new servers, new head port) the resume runs exactly the missing pairs, once each."""
    done_pairs = pairs(run["done"])
    with running_servers([config_of(WEATHER)], model_extra(script=QUICK)) as helper:
        code, stdout, stderr = collect_here(
            [*run["args"], "+resume_from_cache=true"], head_port(helper), capsys
        )
    assert code == 0, stderr[-3000:]
    final = read_jsonl(run["out"])
    assert Counter(pairs(final)) == Counter(dict.fromkeys(EVERYTHING, 1))
    assert pairs(final)[: len(done_pairs)] == done_pairs  # earlier lines untouched
    assert read_jsonl(run["side"]["failures"]) == run["failed"]  # nothing failed this time
    summary = orjson.loads(run["side"]["metrics"].read_bytes())
    assert summary["this_run"]["ok"] == TOTAL - len(done_pairs) and summary["this_run"]["failed"] == 0
    assert summary["rollouts_ok"] == TOTAL and summary["down_servers"] == [] and summary["not_attempted"] == 0
    assert f"Rollouts: {TOTAL} / {TOTAL} ok" in stdout


def test_killed_agent_stops_dispatch_then_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _kill_mid_run(tmp_path, WEATHER_AGENT)
    # No success can arrive after the agent died: only the first failures (before the breaker
    # opened) let new rows start.
    _check_stopped(run, WEATHER_AGENT, extra_after_kill=THRESHOLD)
    for f in run["failed"]:
        assert (f["kind"], f["server"], f["path"], f["attempt"]) == (
            "connection_error",
            WEATHER_AGENT,
            "/run",
            1,
        ), f
        assert "via" not in f
    _resume_completes_exactly_the_missing(run, capsys)


def test_killed_resources_server_stops_dispatch_then_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _kill_mid_run(tmp_path, WEATHER)
    # Rollouts past /verify when the server died still succeed, and each lets one more row start
    # before the breaker opens: a few dozen at most of the 1,700 rows left.
    _check_stopped(run, WEATHER, extra_after_kill=THRESHOLD + 30)
    for f in run["failed"]:
        assert (f["kind"], f["server"], f["attempt"]) == ("connection_error", WEATHER, 1), f
        assert f["path"] in ("/seed_session", "/get_weather", "/verify"), f
        assert f["via"] == {"server": WEATHER_AGENT, "path": "/run", "status": 502}, f
    assert f"reported by agent {WEATHER_AGENT}" in run["stderr"]
    _resume_completes_exactly_the_missing(run, capsys)


def test_only_agents_that_need_the_down_server_are_stopped(tmp_path: Path) -> None:
    """Two environments in one run; one's resources server dies: the other's rows all still run."""
    other, other_agent = "example_multi_step", "example_multi_step_simple_agent"
    weather_rows = [{**r, "agent_ref": {"name": WEATHER_AGENT}} for r in example_rows(WEATHER)]
    other_rows = [{**r, "agent_ref": {"name": other_agent}} for r in example_rows(other)]
    mixed = [row for pair in zip(weather_rows, other_rows, strict=True) for row in pair]  # alternating
    input_path = write_jsonl(tmp_path / "input.jsonl", mixed)
    out = tmp_path / "rollouts.jsonl"
    repeats = 100
    args = base_args(
        input_path,
        out,
        f"+num_repeats={repeats}",
        "+num_samples_in_parallel=50",
        "+progress=false",
        agent=None,
    )
    with running_servers([config_of(WEATHER), config_of(other)], model_extra(script=SLOW)) as helper:
        proc = start_collect(args, head_port(helper), tmp_path)
        try:
            wait_for_lines(out, 200, proc)
            kill9(server_pid(helper, WEATHER))
            code, stdout, stderr = finish(proc, tmp_path)
        finally:
            _kill_group(proc)
    assert code == EXIT_SERVER_DOWN, stderr[-3000:]
    summary = orjson.loads(sidecar_paths(out)["metrics"].read_bytes())
    assert [(d["server"], d["blocked_agents"]) for d in summary["down_servers"]] == [
        (WEATHER, [WEATHER_AGENT])
    ]
    done = read_jsonl(out)
    failed = read_jsonl(failures_path_for(out))  # upstream's name for the file the collector wrote
    # Tasks 1, 3, 5, ... are the other environment's: every one of its rollouts ran and succeeded.
    other_pairs = {(t, r) for t in range(1, 10, 2) for r in range(repeats)}
    assert {p for p in pairs(done) if p[0] % 2 == 1} == other_pairs
    assert all(f["agent_ref"]["name"] == WEATHER_AGENT and f["server"] == WEATHER for f in failed)
    weather_done = [p for p in pairs(done) if p[0] % 2 == 0]
    assert summary["not_attempted"] == 5 * repeats - len(weather_done) - len(failed) > 0


async def test_trainer_api_raises_server_down_instead_of_hammering(caplog: pytest.LogCaptureFixture) -> None:
    rows = example_rows(WEATHER)
    examples = [
        {
            **rows[i % 5],
            "agent_ref": {"type": "responses_api_agents", "name": WEATHER_AGENT},
            "_ng_task_index": i,
        }
        for i in range(60)
    ]
    parallel = 4
    with running_servers([config_of(WEATHER)], model_extra(script=QUICK)) as helper:
        collector = RolloutCollectionHelper(num_samples_in_parallel=parallel)
        try:
            ok = [
                await f
                for f in collector.run_examples(examples[:5], head_server_config=helper.head_server_config)
            ]
            assert len(ok) == 5 and all(isinstance(result["reward"], float) for _, result in ok)

            kill9(server_pid(helper, WEATHER_AGENT))
            caplog.clear()
            sent_and_failed: list[UpstreamError] = []
            held_back: list[ServerDownError] = []
            with caplog.at_level(logging.WARNING, logger="nemo_gym"):
                for future in collector.run_examples(examples, head_server_config=helper.head_server_config):
                    with pytest.raises(UpstreamError) as failure:
                        await future
                    bucket = held_back if isinstance(failure.value, ServerDownError) else sent_and_failed
                    bucket.append(failure.value)
        finally:
            await collector.aclose()
    # The first ``parallel`` rows were sent together; each failure before the breaker opened let
    # one more start. Without the breaker all 60 are sent, each retried 4 times.
    assert len(sent_and_failed) <= parallel + THRESHOLD - 1
    assert len(held_back) == len(examples) - len(sent_and_failed) >= 60 - parallel - THRESHOLD
    for e in sent_and_failed:
        assert (e.kind, e.server, e.path) == ("connection_error", WEATHER_AGENT, "/run")
    for e in held_back:
        assert (e.kind, e.server, e.agent) == ("server_down", WEATHER_AGENT, WEATHER_AGENT)
        assert f"server '{WEATHER_AGENT}' is down: {THRESHOLD} consecutive connection_error" in str(e)
    retry_lines = [r for r in caplog.records if r.getMessage().startswith("Cannot reach")]
    assert 0 < len(retry_lines) <= MAX_WARNING_LINES


async def test_retry_warnings_are_rate_limited_and_the_rest_counted(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """40 requests to a port nobody listens on, 3 retries each: a few lines, then a count of the rest."""
    # A short window, so a later retry wave falls into a new one (the waves are >= 0.2 s apart).
    monkeypatch.setattr(server_client, "RETRY_WARNING_WINDOW_S", 0.1)
    sock = bound_but_not_listening()
    try:
        client = client_for(sock.getsockname()[1], max_retries=3, backoff_s=0.2)
        with caplog.at_level(logging.WARNING, logger="nemo_gym"):
            results = await asyncio.gather(
                *(client.post("tiny", "/x", json={}) for _ in range(40)), return_exceptions=True
            )
    finally:
        sock.close()
        await close_shared_session()
    assert all(isinstance(r, UpstreamError) and r.kind == "connection_error" for r in results)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Cannot reach tiny")]
    assert len(lines) < 40  # a burst per window, not one per retry (120)
    counted = [
        int(m.group(1))
        for line in lines
        if (m := re.search(r"\((\d+) more retry warning\(s\) for tiny", line))
    ]
    assert counted and sum(counted) + len(lines) <= 40 * 3


# ------------------------------------------------------------------------------------------------
# The breaker's bookkeeping (classified failures in, decisions out; no servers needed).


def _failure(kind: str, server: str, status: int | None = None, via: str | None = None) -> dict[str, Any]:
    f: dict[str, Any] = {"kind": kind, "server": server, "path": "/x", "status": status, "error": "..."}
    if via:
        f["via"] = {"server": via, "path": "/run", "status": 502}
    return f


def test_breaker_counts_only_down_failures_and_resets_on_success() -> None:
    breaker = CircuitBreaker(threshold=3)
    # Failures that say nothing about a server being down never open it.
    for _ in range(10):
        breaker.failure("a", _failure("timeout", "a"))
        breaker.failure("a", _failure("http_error", "model", 500, via="a"))
        breaker.failure("a", _failure("http_error", "res", 422, via="a"))
        breaker.failure("a", _failure("validation_error", "a", 422))
    assert breaker.blocking("a") is None and breaker.report() == []
    # Two in a row, a success, two more: still closed (consecutive only).
    for _ in range(2):
        breaker.failure("a", _failure("connection_error", "res", via="a"))
    breaker.success("a")
    for _ in range(2):
        breaker.failure("a", _failure("connection_error", "res", via="a"))
    assert breaker.blocking("a") is None
    # The third in a row opens it, naming the inner server; it stays open after a late success.
    breaker.failure("a", _failure("connection_error", "res", via="a"))
    breaker.success("a")
    opened = breaker.blocking("a")
    assert opened is not None and (opened["server"], opened["consecutive_failures"]) == ("res", 3)
    assert opened["via"]["server"] == "a"


def test_breaker_blocks_every_agent_of_a_down_server_and_only_those() -> None:
    breaker = CircuitBreaker(threshold=2)
    breaker.failure("a", _failure("http_error", "model", 502, via="a"))  # a model whose backend is gone
    assert breaker.blocking("a") is None
    breaker.failure("b", _failure("http_error", "model", 503, via="b"))  # the second in a row opens it
    assert breaker.blocking("a")["server"] == breaker.blocking("b")["server"] == "model"
    breaker.failure("c", _failure("connection_error", "c"))  # another agent, another server
    assert breaker.blocking("c") is None
    breaker.failure("d", _failure("connection_error", "model", via="d"))  # a later agent naming it
    assert breaker.blocking("d")["server"] == "model"
    assert breaker.report() == [{**breaker.opened["model"], "blocked_agents": ["a", "b", "d"]}]
    err = ServerDownError("a", breaker.opened["model"])
    assert isinstance(err, UpstreamError) and err.server == "model" and err.kind == "server_down"
    assert (
        "server 'model' is down: 2 consecutive http_error (HTTP 503) failure(s) on /x, reported by agent b"
        in str(err)
    )
