"""vllm_model against scripted vLLM-compatible backends (real processes on 127.0.0.1, vLLM's wire format).

One run serves the module:
* backend A answers like vLLM without a reasoning parser (``<think>`` in the content),
  backend B like vLLM with one (``reasoning_content``);
* ``think_model`` -> A and ``parser_model`` -> B (no token ids);
* ``policy_model`` -> [A, B] with ``return_token_id_information: true``, used by the
  ``example_single_tool_call`` simple agent for end-to-end rollouts.
"""

from __future__ import annotations

import copy
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

HERE = Path(__file__).resolve().parent
VLLM_CONFIG = "responses_api_models/vllm_model/configs/vllm_model.yaml"
EXAMPLE_CONFIG = "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml"
AGENT = "example_single_tool_call_simple_agent"
MODEL = "fake-model"
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")

TOOLS = [WEATHER_TOOL]
CHAT_TOOLS = [WEATHER_CHAT_TOOL]


def _load(filename: str) -> ModuleType:
    path = HERE.parent / filename if filename == "app.py" else HERE / filename
    spec = importlib.util.spec_from_file_location(f"vllm_model_test_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves annotations through sys.modules
    spec.loader.exec_module(module)
    return module


FAKE = _load("fake_vllm_backend.py")
APP = _load("app.py")


def _city_scripts() -> dict[str, list[dict[str, Any]]]:
    """For each example row: reason + call get_weather for its city, then reason + answer."""
    scripts = {}
    for row in example_rows("example_single_tool_call"):
        city = row["expected_city"]
        scripts[city] = [
            {
                "reasoning": f"I need the weather in {city}.",
                "tool_calls": [{"name": "get_weather", "arguments": {"city": city}}],
            },
            {"reasoning": "Now I can answer.", "content": weather_report(city)},
        ]
    scripts["[script:fail503]"] = [{"http_error": 503}]
    scripts["[script:fail422]"] = [{"http_error": 422}]
    return scripts


@pytest.fixture(scope="module")
def backends() -> Iterator[tuple[Any, Any]]:
    with (
        FAKE.FakeBackend("A", model=MODEL) as a,
        FAKE.FakeBackend("B", model=MODEL, reasoning_parser=True) as b,
    ):
        for backend in (a, b):
            backend.control(scripts=_city_scripts())
        yield a, b


@pytest.fixture(scope="module")
def helper(backends: tuple[Any, Any]) -> Iterator[Any]:
    a, b = backends

    def single(url: str) -> dict[str, Any]:
        impl = {
            "entrypoint": "app.py",
            "base_url": url,
            "api_key": "EMPTY",
            "model": MODEL,
            "max_retries": 2,
            "backoff_s": 0.01,
        }
        return {"responses_api_models": {"vllm_model": impl}}

    extra = {
        "policy_base_url": [a.url + "/v1", b.url + "/v1"],
        "policy_api_key": "EMPTY",
        "policy_model_name": MODEL,
        "policy_model": {
            "responses_api_models": {"vllm_model": {"return_token_id_information": True, "backoff_s": 0.01}}
        },
        "think_model": single(a.url + "/v1"),
        "parser_model": single(b.url + "/v1"),
    }
    with running_servers([VLLM_CONFIG, EXAMPLE_CONFIG], extra, with_scripted_model=False) as run:
        yield run


@pytest.fixture(scope="module")
def urls(helper: Any) -> dict[str, str]:
    return {name: server_url(helper, name) for name in ("policy_model", "think_model", "parser_model")}


def _chat_requests(
    backends: tuple[Any, ...], marker: str, path: str = "/v1/chat/completions"
) -> list[tuple[str, dict[str, Any]]]:
    """(backend name, body) of every request to ``path`` whose body mentions ``marker``."""
    out = []
    for backend in backends:
        for call in backend.calls()["requests"]:
            if call["path"] == path and marker in json.dumps(call["body"]):
                out.append((backend.name, call["body"]))
    return out


def _strip_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


# -- the official SDK against the servers ----------------------------------------------------------------


@pytest.mark.parametrize("instance", ["think_model", "parser_model"])
def test_sdk_responses_with_tools_and_second_turn(urls: dict[str, str], instance: str) -> None:
    with openai.OpenAI(
        base_url=urls[instance] + "/v1",
        api_key=client_token_for_url(urls[instance]),
        max_retries=0,
        timeout=60,
    ) as client:
        first = client.responses.create(model="ignored", input="[sdk] Weather in Quito?", tools=TOOLS)
        assert isinstance(first, Response)
        assert [type(i) for i in first.output] == [ResponseReasoningItem, ResponseFunctionToolCall]
        assert first.output[0].summary[0].text == "I should call get_weather."
        call = first.output[1]
        assert isinstance(call, ResponseFunctionToolCall)
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "example"}
        assert call.call_id.startswith("chatcmpl-tool-")
        assert first.usage is not None and first.usage.input_tokens > 0 and first.usage.output_tokens > 0

        history: list[Any] = [{"role": "user", "content": "[sdk] Weather in Quito?"}]
        history += [item.model_dump(exclude_none=True) for item in first.output]
        history.append({"type": "function_call_output", "call_id": call.call_id, "output": "sunny"})
        second = client.responses.create(model="ignored", input=history, tools=TOOLS)
        assert [type(i) for i in second.output] == [ResponseReasoningItem, ResponseOutputMessage]
        assert second.output_text == "The tool said: sunny"


