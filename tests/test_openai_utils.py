"""The Responses API models: strict request params, lenient items, token-id fields, SDK compatibility."""

from __future__ import annotations

import typing
from typing import Any

import orjson
import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import (
    Response,
    ResponseFunctionToolCall,
    ResponseFunctionToolCallOutputItem,
    ResponseOutputMessage,
    ResponseReasoningItem,
    response_create_params,
)
from pydantic import ValidationError

from nemo_gym.base_resources_server import BaseRunRequest, BaseVerifyRequest, BaseVerifyResponse
from nemo_gym.openai_utils import (
    REQUIRED_TOKEN_METADATA_FIELDS,
    TOKEN_ID_FIELDS,
    TOKEN_METADATA_FIELDS,
    NeMoGymChatCompletion,
    NeMoGymChatCompletionCreateParamsNonStreaming,
    NeMoGymChatCompletionMessage,
    NeMoGymChatCompletionMessageForTraining,
    NeMoGymChatCompletionMessageToolCall,
    NeMoGymChoice,
    NeMoGymEasyInputMessage,
    NeMoGymEasyInputMessageForTraining,
    NeMoGymFunction,
    NeMoGymFunctionCallOutput,
    NeMoGymResponse,
    NeMoGymResponseCreateParamsNonStreaming,
    NeMoGymResponseFunctionToolCall,
    NeMoGymResponseFunctionToolCallForTraining,
    NeMoGymResponseFunctionWebSearch,
    NeMoGymResponseInputTokensDetails,
    NeMoGymResponseOutputMessage,
    NeMoGymResponseOutputMessageForTraining,
    NeMoGymResponseOutputRefusal,
    NeMoGymResponseOutputText,
    NeMoGymResponseOutputTokensDetails,
    NeMoGymResponseReasoningItem,
    NeMoGymResponseReasoningItemForTraining,
    NeMoGymResponseUsage,
    NeMoGymSummary,
    accumulate_response_usage,
    dump,
    text_of_message,
    training_variant_of,
)

TOKENS = {
    "prompt_token_ids": [1, 2, 3],
    "generation_token_ids": [4, 5],
    "generation_log_probs": [-0.25, -1.5],
}

# A plausible value for every top-level parameter of the SDK's ``ResponseCreateParamsNonStreaming``.
SDK_PARAM_VALUES: dict[str, Any] = {
    "access_programs": {"enabled": True},
    "background": False,
    "background_options": {"k": "v"},
    "context_management": [{"type": "compaction", "compact_threshold": 1000}],
    "conversation": "conv_123",
    "image": {"detail": "auto"},
    "include": ["reasoning.encrypted_content"],
    "input": [{"role": "user", "content": "hi"}],
    "instructions": "Be brief.",
    "max_output_tokens": 256,
    "max_tool_calls": 3,
    "metadata": {"task": "t1"},
    "model": "gpt-test",
    "moderation": {"mode": "off"},
    "parallel_tool_calls": False,
    "previous_response_id": "resp_1",
    "prompt": {"id": "pmpt_1", "variables": {"x": "y"}},
    "prompt_cache_key": "key",
    "prompt_cache_options": {"k": "v"},
    "prompt_cache_retention": "24h",
    "reasoning": {"effort": "low", "summary": "auto"},
    "safety_identifier": "user-1",
    "service_tier": "auto",
    "store": False,
    "stream": False,
    "stream_options": {"include_obfuscation": False},
    "temperature": 0.7,
    "text": {"format": {"type": "text"}},
    "tool_choice": {"type": "function", "name": "get_weather"},
    "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": True}],
    "top_logprobs": 2,
    "top_p": 0.9,
    "truncation": "auto",
    "user": "user-1",
}


def _sdk_param_keys() -> set[str]:
    return set(typing.get_type_hints(response_create_params.ResponseCreateParamsNonStreaming))


# -- request parameters ---------------------------------------------------------------------------------


def test_every_sdk_parameter_is_accepted() -> None:
    sdk_keys = _sdk_param_keys()
    assert sdk_keys - set(SDK_PARAM_VALUES) == set(), "the SDK has parameters this test has no value for"
    assert sdk_keys <= set(NeMoGymResponseCreateParamsNonStreaming.model_fields)
    params = NeMoGymResponseCreateParamsNonStreaming.model_validate(
        {k: SDK_PARAM_VALUES[k] for k in sdk_keys}
    )
    dumped = dump(params)
    assert set(dumped) == sdk_keys
    assert dumped["tool_choice"] == SDK_PARAM_VALUES["tool_choice"]
    assert dumped["tools"] == SDK_PARAM_VALUES["tools"]


