"""Rollout collection: task rows in, verified reward-annotated trajectories out.

Contract
--------
* The input JSONL is validated in a first streaming pass before any request: every line that is
  not a JSON object, whose ``responses_create_params`` fails validation, or that names no agent is
  reported with its line number and field, all at once, and nothing is sent or written. Then each
  row is checked against the row schema its agent's resources server publishes (``GET
  /row_schema``): a missing required field, a top-level field of the wrong JSON type, a value outside
  a field's enum (or its items' enum) and a ``contentMediaType: application/json`` string that is not
  JSON are reported the same way. An agent without a resources server, or a schema that cannot be
  fetched, gets one warning and no check.
* Rows are expanded in place (``num_repeats``: abc -> aabbcc) with ``_ng_task_index`` and
  ``_ng_rollout_index``; the expanded rows are written to ``<stem>_materialized_inputs.jsonl``.
* At most ``num_samples_in_parallel`` rollouts are in flight; rows are read lazily, so memory does
  not grow with the input.
* Each finished rollout is one whole line in the output, written and flushed as it completes. An
  infrastructure failure (connection refused, timeout, 5xx, a 4xx from the agent) goes to
  ``<stem>_failures.jsonl`` with its kind, server, error and attempt number — never to the output.
* With model-call capture on (the servers' ``observability_enabled``; the collector's own option can
  turn it off, or require it), each rollout's model calls are taken from the model servers as it ends
  and appended to ``<stem>_model_calls.jsonl`` (:mod:`nemo_gym.observability`).
* A per-server circuit breaker: after ``circuit_breaker_threshold`` consecutive rollouts fail
  because one server is down (unreachable past the client's retries, or 502/503/504 — the agent's
  own, or an inner server's named in the agent's 502), rows for the agents it affects are no longer
  sent. Rollouts in flight finish or fail; rows not sent are "not attempted" (not failures, not
  counted towards ``max_attempts``): a resume runs them. One line per failure kind is printed at
  the end, and the exit status is 3, naming the server. A server with several replicas is down only
  when none of them answers: the in-flight failures of one dead replica's sessions are written to the
  failures file (a resume runs them) and the run goes on through the others.
* The failures file never carries a secret: each record is scrubbed (:mod:`nemo_gym.redaction`) of
  the secret values this process knows (its config and ``env.yaml``) before it is written.
* ``resume_from_cache`` runs exactly the (task, rollout) pairs missing from the output, retrying
  failed ones up to ``max_attempts`` (then skipping and reporting them); it refuses, touching
  nothing, if the materialized inputs no longer match. A line cut short by a hard kill is dropped.
* SIGINT/SIGTERM stop cleanly: nothing new starts, in-flight rollouts are cancelled (they are not
  failures), and the output keeps only whole lines. Exit status: 0 all done, 1 rollouts missing
  after failures, 2 bad input or options (nothing sent or written), 3 stopped early because a
  server is down, 130 interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nemo_gym.fd_limits import raise_open_file_limit
from nemo_gym.global_config import ConfigError
from nemo_gym.observability import ModelCallSink, capture_wanted, model_calls_path
from nemo_gym.openai_utils import NeMoGymResponseCreateParamsNonStreaming
from nemo_gym.redaction import add_secret_values, config_secret_values, process_scrubber
from nemo_gym.replicas import live_replicas, replicated_instances
from nemo_gym.rollout_stats import aggregate_metrics, k_values
from nemo_gym.server_client import (
    BaseServerConfig,
    ServerClient,
    UpstreamError,
    _find_instance_block,
    close_shared_session,
    response_body,
)

logger = logging.getLogger("nemo_gym")

MAX_ERRORS_SHOWN = 50


class _BadLines:
    """Problems of an input file's lines, for one error that names every bad line (the first
    ``MAX_ERRORS_SHOWN`` problems shown, the number of bad lines counted)."""

    def __init__(self) -> None:
        self.shown: list[str] = []
        self.count = 0

    def add(self, where: str, problems: list[str]) -> None:
        """Record the problems of the line at ``where`` (nothing when ``problems`` is empty)."""
        if problems:
            self.count += 1
            if len(self.shown) < MAX_ERRORS_SHOWN:
                self.shown.extend(f"{where}: {p}" for p in problems)

    def raise_if_any(self, what: str) -> None:
        """Raise :class:`InputError` "<n> line(s) of <what>; nothing was sent" listing them, if any."""
        if self.count:
            more = (
                f"\n  ... and more ({self.count} bad lines in all)" if self.count > MAX_ERRORS_SHOWN else ""
            )
            raise InputError(
                f"{self.count} line(s) of {what}; nothing was sent:\n  " + "\n  ".join(self.shown) + more
            )


# Exit status when dispatch stopped because a server is down (restart it, then resume).
EXIT_SERVER_DOWN = 3
# The fields that group this run's failures into kinds for the end-of-run report.
_KIND_FIELDS = ("kind", "server", "status", "via")


class CollectionOptions(BaseModel):
    """The collection options ``ng_collect_rollouts`` and ``ng_e2e_collect_rollouts`` share."""

    model_config = ConfigDict(extra="forbid")

    output_jsonl_fpath: str
    agent_name: str | None = None
    limit: int | None = Field(default=None, ge=0)
    num_samples_in_parallel: int = Field(default=256, ge=1)
    responses_create_params: dict[str, Any] = Field(default_factory=dict)
    num_repeats_add_seed: bool = False
    resume_from_cache: bool = False
    overwrite: bool = False
    max_attempts: int = Field(default=3, ge=1)
    # Consecutive "server down" failures of one server (each after its retries) that stop dispatching.
    circuit_breaker_threshold: int = Field(default=3, ge=1)
    pass_threshold: float = 1.0
    request_timeout_s: float = 3600.0
    progress: bool = True
    # Export the metrics to an experiment tracker at the end (nemo_gym.eval.tracking; its keys apart).
    tracker: Literal["mlflow", "wandb"] | None = None
    # Model-call capture (nemo_gym.observability): None follows the servers' config, false never pulls.
    observability_enabled: bool | None = None


class RolloutCollectionConfig(CollectionOptions):
    """The options of ``ng_collect_rollouts`` (each is a ``+key=value`` on the command line)."""

    input_jsonl_fpath: str
    num_repeats: int = Field(default=1, ge=1)


class InputError(Exception):
    """The input file has problems; the message lists them with line numbers."""


# ------------------------------------------------------------------------------------------------
# Paths.


def sidecar_paths(output: Path) -> dict[str, Path]:
    """The files written next to the output: materialized inputs, failures, aggregate metrics."""
    stem = output.with_suffix("") if output.suffix == ".jsonl" else output
    return {
        "materialized": Path(f"{stem}_materialized_inputs.jsonl"),
        "failures": Path(f"{stem}_failures.jsonl"),
        "metrics": Path(f"{stem}_aggregate_metrics.json"),
    }


# ------------------------------------------------------------------------------------------------
# Input: validation and materialisation (both streaming).


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` merged in (nested dicts merged, anything else replaced)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _agent_of(row: dict[str, Any], default: str | None) -> str | None:
    """The row's ``agent_ref.name``, else ``default`` (+agent_name)."""
    ref = row.get("agent_ref")
    if isinstance(ref, dict) and isinstance(ref.get("name"), str) and ref["name"]:
        return ref["name"]
    return default


