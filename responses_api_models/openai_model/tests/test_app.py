"""openai_model against a scripted OpenAI-compatible backend (a real process on 127.0.0.1).

The backend is ``vllm_model``'s fake (it also serves ``/v1/responses``), started with an API key;
with a wrong key it answers OpenAI's 401 and echoes the key it got, so scrubbing can be checked.
"""

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
from openai.types.responses import Response, ResponseFunctionToolCall, ResponseOutputMessage
from pydantic import ValidationError

from nemo_gym.auth import client_token_for_url
from nemo_gym.tools.testing import get, post_json, refusing_port, running_servers, server_url

HERE = Path(__file__).resolve().parent
FAKE_PATH = HERE.parents[1] / "vllm_model" / "tests" / "fake_vllm_backend.py"
OPENAI_CONFIG = "responses_api_models/openai_model/configs/openai_model.yaml"
MODEL = "gpt-fake"
GOOD_KEY = "sk-test-GOOD-0123456789abcdef"
BAD_KEY = "sk-test-WRONG-9876543210fedcba"
INSTANCES = ("policy_model", "bad_key_model", "bad_model_model", "bad_url_model", "down_model")

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves annotations through sys.modules
    spec.loader.exec_module(module)
    return module


FAKE = _load(FAKE_PATH, "openai_model_test_fake_backend")
APP = _load(HERE.parent / "app.py", "openai_model_test_app")


@pytest.fixture(scope="module")
def backend() -> Iterator[Any]:
    with FAKE.FakeBackend("openai", model=MODEL, api_key=GOOD_KEY) as b:
        yield b


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("openai_model_logs")


@pytest.fixture(scope="module")
def helper(backend: Any, log_dir: Path) -> Iterator[Any]:
    fast = {"max_retries": 3, "backoff_s": 0.01, "max_backoff_s": 0.05}

    def instance(**fields: Any) -> dict[str, Any]:
        impl = {
            "entrypoint": "app.py",
            "openai_base_url": backend.url + "/v1",
            "openai_api_key": GOOD_KEY,
            "openai_model": MODEL,
            **fast,
            **fields,
        }
        return {"responses_api_models": {"openai_model": impl}}

    extra = {
        "policy_base_url": backend.url + "/v1",
        "policy_api_key": GOOD_KEY,
        "policy_model_name": MODEL,
        "log_dir": str(log_dir),
        "policy_model": {"responses_api_models": {"openai_model": fast}},
        "bad_key_model": instance(openai_api_key=BAD_KEY),
        "bad_model_model": instance(openai_model="gpt-nope"),
        "bad_url_model": instance(openai_base_url=backend.url + "/wrong/v1"),
        "down_model": instance(openai_base_url=f"http://127.0.0.1:{refusing_port()}/v1", max_retries=2),
    }
    with running_servers([OPENAI_CONFIG], extra, with_scripted_model=False) as run:
        yield run


@pytest.fixture(scope="module")
def urls(helper: Any) -> dict[str, str]:
    return {name: server_url(helper, name) for name in INSTANCES}


@pytest.fixture
def client(urls: dict[str, str]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=urls["policy_model"] + "/v1",
        api_key=client_token_for_url(urls["policy_model"]),
        max_retries=0,
        timeout=60,
    ) as c:
        yield c


def _requests(backend: Any, path: str, marker: str) -> list[dict[str, Any]]:
    return [c for c in backend.calls()["requests"] if c["path"] == path and marker in json.dumps(c["body"])]


# -- the official SDK ------------------------------------------------------------------------------------


def test_sdk_responses_with_tools_and_second_turn(client: openai.OpenAI, backend: Any) -> None:
    first = client.responses.create(model="anything", input="[sdk-resp] Weather in Oslo?", tools=TOOLS)
    assert isinstance(first, Response)
    call = first.output[0]
    assert isinstance(call, ResponseFunctionToolCall) and call.name == "get_weather"
    history: list[Any] = [{"role": "user", "content": "[sdk-resp] Weather in Oslo?"}]
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "sunny"})
    second = client.responses.create(model="anything", input=history, tools=TOOLS)
    assert [type(i) for i in second.output] == [ResponseOutputMessage]
    assert second.output_text == "The tool said: sunny"
    sent = _requests(backend, "/v1/responses", "[sdk-resp]")
    assert len(sent) == 2
    assert all(c["authorized"] and c["body"]["model"] == MODEL for c in sent)  # configured key and model