@pytest.mark.parametrize("instance", ["think_model", "parser_model"])
def test_sdk_chat_completions_with_tools_is_forwarded(
    urls: dict[str, str], instance: str, backends: tuple[Any, Any]
) -> None:
    with openai.OpenAI(
        base_url=urls[instance] + "/v1",
        api_key=client_token_for_url(urls[instance]),
        max_retries=0,
        timeout=60,
    ) as client:
        completion = client.chat.completions.create(
            model="ignored",
            messages=[{"role": "user", "content": "[chat-sdk] Weather in Cusco?"}],
            tools=CHAT_TOOLS,
        )
    assert isinstance(completion, ChatCompletion)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    assert choice.message.tool_calls[0].function.name == "get_weather"
    sent = _chat_requests(backends, "[chat-sdk]")
    assert sent and all(body["model"] == MODEL for _, body in sent)  # the configured model, not the client's


# -- conversion on the wire ------------------------------------------------------------------------------


def test_request_conversion_as_the_backend_receives_it(
    urls: dict[str, str], backends: tuple[Any, Any]
) -> None:
    params = {
        "model": "whatever",
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use the tool."},
            {"role": "user", "content": [{"type": "input_text", "text": "[wire] Weather in Reykjavik?"}]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [{"type": "summary_text", "text": "Need weather."}],
            },
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city":"Reykjavik"}',
                "status": "completed",
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_output_tokens": 300,
        "temperature": 0.1,
        "top_p": 0.5,
        "seed": 3,
    }
    resp = post_json(urls["think_model"] + "/v1/responses", params)
    assert resp.status_code == 200, resp.text
    sent = _chat_requests(backends, "[wire]")
    assert [name for name, _ in sent] == ["A"]
    assert sent[0][1] == {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Use the tool."},
            {"role": "user", "content": "[wire] Weather in Reykjavik?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "reasoning_content": "Need weather.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Reykjavik"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        "tools": CHAT_TOOLS,
        "tool_choice": "auto",
        "max_tokens": 300,
        "temperature": 0.1,
        "top_p": 0.5,
        "seed": 3,
    }
    body = resp.json()
    Response.model_validate(body, strict=True)
    assert [i["type"] for i in body["output"]] == ["reasoning", "message"]
    assert body["output"][1]["content"][0]["text"] == "The tool said: sunny"
    assert (
        body["temperature"] == 0.1
        and body["max_output_tokens"] == 300
        and body["instructions"] == "Be brief."
    )
    assert all(f not in item for item in body["output"] for f in TOKEN_FIELDS)  # not asked for


def test_think_tags_and_reasoning_content_give_the_same_items(urls: dict[str, str]) -> None:
    body = {"input": "[same] Weather in Bern?", "tools": TOOLS}
    think = post_json(urls["think_model"] + "/v1/responses", body).json()
    parser = post_json(urls["parser_model"] + "/v1/responses", body).json()
    assert _strip_ids(think["output"]) == _strip_ids(parser["output"])
    assert [i["type"] for i in think["output"]] == ["reasoning", "function_call"]
    # ... although the two backends answered differently:
    chat = {"messages": [{"role": "user", "content": "[same-raw] hi"}]}
    raw_a = post_json(urls["think_model"] + "/v1/chat/completions", chat).json()["choices"][0]["message"]
    raw_b = post_json(urls["parser_model"] + "/v1/chat/completions", chat).json()["choices"][0]["message"]
    assert raw_a["content"].startswith("<think>") and raw_a["reasoning_content"] is None
    assert raw_b["reasoning_content"] == "The user said something." and "<think>" not in raw_b["content"]


@pytest.mark.parametrize("instance", ["think_model", "parser_model"])
def test_max_output_tokens_hit_is_an_incomplete_response(urls: dict[str, str], instance: str) -> None:
    resp = post_json(urls[instance] + "/v1/responses", {"input": "[trunc] hello", "max_output_tokens": 10})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    parsed = Response.model_validate(body, strict=True)
    assert parsed.status == "incomplete"
    assert parsed.incomplete_details is not None and parsed.incomplete_details.reason == "max_output_tokens"
    # Cut off while thinking: only (partial) reasoning, no message.
    assert [i["type"] for i in body["output"]] == ["reasoning"]
    assert body["output"][0]["summary"][0]["text"] == "The user"
    assert parsed.usage is not None and parsed.usage.output_tokens == 10


@pytest.mark.parametrize("instance", ["think_model", "policy_model"])
def test_context_overflow_is_an_incomplete_response(urls: dict[str, str], instance: str) -> None:
    for body in (
        {"input": "[overflow] hi", "max_output_tokens": 5000},
        {"input": "[overflow] " + "x" * 3000},
    ):
        resp = post_json(urls[instance] + "/v1/responses", body)
        assert resp.status_code == 200, resp.text
        parsed = Response.model_validate(resp.json(), strict=True)
        assert parsed.status == "incomplete" and parsed.output == []
        assert (
            parsed.incomplete_details is not None and parsed.incomplete_details.reason == "max_output_tokens"
        )


def test_backend_errors_are_retried_then_reported(urls: dict[str, str], backends: tuple[Any, Any]) -> None:
    a, _ = backends
    url = urls["think_model"] + "/v1/responses"
    # A 429 and a 503 that go away: retried, the caller never sees them.
    a.control(fail_next=[429, 503], reset_calls=True)
    resp = post_json(url, {"input": "[retry-once] hi"})
    assert resp.status_code == 200, resp.text
    assert a.calls()["counts"]["/v1/chat/completions"] == 3
    # A 503 that stays: max_retries (2) retries, then a 502 naming the backend.
    a.control(reset_calls=True)
    resp = post_json(url, {"input": "[script:fail503] hi"})
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert error["server"] == "think_model" and error["backend_status"] == 503 and a.url in error["backend"]
    assert "scripted HTTP 503" in error["message"]
    assert a.calls()["counts"]["/v1/chat/completions"] == 3
    # A 4xx is not retried and keeps its status.
    a.control(reset_calls=True)
    resp = post_json(url, {"input": "[script:fail422] hi"})
    assert resp.status_code == 422 and "scripted HTTP 422" in resp.json()["error"]["message"]
    assert a.calls()["counts"]["/v1/chat/completions"] == 1


def test_items_without_a_chat_equivalent_are_a_400(urls: dict[str, str]) -> None:
    resp = post_json(
        urls["think_model"] + "/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]}
    )
    assert resp.status_code == 400
    assert "web_search" in resp.json()["error"]["message"]
    resp = post_json(
        urls["think_model"] + "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"},  # stream: true is relayed
    )
    assert resp.status_code == 400 and "`stream`" in resp.json()["error"]["message"]


