"""ng_viewer's index and dataset, in process: offsets, per-row facts, the cache, search, summaries.

Every expected number comes from the rows written by ``tests/test_viewer_support.py``.
"""

from __future__ import annotations

import math
import os
import stat
import statistics
from pathlib import Path
from typing import cast

import orjson
import pytest

from nemo_gym.tools.viewer.compare import compare
from nemo_gym.tools.viewer.dataset import Dataset
from nemo_gym.tools.viewer.index import RolloutIndex, cache_path_for
from nemo_gym.tools.viewer.query import Filters, QueryError, parse_task_spec
from nemo_gym.tools.viewer.row_facts import (
    FLAG_MISSING_OUTPUT,
    FLAG_NO_REWARD,
    FLAG_RESPONSE_ERROR,
    FLAG_TOOL_ERROR,
    looks_like_error,
    summarize_row,
)
from nemo_gym.tools.viewer.search import search_patterns
from tests.test_viewer_support import (
    AGENT,
    MALFORMED_A,
    NEEDLE,
    OTHER_AGENT,
    REWARDS_A,
    REWARDS_B,
    ViewerFiles,
    rollout,
    write_files,
)

WAIT_S = 30.0


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The default index cache directory, moved into the test's temp directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg_cache"))
    return tmp_path / "xdg_cache" / "nemo_gym" / "viewer"


@pytest.fixture
def files(tmp_path: Path) -> ViewerFiles:
    return write_files(tmp_path / "data")


def data_dir_listing(files: ViewerFiles) -> list[str]:
    return sorted(p.name for p in files.a.parent.iterdir())


DATA_FILES = ["rollouts_a.jsonl", "rollouts_a_failures.jsonl", "rollouts_b.jsonl"]


def open_ds(path: Path, file_id: str = "1", cache_dir: Path | None = None) -> Dataset:
    ds = Dataset(file_id, path, cache_dir=str(cache_dir) if cache_dir else None).start()
    assert ds.wait_ready(WAIT_S), "indexing did not finish"
    assert ds.state == "ready", ds.error
    return ds


# ------------------------------------------------------------------------------------------------
# Index.


def test_index_offsets_facts_and_malformed_lines(files: ViewerFiles) -> None:
    idx = RolloutIndex.open(files.a)
    assert len(idx) == len(files.rows_a) == 18
    assert list(idx.columns["line_no"]) == files.lines_a
    for i, row in enumerate(files.rows_a):
        assert idx.read_row(i) == row  # the offsets point at exactly that line
    assert [(m.line_no, m.snippet) for m in idx.malformed_lines()] == [
        (n, t.decode()) for n, t in sorted(MALFORMED_A.items())
    ]
    assert idx.malformed[0].error.startswith("not valid JSON")
    assert idx.malformed[1].error == "a rollout must be a JSON object, got list"
    assert list(idx.columns["reward"]) == [float(r) for rs in REWARDS_A.values() for r in rs]
    assert list(idx.columns["task"]) == [t for t, rs in REWARDS_A.items() for _ in rs]
    assert list(idx.columns["rollout"]) == [r for rs in REWARDS_A.values() for r in range(len(rs))]
    assert idx.agents == [AGENT, OTHER_AGENT]
    assert [idx.agent_name(i) for i in range(len(idx))] == [row["agent_ref"]["name"] for row in files.rows_a]
    assert list(idx.columns["input_tokens"]) == [r["response"]["usage"]["input_tokens"] for r in files.rows_a]
    assert list(idx.columns["total_tokens"]) == [r["response"]["usage"]["total_tokens"] for r in files.rows_a]
    assert idx.previews[0] == "What's the weather like in Paris right now?"
    by_key = {(r["_ng_task_index"], r["_ng_rollout_index"]): i for i, r in enumerate(files.rows_a)}
    # Tool calls and model turns: call -> output -> answer is two turns; two calls make three.
    assert idx.columns["tool_calls"][by_key[0, 0]] == 1 and idx.columns["turns"][by_key[0, 0]] == 2
    assert idx.columns["tool_calls"][by_key[2, 2]] == 2 and idx.columns["turns"][by_key[2, 2]] == 3
    assert idx.columns["turns"][by_key[3, 1]] == 2  # reasoning + call are one turn
    assert idx.columns["tool_errors"][by_key[1, 2]] == 1
    assert idx.columns["flags"][by_key[1, 2]] == FLAG_TOOL_ERROR
    assert sum(1 for f in idx.columns["flags"] if f) == 1


