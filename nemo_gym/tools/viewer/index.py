"""Line-offset index of a rollouts JSONL file, with a compact per-row summary, cached on disk.

Contract
--------
* :meth:`RolloutIndex.open` makes one streaming pass over the file (never holding more than one
  line in memory) and records, for every non-blank line, its byte offset, length and line number.
  Lines that parse as JSON objects become *rows* with a compact summary (reward, task and rollout
  index, agent, model turns, tool calls, tool errors, token usage, a short prompt preview) kept in
  ``array`` columns — about 100 bytes per row. Lines that do not parse (or are not objects) are
  listed in :attr:`RolloutIndex.malformed` with their line number and the parser's message; they
  never stop the rest of the file from being indexed.
* The index is cached in a private directory, never next to the rollouts file: by default
  ``$XDG_CACHE_HOME/nemo_gym/viewer`` (``~/.cache/nemo_gym/viewer``), created with mode 0700 (and
  tightened to 0700 if it is ours and looser), or the directory given as ``cache_dir``
  (``+index_dir``). The cache file is named by a hash of the resolved path of the rollouts file,
  written atomically (a 0600 temporary file renamed over the old one), and its header holds the
  resolved path, size and ``mtime_ns`` it describes: it is loaded only for that path, and used
  as-is only when size and mtime match. When the file only grew (rollouts appended, as
  ``ng_collect_rollouts`` does), only the new bytes are indexed. When no private cache directory
  can be had, the index is kept in memory only.
* A final line without a newline that does not parse is taken to be still being written: it is
  left out (not reported as malformed) and picked up by the next :meth:`RolloutIndex.refresh`.
* :meth:`RolloutIndex.read_raw` returns the bytes of one row with a single ``pread``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import threading
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from nemo_gym.tools.viewer.row_facts import NO_INDEX, summarize_row

INDEX_VERSION = 1
MAGIC = b"NGVIDX\x00\x01"
MAX_MALFORMED_KEPT = 10_000
MALFORMED_SNIPPET_CHARS = 200
TAIL_CHECK_BYTES = 256

# Columns: name -> array typecode. Kept in this order in the cache file.
COLUMNS: dict[str, str] = {
    "offset": "q",
    "length": "q",
    "line_no": "q",
    "reward": "d",
    "task": "q",
    "rollout": "q",
    "agent": "i",
    "turns": "i",
    "tool_calls": "i",
    "tool_errors": "i",
    "input_tokens": "q",
    "output_tokens": "q",
    "total_tokens": "q",
    "flags": "B",
}


class IndexFileError(Exception):
    """The rollouts file cannot be indexed (missing, not a regular file, unreadable)."""


# ------------------------------------------------------------------------------------------------
# The index.


@dataclass(slots=True)
class Malformed:
    """A line that is not a JSON object."""

    line_no: int
    offset: int
    error: str
    snippet: str

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"line_no": self.line_no, "offset": self.offset, "error": self.error, "snippet": self.snippet}


CACHE_SUFFIX = ".ngv-index"
CACHE_NAME_CHARS = 80  # how much of the rollouts file's name is kept in the cache file's name


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/nemo_gym/viewer``, or ``~/.cache/nemo_gym/viewer`` without it."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "nemo_gym" / "viewer"


def cache_file_name(path: Path) -> str:
    """The cache file's name for ``path``: a hash of its resolved path, plus its name for people."""
    resolved = str(path.resolve())
    digest = hashlib.sha256(resolved.encode("utf-8", errors="surrogateescape")).hexdigest()[:32]
    return f"{digest}-{path.name[:CACHE_NAME_CHARS]}{CACHE_SUFFIX}"


def _private_dir(d: Path) -> Path | None:
    """``d`` created (mode 0700) if missing and checked private: a real directory owned by us, no
    group/other access (tightened when it is ours). None when that cannot be had."""
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = d.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return None
        if st.st_mode & 0o077:
            os.chmod(d, 0o700)
    except OSError:
        return None
    return d