# -- token ids ---------------------------------------------------------------------------------------------


def test_token_ids_of_one_call(urls: dict[str, str], backends: tuple[Any, Any]) -> None:
    user = "[ids-one] Weather in Accra?"
    resp = post_json(urls["policy_model"] + "/v1/responses", {"input": user, "tools": TOOLS})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    Response.model_validate(body, strict=True)
    first, last = body["output"]
    assert first["type"] == "reasoning" and all(f not in first for f in TOKEN_FIELDS)
    assert last["type"] == "function_call"

    sent = _chat_requests(backends, "[ids-one]")
    assert len(sent) == 1
    chat = sent[0][1]
    assert (
        chat["logprobs"] is True and chat["top_logprobs"] == 0 and chat["return_tokens_as_token_ids"] is True
    )
    tokenized = _chat_requests(backends, "[ids-one]", path="/tokenize")
    assert [name for name, _ in tokenized] == [sent[0][0]]  # same backend
    assert (
        tokenized[0][1]["messages"] == chat["messages"] and tokenized[0][1]["add_generation_prompt"] is True
    )

    expected_prompt = FAKE.tokenize(FAKE.render([{"role": "user", "content": user}], CHAT_TOOLS, True))
    assert last["prompt_token_ids"] == expected_prompt
    generated = FAKE.decode(last["generation_token_ids"], skip_special_tokens=False)
    assert generated == FAKE.generation_text(
        {
            "reasoning": "I should call get_weather.",
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "example"}}],
        }
    )
    assert last["generation_log_probs"] == [
        FAKE.logprob_of(t, i) for i, t in enumerate(last["generation_token_ids"])
    ]
    assert body["usage"]["input_tokens"] == len(expected_prompt)
    assert body["usage"]["output_tokens"] == len(last["generation_token_ids"])