def test_unknown_top_level_key_is_rejected_by_name() -> None:
    with pytest.raises(ValidationError) as info:
        NeMoGymResponseCreateParamsNonStreaming.model_validate({"input": "hi", "max_tokens": 5})
    errors = info.value.errors()
    assert [(e["loc"], e["type"]) for e in errors] == [(("max_tokens",), "extra_forbidden")]


def test_unknown_key_inside_a_task_row_params_is_rejected_but_undeclared_row_fields_ignored() -> None:
    row = BaseRunRequest.model_validate(
        {"responses_create_params": {"input": "x"}, "expected": 3, "meta": {"a": 1}}
    )
    # Upstream semantics: a request model reads only what it declares (the agent keeps the row's fields).
    assert dump(row) == {"responses_create_params": {"input": "x"}}
    with pytest.raises(ValidationError) as info:
        BaseRunRequest.model_validate({"responses_create_params": {"input": "x", "tool": []}})
    assert info.value.errors()[0]["loc"] == ("responses_create_params", "tool")


def test_string_input_and_absent_fields_stay_absent() -> None:
    params = NeMoGymResponseCreateParamsNonStreaming.model_validate({"input": "hello", "temperature": None})
    assert [text_of_message(m) for m in params.input_items()] == ["hello"]
    # A null optional means "not given": it is not sent on to the next hop, set or not.
    assert dump(params) == {"input": "hello"}
    # The OpenAI defaults are filled in (as upstream does) but, never set, are not sent on by dump().
    assert params.model_dump(mode="json") == {
        "input": "hello",
        "tools": [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
    }
    assert dump(NeMoGymResponseCreateParamsNonStreaming.model_validate({"input": "x", "store": False})) == {
        "input": "x",
        "store": False,
    }


def test_a_subclass_keeps_the_rule_for_its_own_optional_fields() -> None:
    """The rule is attached to each class's fields as it is defined, an environment's subclass included."""

    class WithKnob(NeMoGymResponseCreateParamsNonStreaming):
        knob: int | None = None
        label: str = "fixed"

    assert WithKnob.model_validate({"input": "x", "knob": None}).model_dump(mode="json") == {
        "input": "x",
        "tools": [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "label": "fixed",
    }
    assert WithKnob.model_validate({"input": "x", "knob": 3}).model_dump(mode="json")["knob"] == 3
    assert (
        orjson.loads(WithKnob.model_validate({"input": "x", "knob": None}).model_dump_json()).get(
            "knob", "absent"
        )
        == "absent"
    )


def test_stream_true_is_rejected() -> None:
    with pytest.raises(ValidationError, match="stream"):
        NeMoGymResponseCreateParamsNonStreaming.model_validate({"input": "x", "stream": True})


# -- items ----------------------------------------------------------------------------------------------


def test_items_parse_into_their_types_and_round_trip_unchanged() -> None:
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [{"type": "summary_text", "text": "think"}],
            "encrypted_content": "abc",
        },
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "get_weather",
            "arguments": '{"city":"Paris"}',
            "id": "fc_1",
        },
        {"type": "function_call_output", "call_id": "c1", "output": '{"weather":"sunny"}'},
        {
            "type": "web_search_call",
            "id": "ws_1",
            "status": "completed",
            "action": {"type": "search", "query": "q"},
        },
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Sunny.", "annotations": [], "logprobs": []}],
            "vendor_field": {"kept": True},
        },
    ]
    params = NeMoGymResponseCreateParamsNonStreaming.model_validate({"input": items})
    assert [type(i) for i in params.input] == [
        NeMoGymEasyInputMessage,
        NeMoGymEasyInputMessage,
        NeMoGymResponseReasoningItem,
        NeMoGymResponseFunctionToolCall,
        NeMoGymFunctionCallOutput,
        NeMoGymResponseFunctionWebSearch,
        NeMoGymResponseOutputMessage,
    ]
    assert dump(params)["input"] == items