def cache_path_for(path: Path, cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """Where the index of ``path`` is cached: in ``cache_dir`` (created if missing) or in the private
    default directory; None when no such directory can be used (the index then stays in memory)."""
    if cache_dir is None:
        d = _private_dir(default_cache_dir())
    else:
        d = Path(cache_dir).expanduser()
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            return None
    return d / cache_file_name(path) if d is not None else None


ProgressFn = Callable[[int, int], None]


@dataclass
class RolloutIndex:
    """Offsets and compact summaries of every row of one rollouts file (see the module docstring)."""

    path: Path
    size: int = 0  # file size the index was checked against
    mtime_ns: int = 0
    indexed_size: int = 0  # bytes covered by the index (a trailing partial line is not covered)
    next_line_no: int = 1
    columns: dict[str, array] = field(default_factory=lambda: {n: array(t) for n, t in COLUMNS.items()})
    previews: list[str] = field(default_factory=list)
    agents: list[str] = field(default_factory=list)
    malformed: list[Malformed] = field(default_factory=list)
    malformed_total: int = 0
    pending: Malformed | None = None  # an unparseable last line without a newline (maybe still being written)
    tail: bytes = b""  # the last bytes of the indexed range, to recognise an append-only change
    cache_path: Path | None = None
    loaded_from_cache: bool = False
    generation: int = 0  # bumped whenever rows are added
    _agent_ids: dict[str, int] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # -- opening ----------------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        cache_dir: str | os.PathLike[str] | None = None,
        progress: ProgressFn | None = None,
        use_cache: bool = True,
    ) -> RolloutIndex:
        """Index ``path``, reusing (or extending) a cached index when its size/mtime key allows.

        ``cache_dir``: where to keep the cache file (default: the private cache directory, see the
        module docstring). ``progress(done_bytes, total_bytes)`` is called while reading.
        """
        p = Path(path)
        if not p.exists():
            raise IndexFileError(f"{p} does not exist")
        if not p.is_file():
            raise IndexFileError(f"{p} is not a regular file")
        try:
            st = p.stat()
            with open(p, "rb"):
                pass
        except OSError as e:
            raise IndexFileError(f"cannot read {p}: {e.strerror or e}") from None
        target = cache_path_for(p, cache_dir) if use_cache else None
        idx = cls._load_cache(p, target) if target is not None else None
        if idx is None:
            idx = cls(path=p)
        else:
            idx.loaded_from_cache = idx.size == st.st_size and idx.mtime_ns == st.st_mtime_ns
        changed = idx._update(st, progress)
        if target is not None and (changed or not idx.loaded_from_cache):
            idx._save_cache(target)
        return idx

    def refresh(self, progress: ProgressFn | None = None) -> bool:
        """Bring the index up to date with the file; True when rows were added or it was rebuilt."""
        try:
            st = self.path.stat()
        except OSError as e:
            raise IndexFileError(f"cannot read {self.path}: {e.strerror or e}") from None
        if st.st_size == self.size and st.st_mtime_ns == self.mtime_ns:
            return False
        changed = self._update(st, progress)
        if changed and self.cache_path is not None:
            self._save_cache(self.cache_path)
        return changed

    def is_current(self) -> bool:
        """Whether the offsets still describe the file (unchanged, or only appended to)."""
        try:
            st = self.path.stat()
        except OSError:
            return False
        if st.st_size == self.size and st.st_mtime_ns == self.mtime_ns:
            return True
        return self._appended_since(st)

    def _appended_since(self, st: os.stat_result) -> bool:
        """Whether the file now is the indexed one with bytes appended (same content up to ``indexed_size``).

        A modification that keeps the size is a rewrite; a grown file counts as appended to when
        the bytes just before ``indexed_size`` are unchanged (how ``ng_collect_rollouts`` writes).
        """
        if st.st_size == self.size and st.st_mtime_ns != self.mtime_ns and self.indexed_size == self.size:
            return False
        return self.indexed_size <= st.st_size and self._tail_matches()

    # -- reading rows -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.columns["offset"])

    def read_raw(self, row: int) -> bytes:
        """The bytes of row ``row`` (one JSON object, without the newline)."""
        offset, length = self.columns["offset"][row], self.columns["length"][row]
        fd = os.open(self.path, os.O_RDONLY)
        try:
            data = os.pread(fd, length, offset)
        finally:
            os.close(fd)
        return data.rstrip(b"\r\n")

    def read_row(self, row: int) -> dict[str, Any]:
        """Row ``row`` parsed."""
        return orjson.loads(self.read_raw(row))

    def malformed_lines(self) -> list[Malformed]:
        """Malformed lines kept (at most ``MAX_MALFORMED_KEPT``), plus an unparseable partial last line."""
        return self.malformed + ([self.pending] if self.pending is not None else [])

    @property
    def malformed_count(self) -> int:
        """Every malformed line, including an unparseable partial last line."""
        return self.malformed_total + (1 if self.pending is not None else 0)

    def agent_name(self, row: int) -> str:
        """The agent name of row ``row`` ("" when the row names none)."""
        a = self.columns["agent"][row]
        return self.agents[a] if a >= 0 else ""

    # -- building ---------------------------------------------------------------------------------
    def _update(self, st: os.stat_result, progress: ProgressFn | None) -> bool:
        """Index what is new in the file (or everything, if it was not only appended to)."""
        with self._lock:
            if self.size == st.st_size and self.mtime_ns == st.st_mtime_ns and self.indexed_size == self.size:
                return False
            if not self._appended_since(st):
                self._reset()
            self._scan(st.st_size, progress)
            self.size, self.mtime_ns = st.st_size, st.st_mtime_ns
            self.generation += 1
            return True

    def _reset(self) -> None:
        self.indexed_size = 0
        self.next_line_no = 1
        self.columns = {n: array(t) for n, t in COLUMNS.items()}
        self.previews = []
        self.agents = []
        self._agent_ids = {}
        self.malformed = []
        self.malformed_total = 0
        self.pending = None
        self.tail = b""

    def _tail_matches(self) -> bool:
        if self.indexed_size == 0:
            return True
        n = len(self.tail)
        try:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                data = os.pread(fd, n, self.indexed_size - n)
            finally:
                os.close(fd)
        except OSError:
            return False
        return data == self.tail

    def _agent_id(self, name: str) -> int:
        if not name:
            return NO_INDEX
        aid = self._agent_ids.get(name)
        if aid is None:
            aid = self._agent_ids[name] = len(self.agents)
            self.agents.append(name)
        return aid

    def _scan(self, end: int, progress: ProgressFn | None) -> None:
        """Read lines from ``indexed_size`` up to ``end`` bytes and add them."""
        cols = self.columns
        self.pending = None
        offset = self.indexed_size
        line_no = self.next_line_no
        last_report = offset
        with open(self.path, "rb", buffering=1 << 20) as f:
            f.seek(offset)
            while offset < end:
                line = f.readline(end - offset)
                if not line:
                    break
                complete = line.endswith(b"\n")
                body = line.strip()
                if body:
                    try:
                        obj = orjson.loads(body)
                        error = (
                            None
                            if isinstance(obj, dict)
                            else f"a rollout must be a JSON object, got {type(obj).__name__}"
                        )
                    except orjson.JSONDecodeError as e:
                        obj, error = None, f"not valid JSON: {e}"
                    if error is not None and not complete:
                        # Perhaps still being written: reported, but left for the next refresh to re-read.
                        snippet = body[: MALFORMED_SNIPPET_CHARS * 2].decode("utf-8", errors="replace")
                        self.pending = Malformed(
                            line_no,
                            offset,
                            f"incomplete last line (no newline; still being written?): {error}",
                            snippet[:MALFORMED_SNIPPET_CHARS],
                        )
                        break
                    if error is None:
                        facts = summarize_row(obj)
                        cols["offset"].append(offset)
                        cols["length"].append(len(line))
                        cols["line_no"].append(line_no)
                        cols["reward"].append(facts.reward)
                        cols["task"].append(facts.task)
                        cols["rollout"].append(facts.rollout)
                        cols["agent"].append(self._agent_id(facts.agent))
                        cols["turns"].append(facts.turns)
                        cols["tool_calls"].append(facts.tool_calls)
                        cols["tool_errors"].append(facts.tool_errors)
                        cols["input_tokens"].append(facts.input_tokens)
                        cols["output_tokens"].append(facts.output_tokens)
                        cols["total_tokens"].append(facts.total_tokens)
                        cols["flags"].append(facts.flags)
                        self.previews.append(facts.preview)
                    else:
                        self.malformed_total += 1
                        if len(self.malformed) < MAX_MALFORMED_KEPT:
                            snippet = body[: MALFORMED_SNIPPET_CHARS * 2].decode("utf-8", errors="replace")
                            self.malformed.append(
                                Malformed(line_no, offset, error, snippet[:MALFORMED_SNIPPET_CHARS])
                            )
                elif not complete:
                    break
                offset += len(line)
                line_no += 1
                if progress is not None and offset - last_report >= (8 << 20):
                    last_report = offset
                    progress(offset, end)
        self.indexed_size = offset
        self.next_line_no = line_no
        if offset:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                start = max(0, offset - TAIL_CHECK_BYTES)
                self.tail = os.pread(fd, offset - start, start)
            finally:
                os.close(fd)
        if progress is not None:
            progress(offset, end)

    # -- the cache file ---------------------------------------------------------------------------
    def _save_cache(self, target: Path) -> None:
        header = {
            "version": INDEX_VERSION,
            "path": str(self.path.resolve()),
            "size": self.size,
            "mtime_ns": self.mtime_ns,
            "indexed_size": self.indexed_size,
            "next_line_no": self.next_line_no,
            "rows": len(self),
            "agents": self.agents,
            "malformed": [m.as_dict() for m in self.malformed],
            "malformed_total": self.malformed_total,
            "pending": self.pending.as_dict() if self.pending is not None else None,
            "tail": self.tail.hex(),
            "columns": [
                [name, COLUMNS[name], len(self.columns[name]) * self.columns[name].itemsize]
                for name in COLUMNS
            ],
        }
        head = orjson.dumps(header)
        previews = orjson.dumps(self.previews)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            # Private from the first byte (0600, whatever the umask), never through a symlink, then
            # renamed over the old cache so a reader sees the old or the new file, never half of one.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.fchmod(fd, 0o600)
                with open(fd, "wb", closefd=False) as f:
                    f.write(MAGIC)
                    f.write(len(head).to_bytes(8, "little"))
                    f.write(head)
                    for name in COLUMNS:
                        f.write(self.columns[name].tobytes())
                    f.write(len(previews).to_bytes(8, "little"))
                    f.write(previews)
            finally:
                os.close(fd)
            os.replace(tmp, target)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            return
        self.cache_path = target

    @classmethod
    def _load_cache(cls, path: Path, cache: Path) -> RolloutIndex | None:
        """The cached index at ``cache`` if it belongs to ``path`` and is intact; else None."""
        try:
            with open(cache, "rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    return None
                head_len = int.from_bytes(f.read(8), "little")
                header = orjson.loads(f.read(head_len))
                if header.get("version") != INDEX_VERSION or header.get("path") != str(path.resolve()):
                    return None
                idx = cls(path=path)
                for name, typecode, nbytes in header["columns"]:
                    if COLUMNS.get(name) != typecode:
                        return None
                    col = array(typecode)
                    data = f.read(nbytes)
                    if len(data) != nbytes:
                        return None
                    col.frombytes(data)
                    idx.columns[name] = col
                n_prev = int.from_bytes(f.read(8), "little")
                idx.previews = orjson.loads(f.read(n_prev))
        except (OSError, ValueError, KeyError, TypeError, orjson.JSONDecodeError):
            return None
        n = header["rows"]
        if any(len(c) != n for c in idx.columns.values()) or len(idx.previews) != n:
            return None
        idx.size, idx.mtime_ns = header["size"], header["mtime_ns"]
        idx.indexed_size, idx.next_line_no = header["indexed_size"], header["next_line_no"]
        idx.agents = list(header["agents"])
        idx._agent_ids = {a: i for i, a in enumerate(idx.agents)}
        idx.malformed = [Malformed(**m) for m in header["malformed"]]
        idx.malformed_total = header["malformed_total"]
        idx.pending = Malformed(**header["pending"]) if header.get("pending") else None
        idx.tail = bytes.fromhex(header["tail"])
        idx.cache_path = cache
        return idx
