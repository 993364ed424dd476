"""``stream: true`` on ``/v1/responses`` and ``/v1/chat/completions``, through the official ``openai`` SDK's
streaming helpers, against real servers on 127.0.0.1 (nemo_gym.server.streaming).

* scripted_model: the reassembled stream equals the non-streamed answer exactly (text and tool calls).
* local_model (the real tiny GGUF): the first event arrives well before the generation ends, and a
  client that goes away stops the generation. Only structure is asserted, never the model's words.
* vllm_model relays the (fake) vLLM backend's stream; openai_model relays its upstream's stream.
* Malformed stream requests are a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import openai
import pytest

from nemo_gym.auth import client_token_for_url
from nemo_gym.kit.chat_conversion import split_think_tags
from nemo_gym.server.streaming import (
    MessagesEventEncoder,
    ReasoningDelta,
    StreamEnd,
    TextDelta,
    cut_at_stop_sequences,
    split_think_stream,
)
from nemo_gym.tools.testing import WEATHER_CHAT_TOOL, WEATHER_TOOL, running_servers, server_url

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 120.0  # bound on every wait here (never a speed check)
SCRIPTS = [
    {
        "contains": "[script:long]",
        "turns": [
            {
                "reasoning": "Thinking it over, at some length.",
                "tool_calls": [
                    {"name": "get_weather", "arguments": {"city": "Reykjavik, a city with a long name"}},
                    {"name": "get_weather", "arguments": "{not json"},
                ],
            },
            {"text": "A long answer that is cut into several pieces when it is streamed, ünïcödé included."},
        ],
    },
    {"contains": "[script:fail]", "turns": [{"http_error": 503}]},
]
SCRIPTED_EXTRA = {
    "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": SCRIPTS}}},
}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url + "/v1", api_key=client_token_for_url(url), max_retries=0, timeout=WAIT_S
    )


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {client_token_for_url(url)}"}
    return httpx.post(url + path, json=body, headers=headers, timeout=WAIT_S, trust_env=False)


def _comparable_output(output: list[Any]) -> list[dict[str, Any]]:
    """Output items without what differs between two calls (ids) and what the SDK adds (parsed)."""
    items = []
    for item in output:
        d = item.model_dump(exclude_none=True) if hasattr(item, "model_dump") else dict(item)
        for key in ("id", "call_id", "parsed_arguments"):
            d.pop(key, None)
        items.append(d)
    return items


def _invalid_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return True
    return False


def _has_invalid_arguments(output: list[Any]) -> bool:
    return any(item.type == "function_call" and _invalid_json(item.arguments) for item in output)


def _chat_message(completion: Any) -> dict[str, Any]:
    """The message without ids, and without what the SDK's accumulator adds (index, parsed arguments); an
    empty content or call list is none (a stream's role chunk carries ``content: ""``)."""
    message = completion.choices[0].message.model_dump(exclude_none=True)
    for key in ("content", "tool_calls"):  # vLLM's plain answer has ``tool_calls: []``
        if message.get(key) in ("", []):
            del message[key]
    for call in message.get("tool_calls") or []:
        call.pop("id")
        call.pop("index", None)
        call["function"].pop("parsed_arguments", None)
    return message


# -- scripted_model -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scripted_url() -> Iterator[str]:
    with running_servers([], SCRIPTED_EXTRA) as helper:
        yield server_url(helper, "policy_model")


def _responses_inputs() -> list[dict[str, Any]]:
    long_in = [{"role": "user", "content": "[script:long] go"}]
    return [
        {"input": "hello"},
        {"input": [{"role": "user", "content": "weather?"}], "tools": [WEATHER_TOOL]},
        {"input": long_in, "tools": [WEATHER_TOOL]},
        {
            "input": [
                *long_in,
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
            "tools": [WEATHER_TOOL],
        },
    ]


@pytest.mark.parametrize("case", range(4))
def test_scripted_responses_stream_reassembles_the_plain_answer(scripted_url: str, case: int) -> None:
    params = _responses_inputs()[case]
    with _client(scripted_url) as client:
        plain = client.responses.create(model="scripted", **params)
        events = list(client.responses.create(model="scripted", stream=True, **params))
        if not _has_invalid_arguments(plain.output):  # the helper json-parses arguments (an SDK choice)
            with client.responses.stream(model="scripted", **params) as stream:
                helper_events = list(stream)
                final = stream.get_final_response()
            assert [e.type for e in helper_events] == [e.type for e in events]
            assert _comparable_output(final.output) == _comparable_output(plain.output)
            assert final.output_text == plain.output_text
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    completed = events[-1].response
    assert completed.id == events[0].response.id
    assert _comparable_output(completed.output) == _comparable_output(plain.output)
    assert completed.usage == plain.usage
    # Every item is announced, then finished, in order; text and arguments arrive as deltas.
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert added == done == list(range(len(plain.output)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text
    for index, item in enumerate(plain.output):
        if item.type == "function_call":
            pieces = [
                e.delta
                for e in events
                if e.type == "response.function_call_arguments.delta" and e.output_index == index
            ]
            assert "".join(pieces) == item.arguments
            if len(item.arguments) > 30:
                assert len(pieces) > 1  # really in pieces


@pytest.mark.parametrize("case", range(3))
def test_scripted_chat_stream_reassembles_the_plain_answer(scripted_url: str, case: int) -> None:
    bodies = [
        {"messages": [{"role": "user", "content": "hello"}]},
        {"messages": [{"role": "user", "content": "[script:long] go"}], "tools": [WEATHER_CHAT_TOOL]},
        {
            "messages": [
                {"role": "user", "content": "[script:long] go"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
            "tools": [WEATHER_CHAT_TOOL],
        },
    ]
    body = bodies[case]
    with _client(scripted_url) as client:
        plain = client.chat.completions.create(model="scripted", **body)
        chunks = list(
            client.chat.completions.create(
                model="scripted", stream=True, stream_options={"include_usage": True}, **body
            )
        )
        calls_in_plain = plain.choices[0].message.tool_calls or []
        if not any(_invalid_json(c.function.arguments) for c in calls_in_plain):
            # The SDK's own accumulator reassembles the same message (it json-parses strict tools' arguments).
            with client.chat.completions.stream(model="scripted", **body) as stream:
                for _ in stream:
                    pass
                assert _chat_message(stream.get_final_completion()) == _chat_message(plain)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == [plain.choices[0].finish_reason]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (plain.choices[0].message.content or "")
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            if call.function and call.function.name:
                entry["name"] = call.function.name
            entry["arguments"] += (call.function.arguments or "") if call.function else ""
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in plain.choices[0].message.tool_calls or []
    ]
    assert [calls[i] for i in sorted(calls)] == expected


def test_scripted_stream_without_usage_option_has_no_usage_chunk(scripted_url: str) -> None:
    with _client(scripted_url) as client:
        chunks = list(
            client.chat.completions.create(
                model="scripted", stream=True, messages=[{"role": "user", "content": "hi"}]
            )
        )
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_scripted_stream_wire_format(scripted_url: str) -> None:
    """The bytes on the wire: SSE with ``event:`` lines for Responses, ``data: [DONE]`` for Chat."""
    r = _post(
        scripted_url,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.rstrip().endswith("data: [DONE]")
    r = _post(scripted_url, "/v1/responses", {"input": "hi", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in r.text.split("\n\n") if b.strip()]
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        assert json.loads(data_line[6:])["type"] == event_line[7:]


def test_scripted_error_before_the_stream_is_a_plain_error(scripted_url: str) -> None:
    with _client(scripted_url) as client:
        with pytest.raises(openai.APIStatusError) as info:
            list(client.responses.create(model="scripted", stream=True, input="[script:fail]"))
    assert info.value.status_code == 503


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/responses", {"input": "hi", "stream": "yes"}, "`stream`"),
        ("/v1/responses", {"input": "hi", "stream_options": {"include_usage": True}}, "`stream_options`"),
        ("/v1/responses", {"input": "hi", "stream": True, "temperature": "hot"}, "`temperature`"),
        ("/v1/responses", {"input": "hi", "stream": True, "bogus_key": 1}, "`bogus_key`"),
        ("/v1/chat/completions", {"messages": [], "stream": 1}, "`stream`"),
        ("/v1/chat/completions", {"messages": [], "stream": False, "stream_options": {}}, "`stream_options`"),
        (
            "/v1/chat/completions",
            {"messages": [], "stream": True, "stream_options": {"include_usage": "yes"}},
            "`stream_options.include_usage`",
        ),
        ("/v1/chat/completions", {"messages": [], "stream": True, "stream_options": []}, "`stream_options`"),
    ],
)
def test_malformed_stream_requests_are_400s_naming_the_field(
    scripted_url: str, path: str, body: dict[str, Any], field: str
) -> None:
    r = _post(scripted_url, path, body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_non_streamed_requests_are_unchanged(scripted_url: str) -> None:
    """``stream: false`` (and no stream key) still answer plain JSON through the routes."""
    for body in ({"input": "hi", "stream": False}, {"input": "hi"}):
        r = _post(scripted_url, "/v1/responses", body)
        assert r.status_code == 200 and r.json()["object"] == "response"
    r = _post(
        scripted_url,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "stream": False},
    )
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"


# -- local_model (the real tiny GGUF on the CPU) --------------------------------------------------------

LOCAL_CONFIG = "responses_api_models/local_model/configs/local_model.yaml"


def _local_model_missing() -> str | None:
    from responses_api_models.local_model import weights

    return weights.default_model_unavailable()


@pytest.fixture(scope="module")
def local_url() -> Iterator[str]:
    missing = _local_model_missing()
    if missing is not None:
        pytest.skip(f"needs the default local model: {missing}")
    extra = {"policy_model": {"responses_api_models": {"local_model": {"return_token_id_information": True}}}}
    with running_servers([LOCAL_CONFIG], extra, with_scripted_model=False) as helper:
        yield server_url(helper, "policy_model")


LONG_PROMPT = [{"role": "user", "content": "Count from 1 to 200, separated by commas."}]


def test_local_chat_stream_sends_tokens_as_generated(local_url: str) -> None:
    with _client(local_url) as client:
        t0 = time.monotonic()
        first_content: float | None = None
        chunks = []
        stream = client.chat.completions.create(
            model="local",
            messages=LONG_PROMPT,
            max_tokens=48,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if first_content is None and chunk.choices and chunk.choices[0].delta.content:
                first_content = time.monotonic() - t0
            chunks.append(chunk)
        total = time.monotonic() - t0
    # How long the model counts is its choice (it nearly always runs into the budget); what the stream
    # guarantees is checked against what it says it generated.
    assert chunks[-1].usage is not None
    generated = chunks[-1].usage.completion_tokens
    finishing = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].finish_reason in ("length", "stop")
    assert (generated == 48) == (finishing[0].finish_reason == "length") and 1 <= generated <= 48
    if generated >= 8:
        assert first_content is not None and first_content < total / 2, (first_content, total)
        content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
        assert len(content_chunks) > 5  # token by token, not one piece at the end
    # The token ids ride on the final chunk, as on the plain answer's message.
    extra = finishing[0].delta.model_extra or {}
    assert len(extra["generation_token_ids"]) == generated == len(extra["generation_log_probs"])


def test_local_responses_stream_structure(local_url: str) -> None:
    with _client(local_url) as client:
        t0 = time.monotonic()
        first_delta: float | None = None
        events = []
        stream = client.responses.create(model="local", input=LONG_PROMPT, max_output_tokens=40, stream=True)
        for event in stream:
            if first_delta is None and event.type == "response.output_text.delta":
                first_delta = time.monotonic() - t0
            events.append(event)
        total = time.monotonic() - t0
        # Cut off by the budget, the answer ends with ``response.incomplete`` (as OpenAI's does; the SDK's
        # ``responses.stream`` helper only knows ``response.completed``, see the completed case below).
        final = events[-1].response
    generated = final.usage.output_tokens if final.usage is not None else 0
    if generated >= 8:  # how long it writes is the model's choice; at the budget nearly always
        assert first_delta is not None and first_delta < total / 2, (first_delta, total)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    # Cut off by the budget it ends "incomplete"; ended by the model (its choice), "completed".
    assert (kinds[-1], final.status) in (
        ("response.incomplete", "incomplete"),
        ("response.completed", "completed"),
    )
    assert (final.status == "incomplete") == (generated == 40) and 1 <= generated <= 40
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text.startswith(text.rstrip())
    assert len(final.output[-1].model_extra["generation_token_ids"]) == generated


def test_local_responses_stream_helper_completed(local_url: str) -> None:
    with _client(local_url) as client:
        with client.responses.stream(
            model="local", input=[{"role": "user", "content": "Say hi."}], max_output_tokens=200
        ) as stream:
            events = list(stream)
            if events[-1].type == "response.completed":  # the model ended within the budget (nearly always)
                final = stream.get_final_response()
                text = [item for item in final.output if item.type == "message"]
                assert len(text) == 1 and final.output_text == text[0].content[0].text
            else:
                assert events[-1].type == "response.incomplete"


def test_local_forced_tool_call_streams_as_a_call(local_url: str) -> None:
    """A forced call (grammar-constrained, so whatever the model prefers) arrives as tool-call deltas."""
    with _client(local_url) as client:
        chunks = list(
            client.chat.completions.create(
                model="local",
                messages=[{"role": "user", "content": "Weather in Paris?"}],
                tools=[WEATHER_CHAT_TOOL],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                stream=True,
            )
        )
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert calls and calls[0].function.name == "get_weather" and calls[0].id
    args = json.loads("".join(tc.function.arguments or "" for tc in calls))
    assert isinstance(args, dict) and set(args) == {"city"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"
    ]


def test_local_client_going_away_stops_the_generation(local_url: str) -> None:
    stats_url = local_url + "/stats"
    headers = {"Authorization": f"Bearer {client_token_for_url(local_url)}"}
    before = httpx.get(stats_url, headers=headers, timeout=WAIT_S, trust_env=False).json()
    body = {"model": "local", "messages": LONG_PROMPT, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(timeout=WAIT_S, trust_env=False, headers=headers) as http:
        with http.stream("POST", local_url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    seen += 1
                if seen >= 4:
                    break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + WAIT_S
    while True:
        stats = httpx.get(stats_url, headers=headers, timeout=WAIT_S, trust_env=False).json()
        if stats["stopped_generations"] > before["stopped_generations"] and stats["running"] == 0:
            break
        assert time.monotonic() < deadline, f"the generation did not stop: {stats}"
        time.sleep(0.05)
    assert stats["last_stopped_after_tokens"] < 400
    # The model is free again: a plain request is answered.
    with _client(local_url) as client:
        answer = client.chat.completions.create(model="local", messages=LONG_PROMPT, max_tokens=4)
    assert answer.choices[0].finish_reason in ("length", "stop") and answer.usage.completion_tokens <= 4


def test_local_non_streaming_clients_going_away_stop_their_generations(local_url: str) -> None:
    """Before: a non-streaming request kept generating after its client left; two abandoned 800-token
    requests made the next one wait 288 s. Now both stop (one running, one queued behind it)."""
    stats_url = local_url + "/stats"
    headers = {"Authorization": f"Bearer {client_token_for_url(local_url)}"}
    before = httpx.get(stats_url, headers=headers, timeout=WAIT_S, trust_env=False).json()
    body = {"model": "local", "messages": LONG_PROMPT, "max_tokens": 800, "temperature": 0}

    def abandon() -> None:
        with contextlib.suppress(httpx.TimeoutException):  # the client gives up and closes its connection
            httpx.post(
                local_url + "/v1/chat/completions", json=body, headers=headers, timeout=1.0, trust_env=False
            )

    threads = [threading.Thread(target=abandon) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while True:
        stats = httpx.get(stats_url, headers=headers, timeout=WAIT_S, trust_env=False).json()
        if stats["running"] == 0 and stats["stopped_generations"] > before["stopped_generations"]:
            break
        assert time.monotonic() < deadline, f"the generations did not stop: {stats}"
        time.sleep(0.05)
    assert stats["last_stopped_after_tokens"] < 800
    with _client(local_url) as client:  # the model is free again at once
        answer = client.chat.completions.create(model="local", messages=LONG_PROMPT, max_tokens=4)
    assert answer.usage.completion_tokens <= 4


# -- vllm_model and openai_model, against the repo's fake vLLM / OpenAI backend ------------------------

VLLM_CONFIG = "responses_api_models/vllm_model/configs/vllm_model.yaml"
OPENAI_CONFIG = "responses_api_models/openai_model/configs/openai_model.yaml"
FAKE_MODEL = "fake-model"


def _load_fake() -> ModuleType:
    path = ROOT / "responses_api_models/vllm_model/tests/fake_vllm_backend.py"
    spec = importlib.util.spec_from_file_location("streaming_test_fake_vllm_backend", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def relay_urls() -> Iterator[dict[str, Any]]:
    fake = _load_fake()
    with fake.FakeBackend("stream", model=FAKE_MODEL) as backend:
        backend.control(
            scripts={
                "[script:stream]": [
                    {
                        "tool_calls": [
                            {"name": "get_weather", "arguments": {"city": "Paris, the capital of France"}}
                        ]
                    },
                    {"content": "It is sunny in Paris today, and it will stay sunny all week long."},
                ]
            }
        )
        extra = {
            "policy_base_url": backend.url + "/v1",
            "policy_api_key": "EMPTY",
            "policy_model_name": FAKE_MODEL,
            "upstream_model": {
                "responses_api_models": {
                    "openai_model": {
                        "entrypoint": "app.py",
                        "openai_base_url": backend.url + "/v1",
                        "openai_api_key": "EMPTY",
                        "openai_model": FAKE_MODEL,
                    }
                }
            },
        }
        with running_servers([VLLM_CONFIG], extra, with_scripted_model=False) as helper:
            yield {
                "vllm": server_url(helper, "policy_model"),
                "openai": server_url(helper, "upstream_model"),
                "backend": backend,
            }


STREAM_TURNS = [
    [{"role": "user", "content": "[script:stream] weather?"}],
    [
        {"role": "user", "content": "[script:stream] weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ],
]


@pytest.mark.parametrize("server", ["vllm", "openai"])
@pytest.mark.parametrize("turn", [0, 1])
def test_relayed_responses_stream_reassembles_the_plain_answer(
    relay_urls: dict[str, Any], server: str, turn: int
) -> None:
    params = {"input": STREAM_TURNS[turn], "tools": [WEATHER_TOOL]}
    with _client(relay_urls[server]) as client:
        plain = client.responses.create(model=FAKE_MODEL, **params)
        with client.responses.stream(model=FAKE_MODEL, **params) as stream:
            events = list(stream)
            final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert _comparable_output(final.output) == _comparable_output(plain.output)
    if plain.output_text:
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert len(deltas) > 3 and "".join(deltas) == plain.output_text  # relayed in pieces
    else:
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert len(deltas) > 3 and "".join(deltas) == plain.output[0].arguments


@pytest.mark.parametrize("server", ["vllm", "openai"])
@pytest.mark.parametrize("turn", [0, 1])
def test_relayed_chat_stream_reassembles_the_plain_answer(
    relay_urls: dict[str, Any], server: str, turn: int
) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "[script:stream] weather?"}]
    if turn:
        call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]
    body = {"messages": messages, "tools": [WEATHER_CHAT_TOOL]}
    with _client(relay_urls[server]) as client:
        plain = client.chat.completions.create(model=FAKE_MODEL, **body)
        chunks = list(
            client.chat.completions.create(
                model=FAKE_MODEL, stream=True, stream_options={"include_usage": True}, **body
            )
        )
        with client.chat.completions.stream(model=FAKE_MODEL, **body) as stream:
            for _ in stream:
                pass
            assert _chat_message(stream.get_final_completion()) == _chat_message(plain)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert len(chunks) > 5


def test_relayed_backend_error_before_the_stream_keeps_its_status(relay_urls: dict[str, Any]) -> None:
    for server in ("vllm", "openai"):
        r = _post(
            relay_urls[server],
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 10**6},
        )
        assert r.status_code == 400 and "maximum context length" in r.text, (server, r.text)


def test_streaming_bench_runs_and_reports(tmp_path: Path) -> None:
    """``ng_bench +suite=streaming`` end to end on a tiny load (its figures are reported, never asserted)."""
    from nemo_gym.tools.bench.streaming import run_suite

    out = tmp_path / "streaming_bench.json"
    result = run_suite(
        {"requests": 20, "concurrency": 2, "rounds": 1, "local": False, "output_json_fpath": str(out)}
    )
    assert json.loads(out.read_text()) == result
    for api in ("responses", "chat"):
        row = result["scripted"][api]
        assert row["plain_requests_per_s"] > 0 and row["streamed_requests_per_s"] > 0
        assert isinstance(row["stream_cost_pct"], float)


# -- the stream transforms the Messages endpoint and vllm_model use, fed one character at a time -----


def _collect(gen: Any) -> list[Any]:
    async def run() -> list[Any]:
        return [d async for d in gen]

    return asyncio.run(run())


async def _chars(text: str, end: StreamEnd) -> Any:
    for ch in text:
        yield TextDelta(ch)
    yield end


def _joined(deltas: list[Any]) -> tuple[str, str]:
    reasoning = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
    text = "".join(d.text for d in deltas if isinstance(d, TextDelta))
    return reasoning, text


@pytest.mark.parametrize(
    "raw",
    [
        "<think>\nThe user said something.\n</think>\n\nHello! I am here.",
        "  <think>a b </think>Hi",
        "<think>cut off while thinking",
        "No tags at all, <think> later is text.",
        "<thin",
    ],
)
def test_split_think_stream_matches_the_plain_parse_char_by_char(raw: str) -> None:
    out = _collect(split_think_stream(_chars(raw, StreamEnd())))
    assert isinstance(out[-1], StreamEnd)
    expected_reasoning, expected_text = (
        split_think_tags(raw) if raw.lstrip().startswith("<think>") else (None, raw)
    )
    reasoning, text = _joined(out)
    assert (reasoning or None, text) == (expected_reasoning or None, expected_text)


def test_cut_at_stop_sequences_char_by_char_stops_the_source() -> None:
    closed = []

    async def source() -> Any:
        try:
            for ch in "Hello! I am a model that goes on":
                yield TextDelta(ch)
            yield StreamEnd()
        finally:
            closed.append(True)

    encoder = MessagesEventEncoder("m")
    out = _collect(cut_at_stop_sequences(source(), ["never", "I am"], encoder))
    assert _joined(out)[1] == "Hello! " and isinstance(out[-1], StreamEnd)
    assert encoder.stop_sequence == "I am" and closed == [True]
