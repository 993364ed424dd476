"""The collector's memory does not grow with the rows (issue 25); nothing here is timed.

What is proven here (each test says which part):
* ``bounded_map`` pulls a row only when a slot is free: never more than ``limit`` ahead of the rows
  whose outcome was handed out.
* ``collect_rollouts`` against a fast in-process agent: the rows taken from the materialized inputs for
  sending stay within ``num_samples_in_parallel`` + 1 of those finished, and the asyncio tasks alive within twice
  that (a rollout and the connection it may be opening) + a constant; every rollout lands.
  With the spill made tiny (so the resume bookkeeping really goes to disk), a resume sends exactly the
  missing pairs with the right attempt numbers and skips those past ``max_attempts``.
* ``RolloutCollectionHelper.run_examples`` makes a task only for a rollout that may start.
* ``aggregate_metrics`` and the resume bookkeeping (:class:`ResumeState`): tracemalloc's peak on ten
  times the rows stays within a fixed bound, and the results are those of the in-memory computation
  (a reference copy of it below), to the last bit.
* :class:`SortedSpill` (multi-level merges, repeated reads, files removed) and :class:`DiskTable`.
* The tracker's streamed rewards (:class:`RewardScan`) give the histograms and sample of the list.
"""

from __future__ import annotations

import asyncio
import functools
import math
import random
import tracemalloc
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from nemo_gym.client.server_client import ServerClient, close_shared_session
from nemo_gym.collection import collector as collector_module
from nemo_gym.collection import tracking
from nemo_gym.collection.collector import collect_rollouts
from nemo_gym.collection.dispatch import bounded_map
from nemo_gym.collection.helper import RolloutCollectionHelper
from nemo_gym.collection.options import RolloutCollectionConfig
from nemo_gym.collection.output_files import (
    ResumeState,
    _scan_existing_output,
    _scan_failures,
    _scan_terminal_failures,
    sidecar_paths,
)
from nemo_gym.config.types import BaseServerConfig
from nemo_gym.kit import rollout_stats, spill
from nemo_gym.kit.rollout_stats import aggregate_metrics, k_values, task_profile
from nemo_gym.kit.spill import DiskTable, SortedSpill
from tests.conftest import serve_app

AGENT = "fast_agent"
BOUND_S = 120


# ------------------------------------------------------------------------------------------------
# A fast agent: a bare ASGI app answering /run at once (and the head server's config route).


