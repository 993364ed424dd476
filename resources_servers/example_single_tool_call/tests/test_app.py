"""example_single_tool_call against real servers: tool output, reward, and task fields kept."""

import orjson
import pytest

from nemo_gym.tools.testing import example_rows, post_json, run_rollout, running_servers, server_url
from resources_servers.example_single_tool_call.app import answer_reports_reading, weather_for

CONFIG = "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml"
AGENT = "example_single_tool_call_simple_agent"


def _script(rows, answer):
    """A scripted model that asks for the right city for each example row, then says ``answer(row)``."""
    return {
        "policy_model": {
            "responses_api_models": {
                "scripted_model": {
                    "scripts_by_input": [
                        {
                            "contains": row["expected_city"],
                            "turns": [
                                {
                                    "tool_calls": [
                                        {"name": "get_weather", "arguments": {"city": row["expected_city"]}}
                                    ]
                                },
                                {"text": answer(row)},
                            ],
                        }
                        for row in rows
                    ]
                }
            }
        }
    }


def _sentence(row):
    condition, degrees = weather_for(row["expected_city"]).split(" degrees")[0].split(", ")
    return f"It is {condition} in {row['expected_city']} right now, {degrees} degrees Celsius."


def test_rollouts_that_report_the_weather_score_one_and_keep_task_fields():
    rows = example_rows("example_single_tool_call")
    with running_servers([CONFIG], _script(rows, _sentence)) as helper:
        for row in rows:
            result = run_rollout(helper, AGENT, row)
            assert result["reward"] == 1.0, result["response"]["output"]
            assert result["called_for_expected_city"] and result["answer_reports_weather"]
            assert result["expected_city"] == row["expected_city"]
            types = [item["type"] for item in result["response"]["output"]]
            assert types == ["function_call", "function_call_output", "message"]
            weather = orjson.loads(result["response"]["output"][1]["output"])
            assert weather == {"city": row["expected_city"], "weather": weather_for(row["expected_city"])}


@pytest.mark.parametrize(
    "answer",
    [
        # What a 0.5B model wrote as its "answer" on one machine: the call and the result echoed as JSON.
        lambda row: (
            f'{{"name": "get_weather", "arguments": {{"city": "{row["expected_city"]}"}}}} '
            f'{{"weather": "{weather_for(row["expected_city"])}"}}'
        ),
        lambda row: f"Here is the weather in {row['expected_city']}.",  # answers, but reports nothing
    ],
    ids=["json_echo", "no_reading"],
)
def test_an_answer_that_does_not_report_the_reading_scores_zero(answer):
    rows = example_rows("example_single_tool_call")[:2]
    with running_servers([CONFIG], _script(rows, answer)) as helper:
        for row in rows:
            result = run_rollout(helper, AGENT, row)
            assert result["called_for_expected_city"] is True
            assert result["answer_reports_weather"] is False and result["reward"] == 0.0


def test_wrong_city_scores_zero():
    # The default scripted model calls get_weather with a placeholder city, so the verifier must say 0.
    row = example_rows("example_single_tool_call")[0]
    with running_servers([CONFIG]) as helper:
        result = run_rollout(helper, AGENT, row)
        assert result["reward"] == 0.0 and result["called_for_expected_city"] is False
        call = result["response"]["output"][0]
        assert (
            call["name"] == "get_weather" and orjson.loads(call["arguments"])["city"] != row["expected_city"]
        )
        # The tool itself is deterministic per city.
        url = server_url(helper, "example_single_tool_call") + "/get_weather"
        assert post_json(url, {"city": "Paris"}).json() == post_json(url, {"city": "paris"}).json() | {
            "city": "Paris"
        }


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("It is rainy in Tokyo, 14 degrees Celsius.", True),
        ("Expect rain in Tokyo today (14°C), so take an umbrella.", True),
        ("The weather in Tokyo is rainy, 14 degrees.", True),
        ("It is rainy in Tokyo.", False),  # no temperature
        ("It is 14 degrees in Tokyo.", False),  # no condition
        ("It is rainy in Tokyo, 140 degrees.", False),  # another number
        ("It is sunny in Tokyo, 14 degrees.", False),  # another condition
        ('{"weather": "rainy, 14 degrees Celsius"}', False),  # JSON, not an answer
        ('Tokyo: rainy, 14. {"city": "Tokyo"}', False),
        ("rainy 14", False),  # not a sentence
    ],
)
def test_answer_reports_reading(answer, expected):
    assert answer_reports_reading(answer, "rainy, 14 degrees Celsius") is expected


