"""Hostile input to every route of a running stack: a clear 4xx, never a 500, and every server stays up.

One ``ng_run`` with the features the last issues added: model-call capture (rollout prefixes,
``/ng_model_calls/pop``), an environment exposing its tools over MCP (workplace_assistant), the
scripted model and two simple agents. Every route each server lists in its OpenAPI schema gets a set of
malformed bodies (not JSON, wrong types, nulls, deep nesting, a lone surrogate, huge numbers); then the
routes outside the schema (``/mcp``, ``/ng-rollout/<id>/...``) and run rows whose identity fields cannot
make a rollout id. An answer of 5xx is allowed only when an agent reports that an inner server refused
the row (502 carrying the inner 4xx); an ``internal_error`` (an unhandled exception) fails the test.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from nemo_gym.auth import auth_headers
from tests.conftest import Launcher, get_json

CONFIGS = [
    "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml",
    "responses_api_models/scripted_model/configs/scripted_model_example_single_tool_call.yaml",
    "resources_servers/workplace_assistant/configs/workplace_assistant.yaml",
]
AGENT = "example_single_tool_call_simple_agent"

LONE_SURROGATE = b'{"city": "\\ud800"}'
HOSTILE_BODIES: list[tuple[str, bytes]] = [
    ("not json", b"{not json"),
    ("empty", b""),
    ("null", b"null"),
    ("array", b"[1, 2, 3]"),
    ("string", b'"x"'),
    ("huge number", b"1e999"),
    ("deep nesting", b"[" * 5000 + b"]" * 5000),
    ("empty object", b"{}"),
    (
        "wrong types",
        json.dumps(
            {
                "responses_create_params": 5,
                "response": "x",
                "input": {"a": 1},
                "city": ["x"],
                "rollout_ids": "x",
                "session_id": "../../etc/passwd",
            }
        ).encode(),
    ),
    (
        "nulls",
        json.dumps(dict.fromkeys(["responses_create_params", "response", "input", "tools", "city"])).encode(),
    ),
    ("lone surrogate (escaped)", LONE_SURROGATE),
    ("lone surrogate (bytes)", '{"city": "\ud800"}'.encode("utf-8", "surrogatepass")),
    ("big integer", b'{"task_idx": 123456789012345678901234567890, "rollout_ids": [1e400]}'),
]


@pytest.fixture(scope="module")
def stack(launch_module: Launcher) -> Iterator[dict[str, Any]]:
    run = launch_module(
        f"+config_paths=[{','.join(CONFIGS)}]",
        "++workplace_assistant.resources_servers.workplace_assistant.expose_tools_over_mcp=true",
        "+observability_enabled=true",
        "+head_server.port=0",
    )
    assert run.wait_ready() == 5
    instances = get_json(run.head_url + "/server_instances", token=run.token)
    with httpx.Client(timeout=30, trust_env=False, headers=auth_headers(run.token)) as client:
        yield {"client": client, "urls": {i["name"]: i["url"].rstrip("/") for i in instances}}


def _acceptable(resp: httpx.Response) -> bool:
    """A 4xx; or an agent's 502 saying an inner server refused the request (its row's fault)."""
    if resp.status_code < 500:
        return True
    try:
        inner = resp.json()["error"]["inner"]
    except (ValueError, KeyError, TypeError):
        return False
    return resp.status_code == 502 and isinstance(inner.get("status"), int) and 400 <= inner["status"] < 500


def test_every_schema_route_answers_hostile_bodies_with_a_4xx(stack: dict[str, Any]) -> None:
    client: httpx.Client = stack["client"]
    bad: list[str] = []
    tried = 0
    for name, url in stack["urls"].items():
        spec = client.get(url + "/openapi.json").json()
        for path, operations in spec["paths"].items():
            for method in operations:
                if method not in ("post", "put", "patch"):
                    continue
                for label, body in HOSTILE_BODIES:
                    resp = client.request(
                        method.upper(), url + path, content=body, headers={"content-type": "application/json"}
                    )
                    tried += 1
                    if not _acceptable(resp):
                        bad.append(
                            f"{name} {method.upper()} {path} [{label}] -> {resp.status_code} {resp.text[:300]}"
                        )
    assert tried > 100  # every server's routes were reached
    assert not bad, "\n".join(bad)
    for url in stack["urls"].values():
        assert client.get(url + "/").status_code == 200


def test_a_lone_surrogate_is_refused_at_the_door(stack: dict[str, Any]) -> None:
    """Before: parsed into a string that no JSON encoder can write back, so a tool echoing it was a 500."""
    resp = stack["client"].post(
        stack["urls"]["example_single_tool_call"] + "/get_weather",
        content=LONE_SURROGATE,
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 422, resp.text
    assert (
        resp.json()["detail"][0]["type"] == "json_invalid" and "surrogate" in resp.json()["error"]["message"]
    )


@pytest.mark.parametrize(
    "identity, field",
    [
        ({"_ng_rollout_id": "../x"}, "_ng_rollout_id"),
        ({"_ng_rollout_id": 5}, "_ng_rollout_id"),
        ({"_ng_rollout_id": "a" * 5000}, "_ng_rollout_id"),
        ({"_ng_task_index": "x/../../ng_model_calls/pop", "_ng_rollout_index": 0}, "_ng_task_index"),
        ({"_ng_task_index": 0, "_ng_rollout_index": -1}, "_ng_rollout_index"),
        ({"_ng_task_index": 0, "_ng_rollout_index": 0, "_ng_attempt_index": "2"}, "_ng_attempt_index"),
    ],
)
def test_run_rows_whose_identity_cannot_make_a_rollout_id_are_a_422_naming_the_field(
    stack: dict[str, Any], identity: dict[str, Any], field: str
) -> None:
    """Before: a ValueError (500), or a task index with slashes spliced into the model call's path."""
    row = {"responses_create_params": {"input": "What is the weather in Paris?"}, "expected_city": "Paris"}
    resp = stack["client"].post(stack["urls"][AGENT] + "/run", json={**row, **identity})
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"][0]["loc"] == ["body", field]


