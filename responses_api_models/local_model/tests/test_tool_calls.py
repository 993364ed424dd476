"""Tool-call parsing: every spelling a small model uses, and the texts that must stay plain text."""

from __future__ import annotations

import json

import pytest

from responses_api_models.local_model.tool_calls import parse_completion, split_reasoning

TOOLS = ["get_weather", "search"]


def _calls(text: str, tools: list[str] | None = TOOLS) -> list[tuple[str, dict]]:
    parsed = parse_completion(text, tools)
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def test_tool_call_tags_qwen_format() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parsed = parse_completion(text, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert parsed.content == ""


def test_tool_call_tags_several_calls_and_surrounding_text() -> None:
    text = (
        'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"q": "Oslo news"}}\n</tool_call>'
    )
    parsed = parse_completion(text, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("search", {"q": "Oslo news"}),
    ]
    assert parsed.content == "Let me check both."


def test_tool_call_tag_without_closing_tag_at_the_end() -> None:
    assert _calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}') == [
        ("get_weather", {"city": "Lima"})
    ]


def test_tool_call_tag_accepts_unknown_tool_name() -> None:
    # The agent answers "unknown tool" to the model; the parser must not hide the attempt as text.
    assert _calls('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>') == [("get_time", {})]


def test_tool_call_tag_with_invalid_json_keeps_name_and_raw_arguments() -> None:
    parsed = parse_completion(
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"</tool_call>', TOOLS
    )
    assert len(parsed.tool_calls) == 1
    assert parsed.tool_calls[0].name == "get_weather"
    with pytest.raises(json.JSONDecodeError):
        json.loads(parsed.tool_calls[0].arguments)


def test_fenced_json_call() -> None:
    text = 'I will call the tool:\n```json\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n```'
    parsed = parse_completion(text, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Tokyo"})
    ]
    assert parsed.content == "I will call the tool:"


def test_fenced_json_list_of_calls_and_parameters_synonym() -> None:
    text = '```\n[{"name": "get_weather", "parameters": {"city": "A"}}, {"name": "search", "arguments": {"q": "b"}}]\n```'
    assert _calls(text) == [("get_weather", {"city": "A"}), ("search", {"q": "b"})]


def test_bare_json_call() -> None:
    text = '{"name": "get_weather", "arguments": {"city": "Nairobi"}}'
    parsed = parse_completion(text, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Nairobi"})
    ]
    assert parsed.content == ""


def test_several_bare_calls_as_the_whole_message() -> None:
    text = (
        '{"name": "get_weather", "arguments": {"city": "A"}}\n{"name": "search", "parameters": {"q": "b"}};'
    )
    assert _calls(text) == [("get_weather", {"city": "A"}), ("search", {"q": "b"})]


@pytest.mark.parametrize(
    "text",
    [
        'Sure. {"name": "get_weather", "arguments": {"city": "Oslo"}} Done.',
        # What Qwen2.5-Coder-0.5B writes after a tool result: the call again plus the data it "got".
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n{"weather": "snowy, 7 degrees Celsius"}',
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```json\n{"city": "Oslo", "weather": "snowy"}\n```',
    ],
)
def test_bare_call_mixed_with_other_text_is_prose(text: str) -> None:
    parsed = parse_completion(text, TOOLS)
    assert parsed.tool_calls == [] and parsed.content == text


def test_arguments_given_as_string_are_kept_verbatim() -> None:
    parsed = parse_completion(
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>', TOOLS
    )
    assert parsed.tool_calls[0].arguments == '{"city": "Rome"}'


def test_non_ascii_arguments_survive() -> None:
    assert _calls('<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>') == [
        ("get_weather", {"city": "Zürich"})
    ]


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "Paris", "population": 2100000}',  # JSON data, not a call
        '```json\n{"name": "unknown_tool", "arguments": {}}\n```',  # fenced/bare calls must name an offered tool
        '{"name": "not_offered", "arguments": {"x": 1}}',
        "The weather in Paris is sunny, 20 degrees.",
        "{not json at all}",
    ],
)
def test_plain_text_is_not_a_tool_call(text: str) -> None:
    parsed = parse_completion(text, TOOLS)
    assert parsed.tool_calls == []
    assert parsed.content == text


