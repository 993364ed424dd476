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
