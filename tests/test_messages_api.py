"""Anthropic's Messages API on every model server, driven by the official ``anthropic`` SDK over real HTTP.

One run holds three model servers: the scripted model (``policy_model``: exact answers), ``openai_model``
and ``vllm_model``, both in front of the repo's fake vLLM/OpenAI backend (a real process on 127.0.0.1).
local_model runs the real tiny GGUF in a run of its own; as in its own tests, only structure, ids and
counts are asserted there, never the model's words.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import anthropic
import httpx
import pytest
from anthropic.types import Message, TextBlock, ThinkingBlock, ToolUseBlock

from nemo_gym.auth import auth_headers, client_token_for_url
from nemo_gym.openai_utils.messages import (
    MessagesRequestError,
    apply_stop_sequences,
    estimate_input_tokens,
    messages_request_to_responses,
    responses_to_messages_answer,
)
from nemo_gym.tools.testing import running_servers, server_url
from responses_api_models.local_model import weights

ROOT = Path(__file__).resolve().parents[1]
FAKE_PATH = ROOT / "responses_api_models" / "vllm_model" / "tests" / "fake_vllm_backend.py"
LOCAL_CONFIG = "responses_api_models/local_model/configs/local_model.yaml"
MODEL = "fake-model"
KEY = "sk-test-messages-0123456789"
SERVERS = ("scripted", "openai_model", "vllm_model")
INSTANCES = {"scripted": "policy_model", "openai_model": "openai_messages", "vllm_model": "vllm_messages"}
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
HELLO = {
    "scripted": "Hello! I am a scripted model.",
    "openai_model": "Hello! I am a fake OpenAI model.",
    "vllm_model": "Hello! I am a fake vLLM model.",
}
TOOL_ANSWER = {
    "scripted": "The tool returned: sunny, 21 C",
    "openai_model": "The tool said: sunny, 21 C",
    "vllm_model": "The tool said: sunny, 21 C",
}
WAIT_S = 120.0


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


FAKE = _load(FAKE_PATH, "messages_api_test_fake_backend")


@pytest.fixture(scope="module")
def backend() -> Iterator[Any]:
    with FAKE.FakeBackend("messages", model=MODEL, api_key=KEY) as b:
        yield b


@pytest.fixture(scope="module")
def urls(backend: Any) -> Iterator[dict[str, str]]:
    scripts = [
        {"contains": "[overloaded]", "turns": [{"http_error": 503}]},
        {"contains": "[missing]", "turns": [{"http_error": 404}]},
        {"contains": "[broken]", "turns": [{"http_error": 500}]},
    ]
    extra = {
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": scripts}}},
        "openai_messages": {
            "responses_api_models": {
                "openai_model": {
                    "entrypoint": "app.py",
                    "openai_base_url": backend.url + "/v1",
                    "openai_api_key": KEY,
                    "openai_model": MODEL,
                    "max_retries": 0,
                }
            }
        },
        "vllm_messages": {
            "responses_api_models": {
                "vllm_model": {
                    "entrypoint": "app.py",
                    "base_url": backend.url + "/v1",
                    "api_key": KEY,
                    "model": MODEL,
                    "max_retries": 0,
                }
            }
        },
    }
    with running_servers([], extra) as helper:
        yield {kind: server_url(helper, name) for kind, name in INSTANCES.items()}


def _client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=client_token_for_url(url), max_retries=0, timeout=WAIT_S)


@pytest.fixture(params=SERVERS)
def server(request: pytest.FixtureRequest, urls: dict[str, str]) -> Iterator[tuple[str, anthropic.Anthropic]]:
    with _client(urls[request.param]) as client:
        yield request.param, client


def _texts(message: Message) -> list[str]:
    return [b.text for b in message.content if isinstance(b, TextBlock)]


# -- answers ---------------------------------------------------------------------------------------------


def test_text_answer(server: tuple[str, anthropic.Anthropic]) -> None:
    kind, client = server
    message = client.messages.create(
        model="any-name",
        max_tokens=100,
        system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": "Say hello."}],
        metadata={"user_id": "u-1"},
        cache_control={"type": "ephemeral"},
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 40},  # no longer arguments of the SDK
    )
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.model == "any-name"
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert _texts(message) == [HELLO[kind]]
    if kind == "vllm_model":  # the fake backend thinks first (<think> in the content): a thinking block
        assert isinstance(message.content[0], ThinkingBlock)
        assert message.content[0].thinking == "The user said something."
    else:
        assert len(message.content) == 1
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0


def test_tool_use_round_trip(server: tuple[str, anthropic.Anthropic], backend: Any) -> None:
    kind, client = server
    question = {"role": "user", "content": f"[{kind}-tools] What is the weather in Oslo?"}
    first = client.messages.create(model="m", max_tokens=200, tools=[WEATHER], messages=[question])
    assert first.stop_reason == "tool_use"
    calls = [b for b in first.content if isinstance(b, ToolUseBlock)]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(calls[0].input, dict) and isinstance(calls[0].input["city"], str)
    result = {
        "type": "tool_result",
        "tool_use_id": calls[0].id,
        "content": [{"type": "text", "text": "sunny, 21 C"}],
    }
    second = client.messages.create(
        model="m",
        max_tokens=200,
        tools=[WEATHER],
        messages=[
            question,
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [result]},
        ],
    )
    assert second.stop_reason == "end_turn"
    assert _texts(second) == [TOOL_ANSWER[kind]]
    if kind != "scripted":  # the backend got the call and its result under the same id
        seen = json.dumps(
            [c["body"] for c in backend.calls()["requests"] if f"[{kind}-tools]" in json.dumps(c)]
        )
        assert calls[0].id in seen and "sunny, 21 C" in seen


def test_tool_choice_and_tool_result_errors_flag(urls: dict[str, str], backend: Any) -> None:
    with _client(urls["vllm_model"]) as client:
        client.messages.create(
            model="m",
            max_tokens=50,
            tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            messages=[{"role": "user", "content": "[choice] weather?"}],
        )
    chat = next(c["body"] for c in backend.calls()["requests"] if "[choice]" in json.dumps(c["body"]))
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False
    assert chat["max_tokens"] == 50
    assert chat["tools"][0]["function"]["parameters"] == WEATHER["input_schema"]


@pytest.mark.parametrize("kind", ["scripted", "openai_model"])
def test_stop_sequences(kind: str, urls: dict[str, str]) -> None:
    with _client(urls[kind]) as client:
        message = client.messages.create(
            model="m",
            max_tokens=100,
            stop_sequences=["never there", "I am"],
            messages=[{"role": "user", "content": "hi"}],
        )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "I am"
    assert _texts(message) == ["Hello! "]


# -- streaming (messages.stream: the SDK reassembles the events into the message) -------------------


def _same_message(streamed: Message, plain: Message) -> None:
    """A streamed answer reassembled by the SDK is the plain answer (ids aside)."""
    assert streamed.stop_reason == plain.stop_reason and streamed.stop_sequence == plain.stop_sequence
    strip = lambda m: [{k: v for k, v in b.model_dump().items() if k != "id"} for b in m.content]  # noqa: E731
    assert strip(streamed) == strip(plain)
    assert streamed.usage.output_tokens == plain.usage.output_tokens


def test_streamed_text_and_tool_use_reassemble_the_plain_answer(
    server: tuple[str, anthropic.Anthropic],
) -> None:
    kind, client = server
    for args in (
        {"messages": [{"role": "user", "content": "Say hello."}]},
        {
            "tools": [WEATHER],
            "messages": [{"role": "user", "content": f"[{kind}-tools] What is the weather in Oslo?"}],
        },
    ):
        plain = client.messages.create(model="m", max_tokens=200, **args)
        with client.messages.stream(model="m", max_tokens=200, **args) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert "content_block_start" in kinds and "content_block_stop" in kinds
        _same_message(streamed, plain)


@pytest.mark.parametrize("kind", ["scripted", "openai_model"])
def test_a_streamed_answer_stops_at_the_first_stop_sequence(kind: str, urls: dict[str, str]) -> None:
    args = {
        "max_tokens": 100,
        "stop_sequences": ["never there", "I am"],
        "messages": [{"role": "user", "content": "hi"}],
    }
    with _client(urls[kind]) as client:
        with client.messages.stream(model="m", **args) as stream:
            streamed = stream.get_final_message()
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == "I am"
    assert _texts(streamed) == ["Hello! "]


def test_max_tokens(urls: dict[str, str], backend: Any) -> None:
    with _client(urls["vllm_model"]) as client:  # the fake backend stops at max_tokens
        message = client.messages.create(
            model="m", max_tokens=3, messages=[{"role": "user", "content": "hi"}]
        )
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3
    with _client(urls["openai_model"]) as client:  # passed on as the Responses API's max_output_tokens
        client.messages.create(model="m", max_tokens=7, messages=[{"role": "user", "content": "[budget] hi"}])
    sent = next(c["body"] for c in backend.calls()["requests"] if "[budget]" in json.dumps(c["body"]))
    assert sent["max_output_tokens"] == 7 and sent["model"] == MODEL


def test_count_tokens(server: tuple[str, anthropic.Anthropic]) -> None:
    kind, client = server
    prompt: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Count me, please."}],
        "system": "Be brief.",
    }
    counted = client.messages.count_tokens(model="m", **prompt).input_tokens
    if kind == "vllm_model":  # the backend's tokenizer: what a generation reads
        assert counted == client.messages.create(model="m", max_tokens=20, **prompt).usage.input_tokens
    else:  # no tokenizer: the documented estimate
        assert counted == estimate_input_tokens(
            messages_request_to_responses(prompt | {"model": "m"}, count_only=True).params
        )
    with_tools = client.messages.count_tokens(model="m", tools=[WEATHER], **prompt).input_tokens
    assert with_tools > counted
    # A conversation no context holds is refused before any tokenizer runs (30,001 turns: 68 CPU-s before).
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(30_001)]
    with pytest.raises(anthropic.BadRequestError, match="too large to count: 30,001 items"):
        client.messages.count_tokens(model="m", messages=turns)


# -- errors ----------------------------------------------------------------------------------------------

BAD_REQUESTS = {
    "missing max_tokens": ({"max_tokens": anthropic.NOT_GIVEN}, "max_tokens"),
    "unknown field": ({"extra_body": {"reasoning_mode": "deep"}}, "reasoning_mode"),
    "image block": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                        }
                    ],
                }
            ]
        },
        "image",
    ),
    "document block": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "document",
                            "source": {"type": "text", "media_type": "text/plain", "data": "x"},
                        }
                    ],
                }
            ]
        },
        "document",
    ),
    "server tool": (
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        "web_search_20250305",
    ),
    "stream": ({"extra_body": {"stream": "yes"}}, "stream"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_requests_name_the_field(case: str, server: tuple[str, anthropic.Anthropic]) -> None:
    _kind, client = server
    overrides, named = BAD_REQUESTS[case]
    args: dict[str, Any] = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(**(args | overrides))
    assert info.value.status_code == 400
    assert info.value.body["type"] == "error"  # type: ignore[index]
    assert info.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert named in info.value.body["error"]["message"]  # type: ignore[index]


def test_server_errors_in_anthropic_shape(urls: dict[str, str]) -> None:
    cases = [
        ("[overloaded]", anthropic.InternalServerError, 503, "overloaded_error"),
        ("[missing]", anthropic.NotFoundError, 404, "not_found_error"),
        ("[broken]", anthropic.InternalServerError, 500, "api_error"),
    ]
    with _client(urls["scripted"]) as client:
        for text, error, status, kind in cases:
            with pytest.raises(error) as info:
                client.messages.create(model="m", max_tokens=10, messages=[{"role": "user", "content": text}])
            assert info.value.status_code == status, text
            assert info.value.body == {  # type: ignore[comparison-overlap]
                "type": "error",
                "error": {"type": kind, "message": f"scripted HTTP {status}"},
            }
    bad_json = httpx.post(
        urls["scripted"] + "/v1/messages",
        content=b"{not json",
        headers=auth_headers(client_token_for_url(urls["scripted"])),
        timeout=WAIT_S,
    )
    assert bad_json.status_code == 400
    assert bad_json.json()["error"]["type"] == "invalid_request_error"
    with anthropic.Anthropic(base_url=urls["scripted"], api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError):  # the framework's run-token check
            wrong.messages.create(model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}])


# -- conversion (no server) ---------------------------------------------------------------------------------


def test_conversion_round_trip_of_tool_calls() -> None:
    call = messages_request_to_responses(
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": ""},
                        {"type": "text", "text": "b"},
                        {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}},
                        {"type": "tool_use", "id": "t2", "name": "f", "input": {"_raw_arguments": "{oops"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "ok"},
                        {"type": "tool_result", "tool_use_id": "t2", "content": "bad", "is_error": True},
                        {"type": "text", "text": "go on"},
                    ],
                },
            ],
        }
    )
    kinds = [(i["type"], i.get("role")) for i in call.params["input"]]
    assert kinds == [
        ("message", "user"),
        ("reasoning", None),
        ("message", "assistant"),
        ("function_call", None),
        ("function_call", None),
        ("function_call_output", None),
        ("function_call_output", None),
        ("message", "user"),
    ]
    assert call.params["input"][4]["arguments"] == "{oops"
    assert call.params["input"][6]["output"] == "Error: bad"
    answer = responses_to_messages_answer(
        {
            "status": "completed",
            "output": [
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
                {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{oops"},
            ],
            "usage": {"input_tokens": 3, "output_tokens": 4},
        },
        call,
    )
    assert answer["stop_reason"] == "tool_use"
    assert [b["input"] for b in answer["content"]] == [{"x": 1}, {"_raw_arguments": "{oops"}]
    assert answer["usage"]["input_tokens"] == 3 and answer["usage"]["output_tokens"] == 4


def test_stop_sequences_cut_at_the_earliest() -> None:
    blocks = [{"type": "thinking", "thinking": "x", "signature": ""}, {"type": "text", "text": "abcXYdefZ"}]
    assert apply_stop_sequences(blocks, ["Z", "XY"]) == ([blocks[0], {"type": "text", "text": "abc"}], "XY")
    assert apply_stop_sequences(blocks, ["nope"]) == (blocks, None)
    tail = [{"type": "text", "text": "STOP"}, {"type": "tool_use", "id": "a", "name": "f", "input": {}}]
    assert apply_stop_sequences(tail, ["STOP"]) == ([], "STOP")


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}, "model"),
        ({"model": "m", "max_tokens": 1, "messages": []}, "messages"),
        ({"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (
            {"model": "m", "max_tokens": 1, "messages": [{"role": "system", "content": "x"}]},
            "messages[0].role",
        ),
        ({"model": "m", "max_tokens": 1, "thinking": {"type": "enabled"}, "messages": []}, "thinking"),
        (
            {"model": "m", "max_tokens": 1, "temperature": 3, "messages": [{"role": "user", "content": "x"}]},
            "temperature",
        ),
        (
            {
                "model": "m",
                "max_tokens": 1,
                "metadata": {"team": "a"},
                "messages": [{"role": "user", "content": "x"}],
            },
            "team",
        ),
    ],
)
def test_conversion_refuses_by_name(body: dict[str, Any], named: str) -> None:
    with pytest.raises(MessagesRequestError, match=named.replace("[", r"\[").replace("]", r"\]")):
        messages_request_to_responses(body)


# -- local_model: the real tiny model (structure only) ------------------------------------------------------

needs_local_model = pytest.mark.skipif(
    weights.default_model_unavailable() is not None,
    reason=f"needs the default local model: {weights.default_model_unavailable()}",
)


@pytest.fixture(scope="module")
def local_client() -> Iterator[anthropic.Anthropic]:
    with running_servers([LOCAL_CONFIG], {}, with_scripted_model=False) as helper:
        with _client(server_url(helper, "policy_model")) as client:
            yield client


@needs_local_model
def test_local_model_text_tools_limits_and_count(local_client: anthropic.Anthropic) -> None:
    prompt: dict[str, Any] = {
        "system": "You are a helpful assistant.",
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
    }
    # A forced call to a tool whose argument must be at least 1,200 characters (grammar-constrained):
    # the answer cannot end within 3 tokens, whatever the model prefers.
    essay = {
        "name": "write_essay",
        "description": "Write an essay.",
        "input_schema": {
            "type": "object",
            "properties": {"text": {"type": "string", "minLength": 1200}},
            "required": ["text"],
        },
    }
    forced_long = {"tools": [essay], "tool_choice": {"type": "tool", "name": "write_essay"}}
    short = local_client.messages.create(model="m", max_tokens=3, **prompt, **forced_long)
    assert short.stop_reason == "max_tokens" and 1 <= short.usage.output_tokens <= 3
    counted_short = local_client.messages.count_tokens(model="m", **prompt, **forced_long).input_tokens
    assert counted_short == short.usage.input_tokens
    free = local_client.messages.create(model="m", max_tokens=24, **prompt)
    assert free.stop_reason in ("end_turn", "max_tokens") and free.usage.output_tokens <= 24
    assert all(isinstance(b, (TextBlock, ThinkingBlock, ToolUseBlock)) for b in free.content)

    question = {"role": "user", "content": "What is the weather in Paris?"}
    forced = local_client.messages.create(
        model="m",
        max_tokens=64,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[question],
    )
    calls = [b for b in forced.content if isinstance(b, ToolUseBlock)]
    assert forced.stop_reason == "tool_use" and calls and calls[0].name == "get_weather"
    assert isinstance(calls[0].input.get("city"), str)
    result = {"type": "tool_result", "tool_use_id": calls[0].id, "content": "sunny, 21 C"}
    follow_up = [
        question,
        {"role": "assistant", "content": forced.content},
        {"role": "user", "content": [result]},
    ]
    answer = local_client.messages.create(model="m", max_tokens=16, tools=[WEATHER], messages=follow_up)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = local_client.messages.count_tokens(model="m", tools=[WEATHER], messages=follow_up).input_tokens
    assert counted == answer.usage.input_tokens


@needs_local_model
@pytest.mark.parametrize("case", ["missing max_tokens", "unknown field", "image block"])
def test_local_model_bad_requests_name_the_field(case: str, local_client: anthropic.Anthropic) -> None:
    overrides, named = BAD_REQUESTS[case]
    args: dict[str, Any] = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(anthropic.BadRequestError) as info:
        local_client.messages.create(**(args | overrides))
    assert named in info.value.body["error"]["message"]  # type: ignore[index]


@needs_local_model
def test_local_model_streams_messages_as_it_generates(local_client: anthropic.Anthropic) -> None:
    """A real model's Messages stream: events arrive before the generation ends (the first text delta at
    less than half of the whole stream's time: 40 tokens on CPU take seconds), and the message the SDK
    reassembles has a stop reason consistent with its token count (no assertion on the model's choices)."""
    args: dict[str, Any] = {
        "model": "m",
        "max_tokens": 40,
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
    }
    began = time.monotonic()
    first_text_at = None
    with local_client.messages.stream(**args) as stream:
        for event in stream:
            if (
                first_text_at is None
                and event.type == "content_block_delta"
                and event.delta.type == "text_delta"
            ):
                first_text_at = time.monotonic() - began
        message = stream.get_final_message()
    total = time.monotonic() - began
    assert message.stop_reason in ("end_turn", "max_tokens") and 1 <= message.usage.output_tokens <= 40
    if (
        message.usage.output_tokens >= 8
    ):  # how long it writes is the model's choice; a story is nearly always long
        assert first_text_at is not None and first_text_at < total / 2, (first_text_at, total)
    if message.stop_reason == "max_tokens":
        assert message.usage.output_tokens == 40
