"""scripted_model over real HTTP: the official ``openai`` SDK talks to it, scripts play, token ids are stable."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import (
    Response,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseReasoningItem,
)
from pydantic import ValidationError

from nemo_gym.auth import client_token_for_url
from nemo_gym.tools.testing import (
    WEATHER_CHAT_TOOL,
    WEATHER_TOOL,
    example_rows,
    post_json,
    run_rollout,
    running_servers,
    server_url,
)
from resources_servers.example_single_tool_call.app import weather_report

TOOLS = [WEATHER_TOOL]
EXAMPLE_CONFIG = "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml"
CHAT_TOOLS = [WEATHER_CHAT_TOOL]

SCRIPTS = [
    {
        "contains": "[script:three_turns]",
        "turns": [
            {
                "reasoning": "I should look it up.",
                "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}],
            },
            {"tool_calls": [{"name": "get_weather", "arguments": "{not json"}]},
            {"text": "Done."},
        ],
    },
    {"contains": "[script:fail]", "turns": [{"http_error": 503}]},
    {"contains": "[script:cut]", "turns": [{"incomplete": True, "text": "Half an ans"}]},
]

EXTRA_CONFIG = {
    "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": SCRIPTS}}},
    "token_model": {
        "responses_api_models": {
            "scripted_model": {"entrypoint": "app.py", "return_token_id_information": True}
        }
    },
}


def _load_app() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "app.py"
    spec = importlib.util.spec_from_file_location("scripted_model_app_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


# Rules from a file (checked before scripts_by_input): by rollout id, by both conditions, echo turns.
FILE_RULES = [
    {"rollout_id": "audit-1", "contains": "[both]", "turns": [{"text": "rollout one, both conditions"}]},
    {"rollout_id": "audit-1", "turns": [{"text": "rollout one"}]},
    {"contains": "[echo:prompt]", "turns": [{"echo": "prompt"}]},
    {
        "contains": "[echo:tools]",
        "turns": [
            {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]},
            {"echo": "tool_outputs"},
        ],
    },
    {
        "contains": "[echo:plain]",
        "turns": [{"tool_calls": [{"name": "get_weather"}]}, {"echo": "tool_outputs_plain"}],
    },
]


@pytest.fixture(scope="module")
def urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """One run for the whole module: the scripted policy_model plus a second instance with token ids."""
    rules = tmp_path_factory.mktemp("rules") / "rules.json"
    rules.write_text(json.dumps(FILE_RULES))
    config = json.loads(json.dumps(EXTRA_CONFIG))
    config["policy_model"]["responses_api_models"]["scripted_model"]["scripts_by_input_fpath"] = str(rules)
    with running_servers([], config) as helper:
        yield {name: server_url(helper, name) for name in ("policy_model", "token_model")}


@pytest.fixture
def client(urls: dict[str, str]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=urls["policy_model"] + "/v1",
        api_key=client_token_for_url(urls["policy_model"]),
        max_retries=0,
        timeout=30,
    ) as c:
        yield c


# -- the official SDK against the running server ------------------------------------------------------


def test_sdk_responses_with_tools_parses_function_call(client: openai.OpenAI) -> None:
    response = client.responses.create(model="scripted", input="What is the weather in Paris?", tools=TOOLS)
    assert isinstance(response, Response)
    calls = [item for item in response.output if isinstance(item, ResponseFunctionToolCall)]
    assert len(calls) == 1
    assert calls[0].name == "get_weather" and calls[0].call_id
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    assert (
        response.usage is not None
        and response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    )


def test_sdk_responses_without_tools_parses_text(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="scripted", input="Hi there", instructions="Be brief.", temperature=0.2
    )
    assert response.output_text == "Hello! I am a scripted model."
    assert [type(item) for item in response.output] == [ResponseOutputMessage]
    assert response.instructions == "Be brief." and response.temperature == 0.2


def test_sdk_second_turn_round_trips_sdk_output_items(client: openai.OpenAI) -> None:
    """What the SDK parsed can be sent back as input (plus a tool result), as a client loop does."""
    first = client.responses.create(model="scripted", input="Weather in Rome?", tools=TOOLS)
    call = first.output[0]
    assert isinstance(call, ResponseFunctionToolCall)
    history: list[Any] = [{"role": "user", "content": "Weather in Rome?"}]
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history.append(
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"weather": "sunny"}'}
    )
    second = client.responses.create(model="scripted", input=history, tools=TOOLS)
    assert second.output_text == 'The tool returned: {"weather": "sunny"}'


def test_sdk_chat_completions_with_and_without_tools(client: openai.OpenAI) -> None:
    with_tools = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Weather in Lima?"}], tools=CHAT_TOOLS
    )
    assert isinstance(with_tools, ChatCompletion)
    choice = with_tools.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    tool_call = choice.message.tool_calls[0]
    assert tool_call.function.name == "get_weather" and '"city"' in tool_call.function.arguments

    followup = client.chat.completions.create(
        model="scripted",
        messages=[
            {"role": "user", "content": "Weather in Lima?"},
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": tool_call.id, "content": "cloudy"},
        ],
        tools=CHAT_TOOLS,
    )
    assert followup.choices[0].message.content == "The tool returned: cloudy"
    assert followup.choices[0].finish_reason == "stop"

    plain = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Hello"}])
    assert plain.choices[0].message.content == "Hello! I am a scripted model."
    assert plain.choices[0].message.tool_calls is None
    assert plain.usage is not None and plain.usage.total_tokens > 0


def test_sdk_unknown_parameter_is_a_422_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.responses.create(model="scripted", input="hi", extra_body={"bogus_parameter": 1})
    assert "bogus_parameter" in str(info.value.body)


# -- the raw HTTP contract --------------------------------------------------------------------------


def test_unknown_top_level_key_is_422_naming_it(urls: dict[str, str]) -> None:
    resp = post_json(urls["policy_model"] + "/v1/responses", {"input": "hi", "temperatur": 0.5})
    assert resp.status_code == 422
    error = resp.json()["error"]
    assert error["kind"] == "validation_error" and error["server"] == "policy_model"
    assert "temperatur" in error["message"]


def test_response_json_validates_strictly_with_the_sdk(urls: dict[str, str]) -> None:
    body = {"input": "[script:three_turns] go", "tools": TOOLS, "model": "m", "metadata": {"k": "v"}}
    raw = post_json(urls["policy_model"] + "/v1/responses", body).json()
    parsed = Response.model_validate(raw, strict=True)
    assert [type(item) for item in parsed.output] == [ResponseReasoningItem, ResponseFunctionToolCall]
    assert parsed.model_extra == {}
    assert parsed.metadata == {"k": "v"} and parsed.model == "m"


def test_script_turns_follow_the_number_of_model_turns(urls: dict[str, str]) -> None:
    url = urls["policy_model"] + "/v1/responses"
    history: list[dict[str, Any]] = [{"role": "user", "content": "[script:three_turns] weather?"}]
    seen: list[list[str]] = []
    for _ in range(3):
        out = post_json(url, {"input": history, "tools": TOOLS}).json()["output"]
        seen.append([item["type"] for item in out])
        history += out
        for item in out:
            if item["type"] == "function_call":
                history.append({"type": "function_call_output", "call_id": item["call_id"], "output": "ok"})
    assert seen == [["reasoning", "function_call"], ["function_call"], ["message"]]
    calls = [item for item in history if item.get("type") == "function_call"]
    assert calls[0]["arguments"] == '{"city":"Oslo"}'
    assert calls[1]["arguments"] == "{not json"  # a raw string is sent exactly as scripted
    assert history[-1]["content"][0]["text"] == "Done."


def _text(resp: Any) -> str:
    assert resp.status_code == 200, resp.text[:500]
    return "".join(i["content"][0]["text"] for i in resp.json()["output"] if i["type"] == "message")


def test_file_rules_pick_turns_by_rollout_id_and_by_both_conditions(urls: dict[str, str]) -> None:
    base = urls["policy_model"]
    rollout = f"{base}/ng-rollout/audit-1/v1/responses"
    assert _text(post_json(rollout, {"input": "anything"})) == "rollout one"
    assert _text(post_json(rollout, {"input": "[both] anything"})) == "rollout one, both conditions"
    # Another rollout, or none: the rule does not apply (the default behaviour answers).
    for url in (f"{base}/ng-rollout/audit-2/v1/responses", f"{base}/v1/responses"):
        assert _text(post_json(url, {"input": "[both] anything"})) == "Hello! I am a scripted model."
    # File rules come before scripts_by_input; scripts_by_input still applies to the rest.
    assert post_json(f"{base}/v1/responses", {"input": "[script:fail] hi"}).status_code == 503


def test_echo_turns_repeat_the_prompt_and_the_tool_outputs(urls: dict[str, str]) -> None:
    url = urls["policy_model"] + "/v1/responses"
    assert _text(post_json(url, {"input": "[echo:prompt] Say this back."})) == "[echo:prompt] Say this back."
    for tag, expected in (
        ("[echo:tools]", '{"city": "Oslo", "weather": "foggy"}\nsecond'),
        ("[echo:plain]", "city: Oslo, weather: foggy\nsecond"),
    ):
        history: list[dict[str, Any]] = [{"role": "user", "content": f"{tag} weather?"}]
        history += post_json(url, {"input": history, "tools": TOOLS}).json()["output"]
        call_id = history[-1]["call_id"]
        history += [
            {
                "type": "function_call_output",
                "call_id": call_id,
                "output": '{"city": "Oslo", "weather": "foggy"}',
            },
            {"type": "function_call_output", "call_id": call_id, "output": "second"},
        ]
        assert _text(post_json(url, {"input": history, "tools": TOOLS})) == expected


def test_a_bad_rules_file_is_an_error_naming_the_file_and_the_rule(tmp_path: Path) -> None:
    from nemo_gym.kit.script import load_rules

    bad = tmp_path / "rules.yaml"
    bad.write_text("- {contains: a, turns: [{text: x}]}\n- {turns: [{text: y}]}\n")
    with pytest.raises(ValueError, match=r"rules.yaml: rule 1: .*needs `contains`"):
        load_rules(bad)
    bad.write_text("- {contains: a, turns: [{text: x, echo: prompt}]}\n")
    with pytest.raises(ValueError, match="either `text` or `echo`"):
        load_rules(bad)
    with pytest.raises(ValueError, match="cannot read the script rules file"):
        load_rules(tmp_path / "missing.json")


def test_scripted_http_error(urls: dict[str, str]) -> None:
    resp = post_json(urls["policy_model"] + "/v1/responses", {"input": "[script:fail] hi"})
    assert resp.status_code == 503
    assert resp.json()["error"]["message"] == "scripted HTTP 503"


def test_scripted_incomplete_answer_in_both_apis(client: openai.OpenAI) -> None:
    response = client.responses.create(model="m", input="[script:cut] go")
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens" and response.output_text == "Half an ans"
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "[script:cut] go"}]
    )
    assert chat.choices[0].finish_reason == "length" and chat.choices[0].message.content == "Half an ans"


def test_partial_token_ids_in_input_are_rejected(urls: dict[str, str]) -> None:
    item = {
        "type": "function_call",
        "call_id": "c1",
        "name": "get_weather",
        "arguments": "{}",
        "prompt_token_ids": [1, 2],
        "generation_token_ids": [3],
    }
    resp = post_json(
        urls["policy_model"] + "/v1/responses", {"input": [{"role": "user", "content": "x"}, item]}
    )
    assert resp.status_code == 422
    assert "generation_log_probs" in resp.json()["error"]["message"]


# -- token ids --------------------------------------------------------------------------------------


def test_token_ids_on_last_item_and_content_only(urls: dict[str, str]) -> None:
    app = _load_app()
    url = urls["token_model"] + "/v1/responses"
    first_input = [{"role": "user", "content": "Weather in Kyiv?"}]
    first = post_json(url, {"input": first_input, "tools": TOOLS}).json()
    call = first["output"][-1]
    assert call["type"] == "function_call"
    assert bytes(call["prompt_token_ids"]).decode() == "<|user|>Weather in Kyiv?<|assistant|>"
    assert bytes(call["generation_token_ids"]).decode() == f"<|call|>get_weather({call['arguments']})<|end|>"
    assert call["generation_log_probs"] == app.fake_log_probs(call["generation_token_ids"])
    assert len(set(call["generation_log_probs"])) > 1

    # The next prompt depends on content only: the same history with or without the earlier ids gives
    # the same prompt ids (earlier ids are not re-tokenised into ever longer prompts).
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    with_ids = post_json(url, {"input": first_input + [call, result], "tools": TOOLS}).json()
    stripped = {
        k: v
        for k, v in call.items()
        if k not in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
    }
    without_ids = post_json(url, {"input": first_input + [stripped, result], "tools": TOOLS}).json()
    answer = with_ids["output"][-1]
    assert answer["type"] == "message"
    assert answer["prompt_token_ids"] == without_ids["output"][-1]["prompt_token_ids"]
    assert bytes(answer["prompt_token_ids"]).decode().endswith("<|tool|>sunny<|assistant|>")
    # The response (with the training fields on an item) is still what the SDK parses.
    Response.model_validate(with_ids, strict=True)


def assert_contiguous(output: list[dict[str, Any]]) -> int:
    """A trainer's token-contiguity check over a rollout's output items (as NeMo RL does it).

    Items with generation ids are trainable, in order; each one's ``prompt_token_ids`` must start with
    every token seen so far (earlier prompts' new tokens plus generations). Returns the trainable count.
    """
    seen: list[int] = []
    trainable = 0
    for index, item in enumerate(output):
        if not item.get("generation_token_ids"):
            continue
        trainable += 1
        prompt = item["prompt_token_ids"]
        assert prompt[: len(seen)] == seen, (
            f"output[{index}]: prompt_token_ids do not start with the {len(seen)} tokens seen earlier:\n"
            f"seen:   {bytes(seen)!r}\nprompt: {bytes(prompt)!r}"
        )
        seen = [*seen, *prompt[len(seen) :], *item["generation_token_ids"]]
    return trainable


ROLLOUT_SCRIPT = [
    {
        "contains": "Paris",
        "turns": [
            {
                "reasoning": "Look it up first.",
                "tool_calls": [{"name": "get_weather", "arguments": {"city": "Lyon"}}],
            },
            {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
            {"reasoning": "Now answer.", "text": weather_report("Paris")},
        ],
    }
]


def test_multi_turn_rollout_through_simple_agent_is_token_contiguous() -> None:
    """A whole rollout driven by simple_agent: every turn's prompt ids extend all earlier prompts and
    generations (the agent sends earlier items back with their ids), and the ids reach /run's result."""
    extra = {
        "policy_model": {
            "responses_api_models": {
                "scripted_model": {"return_token_id_information": True, "scripts_by_input": ROLLOUT_SCRIPT}
            }
        }
    }
    with running_servers([EXAMPLE_CONFIG], extra) as helper:
        row = next(r for r in example_rows("example_single_tool_call") if "Paris" in json.dumps(r))
        result = run_rollout(helper, "example_single_tool_call_simple_agent", row)
    output = result["response"]["output"]
    assert [item["type"] for item in output] == [
        "reasoning",
        "function_call",
        "function_call_output",
        "function_call",
        "function_call_output",
        "reasoning",
        "message",
    ]
    assert assert_contiguous(output) == 3
    assert result["reward"] == 1.0
    # The last prompt holds both tool results and ends with the generation prompt.
    last_prompt = bytes(output[-1]["prompt_token_ids"]).decode()
    assert last_prompt.count("<|tool|>") == 2 and last_prompt.endswith(
        "<|end|><|tool|>" + output[4]["output"] + "<|assistant|>"
    )


def test_carried_token_ids_are_reused_verbatim(urls: dict[str, str]) -> None:
    """Ids an earlier turn carries win over re-rendering (a real server never re-tokenises them)."""
    url = urls["token_model"] + "/v1/responses"
    earlier = {
        "type": "function_call",
        "call_id": "c1",
        "name": "get_weather",
        "arguments": '{"city":"Oslo"}',
        "prompt_token_ids": [900, 901],
        "generation_token_ids": [902],
        "generation_log_probs": [-0.5],
    }
    result = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    body = {"input": [{"role": "user", "content": "x"}, earlier, result], "tools": TOOLS}
    answer = post_json(url, body).json()["output"][-1]
    assert answer["prompt_token_ids"][:3] == [900, 901, 902]
    assert bytes(answer["prompt_token_ids"][3:]).decode() == "<|tool|>sunny<|assistant|>"


def test_chat_completions_token_ids_are_contiguous_across_turns(urls: dict[str, str]) -> None:
    """The Chat Completions path: ids on the assistant message, sent back on it next turn (as the
    verifiers NeMo-RL chat client does), and the next prompt extends them."""
    url = urls["token_model"] + "/v1/chat/completions"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Rome?"},
    ]
    first = post_json(url, {"messages": messages, "tools": CHAT_TOOLS}).json()["choices"][0]["message"]
    assert first["tool_calls"] and first["generation_token_ids"]
    messages += [first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "sunny"}]
    second = post_json(url, {"messages": messages, "tools": CHAT_TOOLS}).json()["choices"][0]["message"]
    assert second["content"] == "The tool returned: sunny"
    assert assert_contiguous([first, second]) == 2
    # Without the carried ids the re-rendered prompt is the same (the rendering is prefix-stable).
    bare = {k: v for k, v in first.items() if not k.endswith("_ids") and k != "generation_log_probs"}
    again = post_json(url, {"messages": [*messages[:2], bare, messages[3]], "tools": CHAT_TOOLS}).json()
    assert again["choices"][0]["message"]["prompt_token_ids"] == second["prompt_token_ids"]


