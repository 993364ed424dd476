"""example_single_tool_call: one tool (``get_weather``) and a verifier that checks the model used it.

Reward 1.0 iff the response contains a ``get_weather`` call for the task's ``expected_city``
(case-insensitive) and ends with an assistant message that answers in one plain sentence with ONE
reading: the condition the tool said for that city (``rain``/``rainy``...) and its temperature, and no
other condition or temperature. Anything else scores 0.0, with ``failure_reason`` and ``reason``:
``wrong_city`` (no call for the city), ``no_answer`` (the last item is not an assistant message),
``not_prose`` (the tool's output echoed: JSON braces, ``city:``/``weather:`` keys, fewer than three words
of its own; longer than ``MAX_ANSWER_CHARS``; letters of another script, look-alikes of Latin ones),
``several_readings`` (more than one condition or temperature: a list of them all is not an answer) and
``wrong_reading`` (the tool's condition or temperature not said). See :func:`judge_answer`.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
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
# The words that say each condition ("sunshine", "raining", "snowfall"): an answer says the tool's one.
CONDITION_WORDS = {
    "sunny": ("sun", "suns", "sunny", "sunnier", "sunniest", "sunshine", "sunlight", "sunlit"),
    "cloudy": ("cloud", "clouds", "cloudy", "cloudier", "cloudiest", "clouded"),
    "rainy": ("rain", "rains", "rainy", "rainier", "rainiest", "raining", "rained", "rainfall"),
    "windy": ("wind", "winds", "windy", "windier", "windiest"),
    "snowy": ("snow", "snows", "snowy", "snowier", "snowiest", "snowing", "snowed", "snowfall"),
    "foggy": ("fog", "fogs", "foggy", "foggier", "foggiest"),
}
_CONDITION_OF = {word: condition for condition, words in CONDITION_WORDS.items() for word in words}
# A condition after one of these (within three words) is denied, not stated: "no rain", "isn't windy".
_NEGATIONS = frozenset("no not without never nor neither isn't aren't wasn't won't don't doesn't".split())
MAX_ANSWER_CHARS = 1000  # one sentence is asked; a longer answer is not read
MIN_OWN_WORDS = 3  # words that are not the tool's output: keys, city, condition, "degrees", "Celsius"
_READING_RE = re.compile(r"^\s*(\w+)\s*,\s*(-?\d+) degrees Celsius\s*$")
_WORD = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)?")
_KEY = re.compile(r"\b(?:city|weather)\b\W{0,2}\s*[:=]", re.IGNORECASE)  # city:  "weather":  city =
# A number standing on its own (not glued to a word), its sign read: "-7", "+7"; then, optionally, a
# Fahrenheit unit right after it.
_NUMBER = re.compile(r"(?<![\w.])([-+]?)(\d+(?:\.\d+)?)(\s*(?:°|º|degrees?)?\s*(?:f\b|fahrenheit))?", re.I)
_DASHES = str.maketrans(dict.fromkeys("\u2010\u2011\u2012\u2013\u2014\u2212", "-") | {"\u2019": "'"})


def weather_for(city: str) -> str:
    """The made-up weather of ``city``: deterministic per city, so rollouts are reproducible."""
    digest = hashlib.sha256(city.strip().lower().encode()).digest()
    return f"{CONDITIONS[digest[0] % len(CONDITIONS)]}, {digest[1] % 35} degrees Celsius"


def weather_report(city: str) -> str:
    """A sentence that reports ``city``'s weather as the verifier wants it (for scripts and examples)."""
    condition, degrees = weather_for(city).split(" degrees")[0].split(", ")
    return f"It is {condition} in {city.strip()} right now, {degrees} degrees Celsius."


def _fold(text: str) -> str:
    """``text`` as it reads: compatibility forms folded (full-width and mathematical letters and digits to
    plain ones), accents, combining marks and invisible characters dropped, dashes and minus signs as
    ``-``, lower case."""
    kept = "".join(
        c for c in unicodedata.normalize("NFKD", text) if unicodedata.category(c) not in _INVISIBLE
    )
    return unicodedata.normalize("NFKC", kept).translate(_DASHES).lower()


_INVISIBLE = frozenset(("Mn", "Me", "Cf"))


def _stated_conditions(words: list[str]) -> list[str]:
    """The conditions ``words`` state, in order (a condition after a negation is not stated)."""
    stated: list[str] = []
    for i, word in enumerate(words):
        condition = _CONDITION_OF.get(word)
        if condition and not _NEGATIONS & set(words[max(0, i - 3) : i]) and condition not in stated:
            stated.append(condition)
    return stated


