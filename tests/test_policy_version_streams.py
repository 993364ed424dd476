"""The policy version on streamed answers (nemo_gym.server.policy_version), with the scripted model over real
HTTP and the official SDKs' stream helpers: the version current when a streamed call started is on its
final event (Responses: the output items of ``response.completed``; Chat: the finishing chunk and the usage
chunk; Messages: ``message_delta``) and on the recorded call, while every other event is unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from nemo_gym.auth import client_token_for_url
from nemo_gym.server.policy_version import PolicyVersionStreamStampMiddleware, stamp_event
from nemo_gym.tools.testing import WEATHER_CHAT_TOOL, WEATHER_TOOL, post_json, running_servers, server_url

EXAMPLE_CONFIG = "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml"
WAIT_S = 60.0
ROLLOUT = "stream-version-1"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running_servers([EXAMPLE_CONFIG], {"observability_enabled": True}) as helper:
        model_url = server_url(helper, "policy_model")
        post_json(model_url + "/policy_version", {"policy_version": 7}).raise_for_status()
        yield model_url


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url + "/v1", api_key=client_token_for_url(url), max_retries=0, timeout=WAIT_S
    )


def _extra(obj: Any) -> dict[str, Any]:
    return dict(getattr(obj, "model_extra", None) or {})


def test_responses_stream_final_items_carry_the_version(url: str) -> None:
    with _openai(url) as client:
        with client.responses.stream(
            model="m", input="What is the weather in Paris?", tools=[WEATHER_TOOL]
        ) as s:
            events = list(s)
            final = s.get_final_response()
    assert events[-1].type == "response.completed"
    assert final.output and all(_extra(item).get("policy_version") == 7 for item in final.output)
    # The deltas before it are as they were: no version on them.
    assert all("policy_version" not in _extra(e) for e in events[:-1])


def test_chat_stream_last_chunks_carry_the_version(url: str) -> None:
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER_CHAT_TOOL]}
    with _openai(url) as client:
        chunks = list(
            client.chat.completions.create(
                model="m", stream=True, stream_options={"include_usage": True}, **body
            )
        )
        with client.chat.completions.stream(model="m", **body) as stream:
            for _ in stream:
                pass
            assembled = stream.get_final_completion()
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and _extra(finishing[0]).get("policy_version") == 7
    assert chunks[-1].choices == [] and _extra(chunks[-1]).get("policy_version") == 7  # the usage chunk
    others = [c for c in chunks if c is not finishing[0] and c is not chunks[-1]]
    assert others and all("policy_version" not in _extra(c) for c in others)
    assert assembled.choices[0].finish_reason == finishing[0].choices[0].finish_reason


def test_messages_stream_message_delta_carries_the_version(url: str) -> None:
    with anthropic.Anthropic(
        base_url=url, api_key=client_token_for_url(url), max_retries=0, timeout=WAIT_S
    ) as client:
        with client.messages.stream(
            model="m", max_tokens=200, messages=[{"role": "user", "content": "Say hello."}]
        ) as stream:
            events = list(stream)
            message = stream.get_final_message()
    deltas = [e for e in events if e.type == "message_delta"]
    assert len(deltas) == 1 and _extra(deltas[0]).get("policy_version") == 7
    assert events[-1].type == "message_stop" and message.stop_reason is not None


def test_recorded_streamed_calls_carry_the_version(url: str) -> None:
    rollout_url = f"{url}/ng-rollout/{ROLLOUT}"
    with _openai(rollout_url) as client:
        with client.responses.stream(model="m", input="Hello there") as s:
            s.get_final_response()
        for _ in client.chat.completions.create(
            model="m", stream=True, messages=[{"role": "user", "content": "Hi"}]
        ):
            pass
    calls = post_json(url + "/ng_model_calls/pop", {"rollout_ids": [ROLLOUT]}).json()["calls"][ROLLOUT]
    assert [c["dialect"] for c in calls] == ["responses", "chat_completions"]
    assert all(c["policy_version"] == 7 for c in calls)
    responses_call = calls[0]["response"]
    assert responses_call["output"] and all(i["policy_version"] == 7 for i in responses_call["output"])


def test_without_a_version_streams_pass_unchanged() -> None:
    """The middleware costs nothing and changes nothing until a trainer sets a version."""

    class Unset:
        def get(self) -> None:
            return None

    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send(
            {"type": "http.response.body", "body": b'data: {"finish_reason":"stop"}\n\n', "more_body": False}
        )

    async def collect(message: dict[str, Any]) -> None:
        sent.append(message)

    import asyncio

    middleware = PolicyVersionStreamStampMiddleware(app, Unset())  # type: ignore[arg-type]
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions"}
    asyncio.run(middleware(scope, None, collect))
    assert sent[1]["body"] == b'data: {"finish_reason":"stop"}\n\n'


def test_events_split_anywhere_are_stamped_once_and_passed_in_order() -> None:
    """A backend's bytes may cut an event anywhere (a relayed vLLM stream): each event is passed on whole
    as soon as it is complete, the final one stamped."""

    class Seven:
        def get(self) -> int:
            return 7

    stream = (
        b'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
        b"data: [DONE]\n\n"
    )
    for step in (1, 7, 50, len(stream)):
        pieces = [stream[i : i + step] for i in range(0, len(stream), step)]
        sent: list[bytes] = []

        async def app(scope: Any, receive: Any, send: Any, pieces: list[bytes] = pieces) -> None:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            for i, piece in enumerate(pieces):
                await send({"type": "http.response.body", "body": piece, "more_body": i < len(pieces) - 1})

        async def collect(message: dict[str, Any], sent: list[bytes] = sent) -> None:
            if message["type"] == "http.response.body":
                sent.append(message["body"])

        import asyncio

        middleware = PolicyVersionStreamStampMiddleware(app, Seven())  # type: ignore[arg-type]
        asyncio.run(
            middleware({"type": "http", "method": "POST", "path": "/v1/chat/completions"}, None, collect)
        )
        out = b"".join(sent)
        events = out.split(b"\n\n")
        assert events[0] == stream.split(b"\n\n")[0]
        assert b'"policy_version":7' in events[1] and events[2] == b"data: [DONE]" and out.endswith(b"\n\n")
        assert out.count(b"policy_version") == 1


def test_stamp_event_shapes() -> None:
    completed = {"type": "response.completed", "response": {"output": [{"type": "message"}]}}
    stamp_event("/v1/responses", completed, 3)
    assert completed["response"]["output"][0]["policy_version"] == 3 and "policy_version" not in completed
    chunk = {"choices": [{"delta": {"generation_token_ids": [1]}, "finish_reason": "stop"}]}
    stamp_event("/v1/chat/completions", chunk, "v3")
    assert chunk["policy_version"] == "v3" and chunk["choices"][0]["delta"]["policy_version"] == "v3"
