"""nemo_gym.kit.chat_conversion: every conversion case, both directions, and round trips."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from openai.types.responses import (
    Response,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseReasoningItem,
)

from nemo_gym.kit.chat_conversion import (
    ChatConversionError,
    build_response,
    chat_message_to_output_items,
    chat_usage_to_responses_usage,
    responses_params_to_chat_request,
    responses_to_chat_messages,
    responses_tools_to_chat_tools,
    split_think_tags,
)
from nemo_gym.openai_utils import NeMoGymResponse

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the weather.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}


def _strip_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items without the ids minted on each conversion (``call_id`` is kept: it links calls and outputs)."""
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


# -- Responses -> Chat: messages ---------------------------------------------------------------------


def test_instructions_developer_and_system_become_system_messages() -> None:
    params = {
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "No jokes."}]},
            {"role": "user", "content": "Hi"},
        ],
    }
    assert responses_to_chat_messages(params) == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "system", "content": "No jokes."},
        {"role": "user", "content": "Hi"},
    ]


def test_string_input_is_one_user_message() -> None:
    assert responses_to_chat_messages({"input": "Hello"}) == [{"role": "user", "content": "Hello"}]


def test_user_content_parts() -> None:
    params = {
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "one part"}]},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "look:"},
                    {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"},
                ],
            },
        ]
    }
    assert responses_to_chat_messages(params) == [
        {"role": "user", "content": "one part"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look:"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
            ],
        },
    ]


def test_assistant_message_output_text_parts_and_refusal() -> None:
    params = {
        "input": [
            {"role": "user", "content": "Hi"},
            {
                "type": "message",
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": "Hello ", "annotations": []},
                    {"type": "output_text", "text": "there.", "annotations": []},
                ],
            },
            {"role": "user", "content": "Do something bad"},
            {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
        ]
    }
    assert responses_to_chat_messages(params)[1:] == [
        {"role": "assistant", "content": "Hello there."},
        {"role": "user", "content": "Do something bad"},
        {"role": "assistant", "content": "I can't."},
    ]


def test_function_calls_of_a_turn_merge_into_the_turns_assistant_message() -> None:
    params = {
        "input": [
            {"role": "user", "content": "Weather in Oslo and Rome?"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking."}],
            },
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "rainy"}],
            },
            {"type": "function_call", "call_id": "c3", "name": "get_weather", "arguments": '{"city":"Lima"}'},
            {"type": "function_call_output", "call_id": "c3", "output": {"weather": "foggy"}},
        ]
    }
    call = {"type": "function", "function": {"name": "get_weather"}}
    assert responses_to_chat_messages(params)[1:] == [
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "c1", **call, "function": {**call["function"], "arguments": '{"city":"Oslo"}'}},
                {"id": "c2", **call, "function": {**call["function"], "arguments": '{"city":"Rome"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rainy"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c3", **call, "function": {**call["function"], "arguments": '{"city":"Lima"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c3", "content": '{"weather":"foggy"}'},
    ]


def test_reasoning_goes_on_its_turns_assistant_message() -> None:
    params = {
        "input": [
            {"role": "user", "content": "Q"},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "think 1"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "r"},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think 2"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A"}]},
            {"type": "reasoning", "summary": [], "encrypted_content": "opaque"},  # nothing readable: skipped
        ]
    }
    msgs = responses_to_chat_messages(params)
    assert msgs[1] == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "think 1",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    assert msgs[3] == {"role": "assistant", "content": "A", "reasoning_content": "think 2"}
    assert len(msgs) == 4


def test_reasoning_after_text_of_a_turn_starts_a_new_assistant_message() -> None:
    params = {
        "input": [
            {"role": "user", "content": "Q"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "first"}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "again"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "second"}]},
        ]
    }
    assert responses_to_chat_messages(params)[1:] == [
        {"role": "assistant", "content": "first"},
        {"role": "assistant", "content": "second", "reasoning_content": "again"},
    ]


def test_token_ids_are_kept_only_when_asked() -> None:
    ids = {"prompt_token_ids": [1, 2], "generation_token_ids": [3, 4], "generation_log_probs": [-0.1, -0.2]}
    params = {
        "input": [
            {"role": "user", "content": "Q"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", **ids},
        ]
    }
    plain = responses_to_chat_messages(params)
    assert "prompt_token_ids" not in plain[1]
    kept = responses_to_chat_messages(params, keep_token_ids=True)
    assert kept[1]["prompt_token_ids"] == [1, 2] and kept[1]["generation_token_ids"] == [3, 4]
    assert "generation_log_probs" not in kept[1]


def test_items_without_a_chat_equivalent_raise_naming_them() -> None:
    with pytest.raises(ChatConversionError, match=r"input\[1\].*item_reference"):
        responses_to_chat_messages(
            {"input": [{"role": "user", "content": "x"}, {"type": "item_reference", "id": "i"}]}
        )
    with pytest.raises(ChatConversionError, match="input_audio"):
        responses_to_chat_messages({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]})


# -- Responses -> Chat: tools and parameters ------------------------------------------------------------


