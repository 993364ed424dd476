"""simple_agent over real HTTP: the loop, tool-call failures the model can read, max_steps, errors, token ids.

The servers: the scripted ``policy_model`` (scripts chosen by a ``[case:...]`` marker in the user
message), a second scripted ``token_model`` returning token ids, the test-only resources server
``agent_test_tools`` (tests/fixture_root/resources_servers/agent_test_tools/) and two simple_agent
instances, ``test_agent`` (max_steps 3) and ``token_agent``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from openai.types.responses import Response
from pydantic import ValidationError

from nemo_gym.openai_utils import TOKEN_ID_FIELDS, NeMoGymResponse, NeMoGymResponseCreateParamsNonStreaming
from nemo_gym.tools.testing import get, post_json, running_servers, server_url

FIXTURE_ROOT = Path(__file__).resolve().parent / "fixture_root"
CONFIG = str(FIXTURE_ROOT / "resources_servers" / "agent_test_tools" / "configs" / "agent_test_tools.yaml")


def _tool(name: str, properties: dict[str, Any] | None = None) -> dict[str, Any]:
    props = properties or {}
    return {
        "type": "function",
        "name": name,
        "description": f"The {name} tool.",
        "parameters": {
            "type": "object",
            "properties": props,
            "required": list(props),
            "additionalProperties": False,
        },
    }


TOOLS = [
    _tool("record", {"value": {"type": "string"}}),
    _tool("explode"),
    _tool("refuse", {"reason": {"type": "string"}}),
    _tool("broken_infra"),
    _tool("hang", {"seconds": {"type": "number"}}),
]


def _call(name: str, arguments: Any = None) -> dict[str, Any]:
    return {"name": name, "arguments": {} if arguments is None else arguments}


def _case(marker: str, *turns: dict[str, Any]) -> dict[str, Any]:
    return {"contains": f"[case:{marker}]", "turns": list(turns)}


DONE = {"text": "All done."}
SCRIPTS = [
    _case("happy", {"tool_calls": [_call("record", {"value": "a"})]}, DONE),
    _case(
        "in_order",
        {"tool_calls": [_call("record", {"value": v}) for v in ("first", "second", "third")]},
        DONE,
    ),
    _case("unknown_tool", {"tool_calls": [_call("teleport", {"to": "Mars"})]}, DONE),
    _case("bad_json", {"tool_calls": [_call("record", '{"value": "a"')]}, DONE),
    _case("not_object", {"tool_calls": [_call("record", "[1, 2]")]}, DONE),
    _case("schema", {"tool_calls": [_call("record", {"valu": "typo"})]}, DONE),
    _case("raises", {"tool_calls": [_call("explode")]}, DONE),
    _case("refuses", {"tool_calls": [_call("refuse", {"reason": "not today"})]}, DONE),
    _case(
        "mixed",
        {
            "tool_calls": [
                _call("record", {"value": "x"}),
                _call("explode"),
                _call("teleport"),
                _call("record", {"value": "y"}),
            ]
        },
        DONE,
    ),
    _case("loop", *[{"tool_calls": [_call("record", {"value": f"step{i}"})]} for i in range(10)]),
    _case("model_down", {"http_error": 503}),
    _case("model_down_later", {"tool_calls": [_call("record", {"value": "a"})]}, {"http_error": 500}),
    _case("infra", {"tool_calls": [_call("broken_infra")]}, DONE),
    _case("tool_hangs", {"tool_calls": [_call("hang", {"seconds": 30})]}, DONE),
    _case("model_hangs", {"delay_s": 30, "text": "too late"}),
    _case("dropped", {"delay_s": 3, "tool_calls": [_call("record", {"value": "late"})]}, DONE),
]

EXTRA_CONFIG = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": SCRIPTS}}}}


@pytest.fixture(scope="module")
def urls() -> Iterator[dict[str, str]]:
    old_cwd = os.getcwd()
    os.chdir(FIXTURE_ROOT)  # so resources_servers/agent_test_tools/ resolves; servers keep this cwd
    try:
        with running_servers([CONFIG], EXTRA_CONFIG) as helper:
            os.chdir(old_cwd)
            names = (
                "test_agent",
                "token_agent",
                "bounded_agent",
                "policy_model",
                "token_model",
                "agent_test_tools",
            )
            yield {name: server_url(helper, name) for name in names}
    finally:
        os.chdir(old_cwd)


def make_row(marker: str, task_id: int = 7, **fields: Any) -> dict[str, Any]:
    return {
        "responses_create_params": {
            "input": [
                {"role": "developer", "content": "Use the tools."},
                {"role": "user", "content": f"[case:{marker}] please"},
            ],
            "tools": TOOLS,
        },
        "task_id": task_id,
        "ground_truth": {"nested": [1, 2, {"deep": None}]},
        "label": "keep me",
        **fields,
    }


def run(urls: dict[str, str], row: dict[str, Any], agent: str = "test_agent") -> dict[str, Any]:
    resp = post_json(urls[agent] + "/run", row, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def outputs_of(result: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [item for item in result["response"]["output"] if item["type"] == kind]


def _same_params(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal as Responses parameters (a hop may spell out defaults such as an input item's type)."""
    parse = NeMoGymResponseCreateParamsNonStreaming.model_validate
    return parse(a).model_dump(mode="json") == parse(b).model_dump(mode="json")


