"""Exact token ids for clients that resend plain history (agent harnesses; nemo_gym.server.rollout_tokens), and
token ids on vllm_model's streamed answers: real servers on 127.0.0.1, the official ``openai`` SDK.

* vllm_model against the repo's fake vLLM backend with a reasoning parser: its chat template drops earlier
  turns' reasoning (as Qwen3's does), so a conversation resent as text re-tokenises differently from what
  the model generated. Under a rollout prefix the server puts the remembered ids back on the resent
  answer, and call 2's prompt ids start with call 1's prompt + generated ids; without a prefix they do not.
* local_model with the real GGUF on CPU: the same guarantee, asserted on structure only (ids, counts,
  samples), never on the words the model chooses.
* Either way, the recorded calls merge into one training sample, and a rewritten history starts a new,
  marked one.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import openai
import pytest

from nemo_gym.auth import client_token_for_url
from nemo_gym.kit.harness_trajectory import call_tokens, merge_samples
from nemo_gym.server.rollout_tokens import RolloutTokenMemory, answer_key
from nemo_gym.tools.testing import (
    WEATHER_CHAT_TOOL,
    WEATHER_TOOL,
    get,
    post_json,
    running_servers,
    server_url,
)
from responses_api_models.local_model import weights

ROOT = Path(__file__).resolve().parents[1]
VLLM_CONFIG = "responses_api_models/vllm_model/configs/vllm_model.yaml"
LOCAL_CONFIG = "responses_api_models/local_model/configs/local_model.yaml"
MODEL = "fake-model"
WAIT_S = 120.0
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def _load_fake() -> ModuleType:
    path = ROOT / "responses_api_models/vllm_model/tests/fake_vllm_backend.py"
    spec = importlib.util.spec_from_file_location("harness_tokens_fake_vllm_backend", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url + "/v1", api_key=client_token_for_url(url), max_retries=0, timeout=WAIT_S
    )


def _ids(message: Any) -> dict[str, Any]:
    extra = getattr(message, "model_extra", None) or {}
    return {k: extra.get(k) for k in TOKEN_FIELDS}


def _plain(message: Any) -> dict[str, Any]:
    """What a harness keeps of an answer and sends back: role, text, tool calls (no ids)."""
    return message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})


def _pop(url: str, rollout_id: str) -> list[dict[str, Any]]:
    answer = post_json(url + "/ng_model_calls/pop", {"rollout_ids": [rollout_id]}).json()
    return answer["calls"].get(rollout_id, [])


def _extends(later: list[int], earlier: dict[str, Any]) -> bool:
    prefix = earlier["prompt_token_ids"] + earlier["generation_token_ids"]
    return later[: len(prefix)] == prefix


def _two_calls(
    client: openai.OpenAI, user: str, **kwargs: Any
) -> tuple[dict[str, Any], dict[str, Any], list]:
    """A harness's first two calls: the model's tool call, then its result with the answer resent as text."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": user}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_CHAT_TOOL], **kwargs
    )
    message = first.choices[0].message
    assert message.tool_calls, message
    messages.append(_plain(message))
    messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny, 21 C"})
    kwargs.pop("tool_choice", None)
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_CHAT_TOOL], **kwargs
    )
    return _ids(message), _ids(second.choices[0].message), messages


# -- vllm_model against the fake backend ---------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm() -> Iterator[dict[str, Any]]:
    fake = _load_fake()
    with fake.FakeBackend("harness", model=MODEL, reasoning_parser=True) as backend:
        extra = {
            "observability_enabled": True,
            "policy_base_url": backend.url + "/v1",
            "policy_api_key": "EMPTY",
            "policy_model_name": MODEL,
            "policy_model": {"responses_api_models": {"vllm_model": {"return_token_id_information": True}}},
        }
        with running_servers([VLLM_CONFIG], extra, with_scripted_model=False) as helper:
            yield {"url": server_url(helper, "policy_model"), "backend": backend}