def judge_answer(answer: str, weather: str, city: str = "") -> tuple[str, str]:
    """(``pass`` / ``not_prose`` / ``several_readings`` / ``wrong_reading``, the reason for a person) of the
    final ``answer`` to the tool's reading ``weather`` (e.g. ``"rainy, 14 degrees Celsius"``) for ``city``.

    * Prose: at most ``MAX_ANSWER_CHARS``; Latin letters only (a Cyrillic or Greek look-alike would hide a
      word from the checks below); no ``{``/``}`` and no ``city:``/``weather:`` key (the tool's output
      echoed); at least ``MIN_OWN_WORDS`` words that are not words of the tool's output.
    * One reading: the tool's condition stated (by a word of ``CONDITION_WORDS``, not after a negation) and
      no other; the tool's temperature as a number (``14`` in "14 degrees", "14°C"; ``-14`` and ``140`` are
      other numbers) and no other number, except that temperature in Fahrenheit (``57°F``, rounded either
      way) right after it.
    """
    m = _READING_RE.match(weather)
    if m is None:
        return "wrong_reading", f"the tool's reading {weather[:80]!r} is not a condition and a temperature"
    if len(answer) > MAX_ANSWER_CHARS:
        return "not_prose", f"longer than {MAX_ANSWER_CHARS} characters: one sentence is asked"
    text = _fold(answer)
    foreign = sorted({c for c in text if c.isalpha() and not unicodedata.name(c, "").startswith("LATIN")})
    if foreign:
        return (
            "not_prose",
            f"letters of another script ({''.join(foreign[:8])}): look-alikes of Latin letters",
        )
    if "{" in text or "}" in text:
        return "not_prose", "JSON braces: the call or the tool's output echoed, not an answer"
    if _KEY.search(text):
        return "not_prose", "the tool's output echoed with its keys (city:, weather:), not an answer"
    words = _WORD.findall(text)
    echoed = {"city", "weather", *_WORD.findall(_fold(f"{city} {weather}"))}
    own = [w for w in words if w not in echoed]
    if len(own) < MIN_OWN_WORDS:
        return "not_prose", (
            f"{len(own)} words of its own besides the tool's output (at least {MIN_OWN_WORDS}): "
            "the output echoed, not a sentence"
        )
    condition, degrees = m.group(1).lower(), float(m.group(2))
    stated = _stated_conditions(words)
    if len(stated) > 1:
        return "several_readings", f"more than one condition ({', '.join(stated)}): the tool said {condition}"
    numbers: list[float] = []
    for sign, digits, fahrenheit in _NUMBER.findall(text):
        value = -float(digits) if sign == "-" else float(digits)
        converted = degrees * 9 / 5 + 32
        if fahrenheit and abs(value - converted) < 1:  # the same temperature in Fahrenheit
            continue
        if value not in numbers:
            numbers.append(value)
    if len(numbers) > 1:
        shown = ", ".join(f"{n:g}" for n in numbers[:8]) + (", ..." if len(numbers) > 8 else "")
        return "several_readings", f"more than one temperature ({shown}): the tool said {degrees:g}"
    if condition not in stated:
        return "wrong_reading", f"does not say it is {condition}, as the tool said"
    if degrees not in numbers:
        return "wrong_reading", f"does not give the temperature {degrees:g} that the tool said"
    return "pass", f"says {condition} and {degrees:g} degrees, as the tool did"


def answer_reports_reading(answer: str, weather: str, city: str = "") -> bool:
    """True iff :func:`judge_answer` passes ``answer``: one plain sentence stating ``weather``'s
    condition and temperature, and no other."""
    return judge_answer(answer, weather, city)[0] == "pass"


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
    failure_reason: str  # pass, wrong_city, no_answer, not_prose, several_readings, wrong_reading
    reason: str  # for a person: why it scored so


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
        reported = False
        if not called:
            verdict = "wrong_city", f"no get_weather call for {body.expected_city!r}"
        elif weather is None:
            verdict = (
                "wrong_city",
                f"the get_weather call for {body.expected_city!r} has no reading in the response",
            )
        elif answer is None or not answer.strip():
            verdict = "no_answer", "the response does not end with an assistant message"
        else:
            verdict = judge_answer(answer, weather, body.expected_city)
            reported = verdict[0] == "pass"
        return SingleToolCallVerifyResponse.from_request(
            body,
            reward=1.0 if (called and reported) else 0.0,
            called_for_expected_city=called,
            answer_reports_weather=reported,
            failure_reason=verdict[0],
            reason=verdict[1],
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