def tool_texts(result: dict[str, Any]) -> list[str]:
    return [item["output"] for item in outputs_of(result, "function_call_output")]


# -- the loop -------------------------------------------------------------------------------------------


def test_happy_rollout_seeds_calls_tools_verifies_and_keeps_task_fields(urls: dict[str, str]) -> None:
    # A row copied from an earlier output line carries a stale reward: the verifier's replaces it.
    row = make_row("happy", task_id=41, extra_metric_input=3.5, reward=-7.0)
    result = run(urls, row)
    assert result["reward"] == 1.0
    # Every task field of the row survives, unchanged, although the verifier declares only task_id.
    for key in ("task_id", "ground_truth", "label", "extra_metric_input"):
        assert result[key] == row[key]
    assert _same_params(result["responses_create_params"], row["responses_create_params"])
    # The session cookie was passed seed -> tools -> verify.
    assert result["seen_task_id"] == 41 and result["session_calls"] == ["a"]
    types = [item["type"] for item in result["response"]["output"]]
    assert types == ["function_call", "function_call_output", "message"]
    call, output = result["response"]["output"][:2]
    assert output["call_id"] == call["call_id"]
    assert orjson.loads(output["output"]) == {"calls": ["a"]}
    NeMoGymResponse.model_validate(result["response"])


def test_several_tool_calls_of_one_turn_run_in_order(urls: dict[str, str]) -> None:
    result = run(urls, make_row("in_order"))
    output = result["response"]["output"]
    assert [item["type"] for item in output] == ["function_call"] * 3 + ["function_call_output"] * 3 + [
        "message"
    ]
    calls, results = output[:3], output[3:6]
    assert [r["call_id"] for r in results] == [c["call_id"] for c in calls]
    assert [orjson.loads(r["output"])["calls"] for r in results] == [
        ["first"],
        ["first", "second"],
        ["first", "second", "third"],
    ]
    assert result["session_calls"] == ["first", "second", "third"]


@pytest.mark.parametrize(
    ("marker", "expected"),
    [
        ("unknown_tool", ["unknown tool 'teleport'", "record", "explode"]),
        ("bad_json", ["'record'", "not valid JSON"]),
        ("not_object", ["'record'", "must be a JSON object", "list"]),
        ("schema", ["invalid arguments for tool 'record'", "value", "valu"]),
        ("raises", ["tool 'explode' failed", "RuntimeError", "kaboom: the tool broke"]),
        ("refuses", ["tool 'refuse'", "400", "refused: not today"]),
    ],
)
def test_a_bad_tool_call_becomes_text_the_model_reads(
    urls: dict[str, str], marker: str, expected: list[str]
) -> None:
    result = run(urls, make_row(marker))
    texts = tool_texts(result)
    assert len(texts) == 1
    for fragment in expected:
        assert fragment in texts[0], (fragment, texts[0])
    # The rollout went on: the model got the error as a tool result and answered.
    last = result["response"]["output"][-1]
    assert last["type"] == "message" and last["content"][0]["text"] == "All done."
    assert result["reward"] == 0.0  # nothing recorded, so the verifier says 0 (not an infrastructure error)