def test_summarize_row_flags() -> None:
    row = rollout(0, 0, 1.0)
    row["response"]["output"] = [o for o in row["response"]["output"] if o["type"] != "function_call_output"]
    row["response"]["status"] = "incomplete"
    del row["reward"]
    facts = summarize_row(row)
    assert facts.flags == FLAG_MISSING_OUTPUT | FLAG_RESPONSE_ERROR | FLAG_NO_REWARD
    assert math.isnan(facts.reward)
    assert summarize_row({"reward": True}).flags & FLAG_NO_REWARD  # a bool is not a reward
    bare = summarize_row({})
    assert (bare.task, bare.rollout, bare.agent, bare.turns, bare.tool_calls) == (-1, -1, "", 0, 0)


@pytest.mark.parametrize(
    ("output", "is_error"),
    [
        ("Error: tool 'x' failed: ValueError: boom", True),
        ("  error: bad arguments", True),
        ("Traceback (most recent call last):\n  File ...", True),
        ('{"error": "city not found"}', True),
        ('{"error": null, "weather": "sunny"}', False),
        ('{"weather": "no errors today"}', False),
        ("The errors were fixed.", False),
        ([{"type": "input_text", "text": "Error: nope"}], True),
    ],
)
def test_looks_like_error(output: object, is_error: bool) -> None:
    assert looks_like_error(output) is is_error


