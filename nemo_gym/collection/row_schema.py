"""Task rows against the schema their environment publishes (``GET /row_schema`` of its resources server).

Contract
--------
* :func:`fetch_row_schemas` gets each agent's resources server's schema once per server. An agent
  without a resources server, or a schema that cannot be fetched (bounded by
  ``ROW_SCHEMA_TIMEOUT_S``), gets one warning and no check.
* :class:`RowSchema` checks a row for missing required fields, top-level fields of the wrong JSON
  type, values outside a field's enum (or its items' enum) and ``contentMediaType:
  application/json`` strings that are not JSON; each message names the field and the server (and
  the ``x-used-by`` paths) that needs it.
* :func:`check_input` is the collector's one streaming pass over the input before anything is sent:
  the format checks of :func:`~nemo_gym.collection.input_rows.validate_input`, the agents running,
  and each row against its agent's schema (fetched lazily, when a row first names the agent).
* :func:`check_rows_against_schemas` is a separate streaming pass over the input that raises one
  :class:`InputError` listing every bad row (file:line and field) before anything is sent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from nemo_gym.client.server_client import ServerClient, find_instance_block
from nemo_gym.collection.input_rows import (
    InputScan,
    _agent_of,
    _BadLines,
    _iter_input,
    check_agents_running,
    running_agents,
)
from nemo_gym.collection.options import RolloutCollectionConfig
from nemo_gym.errors import UpstreamError, response_body

logger = logging.getLogger("nemo_gym")


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


class _SchemaCache:
    """Each agent's row schema, fetched when first asked for, once per resources server."""

    def __init__(self, client: ServerClient) -> None:
        self.client = client
        self._by_agent: dict[str, RowSchema | None] = {}
        self._by_server: dict[str, RowSchema | None] = {}

    async def get(self, agent: str) -> RowSchema | None:
        if agent in self._by_agent:
            return self._by_agent[agent]
        found = find_instance_block(self.client.global_config_dict, agent)
        ref = found[2].get("resources_server") if found is not None and hasattr(found[2], "get") else None
        server = ref.get("name") if hasattr(ref, "get") else None
        schema = None
        if not isinstance(server, str) or not server:
            logger.warning(
                "Agent %s names no resources_server in its config: task rows for it are not checked "
                "against an environment schema.",
                agent,
            )
        else:
            if server not in self._by_server:
                self._by_server[server] = await _fetch_row_schema(server, self.client)
            schema = self._by_server[server]
        self._by_agent[agent] = schema
        return schema


async def fetch_row_schemas(agents: set[str], client: ServerClient) -> dict[str, RowSchema]:
    """The row schema of each agent's resources server, by agent.

    An agent whose config names no ``resources_server``, or whose server does not publish a schema
    (not built on ``SimpleResourcesServer``, unreachable, an error) is left out with one warning.
    """
    cache = _SchemaCache(client)
    schemas: dict[str, RowSchema] = {}
    for agent in sorted(agents):
        schema = await cache.get(agent)
        if schema is not None:
            schemas[agent] = schema
    return schemas


@dataclass(frozen=True)
class CheckedInput:
    """What :func:`check_input` found: the rows, the agents they use, and the client it connected."""

    n_rows: int
    agents: set[str]
    client: ServerClient


async def check_input(
    cfg: RolloutCollectionConfig, connect: ServerClient | Callable[[], ServerClient]
) -> CheckedInput:
    """One streaming pass over the input that does :func:`validate_input` and
    :func:`check_rows_against_schemas` together, before anything is sent; memory does not grow with
    the input.

    ``connect`` is the client, or makes it: it is called when the first well-formed row names an
    agent (its schema is fetched then, once per resources server). The problems are raised in the
    order of the separate checks: the rows' format (also when the head server cannot be reached),
    no rows, the connection, agents not running (:func:`check_agents_running`), then the rows that
    lack what their environment needs.
    """
    scan = InputScan(cfg)
    client: ServerClient | None = connect if isinstance(connect, ServerClient) else None
    unreachable: ConnectionError | None = None
    cache: _SchemaCache | None = None
    running: set[str] | None = None
    schema_bad = _BadLines()
    for where, row, agent in scan.rows():
        if scan.bad.count or unreachable is not None:
            continue  # the format problems are raised first; no schema check is needed then
        if client is None:
            try:
                client = connect()  # type: ignore[operator]
            except ConnectionError as e:
                unreachable = e
                continue
        if cache is None:
            cache = _SchemaCache(client)
            running = set(running_agents(client))
        if agent not in running:  # type: ignore[operator]
            continue  # reported by check_agents_running below
        schema = await cache.get(agent)
        schema_bad.add(where, schema.problems(row) if schema is not None else [])
    n_rows, agents = scan.finish()
    if unreachable is not None:
        raise unreachable
    if client is None:
        client = connect()  # type: ignore[operator]
    check_agents_running(agents, client)
    schema_bad.raise_if_any(f"{scan.path} do not carry what their environment needs")
    return CheckedInput(n_rows, agents, client)


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