def test_item_missing_a_required_field_is_rejected() -> None:
    with pytest.raises(ValidationError, match="call_id"):
        NeMoGymResponseCreateParamsNonStreaming.model_validate(
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}
        )


def test_sdk_objects_parse_as_our_items() -> None:
    sdk_items = [
        ResponseFunctionToolCall(
            type="function_call", call_id="c", name="f", arguments="{}", id="fc", status="completed"
        ),
        ResponseReasoningItem(type="reasoning", id="rs", summary=[]),
        ResponseOutputMessage(
            type="message",
            id="m",
            role="assistant",
            status="completed",
            content=[{"type": "output_text", "text": "hi", "annotations": []}],
        ),
    ]
    response = NeMoGymResponse.model_validate(
        {"output": [i.model_dump(exclude_none=True) for i in sdk_items]}
    )
    assert [type(i) for i in response.output] == [
        NeMoGymResponseFunctionToolCall,
        NeMoGymResponseReasoningItem,
        NeMoGymResponseOutputMessage,
    ]
    assert response.output_text == "hi"


# -- token-id fields -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["message", "function_call", "reasoning"])
def test_token_ids_all_three_pass_unchanged(kind: str) -> None:
    item = {
        "message": {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "x", "annotations": []}],
        },
        "function_call": {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        "reasoning": {"type": "reasoning", "id": "r", "summary": []},
    }[kind] | TOKENS
    request = BaseVerifyRequest.model_validate(
        {"responses_create_params": {"input": [item]}, "response": {"output": [item]}}
    )
    verify = BaseVerifyResponse(**request.model_dump(), reward=1.0)
    out = verify.model_dump(mode="json")
    for fname in TOKEN_ID_FIELDS:
        assert out["response"]["output"][0][fname] == TOKENS[fname]
        assert out["responses_create_params"]["input"][0][fname] == TOKENS[fname]


@pytest.mark.parametrize("missing", TOKEN_ID_FIELDS)
def test_partial_token_ids_are_rejected(missing: str) -> None:
    item = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"} | {
        k: v for k, v in TOKENS.items() if k != missing
    }
    with pytest.raises(ValidationError) as info:
        NeMoGymResponse.model_validate({"output": [item]})
    assert missing in str(info.value)


def test_log_probs_must_match_generation_ids() -> None:
    item = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"} | TOKENS
    item["generation_log_probs"] = [-0.1]
    with pytest.raises(ValidationError, match="same length"):
        NeMoGymResponse.model_validate({"output": [item]})


def test_items_without_token_ids_do_not_gain_them() -> None:
    response = NeMoGymResponse.model_validate(
        {"output": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}
    )
    item = response.model_dump(mode="json")["output"][0]
    assert not set(TOKEN_ID_FIELDS) & set(item)


# -- the response object ----------------------------------------------------------------------------------


def test_our_response_validates_strictly_with_the_sdk() -> None:
    ours = NeMoGymResponse(
        model="m",
        output=[
            NeMoGymResponseReasoningItem(id="rs_1", summary=[{"type": "summary_text", "text": "hmm"}]),
            NeMoGymResponseFunctionToolCall(
                call_id="c1", name="get_weather", arguments='{"city":"Oslo"}', id="fc_1", status="completed"
            ),
            NeMoGymFunctionCallOutput(call_id="c1", output="sunny", id="fco_1", status="completed"),
            NeMoGymResponseOutputMessage(
                role="assistant",
                id="msg_1",
                status="completed",
                content=[{"type": "output_text", "text": "It is sunny.", "annotations": []}],
            ),
        ],
        usage=NeMoGymResponseUsage(input_tokens=10, output_tokens=5, total_tokens=15),
    )
    data = ours.model_dump(mode="json")
    parsed = Response.model_validate(data, strict=True)
    assert [type(i) for i in parsed.output] == [
        ResponseReasoningItem,
        ResponseFunctionToolCall,
        ResponseFunctionToolCallOutputItem,
        ResponseOutputMessage,
    ]
    assert parsed.output_text == ours.output_text == "It is sunny."
    assert parsed.model_extra == {}
    assert parsed.usage is not None and parsed.usage.input_tokens_details.cached_tokens == 0
    # And back: what the SDK parsed is accepted by our model unchanged.
    again = NeMoGymResponse.model_validate(parsed.model_dump(mode="json", exclude_none=True))
    assert [i.type for i in again.output] == [i.type for i in ours.output]