def test_tools_conversion() -> None:
    assert responses_tools_to_chat_tools(None) is None
    assert responses_tools_to_chat_tools([]) is None
    assert responses_tools_to_chat_tools([WEATHER_TOOL]) == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get the weather.",
                "parameters": WEATHER_TOOL["parameters"],
                "strict": True,
            },
        }
    ]
    assert responses_tools_to_chat_tools([{"type": "function", "name": "bare"}]) == [
        {"type": "function", "function": {"name": "bare"}}
    ]
    with pytest.raises(ChatConversionError, match="web_search"):
        responses_tools_to_chat_tools([{"type": "web_search"}])


def test_params_to_chat_request() -> None:
    params = {
        "input": "Hi",
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False,
        "max_output_tokens": 64,
        "temperature": 0.3,
        "top_p": 0.9,
        "seed": 7,
        "top_logprobs": 2,
        "text": {
            "format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}
        },
        "reasoning": {"effort": "low"},
        "metadata": {"k": "v"},
    }
    request = responses_params_to_chat_request(params, "my-model")
    assert request == {
        "model": "my-model",
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": responses_tools_to_chat_tools([WEATHER_TOOL]),
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "max_tokens": 64,
        "temperature": 0.3,
        "top_p": 0.9,
        "seed": 7,
        "logprobs": True,
        "top_logprobs": 2,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
        },
        "reasoning_effort": "low",
    }


def test_params_not_set_are_not_sent() -> None:
    request = responses_params_to_chat_request(
        {"input": "Hi", "tool_choice": "required", "text": {"format": {"type": "text"}}}, "m"
    )
    assert request == {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
    }  # no tools: no tool_choice
    assert (
        responses_params_to_chat_request({"input": "x", "tools": [WEATHER_TOOL], "tool_choice": "auto"}, "m")[
            "tool_choice"
        ]
        == "auto"
    )


# -- Chat -> Responses ----------------------------------------------------------------------------------


def test_reasoning_content_then_text_then_calls() -> None:
    message = {
        "role": "assistant",
        "reasoning_content": "Plan.",
        "content": "Let me check.",
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
            },
            {
                "id": "call_b",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
            },
        ],
    }
    items = chat_message_to_output_items(message)
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call", "function_call"]
    assert items[0]["summary"] == [{"type": "summary_text", "text": "Plan."}]
    assert items[1]["content"] == [{"type": "output_text", "text": "Let me check.", "annotations": []}]
    assert [(i["call_id"], i["arguments"]) for i in items[2:]] == [
        ("call_a", '{"city":"Oslo"}'),
        ("call_b", '{"city":"Rome"}'),
    ]
    assert items[2]["id"] != items[3]["id"] and items[2]["id"].startswith("fc_")
    ResponseReasoningItem.model_validate(items[0], strict=True)
    ResponseOutputMessage.model_validate(items[1], strict=True)
    ResponseFunctionToolCall.model_validate(items[2], strict=True)


def test_vllm_newer_reasoning_field_is_read() -> None:
    items = chat_message_to_output_items(
        {"role": "assistant", "reasoning": "hmm", "content": "ok", "tool_calls": []}
    )
    assert [i["type"] for i in items] == ["reasoning", "message"] and items[0]["summary"][0]["text"] == "hmm"


@pytest.mark.parametrize(
    ("content", "reasoning", "text"),
    [
        ("<think>\nPlan A.\n</think>\n\nAnswer.", "Plan A.", "Answer."),
        ("Plan B.</think>\n\nAnswer.", "Plan B.", "Answer."),  # the template opened <think> in the prompt
        ("<think>\nCut off while thin", "Cut off while thin", ""),  # generation hit max tokens
        ("No tags at all.", None, "No tags at all."),
    ],
)
def test_think_tags(content: str, reasoning: str | None, text: str) -> None:
    assert split_think_tags(content) == (reasoning, text)
    items = chat_message_to_output_items({"role": "assistant", "content": content})
    types = (["reasoning"] if reasoning else []) + (["message"] if text else [])
    assert [i["type"] for i in items] == types
    if reasoning:
        assert items[0]["summary"][0]["text"] == reasoning
    if text:
        assert items[-1]["content"][0]["text"] == text
    raw = chat_message_to_output_items({"role": "assistant", "content": content}, parse_think_tags=False)
    assert [i["type"] for i in raw] == ["message"] and raw[0]["content"][0]["text"] == content


def test_no_text_means_no_message_item_and_missing_call_ids_are_minted() -> None:
    items = chat_message_to_output_items(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
        }
    )
    assert [i["type"] for i in items] == ["function_call"] and items[0]["call_id"].startswith("call_")
    assert chat_message_to_output_items({"role": "assistant", "content": ""}) == []
    incomplete = chat_message_to_output_items(
        {"role": "assistant", "content": "partial"}, status="incomplete"
    )
    assert incomplete[0]["status"] == "incomplete"


