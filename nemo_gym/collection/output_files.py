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
* :func:`_check_materialized_matches` refuses a resume, touching nothing, when the rows this config
  would send differ from the materialized inputs; :func:`_check_output_paths` refuses an output path
  that is the input file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson

from nemo_gym.collection.input_rows import materialize
from nemo_gym.collection.options import NG_TERMINAL_KEY, InputError, RolloutCollectionConfig
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


def _scan_existing_output(path: Path) -> tuple[set[tuple[int, int]], int]:
    """(pairs already done, number of unreadable whole lines) of an existing output file.

    A trailing line without its newline (a write cut short by a hard kill or a full disk) is cut
    off, or completed with its newline when it is a whole rollout. Unreadable lines elsewhere are
    left in place (nothing already written is deleted); their pairs count as not done.
    """
    done: set[tuple[int, int]] = set()
    bad = 0
    if not path.exists():
        return done, bad
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
                done.add(key)
    if tail is not None:
        key = _rollout_key(tail)
        with open(path, "r+b") as f:
            if key is not None:
                f.seek(size)
                f.write(b"\n")
                done.add(key)
            else:
                f.truncate(offset)
    return done, bad


def _scan_failures(path: Path) -> dict[tuple[int, int], int]:
    """The highest attempt number recorded per failed (task, rollout) pair."""
    attempts: dict[tuple[int, int], int] = {}
    if not path.exists():
        return attempts
    with open(path, "rb") as f:
        for line in f:
            try:
                row = orjson.loads(line)
                key = (int(row["_ng_task_index"]), int(row["_ng_rollout_index"]))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
            attempts[key] = max(attempts.get(key, 0), int(row.get("attempt", 1)))
    return attempts


def _scan_terminal_failures(path: Path) -> set[tuple[int, int]]:
    """The (task, rollout) pairs whose recorded failure is terminal (``_ng_failure_terminal``)."""
    terminal: set[tuple[int, int]] = set()
    if not path.exists():
        return terminal
    with open(path, "rb") as f:
        for line in f:
            if NG_TERMINAL_KEY.encode() not in line:
                continue
            try:
                row = orjson.loads(line)
                if row.get(NG_TERMINAL_KEY):
                    terminal.add((int(row["_ng_task_index"]), int(row["_ng_rollout_index"])))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
                continue
    return terminal


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