# -- upstream's names and constructions (drop-in) ------------------------------------------------------

# Every name upstream environments, agents and trainers import from ``nemo_gym.openai_utils``.
UPSTREAM_NAMES = """
NeMoGymResponseCreateParamsNonStreaming NeMoGymResponse NeMoGymEasyInputMessage NeMoGymResponseOutputMessage
NeMoGymResponseOutputText NeMoGymResponseFunctionToolCall NeMoGymFunctionCallOutput NeMoGymChatCompletion
NeMoGymResponseReasoningItem NeMoGymSummary NeMoGymResponseUsage NeMoGymChatCompletionCreateParamsNonStreaming
NeMoGymResponseInputTokensDetails NeMoGymResponseOutputTokensDetails NeMoGymResponseOutputItem NeMoGymAsyncOpenAI
accumulate_response_usage NeMoGymResponseOutputRefusal NeMoGymChatCompletionMessage NeMoGymChoice
NeMoGymResponseOutputMessageForTraining NeMoGymResponseInput RATE_LIMIT_ERROR_CODES RETRY_ERROR_CODES
NeMoGymResponseInputItem NeMoGymChatCompletionMessageParam NeMoGymMessage NeMoGymChatCompletionMessageForTraining
NeMoGymResponseFunctionToolCallForTraining REQUIRED_TOKEN_METADATA_FIELDS TOKEN_METADATA_FIELDS
NeMoGymChatCompletionAssistantMessageForTrainingParam NeMoGymChatCompletionAssistantMessageParam
NeMoGymChatCompletionContentPartTextParam NeMoGymChatCompletionMessageToolCall
NeMoGymChatCompletionMessageToolCallFunctionParam NeMoGymChatCompletionMessageToolCallParam
NeMoGymChatCompletionSystemMessageParam NeMoGymChatCompletionToolMessageParam NeMoGymChatCompletionUserMessageParam
NeMoGymFunction NeMoGymFunctionToolParam NeMoGymResponseInputText NeMoGymEasyInputMessageForTraining
NeMoGymMessageForTraining NeMoGymResponseReasoningItemForTraining TokenIDLogProbMixin TokenIDLogProbTypedDictMixin
RESPONSES_TO_TRAIN training_variant_of NeMoGymContent NeMoGymInputVideoPart NeMoGymResponseMcpCall
NeMoGymResponseMcpListTools NeMoGymResponseMcpApprovalRequest NeMoGymResponseFileSearchToolCall
NeMoGymResponseFunctionWebSearch NeMoGymResponseComputerToolCall NeMoGymImageGenerationCall
NeMoGymResponseCodeInterpreterToolCall NeMoGymLocalShellCall NeMoGymResponseCustomToolCall NeMoGymComputerCallOutput
NeMoGymResponseCustomToolCallOutput NeMoGymLocalShellCallOutput NeMoGymMcpApprovalResponse NeMoGymFunctionDefinition
NeMoGymChatCompletionToolParam NeMoGymChatCompletionCustomToolParam NeMoGymChatCompletionContentPartImageParam
NeMoGymChatCompletionContentPartInputAudioParam NeMoGymChatCompletionContentPartFileParam
NeMoGymChatCompletionContentPartVideoUrlParam NeMoGymChatCompletionDeveloperMessageParam
NeMoGymChatCompletionMessageCustomToolCall NeMoGymChatCompletionMessageCustomToolCallParam
NeMoGymChatCompletionOutputMessage
""".split()


def test_every_upstream_name_is_importable() -> None:
    import nemo_gym.openai_utils as ou

    assert [n for n in UPSTREAM_NAMES if not hasattr(ou, n)] == []
    assert set(UPSTREAM_NAMES) <= set(ou.__all__)


def _upstream_style_response(**kw: Any) -> NeMoGymResponse:
    """A response built the way upstream environments' tests build theirs."""
    return NeMoGymResponse(
        id="resp_test",
        created_at=1234.5,
        model="policy",
        object="response",
        output=[
            NeMoGymResponseReasoningItem(
                id="rs_1", summary=[NeMoGymSummary(text="Let me think.", type="summary_text")]
            ),
            NeMoGymResponseFunctionToolCall(call_id="call_1", name="lookup", arguments='{"q": "x"}'),
            # No role: upstream defaults an output message's role to "assistant".
            NeMoGymResponseOutputMessage(
                id="msg_1",
                content=[
                    NeMoGymResponseOutputText(text="The answer is ", annotations=[]),
                    NeMoGymResponseOutputText(text="42.", annotations=[]),
                ],
            ),
            NeMoGymResponseOutputMessage(id="msg_2", content=[NeMoGymResponseOutputRefusal(refusal="no")]),
        ],
        parallel_tool_calls=False,
        tool_choice="auto",
        tools=[],
        **kw,
    )


