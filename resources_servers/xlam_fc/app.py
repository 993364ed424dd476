"""xlam_fc: function calling (xLAM-style rows): the model's calls must match the expected calls.

Contract
--------
* A row offers function tools in ``responses_create_params.tools`` and carries ``expected_answers``:
  the calls a correct answer makes, ``[{"name": ..., "arguments": {...}}]`` (arguments as an object
  or JSON text). Field names follow upstream NeMo Gym's ``xlam_fc``. ``expected_answers`` is
  required (upstream defaults it to ``[]``); ``[]`` means "no call should be made".
* The tools are not executed: ``POST /<any tool name>`` answers a fixed note, so the agent loop
  goes on. The config runs one model turn (``max_steps: 1``): the calls of that turn are graded.
* Matching: each expected call is paired with a distinct predicted call of the same name whose
  arguments contain every expected argument with an equal value (order of calls does not matter).
  Extra predicted arguments (ones the expected call does not name) are allowed by default, as
  upstream grades; with ``exact_arguments: true`` a paired call's arguments must equal the expected
  ones exactly (no extras). Reward 1.0 iff every expected call is paired and the model made exactly
  as many calls as expected; else 0.0. ``expected_answers == []``: 1.0 iff no call was made.
* Only a valid call of an offered tool can pair (:func:`call_problem`): its arguments must be one JSON
  object with unique keys (text that is not JSON, a non-object or a key given twice can be read two
  ways), and, when the row's tool declares its ``properties`` with ``additionalProperties: false`` (as
  every upstream xLAM row does), name only declared arguments: an undeclared one is not an argument
  of that function, however the expected call reads (so "extra arguments" are declared optional ones).
  A call to a tool the row does not offer never pairs either. Values compare as JSON: same type
  (``true`` is not ``1``, ``"250"`` is not ``250``; ``250`` and ``250.0`` are one number), same keys,
  same list lengths.
* The response states the rule and what it let through: ``extra_arguments_allowed`` (the rule in
  force) and ``num_extra_arguments`` (arguments the model added beyond those of the expected call its
  call pairs with under upstream's rule, counted under either rule; aggregate metrics carry the means), besides ``num_expected``, ``num_predicted``, ``num_correct``, ``num_invalid_calls``,
  ``predicted_calls`` (arguments that are not a JSON object count as ``{}`` there) and
  ``failure_reason`` (why the reward is 0; ``None`` when it is 1).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from fastapi import FastAPI
from pydantic import BaseModel, Field, field_validator

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)


class XlamFcResourcesServerConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS
    exact_arguments: bool = Field(
        default=False,
        description="true: a call's arguments must equal the expected ones (no extras); "
        "false (upstream's rule): they must contain the expected ones",
    )


class ExpectedCall(BaseModel):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)

    @field_validator("arguments")
    @classmethod
    def _object(cls, value: dict[str, Any] | str) -> dict[str, Any] | str:
        if isinstance(value, str) and not isinstance(json.loads(value or "{}"), dict):
            raise ValueError("arguments given as text must be a JSON object")
        return value


class XlamFcVerifyRequest(BaseVerifyRequest):
    expected_answers: list[ExpectedCall] = Field(description="The calls a correct answer makes (may be []).")


class XlamFcVerifyResponse(BaseVerifyResponse):
    expected_answers: list[ExpectedCall]
    num_expected: int = 0
    num_predicted: int = 0
    num_correct: int = 0
    predicted_calls: list[dict[str, Any]] = Field(default_factory=list)
    extra_arguments_allowed: bool = True
    num_extra_arguments: int = 0
    num_invalid_calls: int = 0
    failure_reason: str | None = None


class DuplicateKeyError(ValueError):
    """A JSON object that gives one key twice."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(f"argument {key!r} is given twice")
        out[key] = value
    return out


def parse_call_arguments(arguments: Any) -> tuple[dict[str, Any] | None, str | None]:
    """(the arguments of a model's call, None) or (None, why they cannot be read as one JSON object)."""
    if isinstance(arguments, dict):
        return arguments, None
    if not isinstance(arguments, str):
        return None, "the arguments are not JSON text"
    try:
        value = json.loads(arguments or "{}", object_pairs_hook=_unique_keys)
    except DuplicateKeyError as e:
        return None, str(e)
    except (json.JSONDecodeError, RecursionError):
        return None, "the arguments are not valid JSON"
    if not isinstance(value, dict):
        return None, "the arguments are not a JSON object"
    return value, None


def offered_tools(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """Name -> parameters schema of each function tool a row offers."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        if isinstance(tool, dict) and tool.get("type", "function") == "function" and tool.get("name"):
            params = tool.get("parameters")
            out[str(tool["name"])] = params if isinstance(params, dict) else {}
    return out


def call_problem(name: str, arguments: dict[str, Any], tools: dict[str, dict[str, Any]]) -> str | None:
    """Why a call (arguments already read) is not a valid call of a tool in ``tools``; None if it is.
    A row that offers no tools at all leaves calls unchecked."""
    if not tools:
        return None
    if name not in tools:
        return f"{name!r} is not a tool the row offers"
    params = tools[name]
    declared = params.get("properties")
    if isinstance(declared, dict) and params.get("additionalProperties") is False:
        undeclared = sorted(set(arguments) - set(declared))
        if undeclared:
            return f"{name}: argument(s) {', '.join(map(repr, undeclared))} are not parameters of the tool"
    return None


def json_equal(got: Any, want: Any) -> bool:
    """Equal as JSON values: booleans are not numbers, ints and floats are one number type, objects need
    the same keys, lists the same length (recursively)."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    if isinstance(want, (int, float)):
        return isinstance(got, (int, float)) and got == want
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and got.keys() == want.keys()
            and all(json_equal(got[k], want[k]) for k in want)
        )
    if isinstance(want, list):
        return (
            isinstance(got, list)
            and len(got) == len(want)
            and all(json_equal(g, w) for g, w in zip(got, want, strict=True))
        )
    return type(got) is type(want) and got == want


