"""workplace_assistant's tools over MCP (``expose_tools_over_mcp: true``), driven by the ``mcp``
package's own streamable-HTTP client: the session /seed_session announces is the one the MCP calls
change, and /verify of that session sees the effects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("mcp", reason="the `mcp` extra is not installed (pip install -e '.[mcp]')")

import httpx2  # noqa: E402
from mcp import ClientSession  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

from nemo_gym.cli import RunHelper
from nemo_gym.server.asgi.sessions import cookie_name_for
from nemo_gym.server.mcp import NEMO_GYM_MCP_METADATA_KEY, NEMO_GYM_MCP_SESSION_TOKEN_HEADER
from nemo_gym.tools.testing import example_rows, post_json, running_servers, server_url
from resources_servers.workplace_assistant.world import TOOLS

ENV = "workplace_assistant"
CONFIG = f"resources_servers/{ENV}/configs/{ENV}.yaml"
COOKIE = cookie_name_for(ENV)
ROW = example_rows(ENV)[0]  # reply to Samir's latest churn email


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    extra = {ENV: {"resources_servers": {ENV: {"expose_tools_over_mcp": True}}}}
    with running_servers([CONFIG], extra) as h:
        yield h


async def _mcp(
    url: str, headers: dict[str, str], calls: list[tuple[str, dict[str, Any]]]
) -> tuple[list[str], list[Any]]:
    async with httpx2.AsyncClient(headers=headers, timeout=30) as http:
        async with streamable_http_client(url, http_client=http) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                tools = [t.name for t in (await session.list_tools()).tools]
                results = [await session.call_tool(name, args) for name, args in calls]
    return tools, results


def _seed(base: str) -> tuple[dict[str, str], dict[str, Any]]:
    resp = post_json(base + "/seed_session", example_rows("workplace_assistant")[0])
    assert resp.status_code == 200, resp.text
    return {COOKIE: resp.cookies[COOKIE]}, resp.json()[NEMO_GYM_MCP_METADATA_KEY]


def test_mcp_client_lists_and_calls_the_sessions_tools(helper: RunHelper) -> None:
    base = server_url(helper, ENV)
    cookies, meta = _seed(base)
    assert meta["server_name"] == ENV and meta["url_path"] == "/mcp" and meta["transport"] == "http"
    assert meta["headers"][NEMO_GYM_MCP_SESSION_TOKEN_HEADER] == cookies[COOKIE]
    assert meta["headers"]["Authorization"].startswith("Bearer ")
    calls = [
        ("email_search_emails", {"query": "churn samir"}),
        ("email_reply_email", {"email_id": "00000010", "body": "I will decide by Thursday."}),
        ("email_delete_email", {"email_id": "99999999"}),
    ]
    tools, results = asyncio.run(asyncio.wait_for(_mcp(base + meta["url_path"], meta["headers"], calls), 60))
    assert tools == list(TOOLS)
    found = json.loads(results[0].content[0].text)["output"]["emails"]
    assert [e["email_id"] for e in found] == ["00000010"] and not results[0].is_error
    assert results[1].structured_content == {"output": "Reply sent (email_id 00000041)."}
    assert "No record in emails" in results[2].content[0].text  # the tool's own error, as over HTTP
    # The effects are in this session: /verify with the session's cookie scores them.
    verify = post_json(base + "/verify", {**ROW, "response": {"output": []}}, cookies=cookies)
    assert verify.status_code == 200, verify.text
    assert verify.json()["reward"] == 1.0 and verify.json()["state_source"] == "session"


def test_mcp_calls_of_one_session_do_not_touch_another(helper: RunHelper) -> None:
    base = server_url(helper, ENV)
    (cookies_a, meta_a), (cookies_b, _) = _seed(base), _seed(base)
    reply = [("email_reply_email", {"email_id": "00000010", "body": "I will decide by Thursday."})]
    asyncio.run(asyncio.wait_for(_mcp(base + "/mcp", meta_a["headers"], reply), 60))
    b = post_json(base + "/verify", {**ROW, "response": {"output": []}}, cookies=cookies_b).json()
    assert b["reward"] == 0.0 and b["state_source"] == "session"  # b never replied
    assert (
        post_json(base + "/verify", {**ROW, "response": {"output": []}}, cookies=cookies_a).json()["reward"]
        == 1.0
    )


def test_mcp_needs_the_session_token_and_the_run_token(helper: RunHelper) -> None:
    base = server_url(helper, ENV)
    _, meta = _seed(base)
    headers = dict(meta["headers"])
    call = [("email_search_emails", {"query": "churn"})]
    forged = {**headers, NEMO_GYM_MCP_SESSION_TOKEN_HEADER: "0" * 32 + ".AAAA"}
    for bad in (forged, {k: v for k, v in headers.items() if k != NEMO_GYM_MCP_SESSION_TOKEN_HEADER}):
        _, results = asyncio.run(asyncio.wait_for(_mcp(base + "/mcp", bad, call), 60))
        assert results[0].is_error and NEMO_GYM_MCP_SESSION_TOKEN_HEADER in results[0].content[0].text
    no_run_token = {k: v for k, v in headers.items() if k != "Authorization"}
    with pytest.raises(ExceptionGroup):  # the client gives up: the request guard refused it
        asyncio.run(asyncio.wait_for(_mcp(base + "/mcp", no_run_token, call), 60))
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}
    raw = httpx.post(base + "/mcp", json=init, headers=no_run_token, timeout=10, trust_env=False)
    assert raw.status_code == 401, raw.text