def test_upstream_constructions_validate_and_pass_the_sdk_strictly() -> None:
    response = _upstream_style_response(
        usage=NeMoGymResponseUsage(
            input_tokens=7,
            input_tokens_details=NeMoGymResponseInputTokensDetails(cached_tokens=0),
            output_tokens=3,
            output_tokens_details=NeMoGymResponseOutputTokensDetails(reasoning_tokens=1),
            total_tokens=10,
        )
    )
    message = response.output[2]
    assert message.role == "assistant" and message.status == "completed" and message.type == "message"
    assert response.output_text == "The answer is 42."
    parsed = Response.model_validate(response.model_dump(mode="json"), strict=True)
    assert parsed.output_text == "The answer is 42."
    assert [i.type for i in parsed.output] == ["reasoning", "function_call", "message", "message"]
    # ... and what the SDK parsed comes back into the same classes.
    again = NeMoGymResponse.model_validate(parsed.model_dump(mode="json", exclude_none=True))
    assert [type(i) for i in again.output] == [type(i) for i in response.output]
    # A verify request carrying it (as upstream tests call verify directly) keeps every item.
    request = BaseVerifyRequest(
        responses_create_params=NeMoGymResponseCreateParamsNonStreaming(
            input=[NeMoGymEasyInputMessage(role="user", content="What is 6 x 7?")]
        ),
        response=response,
    )
    assert request.response.output_text == "The answer is 42."


def test_input_and_output_messages_are_distinct_classes() -> None:
    with pytest.raises(ValidationError, match="role"):
        NeMoGymEasyInputMessage(content="hi")
    params = NeMoGymResponseCreateParamsNonStreaming.model_validate(
        {
            "input": [
                {"role": "system", "content": "Be brief."},
                {"role": "assistant", "content": "Earlier answer."},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            ]
        }
    )
    assert [type(i) for i in params.input] == [
        NeMoGymEasyInputMessage,
        NeMoGymEasyInputMessage,
        NeMoGymResponseOutputMessage,
        NeMoGymEasyInputMessage,
    ]
    # Input content parts stay plain dicts (upstream's TypedDicts), so index access works.
    assert params.input[3].content[0]["text"] == "Hi"
    assert isinstance(params.input[2].content[0], NeMoGymResponseOutputText)


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"text": "no type"}, "string 'type'"),
        ({"type": "input_text"}, "string 'text'"),
        ({"type": "input_video"}, "exactly one of"),
        ({"type": "input_video", "video_url": {"url": " "}}, "non-empty URL"),
    ],
)
def test_bad_input_content_parts_are_named(part: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message) as info:
        NeMoGymResponseCreateParamsNonStreaming.model_validate(
            {"input": [{"role": "user", "content": [part]}]}
        )
    # The error points at the part (the other entries are the string forms ``input`` could have taken).
    assert any({0, "input_message", "content"} <= set(e["loc"]) for e in info.value.errors())


def test_create_params_use_openai_defaults_and_keep_tools_as_dicts() -> None:
    tool = {"type": "function", "name": "lookup", "parameters": {"type": "object"}, "strict": False}
    params = NeMoGymResponseCreateParamsNonStreaming(input="x", tools=[tool])
    assert params.parallel_tool_calls is True and params.tool_choice == "auto"
    assert params.tools[0]["name"] == "lookup" and params.tools == [tool]
    bare = NeMoGymResponseCreateParamsNonStreaming(input="x")
    assert bare.tools == [] and bare.model_dump()["tools"] == []
    # Defaults are not "set": dump() (what every hop sends) leaves them out.
    assert dump(bare) == {"input": "x"}
    with pytest.raises(ValidationError) as info:
        NeMoGymResponseCreateParamsNonStreaming.model_validate({"tools": []})
    assert [e["loc"] for e in info.value.errors()] == [("input",)]
    with pytest.raises(ValidationError, match="non-empty string 'name'") as info:
        NeMoGymResponseCreateParamsNonStreaming.model_validate(
            {"input": "x", "tools": [{"type": "function"}]}
        )
    assert info.value.errors()[0]["loc"] == ("tools", 0)
    # Other tool types pass as they are.
    web = {"type": "web_search", "search_context_size": "low"}
    assert NeMoGymResponseCreateParamsNonStreaming(input="x", tools=[web]).tools == [web]