def _rollout(helper: Any, row: dict[str, Any]) -> dict[str, Any]:
    return run_rollout(helper, AGENT, row, timeout=120)


def test_multi_turn_rollout_token_ids_end_to_end(helper: Any, backends: tuple[Any, Any]) -> None:
    row = copy.deepcopy(example_rows("example_single_tool_call")[0])
    city = row["expected_city"]
    row["responses_create_params"]["input"][-1]["content"] += " [e2e-ids]"
    result = _rollout(helper, row)
    assert result["reward"] == 1.0 and result["expected_city"] == city
    output = result["response"]["output"]
    assert [i["type"] for i in output] == [
        "reasoning",
        "function_call",
        "function_call_output",
        "reasoning",
        "message",
    ]
    carrying = [i for i, item in enumerate(output) if "prompt_token_ids" in item]
    assert carrying == [1, 4]  # the last item of each model call, and only those
    turn1, turn2 = output[1], output[4]
    for item in (turn1, turn2):
        assert all(isinstance(item[f], list) and item[f] for f in TOKEN_FIELDS)
        assert len(item["generation_token_ids"]) == len(item["generation_log_probs"])
    p1, g1, p2 = turn1["prompt_token_ids"], turn1["generation_token_ids"], turn2["prompt_token_ids"]
    assert p2[: len(p1)] == p1  # turn 2 starts with turn 1's prompt ...
    assert p2[: len(p1) + len(g1)] == p1 + g1  # ... followed by exactly the tokens turn 1 generated
    assert (
        FAKE.decode(turn2["generation_token_ids"])
        == f"<think>\nNow I can answer.\n</think>\n\n{weather_report(city)}"
    )

    # Turn 1's ids were sent back on its assistant message, and the whole rollout used one backend.
    sent = _chat_requests(backends, "[e2e-ids]")
    assert len(sent) == 2 and sent[0][0] == sent[1][0]
    replayed = [m for m in sent[1][1]["messages"] if m["role"] == "assistant"]
    assert replayed[0]["prompt_token_ids"] == p1 and replayed[0]["generation_token_ids"] == g1
    assert "generation_log_probs" not in replayed[0]


def test_without_id_replay_the_prompt_would_not_extend_the_generation(
    helper: Any, backends: tuple[Any, Any]
) -> None:
    """Shows the replay matters: a backend that ignores the ids re-renders turn 1 without its reasoning."""
    row = copy.deepcopy(example_rows("example_single_tool_call")[1])
    row["responses_create_params"]["input"][-1]["content"] += " [e2e-stock]"
    for backend in backends:
        backend.control(honor_token_ids=False)
    try:
        output = _rollout(helper, row)["response"]["output"]
    finally:
        for backend in backends:
            backend.control(honor_token_ids=True)
    p1, g1, p2 = (
        output[1]["prompt_token_ids"],
        output[1]["generation_token_ids"],
        output[4]["prompt_token_ids"],
    )
    assert p2[: len(p1)] == p1
    assert p2[: len(p1) + len(g1)] != p1 + g1


