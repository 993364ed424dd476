"""``stream: true`` on ``/v1/responses`` and ``/v1/chat/completions``, through the official ``openai`` SDK's
streaming helpers, against real servers on 127.0.0.1 (nemo_gym.server.streaming).

* scripted_model: the reassembled stream equals the non-streamed answer exactly (text and tool calls).
* local_model (the real tiny GGUF): the first event arrives well before the generation ends, and a
  client that goes away stops the generation. Only structure is asserted, never the model's words.
* vllm_model relays the (fake) vLLM backend's stream; openai_model relays its upstream's stream.
* Malformed stream requests are a 400 naming the field.
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

import httpx
import openai
import pytest

from nemo_gym.auth import client_token_for_url
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
    message = completion.choices[0].message.model_dump(exclude_none=True)
    for call in message.get("tool_calls") or []:
        call.pop("id")
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