def test_no_tools_offered_means_no_parsing() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    parsed = parse_completion(text, None)
    assert parsed.tool_calls == [] and parsed.content == text


def test_think_blocks_become_reasoning() -> None:
    parsed = parse_completion(
        '<think>Need the weather.</think>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
        TOOLS,
    )
    assert parsed.reasoning == "Need the weather."
    assert [c.name for c in parsed.tool_calls] == ["get_weather"]
    assert split_reasoning("Answer only.") == (None, "Answer only.")
    assert split_reasoning("thinking...</think>Answer") == ("thinking...", "Answer")


# -- recorded outputs of Qwen2.5-Coder-0.5B-Instruct (greedy, on machines where it wrote these) -----------


def test_one_bare_call_per_line_is_several_calls() -> None:
    # The quickstart's first task on an AMD machine: four calls, one a line, none with tags.
    text = (
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '{"name": "get_weather", "arguments": {"city": "London"}}\n'
        '{"name": "get_weather", "arguments": {"city": "Berlin"}}\n'
        '{"name": "get_weather", "arguments": {"city": "Madrid"}}'
    )
    parsed = parse_completion(text, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": city}) for city in ("Paris", "London", "Berlin", "Madrid")
    ]
    assert all(c.complete for c in parsed.tool_calls) and parsed.content == ""


def test_lead_in_sentence_then_calls_one_a_line() -> None:
    text = 'I will check both cities.\n\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n{"name": "get_weather", "arguments": {"city": "Bergen"}}\n'
    parsed = parse_completion(text, TOOLS)
    assert [json.loads(c.arguments)["city"] for c in parsed.tool_calls] == ["Oslo", "Bergen"]
    assert parsed.content == "I will check both cities."


def test_echoed_call_and_result_after_a_tool_answer_stays_prose() -> None:
    # What the model printed as its "answer" after get_weather returned (AMD machine, issue report).
    text = '{"name": "get_weather", "arguments": {"city": "Tokyo"}} {"weather": "cloudy, 14 degrees Celsius"}'
    parsed = parse_completion(text, TOOLS)
    assert parsed.tool_calls == [] and parsed.content == text


@pytest.mark.parametrize(
    "text, content",
    [
        ('{"name": "get_weather", "arguments": {"city": "Par', ""),
        ('{"name": "get_weather", "arguments": {"city": "Oslo"}}\n{"name": "get_weather", "argu', ""),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lim', ""),
        ('Checking.\n```json\n{"name": "get_weather", "arguments": {"ci', "Checking."),
    ],
)
def test_a_call_cut_off_by_the_token_limit_is_an_incomplete_call_not_text(text: str, content: str) -> None:
    parsed = parse_completion(text, TOOLS)
    assert parsed.tool_calls and parsed.tool_calls[-1].name == "get_weather"
    assert not parsed.tool_calls[-1].complete
    assert all(c.complete for c in parsed.tool_calls[:-1])
    assert parsed.content == content


def test_cut_off_json_that_names_no_offered_tool_stays_text() -> None:
    for text in ('{"name": "Paris", "population": 21', '{"name": "not_offered", "arguments": {"x'):
        parsed = parse_completion(text, TOOLS)
        assert parsed.tool_calls == [] and parsed.content == text


def test_call_wrapped_in_the_prompts_tools_tag() -> None:
    # What Qwen2.5-Coder-1.5B writes (greedy, AMD machine): the <tools> tag of the tool list.
    text = '<tools>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tools>'
    parsed = parse_completion(text, TOOLS)
    assert [(c.name, json.loads(c.arguments), c.complete) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Lima"}, True)
    ]
    assert parsed.content == ""


@pytest.mark.parametrize(
    "text",
    [
        # A tool definition copied from the prompt, an unoffered name, an empty tag: not calls.
        '<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "x", "parameters": {}}}\n</tools>',
        '<tools>{"name": "not_offered", "arguments": {}}</tools>',
        "<tools></tools>",
    ],
)
def test_tools_tag_without_an_offered_call_is_text(text: str) -> None:
    parsed = parse_completion(text, TOOLS)
    assert parsed.tool_calls == [] and parsed.content == text