def test_vllm_a_resent_answer_gets_its_exact_ids_back_and_one_sample(vllm: dict[str, Any]) -> None:
    url, rollout = vllm["url"], "harness-vllm-1"
    with _client(f"{url}/ng-rollout/{rollout}") as client:
        first, second, messages = _two_calls(client, "Weather in Paris? [h1]")
        assert all(first[k] for k in TOKEN_FIELDS) and all(second[k] for k in TOKEN_FIELDS)
        assert _extends(second["prompt_token_ids"], first)
        # The backend was sent the ids on the resent answer (as NeMo RL's vLLM server reads them).
        sent = [r["body"] for r in vllm["backend"].calls()["requests"] if "[h1]" in str(r["body"])]
        replayed = [m for m in sent[1]["messages"] if m["role"] == "assistant"]
        assert replayed[0]["prompt_token_ids"] == first["prompt_token_ids"]
        assert replayed[0]["generation_token_ids"] == first["generation_token_ids"]
        # A harness that rewrote its history (dropped the tool turn, summarised it): no ids to reuse.
        rewritten = [messages[0], {"role": "user", "content": "Summary: the tool said sunny. Answer now."}]
        client.chat.completions.create(model=MODEL, messages=rewritten)
    # Without a rollout prefix nothing is remembered: the fake's template drops the reasoning of the
    # resent turn, so the re-tokenised prompt does not extend what the model generated.
    with _client(url) as client:
        plain_first, plain_second, _ = _two_calls(client, "Weather in Paris? [h1-plain]")
    assert not _extends(plain_second["prompt_token_ids"], plain_first)

    calls = _pop(url, rollout)
    out = merge_samples(calls)
    assert out["calls_without_token_ids"] == []
    merged, fresh = out["samples"]
    assert merged["call_indices"] == [0, 1] and merged["rewrote_history"] is False
    assert merged["token_ids"] == second["prompt_token_ids"] + second["generation_token_ids"]
    assert sum(merged["loss_mask"]) == len(first["generation_token_ids"]) + len(
        second["generation_token_ids"]
    )
    assert fresh["call_indices"] == [2] and fresh["rewrote_history"] is True


def test_vllm_responses_api_harness_extends_too(vllm: dict[str, Any]) -> None:
    """The same through /v1/responses (and so /v1/messages): the output items resent without their ids."""
    url, rollout = vllm["url"], "harness-vllm-resp"
    with _client(f"{url}/ng-rollout/{rollout}") as client:
        items: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Rome? [h2]"}]
        first = client.responses.create(model=MODEL, input=items, tools=[WEATHER_TOOL])
        ids1 = _ids(first.output[-1])
        call = next(i for i in first.output if i.type == "function_call")
        items += [i.model_dump(exclude_none=True, exclude=set(TOKEN_FIELDS)) for i in first.output]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "rain"})
        second = client.responses.create(model=MODEL, input=items, tools=[WEATHER_TOOL])
    assert _extends(_ids(second.output[-1])["prompt_token_ids"], ids1)
    [sample] = merge_samples(_pop(url, rollout))["samples"]
    assert sample["call_indices"] == [0, 1]


def test_vllm_messages_api_harness_extends_too(vllm: dict[str, Any]) -> None:
    """An ``anthropic`` SDK harness (as examples/harnesses/anthropic_agent.py): content blocks resent as given."""
    import anthropic

    url, rollout = vllm["url"], "harness-vllm-messages"
    tool = {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    base = f"{url}/ng-rollout/{rollout}"
    with anthropic.Anthropic(
        base_url=base, api_key=client_token_for_url(url), max_retries=0, timeout=WAIT_S
    ) as client:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Bern? [h6]"}]
        first = client.messages.create(model=MODEL, max_tokens=200, messages=messages, tools=[tool])
        use = next(b for b in first.content if b.type == "tool_use")
        messages.append(
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]}
        )
        messages.append(
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "fog"}]}
        )
        second = client.messages.create(model=MODEL, max_tokens=200, messages=messages, tools=[tool])
    ids1, ids2 = _ids(first), _ids(second)
    assert all(ids1[k] for k in TOKEN_FIELDS) and _extends(ids2["prompt_token_ids"], ids1)
    [sample] = merge_samples(_pop(url, rollout))["samples"]
    assert sample["call_indices"] == [0, 1] and sample["rewrote_history"] is False


