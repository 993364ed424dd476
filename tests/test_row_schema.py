"""Task rows are checked against the schema the environment publishes, before any rollout.

What is proven here:
* A resources server publishes ``GET /row_schema``: the fields of its ``/seed_session`` and
  ``/verify`` request bodies (not ``response``), with which endpoint reads each.
* ``ng_collect_rollouts`` on the real example_single_tool_call environment: rows lacking
  ``expected_city`` or carrying it with the wrong JSON type are all reported (file, line, field),
  exit status 2, nothing is sent (the model answered no request) and nothing is written.
* An agent with no resources server, or whose resources server publishes no schema, gets one
  warning and its rows are not held back.
* The JSON type rules of the check (integers as numbers, optional fields, nested models).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import orjson
import pytest
from omegaconf import OmegaConf

from nemo_gym.client.server_client import close_shared_session
from nemo_gym.collection.output_files import sidecar_paths
from nemo_gym.collection.row_schema import RowSchema, check_rows_against_schemas, fetch_row_schemas
from nemo_gym.rollout_collection import RolloutCollectionConfig
from nemo_gym.server.resources import task_row_schema
from nemo_gym.server_utils import ServerClient
from nemo_gym.tools.testing import example_rows, get, running_servers, server_url
from resources_servers.example_multi_step.app import ExampleMultiStepServer
from resources_servers.example_session_state_mgmt.app import ExampleSessionStateMgmtServer
from tests.test_rollout_collection import (
    WEATHER,
    WEATHER_AGENT,
    base_args,
    collect_here,
    config_of,
    head_port,
)

MODEL = "policy_model"


def _model_requests(helper: Any) -> int:
    resp = get(server_url(helper, MODEL) + "/stats")
    assert resp.status_code == 200, resp.text
    return resp.json()["requests"]


def test_rows_missing_verifier_fields_are_refused_before_anything_is_sent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = example_rows(WEATHER)[0]
    rows: list[dict[str, Any]] = [
        good,
        {k: v for k, v in good.items() if k != "expected_city"},  # line 2: the verifier's field is missing
        {**good, "expected_city": 5},  # line 3: wrong JSON type
        good,
        {k: v for k, v in good.items() if k != "expected_city"},  # line 5
    ]
    input_path = tmp_path / "tasks.jsonl"
    input_path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    out = tmp_path / "out.jsonl"
    with running_servers([config_of(WEATHER)]) as helper:
        # The schema the collector reads is what the server publishes over HTTP.
        resp = get(server_url(helper, WEATHER) + "/row_schema")
        assert resp.status_code == 200, resp.text
        schema = resp.json()
        assert schema["required"] == ["responses_create_params", "expected_city"]
        assert schema["properties"]["expected_city"]["type"] == "string"
        assert schema["properties"]["expected_city"]["x-used-by"] == ["/verify"]
        assert "response" not in schema["properties"]

        code, stdout, stderr = collect_here(base_args(input_path, out), head_port(helper), capsys)
        requests_seen = _model_requests(helper)
    assert code == 2, stderr[-3000:]
    where = str(input_path)
    assert "3 line(s)" in stderr and "nothing was sent" in stderr
    assert f"{where}:2: missing field `expected_city`, needed by {WEATHER} /verify" in stderr
    assert f"{where}:3: field `expected_city` must be string for {WEATHER} /verify, got integer" in stderr
    assert f"{where}:5: missing field `expected_city`" in stderr
    assert f"{where}:1:" not in stderr and f"{where}:4:" not in stderr
    assert "Traceback" not in stderr and stdout == ""
    assert requests_seen == 0  # no rollout started: the model answered nothing
    assert not out.exists() and not any(p.exists() for p in sidecar_paths(out).values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tasks.jsonl"]


async def test_no_resources_server_or_no_schema_warns_once_and_does_not_block(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    with running_servers([config_of(WEATHER)]) as helper:
        client = ServerClient.load_from_global_config(helper.head_server_config)
        cfg = client.global_config_dict
        agent_block = OmegaConf.to_container(cfg[WEATHER_AGENT], resolve=True)
        # A custom agent that names no resources server, and two whose "resources server" is a real
        # server that publishes no schema (the model server answers 404).
        custom = {"responses_api_agents": {"custom_agent": {"host": "127.0.0.1", "port": 1}}}
        no_schema = {
            "responses_api_agents": {"simple_agent": {**agent_block["responses_api_agents"]["simple_agent"]}}
        }
        no_schema["responses_api_agents"]["simple_agent"]["resources_server"] = {
            "type": "responses_api_models",
            "name": MODEL,
        }
        OmegaConf.update(cfg, "custom", custom, force_add=True)
        OmegaConf.update(cfg, "no_schema_1", no_schema, force_add=True)
        OmegaConf.update(cfg, "no_schema_2", no_schema, force_add=True)
        try:
            with caplog.at_level(logging.WARNING, logger="nemo_gym"):
                schemas = await fetch_row_schemas(
                    {WEATHER_AGENT, "custom", "no_schema_1", "no_schema_2"}, client
                )
        finally:
            await close_shared_session()
    assert sorted(schemas) == [WEATHER_AGENT] and schemas[WEATHER_AGENT].server == WEATHER
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 2, messages
    assert "Agent custom names no resources_server" in messages[0]
    assert (
        f"Cannot get the task-row schema of resources server {MODEL}" in messages[1]
        and "HTTP 404" in messages[1]
    )

    # Rows for those agents are not held back; a row for the checked agent still is.
    row = {k: v for k, v in example_rows(WEATHER)[0].items() if k != "expected_city"}
    path = tmp_path / "rows.jsonl"
    path.write_bytes(
        b"".join(orjson.dumps({**row, "agent_ref": {"name": a}}) + b"\n" for a in ("custom", "no_schema_1"))
    )
    check_rows_against_schemas(
        RolloutCollectionConfig(input_jsonl_fpath=str(path), output_jsonl_fpath="o"), schemas
    )
    path.write_bytes(orjson.dumps({**row, "agent_ref": {"name": WEATHER_AGENT}}) + b"\n")
    with pytest.raises(Exception, match=r"rows\.jsonl:1: missing field `expected_city`"):
        check_rows_against_schemas(
            RolloutCollectionConfig(input_jsonl_fpath=str(path), output_jsonl_fpath="o"), schemas
        )


def test_published_schemas_of_the_example_environments() -> None:
    counter = task_row_schema(ExampleSessionStateMgmtServer)
    assert counter["required"] == ["responses_create_params", "initial_count", "expected_count"]
    assert counter["properties"]["initial_count"]["x-used-by"] == ["/seed_session"]
    assert counter["properties"]["expected_count"]["x-used-by"] == ["/verify"]
    multi = task_row_schema(ExampleMultiStepServer)
    assert multi["required"] == ["responses_create_params", "expected_synonyms", "expected_synonym_values"]
    assert multi["properties"]["expected_synonyms"]["type"] == "array"

    check = RowSchema("example_session_state_mgmt", counter)
    base = {"responses_create_params": {"input": "hi"}}
    assert check.problems({**base, "initial_count": 1, "expected_count": 3}) == []
    assert check.problems({**base, "initial_count": 1.0, "expected_count": 3}) == []  # integral number
    assert check.problems({**base, "expected_count": 3}) == [
        "missing field `initial_count`, needed by example_session_state_mgmt /seed_session"
    ]
    assert check.problems({**base, "initial_count": "1", "expected_count": True}) == [
        "field `initial_count` must be integer for example_session_state_mgmt /seed_session, got string",
        "field `expected_count` must be integer for example_session_state_mgmt /verify, got boolean",
    ]


def test_json_type_rules_of_the_row_check() -> None:
    schema = {
        "properties": {
            "score": {"type": "number"},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "meta": {"$ref": "#/$defs/Meta"},
            "label": {"enum": ["a", "b"]},
            "anything": {},
        },
        "required": ["score"],
        "$defs": {"Meta": {"type": "object", "properties": {"k": {"type": "string"}}}},
    }
    check = RowSchema("env", schema)
    assert check.problems({"score": 1, "note": None, "meta": {"k": "v"}, "label": "a", "anything": [1]}) == []
    assert check.problems({"score": 0.5, "note": "x"}) == []
    assert check.problems({"note": 3, "meta": [], "label": 1}) == [
        "missing field `score`, needed by env",
        "field `note` must be null or string for env, got integer",
        "field `meta` must be object for env, got array",
        "field `label` must be string for env, got integer",
    ]


def test_enum_and_json_text_rules_of_the_row_check() -> None:
    schema = {
        "properties": {
            "mode": {"enum": ["a", "b"], "type": "string"},
            "ids": {"type": "array", "items": {"$ref": "#/$defs/Id"}},
            "schema_str": {"type": "string", "contentMediaType": "application/json"},
        },
        "$defs": {"Id": {"enum": ["x:1", "y:2"], "type": "string"}},
    }
    check = RowSchema("env", schema)
    assert check.problems({"mode": "a", "ids": ["y:2", "x:1"], "schema_str": '{"type": "object"}'}) == []
    problems = check.problems({"mode": "c", "ids": ["x:1", "z:9"], "schema_str": "{not json"})
    assert len(problems) == 3, problems
    assert problems[0].startswith('field `mode` has unknown value(s) ["c"] for env; known: "a", "b"')
    assert problems[1].startswith('field `ids` has unknown value(s) ["z:9"]')
    assert problems[2].startswith("field `schema_str` must be JSON text for env")
    # A field of the wrong type is reported once, as such.
    assert check.problems({"mode": 1}) == ["field `mode` must be string for env, got integer"]