def as_arguments(arguments: Any) -> dict[str, Any]:
    """Call arguments as a dict: JSON text parsed; anything that is not an object is ``{}``."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
    return arguments if isinstance(arguments, dict) else {}


def call_matches(predicted: dict[str, Any], expected: dict[str, Any], exact: bool = False) -> bool:
    """Same name, and the predicted arguments contain every expected one with an equal value (``exact``:
    and no others). A predicted call marked ``invalid`` (see :func:`call_problem`) never matches."""
    if predicted.get("invalid") or predicted.get("name") != expected.get("name"):
        return False
    got, want = as_arguments(predicted.get("arguments")), as_arguments(expected.get("arguments"))
    if exact and got.keys() != want.keys():
        return False
    return all(key in got and json_equal(got[key], value) for key, value in want.items())


def pair_calls(
    predicted: list[dict[str, Any]], expected: list[dict[str, Any]], exact: bool = False
) -> list[tuple[int, int]]:
    """(expected index, predicted index) of each expected call paired with a distinct predicted call."""
    used: set[int] = set()
    pairs = []
    for j, want in enumerate(expected):
        for i, got in enumerate(predicted):
            if i not in used and call_matches(got, want, exact):
                used.add(i)
                pairs.append((j, i))
                break
    return pairs


def grade_calls(
    predicted: list[dict[str, Any]], expected: list[dict[str, Any]], exact: bool = False
) -> tuple[float, int]:
    """(reward, number of expected calls matched by distinct predicted calls)."""
    if not expected:
        return (0.0 if predicted else 1.0), 0
    correct = len(pair_calls(predicted, expected, exact))
    return (1.0 if correct == len(expected) == len(predicted) else 0.0), correct


def count_extra_arguments(predicted: list[dict[str, Any]], expected: list[dict[str, Any]]) -> int:
    """Arguments of the predicted calls paired under upstream's rule that their expected call does not name."""
    return sum(
        len(
            as_arguments(predicted[i].get("arguments")).keys()
            - as_arguments(expected[j].get("arguments")).keys()
        )
        for j, i in pair_calls(predicted, expected)
    )


def failure_reason(
    reward: float, correct: int, n_predicted: int, n_expected: int, problems: list[str]
) -> str | None:
    """Why the calls earn nothing (None when they earn 1.0)."""
    if reward > 0:
        return None
    if not n_expected:
        return f"no call was expected, {n_predicted} made"
    if problems:
        return f"{len(problems)} call(s) are not valid calls of the offered tools: {problems[0]}"
    if n_predicted != n_expected:
        return f"{n_predicted} call(s) made, {n_expected} expected ({correct} matched)"
    return f"{correct} of {n_expected} expected call(s) matched (name and argument values)"


class XlamFcResourcesServer(SimpleResourcesServer):
    config: XlamFcResourcesServerConfig

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/{tool_name}")(self.any_tool)  # registered last: the real endpoints win
        return app

    async def any_tool(self, tool_name: str) -> dict[str, str]:
        """Every tool of a row: not executed, only recorded (the calls are what is graded)."""
        return {
            "tool": tool_name,
            "status": "recorded; this environment grades the calls, it does not run them",
        }

    async def verify(self, body: XlamFcVerifyRequest) -> XlamFcVerifyResponse:
        tools = offered_tools(body.responses_create_params.tools)
        predicted: list[dict[str, Any]] = []
        problems: list[str] = []
        for item in body.response.output:
            if item.type != "function_call":
                continue
            arguments, problem = parse_call_arguments(item.arguments)
            problem = problem and f"{item.name}: {problem}"
            problem = problem or call_problem(item.name, arguments or {}, tools)
            call: dict[str, Any] = {"name": item.name, "arguments": arguments or {}}
            if problem:
                call["invalid"] = True
                problems.append(problem)
            predicted.append(call)
        expected = [call.model_dump() for call in body.expected_answers]
        exact = self.config.exact_arguments
        reward, correct = grade_calls(predicted, expected, exact)
        reason = failure_reason(reward, correct, len(predicted), len(expected), problems)
        extra = count_extra_arguments(predicted, expected)
        for call in predicted:
            call.pop("invalid", None)
        fields = body.model_dump(
            exclude=set(XlamFcVerifyResponse.model_fields) - set(XlamFcVerifyRequest.model_fields)
        )
        return XlamFcVerifyResponse(
            **fields,
            reward=reward,
            num_expected=len(expected),
            num_predicted=len(predicted),
            num_correct=correct,
            predicted_calls=predicted,
            extra_arguments_allowed=not exact,
            num_extra_arguments=extra,
            num_invalid_calls=len(problems),
            failure_reason=reason,
        )


if __name__ == "__main__":
    XlamFcResourcesServer.run_webserver()