def test_index_cache_is_keyed_by_size_and_mtime(files: ViewerFiles, private_cache: Path) -> None:
    first = RolloutIndex.open(files.a)
    assert first.cache_path == cache_path_for(files.a) and first.cache_path.is_file()
    assert first.cache_path.parent == private_cache
    assert not first.loaded_from_cache
    assert data_dir_listing(files) == DATA_FILES  # nothing written beside the data
    second = RolloutIndex.open(files.a)
    assert second.loaded_from_cache
    assert {k: list(v) for k, v in second.columns.items()} == {k: list(v) for k, v in first.columns.items()}
    assert second.previews == first.previews
    assert [m.as_dict() for m in second.malformed_lines()] == [m.as_dict() for m in first.malformed_lines()]
    # Same size, new content, new mtime: rebuilt from scratch.
    data = files.a.read_bytes().replace(b'"reward":1,', b'"reward":0,', 1)
    assert data != files.a.read_bytes() and len(data) == files.a.stat().st_size
    files.a.write_bytes(data)
    st = files.a.stat()
    os.utime(files.a, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    third = RolloutIndex.open(files.a)
    assert not third.loaded_from_cache
    assert third.columns["reward"][0] == 0.0
    # A cache file that is not ours (garbage) is ignored and replaced.
    third.cache_path.write_bytes(b"garbage")
    fourth = RolloutIndex.open(files.a)
    assert not fourth.loaded_from_cache and len(fourth) == 18


def test_index_dir_keeps_the_data_directory_clean(files: ViewerFiles, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    idx = RolloutIndex.open(files.a, cache_dir=cache_dir)
    assert idx.cache_path is not None and idx.cache_path.parent == cache_dir
    assert stat.S_IMODE(idx.cache_path.stat().st_mode) == 0o600
    assert not cast(Path, cache_path_for(files.a)).exists()
    assert data_dir_listing(files) == DATA_FILES
    assert RolloutIndex.open(files.a, cache_dir=cache_dir).loaded_from_cache


def test_cache_file_is_private_whatever_the_umask(files: ViewerFiles, private_cache: Path) -> None:
    private_cache.mkdir(parents=True)
    os.chmod(private_cache, 0o755)  # left loose by someone: tightened
    old = os.umask(0)
    try:
        idx = RolloutIndex.open(files.a)
        with open(files.a, "ab") as f:
            f.write(orjson.dumps(rollout(6, 0, 0.75)) + b"\n")
        assert idx.refresh()  # rewrites the cache (atomically, through a temporary file)
    finally:
        os.umask(old)
    assert idx.cache_path is not None and idx.cache_path.parent == private_cache
    assert stat.S_IMODE(private_cache.stat().st_mode) == 0o700
    assert stat.S_IMODE(idx.cache_path.stat().st_mode) == 0o600
    assert [p.name for p in private_cache.iterdir()] == [idx.cache_path.name]  # no temporary file left
    assert RolloutIndex.open(files.a).loaded_from_cache


def test_files_with_the_same_name_get_their_own_cache(files: ViewerFiles, tmp_path: Path) -> None:
    other = tmp_path / "elsewhere" / files.a.name
    other.parent.mkdir()
    other.write_bytes(files.b.read_bytes())
    a, b = RolloutIndex.open(files.a), RolloutIndex.open(other)
    assert a.cache_path != b.cache_path
    assert (len(RolloutIndex.open(files.a)), len(RolloutIndex.open(other))) == (18, 21)
    assert RolloutIndex.open(other).loaded_from_cache


def test_without_a_usable_cache_dir_the_index_stays_in_memory(
    files: ViewerFiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    idx = RolloutIndex.open(files.a)
    assert len(idx) == 18 and idx.cache_path is None
    assert data_dir_listing(files) == DATA_FILES  # no fallback beside the data (nor in a shared temp dir)


def test_appended_rows_index_only_the_new_bytes(files: ViewerFiles) -> None:
    idx = RolloutIndex.open(files.a)
    # Change row 0 in place without changing its length: an append-only update must not re-read it.
    data = files.a.read_bytes()
    changed = data.replace(b'"reward":1,', b'"reward":0,', 1)
    assert changed != data
    files.a.write_bytes(changed)
    with open(files.a, "ab") as f:
        f.write(orjson.dumps(rollout(6, 0, 0.75)) + b"\n")
    assert idx.refresh()
    assert len(idx) == 19
    assert idx.columns["reward"][0] == 1.0  # not re-read
    assert (idx.columns["task"][18], idx.columns["reward"][18], idx.columns["line_no"][18]) == (6, 0.75, 21)
    reopened = RolloutIndex.open(files.a)  # the cache was extended too
    assert reopened.loaded_from_cache and len(reopened) == 19


def test_partial_last_line_is_left_for_the_next_refresh(files: ViewerFiles) -> None:
    line = orjson.dumps(rollout(6, 0, 0.5))
    with open(files.a, "ab") as f:
        f.write(line[:40])
    idx = RolloutIndex.open(files.a)
    assert len(idx) == 18
    pending = idx.malformed_lines()[-1]
    assert pending.line_no == 21 and pending.error.startswith("incomplete last line")
    assert idx.malformed_count == 3
    with open(files.a, "ab") as f:
        f.write(line[40:] + b"\n")
    assert idx.refresh()
    assert len(idx) == 19 and idx.malformed_count == 2
    assert idx.read_row(18) == rollout(6, 0, 0.5)


def test_rewritten_file_is_detected(files: ViewerFiles) -> None:
    ds = open_ds(files.a)
    assert ds.read_rollout(0) == orjson.dumps(files.rows_a[0])
    files.a.write_bytes(files.b.read_bytes())
    with pytest.raises(QueryError, match="changed on disk"):
        ds.read_rollout(0)
    assert ds.refresh()
    assert len(ds.require()) == len(files.rows_b)


def test_missing_and_unreadable_paths(tmp_path: Path) -> None:
    ds = Dataset("1", tmp_path / "nope.jsonl").start()
    assert ds.wait_ready(WAIT_S)
    assert ds.state == "error" and "does not exist" in (ds.error or "")
    d = Dataset("2", tmp_path).start()
    assert d.wait_ready(WAIT_S)
    assert d.state == "error" and "not a regular file" in (d.error or "")


# ------------------------------------------------------------------------------------------------
# Filters, sort, search.


def ids_of(ds: Dataset, files: ViewerFiles, **kw: object) -> list[tuple[int, int]]:
    sort = str(kw.pop("sort", "row"))
    desc = bool(kw.pop("desc", False))
    ids, _ = ds.select(Filters(**kw), sort, desc, wait_s=WAIT_S)  # type: ignore[arg-type]
    return [(files.rows_a[i]["_ng_task_index"], files.rows_a[i]["_ng_rollout_index"]) for i in ids]


def test_filters_and_sorting(files: ViewerFiles) -> None:
    ds = open_ds(files.a)
    every = [(t, r) for t, rs in REWARDS_A.items() for r in range(len(rs))]
    assert ids_of(ds, files) == every
    assert ids_of(ds, files, reward_min=0.3, reward_max=0.9) == [(2, 2)]
    assert ids_of(ds, files, reward_min=1.0) == [(t, r) for t, r in every if REWARDS_A[t][r] >= 1]
    assert ids_of(ds, files, tasks=parse_task_spec("1, 3-4")) == [(t, r) for t, r in every if t in (1, 3, 4)]
    assert ids_of(ds, files, agent=OTHER_AGENT) == [(5, 0), (5, 1), (5, 2)]
    assert ids_of(ds, files, agent="nobody") == []
    assert ids_of(ds, files, errors_only=True) == [(1, 2)]
    by_reward = ids_of(ds, files, sort="reward", desc=True)
    assert [REWARDS_A[t][r] for t, r in by_reward] == sorted(
        (REWARDS_A[t][r] for t, r in every), reverse=True
    )
    assert by_reward[:5] == [(0, 0), (0, 1), (0, 2), (2, 0), (3, 0)]  # ties keep file order
    assert ids_of(ds, files, sort="row", desc=True) == every[::-1]
    tokens = ids_of(ds, files, sort="total_tokens")
    assert [files.rows_a[every.index(k)]["response"]["usage"]["total_tokens"] for k in tokens] == sorted(
        r["response"]["usage"]["total_tokens"] for r in files.rows_a
    )
    page = ds.rows_page(Filters(tasks=((2, 2),)), "reward", True, 1, 1)
    assert page["total"] == 3 and page["all"] == 18
    assert [(r["task"], r["rollout"], r["reward"], r["line_no"]) for r in page["rows"]] == [
        (2, 2, 0.5, files.lines_a[8])
    ]
    with pytest.raises(QueryError, match="cannot sort by"):
        ds.select(Filters(), "nonsense", False)
    with pytest.raises(QueryError, match="limit"):
        ds.rows_page(Filters(), "row", False, 0, 0)


def test_rows_without_a_reward_sort_last_and_fail_reward_filters(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    rows = [rollout(0, 0, 0.5), {**rollout(0, 1, 0.0), "reward": None}, rollout(0, 2, 1.0)]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    ds = open_ds(path)
    assert ds.select(Filters(), "reward", True)[0] == [2, 0, 1]
    assert ds.select(Filters(), "reward", False)[0] == [0, 2, 1]
    assert ds.select(Filters(reward_min=-1e9), "row", False)[0] == [0, 2]
    assert ds.row_summary(1)["reward"] is None


def test_parse_task_spec() -> None:
    assert parse_task_spec("3, 5,10-20") == ((3, 3), (5, 5), (10, 20))
    for bad in ("x", "5-3", "1-b"):
        with pytest.raises(QueryError):
            parse_task_spec(bad)


def test_full_text_search(files: ViewerFiles) -> None:
    ds = open_ds(files.a)
    assert ids_of(ds, files, text=NEEDLE) == [(4, 0)]  # inside a tool output, not in any preview
    assert ids_of(ds, files, text=NEEDLE.upper()) == [(4, 0)]  # ASCII case-insensitive
    assert ids_of(ds, files, text="unknown city 'Atlantis'") == [(1, 2)]
    # Text with quotes is found in its JSON-escaped form (arguments are a JSON string inside JSON).
    assert ids_of(ds, files, text='{"city":"Lagos"}') == [(1, 0), (1, 1), (1, 2)]
    assert ids_of(ds, files, text="Lagos", reward_min=1.0) == []
    assert ids_of(ds, files, text="Lagos", tasks=((1, 1),), sort="row", desc=True) == [(1, 2), (1, 1), (1, 0)]
    assert ids_of(ds, files, text="no such text anywhere") == []
    # Text that only occurs in a malformed line matches nothing.
    assert ids_of(ds, files, text="broken") == []
    _, status = ds.select(Filters(text="Oslo"), "row", False, wait_s=WAIT_S)
    assert status is not None and status.pop("seconds") >= 0
    assert status == {
        "text": "Oslo",
        "done": True,
        "scanned": 18,
        "total": 18,
        "matches": 4,
        "error": None,
    }  # task 4 x3 + the two-call rollout


def test_search_patterns() -> None:
    assert search_patterns("abc") == [b"abc"]
    pats = search_patterns('say "hi"')
    assert b'say "hi"' in pats and b'say \\"hi\\"' in pats and b'say \\\\\\"hi\\\\\\"' in pats
    assert search_patterns("café") == ["café".encode(), b"caf\\u00e9"]


def test_search_finds_matches_across_block_boundaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nemo_gym.tools.viewer.search as search_mod

    monkeypatch.setattr(search_mod, "SEARCH_BLOCK_BYTES", 1)  # one row per block
    path = tmp_path / "r.jsonl"
    rows = [rollout(t % 7, t, 1.0) for t in range(30)]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    ds = open_ds(path)
    ids, status = ds.select(Filters(text="Quito"), "row", False, wait_s=WAIT_S)
    assert ids == [i for i in range(30) if i % 7 == 6]
    assert status is not None and status["done"] and status["scanned"] == 30


# ------------------------------------------------------------------------------------------------
# Summary, per-task table, failures, comparison.


def test_summary_and_tasks(files: ViewerFiles) -> None:
    ds = open_ds(files.a)
    s = ds.summary()
    rewards = [float(r) for rs in REWARDS_A.values() for r in rs]
    assert s["rows"] == 18 and s["scored"] == 18 and s["num_tasks"] == 6
    assert s["mean_reward"] == pytest.approx(statistics.fmean(rewards))
    assert s["std_reward"] == pytest.approx(statistics.pstdev(rewards))
    assert s["pass_rate"] == pytest.approx(sum(r >= 1 for r in rewards) / 18)
    assert s["histogram"]["kind"] == "values"
    assert [(b["lo"], b["count"]) for b in s["histogram"]["bins"]] == [
        (0.0, 7),
        (0.25, 3),
        (0.5, 1),
        (1.0, 7),
    ]
    assert s["pass_at_k"]["pass@1"] == pytest.approx(
        statistics.fmean(sum(r >= 1 for r in rs) / 3 for rs in REWARDS_A.values())
    )
    assert s["pass_at_k"]["pass@2"] == pytest.approx((1 + 0 + 2 / 3 + 1 + 2 / 3 + 0) / 6)
    assert s["malformed_total"] == 2 and [m["line_no"] for m in s["malformed"]] == sorted(MALFORMED_A)
    assert s["error_rollouts"] == 1
    assert s["agents"] == {AGENT: 15, OTHER_AGENT: 3}
    assert s["tokens"]["total_tokens"] == sum(r["response"]["usage"]["total_tokens"] for r in files.rows_a)
    f = s["failures"]
    assert f["present"] and f["total"] == 2 and f["malformed"] == 1
    assert f["by_kind"] == {"timeout": 1, "server_error": 1}
    assert [(r["task"], r["rollout"], r["attempt"], r["kind"]) for r in f["rows"]] == [
        (2, 1, 1, "timeout"),
        (4, 2, 2, "server_error"),
    ]

    by_rate = ds.tasks_page("pass_rate", True, 0, 50)
    assert by_rate["total"] == 6
    assert [(r["task"], r["pass_rate"]) for r in by_rate["rows"]] == [
        (0, 1.0),
        (3, pytest.approx(2 / 3)),
        (2, pytest.approx(1 / 3)),
        (4, pytest.approx(1 / 3)),
        (1, 0.0),
        (5, 0.0),
    ]
    t2 = next(r for r in ds.tasks_page("task", False, 0, 50)["rows"] if r["task"] == 2)
    assert (
        t2["mean_reward"] == pytest.approx(0.5)
        and t2["passed"] == 1
        and t2["mean_tool_calls"] == pytest.approx(4 / 3)
    )
    assert ds.tasks_page("mean_reward", False, 2, 2)["rows"][0]["task"] == 4  # (1: 0, 5: .25, 4: 1/3, ...)
    with pytest.raises(QueryError):
        ds.tasks_page("bogus", False, 0, 10)


def test_failures_sidecar_absent(files: ViewerFiles) -> None:
    ds = open_ds(files.b)
    f = ds.summary()["failures"]
    assert f["present"] is False and f["total"] == 0 and f["path"].endswith("rollouts_b_failures.jsonl")


def test_compare(files: ViewerFiles) -> None:
    a, b = open_ds(files.a, "1"), open_ds(files.b, "2")
    c = compare(a, b, "task", False, 0, 50)
    assert (c["tasks_both"], c["tasks_only_a"], c["tasks_only_b"]) == (6, 0, 1)
    deltas = {r["task"]: r["delta"] for r in c["rows"]}
    expected = {t: statistics.fmean(REWARDS_B[t]) - statistics.fmean(REWARDS_A[t]) for t in REWARDS_A}
    assert {t: deltas[t] for t in REWARDS_A} == pytest.approx(expected)
    assert deltas[6] is None
    assert (c["improved"], c["regressed"], c["unchanged"]) == (2, 1, 3)
    assert c["prompt_mismatches"] == 0
    assert c["mean_delta"] == pytest.approx(statistics.fmean(expected.values()))
    top = compare(a, b, "delta", True, 0, 2)["rows"]
    assert [(r["task"], r["delta"]) for r in top] == [(1, 1.0), (4, pytest.approx(1 / 3))]
    assert [r["task"] for r in compare(a, b, "task", False, 0, 50, only="regressed")["rows"]] == [0]
    assert [r["task"] for r in compare(a, b, "task", False, 0, 50, only="only_b")["rows"]] == [6]
    with pytest.raises(QueryError):
        compare(a, b, "task", False, 0, 50, only="sideways")


def test_compare_flags_files_of_different_tasks(files: ViewerFiles, tmp_path: Path) -> None:
    other = tmp_path / "other.jsonl"
    rows = [rollout((t + 1) % 7, r, 1.0) for t in range(6) for r in range(3)]
    for row, t in zip(rows, [t for t in range(6) for _ in range(3)], strict=True):
        row["_ng_task_index"] = t  # same indices, different prompts
    other.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    c = compare(open_ds(files.a, "1"), open_ds(other, "2"), "task", False, 0, 50)
    assert c["prompt_mismatches"] == 6
    assert all(r["prompt_differs"] for r in c["rows"])