def test_items_with_token_ids_parse_into_their_training_variants() -> None:
    items = [
        {"role": "user", "content": "q"} | TOKENS,
        {"type": "message", "role": "assistant", "id": "m", "content": [{"type": "output_text", "text": "a"}]}
        | TOKENS,
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"} | TOKENS,
        {"type": "reasoning", "id": "r", "summary": []} | TOKENS,
    ]
    response = NeMoGymResponse.model_validate({"output": items})
    assert [type(i) for i in response.output] == [
        NeMoGymEasyInputMessageForTraining,
        NeMoGymResponseOutputMessageForTraining,
        NeMoGymResponseFunctionToolCallForTraining,
        NeMoGymResponseReasoningItemForTraining,
    ]
    for base, item in zip(
        [
            NeMoGymEasyInputMessage,
            NeMoGymResponseOutputMessage,
            NeMoGymResponseFunctionToolCall,
            NeMoGymResponseReasoningItem,
        ],
        response.output,
        strict=True,
    ):
        assert isinstance(item, base) and training_variant_of(base) is type(item)
    with pytest.raises(NotImplementedError, match="NeMoGymFunctionCallOutput"):
        training_variant_of(NeMoGymFunctionCallOutput)
    # In the training classes the three fields are required.
    with pytest.raises(ValidationError, match="generation_log_probs"):
        NeMoGymResponseOutputMessageForTraining(
            id="m", content=[], prompt_token_ids=[1], generation_token_ids=[2]
        )
    built = NeMoGymResponseOutputMessageForTraining(
        id="m",
        content=[NeMoGymResponseOutputText(text="", annotations=[])],
        prompt_token_ids=[0],
        generation_token_ids=[0],
        generation_log_probs=[0.0],
    )
    assert built.model_dump()["role"] == "assistant" and "routed_experts" not in built.model_dump()


def test_routed_experts_pass_unchanged_but_never_alone() -> None:
    item = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"} | TOKENS
    envelope = "trainer-envelope:int16:2x1x1:AAAA"
    response = NeMoGymResponse.model_validate({"output": [item | {"routed_experts": envelope}]})
    assert response.model_dump(mode="json")["output"][0]["routed_experts"] == envelope
    assert REQUIRED_TOKEN_METADATA_FIELDS == set(TOKEN_ID_FIELDS)
    assert TOKEN_METADATA_FIELDS == set(TOKEN_ID_FIELDS) | {"routed_experts"}
    with pytest.raises(ValidationError, match="all together"):
        NeMoGymResponse.model_validate(
            {
                "output": [
                    {
                        "type": "function_call",
                        "call_id": "c",
                        "name": "f",
                        "arguments": "{}",
                        "routed_experts": envelope,
                    }
                ]
            }
        )


def test_usage_sums_keep_unknown_detail_counts_unknown() -> None:
    def usage(i: int, o: int, cached: int | None, reasoning: int | None) -> NeMoGymResponseUsage:
        return NeMoGymResponseUsage(
            input_tokens=i,
            input_tokens_details=NeMoGymResponseInputTokensDetails(cached_tokens=cached),
            output_tokens=o,
            output_tokens_details=NeMoGymResponseOutputTokensDetails(reasoning_tokens=reasoning),
            total_tokens=i + o,
        )

    total = NeMoGymResponseUsage.sum_from_list([usage(10, 2, 4, 1), usage(5, 3, 1, 0)])
    assert (total.input_tokens, total.output_tokens, total.total_tokens) == (15, 5, 20)
    assert total.input_tokens_details.cached_tokens == 5 and total.output_tokens_details.reasoning_tokens == 1
    assert NeMoGymResponseUsage.sum_from_list([]).total_tokens == 0

    first = usage(1, 1, 0, None)
    assert accumulate_response_usage(None, None) is None
    copied = accumulate_response_usage(None, first)
    assert copied == first and copied is not first
    copied.input_tokens = 99
    assert first.input_tokens == 1  # a copy, not the caller's object
    summed = accumulate_response_usage(first, usage(2, 2, 3, 4))
    assert summed.input_tokens == 3 and summed.input_tokens_details.cached_tokens == 3
    assert summed.output_tokens_details.reasoning_tokens is None  # unknown + 4 is still unknown
    assert accumulate_response_usage(first, None) is first


