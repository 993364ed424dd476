"""The collector's files: sidecar paths, whole-line appends, and the scans a resume relies on.

Contract
--------
* :func:`sidecar_paths` is the one definition of the files written next to the output
  (``<stem>_materialized_inputs.jsonl``, ``<stem>_failures.jsonl``, ``<stem>_aggregate_metrics.json``).
* :class:`LineWriter` appends each JSON line with one ``write`` call (looping on short writes), so an
  interrupt never leaves half a line from this process; the rollouts and failures files are written
  scrubbed of known secrets.
* :func:`_scan_existing_output` returns the (task, rollout) pairs already done; a trailing line cut
  short by a hard kill is dropped (or completed when it is a whole rollout), and nothing else already
  written is deleted. :func:`_scan_failures` returns the highest attempt per failed pair.
  :class:`ResumeState` is the same scans for the collector, with memory that does not grow with the
  pairs: each pair's status in key order, through a spill to temporary files.
* :func:`_check_materialized_matches` refuses a resume, touching nothing, when the rows this config
  would send differ from the materialized inputs; :func:`_check_output_paths` refuses an output path
  that is the input file.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from nemo_gym.collection.input_rows import materialize
from nemo_gym.collection.options import NG_TERMINAL_KEY, InputError, RolloutCollectionConfig
from nemo_gym.kit.spill import SortedSpill
from nemo_gym.redaction import process_scrubber


def sidecar_paths(output: Path) -> dict[str, Path]:
    """The files written next to the output: materialized inputs, failures, aggregate metrics."""
    stem = output.with_suffix("") if output.suffix == ".jsonl" else output
    return {
        "materialized": Path(f"{stem}_materialized_inputs.jsonl"),
        "failures": Path(f"{stem}_failures.jsonl"),
        "metrics": Path(f"{stem}_aggregate_metrics.json"),
    }


def failures_path_for(output_fpath: Path | str) -> Path:
    """``<stem>_failures.jsonl`` next to ``output_fpath``: the failures file ``ng_collect_rollouts`` writes
    (upstream's ``nemo_gym.path_utils.failures_path_for``), so tools that read or append to it agree."""
    return sidecar_paths(Path(output_fpath))["failures"]


def _rollout_key(line: bytes) -> tuple[int, int] | None:
    """The (task, rollout) pair of one output line, or None when it is not a finished rollout."""
    try:
        row = orjson.loads(line)
        reward = row["reward"]
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            return None
        return int(row["_ng_task_index"]), int(row["_ng_rollout_index"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def _scan_output_keys(path: Path, on_done: Callable[[tuple[int, int]], object]) -> int:
    """Call ``on_done`` with each (task, rollout) pair of an existing output file (in file order, a pair
    as often as it appears); returns the number of unreadable whole lines.

    A trailing line without its newline (a write cut short by a hard kill or a full disk) is cut
    off, or completed with its newline when it is a whole rollout. Unreadable lines elsewhere are
    left in place (nothing already written is deleted); their pairs count as not done.
    """
    bad = 0
    if not path.exists():
        return bad
    size = path.stat().st_size
    offset = 0
    tail: bytes | None = None
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                tail = line
                break
            offset += len(line)
            if not line.strip():
                continue
            key = _rollout_key(line)
            if key is None:
                bad += 1
            else:
                on_done(key)
    if tail is not None:
        key = _rollout_key(tail)
        with open(path, "r+b") as f:
            if key is not None:
                f.seek(size)
                f.write(b"\n")
                on_done(key)
            else:
                f.truncate(offset)
    return bad


def _scan_existing_output(path: Path) -> tuple[set[tuple[int, int]], int]:
    """(pairs already done, number of unreadable whole lines) of an existing output file, in memory
    (the collector itself uses :class:`ResumeState`); the tail is repaired as :func:`_scan_output_keys` says."""
    done: set[tuple[int, int]] = set()
    bad = _scan_output_keys(path, done.add)
    return done, bad


def _scan_failure_records(path: Path, on_attempt: Callable[[tuple[int, int], int], object]) -> None:
    """Call ``on_attempt`` with (pair, attempt number) for each failure record of the failures file."""
    if not path.exists():
        return
    with open(path, "rb") as f:
        for line in f:
            try:
                row = orjson.loads(line)
                key = (int(row["_ng_task_index"]), int(row["_ng_rollout_index"]))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
            on_attempt(key, int(row.get("attempt", 1)))


def _scan_terminal_records(path: Path, on_terminal: Callable[[tuple[int, int]], object]) -> None:
    """Call ``on_terminal`` with the pair of each terminal failure record (``_ng_failure_terminal``)."""
    if not path.exists():
        return
    with open(path, "rb") as f:
        for line in f:
            if NG_TERMINAL_KEY.encode() not in line:
                continue
            try:
                row = orjson.loads(line)
                if row.get(NG_TERMINAL_KEY):
                    key = (int(row["_ng_task_index"]), int(row["_ng_rollout_index"]))
                else:
                    continue
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
                continue
            on_terminal(key)


def _scan_failures(path: Path) -> dict[tuple[int, int], int]:
    """The highest attempt number recorded per failed (task, rollout) pair (in memory)."""
    attempts: dict[tuple[int, int], int] = {}

    def add(key: tuple[int, int], attempt: int) -> None:
        attempts[key] = max(attempts.get(key, 0), attempt)

    _scan_failure_records(path, add)
    return attempts


def _scan_terminal_failures(path: Path) -> set[tuple[int, int]]:
    """The (task, rollout) pairs whose recorded failure is terminal (``_ng_failure_terminal``; in memory)."""
    terminal: set[tuple[int, int]] = set()
    _scan_terminal_records(path, terminal.add)
    return terminal


# Record kinds of ResumeState's spill, in the order a pair's records sort.
_DONE, _ATTEMPT, _TERMINAL = 0, 1, 2


@dataclass(frozen=True)
class PairStatus:
    """What earlier runs left for one (task, rollout) pair that has a record in the output or failures."""

    key: tuple[int, int]
    done: bool  # a whole rollout of it is in the output
    failed: bool  # the failures file has a record of it
    attempts: int  # the highest attempt number recorded (at least 0)
    terminal: bool  # a recorded failure is terminal (never retried)
    exhausted: bool  # not done, and failed max_attempts times or terminally: skipped


class ResumeState:
    """The output and failures files of earlier runs, as :class:`PairStatus` per pair in key order.

    The scans are those of :func:`_scan_existing_output` (which repairs the output's tail),
    :func:`_scan_failures` and :func:`_scan_terminal_failures`, in that order; their pairs go through a
    :class:`~nemo_gym.kit.spill.SortedSpill`, so memory does not grow with the pairs done. The
    materialized inputs are in key order too, so the collector walks both side by side
    (:meth:`statuses`). ``n_done`` and ``n_exhausted`` count distinct pairs, as the sets did.
    """

    def __init__(self, output: Path, failures: Path, max_attempts: int) -> None:
        self.max_attempts = max_attempts
        self._spill = SortedSpill()
        try:
            add = self._spill.add
            self.unreadable = _scan_output_keys(output, lambda k: add((k[0], k[1], _DONE, 0)))
            _scan_failure_records(failures, lambda k, attempt: add((k[0], k[1], _ATTEMPT, attempt)))
            _scan_terminal_records(failures, lambda k: add((k[0], k[1], _TERMINAL, 0)))
            self.n_done = self.n_exhausted = 0
            for status in self.statuses():
                self.n_done += status.done
                self.n_exhausted += status.exhausted
        except BaseException:
            self.close()
            raise

    def statuses(self) -> Iterator[PairStatus]:
        """One :class:`PairStatus` per pair with a record, in ascending (task, rollout) order."""
        for key, records in itertools.groupby(self._spill, key=lambda r: (r[0], r[1])):
            done = failed = terminal = False
            attempts = 0
            for _, _, kind, attempt in records:
                if kind == _DONE:
                    done = True
                elif kind == _ATTEMPT:
                    failed = True
                    attempts = max(attempts, attempt)
                else:
                    terminal = True
            exhausted = failed and (attempts >= self.max_attempts or terminal) and not done
            yield PairStatus(key, done, failed, attempts, terminal, exhausted)

    def close(self) -> None:
        """Remove the spill's temporary files (idempotent)."""
        self._spill.close()


class LineWriter:
    """Appends whole lines with one ``write`` system call each, so an interrupt never splits a line.

    ``scrubbed``: each line is scrubbed of the secret values this process knows (its config and
    ``env.yaml``: :func:`nemo_gym.redaction.process_scrubber`) before it is written, whatever the
    answer it holds echoed (a model quoting its ``Authorization`` header, a server's own error text).
    Scrubbing the serialized line keeps it valid JSON (:data:`~nemo_gym.redaction.REDACTED` needs no
    escaping; escaped forms of the secrets are matched too).
    """

    def __init__(self, path: Path, truncate: bool = False, scrubbed: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
        self.fd = os.open(path, flags, 0o644)
        self.path = path
        self.scrubbed = scrubbed

    def write(self, obj: Any) -> None:
        """Append ``obj`` as one JSON line."""
        data = orjson.dumps(obj)
        if self.scrubbed:
            data = process_scrubber().scrub_bytes(data)
        data += b"\n"
        view = memoryview(data)
        while view:
            written = os.write(self.fd, view)
            view = view[written:]

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _check_output_paths(cfg: RolloutCollectionConfig, out_path: Path, side: dict[str, Path]) -> None:
    """Refuse an output (or sidecar) path that is the input file: writing it would destroy the input."""
    source = Path(cfg.input_jsonl_fpath).resolve()
    for path in (out_path, *side.values()):
        if path.resolve() == source:
            raise InputError(f"{path} is the input file; choose another +output_jsonl_fpath.")


def _check_materialized_matches(cfg: RolloutCollectionConfig, path: Path) -> None:
    """Raise InputError unless ``path`` holds exactly the rows this config would send (streaming)."""
    if not path.exists():
        return
    with open(path, "rb") as f:
        for n, row in enumerate(materialize(cfg), start=1):
            line = f.readline()
            try:
                same = bool(line) and orjson.loads(line) == orjson.loads(orjson.dumps(row))
            except orjson.JSONDecodeError:
                same = False
            if not same:
                raise InputError(
                    f"Cannot resume: the rows to send no longer match {path} (first difference at line {n}). "
                    "The input file, +limit, +num_repeats, +num_repeats_add_seed, +responses_create_params or "
                    "+agent_name changed since the first run. Use a new +output_jsonl_fpath, or +overwrite=true "
                    "to start over."
                )
        if f.readline():
            raise InputError(
                f"Cannot resume: {path} has more rows than the current input and repeats produce. "
                "The input file, +limit or +num_repeats changed since the first run. "
                "Use a new +output_jsonl_fpath, or +overwrite=true to start over."
            )