def _weather_response(city: str, answer: str) -> dict:
    """A response in which the model called get_weather for ``city``, got its reading, and said ``answer``."""
    reading = orjson.dumps({"city": city, "weather": weather_for(city)}).decode()
    return {
        "output": [
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": f'{{"city": "{city}"}}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": reading},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": answer, "annotations": []}],
            },
        ]
    }


_EVERY_TEMPERATURE = ", ".join(str(n) for n in range(35))
# Paris reads "snowy, 7 degrees Celsius". What a policy tries instead of one plain sentence: every one of
# these scored 1.0 before (answer, failure_reason, words of the reason).
_WEATHER_EXPLOITS = [
    (
        "It may be sunny, cloudy, rainy, windy, snowy or foggy in Paris, "
        f"at {_EVERY_TEMPERATURE} degrees Celsius.",
        "several_readings",
        "more than one condition",
    ),
    (
        f"It is snowy in Paris right now, {_EVERY_TEMPERATURE} degrees Celsius.",
        "several_readings",
        "more than one temperature",
    ),
    (
        "It is snowy or sunny in Paris right now, 7 degrees Celsius.",
        "several_readings",
        "more than one condition",
    ),
    (
        "It is snowy in Paris right now, 7 or 8 degrees Celsius.",
        "several_readings",
        "more than one temperature",
    ),
    ("city:Paris,weather:snowy, 7 degrees Celsius", "not_prose", "keys"),
    ('"city": "Paris", "weather": "snowy, 7 degrees Celsius"', "not_prose", "keys"),
    ("city Paris weather snowy 7 degrees Celsius", "not_prose", "words of its own"),
    ("Paris: snowy, 7 degrees Celsius", "not_prose", "words of its own"),
    # look-alike letters hide two more conditions from the count (Cyrillic dze and es)
    (
        "It is snowy (or \u0455unny, or \u0441loudy) in Paris right now, 7 degrees Celsius.",
        "not_prose",
        "look-alike",
    ),
    ("It is snowy in Paris right now, -7 degrees Celsius.", "wrong_reading", "temperature 7"),
    (
        "It is snowy in Paris right now, 7 degrees Celsius. " + "It is snowy. " * 230_000,
        "not_prose",
        "longer than",
    ),
]
# Right answers, as models and this project's scripts write them.
_WEATHER_RIGHT = [
    "The current weather in Paris is snowy, with a temperature of 7 degrees Celsius.",  # the quickstart's
    "Right now in Paris it is snowy, 7 degrees Celsius.",  # the scripted model's config
    "It is snowy in Paris right now at 7 degrees Celsius",  # tests/test_e2e_collect_rollouts.py
    "It is snowing in Paris today, 7\u00b0C (45\u00b0F), so wear a warm coat.",  # a Fahrenheit conversion
    "Expect snow in Paris today, 7 degrees, with no rain and no sunshine.",  # negated conditions
    "It is snowy in Paris right now, \uff17 degrees Celsius.",  # a full-width digit is that digit
]


def test_one_plain_sentence_with_one_reading_is_the_answer():
    with running_servers([CONFIG]) as helper:
        url = server_url(helper, "example_single_tool_call") + "/verify"
        row = example_rows("example_single_tool_call")[0]
        assert row["expected_city"] == "Paris" and weather_for("Paris") == "snowy, 7 degrees Celsius"
        got = {}
        for answer, _, _ in _WEATHER_EXPLOITS:
            resp = post_json(url, {**row, "response": _weather_response("Paris", answer)})
            assert resp.status_code == 200, resp.text[:2000]
            result = resp.json()
            assert result["called_for_expected_city"] is True
            got[answer[:60]] = (result["reward"], result.get("failure_reason"), result.get("reason", ""))
        assert {k: v[:2] for k, v in got.items()} == {a[:60]: (0.0, r) for a, r, _ in _WEATHER_EXPLOITS}
        for answer, _, words in _WEATHER_EXPLOITS:
            assert words in got[answer[:60]][2], (answer[:60], got[answer[:60]])
        for answer in _WEATHER_RIGHT + [_sentence(row)]:
            result = post_json(url, {**row, "response": _weather_response("Paris", answer)}).json()
            assert (result["reward"], result["failure_reason"]) == (1.0, "pass"), (answer, result["reason"])
        # The answer only in a reasoning item (the last item) is no answer.
        response = _weather_response("Paris", "Let me see.")
        response["output"].append(
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": _sentence(row)}]}
        )
        result = post_json(url, {**row, "response": response}).json()
        assert (result["reward"], result["failure_reason"]) == (0.0, "no_answer")