def test_sdk_chat_completions_with_tools(client: openai.OpenAI, backend: Any) -> None:
    completion = client.chat.completions.create(
        model="anything",
        messages=[{"role": "user", "content": "[sdk-chat] Weather in Lima?"}],
        tools=CHAT_TOOLS,
    )
    assert isinstance(completion, ChatCompletion)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls is not None
    tool_call = choice.message.tool_calls[0]
    assert tool_call.function.name == "get_weather" and json.loads(tool_call.function.arguments) == {
        "city": "example"
    }
    followup = client.chat.completions.create(
        model="anything",
        messages=[
            {"role": "user", "content": "[sdk-chat] Weather in Lima?"},
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": tool_call.id, "content": "cloudy"},
        ],
        tools=CHAT_TOOLS,
    )
    assert followup.choices[0].finish_reason == "stop"
    assert followup.choices[0].message.content is not None and followup.choices[0].message.content.endswith(
        "The tool said: cloudy"
    )
    assert all(c["body"]["model"] == MODEL for c in _requests(backend, "/v1/chat/completions", "[sdk-chat]"))


def test_token_id_fields_are_not_forwarded(urls: dict[str, str], backend: Any) -> None:
    item = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "earlier", "annotations": []}],
        "prompt_token_ids": [1, 2],
        "generation_token_ids": [3],
        "generation_log_probs": [-0.5],
    }
    body = {"input": [{"role": "user", "content": "[strip] hi"}, item, {"role": "user", "content": "again"}]}
    resp = post_json(urls["policy_model"] + "/v1/responses", body)
    assert resp.status_code == 200, resp.text
    (sent,) = _requests(backend, "/v1/responses", "[strip]")
    forwarded = sent["body"]["input"][1]
    assert forwarded["content"][0]["text"] == "earlier"
    assert not any(
        f in forwarded for f in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
    )


def test_malformed_streaming_chat_is_refused(urls: dict[str, str]) -> None:
    """``stream: true`` is relayed (tests/test_streaming.py); a ``stream`` that is not a boolean is a 400."""
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}
    resp = post_json(urls["policy_model"] + "/v1/chat/completions", body)
    assert resp.status_code == 400 and "`stream`" in resp.json()["error"]["message"]


# -- retries --------------------------------------------------------------------------------------------


def test_429_and_503_are_retried(urls: dict[str, str], backend: Any) -> None:
    backend.control(fail_next=[{"status": 429, "retry_after": "0"}, 503], reset_calls=True)
    resp = post_json(urls["policy_model"] + "/v1/responses", {"input": "[retry] hi"})
    assert resp.status_code == 200, resp.text
    assert Response.model_validate(resp.json()).output_text == "Hello! I am a fake OpenAI model."
    assert backend.calls()["counts"] == {"/v1/responses": 3}

    backend.control(fail_next=[502], reset_calls=True)
    resp = post_json(
        urls["policy_model"] + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    )
    assert resp.status_code == 200, resp.text
    assert backend.calls()["counts"] == {"/v1/chat/completions": 2}


def test_retries_are_bounded(urls: dict[str, str], backend: Any) -> None:
    backend.control(fail_next=[503] * 10, reset_calls=True)
    try:
        resp = post_json(urls["policy_model"] + "/v1/responses", {"input": "[retry-forever] hi"})
        counts = backend.calls()["counts"]
    finally:
        backend.control(fail_next=[])
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert error["server"] == "policy_model" and error["upstream_status"] == 503
    assert "gave up after 4 attempts" in error["message"] and "scripted failure 503" in error["message"]
    assert counts == {"/v1/responses": 4}  # 1 + max_retries (3)