# -- Chat Completions ----------------------------------------------------------------------------------


def _chat_completion(**message: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "created": 1700000000,
        "model": "policy",
        "object": "chat.completion",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", **message}}],
    }


def test_chat_completion_as_upstream_builds_it_round_trips_through_the_sdk() -> None:
    built = NeMoGymChatCompletion(
        id="chatcmpl-1",
        created=1700000000,
        model="policy",
        object="chat.completion",
        choices=[
            NeMoGymChoice(
                index=0,
                finish_reason="tool_calls",
                message=NeMoGymChatCompletionMessage(
                    role="assistant",
                    content="Let me look.",
                    tool_calls=[
                        NeMoGymChatCompletionMessageToolCall(
                            id="call_1",
                            type="function",
                            function=NeMoGymFunction(name="lookup", arguments="{}"),
                        )
                    ],
                ),
            )
        ],
    )
    sdk = ChatCompletion.model_validate(built.model_dump(mode="json"), strict=True)
    assert sdk.choices[0].message.tool_calls[0].function.name == "lookup"
    back = NeMoGymChatCompletion.model_validate(sdk.model_dump(mode="json"))
    assert isinstance(back.choices[0].message.tool_calls[0].function, NeMoGymFunction)
    # A backend's extra message fields (vLLM's reasoning_content) are kept.
    kept = NeMoGymChatCompletion.model_validate(_chat_completion(content="x", reasoning_content="think"))
    assert kept.choices[0].message.model_dump()["reasoning_content"] == "think"


def test_chat_message_with_token_ids_is_the_training_variant() -> None:
    trained = NeMoGymChatCompletion.model_validate(_chat_completion(content="x", **TOKENS))
    assert type(trained.choices[0].message) is NeMoGymChatCompletionMessageForTraining
    plain = NeMoGymChatCompletion.model_validate(_chat_completion(content="x"))
    assert type(plain.choices[0].message) is NeMoGymChatCompletionMessage
    with pytest.raises(ValidationError, match="all together"):
        NeMoGymChatCompletion.model_validate(_chat_completion(content="x", prompt_token_ids=[1]))


def test_chat_create_params_keep_messages_as_dicts() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "video_url", "video_url": "v.mp4"}],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": "done", "reasoning_content": "kept"} | TOKENS,
    ]
    params = NeMoGymChatCompletionCreateParamsNonStreaming(
        messages=messages,
        max_tokens=64,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        chat_template_kwargs={"enable_thinking": False},
    )
    assert params.messages == messages and all(type(m) is dict for m in params.messages)
    assert params.parallel_tool_calls is True
    assert dump(params) == {
        "messages": messages,
        "max_tokens": 64,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    with pytest.raises(ValidationError, match="developer, system, user, assistant or tool"):
        NeMoGymChatCompletionCreateParamsNonStreaming(
            messages=[{"role": "function", "content": "x", "name": "f"}]
        )
    with pytest.raises(ValidationError, match="tool_call_id"):
        NeMoGymChatCompletionCreateParamsNonStreaming(messages=[{"role": "tool", "content": "x"}])
    with pytest.raises(ValidationError, match="all together"):
        NeMoGymChatCompletionCreateParamsNonStreaming(
            messages=[{"role": "assistant", "content": "x", "generation_token_ids": [1]}]
        )
    with pytest.raises(ValidationError, match="stream"):
        NeMoGymChatCompletionCreateParamsNonStreaming(messages=[], stream=True)


def test_a_response_with_a_null_status_is_accepted() -> None:
    # Some providers answer ``status: null``; stored rollouts carry it and must re-verify.
    from nemo_gym.openai_utils import NeMoGymResponse

    body = {
        "id": "resp_1", "object": "response", "created_at": 0, "model": "m", "status": None,
        "output": [], "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
    }  # fmt: skip
    assert NeMoGymResponse.model_validate(body).status is None
