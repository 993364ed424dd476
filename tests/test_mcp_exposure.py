"""nemo_gym.server.mcp on a server that declares no MCP hook: its typed tool routes are harvested and served
over MCP (the mcp package's own client), bound to the seeded session, and /verify sees the effects."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("mcp", reason="the `mcp` extra is not installed (pip install -e '.[mcp]')")

import httpx2  # noqa: E402
from mcp import ClientSession  # noqa: E402
from mcp.client.streamable_http import streamable_http_client

from nemo_gym.server.asgi.sessions import cookie_name_for
from nemo_gym.server.mcp import MCP_URL_PATH as MCP_PATH
from nemo_gym.tools.testing import metric_value, post_json, running_servers, scrape, server_url

ENV = "example_session_state_mgmt"
STUB = {"responses_create_params": {"input": "direct"}, "response": {"output": []}}


async def _drive(url: str, headers: dict[str, str]) -> tuple[dict[str, dict], list[str]]:
    async with httpx2.AsyncClient(headers=headers, timeout=30) as http:
        async with streamable_http_client(url, http_client=http) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                tools = {t.name: t.input_schema for t in (await session.list_tools()).tools}
                texts = []
                for name, args in (
                    ("increment_counter", {"count": 5}),
                    ("increment_counter", {"count": "x"}),
                ):
                    result = await session.call_tool(name, args)
                    texts.append(("error: " if result.is_error else "") + result.content[0].text)
                texts.append((await session.call_tool("get_counter_value", {})).content[0].text)
    return tools, texts


def test_harvested_routes_are_served_over_mcp_for_the_session() -> None:
    instance = {ENV: {"resources_servers": {ENV: {"entrypoint": "app.py", "expose_tools_over_mcp": True}}}}
    with running_servers([], instance, with_scripted_model=False) as helper:
        base = server_url(helper, ENV)
        seeded = post_json(base + "/seed_session", {**STUB, "initial_count": 10})
        cookies = {cookie_name_for(ENV): seeded.cookies[cookie_name_for(ENV)]}
        meta = seeded.json()["mcp"]
        tools, texts = asyncio.run(asyncio.wait_for(_drive(base + meta["url_path"], meta["headers"]), 60))
        assert sorted(tools) == ["get_counter_value", "increment_counter"]  # no seed_session, verify, ...
        assert tools["increment_counter"]["required"] == ["count"]
        assert texts[0] == '{"success":true}'
        assert texts[1].startswith("error: HTTP 422") and "count" in texts[1]
        assert texts[2] == '{"count":15}'
        # The rollout read the counter over MCP and tells it: what the environment's reward asks for.
        told = {
            "output": [
                {"type": "function_call", "call_id": "c1", "name": "get_counter_value", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": texts[2]},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "It is 15."}],
                },
            ]
        }
        verify = post_json(
            base + "/verify", {**STUB, "response": told, "expected_count": 15}, cookies=cookies
        )
        assert verify.json()["reward"] == 1.0, verify.text
        # Tool calls made over MCP count under their tool, as over HTTP (nemo_gym.server.metrics).
        m = scrape(base)
        assert metric_value(m, "nemo_gym_tool_calls_total", tool="increment_counter", outcome="ok") == 1
        assert metric_value(m, "nemo_gym_tool_calls_total", tool="increment_counter", outcome="error") == 1
        assert metric_value(m, "nemo_gym_tool_calls_total", tool="get_counter_value", outcome="ok") == 1


def _mcp_instance(**extra: object) -> dict:
    return {
        ENV: {"resources_servers": {ENV: {"entrypoint": "app.py", "expose_tools_over_mcp": True, **extra}}}
    }


def test_tool_calls_work_with_the_x_nemo_gym_token_header() -> None:
    """The documented alternative to ``Authorization`` reaches the tool route too."""
    with running_servers([], _mcp_instance(), with_scripted_model=False) as helper:
        base = server_url(helper, ENV)
        seeded = post_json(base + "/seed_session", {**STUB, "initial_count": 1})
        headers = dict(seeded.json()["mcp"]["headers"])
        token = headers.pop("Authorization").removeprefix("Bearer ")
        headers["X-NeMo-Gym-Token"] = token
        _, texts = asyncio.run(asyncio.wait_for(_drive(base + MCP_PATH, headers), 60))
        assert texts == ['{"success":true}', texts[1], '{"count":6}'], texts
        assert texts[1].startswith("error: HTTP 422"), texts


def test_an_idle_get_event_stream_is_ended() -> None:
    with running_servers(
        [], _mcp_instance(mcp_stream_idle_timeout_s=1.0), with_scripted_model=False
    ) as helper:
        base = server_url(helper, ENV)
        token = post_json(base + "/seed_session", {**STUB, "initial_count": 0}).json()["mcp"]["headers"][
            "Authorization"
        ]
        headers = {"Authorization": token, "Accept": "text/event-stream"}

        async def stream_then_call() -> tuple[int, str, float, int]:
            async with httpx2.AsyncClient(headers=headers, timeout=20) as http:
                started = time.monotonic()
                async with http.stream("GET", base + MCP_PATH) as resp:
                    status, kind = resp.status_code, resp.headers.get("content-type", "")
                    async for _ in resp.aiter_bytes():
                        pass  # ends when the server ends the stream (else the 20 s read timeout fails it)
                took = time.monotonic() - started
                after = await http.get(base + "/")  # the same client (pool) goes on working
                return status, kind, took, after.status_code

        status, kind, took, after = asyncio.run(asyncio.wait_for(stream_then_call(), 60))
        assert status == 200 and kind.startswith("text/event-stream")
        assert took < 15, took  # ended by the 1 s bound, far inside the client's 20 s read timeout
        assert after == 200