def _agent_ref_problem(row: dict[str, Any]) -> str | None:
    """A message when the row has an ``agent_ref`` that is not ``{name: <non-empty string>}``."""
    if "agent_ref" not in row:
        return None
    ref = row["agent_ref"]
    if isinstance(ref, dict) and isinstance(ref.get("name"), str) and ref["name"]:
        return None
    return f"field `agent_ref` must be an object with a non-empty string `name`, got {orjson.dumps(ref).decode()[:200]}"


def _iter_input(cfg: RolloutCollectionConfig) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) of each non-blank input line, up to +limit rows; read lazily."""
    path = Path(cfg.input_jsonl_fpath)
    taken = 0
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if cfg.limit is not None and taken >= cfg.limit:
                return
            taken += 1
            yield line_no, line


def validate_input(cfg: RolloutCollectionConfig) -> tuple[int, set[str]]:
    """One pass over the input: (number of rows, agent names used); raises InputError listing all problems."""
    path = Path(cfg.input_jsonl_fpath)
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise InputError(f"Input file {path} {what} (+input_jsonl_fpath).")
    bad = _BadLines()
    agents: set[str] = set()
    n = 0
    for line_no, line in _iter_input(cfg):
        n += 1
        where = f"{path}:{line_no}"
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            bad.add(where, [f"not valid JSON ({e})"])
            continue
        if not isinstance(row, dict):
            bad.add(where, [f"a row must be a JSON object, got {type(row).__name__}"])
            continue
        line_problems = []
        params = row.get("responses_create_params")
        if not isinstance(params, dict):
            line_problems.append("field `responses_create_params` is missing or not an object")
        else:
            try:
                NeMoGymResponseCreateParamsNonStreaming.model_validate(
                    _deep_merge(params, cfg.responses_create_params)
                )
            except ValidationError as e:
                for err in e.errors()[:5]:
                    loc = ".".join(str(x) for x in err["loc"])
                    line_problems.append(f"field `responses_create_params.{loc}`: {err['msg']}")
        ref_problem = _agent_ref_problem(row)
        agent = _agent_of(row, cfg.agent_name)
        if ref_problem is not None:
            line_problems.append(ref_problem)
        elif agent is None:
            line_problems.append("no agent: the row has no `agent_ref.name` and +agent_name was not given")
        else:
            agents.add(agent)
        bad.add(where, line_problems)
    bad.raise_if_any(f"{path} are not valid task rows")
    if n == 0:
        raise InputError(
            f"{path} has no rows" + (f" (limit={cfg.limit})" if cfg.limit is not None else "") + "."
        )
    return n, agents


def materialize(cfg: RolloutCollectionConfig) -> Iterator[dict[str, Any]]:
    """The rows actually sent, in order: each input row repeated in place, with indices added."""
    for task_index, (_, line) in enumerate(_iter_input(cfg)):
        row = orjson.loads(line)
        row["responses_create_params"] = _deep_merge(
            row["responses_create_params"], cfg.responses_create_params
        )
        agent = _agent_of(row, cfg.agent_name)
        row["agent_ref"] = {"type": "responses_api_agents", "name": agent}
        for rollout_index in range(cfg.num_repeats):
            out = dict(row)
            if cfg.num_repeats_add_seed:
                out["responses_create_params"] = {**row["responses_create_params"], "seed": rollout_index}
            out["_ng_task_index"] = task_index
            out["_ng_rollout_index"] = rollout_index
            yield out


def check_agents_running(agents: set[str], client: ServerClient) -> None:
    """Raise InputError naming every agent that is not running, and the agents that are."""
    cfg = client.global_config_dict
    running = sorted(
        str(name)
        for name in cfg.keys()
        if hasattr(cfg.get(name), "keys") and "responses_api_agents" in cfg.get(name)
    )
    missing = sorted(a for a in agents if a not in running)
    if missing:
        raise InputError(
            f"Agent(s) {', '.join(repr(m) for m in missing)} are not running. "
            f"Running agents: {', '.join(running) or 'none'}."
        )


# ------------------------------------------------------------------------------------------------
# Task rows against the schema the environment publishes (``GET /row_schema`` of its resources server).

ROW_SCHEMA_PATH = "/row_schema"
ROW_SCHEMA_TIMEOUT_S = 30.0
_JSON_TYPE_NAMES = ("null", "boolean", "integer", "number", "string", "array", "object")


def _json_type(value: Any) -> str:
    """The JSON type name of a parsed JSON value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _allowed_types(prop: Any, defs: dict[str, Any], depth: int = 0) -> set[str] | None:
    """The JSON types a property schema allows at its top level; None when any value may do."""
    if not isinstance(prop, dict) or depth > 20:
        return None
    ref = prop.get("$ref")
    if isinstance(ref, str):
        return _allowed_types(defs.get(ref.rsplit("/", 1)[-1]), defs, depth + 1)
    kind = prop.get("type")
    if isinstance(kind, str):
        return {kind} if kind in _JSON_TYPE_NAMES else None
    if isinstance(kind, list) and all(k in _JSON_TYPE_NAMES for k in kind):
        return set(kind)
    for key in ("anyOf", "oneOf"):
        options = prop.get(key)
        if isinstance(options, list) and options:
            allowed: set[str] = set()
            for option in options:
                types = _allowed_types(option, defs, depth + 1)
                if types is None:
                    return None
                allowed |= types
            return allowed
    all_of = prop.get("allOf")
    if isinstance(all_of, list) and len(all_of) == 1:
        return _allowed_types(all_of[0], defs, depth + 1)
    if isinstance(prop.get("enum"), list) and prop["enum"]:
        return {_json_type(v) for v in prop["enum"]}
    return {_json_type(prop["const"])} if "const" in prop else None