def test_good_and_bad_calls_in_one_turn_each_get_their_own_result(urls: dict[str, str]) -> None:
    result = run(urls, make_row("mixed"))
    calls = outputs_of(result, "function_call")
    results = outputs_of(result, "function_call_output")
    assert [r["call_id"] for r in results] == [c["call_id"] for c in calls]
    assert orjson.loads(results[0]["output"]) == {"calls": ["x"]}
    assert "kaboom" in results[1]["output"]
    assert "unknown tool 'teleport'" in results[2]["output"]
    assert orjson.loads(results[3]["output"]) == {"calls": ["x", "y"]}
    assert result["reward"] == 1.0


def test_max_steps_bounds_the_model_turns(urls: dict[str, str]) -> None:
    result = run(urls, make_row("loop"))  # the script would call a tool 10 times; test_agent allows 3
    types = [item["type"] for item in result["response"]["output"]]
    assert types == ["function_call", "function_call_output"] * 3
    assert result["session_calls"] == ["step0", "step1", "step2"]


def test_concurrent_rollouts_keep_separate_sessions(urls: dict[str, str]) -> None:
    rows = [make_row("happy", task_id=100 + i) for i in range(6)]
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(lambda r: run(urls, r), rows))
    assert [r["seen_task_id"] for r in results] == [100 + i for i in range(6)]
    assert all(r["session_calls"] == ["a"] and r["reward"] == 1.0 for r in results)