def fast_agent(failing: Callable[[dict[str, Any]], bool] = lambda row: False) -> Any:
    """``POST /run``: the row, a reward, a usage and a metric; 500 when ``failing(row)``.
    ``GET /global_config_dict_yaml``: a config naming this server as agent ``fast_agent``."""
    state: dict[str, Any] = {"port": 0, "failing": failing}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if scope["path"] == "/run":
            row = orjson.loads(body)
            if state["failing"](row):
                status, out = 500, orjson.dumps({"error": "scripted failure"})
            else:
                task, rollout = row["_ng_task_index"], row["_ng_rollout_index"]
                result = {
                    **row,
                    "response": {
                        "output": [],
                        "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5},
                    },
                    "reward": 1.0 if (task + rollout) % 3 else 0.0,
                    "steps": 1 + task % 4,
                }
                status, out = 200, orjson.dumps(result)
        else:
            status = 200
            out = (
                f"{AGENT}:\n  responses_api_agents:\n    fast:\n      host: 127.0.0.1\n"
                f"      port: {state['port']}\n"
            ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": out})

    app.state = state  # type: ignore[attr-defined]
    return app


def client_for(base: str) -> ServerClient:
    port = int(base.rsplit(":", 1)[1])
    return ServerClient(
        global_config_dict={AGENT: {"responses_api_agents": {"fast": {"host": "127.0.0.1", "port": port}}}},
        max_retries=0,
    )


def write_tasks(path: Path, n: int) -> Path:
    with open(path, "wb") as f:
        for i in range(n):
            row = {"responses_create_params": {"input": f"q{i}"}, "id": f"t{i}", "expected": i}
            f.write(orjson.dumps(row) + b"\n")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------------
# Lazy dispatch.


async def test_bounded_map_pulls_a_row_only_when_a_slot_is_free() -> None:
    limit, n = 16, 3000
    pulled = handed_out = most_ahead = most_tasks = 0

    def rows() -> Iterator[dict[str, Any]]:
        nonlocal pulled
        for i in range(n):
            pulled += 1
            yield {"i": i}

    async def worker(row: dict[str, Any]) -> int:
        await asyncio.sleep(0.001 if row["i"] % 7 == 0 else 0)
        return row["i"]

    async for _row, _result, exc in bounded_map(rows(), worker, limit):
        assert exc is None
        handed_out += 1
        most_ahead = max(most_ahead, pulled - handed_out)
        most_tasks = max(most_tasks, len(asyncio.all_tasks()))
    assert handed_out == pulled == n
    assert most_ahead <= limit
    assert most_tasks <= limit + 2  # this test's own task, and nothing per row


def test_collector_keeps_in_flight_rows_and_tasks_bounded_then_resumes_from_a_spill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,000 rows x 2 at 32 in flight: tasks alive and rows pulled stay within 32 + a constant. Then a
    resume with the spill made tiny (the done pairs and attempts really go through files): exactly the
    missing pairs are sent, failures carry attempt 2, and pairs past +max_attempts are skipped."""
    n_rows, repeats, limit = 2000, 2, 32
    tasks = write_tasks(tmp_path / "tasks.jsonl", n_rows)
    out = tmp_path / "rollouts.jsonl"
    side = sidecar_paths(out)
    pulled = started = ended = most_ahead = most_tasks = 0
    real_bounded_map, real_run_one = collector_module.bounded_map, collector_module.run_one

    def counting_bounded_map(rows: Any, *args: Any, **kwargs: Any) -> Any:
        def counted() -> Iterator[dict[str, Any]]:
            nonlocal pulled
            for row in rows:
                pulled += 1
                yield row

        return real_bounded_map(counted(), *args, **kwargs)

    async def watching_run_one(
        client: ServerClient, row: dict[str, Any], timeout_s: float, via: str | None = None
    ) -> dict[str, Any]:
        nonlocal started, ended, most_ahead, most_tasks
        started += 1
        most_ahead = max(most_ahead, pulled - ended)
        if started % 25 == 0:
            most_tasks = max(most_tasks, len(asyncio.all_tasks()))
        try:
            return await real_run_one(client, row, timeout_s, via)
        finally:
            ended += 1

    monkeypatch.setattr(collector_module, "bounded_map", counting_bounded_map)
    monkeypatch.setattr(collector_module, "run_one", watching_run_one)
    fails = {"on": lambda row: row["_ng_task_index"] % 50 == 7}
    app = fast_agent(lambda row: fails["on"](row))

    def collect(**options: Any) -> Any:
        cfg = RolloutCollectionConfig(
            input_jsonl_fpath=str(tasks),
            output_jsonl_fpath=str(out),
            agent_name=AGENT,
            num_repeats=repeats,
            num_samples_in_parallel=limit,
            progress=False,
            **options,
        )

        async def go() -> Any:
            try:
                return await collect_rollouts(cfg, client)
            finally:
                await close_shared_session()

        return asyncio.run(asyncio.wait_for(go(), BOUND_S))

    with serve_app(app) as base:
        client = client_for(base)
        summary = collect()
        failing_pairs = {(t, r) for t in range(n_rows) if t % 50 == 7 for r in range(repeats)}
        assert summary.rollouts_ok == n_rows * repeats - len(failing_pairs)
        assert most_ahead <= limit + 1, most_ahead  # the rows in flight, and the one being started
        # Each rollout in flight, and at most one connection being opened for each (the transport opens
        # them in tasks), and this run's own: nothing per row.
        assert most_tasks <= 2 * limit + 3, most_tasks
        assert {
            (f["_ng_task_index"], f["_ng_rollout_index"], f["attempt"]) for f in read_jsonl(side["failures"])
        } == {(*p, 1) for p in failing_pairs}

        # Drop every other whole rollout; make the spill tiny so the resume bookkeeping uses files.
        lines = out.read_bytes().splitlines(keepends=True)
        out.write_bytes(b"".join(lines[::2]))
        dropped = {(r["_ng_task_index"], r["_ng_rollout_index"]) for r in map(orjson.loads, lines[1::2])}
        tiny_spill(monkeypatch, max_in_memory=50, fan_in=3, block=7)
        sent: list[tuple[int, int]] = []
        real_failing = app.state["failing"]

        def recording(row: dict[str, Any]) -> bool:
            sent.append((row["_ng_task_index"], row["_ng_rollout_index"]))
            return real_failing(row)

        app.state["failing"] = recording
        fails["on"] = lambda row: row["_ng_task_index"] % 100 == 7  # half of them fail again
        pulled = started = ended = most_ahead = 0
        summary = collect(resume_from_cache=True, max_attempts=2)
        assert sorted(sent) == sorted(dropped | failing_pairs)
        assert most_ahead <= limit + 1
        still = {p for p in failing_pairs if p[0] % 100 == 7}
        assert summary.rollouts_missing == len(still)
        second = [f for f in read_jsonl(side["failures"]) if f["attempt"] == 2]
        assert {(f["_ng_task_index"], f["_ng_rollout_index"]) for f in second} == still

        # A third run: those failed twice (+max_attempts=2): skipped, nothing sent.
        sent.clear()
        summary = collect(resume_from_cache=True, max_attempts=2)
        assert sent == [] and summary.skipped_after_max_attempts == len(still)
        assert summary.rollouts_missing == len(still) and summary.not_attempted == 0
    done = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in read_jsonl(out)]
    assert len(done) == len(set(done)) == n_rows * repeats - len(still)


async def test_run_examples_makes_a_task_only_for_a_rollout_that_may_start() -> None:
    """500 examples at 8 in flight: never more than 8 rollout tasks (the old way made 500 at once)."""
    app = fast_agent()
    with serve_app(app) as base:
        port = int(base.rsplit(":", 1)[1])
        app.state["port"] = port
        examples = [
            {
                "responses_create_params": {"input": "q"},
                "agent_ref": {"name": AGENT},
                "_ng_task_index": i,
                "_ng_rollout_index": 0,
            }
            for i in range(500)
        ]
        helper = RolloutCollectionHelper(num_samples_in_parallel=8)
        baseline = len(asyncio.all_tasks())
        most = 0
        rows_back = []
        try:
            futures = helper.run_examples(
                examples, head_server_config=BaseServerConfig(host="127.0.0.1", port=port)
            )
            for future in futures:
                most = max(most, len(asyncio.all_tasks()) - baseline)
                row, result = await asyncio.wait_for(future, BOUND_S)
                assert row is examples[row["_ng_task_index"]] and result["reward"] in (0.0, 1.0)
                rows_back.append(row["_ng_task_index"])
        finally:
            await helper.aclose()
    assert sorted(rows_back) == list(range(500))
    assert most <= 8 + 1, most  # the rollouts in flight and the task that starts them


# ------------------------------------------------------------------------------------------------
# Aggregate metrics: bounded memory, the in-memory results.


def reference_aggregate_metrics(
    path: Path, pass_threshold: float = 1.0, max_k: int | None = None, task_rows_path: Path | None = None
) -> dict[str, Any]:
    """aggregate_metrics as it was computed with everything in memory (the reference for the results)."""
    stats: dict[str, rollout_stats.RunningStat] = defaultdict(rollout_stats.RunningStat)
    tokens = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
    tasks: dict[int, list[float]] = defaultdict(list)
    fields = rollout_stats.task_row_fields(task_rows_path) if task_rows_path is not None else {}
    rows = rollout_stats.ScoredRows(path)
    for task, reward, row in rows:
        data_fields = fields.get(task, frozenset())
        for key, value in row.items():
            if key in rollout_stats.INDEX_FIELDS or (key in data_fields and key != "reward"):
                continue
            x = rollout_stats._numeric(value)
            if x is not None:
                stats[key].add(x)
        tasks[task].append(reward)
        usage = rollout_stats._usage(row)
        for key in tokens:
            count = usage.get(key)
            tokens[key] += count if isinstance(count, int) and not isinstance(count, bool) else 0
    k_max = max_k or max((len(v) for v in tasks.values()), default=1)
    per_task = {str(t): task_profile(r, k_max, pass_threshold) for t, r in sorted(tasks.items())}
    metrics: dict[str, Any] = {
        "num_rollouts": stats["reward"].n if "reward" in stats else 0,
        "malformed_lines": rows.malformed,
    }
    for key, st in sorted(stats.items()):
        metrics[f"mean/{key}"] = st.mean
        metrics[f"std/{key}"] = st.std
    metrics["tokens"] = tokens
    metrics["num_tasks"] = len(per_task)
    for k in k_values(k_max):
        values = [p.get(f"pass@{k}") for p in per_task.values()]
        if values and None not in values:
            metrics[f"pass@{k}"] = sum(values) / len(values)
    if len(per_task) <= rollout_stats.MAX_PER_TASK_IN_METRICS:
        metrics["per_task"] = per_task
    else:
        metrics["per_task"] = (
            f"{len(per_task)} tasks: too many to list here; run ng_reward_profile for the per-task file"
        )
    return metrics


def write_rollouts(
    tmp: Path, n_tasks: int, repeats: int, seed: int, shuffle: bool = True
) -> tuple[Path, Path]:
    """A rollouts file (completion order: shuffled) and its materialized inputs, with odd lines."""
    rnd = random.Random(seed)
    materialized, rollouts = [], []
    for t in range(n_tasks):
        base = {"responses_create_params": {"input": "q"}, "id": f"t{t}", "truth": t * 1.5}
        if t % 7 == 0:
            base["extra"] = 3
        for r in range(repeats):
            materialized.append({**base, "_ng_task_index": t, "_ng_rollout_index": r})
            if rnd.random() < 0.9:
                usage = {"input_tokens": rnd.randint(1, 9), "output_tokens": 2, "total_tokens": 5}
                reward: Any = rnd.choice([0.0, 1.0, 0.5, rnd.random()]) if rnd.random() > 0.03 else "bad"
                rollouts.append(
                    {**base, "_ng_task_index": t, "_ng_rollout_index": r, "reward": reward,
                     "score": rnd.random() * 10, "response": {"usage": usage}}
                )  # fmt: skip
    if shuffle:
        rnd.shuffle(rollouts)
    lines = [orjson.dumps(r) for r in rollouts]
    lines.insert(len(lines) // 2, b"not json")
    lines.append(orjson.dumps({"reward": 1.0}))  # no task index: task -1
    out, mat = tmp / f"rollouts_{seed}.jsonl", tmp / f"materialized_{seed}.jsonl"
    out.write_bytes(b"\n".join(lines) + b"\n")
    mat.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in materialized))
    return out, mat


def tiny_spill(
    monkeypatch: pytest.MonkeyPatch, max_in_memory: int = 7, fan_in: int = 3, block: int = 5
) -> None:
    """Make every SortedSpill made from now on spill (and merge) after a few records."""
    monkeypatch.setattr(spill, "DEFAULT_MAX_IN_MEMORY", max_in_memory)
    monkeypatch.setattr(spill, "DEFAULT_FAN_IN", fan_in)
    monkeypatch.setattr(spill, "DEFAULT_BLOCK", block)


@pytest.mark.parametrize("seed", range(4))
def test_aggregate_metrics_streamed_equal_the_in_memory_ones_to_the_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    n_tasks, repeats = [(1, 3), (40, 4), (300, 2), (97, 5)][seed]
    out, mat = write_rollouts(tmp_path, n_tasks, repeats, seed, shuffle=seed != 1)
    # (per_task listed or too many to list, spilled to files or not, max_k given or not, task rows or not)
    for cap, spilled, max_k, rows_path in (
        (10_000, False, None, None),
        (20, False, repeats, mat),
        (10_000, True, repeats, mat),
        (20, True, None, mat),
    ):
        monkeypatch.setattr(rollout_stats, "MAX_PER_TASK_IN_METRICS", cap)
        if spilled:
            tiny_spill(monkeypatch)
        args = {"pass_threshold": 0.5, "max_k": max_k, "task_rows_path": rows_path}
        got, want = aggregate_metrics(out, **args), reference_aggregate_metrics(out, **args)
        assert orjson.dumps(got) == orjson.dumps(want)  # same keys, same order, same bits


def tracemalloc_peak(fn: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_aggregate_metrics_memory_does_not_grow_with_the_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,200 vs 12,000 rollouts (300 vs 3,000 tasks), the spill's buffer at 100 records: the peak grows
    by less than 0.8 MB (measured: 0.16 MB; holding the rewards, per-task profiles and task fields in
    memory, as before, grew it by 2.7 MB)."""
    tiny_spill(monkeypatch, max_in_memory=100, fan_in=4, block=32)
    monkeypatch.setattr(rollout_stats, "MAX_PER_TASK_IN_METRICS", 100)
    peaks = []
    for n_tasks in (300, 3_000):
        out, mat = write_rollouts(tmp_path, n_tasks, 4, seed=n_tasks)
        peaks.append(tracemalloc_peak(functools.partial(aggregate_metrics, out, max_k=4, task_rows_path=mat)))
    assert peaks[1] - peaks[0] < 800_000, peaks


# ------------------------------------------------------------------------------------------------
# Resume bookkeeping: bounded memory, the sets' results.


def write_resume_files(tmp: Path, n_pairs: int, seed: int) -> tuple[Path, Path]:
    """An output (done pairs, shuffled, some twice, junk lines, a cut tail) and a failures file."""
    rnd = random.Random(seed)
    keys = [(t, r) for t in range(n_pairs // 2) for r in range(2)]
    done = [k for k in keys if rnd.random() < 0.6]
    done += rnd.sample(done, len(done) // 20)  # a pair written twice
    rnd.shuffle(done)
    lines = [
        orjson.dumps({"_ng_task_index": t, "_ng_rollout_index": r, "reward": 1.0}) + b"\n" for t, r in done
    ]
    lines.insert(len(lines) // 3, b"{broken\n")
    lines.insert(
        len(lines) // 2, orjson.dumps({"_ng_task_index": 1, "_ng_rollout_index": 0, "reward": "x"}) + b"\n"
    )
    out = tmp / f"out_{seed}.jsonl"
    out.write_bytes(b"".join(lines) + b'{"_ng_task_index": 0, "_ng_rollo')  # a tail cut by a hard kill
    failures = []
    for t, r in rnd.sample(keys, len(keys) // 5):
        for attempt in range(1, rnd.randint(1, 4)):
            record = {"_ng_task_index": t, "_ng_rollout_index": r, "attempt": attempt, "kind": "server_error"}
            if rnd.random() < 0.1:
                record["_ng_failure_terminal"] = True
            failures.append(orjson.dumps(record) + b"\n")
    rnd.shuffle(failures)
    fail = tmp / f"failures_{seed}.jsonl"
    fail.write_bytes(b"".join(failures) + b"[1, 2]\n")
    return out, fail


@pytest.mark.parametrize("seed", range(4))
def test_resume_state_gives_what_the_in_memory_scans_give(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    out, fail = write_resume_files(tmp_path, [10, 200, 1000, 3000][seed], seed)
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(out.read_bytes())
    done, bad = _scan_existing_output(copy)
    attempts, terminal = _scan_failures(fail), _scan_terminal_failures(fail)
    exhausted = {k for k, a in attempts.items() if (a >= 3 or k in terminal) and k not in done}
    tiny_spill(monkeypatch, max_in_memory=seed * 40 + 3)
    state = ResumeState(out, fail, max_attempts=3)
    try:
        assert out.read_bytes() == copy.read_bytes()  # the tail repaired the same way
        assert (state.n_done, state.n_exhausted, state.unreadable) == (len(done), len(exhausted), bad)
        statuses = list(state.statuses())
        assert [s.key for s in statuses] == sorted(done | set(attempts))
        for s in statuses:
            assert s.done == (s.key in done) and s.failed == (s.key in attempts)
            assert s.attempts == attempts.get(s.key, 0) and s.terminal == (s.key in terminal)
            assert s.exhausted == (s.key in exhausted)
        assert list(state.statuses()) == statuses  # read again: the same
    finally:
        state.close()


def test_resume_bookkeeping_memory_does_not_grow_with_the_pairs_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,500 vs 15,000 pairs, the spill's buffer at 300 records: the peak of scanning and walking them
    grows by less than 0.8 MB (measured: about 0; the sets of the pairs done and attempted, as before,
    grew it by 1.5 MB)."""
    tiny_spill(monkeypatch, max_in_memory=300, fan_in=4, block=32)
    peaks = []
    for n in (1_500, 15_000):
        out, fail = write_resume_files(tmp_path, n, seed=n)

        def scan_and_walk(out: Path = out, fail: Path = fail) -> None:
            state = ResumeState(out, fail, max_attempts=3)
            try:
                for _ in state.statuses():
                    pass
            finally:
                state.close()

        peaks.append(tracemalloc_peak(scan_and_walk))
    assert peaks[1] - peaks[0] < 800_000, peaks


# ------------------------------------------------------------------------------------------------
# The building blocks.


def test_sorted_spill_merges_levels_reads_again_and_removes_its_files() -> None:
    rnd = random.Random(5)
    records = [(rnd.randint(0, 300), rnd.random(), f"s{i}") for i in range(5000)]
    with SortedSpill(max_in_memory=37, fan_in=3, block=4) as s:
        for r in records:
            s.add(r)
        assert s._dir is not None and any(s._dir.iterdir())
        where = s._dir
        assert list(s) == sorted(records)
        assert list(s) == sorted(records)  # as often as asked
        assert s.count == len(records)
    assert not where.exists()
    with SortedSpill() as small:  # nothing spilled: no files at all
        for r in reversed(records[:10]):
            small.add(r)
        assert list(small) == sorted(records[:10]) and small._dir is None


def test_disk_table_keeps_the_first_value_per_key_beyond_its_cache() -> None:
    rnd = random.Random(1)
    want: dict[int, int] = {}
    with DiskTable(block_entries=8, cache_blocks=2, max_key=10_000) as table:
        for _ in range(3000):
            key, value = rnd.randint(0, 12_000), rnd.randint(1, 2**32 - 1)
            table.set_first(key, value)
            want.setdefault(key, value)
        assert all(table.get(k) == v for k, v in want.items())
        assert all(table.get(k) == 0 for k in range(12_000) if k not in want)
        with pytest.raises(ValueError):
            table.set_first(1, 0)


def test_reward_scan_gives_the_histograms_and_sample_of_the_list(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    rnd = random.Random(3)
    for case, values in enumerate(
        [
            [],
            [0.5] * 7,
            [rnd.choice([0.0, 1 / 3, 2 / 3, 1.0]) for _ in range(999)],
            [rnd.random() for _ in range(2000)],
        ]
    ):
        rows = [{"_ng_task_index": i, "reward": v, "response": {"output": []}} for i, v in enumerate(values)]
        rows.insert(len(rows) // 2, {"reward": "none"})
        path = tmp_path / f"r{case}.jsonl"
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
        for n_sample in (0, 3, 50):
            rewards, sample = tracking.read_rewards_and_sample(path, n_sample)
            scan = tracking.RewardScan(path, n_sample)
            assert scan.sample == sample and scan.n == len(rewards)
            assert orjson.dumps(scan.histogram) == orjson.dumps(tracking.reward_histogram(rewards))
            if rewards:
                counts, edges = np.histogram(rewards, bins=tracking.HISTOGRAM_BINS)
                got_counts, got_edges = scan.numpy_histogram(chunk=17)
                assert got_counts.tolist() == counts.tolist() and got_edges.tolist() == edges.tolist()
                assert math.isclose(sum(got_counts.tolist()), len(rewards))
