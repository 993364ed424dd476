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
* The response states the rule and what it let through: ``extra_arguments_allowed`` (the rule in
  force) and ``num_extra_arguments`` (arguments the model added beyond those of the expected call its
  call pairs with under upstream's rule, counted under either rule; aggregate metrics carry the means), besides ``num_expected``, ``num_predicted``, ``num_correct`` and ``predicted_calls``
  (arguments that are not a JSON object count as ``{}``).
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
    and no others)."""
    if predicted.get("name") != expected.get("name"):
        return False
    got, want = as_arguments(predicted.get("arguments")), as_arguments(expected.get("arguments"))
    if exact and got.keys() != want.keys():
        return False
    return all(key in got and got[key] == value for key, value in want.items())


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
        predicted = [
            {"name": item.name, "arguments": as_arguments(item.arguments)}
            for item in body.response.output
            if item.type == "function_call"
        ]
        expected = [call.model_dump() for call in body.expected_answers]
        exact = self.config.exact_arguments
        reward, correct = grade_calls(predicted, expected, exact)
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
            num_extra_arguments=count_extra_arguments(predicted, expected),
        )


if __name__ == "__main__":
    XlamFcResourcesServer.run_webserver()
