"""structured_outputs: the answer must be a document in a given format that follows a given schema.

Contract
--------
* A row carries ``schema_str`` (a JSON Schema, as JSON text) and ``schema_type`` (the format the answer
  must be written in: ``json``, ``yaml``, ``xml``, ``toml`` or ``csv``; default ``json``), plus
  upstream NeMo Gym's optional descriptive fields (``problem_type``, ``schema_repr``, ...), which are
  kept and used to break down metrics (``problem_type`` also picks the all-empty rule below). Field
  names follow upstream's ``structured_outputs``.
* ``response_mode: text`` (default): the answer is the concatenated ``output_text`` of the assistant
  messages, parsed in ``schema_type`` (XML leaf strings and CSV cells are coerced to the schema's
  types first, as upstream). ``response_mode: tool_call``: the answer is the arguments of the single
  function call (of ``tool_name`` when given), or their ``tool_payload_key`` entry.
* The schema is made strict (every declared property required, no others), then the answer is
  validated with ``jsonschema`` (Draft 2020-12). Reward 1.0 when it parses and validates, else 0.0,
  with ``error_type`` (``empty_response``, ``parse_error``, ``validation_error``, ``missing_tool_call``,
  ``multiple_tool_calls``, ``wrong_tool_name``, ``tool_arguments_parse_error``,
  ``missing_tool_payload_key``; and ``content_free`` / ``content_mismatch`` below) and ``error_message``.
* Content (ours): a row may carry ``expected_document`` (the document its task implies) and
  ``expected_rules`` (how parts of it compare, by JSON Pointer); then reward 1.0 also needs the parsed,
  schema-coerced answer to match it (:mod:`reference`: strings normalised, numbers within 1e-9, arrays
  one to one in any order unless a tuple or a rule says otherwise), else 0.0 with ``content_mismatch``
  naming the first field that differs. An extraction or conversion row (``problem_type``) refuses a
  document whose every value is empty, zero, false or null (``content_free``), reference or not. Any
  other row without a reference is scored on form only, as upstream scores every row; a bad rule is a
  422.
* One document of plain data: a key given twice in a JSON object or YAML mapping, JSON's ``NaN`` /
  ``Infinity`` and YAML aliases are a ``parse_error``; a number that is not finite (any format) is a
  ``validation_error``; tool-call arguments get the same JSON reading. ``failure_reason`` is
  ``error_type`` and ``error_message`` in one line.
* Parsing and validation of large answers or schemas (over ``pool_threshold_chars``) run in
  :mod:`nemo_gym.kit.verify_pool`, off the event loop, bounded; a check killed or crashed twice is the
  answer's ``check_timeout`` (0), never a 503. Each process checks a distinct schema against the
  metaschema and builds its validator once (the last 1,024 are kept): that check took ~40% of the
  server's CPU when it ran on every ``/verify``.
* A malformed ``schema_str`` is bad data, not a wrong answer: ``ng_collect_rollouts`` refuses a row
  whose ``schema_str`` is not JSON (file, line, field) before any rollout, and ``/verify`` answers 422
  for one that is JSON but not a valid schema. (Upstream scores both 0.0 with ``schema_error``.)
"""

from __future__ import annotations

import csv
import io
import json
import math
import tomllib
from collections import defaultdict
from enum import StrEnum
from statistics import mean
from typing import Any, ClassVar

import xmltodict
import yaml
from fastapi import HTTPException
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import Field

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)
from nemo_gym.kit.process_cache import ProcessCache
from nemo_gym.kit.verify_pool import VerifyTimeoutError, VerifyWorkerCrashedError, run_in_verify_pool
from resources_servers.structured_outputs.reference import (
    InvalidReference,
    content_free,
    first_difference,
    parse_rules,
)


class SchemaType(StrEnum):
    JSON = "json"
    YAML = "yaml"
    XML = "xml"
    TOML = "toml"
    CSV = "csv"


class StructuredOutputsResourcesServerConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS
    xml_coerce_types: bool = True
    # Answers or schemas longer than this are checked in the verify pool (a worker process).
    pool_threshold_chars: int = 20_000
    pool_timeout_seconds: float = 30.0