def test_vllm_streamed_chat_carries_the_plain_answers_ids(vllm: dict[str, Any]) -> None:
    url, rollout = vllm["url"], "harness-vllm-stream"
    body = {"messages": [{"role": "user", "content": "Weather in Oslo? [h3]"}], "tools": [WEATHER_CHAT_TOOL]}
    with _client(url) as client:
        plain = _ids(client.chat.completions.create(model=MODEL, **body).choices[0].message)
    with _client(f"{url}/ng-rollout/{rollout}") as client:
        chunks = list(
            client.chat.completions.create(
                model=MODEL, stream=True, stream_options={"include_usage": True}, **body
            )
        )
        with client.chat.completions.stream(model=MODEL, **body) as stream:
            for _ in stream:
                pass
            assembled = stream.get_final_completion()
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and _ids(finishing[0].choices[0].delta) == plain
    # Only the server asked for log-probs and vLLM's raw ids: the client sees neither on the chunks.
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)
    assert all("token_ids" not in (c.choices[0].model_extra or {}) for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert assembled.choices[0].message.tool_calls
    calls = _pop(url, rollout)  # the recorded streams carry the same ids
    assert len(calls) == 2
    for call in calls:
        tokens = call_tokens(call)
        assert tokens is not None and tokens.prompt_ids == plain["prompt_token_ids"]
        assert (
            tokens.generation_ids == plain["generation_token_ids"]
            and tokens.log_probs == plain["generation_log_probs"]
        )


def test_vllm_streamed_responses_carry_the_plain_answers_ids(vllm: dict[str, Any]) -> None:
    url, rollout = vllm["url"], "harness-vllm-rstream"
    params = {"input": "Weather in Lima? [h4]", "tools": [WEATHER_TOOL]}
    with _client(url) as client:
        plain = _ids(client.responses.create(model=MODEL, **params).output[-1])
    with _client(f"{url}/ng-rollout/{rollout}") as client:
        with client.responses.stream(model=MODEL, **params) as stream:
            kinds = [e.type for e in stream]
            final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and _ids(final.output[-1]) == plain
    [call] = _pop(url, rollout)
    tokens = call_tokens(call)
    assert tokens is not None and tokens.prompt_ids == plain["prompt_token_ids"]


def test_vllm_streamed_harness_calls_extend_each_other(vllm: dict[str, Any]) -> None:
    """A harness that streams (the SDK's helper assembles each answer) and resends the text: one sample."""
    url, rollout = vllm["url"], "harness-vllm-both"
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Kyiv? [h5]"}]
    finals = []
    with _client(f"{url}/ng-rollout/{rollout}") as client:
        for _ in range(2):
            with client.chat.completions.stream(
                model=MODEL, messages=messages, tools=[WEATHER_CHAT_TOOL]
            ) as s:
                for _event in s:
                    pass
                message = s.get_final_completion().choices[0].message
            finals.append(message)
            messages.append(_plain(message))
            if message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "snow"})
    [sample] = merge_samples(_pop(url, rollout))["samples"]
    assert sample["call_indices"] == [0, 1] and sample["rewrote_history"] is False


def test_vllm_a_backend_without_token_ids_is_an_error_not_an_answer_without_them(
    vllm: dict[str, Any],
) -> None:
    """A vLLM older than 0.10.2 ignores return_token_ids: the call says so (plain: a 502; streamed: the
    stream's error event), rather than giving a trainer an answer silently without ids."""
    url, backend = vllm["url"], vllm["backend"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi [h7]"}]}
    backend.control(return_token_ids=False)
    try:
        plain = post_json(url + "/v1/chat/completions", body, timeout=WAIT_S)
        streamed = post_json(url + "/v1/chat/completions", {**body, "stream": True}, timeout=WAIT_S)
        responses = post_json(url + "/v1/responses", {"input": "hi [h7]", "stream": True}, timeout=WAIT_S)
    finally:
        backend.control(return_token_ids=True)
    assert plain.status_code == 502 and "return_token_ids" in plain.text, plain.text
    assert streamed.status_code == 200 and '"error"' in streamed.text and "return_token_ids" in streamed.text
    assert "generation_token_ids" not in streamed.text
    assert (
        responses.status_code == 200
        and "event: error" in responses.text
        and "return_token_ids" in responses.text
    )


# -- local_model: the real GGUF on CPU -------------------------------------------------------------------

needs_local_model = pytest.mark.skipif(
    weights.default_model_unavailable() is not None,
    reason=f"needs the default local model: {weights.default_model_unavailable()}",
)
FORCED = {"type": "function", "function": {"name": "get_weather"}}  # a call on every CPU (a grammar)


@pytest.fixture(scope="module")
def local_url() -> Iterator[str]:
    extra = {
        "observability_enabled": True,
        "policy_model": {"responses_api_models": {"local_model": {"return_token_id_information": True}}},
    }
    with running_servers([LOCAL_CONFIG], extra, with_scripted_model=False) as helper:
        yield server_url(helper, "policy_model")


@needs_local_model
def test_local_model_a_resent_answer_gets_its_exact_ids_back_and_one_sample(local_url: str) -> None:
    url, rollout = local_url, "harness-local-1"
    with _client(f"{url}/ng-rollout/{rollout}") as client:
        first, second, messages = _two_calls(
            client, "What's the weather in Paris?", tool_choice=FORCED, max_tokens=96, temperature=0
        )
        rewritten = [messages[0], {"role": "user", "content": "It is sunny. Say so."}]
        client.chat.completions.create(model=MODEL, messages=rewritten, max_tokens=8, temperature=0)
    stats = get(url + "/stats").json()["rollout_tokens"]
    calls = _pop(url, rollout)
    assert all(first[k] for k in TOKEN_FIELDS) and all(second[k] for k in TOKEN_FIELDS)
    assert _extends(second["prompt_token_ids"], first)
    assert stats["reused"] >= 1
    out = merge_samples(calls)
    merged, fresh = out["samples"]
    assert merged["call_indices"] == [0, 1] and merged["rewrote_history"] is False
    assert merged["token_ids"] == second["prompt_token_ids"] + second["generation_token_ids"]
    assert fresh["call_indices"] == [2] and fresh["rewrote_history"] is True
    assert get(url + "/stats").json()["rollout_tokens"]["rollouts"] == 0  # forgotten with the pop


@needs_local_model
def test_local_model_streamed_harness_calls_extend_each_other(local_url: str) -> None:
    """Streamed calls (ids on the finishing chunk) are remembered and reused the same way."""
    url, rollout = local_url, "harness-local-stream"

    def streamed(client: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> tuple[dict, dict]:
        text, calls, ids = "", {}, {}
        for chunk in client.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER_CHAT_TOOL], stream=True, temperature=0, **kwargs
        ):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                for call in choice.delta.tool_calls or []:
                    seen = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
                    seen["name"] += (call.function.name or "") if call.function else ""
                    seen["arguments"] += (call.function.arguments or "") if call.function else ""
                if choice.finish_reason:
                    ids = _ids(choice.delta)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls.values()
            ]
        return message, ids

    messages: list[dict[str, Any]] = [{"role": "user", "content": "What's the weather in Oslo?"}]
    with _client(f"{url}/ng-rollout/{rollout}") as client:
        answer, first = streamed(client, messages, tool_choice=FORCED, max_tokens=96)
        assert answer.get("tool_calls"), answer
        messages += [
            answer,
            {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": "snow"},
        ]
        _, second = streamed(client, messages, max_tokens=16)
    assert all(first[k] for k in TOKEN_FIELDS) and _extends(second["prompt_token_ids"], first)
    [sample] = merge_samples(_pop(url, rollout))["samples"]
    assert sample["call_indices"] == [0, 1] and sample["rewrote_history"] is False


# -- the memory itself -----------------------------------------------------------------------------------


def _conversation(answer: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "q"}, answer, {"role": "tool", "tool_call_id": "c1", "content": "r"}]


