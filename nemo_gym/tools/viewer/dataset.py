"""One opened rollouts file: background indexing, filtering, sorting, search, summaries, comparison.

Contract
--------
* Everything except full-text search and reading single rows works on the compact index columns
  only (see :mod:`nemo_gym.tools.viewer.index`); no whole row is loaded to filter or sort.
* Full-text search runs as a :class:`~nemo_gym.tools.viewer.search.SearchJob`; starting a search for a new
  text cancels the previous unfinished one. Filters, sorts and pages are
  :mod:`nemo_gym.tools.viewer.query`'s; comparing two files is :mod:`nemo_gym.tools.viewer.compare`.
* Methods that can take long (indexing, scans) are meant to be called off the event loop; all
  shared state is guarded by locks.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from nemo_gym.kit.rollout_stats import pass_at_k
from nemo_gym.tools.viewer.access import AccessDenied, AccessPolicy
from nemo_gym.tools.viewer.index import IndexFileError, RolloutIndex
from nemo_gym.tools.viewer.query import (
    MAX_PAGE,
    ROW_SORT_KEYS,
    TASK_SORT_KEYS,
    Filters,
    QueryError,
    check_page,
    finite,
    histogram,
    mean_std,
    sort_page,
)
from nemo_gym.tools.viewer.row_facts import ERROR_FLAGS, NO_INDEX
from nemo_gym.tools.viewer.search import SearchJob

MAX_QUERY_CACHE = 16
MAX_SEARCH_JOBS = 8
MAX_FAILURE_ROWS = 500


# ------------------------------------------------------------------------------------------------
# The dataset.


class Dataset:
    """One rollouts file opened in the viewer (indexed in the background)."""

    def __init__(
        self,
        file_id: str,
        path: str | os.PathLike[str],
        cache_dir: str | None = None,
        pass_threshold: float = 1.0,
        access: AccessPolicy | None = None,
    ) -> None:
        self.id = file_id
        self.path = Path(path)
        self.cache_dir = cache_dir
        self.access = access  # when set, sidecars are read only if it allows them
        self.pass_threshold = pass_threshold
        self.state = "indexing"  # indexing | ready | error
        self.error: str | None = None
        self.progress: tuple[int, int] = (0, 0)
        self.index_seconds: float | None = None
        self.index: RolloutIndex | None = None
        self._lock = threading.RLock()
        self._queries: OrderedDict[tuple[Any, ...], list[int]] = OrderedDict()
        self._jobs: OrderedDict[tuple[str, int], SearchJob] = OrderedDict()
        self._cache: dict[str, tuple[Any, Any]] = {}
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None

    # -- indexing ---------------------------------------------------------------------------------
    def start(self) -> Dataset:
        """Index the file on a background thread; returns self."""
        self._thread = threading.Thread(target=self._build, name=f"ng_viewer-index-{self.id}", daemon=True)
        self._thread.start()
        return self

    def wait_ready(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for indexing to end (either way); True when it has."""
        return self._ready.wait(timeout)

    def _on_progress(self, done: int, total: int) -> None:
        self.progress = (done, total)

    def _build(self) -> None:
        t0 = time.monotonic()
        try:
            idx = RolloutIndex.open(self.path, cache_dir=self.cache_dir, progress=self._on_progress)
        except IndexFileError as e:
            self.error, self.state = str(e), "error"
        except Exception as e:  # noqa: BLE001 - shown on the page instead of killing the server
            self.error, self.state = f"indexing failed: {type(e).__name__}: {e}", "error"
        else:
            with self._lock:
                self.index = idx
                self.index_seconds = time.monotonic() - t0
                self.progress = (idx.indexed_size, idx.size)
                self.state = "ready"
        finally:
            self._ready.set()

    def refresh(self) -> bool:
        """Pick up rows appended to the file since it was indexed (or re-index a rewritten file).

        The new index is built beside the current one (from the cache, extended by the appended
        bytes) and swapped in at the end, so requests running meanwhile keep a consistent view.
        Returns True when something changed.
        """
        idx = self.require()
        try:
            st = self.path.stat()
        except OSError as e:
            raise QueryError(f"cannot read {self.path}: {e.strerror or e}") from None
        if st.st_size == idx.size and st.st_mtime_ns == idx.mtime_ns:
            return False
        try:
            new = RolloutIndex.open(self.path, cache_dir=self.cache_dir, progress=self._on_progress)
        except IndexFileError as e:
            raise QueryError(str(e)) from None
        with self._lock:
            new.generation = idx.generation + 1
            self.index = new
            self._queries.clear()
            self._cache.clear()
            for job in self._jobs.values():
                job.cancel()
            self._jobs.clear()
        return True

    def require(self) -> RolloutIndex:
        """The index; raises :class:`QueryError` while it is not ready."""
        if self.index is None:
            raise QueryError(self.error or f"{self.path} is still being indexed")
        return self.index

    def status(self) -> dict[str, Any]:
        """State, progress and headline numbers for the page."""
        out: dict[str, Any] = {
            "id": self.id,
            "path": str(self.path),
            "name": self.path.name,
            "state": self.state,
            "error": self.error,
            "progress": {"done": self.progress[0], "total": self.progress[1]},
        }
        idx = self.index
        if idx is not None:
            out.update(
                rows=len(idx),
                malformed=idx.malformed_count,
                size=idx.size,
                agents=list(idx.agents),
                index_seconds=self.index_seconds,
                index_cache=str(idx.cache_path) if idx.cache_path else None,
                loaded_from_cache=idx.loaded_from_cache,
                current=idx.is_current(),
                pass_threshold=self.pass_threshold,
            )
        return out

    # -- rows -------------------------------------------------------------------------------------
    def _search_job(self, text: str) -> SearchJob:
        idx = self.require()
        key = (text, idx.generation)
        with self._lock:
            job = self._jobs.get(key)
            if job is not None and job.cancelled:
                del self._jobs[key]
                job = None
            if job is None:
                for other in self._jobs.values():
                    if not other.done.is_set():
                        other.cancel()
                job = SearchJob(idx, text).start()
                self._jobs[key] = job
                while len(self._jobs) > MAX_SEARCH_JOBS:
                    self._jobs.popitem(last=False)
            self._jobs.move_to_end(key)
            job.last_used = time.monotonic()
            return job

    def select(
        self, filters: Filters, sort: str = "row", desc: bool = False, wait_s: float = 1.0
    ) -> tuple[list[int], dict[str, Any] | None]:
        """Row ids matching ``filters`` in ``sort`` order, and the search status (None without text).

        With a text search, waits at most ``wait_s`` for the scan; if it is not done the ids are the
        matches found so far (the caller asks again).
        """
        if sort not in ROW_SORT_KEYS:
            raise QueryError(f"cannot sort by {sort!r}; choose one of {', '.join(ROW_SORT_KEYS)}")
        idx = self.require()
        job = None
        if filters.text:
            job = self._search_job(filters.text)
            job.wait(wait_s)
        key = (idx.generation, filters.structural(), sort, desc, filters.text)
        complete = job is None or (job.done.is_set() and not job.cancelled)
        with self._lock:
            cached = self._queries.get(key)
            if cached is not None:
                self._queries.move_to_end(key)
                return cached, (job.status() if job else None)
        ids = self._filter(idx, filters, job)
        ids = self._sort(idx, ids, sort, desc)
        if complete:
            with self._lock:
                self._queries[key] = ids
                while len(self._queries) > MAX_QUERY_CACHE:
                    self._queries.popitem(last=False)
        return ids, (job.status() if job else None)

    @staticmethod
    def _filter(idx: RolloutIndex, f: Filters, job: SearchJob | None) -> list[int]:
        cols = idx.columns
        n = job.scanned if job is not None else len(idx)
        ids: Any = range(n)
        if job is not None:
            m = job.matches
            ids = [i for i in ids if m[i]]
        if f.reward_min is not None or f.reward_max is not None:
            rw = cols["reward"]
            lo = -math.inf if f.reward_min is None else f.reward_min
            hi = math.inf if f.reward_max is None else f.reward_max
            ids = [i for i in ids if lo <= rw[i] <= hi]  # NaN fails both comparisons
        if f.tasks:
            tk = cols["task"]
            ranges = f.tasks
            ids = [i for i in ids if any(lo <= tk[i] <= hi for lo, hi in ranges)]
        if f.agent is not None:
            try:
                aid = idx.agents.index(f.agent) if f.agent else NO_INDEX
            except ValueError:
                return []
            ag = cols["agent"]
            ids = [i for i in ids if ag[i] == aid]
        if f.errors_only:
            fl = cols["flags"]
            ids = [i for i in ids if fl[i] & ERROR_FLAGS]
        return list(ids)

    @staticmethod
    def _sort(idx: RolloutIndex, ids: list[int], sort: str, desc: bool) -> list[int]:
        cols = idx.columns
        if sort == "row":
            return ids[::-1] if desc else ids
        if sort == "reward":
            rw = cols["reward"]
            missing = math.inf if not desc else -math.inf

            def rkey(i: int) -> float:
                v = rw[i]
                return missing if v != v else v

            return sorted(ids, key=rkey, reverse=desc)
        if sort == "task":
            tk, ro = cols["task"], cols["rollout"]
            return sorted(ids, key=lambda i: (tk[i], ro[i]), reverse=desc)
        if sort == "agent":
            return sorted(ids, key=idx.agent_name, reverse=desc)
        col = cols[sort]
        return sorted(ids, key=col.__getitem__, reverse=desc)

    def row_summary(self, i: int) -> dict[str, Any]:
        """The list-row facts of row ``i``."""
        idx = self.require()
        c = idx.columns
        reward = c["reward"][i]
        return {
            "row": i,
            "line_no": c["line_no"][i],
            "reward": reward if finite(reward) else None,
            "task": c["task"][i] if c["task"][i] != NO_INDEX else None,
            "rollout": c["rollout"][i] if c["rollout"][i] != NO_INDEX else None,
            "agent": idx.agent_name(i),
            "turns": c["turns"][i],
            "tool_calls": c["tool_calls"][i],
            "tool_errors": c["tool_errors"][i],
            "input_tokens": c["input_tokens"][i],
            "output_tokens": c["output_tokens"][i],
            "total_tokens": c["total_tokens"][i],
            "flags": c["flags"][i],
            "preview": idx.previews[i],
        }

    def rows_page(
        self, filters: Filters, sort: str, desc: bool, offset: int, limit: int, wait_s: float = 1.0
    ) -> dict[str, Any]:
        """One page of the run list."""
        check_page(offset, limit)
        ids, search = self.select(filters, sort, desc, wait_s)
        idx = self.require()
        return {
            "total": len(ids),
            "all": len(idx),
            "offset": offset,
            "rows": [self.row_summary(i) for i in ids[offset : offset + limit]],
            "search": search,
        }

    def position(
        self, filters: Filters, sort: str, desc: bool, row: int, wait_s: float = 1.0
    ) -> dict[str, Any]:
        """Where ``row`` sits in the filtered, sorted list, and its neighbours (for next/previous)."""
        ids, search = self.select(filters, sort, desc, wait_s)
        try:
            pos = ids.index(row)
        except ValueError:
            return {
                "position": None,
                "total": len(ids),
                "prev": ids[-1] if ids else None,
                "next": ids[0] if ids else None,
                "search": search,
            }
        return {
            "position": pos,
            "total": len(ids),
            "prev": ids[pos - 1] if pos > 0 else None,
            "next": ids[pos + 1] if pos + 1 < len(ids) else None,
            "search": search,
        }

    def read_rollout(self, row: int) -> bytes:
        """The raw JSON of row ``row``; raises :class:`QueryError` if the row does not exist or the file changed."""
        idx = self.require()
        if not 0 <= row < len(idx):
            raise QueryError(f"row {row} does not exist ({len(idx)} rows)")
        if not idx.is_current():
            raise QueryError(
                f"{self.path} changed on disk since it was indexed (not only appended to); reload it"
            )
        return idx.read_raw(row)

    # -- summaries --------------------------------------------------------------------------------
    def _cached(self, name: str, compute: Callable[[], Any]) -> Any:
        idx = self.require()
        with self._lock:
            hit = self._cache.get(name)
            if hit is not None and hit[0] == idx.generation:
                return hit[1]
        value = compute()
        with self._lock:
            self._cache[name] = (idx.generation, value)
        return value

    def task_stats(self) -> dict[int, dict[str, Any]]:
        """Per-task aggregates over the index columns (cached until the file changes)."""
        return self._cached("tasks", self._compute_task_stats)

    def _compute_task_stats(self) -> dict[int, dict[str, Any]]:
        idx = self.require()
        c = idx.columns
        th = self.pass_threshold
        groups: dict[int, list[int]] = {}
        for i, t in enumerate(c["task"]):
            groups.setdefault(t, []).append(i)
        out: dict[int, dict[str, Any]] = {}
        for t, ids in groups.items():
            rewards = [c["reward"][i] for i in ids if finite(c["reward"][i])]
            mean, std = mean_std(rewards)
            passed = sum(1 for r in rewards if r >= th)
            n = len(ids)
            out[t] = {
                "task": t if t != NO_INDEX else None,
                "rollouts": n,
                "scored": len(rewards),
                "passed": passed,
                "pass_rate": passed / len(rewards) if rewards else None,
                "mean_reward": mean,
                "std_reward": std,
                "mean_turns": sum(c["turns"][i] for i in ids) / n,
                "mean_tool_calls": sum(c["tool_calls"][i] for i in ids) / n,
                "mean_tokens": sum(c["total_tokens"][i] for i in ids) / n,
                "error_rollouts": sum(1 for i in ids if c["flags"][i] & ERROR_FLAGS),
                "preview": idx.previews[ids[0]],
                "first_row": ids[0],
            }
        return out

    def tasks_page(self, sort: str, desc: bool, offset: int, limit: int) -> dict[str, Any]:
        """One page of the per-task table."""
        if sort not in TASK_SORT_KEYS:
            raise QueryError(f"cannot sort tasks by {sort!r}; choose one of {', '.join(TASK_SORT_KEYS)}")
        check_page(offset, limit)
        rows = list(self.task_stats().values())
        return {"total": len(rows), "offset": offset, "rows": sort_page(rows, sort, desc, offset, limit)}

    def summary(self) -> dict[str, Any]:
        """Headline numbers, reward histogram, pass@k, token totals, malformed lines, failures."""
        return {**self._cached("summary", self._compute_summary), "failures": self.failures()}

    def _compute_summary(self) -> dict[str, Any]:
        idx = self.require()
        c = idx.columns
        n = len(idx)
        rewards = [r for r in c["reward"] if finite(r)]
        mean, std = mean_std(rewards)
        tasks = self.task_stats()
        th = self.pass_threshold
        per_task_counts = [(v["scored"], v["passed"]) for v in tasks.values() if v["scored"]]
        max_n = max((s for s, _ in per_task_counts), default=0)
        pass_k: dict[str, float] = {}
        for k in sorted({1, 2, 4, 8, max_n}):
            if 1 <= k <= max_n:
                vals = [pass_at_k(s, p, k) for s, p in per_task_counts if s >= k]
                if vals:
                    pass_k[f"pass@{k}"] = sum(vals) / len(vals)
        agents = Counter(c["agent"])
        return {
            "rows": n,
            "scored": len(rewards),
            "unscored": n - len(rewards),
            "mean_reward": mean,
            "std_reward": std,
            "min_reward": min(rewards) if rewards else None,
            "max_reward": max(rewards) if rewards else None,
            "pass_threshold": th,
            "pass_rate": (sum(1 for r in rewards if r >= th) / len(rewards)) if rewards else None,
            "pass_at_k": pass_k,
            "num_tasks": len(tasks),
            "histogram": histogram(rewards),
            "tokens": {
                "input_tokens": sum(c["input_tokens"]),
                "output_tokens": sum(c["output_tokens"]),
                "total_tokens": sum(c["total_tokens"]),
            },
            "mean_turns": sum(c["turns"]) / n if n else None,
            "mean_tool_calls": sum(c["tool_calls"]) / n if n else None,
            "error_rollouts": sum(1 for f in c["flags"] if f & ERROR_FLAGS),
            "agents": {idx.agents[a] if a >= 0 else "": k for a, k in agents.most_common()},
            "malformed_total": idx.malformed_count,
            "malformed": [m.as_dict() for m in idx.malformed_lines()[:MAX_PAGE]],
            "file": {"path": str(self.path), "size": idx.size, "index_seconds": self.index_seconds},
        }

    def malformed(self, offset: int, limit: int) -> dict[str, Any]:
        """A page of the malformed lines (line number, parser message, start of the line)."""
        check_page(offset, limit)
        idx = self.require()
        lines = idx.malformed_lines()
        return {
            "total": idx.malformed_count,
            "kept": len(lines),
            "offset": offset,
            "rows": [m.as_dict() for m in lines[offset : offset + limit]],
        }

    # -- the failures sidecar ---------------------------------------------------------------------
    def failures_path(self) -> Path:
        """``<stem>_failures.jsonl`` next to the rollouts file."""
        from nemo_gym.collection.output_files import sidecar_paths

        return sidecar_paths(self.path)["failures"]

    def failures(self) -> dict[str, Any]:
        """Counts by kind and server, and the first rows, of the failures sidecar (if present)."""
        path = self.failures_path()
        absent = {
            "path": str(path),
            "present": False,
            "total": 0,
            "by_kind": {},
            "by_server": {},
            "rows": [],
            "malformed": 0,
        }
        if self.access is not None:
            try:
                self.access.check(path)  # e.g. a sidecar that is a symlink to a file outside the allow-list
            except AccessDenied as e:
                return {**absent, "error": str(e)}
        try:
            st = path.stat()
        except OSError:
            return absent
        key = (st.st_size, st.st_mtime_ns)
        with self._lock:
            hit = self._cache.get("failures")
            if hit is not None and hit[0] == key:
                return hit[1]
        kinds: Counter[str] = Counter()
        servers: Counter[str] = Counter()
        rows: list[dict[str, Any]] = []
        total = bad = 0
        with open(path, "rb") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = orjson.loads(line)
                except orjson.JSONDecodeError:
                    bad += 1
                    continue
                if not isinstance(row, dict):
                    bad += 1
                    continue
                total += 1
                kinds[str(row.get("kind"))] += 1
                servers[str(row.get("server"))] += 1
                if len(rows) < MAX_FAILURE_ROWS:
                    rows.append(
                        {
                            "line_no": line_no,
                            "task": row.get("_ng_task_index"),
                            "rollout": row.get("_ng_rollout_index"),
                            "attempt": row.get("attempt"),
                            "kind": row.get("kind"),
                            "server": row.get("server"),
                            "path": row.get("path"),
                            "status": row.get("status"),
                            "error": str(row.get("error"))[:2000],
                        }
                    )
        value = {
            "path": str(path),
            "present": True,
            "total": total,
            "by_kind": dict(kinds.most_common()),
            "by_server": dict(servers.most_common()),
            "rows": rows,
            "malformed": bad,
        }
        with self._lock:
            self._cache["failures"] = (key, value)
        return value

    # -- the model-calls sidecar (nemo_gym.server.model_calls) -----------------------------------------
    def model_calls_path(self) -> Path:
        """``<stem>_model_calls.jsonl`` next to the rollouts file."""
        from nemo_gym.server.model_calls import model_calls_path

        return model_calls_path(self.path)

    def model_calls(self, row: int) -> dict[str, Any]:
        """The captured model calls of row ``row``'s (task, rollout), in file order, and any drop counts.

        The sidecar is indexed once per (size, mtime): (task, rollout) -> byte ranges of its lines, so a
        trajectory page reads only its own lines.
        """
        summary = self.row_summary(row)
        path = self.model_calls_path()
        absent = {"path": str(path), "present": False, "calls": [], "dropped": 0, "malformed": 0}
        if self.access is not None:
            try:
                self.access.check(path)
            except AccessDenied as e:
                return {**absent, "error": str(e)}
        try:
            st = path.stat()
        except OSError:
            return absent
        key = (st.st_size, st.st_mtime_ns)
        with self._lock:
            hit = self._cache.get("model_calls")
        if hit is None or hit[0] != key:
            hit = (key, _index_model_calls(path))
            with self._lock:
                self._cache["model_calls"] = hit
        spans, malformed = hit[1]
        calls: list[dict[str, Any]] = []
        dropped = 0
        with open(path, "rb") as f:
            for offset, length in spans.get((summary["task"], summary["rollout"]), ()):
                f.seek(offset)
                line = orjson.loads(f.read(length))
                if line.get("kind") == "dropped":
                    dropped += int(line.get("dropped_calls") or 0)
                else:
                    calls.append(line)
        return {
            "path": str(path),
            "present": True,
            "calls": calls,
            "dropped": dropped,
            "malformed": malformed,
        }


def _index_model_calls(path: Path) -> tuple[dict[tuple[Any, Any], list[tuple[int, int]]], int]:
    """(task, rollout) -> [(offset, length)] of the model-calls sidecar's lines, and its unreadable lines."""
    spans: dict[tuple[Any, Any], list[tuple[int, int]]] = {}
    malformed = 0
    offset = 0
    with open(path, "rb") as f:
        for line in f:
            length = len(line)
            if line.strip():
                try:
                    obj = orjson.loads(line)
                except orjson.JSONDecodeError:
                    obj = None
                if isinstance(obj, dict):
                    k = (obj.get("_ng_task_index"), obj.get("_ng_rollout_index"))
                    spans.setdefault(k, []).append((offset, length))
                else:
                    malformed += 1
            offset += length
    return spans, malformed
