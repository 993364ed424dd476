"""Comparing the model's next action with the expert's: the action models and :class:`ActionComparator`.

Contract (names, categories and config keys as upstream NeMo Gym's module of the same path)
--------
* An action is a chat ``message``, one ``function_call`` (``name`` + ``arguments`` as JSON text), or a
  ``function_call_batch`` of calls. ``ExpectedAction`` is their discriminated union (by ``type``).
* A message is matched by any message (reward 1.0; :func:`..response_utils.extract_action` reads a
  blank message as no action); a call expected but a message given scores 0.
* One call vs one call: same name, arguments parse as one JSON object with unique keys (a key given
  twice, text nested past the parser's depth or anything else unreadable is ``ARGUMENTS_DECODE_ERROR``),
  and the values compare equal recursively: same JSON type (an int where a float is expected differs,
  and a boolean is never a number), same object keys, same list lengths, floats within
  ``floating_point_comparison_threshold``, and strings: exactly equal when either has fewer than two
  words, otherwise their lower-cased word multisets must overlap with
  ``|A ∩ B| / (|A| + |B|) >= word_count_similarity_threshold``.
* Several calls: expected and actual calls are paired by a maximum bipartite matching (order free).
  With ``parallel_tool_call_rewarding: false`` (default) the model must make exactly as many calls as
  expected (a surplus call is a hedge, never free) and the reward is 1.0 iff every expected call is
  matched. With it on, ``allow_subset`` / ``allow_superset`` decide whether fewer / more calls are
  admissible at all, and ``parallel_tool_call_reward_mode`` scores the admissible: ``binary_strict``
  (all required matched), ``fractional`` (matched / required) or ``f1`` (2 * matched / (expected +
  actual)); ``allow_superset`` with ``binary_strict`` or ``fractional`` lets surplus calls through
  unpaid-for (use ``f1`` to charge them).
* Every result carries a :class:`StepRewardCategory` saying why.
"""

from __future__ import annotations

import json
from collections import Counter
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator


class MessageAction(BaseModel):
    type: Literal["message"]
    content: str


class FunctionCallAction(BaseModel):
    type: Literal["function_call"]
    name: str
    arguments: str


class ExpectedFunctionCallAction(FunctionCallAction):
    """An expert call: its arguments must be a JSON object (bad data otherwise, refused at /verify)."""

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"expected arguments must be JSON text: {e}") from None
        if not isinstance(parsed, dict):
            raise ValueError("expected arguments must be a JSON object")
        return value


class FunctionCallBatchAction(BaseModel):
    type: Literal["function_call_batch"]
    calls: list[FunctionCallAction] = Field(min_length=1)


class ExpectedFunctionCallBatchAction(FunctionCallBatchAction):
    calls: list[ExpectedFunctionCallAction] = Field(min_length=1)


ExpectedAction = Annotated[
    MessageAction | ExpectedFunctionCallAction | ExpectedFunctionCallBatchAction, Field(discriminator="type")
]
Action = MessageAction | FunctionCallAction | FunctionCallBatchAction