def test_memory_matches_the_answer_and_the_history_only() -> None:
    memory = RolloutTokenMemory()
    answer = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"a": 1, "b": 2}'}}],
    }
    memory.remember("r", [{"role": "user", "content": "q"}], None, answer, [1, 2], [3, 4])
    # The harness resends it with other spacing in the arguments, reasoning and no content: still a match.
    resent = {
        "role": "assistant",
        "content": "",
        "reasoning_content": "dropped or not",
        "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": {"b": 2, "a": 1}}}],
    }
    attached = memory.attach("r", _conversation(resent), None)
    assert attached[1]["prompt_token_ids"] == [1, 2] and attached[1]["generation_token_ids"] == [3, 4]
    assert "prompt_token_ids" not in resent  # a copy
    # Another rollout, other tools, an edited answer or an edited history: nothing attached.
    assert memory.attach("other", _conversation(resent), None) == _conversation(resent)
    assert "prompt_token_ids" not in memory.attach("r", _conversation(resent), [{"type": "function"}])[1]
    edited = {**resent, "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 9}'}}]}
    assert "prompt_token_ids" not in memory.attach("r", _conversation(edited), None)[1]
    history = [{"role": "user", "content": "q, rephrased"}, resent]
    assert "prompt_token_ids" not in memory.attach("r", history, None)[1]
    assert answer_key(answer) == answer_key(resent)


def test_memory_is_bounded_and_forgets_with_the_pop() -> None:
    memory = RolloutTokenMemory(max_rollouts=2, max_calls_per_rollout=2, max_tokens=100)
    user = [{"role": "user", "content": "q"}]
    for i in range(3):
        memory.remember("a", user, None, {"role": "assistant", "content": str(i)}, [1] * 10, [2] * 10)
    assert memory.stats()["calls"] == 2 and memory.tokens == 40  # per rollout: the newest two
    memory.remember("b", user, None, {"role": "assistant", "content": "x"}, [1] * 10, [2] * 10)
    memory.remember("c", user, None, {"role": "assistant", "content": "y"}, [1] * 10, [2] * 10)
    assert (
        memory.stats()["rollouts"] == 2
        and memory.match("a", [*user, {"role": "assistant", "content": "2"}], None) is None
    )
    memory.remember("c", user, None, {"role": "assistant", "content": "z"}, [1] * 40, [2] * 40)
    assert memory.tokens <= 100  # the token bound evicts least recently used rollouts first
    memory.forget(["b", "c"])
    assert memory.stats() == {"rollouts": 0, "calls": 0, "tokens": 0, "reused": 0}