def test_no_token_ids_unless_configured(urls: dict[str, str]) -> None:
    out = post_json(urls["policy_model"] + "/v1/responses", {"input": "hi"}).json()["output"]
    assert out and all("prompt_token_ids" not in item for item in out)


# -- config -----------------------------------------------------------------------------------------


def test_config_rejects_unknown_turn_keys_and_bad_status() -> None:
    app = _load_app()
    with pytest.raises(ValidationError, match="txt"):
        app.ScriptedModelConfig.model_validate({"name": "m", "script": [{"txt": "typo"}]})
    with pytest.raises(ValidationError, match="http_error"):
        app.ScriptedModelConfig.model_validate({"name": "m", "script": [{"http_error": 200}]})
    with pytest.raises(ValidationError, match="name"):
        app.ScriptedModelConfig.model_validate({"name": "m", "script": [{"tool_calls": [{"arguments": {}}]}]})


def test_example_from_schema_satisfies_simple_schemas() -> None:
    app = _load_app()
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"enum": ["c", "f"]},
            "days": {"type": "integer", "minimum": 3},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
            "maybe": {"type": ["null", "boolean"]},
        },
    }
    assert app.example_from_schema(schema) == {
        "city": "example",
        "unit": "c",
        "days": 3,
        "tags": ["example", "example"],
        "maybe": True,
    }
