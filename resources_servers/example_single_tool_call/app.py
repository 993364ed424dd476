"""example_single_tool_call: one tool (``get_weather``) and a verifier that checks the model used it.

Reward 1.0 iff the response contains a ``get_weather`` call for the task's ``expected_city``
(case-insensitive) and ends with an assistant message that answers in words and reports what the
tool said for that city: its condition (``rain``/``rainy``...) and its temperature. A message that
echoes the call or the tool's JSON back is not an answer and scores 0.0, as does anything else.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, ClassVar

import orjson
from fastapi import FastAPI
from pydantic import BaseModel, Field

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)
from nemo_gym.server.resources import function_calls

CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy")
# What an answer must say for each condition: "sun" matches "sunny", "sunshine", "sun is out".
CONDITION_STEMS = {
    "sunny": "sun",
    "cloudy": "cloud",
    "rainy": "rain",
    "windy": "wind",
    "snowy": "snow",
    "foggy": "fog",
}
_READING_RE = re.compile(r"^\s*(\w+)\s*,\s*(-?\d+) degrees Celsius\s*$")


def weather_for(city: str) -> str:
    """The made-up weather of ``city``: deterministic per city, so rollouts are reproducible."""
    digest = hashlib.sha256(city.strip().lower().encode()).digest()
    return f"{CONDITIONS[digest[0] % len(CONDITIONS)]}, {digest[1] % 35} degrees Celsius"


def weather_report(city: str) -> str:
    """A sentence that reports ``city``'s weather as the verifier wants it (for scripts and examples)."""
    condition, degrees = weather_for(city).split(" degrees")[0].split(", ")
    return f"It is {condition} in {city.strip()} right now, {degrees} degrees Celsius."


def answer_reports_reading(answer: str, weather: str) -> bool:
    """True iff ``answer`` is prose that states ``weather``'s condition and temperature.

    Prose: at least three words and no ``{``/``}`` (a JSON echo of the call or of the tool's output
    is not an answer). The condition counts by its stem (``rain`` for ``rainy``), the temperature as
    a whole number (``14`` in "14 degrees", "14°C", not in "140").
    """
    m = _READING_RE.match(weather)
    if m is None or "{" in answer or "}" in answer or len(re.findall(r"[^\W\d_]+", answer)) < 3:
        return False
    stem = CONDITION_STEMS.get(m.group(1).lower(), m.group(1).lower())
    said_condition = re.search(rf"\b{re.escape(stem)}", answer, re.IGNORECASE) is not None
    said_degrees = re.search(rf"(?<![\d.]){re.escape(m.group(2))}(?![\d])", answer) is not None
    return said_condition and said_degrees


class ExampleSingleToolCallConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = (
        ReverifyMode.STATELESS
    )  # verify reads only the row and the response


class GetWeatherRequest(BaseModel):
    city: str = Field(description="The city to get the weather for, e.g. 'Paris'.")


class GetWeatherResponse(BaseModel):
    city: str
    weather: str


class SingleToolCallVerifyRequest(BaseVerifyRequest):
    expected_city: str


class SingleToolCallVerifyResponse(BaseVerifyResponse):
    called_for_expected_city: bool  # a get_weather call named expected_city
    answer_reports_weather: bool  # the final message states that call's condition and temperature


class ExampleSingleToolCallServer(SimpleResourcesServer):
    config: ExampleSingleToolCallConfig

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/get_weather")(self.get_weather)
        return app

    async def get_weather(self, body: GetWeatherRequest) -> GetWeatherResponse:
        return GetWeatherResponse(city=body.city, weather=weather_for(body.city))

    async def verify(self, body: SingleToolCallVerifyRequest) -> SingleToolCallVerifyResponse:
        expected = body.expected_city.strip().lower()
        readings = _tool_outputs(body.response.output)
        weather: str | None = None  # what get_weather said for the expected city (last such call)
        called = False
        for call in function_calls(body.response, "get_weather"):
            try:
                city = str(orjson.loads(call.arguments).get("city", ""))
            except (orjson.JSONDecodeError, AttributeError):
                continue
            if city.strip().lower() == expected:
                called = True
                weather = readings.get(call.call_id, weather)
        last = body.response.output[-1] if body.response.output else None
        answer = _message_text(last) if last is not None else None
        reported = answer is not None and weather is not None and answer_reports_reading(answer, weather)
        return SingleToolCallVerifyResponse.from_request(
            body,
            reward=1.0 if (called and reported) else 0.0,
            called_for_expected_city=called,
            answer_reports_weather=reported,
        )


def _tool_outputs(items: list[Any]) -> dict[str, str]:
    """call_id -> the ``weather`` string of each get_weather output in ``items``."""
    out: dict[str, str] = {}
    for item in items:
        if getattr(item, "type", None) != "function_call_output":
            continue
        try:
            value = orjson.loads(item.output) if isinstance(item.output, str) else None
        except orjson.JSONDecodeError:
            continue
        if isinstance(value, dict) and isinstance(value.get("weather"), str):
            out[item.call_id] = value["weather"]
    return out


def _message_text(item: Any) -> str | None:
    """The text of an assistant ``message`` item; None for any other item."""
    if getattr(item, "type", None) != "message" or getattr(item, "role", None) != "assistant":
        return None
    content = item.content
    if isinstance(content, str):
        return content
    return "".join(str(getattr(part, "text", "") or "") for part in content or [])


if __name__ == "__main__":
    ExampleSingleToolCallServer.run_webserver()