# Added to pool_timeout_seconds for the pool's bound: a fresh worker imports jsonschema and the parsers.
IMPORT_ALLOWANCE_SECONDS = 30.0


# Descriptive fields of upstream's datasets: kept in the verify response, used to break down metrics.
_BREAKDOWN_FIELDS = (
    "problem_type",
    "schema_repr",
    "response_mode",
    "tool_schema_mode",
    "tool_choice",
    "parallel_tool_calls",
    "num_tools",
    "has_distractors",
    "instruction_layout",
    "instruction_detail_level",
    "system_instruction_style",
    "tool_name_style",
    "distractor_style",
    "tool_union_mode",
)


class StructuredOutputsVerifyRequest(BaseVerifyRequest):
    schema_str: str = Field(
        json_schema_extra={"contentMediaType": "application/json"},
        description="The JSON Schema the answer must follow, as JSON text.",
    )
    schema_type: SchemaType = SchemaType.JSON
    response_mode: str | None = "text"
    tool_name: str | None = None
    tool_payload_key: str | None = None
    problem_type: str | None = None
    schema_repr: str | None = None
    source_format: str | None = None
    num_turns: int | None = None
    source_record_id: str | None = None
    tool_schema_mode: str | None = None
    tool_choice: str | None = None
    parallel_tool_calls: bool | None = None
    source_schema_type: str | None = None
    num_tools: int | None = None
    num_distractors: int | None = None
    has_distractors: bool | None = None
    instruction_layout: str | None = None
    instruction_detail_level: str | None = None
    system_instruction_style: str | None = None
    tool_name_style: str | None = None
    distractor_style: str | None = None
    tool_union_mode: str | None = None
    # Ours (optional): the content the answer must carry. README "Reward" says how it is compared.
    expected_document: Any = Field(
        default=None,
        description="The document the task's source implies (or what makes the content checkable): "
        "reward 1 then needs the answer to match it.",
    )
    expected_rules: dict[str, Any] | None = Field(
        default=None,
        description="How parts of expected_document are compared, by JSON Pointer: ordered / unordered / "
        "contains for arrays, or {array, any_of, tolerance, substrings}.",
    )


class StructuredOutputsVerifyResponse(StructuredOutputsVerifyRequest, BaseVerifyResponse):
    error_type: str | None = None
    error_message: str | None = None
    # error_type and error_message in one line (None when the reward is 1).
    failure_reason: str | None = None


# Distinct schemas whose checked form and validator are kept (see _checked_schema).
SCHEMA_CACHE_SIZE = 1024


class InvalidSchema(ValueError):
    """``schema_str`` is not a usable JSON Schema (bad data, not a wrong answer)."""


def content_task(problem_type: str | None) -> str | None:
    """``extraction`` or ``conversion`` when ``problem_type`` names one (a task whose answer carries
    values from its source), else None."""
    kind = (problem_type or "").lower()
    if "extract" in kind:
        return "extraction"
    return "conversion" if "conversion" in kind or "convert" in kind else None


def strictify_schema(schema: Any) -> None:
    """In place: every object schema with ``properties`` requires all of them and allows no others."""
    if isinstance(schema, dict):
        if isinstance(schema.get("properties"), dict):
            schema["required"] = list(schema["properties"])
            schema["additionalProperties"] = False
        for value in schema.values():
            strictify_schema(value)
    elif isinstance(schema, list):
        for value in schema:
            strictify_schema(value)


