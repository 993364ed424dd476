"""``NeMoGymAsyncOpenAI`` against real servers on 127.0.0.1: the scripted OpenAI-compatible backend
(``vllm_model``'s fake, with an API key and scripted failures) and a scripted model under ``ng_run``
(which wants this run's token)."""

from __future__ import annotations

import importlib.util
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from nemo_gym.openai_utils import (
    RATE_LIMIT_ERROR_CODES,
    RETRY_ERROR_CODES,
    NeMoGymAsyncOpenAI,
    NeMoGymChatCompletion,
    NeMoGymResponse,
)
from nemo_gym.tools.testing import running_servers, server_url

ROOT = Path(__file__).resolve().parents[1]
FAKE_PATH = ROOT / "responses_api_models" / "vllm_model" / "tests" / "fake_vllm_backend.py"
KEY = "sk-test-client-0123456789abcdef"
WRONG_KEY = "sk-test-client-WRONG-fedcba9876"
FAST = {"retry_delay_s": 0.0, "max_retry_delay_s": 0.0}


def _load_fake() -> Any:
    spec = importlib.util.spec_from_file_location("openai_client_test_fake_backend", FAKE_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def backend() -> Iterator[Any]:
    with _load_fake().FakeBackend("client_test", model="fake-model", api_key=KEY) as b:
        yield b


def _client(backend: Any, **fields: Any) -> NeMoGymAsyncOpenAI:
    return NeMoGymAsyncOpenAI(base_url=backend.url + "/v1", api_key=KEY, **{**FAST, **fields})


def _count(backend: Any, path: str) -> int:
    return backend.calls()["counts"].get(path, 0)


def test_retry_status_lists_have_upstream_values() -> None:
    assert RATE_LIMIT_ERROR_CODES == [429, 502, 503, 504, 520]
    assert RETRY_ERROR_CODES == [429, 502, 503, 504, 520, 500]


async def test_every_endpoint_returns_parsed_json(backend: Any) -> None:
    client = _client(backend)
    try:
        chat = await client.create_chat_completion(
            model="fake-model", messages=[{"role": "user", "content": "Say hi"}]
        )
        assert isinstance(chat, dict)
        ChatCompletion.model_validate(chat)
        assert NeMoGymChatCompletion.model_validate(chat).choices[0].message.role == "assistant"

        response = await client.create_response(model="fake-model", input="Say hi")
        assert isinstance(response, dict)
        Response.model_validate(response)
        NeMoGymResponse.model_validate(response)

        models = await client.create_models()
        assert [m["id"] for m in models["data"]] == ["fake-model"]

        # /tokenize is served at the root (vLLM's place): the trailing /v1 is dropped.
        tokens = await client.create_tokenize(model="fake-model", prompt="ab")
        assert tokens["count"] == len(tokens["tokens"]) == 2
    finally:
        await client.close()
    calls = backend.calls()["requests"]
    assert all(c["authorized"] for c in calls[-3:])  # the API key went as a Bearer token


async def test_server_errors_are_retried_a_bounded_number_of_times(backend: Any) -> None:
    client = _client(backend, max_tries=3)
    try:
        # Two failures, then an answer: the caller sees only the answer.
        backend.control(fail_next=[500, 503], reset_calls=True)
        answer = await client.create_chat_completion(
            model="fake-model", messages=[{"role": "user", "content": "x"}]
        )
        assert answer["choices"]
        assert _count(backend, "/v1/chat/completions") == 3

        # Always failing: exactly max_tries requests, then the error with the endpoint's message and body.
        backend.control(fail_next=[500] * 10, reset_calls=True)
        with pytest.raises(aiohttp.ClientResponseError) as info:
            await client.create_chat_completion(
                model="fake-model", messages=[{"role": "user", "content": "x"}]
            )
        assert info.value.status == 500
        assert "after 3 tries" in info.value.message and "scripted failure 500" in info.value.message
        assert b"scripted failure 500" in info.value.response_content
        assert _count(backend, "/v1/chat/completions") == 3
    finally:
        backend.control(fail_next=[])
        await client.close()


async def test_rate_limits_get_their_own_budget_but_are_never_retried_forever(backend: Any) -> None:
    client = _client(backend, max_tries=2, max_rate_limit_tries=4)
    try:
        backend.control(fail_next=[{"status": 429, "retry_after": "0"}] * 20, reset_calls=True)
        with pytest.raises(aiohttp.ClientResponseError) as info:
            await client.create_response(model="fake-model", input="x")
        assert info.value.status == 429
        assert _count(backend, "/v1/responses") == 4
    finally:
        backend.control(fail_next=[])
        await client.close()


async def test_client_errors_are_not_retried_and_the_key_never_shows(backend: Any) -> None:
    client = NeMoGymAsyncOpenAI(base_url=backend.url + "/v1", api_key=WRONG_KEY, **FAST)
    try:
        backend.control(reset_calls=True)
        with pytest.raises(aiohttp.ClientResponseError) as info:
            await client.create_chat_completion(
                model="fake-model", messages=[{"role": "user", "content": "x"}]
            )
        assert info.value.status == 401
        assert _count(backend, "/v1/chat/completions") == 1
        # The backend echoes the key it got; the error (message and body) has it scrubbed.
        assert "Incorrect API key" in info.value.message
        assert WRONG_KEY not in info.value.message and WRONG_KEY not in str(info.value)
        assert WRONG_KEY.encode() not in info.value.response_content
        assert WRONG_KEY not in repr(client)
    finally:
        await client.close()


async def test_unreachable_endpoint_fails_after_max_tries() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = NeMoGymAsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_tries=2, **FAST)
    try:
        with pytest.raises(aiohttp.ClientConnectionError):
            await client.create_models()
    finally:
        await client.close()


def test_run_token_goes_only_to_our_own_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEMO_GYM_AUTH_TOKEN", "run-token-123")
    external = NeMoGymAsyncOpenAI(
        base_url="https://api.openai.example/v1", api_key=KEY, default_headers={"A": "b"}
    )
    assert external._headers(external.base_url + "/responses") == {"A": "b", "Authorization": f"Bearer {KEY}"}
    internal = NeMoGymAsyncOpenAI(base_url="http://gym-node-3:8000/v1", api_key="x", internal=True)
    assert internal._headers(internal.base_url + "/responses")["X-NeMo-Gym-Token"] == "run-token-123"
    local = NeMoGymAsyncOpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x")
    assert local._headers(local.base_url + "/responses")["X-NeMo-Gym-Token"] == "run-token-123"


def test_a_model_server_of_the_run_accepts_the_client() -> None:
    """A server under ng_run wants the run token; the client finds and sends it, whatever its api_key."""
    import asyncio

    with running_servers([]) as run:
        url = server_url(run, "policy_model") + "/v1"

        async def call() -> Any:
            client = NeMoGymAsyncOpenAI(base_url=url, api_key="not-the-run-token", internal=True, **FAST)
            try:
                return await client.create_response(input="hello")
            finally:
                await client.close()

        response = asyncio.run(call())
    parsed = NeMoGymResponse.model_validate(response)
    assert parsed.output_text