def test_unreachable_endpoint_is_retried_then_a_502(urls: dict[str, str]) -> None:
    resp = post_json(urls["down_model"] + "/v1/responses", {"input": "hi"})
    assert resp.status_code == 502
    message = resp.json()["error"]["message"]
    assert "cannot reach" in message and "gave up after 3 attempts" in message


# -- configuration errors ----------------------------------------------------------------------------------


def test_401_names_the_key_setting_and_never_the_key(urls: dict[str, str]) -> None:
    resp = post_json(urls["bad_key_model"] + "/v1/responses", {"input": "hi"})
    assert resp.status_code == 401
    error = resp.json()["error"]
    assert error["kind"] == "upstream_auth_error" and error["server"] == "bad_key_model"
    assert "openai_api_key" in error["message"] and "policy_api_key" in error["message"]
    assert "Incorrect API key provided: ***" in error["message"]  # the endpoint echoed the key; we cut it out
    assert BAD_KEY not in resp.text and GOOD_KEY not in resp.text
    with openai.OpenAI(
        base_url=urls["bad_key_model"] + "/v1",
        api_key=client_token_for_url(urls["bad_key_model"]),
        max_retries=0,
        timeout=30,
    ) as sdk:
        with pytest.raises(openai.AuthenticationError, match="openai_api_key"):
            sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


def test_404_names_the_url_and_model_settings(urls: dict[str, str]) -> None:
    resp = post_json(urls["bad_model_model"] + "/v1/responses", {"input": "hi"})
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert error["kind"] == "upstream_not_found"
    assert "openai_model" in error["message"] and "'gpt-nope'" in error["message"]
    assert "does not exist" in error["message"]  # the endpoint's own words

    resp = post_json(
        urls["bad_url_model"] + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    )
    assert resp.status_code == 404
    message = resp.json()["error"]["message"]
    assert "openai_base_url" in message and "policy_base_url" in message and "/wrong/v1" in message


def test_the_key_is_in_no_log_and_not_in_the_served_config(helper: Any, log_dir: Path) -> None:
    """Runs after the tests above, whose retries and errors were logged."""
    logs = {p.name: p.read_text() for p in log_dir.glob("*.log")}
    assert {f"{name}.log" for name in INSTANCES} <= set(logs)
    everything = "\n".join(logs.values())
    assert "retry 1/3" in logs["policy_model.log"]  # the logs we read are the ones written
    assert "openai_api_key" in logs["bad_key_model.log"]
    assert GOOD_KEY not in everything and BAD_KEY not in everything
    served = get(helper.head_server_config.base_url + "/global_config_dict_yaml")
    assert served.status_code == 200, served.text
    assert "openai_api_key" in served.text  # the key's setting is there, its value is not
    assert GOOD_KEY not in served.text and BAD_KEY not in served.text


# -- pure helpers ------------------------------------------------------------------------------------------


def test_retry_delay_backoff_and_retry_after() -> None:
    assert [APP.retry_delay(n, 0.5, 3.0, None) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 3.0]
    assert APP.retry_delay(1, 0.5, 3.0, "2") == 2.0
    assert APP.retry_delay(1, 0.5, 3.0, "120") == 3.0  # capped
    assert APP.retry_delay(2, 0.5, 3.0, "Wed, 21 Oct 2015 07:28:00 GMT") == 1.0  # a date: own backoff


def test_config_validation_and_secret() -> None:
    cfg = APP.OpenAIModelConfig.model_validate(
        {
            "name": "m",
            "openai_base_url": "https://api.example.com/v1/",
            "openai_api_key": GOOD_KEY,
            "openai_model": "x",
        }
    )
    assert cfg.openai_base_url == "https://api.example.com/v1"
    assert GOOD_KEY not in repr(cfg) and GOOD_KEY not in str(cfg.model_dump())
    with pytest.raises(ValidationError, match="openai_base_url"):
        APP.OpenAIModelConfig.model_validate(
            {"name": "m", "openai_base_url": "api.example.com", "openai_api_key": "k", "openai_model": "x"}
        )