def _not_null(options: list[Any]) -> list[Any]:
    return [o for o in options if not (isinstance(o, dict) and o.get("type") == "null")]


def _resolve(prop: Any, defs: dict[str, Any]) -> dict[str, Any]:
    """``prop`` with a top-level ``$ref``, a single ``allOf`` or an optional's ``anyOf`` [X, null]
    followed to X."""
    for _ in range(20):
        if not isinstance(prop, dict):
            return {}
        ref = prop.get("$ref")
        if isinstance(ref, str):
            prop = defs.get(ref.rsplit("/", 1)[-1])
        elif isinstance(prop.get("allOf"), list) and len(prop["allOf"]) == 1:
            prop = prop["allOf"][0]
        elif isinstance(prop.get("anyOf"), list) and len(_not_null(prop["anyOf"])) == 1:
            prop = _not_null(prop["anyOf"])[0]  # an optional field: its value's schema
        else:
            return prop
    return {}


class RowSchema:
    """The checks one environment's published row schema asks for: required fields, top-level JSON types,
    enums (of a field or of an array field's items) and JSON-text strings (``contentMediaType``)."""

    def __init__(self, server: str, schema: dict[str, Any]) -> None:
        self.server = server
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        defs = schema.get("$defs") if isinstance(schema.get("$defs"), dict) else {}
        self.used_by = {name: prop.get("x-used-by") for name, prop in props.items() if isinstance(prop, dict)}
        self.required = [f for f in schema.get("required") or [] if isinstance(f, str)]
        types = {name: _allowed_types(prop, defs) for name, prop in props.items()}
        self.types = {name: t for name, t in types.items() if t is not None}
        # Value checks: a top-level enum (or one on an array's items), and strings declared
        # ``contentMediaType: application/json`` (a schema carried as text) must parse as JSON.
        self.enums: dict[str, tuple[list[Any], bool]] = {}
        self.json_strings: set[str] = set()
        for name, prop in props.items():
            if not isinstance(prop, dict):
                continue
            prop = _resolve(prop, defs)
            items = _resolve(prop.get("items"), defs) if isinstance(prop.get("items"), dict) else {}
            if isinstance(prop.get("enum"), list):
                self.enums[name] = (prop["enum"], False)
            elif isinstance(items.get("enum"), list):
                self.enums[name] = (items["enum"], True)
            if prop.get("contentMediaType") == "application/json":
                self.json_strings.add(name)

    def _needed_by(self, field: str) -> str:
        paths = self.used_by.get(field)
        where = f" {' and '.join(paths)}" if isinstance(paths, list) and paths else ""
        return f"{self.server}{where}"

    def problems(self, row: dict[str, Any]) -> list[str]:
        """One message per missing required field, top-level field of the wrong JSON type, value outside
        its enum, and JSON-text field that is not JSON."""
        out = [f"missing field `{f}`, needed by {self._needed_by(f)}" for f in self.required if f not in row]
        mistyped: set[str] = set()
        for field, allowed in self.types.items():
            if field not in row:
                continue
            got = _json_type(row[field])
            integral = got == "number" and "integer" in allowed and float(row[field]).is_integer()
            if got in allowed or (got == "integer" and "number" in allowed) or integral:
                continue
            want = " or ".join(sorted(allowed))
            out.append(f"field `{field}` must be {want} for {self._needed_by(field)}, got {got}")
            mistyped.add(field)
        for field, (choices, per_item) in self.enums.items():
            values = row.get(field) if per_item else [row.get(field)]
            if field not in row or field in mistyped or not isinstance(values, list):
                continue
            unknown = [v for v in values if v not in choices and not (v is None and not per_item)]
            if unknown:
                shown = ", ".join(orjson.dumps(c).decode() for c in choices[:40])
                more = f" (and {len(choices) - 40} more)" if len(choices) > 40 else ""
                out.append(
                    f"field `{field}` has unknown value(s) {orjson.dumps(unknown).decode()} for "
                    f"{self._needed_by(field)}; known: {shown}{more}"
                )
        for field in self.json_strings:
            if isinstance(row.get(field), str):
                try:
                    orjson.loads(row[field])
                except orjson.JSONDecodeError as e:
                    out.append(f"field `{field}` must be JSON text for {self._needed_by(field)}: {e}")
        return out


async def fetch_row_schemas(agents: set[str], client: ServerClient) -> dict[str, RowSchema]:
    """The row schema of each agent's resources server, by agent.

    An agent whose config names no ``resources_server``, or whose server does not publish a schema
    (not built on ``SimpleResourcesServer``, unreachable, an error) is left out with one warning.
    """
    cfg = client.global_config_dict
    schemas: dict[str, RowSchema] = {}
    by_server: dict[str, RowSchema | None] = {}
    for agent in sorted(agents):
        found = _find_instance_block(cfg, agent)
        ref = found[2].get("resources_server") if found is not None and hasattr(found[2], "get") else None
        server = ref.get("name") if hasattr(ref, "get") else None
        if not isinstance(server, str) or not server:
            logger.warning(
                "Agent %s names no resources_server in its config: task rows for it are not checked "
                "against an environment schema.",
                agent,
            )
            continue
        if server not in by_server:
            by_server[server] = await _fetch_row_schema(server, client)
        if by_server[server] is not None:
            schemas[agent] = by_server[server]
    return schemas


async def _fetch_row_schema(server: str, client: ServerClient) -> RowSchema | None:
    problem = None
    try:
        resp = await client.get(server, ROW_SCHEMA_PATH, timeout_s=ROW_SCHEMA_TIMEOUT_S)
        if resp.status == 200:
            schema = orjson.loads(response_body(resp))
            if isinstance(schema, dict):
                return RowSchema(server, schema)
            problem = "its answer is not a JSON object"
        else:
            problem = f"it answered HTTP {resp.status}"
    except (UpstreamError, KeyError, orjson.JSONDecodeError) as e:
        problem = str(e)[:300]
    logger.warning(
        "Cannot get the task-row schema of resources server %s (GET %s: %s): rows are not checked "
        "against its required fields.",
        server,
        ROW_SCHEMA_PATH,
        problem,
    )
    return None