def load_schema(schema_str: str) -> dict[str, Any]:
    """The strict form of the schema in ``schema_str``; raises :class:`InvalidSchema`."""
    try:
        schema = json.loads(schema_str)
    except json.JSONDecodeError as e:
        raise InvalidSchema(f"schema_str is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidSchema(f"schema_str must be a JSON object, got {type(schema).__name__}")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        raise InvalidSchema(f"schema_str is not a valid JSON Schema: {e.message}") from None
    strictify_schema(schema)
    return schema


def _make_checked_schema(schema_str: str) -> tuple[dict[str, Any], Draft202012Validator]:
    """:func:`load_schema` and its validator, kept per distinct ``schema_str`` by :data:`_checked_schema`.

    Checking a schema against the 2020-12 metaschema costs milliseconds (jsonschema resolves the
    metaschema's ``$dynamicRef``s on every check), far more than validating a short answer; the rollouts
    of a task share its schema. The schema returned is shared: callers only read it. A bad schema is not
    cached (it raises each time).
    """
    schema = load_schema(schema_str)
    return schema, Draft202012Validator(schema)


# Per process, the last SCHEMA_CACHE_SIZE schemas; check_document sent to a Ray worker takes an empty one
# along (nemo_gym.kit.process_cache).
_checked_schema = ProcessCache(_make_checked_schema, maxsize=SCHEMA_CACHE_SIZE)


def _coerce_scalar(value: Any, kind: Any) -> Any:
    if isinstance(kind, list):
        if value in (None, "") and "null" in kind:
            return None
        for k in kind:
            if k == "null":
                continue
            out = _coerce_scalar(value, k)
            if k == "string" or not isinstance(out, str):
                return out
        return value
    if not isinstance(value, str) or value == "":
        return value
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            return float(value)
    except ValueError:
        return value
    if kind == "boolean" and value.lower() in ("true", "1", "false", "0"):
        return value.lower() in ("true", "1")
    return value


def coerce_xml(data: Any, schema: Any) -> Any:
    """xmltodict gives strings (and single-child dicts for lists): reshape ``data`` to the schema's types."""
    if not isinstance(schema, dict) or "type" not in schema:
        return data
    kind = schema["type"]
    if kind == "object" and isinstance(data, dict):
        props = schema.get("properties", {})
        return {k: coerce_xml(v, props[k]) if k in props else v for k, v in data.items()}
    if kind == "array":
        if isinstance(data, dict) and len(data) == 1:
            data = next(iter(data.values()))
        if not isinstance(data, list):
            data = [] if data is None else [data]
        return [coerce_xml(item, schema.get("items", {})) for item in data]
    if data is None and kind == "string":
        return ""
    return _coerce_scalar(data, kind)


def coerce_csv(rows: list[dict[str, Any]], schema: dict[str, Any]) -> list[dict[str, Any]]:
    """CSV cells are strings: convert each to its column's type in the (array-of-objects) schema."""
    props = schema.get("items", schema).get("properties", {})
    return [
        {k: _coerce_scalar(v, props.get(k, {}).get("type", "string")) for k, v in row.items()} for row in rows
    ]


class _StrictYamlLoader(yaml.SafeLoader):
    """YAML without aliases (``*name``; a few hundred characters of nested aliases stand for billions of
    nodes, and validating or printing them never ends) and without a key given twice in one mapping."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not allowed in an answer", mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        keys = [self.construct_object(k, deep=True) for k, _ in node.value]
        hashable = [k for k in keys if isinstance(k, (str, int, float, bool)) or k is None]
        if len(set(hashable)) != len(hashable):
            twice = next(k for k in hashable if hashable.count(k) > 1)
            raise yaml.constructor.ConstructorError(None, None, f"key {twice!r} given twice", node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} given twice")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json(text: str) -> Any:
    """``json.loads`` without NaN / Infinity (not JSON) and without a key given twice in one object."""
    return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)


def parse_document(schema_type: str, text: str) -> Any:
    match SchemaType(schema_type):
        case SchemaType.JSON:
            return strict_json(text)
        case SchemaType.YAML:
            return yaml.load(text, Loader=_StrictYamlLoader)  # noqa: S506 (a SafeLoader)
        case SchemaType.XML:
            return xmltodict.parse(text)
        case SchemaType.TOML:
            return tomllib.loads(text)
        case SchemaType.CSV:
            return list(csv.DictReader(io.StringIO(text)))


def non_finite_number(document: Any) -> str | None:
    """Where ``document`` holds a number that is not finite (NaN, an infinity; YAML's ``.nan``, TOML's
    ``inf``, JSON's ``1e999``), as a path; None when it holds none. JSON Schema numbers are finite,
    and NaN passes every ``minimum`` / ``maximum``. Iterative: a deep document cannot exhaust the stack."""
    stack: list[tuple[str, Any]] = [("", document)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return where or "(root)"
        if isinstance(value, dict):
            stack.extend((f"{where}/{k}".lstrip("/"), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{where}/{i}".lstrip("/"), v) for i, v in enumerate(value))
    return None


def _first_error(validator: Draft202012Validator, document: Any) -> str | None:
    error = next(iter(sorted(validator.iter_errors(document), key=lambda e: list(e.path))), None)
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return f"at {where}: {error.message}"[:300]


def check_document(
    schema_str: str,
    schema_type: str,
    text: str | None,
    obj: Any = None,
    coerce_xml_types: bool = True,
    expected_document: Any = None,
    expected_rules: dict[str, Any] | None = None,
    problem_type: str | None = None,
) -> tuple[float, str | None, str | None]:
    """(reward, error_type, error_message) of a text answer (``text``) or an already parsed one (``obj``).

    After the schema, the content: for an extraction or conversion ``problem_type`` a document without
    any value is ``content_free``; with ``expected_document`` the answer must match it
    (``content_mismatch``, naming the first field that differs; :mod:`reference`).

    Raises :class:`InvalidSchema` for a bad ``schema_str`` and :class:`InvalidReference` for a bad
    reference. Pure and picklable: runs in the verify pool.
    """
    schema, validator = _checked_schema(schema_str)
    rules = parse_rules(expected_rules, expected_document)
    if text is not None:
        if not text.strip():
            return 0.0, "empty_response", "No assistant response text"
        try:
            obj = parse_document(schema_type, text)
        except Exception as e:  # any parser's error: the answer is not a document of that format
            return 0.0, "parse_error", f"{type(e).__name__}: {str(e)[:200]}"
        if schema_type == SchemaType.XML and coerce_xml_types:
            obj = coerce_xml(obj, schema)
        elif schema_type == SchemaType.CSV:
            obj = coerce_csv(obj, schema)
    if (where := non_finite_number(obj)) is not None:
        return 0.0, "validation_error", f"at {where}: a number that is not finite (NaN or infinity)"
    try:
        problem = _first_error(validator, obj)
    except RecursionError:
        return 0.0, "validation_error", "the document is nested too deeply to validate"
    if problem:
        return 0.0, "validation_error", problem
    if (kind := content_task(problem_type)) is not None and content_free(obj):
        article = "an" if kind == "extraction" else "a"
        why = f"every value of the document is empty, zero or false: no answer to {article} {kind} task"
        return 0.0, "content_free", why
    if expected_document is not None:
        try:
            problem = first_difference(expected_document, obj, rules, schema)
        except RecursionError:
            raise InvalidReference("expected_document is nested too deeply to compare") from None
        if problem is not None:
            return 0.0, "content_mismatch", problem
    return 1.0, None, None


class StructuredOutputsResourcesServer(SimpleResourcesServer):
    config: StructuredOutputsResourcesServerConfig

    async def verify(self, body: StructuredOutputsVerifyRequest) -> StructuredOutputsVerifyResponse:
        text: str | None = None
        obj: Any = None
        if body.response_mode == "tool_call":
            obj, error_type, message = self._tool_call_payload(body)
            if error_type is not None:
                return self._answer(body, 0.0, error_type, message)
            size = len(json.dumps(obj))
        else:
            text = body.response.output_text
            size = len(text)
        args = (
            body.schema_str,
            body.schema_type.value,
            text,
            obj,
            self.config.xml_coerce_types,
            body.expected_document,
            body.expected_rules,
            body.problem_type,
        )
        if body.expected_document is not None:
            try:
                size += len(json.dumps(body.expected_document))
            except (RecursionError, ValueError):
                raise HTTPException(422, "bad row: expected_document is nested too deeply") from None
        try:
            if size + len(body.schema_str) > self.config.pool_threshold_chars:
                result = await self._check_in_pool(args)
            else:
                result = check_document(*args)
        except (InvalidSchema, InvalidReference) as e:
            raise HTTPException(status_code=422, detail=f"bad row: {e}") from None
        return self._answer(body, *result)

    async def _check_in_pool(self, args: tuple[Any, ...]) -> tuple[float, str | None, str | None]:
        """:func:`check_document` in the verify pool. A check killed past ``pool_timeout_seconds`` (plus
        a fresh worker's imports), or whose worker dies, is tried once more on a fresh worker; twice is
        the answer's doing (``check_timeout``, a 0), never a 503."""
        bound = self.config.pool_timeout_seconds + IMPORT_ALLOWANCE_SECONDS
        why = ""
        for _ in range(2):
            try:
                return await run_in_verify_pool(check_document, *args, timeout=bound)
            except VerifyTimeoutError:
                why = f"parsing and validating the answer did not finish within {bound:g} s (twice)"
            except VerifyWorkerCrashedError:
                why = "the worker parsing and validating the answer died (twice)"
        return 0.0, "check_timeout", why

    @staticmethod
    def _answer(
        body: StructuredOutputsVerifyRequest, reward: float, error_type: str | None, message: str | None
    ) -> StructuredOutputsVerifyResponse:
        fields = body.model_dump(exclude={"reward", "error_type", "error_message", "failure_reason"})
        reason = f"{error_type}: {message}" if error_type is not None else None
        return StructuredOutputsVerifyResponse(
            **fields, reward=reward, error_type=error_type, error_message=message, failure_reason=reason
        )

    @staticmethod
    def _tool_call_payload(body: StructuredOutputsVerifyRequest) -> tuple[Any, str | None, str | None]:
        calls = [item for item in body.response.output if item.type == "function_call"]
        if not calls:
            return None, "missing_tool_call", "No function_call item in the response"
        names = ", ".join(c.name for c in calls)
        if len(calls) > 1:
            return None, "multiple_tool_calls", f"Expected exactly one function_call, got: {names}"
        call = calls[0]
        if body.tool_name and call.name != body.tool_name:
            return None, "wrong_tool_name", f"Expected tool '{body.tool_name}', got: {names}"
        try:
            arguments = strict_json(call.arguments)
        except (ValueError, RecursionError) as e:  # not JSON, NaN, a key twice, or nested too deeply
            return None, "tool_arguments_parse_error", f"{type(e).__name__}: {str(e)[:200]}"
        if body.tool_payload_key:
            if not isinstance(arguments, dict) or body.tool_payload_key not in arguments:
                return None, "missing_tool_payload_key", f"Missing tool payload key: {body.tool_payload_key}"
            return arguments[body.tool_payload_key], None, None
        return arguments, None, None

    def compute_metrics(self, tasks: list[list[dict[str, Any]]]) -> dict[str, Any]:
        """Mean reward per format (``mean/reward_json``...) and per value of each descriptive field."""
        groups: dict[str, list[float]] = defaultdict(list)
        for rollouts in tasks:
            for r in rollouts:
                reward = float(r.get("reward", 0.0))
                groups[f"mean/reward_{r.get('schema_type', 'unknown')}"].append(reward)
                if r.get("problem_type"):
                    groups[f"mean/reward_{r['problem_type']}"].append(reward)
                if r.get("schema_repr"):
                    groups[f"mean/reward_repr_{r['schema_repr']}"].append(reward)
                for name in _BREAKDOWN_FIELDS[2:]:
                    value = r.get(name)
                    if value is None or value == "":
                        continue
                    shown = str(value).lower() if isinstance(value, bool) else str(value)
                    groups[f"mean/reward_{name}_{shown}"].append(reward)
                if r.get("error_type"):
                    groups[f"rate/error_{r['error_type']}"].append(1.0)
        total = sum(len(rollouts) for rollouts in tasks) or 1
        out = {k: mean(v) for k, v in groups.items() if not k.startswith("rate/")}
        out |= {k: len(v) / total for k, v in groups.items() if k.startswith("rate/")}
        return out


if __name__ == "__main__":
    StructuredOutputsResourcesServer.run_webserver()