class DuplicateKeyError(ValueError):
    """A model's call arguments give one key twice: two parsers may read two different calls."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key)
        out[key] = value
    return out


def get_tool_calls(action: Action) -> list[FunctionCallAction]:
    if isinstance(action, FunctionCallBatchAction):
        return list(action.calls)
    return [action] if isinstance(action, FunctionCallAction) else []


class StepRewardCategory(StrEnum):
    NO_ACTION_FOUND = "No tool call or chat message was found in the response"
    NO_EXPECTED_TOOL_CALL = "No tool call was found when one was expected"
    EXPECTED_CHAT_MESSAGE_FOUND = "A chat message was found as expected"
    NO_EXPECTED_CHAT_MESSAGE = "A tool call was executed when a chat message was expected"
    UNEXPECTED_TOOL = "The tool in a tool call is not the expected tool"
    ARGUMENTS_DECODE_ERROR = (
        "An error occurred when decoding the arguments string in a tool call as a JSON object"
    )
    ARGUMENT_VALUE_TYPE_DIFFERENT = (
        "The type of an argument value in a tool call is different than the expected type"
    )
    ARGUMENT_OBJECT_KEYS_DIFFERENT = "The keys in an object in an argument value in a tool call are different than the keys in the expected object"
    ARGUMENT_LIST_LENGTH_DIFFERENT = (
        "A list in an argument value in a tool call has a different length than the expected list"
    )
    ARGUMENT_VALUE_DIFFERENT = "An argument value in a tool call is different than the expected value"
    EXPECTED_TOOL_CALL = "A tool call that matches the expected tool call was found"
    FUNCTION_CALL_BATCH_LENGTH_DIFFERENT = "The number of tool calls in a batch is different than expected"
    EXPECTED_TOOL_CALL_BATCH = "A tool-call batch that matches the expected tool calls was found"


class ParallelToolCallRewardMode(StrEnum):
    BINARY_STRICT = "binary_strict"
    FRACTIONAL = "fractional"
    F1 = "f1"


class ActionComparisonResult(BaseModel):
    reward: float
    category: StepRewardCategory


class ToolCallComparatorConfig(BaseModel):
    word_count_similarity_threshold: float = Field(ge=0.0, le=0.5)
    floating_point_comparison_threshold: float = 1e-6
    parallel_tool_call_rewarding: bool = False
    allow_subset: bool = False
    allow_superset: bool = False
    parallel_tool_call_reward_mode: ParallelToolCallRewardMode = ParallelToolCallRewardMode.BINARY_STRICT


def find_maximum_matching(candidates: list[list[int]]) -> dict[int, int]:
    """Maximum bipartite matching (augmenting paths); ``candidates[e]`` = actual indices expected call
    ``e`` matches. Returns {actual index: expected index}."""
    matched: dict[int, int] = {}

    def augment(e: int, seen: set[int]) -> bool:
        for a in candidates[e]:
            if a in seen:
                continue
            seen.add(a)
            if a not in matched or augment(matched[a], seen):
                matched[a] = e
                return True
        return False

    for e in sorted(range(len(candidates)), key=lambda i: len(candidates[i])):
        augment(e, set())
    return matched


class ActionComparator(BaseModel):
    config: ToolCallComparatorConfig

    def compare_action(self, expected: Action, actual: Action) -> ActionComparisonResult:
        if isinstance(expected, MessageAction):
            if isinstance(actual, MessageAction):
                return ActionComparisonResult(
                    reward=1.0, category=StepRewardCategory.EXPECTED_CHAT_MESSAGE_FOUND
                )
            return ActionComparisonResult(reward=0.0, category=StepRewardCategory.NO_EXPECTED_CHAT_MESSAGE)
        if isinstance(actual, MessageAction):
            return ActionComparisonResult(reward=0.0, category=StepRewardCategory.NO_EXPECTED_TOOL_CALL)
        return self.compare_tool_calls(get_tool_calls(expected), get_tool_calls(actual))

    def compare_tool_calls(
        self, expected: list[FunctionCallAction], actual: list[FunctionCallAction]
    ) -> ActionComparisonResult:
        if len(expected) == 1 and len(actual) == 1:
            return self.compare_tool_call(expected[0], actual[0])
        if not self._admissible(len(expected), len(actual)):
            return ActionComparisonResult(
                reward=0.0, category=StepRewardCategory.FUNCTION_CALL_BATCH_LENGTH_DIFFERENT
            )
        candidates: list[list[int]] = []
        reasons: list[StepRewardCategory] = []
        for want in expected:
            hits, reason = [], StepRewardCategory.UNEXPECTED_TOOL
            for i, got in enumerate(actual):
                result = self.compare_tool_call(want, got)
                if result.reward == 1.0:
                    hits.append(i)
                elif reason == StepRewardCategory.UNEXPECTED_TOOL:
                    reason = result.category  # the first near miss past the tool name explains it best
            candidates.append(hits)
            reasons.append(reason)
        matching = find_maximum_matching(candidates)
        reward = self._score(len(matching), len(expected), len(actual))
        if reward == 1.0:
            ok = (
                StepRewardCategory.EXPECTED_TOOL_CALL
                if len(expected) == 1
                else StepRewardCategory.EXPECTED_TOOL_CALL_BATCH
            )
            return ActionComparisonResult(reward=reward, category=ok)
        unmatched = [e for e in range(len(expected)) if e not in set(matching.values())]
        if not unmatched or len(matching) == len(actual):
            category = StepRewardCategory.FUNCTION_CALL_BATCH_LENGTH_DIFFERENT
        else:
            category = reasons[unmatched[0]]
        return ActionComparisonResult(reward=reward, category=category)

    def _admissible(self, n_expected: int, n_actual: int) -> bool:
        if n_actual == n_expected:
            return True
        if not self.config.parallel_tool_call_rewarding:
            return False  # surplus or missing calls: a hedge is never free
        return self.config.allow_subset if n_actual < n_expected else self.config.allow_superset

    def _score(self, n_matched: int, n_expected: int, n_actual: int) -> float:
        cfg = self.config
        if not cfg.parallel_tool_call_rewarding:
            return 1.0 if n_matched == n_expected else 0.0
        if cfg.parallel_tool_call_reward_mode == ParallelToolCallRewardMode.F1:
            return 2 * n_matched / (n_expected + n_actual) if n_expected + n_actual else 0.0
        required = min(n_expected, n_actual) if cfg.allow_subset else n_expected
        if cfg.parallel_tool_call_reward_mode == ParallelToolCallRewardMode.FRACTIONAL:
            return n_matched / required if required else 0.0
        return 1.0 if n_matched == required else 0.0

    def compare_tool_call(
        self, expected: FunctionCallAction, actual: FunctionCallAction
    ) -> ActionComparisonResult:
        if expected.name != actual.name:
            return ActionComparisonResult(reward=0.0, category=StepRewardCategory.UNEXPECTED_TOOL)
        want = json.loads(expected.arguments)
        try:
            got = json.loads(actual.arguments, object_pairs_hook=_unique_keys)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, DuplicateKeyError):
            return ActionComparisonResult(reward=0.0, category=StepRewardCategory.ARGUMENTS_DECODE_ERROR)
        problem = self.argument_difference(want, got)
        if problem is None:
            return ActionComparisonResult(reward=1.0, category=StepRewardCategory.EXPECTED_TOOL_CALL)
        return ActionComparisonResult(reward=0.0, category=problem)

    def argument_difference(self, want: Any, got: Any) -> StepRewardCategory | None:
        """None when ``got`` matches ``want`` (rules in the module docstring), else why not."""
        if not isinstance(got, type(want)) or isinstance(got, bool) != isinstance(want, bool):
            return StepRewardCategory.ARGUMENT_VALUE_TYPE_DIFFERENT
        if isinstance(want, dict):
            if set(want) != set(got):
                return StepRewardCategory.ARGUMENT_OBJECT_KEYS_DIFFERENT
            return next(
                (p for k in want if (p := self.argument_difference(want[k], got[k])) is not None), None
            )
        if isinstance(want, list):
            if len(want) != len(got):
                return StepRewardCategory.ARGUMENT_LIST_LENGTH_DIFFERENT
            return next(
                (
                    p
                    for w, g in zip(want, got, strict=True)
                    if (p := self.argument_difference(w, g)) is not None
                ),
                None,
            )
        if isinstance(want, float):
            close = abs(got - want) < self.config.floating_point_comparison_threshold
            return None if close else StepRewardCategory.ARGUMENT_VALUE_DIFFERENT
        if isinstance(want, str):
            a, b = Counter(want.strip().lower().split()), Counter(got.strip().lower().split())
            if a.total() < 2 or b.total() < 2:
                return None if want == got else StepRewardCategory.ARGUMENT_VALUE_DIFFERENT
            overlap = (a & b).total() / (a.total() + b.total())
            return (
                None
                if overlap >= self.config.word_count_similarity_threshold
                else StepRewardCategory.ARGUMENT_VALUE_DIFFERENT
            )
        return None if want == got else StepRewardCategory.ARGUMENT_VALUE_DIFFERENT