def test_overflowing_rollout_ends_cleanly(helper: Any) -> None:
    row = copy.deepcopy(example_rows("example_single_tool_call")[2])
    row["responses_create_params"]["input"][-1]["content"] += " [e2e-overflow] " + "y" * 3000
    result = _rollout(helper, row)
    assert result["reward"] == 0.0
    assert result["response"]["status"] == "incomplete" and result["response"]["output"] == []


def test_rollouts_stick_to_one_backend(helper: Any, backends: tuple[Any, Any]) -> None:
    rows = example_rows("example_single_tool_call")
    for i, row in enumerate(rows):
        row = copy.deepcopy(row)
        row["responses_create_params"]["input"][-1]["content"] += f" [sticky-{i}]"
        assert _rollout(helper, row)["reward"] == 1.0
    for i in range(len(rows)):
        sent = _chat_requests(backends, f"[sticky-{i}]")
        assert len(sent) == 2, sent
        assert len({name for name, _ in sent}) == 1
        assert {name for name, _ in _chat_requests(backends, f"[sticky-{i}]", path="/tokenize")} == {
            sent[0][0]
        }


# -- pure helpers ------------------------------------------------------------------------------------------


def test_pick_backend_is_stable_and_spreads() -> None:
    urls = ["http://a/v1", "http://b/v1", "http://c/v1"]
    picks = [APP.pick_backend(urls, f"session-{i}") for i in range(300)]
    assert picks == [APP.pick_backend(urls, f"session-{i}") for i in range(300)]
    assert all(picks.count(u) > 50 for u in urls)  # 100 expected each
    assert APP.pick_backend(["http://only/v1"], "anything") == "http://only/v1"


def test_context_overflow_detection() -> None:
    classic = {
        "object": "error",
        "message": "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (4000 in the messages, 1000 in the completion).",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    nested = {
        "error": {
            "message": "'max_tokens' or 'max_completion_tokens' is too large: 1000. This model's maximum context length is 4096 tokens and your request has 3500 input tokens",
            "type": "BadRequestError",
            "code": 400,
        }
    }
    decoder = {
        "error": {
            "message": "The decoder prompt (length 5000) is longer than the maximum model length of 4096.",
            "code": 400,
        }
    }
    for body in (classic, nested, decoder):
        assert APP.is_context_overflow(400, body)
    assert not APP.is_context_overflow(
        400, {"object": "error", "message": "tool_choice is invalid", "code": 400}
    )
    assert not APP.is_context_overflow(500, classic)


def test_logprob_tokens_must_be_token_ids() -> None:
    choice = {
        "logprobs": {
            "content": [{"token": "token_id:42", "logprob": -0.5}, {"token": "token_id:7", "logprob": -1.0}]
        }
    }
    assert APP.generation_ids_and_log_probs(choice) == ([42, 7], [-0.5, -1.0])
    with pytest.raises(ValueError, match="return_tokens_as_token_ids"):
        APP.generation_ids_and_log_probs({"logprobs": {"content": [{"token": "Hello", "logprob": -0.1}]}})


def test_config_base_url_forms() -> None:
    cfg = APP.VLLMModelConfig.model_validate(
        {"name": "m", "base_url": "http://a:8000/v1/, http://b:8000/v1", "model": "x"}
    )
    assert cfg.base_url == ["http://a:8000/v1", "http://b:8000/v1"]
    assert APP.server_root(cfg.base_url[0]) == "http://a:8000"
    assert "EMPTY" not in repr(cfg)
    with pytest.raises(ValidationError, match="http"):
        APP.VLLMModelConfig.model_validate({"name": "m", "base_url": "a:8000", "model": "x"})
    with pytest.raises(ValidationError, match="base_url"):
        APP.VLLMModelConfig.model_validate({"name": "m", "base_url": [], "model": "x"})