# -- round trips ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        {"role": "assistant", "content": "Just text."},
        {"role": "assistant", "content": "Text.", "reasoning_content": "Thoughts."},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Call two tools.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "a", "arguments": '{"x":1}'}},
                {"id": "c2", "type": "function", "function": {"name": "b", "arguments": "{}"}},
            ],
        },
        {
            "role": "assistant",
            "content": "Before.",
            "tool_calls": [{"id": "c3", "type": "function", "function": {"name": "a", "arguments": "{}"}}],
        },
    ],
)
def test_chat_message_round_trip(message: dict[str, Any]) -> None:
    """chat message -> output items -> chat message gives the same message."""
    items = chat_message_to_output_items(message)
    back = responses_to_chat_messages({"input": [{"role": "user", "content": "Q"}, *items]})
    assert back == [{"role": "user", "content": "Q"}, message]


def test_think_tag_message_round_trips_to_reasoning_content() -> None:
    items = chat_message_to_output_items({"role": "assistant", "content": "<think>why</think>because"})
    back = responses_to_chat_messages({"input": items})
    assert back == [{"role": "assistant", "content": "because", "reasoning_content": "why"}]


def test_multi_turn_output_items_round_trip() -> None:
    """Responses history -> chat messages -> (per assistant message) output items gives the same items."""
    turn1 = [
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "I need the weather."}]},
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "get_weather",
            "arguments": '{"city":"Oslo"}',
            "status": "completed",
        },
    ]
    turn2 = [
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Now answer."}]},
        {
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "It is sunny.", "annotations": []}],
        },
    ]
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        *turn1,
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        *turn2,
    ]
    messages = responses_to_chat_messages({"input": copy.deepcopy(history)})
    assistant = [m for m in messages if m["role"] == "assistant"]
    assert len(assistant) == 2
    assert _strip_ids(chat_message_to_output_items(assistant[0])) == turn1
    assert _strip_ids(chat_message_to_output_items(assistant[1])) == turn2


def test_sdk_output_items_round_trip() -> None:
    """Items as the official SDK dumps them (exclude_none) convert back to the chat message they came from."""
    message = {
        "role": "assistant",
        "content": "Sure.",
        "reasoning_content": "Easy.",
        "tool_calls": [{"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    response = Response.model_validate(build_response({}, chat_message_to_output_items(message), None, "m"))
    dumped = [item.model_dump(exclude_none=True) for item in response.output]
    assert responses_to_chat_messages({"input": dumped}) == [message]


# -- build_response -------------------------------------------------------------------------------------


def test_build_response_is_a_strictly_valid_sdk_response() -> None:
    params = {
        "input": "Hi",
        "instructions": "Be brief.",
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "temperature": 0.5,
        "top_p": 0.8,
        "max_output_tokens": 100,
        "metadata": {"task": "t1"},
        "parallel_tool_calls": False,
    }
    output = chat_message_to_output_items(
        {
            "role": "assistant",
            "reasoning_content": "r",
            "content": "c",
            "tool_calls": [
                {"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        }
    )
    usage = {
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "total_tokens": 15,
        "completion_tokens_details": {"reasoning_tokens": 2},
    }
    raw = build_response(params, output, usage, "m1")
    parsed = Response.model_validate(raw, strict=True)
    assert parsed.model == "m1" and parsed.status == "completed" and parsed.object == "response"
    assert parsed.instructions == "Be brief." and parsed.temperature == 0.5 and parsed.top_p == 0.8
    assert parsed.max_output_tokens == 100 and parsed.metadata == {"task": "t1"}
    assert parsed.tool_choice == "required" and parsed.parallel_tool_calls is False
    assert parsed.tools[0].name == "get_weather"
    assert parsed.usage is not None
    assert (parsed.usage.input_tokens, parsed.usage.output_tokens, parsed.usage.total_tokens) == (10, 5, 15)
    assert parsed.usage.output_tokens_details.reasoning_tokens == 2
    assert parsed.output_text == "c"
    NeMoGymResponse.model_validate(raw)  # and our own model accepts it


def test_build_response_incomplete_and_defaults() -> None:
    raw = build_response(
        {"input": "x"}, [], None, "m", status="incomplete", incomplete_details={"reason": "max_output_tokens"}
    )
    parsed = Response.model_validate(raw, strict=True)
    assert parsed.status == "incomplete" and parsed.incomplete_details is not None
    assert parsed.incomplete_details.reason == "max_output_tokens"
    assert parsed.tool_choice == "auto" and parsed.tools == [] and parsed.parallel_tool_calls is True
    assert parsed.usage is not None and parsed.usage.total_tokens == 0


def test_usage_conversion_accepts_both_shapes() -> None:
    responses_usage = {
        "input_tokens": 3,
        "output_tokens": 4,
        "total_tokens": 7,
        "input_tokens_details": {"cached_tokens": 1},
    }
    converted = chat_usage_to_responses_usage(responses_usage)
    assert converted["total_tokens"] == 7 and converted["input_tokens_details"]["cached_tokens"] == 1
    chat_usage = {"prompt_tokens": 3, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 2}}
    assert chat_usage_to_responses_usage(chat_usage)["total_tokens"] == 7
    assert chat_usage_to_responses_usage(chat_usage)["input_tokens_details"]["cached_tokens"] == 2