def check_rows_against_schemas(cfg: RolloutCollectionConfig, schemas: dict[str, RowSchema]) -> None:
    """A second streaming pass: raise InputError listing every row that lacks a field its environment
    needs or has one of the wrong JSON type (file, line and field), before anything is sent."""
    if not schemas:
        return
    path = Path(cfg.input_jsonl_fpath)
    bad = _BadLines()
    for line_no, line in _iter_input(cfg):
        row = orjson.loads(line)
        schema = schemas.get(_agent_of(row, cfg.agent_name) or "")
        bad.add(f"{path}:{line_no}", schema.problems(row) if schema is not None else [])
    bad.raise_if_any(f"{path} do not carry what their environment needs")


# ------------------------------------------------------------------------------------------------
# Output files.


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


class LineWriter:
    """Appends whole lines with one ``write`` system call each, so an interrupt never splits a line."""

    def __init__(self, path: Path, truncate: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
        self.fd = os.open(path, flags, 0o644)
        self.path = path

    def write(self, obj: Any) -> None:
        """Append ``obj`` as one JSON line."""
        data = orjson.dumps(obj) + b"\n"
        view = memoryview(data)
        while view:
            written = os.write(self.fd, view)
            view = view[written:]

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# ------------------------------------------------------------------------------------------------
# Running rollouts.


def classify_failure(exc: BaseException, agent: str) -> dict[str, Any]:
    """The failures-file fields of one failed rollout: kind, server, path, status, error (and via).

    When the agent answered with an error that names an inner failing call (a server it could not
    reach, a model answering 503, ...), that inner server is the one named; ``via`` records the hop
    through the agent. The error text is scrubbed of known secrets before it is cut to length.
    """
    if isinstance(exc, UpstreamError):
        error = exc.detail.get("error") if isinstance(exc.detail, dict) else None
        error = error if isinstance(error, dict) else {}
        inner = error.get("inner")
        if isinstance(inner, dict) and inner:
            return {
                "kind": inner.get("kind") or "upstream_error",
                "server": inner.get("server"),
                "path": inner.get("path"),
                "status": inner.get("status"),
                "error": _error_text(inner.get("detail")),
                "via": {"server": agent, "path": exc.path, "status": exc.status},
            }
        # The agent's own error (its body says which kind when it is one of our servers).
        kind = error.get("kind") if isinstance(error.get("kind"), str) else exc.kind
        return {
            "kind": kind,
            "server": exc.server,
            "path": exc.path,
            "status": exc.status,
            "error": _error_text(exc.detail),
        }
    return {
        "kind": type(exc).__name__,
        "server": agent,
        "path": "/run",
        "status": None,
        "error": _error_text(exc),
    }


def _error_text(detail: Any) -> str:
    """Error text for the failures file: secrets scrubbed, then cut to 4000 characters."""
    return process_scrubber().scrub(str(detail))[:4000]


# Statuses that say a server is unavailable (an agent or model server answers 502 when what it calls
# is unreachable past its own retries).
DOWN_STATUSES = frozenset({502, 503, 504})


def down_server(failure: dict[str, Any]) -> str | None:
    """The server a classified failure shows to be down, or None.

    Down means unreachable past the client's retries (``connection_error``) or answering 502/503/504.
    When the agent reports an inner failure, the inner server is the one named. A timeout, a 4xx, a
    500 (a bug) or a bad response says nothing about a server being down.
    """
    if failure.get("kind") == "connection_error" or failure.get("status") in DOWN_STATUSES:
        server = failure.get("server")
        return server if isinstance(server, str) and server else None
    return None


class ServerDownError(UpstreamError):
    """A row that was not sent because a server its agent needs is down (the circuit breaker is open)."""

    def __init__(self, agent: str, opened: dict[str, Any]) -> None:
        detail = f"not sent to {agent}: {describe_down(opened)}"
        super().__init__(opened["server"], opened.get("path") or "", None, detail, kind="server_down")
        self.agent = agent


def describe_down(opened: dict[str, Any]) -> str:
    """One sentence: which server is down and the evidence (kind, count, path, agent in between)."""
    via = opened.get("via") or {}
    what = f"{opened['consecutive_failures']} consecutive {opened['kind']}"
    if opened.get("status") is not None:
        what += f" (HTTP {opened['status']})"
    where = f" on {opened['path']}" if opened.get("path") else ""
    through = f", reported by agent {via['server']}" if via.get("server") else ""
    return f"server {opened['server']!r} is down: {what} failure(s){where}{through}"


class CircuitBreaker:
    """Stops sending to agents whose rollouts keep failing because a server is down.

    Per server, consecutive "down" failures (see :func:`down_server`) are counted; a successful
    rollout through an agent resets the counts of the servers that agent's failures named. At
    ``threshold`` the breaker for that server opens and stays open for the run: every agent whose
    failures named it (before or after) is blocked, so rows for it are not sent. O(1) per rollout.

    A server in ``replicated`` (several replicas) is down only when none of its replicas is alive:
    at ``threshold`` :meth:`failure` returns its name instead of opening, and the caller checks its
    replicas, then calls :meth:`confirm_down` (none answers) or :meth:`still_serving` (the failures
    were the sessions of a dead replica; the count starts again).
    """

    def __init__(self, threshold: int, replicated: Iterable[str] = ()) -> None:
        self.threshold = threshold
        self.replicated = frozenset(replicated)
        self._consecutive: dict[str, int] = {}
        self._named_by: dict[str, set[str]] = {}  # agent -> servers its down failures named
        self._pending: dict[str, dict[str, Any]] = {}  # replicated server -> the failure to check
        self.opened: dict[str, dict[str, Any]] = {}  # server -> the failure that opened its breaker
        self.blocked: dict[str, str] = {}  # agent -> the down server that blocks it
        self.replica_losses = 0  # down failures of replicated servers that still had a live replica

    def success(self, agent: str) -> None:
        """Record a finished rollout through ``agent``."""
        named = self._named_by.get(agent)
        if named:
            for server in named:
                self._consecutive.pop(server, None)
            named.clear()

    def failure(self, agent: str, failure: dict[str, Any]) -> str | None:
        """Record a failed rollout through ``agent`` (``failure`` as made by :func:`classify_failure`).

        Returns the name of a replicated server whose replicas the caller must check, else None."""
        server = down_server(failure)
        if server is None:
            return None
        self._named_by.setdefault(agent, set()).add(server)
        if server in self.opened:
            self.blocked.setdefault(agent, server)
            return None
        count = self._consecutive[server] = self._consecutive.get(server, 0) + 1
        if count >= self.threshold:
            if server in self.replicated:
                self._pending[server] = failure
                return server
            self._open(server, failure, count)
        return None

    def confirm_down(self, server: str) -> None:
        """No replica of ``server`` is alive: open its breaker."""
        failure = self._pending.pop(server, None)
        if failure is not None and server not in self.opened:
            self._open(server, failure, self._consecutive.get(server, self.threshold))

    def still_serving(self, server: str) -> None:
        """``server`` has a live replica: its failures so far do not make it down."""
        if self._pending.pop(server, None) is not None:
            self.replica_losses += self._consecutive.pop(server, 0)

    def _open(self, server: str, failure: dict[str, Any], count: int) -> None:
        fields = ("kind", "server", "path", "status", "via")
        self.opened[server] = {**{k: failure.get(k) for k in fields}, "consecutive_failures": count}
        for other, named in self._named_by.items():  # every agent whose failures named it
            if server in named:
                self.blocked.setdefault(other, server)

    def blocking(self, agent: str) -> dict[str, Any] | None:
        """The open breaker that blocks ``agent``, or None when rows for it may be sent."""
        server = self.blocked.get(agent) if self.blocked else None
        return None if server is None else self.opened[server]

    def report(self) -> list[dict[str, Any]]:
        """Every open breaker: the down server, the evidence, and the agents it blocked."""
        return [
            {**opened, "blocked_agents": sorted(a for a, s in self.blocked.items() if s == server)}
            for server, opened in self.opened.items()
        ]


async def run_one(client: ServerClient, row: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """POST one materialized row to its agent's /run; a non-2xx raises UpstreamError.

    The result is stamped with the row's task/rollout indices and ``agent_ref``."""
    result = await post_run(client, row, timeout_s)
    result["_ng_task_index"] = row["_ng_task_index"]
    result["_ng_rollout_index"] = row["_ng_rollout_index"]
    result["agent_ref"] = row["agent_ref"]
    return result


async def post_run(client: ServerClient, row: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """The ``/run`` JSON of ``row``'s agent for ``row``, as the agent returned it."""
    agent = row["agent_ref"]["name"]
    resp = await client.post(agent, "/run", json=row, timeout_s=timeout_s)
    if resp.status >= 300:
        body = response_body(resp)
        try:
            detail: Any = orjson.loads(body)
        except orjson.JSONDecodeError:
            detail = body.decode(errors="replace")[:4000]
        kind = "server_error" if resp.status >= 500 else "client_error"
        error = UpstreamError(agent, "/run", resp.status, detail, kind=kind)
        error.response_content = body  # the raw body, as upstream's error carries it (NeMo RL prints it)
        raise error
    return orjson.loads(response_body(resp))


async def bounded_map(
    rows: Iterable[dict[str, Any]],
    worker: Any,
    limit: int,
    stop: asyncio.Event | None = None,
    halt: Callable[[], bool] | None = None,
) -> AsyncIterator[tuple[dict[str, Any], Any, BaseException | None]]:
    """Run ``worker(row)`` with at most ``limit`` in flight, reading ``rows`` lazily; yield as each ends.

    Completions arrive through a queue (O(1) each), so 16k rollouts in flight cost no more per
    completion than 16. When ``stop`` is set, nothing new starts, work that has already finished is
    still yielded, and the rest of the in-flight work is cancelled. Once ``halt()`` is true, nothing
    new starts and the work in flight runs to its end.
    """
    pending: dict[asyncio.Future, dict[str, Any]] = {}
    finished: asyncio.Queue[asyncio.Future | None] = asyncio.Queue()
    it = iter(rows)
    exhausted = False
    watcher = None
    if stop is not None:
        watcher = asyncio.ensure_future(stop.wait())
        watcher.add_done_callback(lambda _: finished.put_nowait(None))

    def fill() -> None:
        nonlocal exhausted
        while not exhausted and len(pending) < limit and not (stop and stop.is_set() or halt and halt()):
            try:
                row = next(it)
            except StopIteration:
                exhausted = True
                return
            task = asyncio.ensure_future(worker(row))
            pending[task] = row
            task.add_done_callback(finished.put_nowait)

    try:
        fill()
        while pending:
            task = await finished.get()
            if task is None:  # stop requested: hand out what already finished, cancel the rest
                for done_task in [t for t in pending if t.done() and not t.cancelled()]:
                    row = pending.pop(done_task)
                    exc = done_task.exception()
                    yield row, (None if exc else done_task.result()), exc
                return
            row = pending.pop(task)
            if task.cancelled():
                continue
            exc = task.exception()
            yield row, (None if exc else task.result()), exc
            fill()
    finally:
        if watcher is not None:
            watcher.cancel()
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


class _Progress:
    """A tqdm bar on stderr with the running mean reward and the failure count (or nothing)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        self.reward_sum, self.n_ok, self.n_failed = 0.0, 0, 0
        self._last = 0.0
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="rollout", dynamic_ncols=True, file=sys.stderr)

    def update(self, reward: float | None) -> None:
        if reward is None:
            self.n_failed += 1
        else:
            self.n_ok += 1
            self.reward_sum += reward
        if self.bar is not None:
            self.bar.update(1)
            now = time.monotonic()
            if now - self._last > 0.5:
                self._last = now
                mean = self.reward_sum / self.n_ok if self.n_ok else float("nan")
                self.bar.set_postfix(mean_reward=f"{mean:.3f}", failed=self.n_failed, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            mean = self.reward_sum / self.n_ok if self.n_ok else float("nan")
            self.bar.set_postfix(mean_reward=f"{mean:.3f}", failed=self.n_failed, refresh=True)
            self.bar.close()


async def collect_rollouts(
    cfg: RolloutCollectionConfig,
    client: ServerClient,
    stop: asyncio.Event | None = None,
    validated: tuple[int, set[str]] | None = None,
) -> dict[str, Any]:
    """The whole job; returns the summary (also written to the metrics file).

    ``validated`` is the result of :func:`validate_input` when the caller already ran it.
    """
    n_rows, agents = validated if validated is not None else validate_input(cfg)
    check_agents_running(agents, client)
    check_rows_against_schemas(cfg, await fetch_row_schemas(agents, client))
    out_path = Path(cfg.output_jsonl_fpath)
    side = sidecar_paths(out_path)
    calls_path = model_calls_path(out_path)
    _check_output_paths(cfg, out_path, {**side, "model_calls": calls_path})
    try:
        capture = capture_wanted(client, cfg.observability_enabled)
    except ValueError as e:
        raise InputError(str(e)) from None

    if out_path.exists() and out_path.stat().st_size and not (cfg.resume_from_cache or cfg.overwrite):
        raise InputError(
            f"{out_path} already has rollouts. Pass +resume_from_cache=true to complete it, "
            "+overwrite=true to start over, or choose another +output_jsonl_fpath."
        )
    fresh = not cfg.resume_from_cache
    done: set[tuple[int, int]] = set()
    attempts: dict[tuple[int, int], int] = {}
    unreadable = 0
    if not fresh:
        # Check before touching anything, so a refused resume leaves every file as it was.
        _check_materialized_matches(cfg, side["materialized"])
        done, unreadable = _scan_existing_output(out_path)
        attempts = _scan_failures(side["failures"])
    if fresh or not side["materialized"].exists():
        writer = LineWriter(side["materialized"], truncate=True)
        try:
            for row in materialize(cfg):
                writer.write(row)
        finally:
            writer.close()

    exhausted = {k for k, a in attempts.items() if a >= cfg.max_attempts and k not in done}
    total = n_rows * cfg.num_repeats
    todo = total - len(done) - len(exhausted)
    breaker = CircuitBreaker(cfg.circuit_breaker_threshold, replicated_instances(client.global_config_dict))

    def rows_to_send() -> Iterator[dict[str, Any]]:
        for r in materialize(cfg):
            key = (r["_ng_task_index"], r["_ng_rollout_index"])
            if key in done or key in exhausted:
                continue
            if breaker.blocked and breaker.blocking(r["agent_ref"]["name"]) is not None:
                continue  # its agent needs a server that is down: not attempted, left for a resume
            yield r

    def all_agents_blocked() -> bool:
        return bool(breaker.blocked) and agents.issubset(breaker.blocked)

    out = LineWriter(out_path, truncate=fresh)
    failures = LineWriter(side["failures"], truncate=fresh)
    worker = lambda r: run_one(client, r, cfg.request_timeout_s)  # noqa: E731
    sink = ModelCallSink.for_client(client, LineWriter(calls_path, truncate=fresh)) if capture else None
    if sink is not None:  # each rollout's model calls, pulled as it ends (nemo_gym.observability)
        worker = sink.wrap(worker)
    progress = _Progress(todo, cfg.progress)
    t0 = time.monotonic()
    n_ok = n_failed = 0
    kinds: Counter[tuple[Any, ...]] = Counter()
    kind_paths: dict[tuple[Any, ...], set[str]] = {}
    try:
        if sink is not None:
            await sink.discard(rows_to_send())  # calls an interrupted earlier run left for these rollouts
        async for row, result, exc in bounded_map(
            rows_to_send(),
            worker,
            cfg.num_samples_in_parallel,
            stop,
            halt=all_agents_blocked,
        ):
            key = (row["_ng_task_index"], row["_ng_rollout_index"])
            agent = row["agent_ref"]["name"]
            reward = result.get("reward") if isinstance(result, dict) else None
            if exc is None and isinstance(reward, (int, float)) and not isinstance(reward, bool):
                out.write(result)
                n_ok += 1
                breaker.success(agent)
                progress.update(float(reward))
                continue
            if exc is None:
                no_reward = "the verify response has no numeric `reward`"
                exc = UpstreamError(agent, "/run", 200, no_reward, kind="bad_response")
            failure = classify_failure(exc, agent)
            check = breaker.failure(agent, failure)
            if check is not None:  # one dead replica of several is not a dead server
                if await live_replicas(client, check):
                    breaker.still_serving(check)
                else:
                    breaker.confirm_down(check)
            via = (failure.get("via") or {}).get("server")
            kind = (failure["kind"], failure["server"], failure["status"], via)  # as _KIND_FIELDS
            kinds[kind] += 1
            kind_paths.setdefault(kind, set()).add(str(failure["path"]))
            failures.write(
                process_scrubber().scrub_obj(
                    {
                        "_ng_task_index": key[0],
                        "_ng_rollout_index": key[1],
                        "agent_ref": row["agent_ref"],
                        "attempt": attempts.get(key, 0) + 1,
                        **failure,
                    }
                )
            )
            n_failed += 1
            progress.update(None)
    finally:
        progress.close()
        out.close()
        failures.close()
        if sink is not None:
            sink.close()
    wall = time.monotonic() - t0
    interrupted = bool(stop and stop.is_set())
    metrics = aggregate_metrics(out_path, pass_threshold=cfg.pass_threshold, max_k=cfg.num_repeats)
    done_after = metrics["num_rollouts"]
    summary = {
        "input_jsonl_fpath": cfg.input_jsonl_fpath,
        "rows": n_rows,
        "num_repeats": cfg.num_repeats,
        "expected_rollouts": total,
        "rollouts_ok": done_after,
        "rollouts_missing": total - done_after,
        "this_run": {
            "ok": n_ok,
            "failed": n_failed,
            "wall_time_s": wall,
            "rollouts_per_s": n_ok / wall if wall > 0 else 0.0,
        },
        "interrupted": interrupted,
        # Rows not sent this run (a server was down, or an interrupt): not failures, a resume runs them.
        "not_attempted": todo - n_ok - n_failed,
        "down_servers": breaker.report(),
        # Failures of a replicated server's sessions while another replica of it was alive.
        "replica_losses": breaker.replica_losses,
        "failure_kinds": [
            {**dict(zip(_KIND_FIELDS, k, strict=True)), "paths": sorted(kind_paths[k]), "count": n}
            for k, n in kinds.most_common()
        ],
        "skipped_after_max_attempts": len(exhausted),
        "max_attempts": cfg.max_attempts,
        "unreadable_output_lines": unreadable,
        "files": {"output": str(out_path), **{k: str(v) for k, v in side.items()}},
        **metrics,
    }
    if sink is not None:
        summary["model_calls"] = sink.summary(str(calls_path))
        summary["files"]["model_calls"] = str(calls_path)
    side["metrics"].write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    return summary


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


def format_summary(summary: dict[str, Any]) -> str:
    """The human-readable end-of-run report (the last line is ``Average reward: <mean>``)."""
    this = summary["this_run"]
    lines = [
        f"Rollouts: {summary['rollouts_ok']} / {summary['expected_rollouts']} ok"
        + (f", {summary['rollouts_missing']} missing" if summary["rollouts_missing"] else "")
        + (" (INTERRUPTED: rerun with +resume_from_cache=true to finish)" if summary["interrupted"] else ""),
        f"This run: {this['ok']} ok, {this['failed']} failed in {this['wall_time_s']:.1f} s "
        f"({this['rollouts_per_s']:.1f} rollouts/s)",
    ]
    for key in sorted(k for k in summary if k.startswith("mean/")):
        name = key[5:]
        lines.append(f"  {name:<24} mean {summary[key]:.4f}  std {summary.get('std/' + name, 0.0):.4f}")
    k_lines = [
        f"pass@{k}={summary[f'pass@{k}']:.3f}"
        for k in k_values(summary["num_repeats"])
        if f"pass@{k}" in summary
    ]
    if k_lines:
        lines.append(f"  tasks: {summary['num_tasks']}  " + "  ".join(k_lines))
    tok = summary["tokens"]
    lines.append(
        f"  tokens: input {tok['input_tokens']}, output {tok['output_tokens']}, total {tok['total_tokens']}"
    )
    if this["failed"]:
        lines.append(
            f"  {this['failed']} infrastructure failure(s) this run: see {summary['files']['failures']}"
        )
    for k in summary.get("failure_kinds", []):
        status = f" HTTP {k['status']}" if k["status"] is not None else ""
        via = f" via {k['via']}" if k["via"] else ""
        paths = ", ".join(k["paths"])
        lines.append(f"    {k['count']} x {k['kind']}{status} from {k['server']} ({paths}){via}")
    down = summary.get("down_servers") or []
    for d in down:
        agents = ", ".join(d["blocked_agents"])
        lines.append(f"  STOPPED: {describe_down(d)}; stopped sending rows to {agents}")
    if down and not summary["interrupted"]:
        lines.append(
            f"  {summary['not_attempted']} rollout(s) not attempted (not failures; they do not count towards "
            "+max_attempts). Restart the server(s), then rerun with +resume_from_cache=true."
        )
    if summary.get("skipped_after_max_attempts"):
        lines.append(
            f"  {summary['skipped_after_max_attempts']} rollout(s) skipped: they failed "
            f"{summary.get('max_attempts')} time(s) already (+max_attempts); see {summary['files']['failures']}"
        )
    if summary["rollouts_missing"] and not summary["interrupted"] and not down:
        lines.append("  Rerun with +resume_from_cache=true to retry the missing rollouts.")
    if summary.get("malformed_lines") or summary.get("unreadable_output_lines"):
        lines.append(
            f"  {summary.get('malformed_lines', 0)} unreadable line(s) in {summary['files']['output']} were skipped"
        )
    lines.append("Files: " + ", ".join(summary["files"].values()))
    if "mean/reward" in summary:
        lines.append(f"Average reward: {summary['mean/reward']:.4f}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Python API for trainers.


class RolloutCollectionHelper:
    """Run task rows through running agents from Python.

    ``for future in RolloutCollectionHelper().run_examples(rows, head_server_config=...):``
    ``    row, result = await future`` — futures complete in any order; at most
    ``num_samples_in_parallel`` rollouts are in flight. ``result`` is the verify response (with
    ``reward`` and every output item's token-id fields, when the model returns them).

    When ``circuit_breaker_threshold`` rollouts in a row fail because one server is down, the rows
    of that call not yet sent to the affected agent are not sent: their awaitables raise
    :class:`ServerDownError` (an :class:`UpstreamError`) naming the down server.
    """

    def __init__(
        self,
        num_samples_in_parallel: int = 256,
        request_timeout_s: float = 3600.0,
        circuit_breaker_threshold: int = 3,
    ) -> None:
        if circuit_breaker_threshold < 1:
            raise ValueError(f"circuit_breaker_threshold must be >= 1, got {circuit_breaker_threshold!r}")
        raise_open_file_limit()
        self.num_samples_in_parallel = num_samples_in_parallel
        self.request_timeout_s = request_timeout_s
        self.circuit_breaker_threshold = circuit_breaker_threshold
        self._clients: dict[tuple[str, int], ServerClient] = {}

    def _client(self, head: BaseServerConfig | None) -> ServerClient:
        key = (head.host, head.port) if head else ("", 0)
        if key not in self._clients:
            self._clients[key] = ServerClient.load_from_global_config(head)
        return self._clients[key]

    def run_examples(
        self,
        examples: list[dict[str, Any]],
        head_server_config: BaseServerConfig | None = None,
        semaphore: asyncio.Semaphore | None = None,
    ) -> Iterator[Awaitable[tuple[dict[str, Any], dict[str, Any]]]]:
        """Start every example now (call from a running event loop); yield awaitables in completion order.

        Each awaitable gives ``(row, result)``: ``row`` is the very dict passed in (nothing added),
        ``result`` the agent's ``/run`` JSON as it returned it (upstream's semantics; the verify
        response echoes the row's fields, so indices a row carries come back). ``semaphore`` bounds
        the rollouts in flight (default: ``num_samples_in_parallel``). An infrastructure failure
        raises :class:`UpstreamError` (``.status`` is the HTTP status, None when no answer came), and
        a row held back because a server is down raises :class:`ServerDownError`.
        """
        client = self._client(head_server_config)
        if semaphore is None:
            semaphore = asyncio.Semaphore(self.num_samples_in_parallel)
        breaker = CircuitBreaker(
            self.circuit_breaker_threshold, replicated_instances(client.global_config_dict)
        )

        async def one(row: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
            if not isinstance(row.get("agent_ref"), dict) or "name" not in row["agent_ref"]:
                raise ValueError("each example needs agent_ref: {name: <agent instance>}")
            agent = row["agent_ref"]["name"]
            async with semaphore:
                opened = breaker.blocking(agent)
                if opened is not None:
                    raise ServerDownError(agent, opened)
                try:
                    result = await post_run(client, row, self.request_timeout_s)
                except UpstreamError as e:
                    check = breaker.failure(agent, classify_failure(e, agent))
                    if check is not None:  # one dead replica of several is not a dead server
                        if await live_replicas(client, check):
                            breaker.still_serving(check)
                        else:
                            breaker.confirm_down(check)
                    raise
                breaker.success(agent)
                return row, result

        return asyncio.as_completed([asyncio.ensure_future(one(r)) for r in examples])

    async def aclose(self) -> None:
        """Close this event loop's HTTP connections (optional; avoids "unclosed session" warnings)."""
        await close_shared_session()


# ------------------------------------------------------------------------------------------------
# CLI.


def collect_main(argv: list[str] | None = None) -> None:
    """``ng_collect_rollouts``. Exit status: 0 all rollouts done, 1 some missing (failures), 2 bad
    input or options (nothing sent), 3 stopped early because a server is down, 130 interrupted
    (for 1, 3 and 130: rerun with ``+resume_from_cache=true``)."""
    from omegaconf import OmegaConf

    from nemo_gym.global_config import (
        COMMAND_OPTIONS,
        HEAD_SERVER_KEY_NAME,
        load_global_config,
        option_problems,
        parse_cli_overrides,
    )

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: ng_collect_rollouts +agent_name=<agent> +input_jsonl_fpath=<in.jsonl> +output_jsonl_fpath=<out.jsonl>\n"
            "  [+limit=N] [+num_repeats=K] [+num_samples_in_parallel=P] [+num_repeats_add_seed=true]\n"
            "  [+responses_create_params.temperature=0.7 ...] [+resume_from_cache=true] [+max_attempts=3]\n"
            "  [+overwrite=true] [+pass_threshold=1.0] [+request_timeout_s=3600] [+progress=false]\n"
            "  [+head_server.host=127.0.0.1 +head_server.port=11000]\n"
            "  [+circuit_breaker_threshold=3] [+tracker=mlflow|wandb (docs/concepts.md: Experiment tracking)]\n"
            "  [+observability_enabled=true|false (model calls to <stem>_model_calls.jsonl; docs/trainers.md)]\n"
            "exit status: 0 all done, 1 some rollouts missing (see the failures file), 2 bad input or options,\n"
            "  3 stopped early because a server is down (restart it, then +resume_from_cache=true), 130 interrupted"
        )
        return
    raise_open_file_limit()
    try:
        cli_keys = {o.key.split(".")[0] for o in parse_cli_overrides(argv) if not o.delete}
        loaded = load_global_config(argv)
        add_secret_values(config_secret_values(loaded.config, loaded.env_yaml_data))  # scrubbed from failures
        # Every key on the command line must be an option; config files and env.yaml are shared with
        # other tools, so only their near-misses of an option are reported.
        problems = option_problems(loaded, "ng_collect_rollouts", strict_cli=True)
        container = OmegaConf.to_container(loaded.config, resolve=True)
    except ConfigError as e:
        sys.stderr.write(str(e) + "\n")
        sys.exit(2)
    if problems:
        unknown = sorted("+" + k for k in cli_keys if k not in COMMAND_OPTIONS["ng_collect_rollouts"])
        sys.stderr.write(
            f"ng_collect_rollouts: unknown option(s): {', '.join(unknown) or 'see below'}. See --help.\n  - "
            + "\n  - ".join(problems)
            + "\n"
        )
        sys.exit(2)
    head = container.pop(HEAD_SERVER_KEY_NAME, None) or {}
    fields = {k: v for k, v in container.items() if k in RolloutCollectionConfig.model_fields}
    try:
        cfg = RolloutCollectionConfig.model_validate(fields)
    except ValidationError as e:
        msgs = [f"+{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()]
        sys.stderr.write("ng_collect_rollouts: invalid options:\n  " + "\n  ".join(msgs) + "\n")
        sys.exit(2)
    try:
        head_cfg = BaseServerConfig(host=head.get("host") or "127.0.0.1", port=int(head.get("port") or 11000))
    except (TypeError, ValueError, ValidationError) as e:
        sys.stderr.write(f"ng_collect_rollouts: invalid +head_server: {e}\n")
        sys.exit(2)
    try:
        summary = asyncio.run(_collect_with_signals(cfg, head_cfg))
    except (InputError, ConnectionError) as e:
        sys.stderr.write(f"ng_collect_rollouts: {e}\n")
        sys.exit(2)
    print(format_summary(summary), flush=True)
    if cfg.tracker:
        from nemo_gym.eval.tracking import track_run

        out = Path(cfg.output_jsonl_fpath)
        track_run(cfg.tracker, container, summary, out, run_name=out.stem, e2e=False)
    if summary["interrupted"]:
        sys.exit(130)
    if summary["down_servers"]:
        for d in summary["down_servers"]:
            sys.stderr.write(f"ng_collect_rollouts: stopped early: {describe_down(d)}.\n")
        sys.stderr.write(
            f"ng_collect_rollouts: {summary['not_attempted']} rollout(s) not attempted, "
            f"{summary['this_run']['failed']} failed; restart the server(s), then rerun with +resume_from_cache=true.\n"
        )
        sys.exit(EXIT_SERVER_DOWN)
    sys.exit(1 if summary["rollouts_missing"] else 0)


async def _collect_with_signals(cfg: RolloutCollectionConfig, head: BaseServerConfig) -> dict[str, Any]:
    """Validate the input (before any server is contacted), then collect; SIGINT/SIGTERM stop cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    validated = validate_input(cfg)
    client = ServerClient.load_from_global_config(head, timeout_s=cfg.request_timeout_s)
    try:
        return await collect_rollouts(cfg, client, stop, validated=validated)
    finally:
        await close_shared_session()