def test_agent_responses_endpoint_returns_a_trajectory_the_sdk_parses(urls: dict[str, str]) -> None:
    body = make_row("in_order")["responses_create_params"]
    resp = post_json(urls["test_agent"] + "/v1/responses", body, timeout=60)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    parsed = Response.model_validate(data, strict=True)
    assert parsed.output_text == "All done."
    assert [item.type for item in parsed.output].count("function_call_output") == 3
    usage = data["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] > 0
    # Usage is summed over the two model turns: more than a single model answer reports.
    single = post_json(urls["policy_model"] + "/v1/responses", body).json()["usage"]
    assert usage["input_tokens"] > single["input_tokens"]


# -- strictness and errors ----------------------------------------------------------------------------


def test_unknown_key_in_responses_create_params_is_a_422_naming_it(urls: dict[str, str]) -> None:
    row = make_row("happy")
    row["responses_create_params"]["max_tokens"] = 10  # a Chat Completions name, not a Responses one
    resp = post_json(urls["test_agent"] + "/run", row)
    assert resp.status_code == 422
    error = resp.json()["error"]
    assert error["server"] == "test_agent" and error["path"] == "/run"
    assert "responses_create_params.max_tokens" in error["message"]

    direct = post_json(urls["test_agent"] + "/v1/responses", {"input": "hi", "max_tokens": 10})
    assert direct.status_code == 422 and "max_tokens" in direct.json()["error"]["message"]


def test_a_failing_model_is_a_502_naming_server_path_and_inner_error(urls: dict[str, str]) -> None:
    for marker, status in (("model_down", 503), ("model_down_later", 500)):
        resp = post_json(urls["test_agent"] + "/run", make_row(marker))
        assert resp.status_code == 502, resp.text
        error = resp.json()["error"]
        assert (
            error["kind"] == "upstream_error" and error["server"] == "test_agent" and error["path"] == "/run"
        )
        inner = error["inner"]
        assert inner["server"] == "policy_model" and inner["path"] == "/v1/responses"
        assert inner["status"] == status and inner["kind"] == "http_error"
        assert f"scripted HTTP {status}" in orjson.dumps(inner["detail"]).decode()


def test_an_infrastructure_failure_of_a_tool_fails_the_rollout(urls: dict[str, str]) -> None:
    resp = post_json(urls["test_agent"] + "/run", make_row("infra"))
    assert resp.status_code == 502, resp.text
    inner = resp.json()["error"]["inner"]
    assert (
        inner["server"] == "agent_test_tools" and inner["path"] == "/broken_infra" and inner["status"] == 503
    )
    assert "database unavailable" in orjson.dumps(inner["detail"]).decode()


# -- token ids end to end ----------------------------------------------------------------------------------


def test_token_ids_pass_every_hop_unchanged(urls: dict[str, str]) -> None:
    """scripted token_model -> simple_agent -> /verify -> /run output: the ids on the items are identical
    to what the model produces for those prompts (replayed here straight against the model)."""
    row = make_row("anything", task_id=5)
    result = run(urls, row, agent="token_agent")
    output = result["response"]["output"]
    assert [item["type"] for item in output] == ["function_call", "function_call_output", "message"]
    assert result["reward"] == 1.0

    model_url = urls["token_model"] + "/v1/responses"
    params = row["responses_create_params"]
    # Turn 1 was prompted with the row's input; turn 2 with that plus turn 1's call and its result.
    for turn_index, history in ((0, []), (2, output[:2])):
        replay = post_json(model_url, {**params, "input": params["input"] + history}).json()["output"]
        direct, through = replay[-1], output[turn_index]
        assert through["type"] == direct["type"]
        for fname in TOKEN_ID_FIELDS:
            assert through[fname] == direct[fname], fname
        assert len(through["generation_log_probs"]) == len(through["generation_token_ids"]) > 0
    # The agent's own items carry none.
    assert not set(TOKEN_ID_FIELDS) & set(output[1])


def import_app() -> Any:
    """simple_agent's app.py as a module."""
    path = Path(__file__).resolve().parent.parent / "app.py"
    spec = importlib.util.spec_from_file_location("simple_agent_app_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_config_requires_at_least_one_step() -> None:
    module = import_app()
    refs = {
        "name": "a",
        "resources_server": {"type": "resources_servers", "name": "r"},
        "model_server": {"type": "responses_api_models", "name": "m"},
    }
    assert module.SimpleAgentConfig.model_validate(refs).max_steps == 20
    with pytest.raises(ValidationError, match="max_steps"):
        module.SimpleAgentConfig.model_validate({**refs, "max_steps": 0})
    with pytest.raises(ValidationError, match="model_sever"):
        module.SimpleAgentConfig.model_validate({**refs, "model_sever": {}})


@pytest.mark.parametrize(
    ("marker", "server", "path", "setting"),
    [
        ("tool_hangs", "agent_test_tools", "/hang", "tool_timeout_s"),
        ("model_hangs", "policy_model", "/v1/responses", "model_timeout_s"),
    ],
)
def test_a_hanging_call_fails_after_the_agents_bound_naming_server_path_and_setting(
    urls: dict[str, str], marker: str, server: str, path: str, setting: str
) -> None:
    # bounded_agent sets 1.5 s for model and tool calls; the scripted model / the tool would take 30 s.
    # The client's own timeout (20 s) is far below 30 s, so a 504 here can only come from the bound.
    resp = post_json(urls["bounded_agent"] + "/run", make_row(marker), timeout=20)
    assert resp.status_code == 504, resp.text
    error = resp.json()["error"]
    assert error["kind"] == "upstream_error" and error["server"] == "bounded_agent"
    inner = error["inner"]
    assert inner["kind"] == "timeout" and inner["server"] == server and inner["path"] == path
    assert f"{setting} of agent 'bounded_agent'" in inner["detail"] and "1.5 s" in inner["detail"]


def test_the_default_bounds_keep_the_model_servers_own_timeout_first() -> None:
    from nemo_gym.base_responses_api_agent import BaseResponsesAPIAgentConfig

    agent = import_app().SimpleAgentConfig.model_validate(
        {
            "resources_server": {"type": "resources_servers", "name": "r"},
            "model_server": {"type": "responses_api_models", "name": "m"},
        }
    )
    model_server_default = 600.0  # openai_model / vllm_model timeout_s
    assert agent.model_timeout_s > model_server_default and agent.verify_timeout_s > model_server_default
    assert agent.tool_timeout_s < 600.0  # a hanging tool no longer costs ten minutes
    assert isinstance(agent, BaseResponsesAPIAgentConfig)


def test_a_dropped_rollout_stops_at_once(urls: dict[str, str]) -> None:
    """The caller gives up during a 3 s model turn: the rollout is cancelled there, so the agent neither
    calls the tool the turn asked for nor makes the second model turn (before: it went on to the end)."""
    stats = urls["policy_model"] + "/stats"
    before = get(stats).json()["requests"]
    with pytest.raises(httpx.ReadTimeout):
        post_json(urls["test_agent"] + "/run", make_row("dropped"), timeout=1)
    time.sleep(4.5)  # the model's turn has ended; a rollout still running would have made turn 2 by now
    assert get(stats).json()["requests"] == before + 1
    # The agent is unharmed: the next rollout runs to the end.
    assert run(urls, make_row("happy"))["reward"] == 1.0
