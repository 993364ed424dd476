"""local_model over real HTTP with the real model: token ids, the official SDK, tool calls, limits.

Nothing here depends on what the model chooses: greedy decoding of a small model differs between
CPUs (their SIMD paths round differently), so a test that leaned on "the model calls get_weather for
Paris" passed on one machine and failed on another. The tests assert what the server guarantees:
exact token ids, valid shapes, a parsed call whenever a call is *forced* (``tool_choice``: the server
then decodes under a grammar built from the tool's schema), limits and errors.

To catch a test that leans on one machine's arithmetic anyway, the whole module runs twice: with
``n_batch: 512`` and with ``n_batch: 8``, which evaluates prompts in other batch shapes and so
changes the logits' rounding on any one machine (measured: the first log-prob moves from -0.1365 to
-0.1440). Generations are short (a few dozen tokens, temperature 0). ``policy_model`` (token ids on)
runs once per variant; ``busy_model`` (``max_queue: 0``), for the queue bound, which no rounding can
change, runs once for the module.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import Response, ResponseFunctionToolCall, ResponseOutputMessage

from nemo_gym.auth import client_token_for_url
from nemo_gym.tools.testing import (
    WEATHER_CHAT_TOOL,
    WEATHER_TOOL,
    get,
    post_json,
    running_servers,
    server_url,
)
from responses_api_models.local_model import weights

pytestmark = pytest.mark.skipif(
    weights.default_model_unavailable() is not None,
    reason=f"needs the default local model: {weights.default_model_unavailable()}",
)

CONFIG = "responses_api_models/local_model/configs/local_model.yaml"
WAIT_S = 120.0  # bound on every wait in this module (never a speed check)

TOOLS = [WEATHER_TOOL]
CHAT_TOOLS = [WEATHER_CHAT_TOOL]
SYSTEM = "You are a helpful assistant. Use the get_weather tool to look up the weather before answering."
WEATHER_INPUT = [
    {"role": "developer", "content": SYSTEM},
    {"role": "user", "content": "What's the weather like in Paris right now?"},
]

# A tool whose one argument must be at least 1,200 characters: forcing a call to it makes a generation
# that is guaranteed to be long (for the queue test), whatever the model would prefer.
ESSAY_TOOL = {
    "type": "function",
    "name": "write_essay",
    "description": "Write an essay.",
    "parameters": {
        "type": "object",
        "properties": {"text": {"type": "string", "minLength": 1200}},
        "required": ["text"],
        "additionalProperties": False,
    },
}
ARGUMENT_VARIANTS = {"n_batch_512": 512, "n_batch_8": 8}


@pytest.fixture(scope="module", params=sorted(ARGUMENT_VARIANTS))
def urls(request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    n_batch = ARGUMENT_VARIANTS[request.param]
    extra = {
        "policy_model": {
            "responses_api_models": {"local_model": {"return_token_id_information": True, "n_batch": n_batch}}
        }
    }
    with running_servers([CONFIG], extra, with_scripted_model=False) as helper:
        yield {"policy_model": server_url(helper, "policy_model")}


@pytest.fixture(scope="module")
def busy_url() -> Iterator[str]:
    """A local model that takes one request at a time (``max_queue: 0``): its name in the config is
    ``busy_model``, which the 503 names."""
    extra = {
        "busy_model": {"responses_api_models": {"local_model": {"entrypoint": "app.py", "max_queue": 0}}}
    }
    with running_servers([], extra, with_scripted_model=False) as helper:
        yield server_url(helper, "busy_model")


def _schema_valid_weather_args(arguments: str) -> None:
    """The arguments of a forced get_weather call: exactly {"city": <string>}, as its schema says."""
    args = json.loads(arguments)
    assert isinstance(args, dict) and set(args) == {"city"} and isinstance(args["city"], str), arguments


@pytest.fixture(scope="module")
def vocab() -> Any:
    """The tokenizer alone, loaded in this test process (independent of the server)."""
    from llama_cpp import Llama

    return Llama(model_path=str(weights.default_weights_path()), vocab_only=True, verbose=False)


@pytest.fixture
def client(urls: dict[str, str]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=urls["policy_model"] + "/v1",
        api_key=client_token_for_url(urls["policy_model"]),
        max_retries=0,
        timeout=WAIT_S,
    ) as c:
        yield c


# -- exact token information ---------------------------------------------------------------------------


def test_token_ids_detokenise_to_the_text_and_the_prompt(urls: dict[str, str], vocab: Any) -> None:
    body = {"input": "Say hello to Ada in one short sentence.", "temperature": 0, "max_output_tokens": 32}
    resp = post_json(urls["policy_model"] + "/v1/responses", body, timeout=WAIT_S)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    last = data["output"][-1]
    assert last["type"] == "message"
    prompt_ids, gen_ids, logprobs = (
        last["prompt_token_ids"],
        last["generation_token_ids"],
        last["generation_log_probs"],
    )
    text = last["content"][0]["text"]
    assert gen_ids  # at least the end-of-turn token
    # The generated ids are exactly the text (the end-of-turn token renders as nothing).
    assert vocab.detokenize(gen_ids).decode() == text
    assert len(logprobs) == len(gen_ids) and all(math.isfinite(lp) and lp <= 0 for lp in logprobs)
    # The prompt ids are the GGUF chat template's rendering of the conversation, tokenised once.
    prompt = vocab.detokenize(prompt_ids, special=True).decode()
    assert "Say hello to Ada in one short sentence." in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert vocab.tokenize(prompt.encode(), add_bos=False, special=True) == prompt_ids
    assert data["usage"]["input_tokens"] == len(prompt_ids) and data["usage"]["output_tokens"] == len(gen_ids)
    if data["status"] == "completed":  # ended by the model: the last id is its end-of-turn token
        assert vocab.detokenize(gen_ids[-1:], special=True).decode() in ("<|im_end|>", "<|endoftext|>")


def test_token_ids_ride_on_the_tool_call_item(urls: dict[str, str], vocab: Any) -> None:
    body = {
        "input": WEATHER_INPUT,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,  # exactly one call: the model cannot choose to add more
        "temperature": 0,
        "max_output_tokens": 128,
    }
    data = post_json(urls["policy_model"] + "/v1/responses", body, timeout=WAIT_S).json()
    assert data["status"] == "completed", data
    calls = [i for i in data["output"] if i["type"] == "function_call"]
    assert calls and all(c["name"] == "get_weather" for c in calls), data["output"]
    for call in calls:
        _schema_valid_weather_args(call["arguments"])
    last = data["output"][-1]
    assert all(k in last for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs"))
    # The ids are the forced call as the model wrote it, tags and all, then its end-of-turn token.
    generated = vocab.detokenize(last["generation_token_ids"], special=True).decode()
    assert generated.startswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert generated.endswith("</tool_call><|im_end|>")
    # The tools are in the prompt, as the template puts them.
    prompt = vocab.detokenize(last["prompt_token_ids"], special=True).decode()
    assert '"name": "get_weather"' in prompt and SYSTEM in prompt


def test_turn_two_prompt_extends_turn_one_exactly(urls: dict[str, str], vocab: Any) -> None:
    """RL on multi-turn rollouts needs turn 2's prompt to be turn 1's prompt + generation, token for token."""
    url = urls["policy_model"] + "/v1/responses"
    forced = {"type": "function", "name": "get_weather"}  # a call on every machine (grammar-constrained)
    first = post_json(
        url,
        {
            "input": WEATHER_INPUT,
            "tools": TOOLS,
            "tool_choice": forced,
            "temperature": 0,
            "max_output_tokens": 128,
        },
        timeout=WAIT_S,
    )
    assert first.status_code == 200 and first.json()["status"] == "completed", first.text
    turn1 = first.json()["output"]
    call = next(i for i in turn1 if i["type"] == "function_call")
    carrier = turn1[-1]
    result = {
        "type": "function_call_output",
        "call_id": call["call_id"],
        "output": '{"city": "Paris", "weather": "sunny, 21 C"}',
    }
    second = post_json(
        url,
        {
            "input": WEATHER_INPUT + turn1 + [result],
            "tools": TOOLS,
            "temperature": 0,
            "max_output_tokens": 32,
        },
        timeout=WAIT_S,
    )
    assert second.status_code == 200, second.text
    prompt2 = second.json()["output"][-1]["prompt_token_ids"]
    prefix = carrier["prompt_token_ids"] + carrier["generation_token_ids"]
    assert prompt2[: len(prefix)] == prefix
    # What follows is the template's rendering of the tool result and the next assistant header.
    rest = vocab.detokenize(prompt2[len(prefix) :], special=True).decode()
    assert "sunny, 21 C" in rest and rest.endswith("<|im_start|>assistant\n")
    # Without the ids (a client that strips them) the prompt is simply re-rendered and still valid.
    stripped = [
        {
            k: v
            for k, v in i.items()
            if k not in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
        }
        for i in turn1
    ]
    third = post_json(
        url,
        {
            "input": WEATHER_INPUT + stripped + [result],
            "tools": TOOLS,
            "temperature": 0,
            "max_output_tokens": 8,
        },
        timeout=WAIT_S,
    )
    fresh = third.json()["output"][-1]["prompt_token_ids"]
    assert fresh[: len(carrier["prompt_token_ids"])] == carrier["prompt_token_ids"]
    assert vocab.tokenize(vocab.detokenize(fresh, special=True), add_bos=False, special=True) == fresh


# -- the official SDK ------------------------------------------------------------------------------------


def test_sdk_responses_tool_call_then_answer(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="local",
        input=WEATHER_INPUT,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},  # exactly one call, on any CPU
        temperature=0,
        max_output_tokens=128,
    )
    assert isinstance(first, Response) and first.status == "completed"
    calls = [i for i in first.output if isinstance(i, ResponseFunctionToolCall)]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    _schema_valid_weather_args(calls[0].arguments)
    # Send the tool result back, as an agent does: the model answers with text using it.
    follow_up: list[Any] = [*WEATHER_INPUT, *[i.model_dump(exclude_none=True) for i in first.output]]
    follow_up = [
        {
            k: v
            for k, v in item.items()
            if k not in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
        }
        for item in follow_up
    ]
    follow_up.append(
        {
            "type": "function_call_output",
            "call_id": calls[0].call_id,
            "output": '{"city": "Paris", "weather": "rainy, 12 degrees Celsius"}',
        }
    )
    # tool_choice "none": the answer is text whatever the model writes (no call parsing at all).
    second = client.responses.create(
        model="local", input=follow_up, tools=TOOLS, tool_choice="none", temperature=0, max_output_tokens=64
    )
    assert [type(i) for i in second.output] == [ResponseOutputMessage]
    assert second.status in ("completed", "incomplete")
    assert second.usage is not None and second.usage.output_tokens > 0


def test_sdk_responses_plain_text(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="local",
        input="What is 2 + 2? Reply with only the number.",
        instructions="Be brief.",
        temperature=0,
        max_output_tokens=8,
    )
    assert isinstance(response, Response)
    assert [type(i) for i in response.output] == [ResponseOutputMessage]
    assert (
        response.usage is not None
        and response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    )


def test_sdk_chat_completions_tool_call(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model="local",
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "How warm is it in Tokyo?"},
        ],
        tools=CHAT_TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,  # exactly one call
        temperature=0,
        max_tokens=128,
    )
    assert isinstance(completion, ChatCompletion)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and len(choice.message.tool_calls) == 1
    assert choice.message.tool_calls[0].function.name == "get_weather"
    _schema_valid_weather_args(choice.message.tool_calls[0].function.arguments)


def test_sdk_chat_completions_text_with_logprobs(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model="local",
        messages=[{"role": "user", "content": "Name the capital of France in one word."}],
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
    )
    choice = completion.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    for entry in choice.logprobs.content:
        # Greedy decoding: every chosen token is the most likely one.
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    assert completion.usage is not None and completion.usage.completion_tokens == len(choice.logprobs.content)


# -- limits ----------------------------------------------------------------------------------------------


def test_output_budget_and_context_overflow_are_incomplete_not_errors(urls: dict[str, str]) -> None:
    short = post_json(
        urls["policy_model"] + "/v1/responses",
        # A forced call cannot end within 3 tokens, so the budget runs out whatever the model prefers.
        {
            "input": "Write a long poem about the sea.",
            "tools": [ESSAY_TOOL],
            "tool_choice": {"type": "function", "name": "write_essay"},
            "max_output_tokens": 3,
        },
        timeout=WAIT_S,
    )
    assert short.status_code == 200
    data = short.json()
    assert data["status"] == "incomplete" and data["incomplete_details"]["reason"] == "max_output_tokens"
    assert len(data["output"][-1]["generation_token_ids"]) == 3

    huge = post_json(
        urls["policy_model"] + "/v1/responses",
        {"input": "word " * 6000, "max_output_tokens": 8},
        timeout=WAIT_S,
    )
    assert huge.status_code == 200
    data = huge.json()
    assert data["status"] == "incomplete" and data["output"] == []
    assert "n_ctx" in data["incomplete_details"]["message"]


def test_bad_requests_are_clear_400s(urls: dict[str, str]) -> None:
    url = urls["policy_model"] + "/v1/chat/completions"
    bad_n = post_json(url, {"messages": [{"role": "user", "content": "hi"}], "n": 2})
    assert bad_n.status_code == 400 and "`n` must be 1" in bad_n.json()["error"]["message"]
    no_messages = post_json(url, {"messages": []})
    assert no_messages.status_code == 400 and "messages" in no_messages.json()["error"]["message"]
    hot = post_json(url, {"messages": [{"role": "user", "content": "hi"}], "temperature": 5})
    assert hot.status_code == 400 and "temperature must be between 0 and 2" in hot.json()["error"]["message"]
    image = post_json(
        urls["policy_model"] + "/v1/responses",
        {
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}],
                }
            ]
        },
    )
    assert image.status_code == 400 and "text only" in image.json()["error"]["message"]


def test_queue_bound_is_an_immediate_503_naming_the_setting(busy_url: str) -> None:
    base = busy_url
    # Forced to write at least 1,200 characters (the tool's schema): a long generation on any CPU.
    long_body = {
        "input": "Write an essay about the sea.",
        "tools": [ESSAY_TOOL],
        "tool_choice": {"type": "function", "name": "write_essay"},
        "temperature": 0,
        # Cut at 40 tokens (seconds of grammar-constrained decoding, more under load): the second request is
        # sent as soon as /stats shows this one running, milliseconds later, and the test need not wait for
        # 1,200 characters (was 400 tokens, then 160: ~25 CPU-seconds per n_batch variant).
        "max_output_tokens": 40,
    }
    results: dict[str, httpx.Response] = {}

    def send_long() -> None:
        results["long"] = post_json(base + "/v1/responses", long_body, timeout=WAIT_S)

    worker = threading.Thread(target=send_long)
    worker.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while get(base + "/stats").json()["running"] != 1:
            assert time.monotonic() < deadline and "long" not in results, "the long request never started"
            time.sleep(0.02)
        refused = post_json(base + "/v1/responses", {"input": "hi", "max_output_tokens": 4}, timeout=WAIT_S)
        assert "long" not in results, "the long request ended before the second was sent; lengthen it"
        assert refused.status_code == 503
        assert refused.headers.get("retry-after") == "1"
        error = refused.json()["error"]
        assert error["kind"] == "queue_full" and "max_queue=0" in error["message"]
        assert "busy_model.responses_api_models.local_model.max_queue" in error["message"]
    finally:
        worker.join(WAIT_S)
    assert results["long"].status_code == 200
    # Once it is idle again, requests are served.
    again = post_json(base + "/v1/responses", {"input": "hi", "max_output_tokens": 4}, timeout=WAIT_S)
    assert again.status_code == 200


# -- forced tool calls -----------------------------------------------------------------------------------


def test_forced_call_is_valid_for_the_schema_and_bad_tool_choice_is_a_400(urls: dict[str, str]) -> None:
    url = urls["policy_model"] + "/v1/responses"
    tool = {
        "type": "function",
        "name": "set_alarm",
        "description": "Set an alarm.",
        "parameters": {
            "type": "object",
            "properties": {
                "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                "days": {
                    "type": "array",
                    "items": {"type": "string", "enum": ["mon", "tue", "wed"]},
                    "maxItems": 3,  # bounded, so the call ends within the budget whatever the model picks
                },
            },
            "required": ["hour", "days"],
            "additionalProperties": False,
        },
    }
    body = {
        "input": "Tell me a joke about cats.",  # nothing in the prompt asks for an alarm
        "tools": [tool, TOOLS[0]],
        "tool_choice": {"type": "function", "name": "set_alarm"},
        "temperature": 0,
        "max_output_tokens": 160,
    }
    data = post_json(url, body, timeout=WAIT_S).json()
    assert data["status"] == "completed", data
    [call] = [i for i in data["output"] if i["type"] == "function_call"]
    args = json.loads(call["arguments"])
    assert call["name"] == "set_alarm" and set(args) == {"hour", "days"}
    assert isinstance(args["hour"], int) and 0 <= args["hour"] <= 23
    assert all(day in ("mon", "tue", "wed") for day in args["days"])

    missing = post_json(url, body | {"tool_choice": {"type": "function", "name": "nope"}})
    assert (
        missing.status_code == 400 and "'nope', which is not in `tools`" in missing.json()["error"]["message"]
    )
    no_tools = post_json(url, {"input": "hi", "tool_choice": "required"})
    assert (
        no_tools.status_code == 400
        and "needs at least one function tool" in no_tools.json()["error"]["message"]
    )