def test_routes_outside_the_schema(stack: dict[str, Any]) -> None:
    client: httpx.Client = stack["client"]
    model, env = stack["urls"]["policy_model"], stack["urls"]["workplace_assistant"]
    bad: list[str] = []

    def check(resp: httpx.Response, what: str) -> None:
        if not _acceptable(resp):
            bad.append(f"{what} -> {resp.status_code} {resp.text[:300]}")

    for prefix in ("-x", "", "x%00y", "x/ng-rollout/y", "%2e%2e"):
        check(
            client.post(f"{model}/ng-rollout/{prefix}/v1/responses", json={"input": "hi"}),
            f"prefix {prefix!r}",
        )
    for body in ({}, {"rollout_ids": None}, {"rollout_ids": [1, None, {"a": 1}]}, {"rollout_ids": ["../x"]}):
        check(client.post(model + "/ng_model_calls/pop", json=body), f"pop {body}")
    for messages in ("hi", [1, 2], None):
        check(client.post(model + "/v1/chat/completions", json={"messages": messages}), f"chat {messages!r}")
    mcp_headers = {"accept": "application/json, text/event-stream", "content-type": "application/json"}
    for raw in (
        b"{",
        b"[]",
        b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}',
        b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"nope","arguments":{}}}',
    ):
        for extra in ({}, {"mcp-session-id": "../../x"}):
            check(
                client.post(env + "/mcp", content=raw, headers={**mcp_headers, **extra}), f"mcp {raw[:40]!r}"
            )
    assert not bad, "\n".join(bad)
    for url in stack["urls"].values():
        assert client.get(url + "/").status_code == 200
