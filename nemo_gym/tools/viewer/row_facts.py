"""The compact facts the viewer keeps of one rollout row: reward, indices, agent, turns, tool calls and
their errors, token usage, a prompt preview, and flags for what looks wrong.

Contract
--------
* :func:`summarize_row` reads a parsed row (any shape: missing or odd fields count as absent, never an
  error) into a :class:`RowFacts`; the index (:mod:`nemo_gym.tools.viewer.index`) stores those as columns.
* ``FLAG_*`` bits say what looks wrong (:data:`ERROR_FLAGS` are the error ones); :data:`NO_INDEX`
  stands for a missing task or rollout index.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import orjson

PREVIEW_CHARS = 160

# Row flags (a bit set per row).
FLAG_TOOL_ERROR = 1  # some function_call_output looks like an error
FLAG_RESPONSE_ERROR = 2  # response.error set, or response.status is not "completed"
FLAG_MISSING_OUTPUT = 4  # a function_call without a matching function_call_output
FLAG_NO_REWARD = 8  # no numeric `reward`
ERROR_FLAGS = FLAG_TOOL_ERROR | FLAG_RESPONSE_ERROR | FLAG_MISSING_OUTPUT
NO_INDEX = -1  # task / rollout index missing

_ERROR_TEXT_RE = re.compile(r"^\s*(error\b|traceback \(most recent call last\))", re.IGNORECASE)
_WS_RE = re.compile(r"\s+")


def content_text(content: Any) -> str:
    """The text of a message ``content`` (a string, or a list of parts with ``text``/``refusal``)."""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                text = part.get("text", part.get("refusal"))
                if isinstance(text, str):
                    parts.append(text)
            elif isinstance(part, str):
                parts.append(part)
    return "".join(parts)


def looks_like_error(output: Any) -> bool:
    """Whether a tool output reads as an error.

    True when its text starts with ``Error`` (how the agent reports bad tool calls and tools that
    raised), contains a Python traceback, or is a JSON object with a non-empty ``error`` field.
    The page's script applies the same rule when it highlights outputs.
    """
    text = output if isinstance(output, str) else content_text(output)
    if _ERROR_TEXT_RE.search(text) or "Traceback (most recent call last)" in text:
        return True
    stripped = text.lstrip()
    if stripped.startswith("{") and '"error"' in stripped:
        try:
            parsed = orjson.loads(stripped)
        except orjson.JSONDecodeError:
            return False
        return isinstance(parsed, dict) and bool(parsed.get("error"))
    return False


def _as_int(value: Any) -> int:
    if isinstance(value, bool):
        return NO_INDEX
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return NO_INDEX


def _as_count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def prompt_preview(params: Any) -> str:
    """The last user message of ``responses_create_params.input``, whitespace collapsed, shortened."""
    if not isinstance(params, dict):
        return ""
    items = params.get("input")
    text = ""
    if isinstance(items, str):
        text = items
    elif isinstance(items, list):
        for item in items:
            if (
                isinstance(item, dict)
                and item.get("role") == "user"
                and item.get("type", "message") == "message"
            ):
                text = content_text(item.get("content"))
    text = _WS_RE.sub(" ", text).strip()
    return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 1] + "…"


@dataclass(slots=True)
class RowFacts:
    """The compact summary of one rollout (what the run list shows and filters on)."""

    reward: float
    task: int
    rollout: int
    agent: str
    turns: int
    tool_calls: int
    tool_errors: int
    input_tokens: int
    output_tokens: int
    total_tokens: int
    flags: int
    preview: str


def summarize_row(row: dict[str, Any]) -> RowFacts:
    """Facts of one rollout object.

    ``turns`` counts model turns: runs of model-produced output items (assistant messages,
    reasoning, function calls) separated by tool outputs. ``tool_calls`` counts ``function_call``
    items in ``response.output``.
    """
    reward_value = row.get("reward")
    flags = 0
    if isinstance(reward_value, (int, float)) and not isinstance(reward_value, bool):
        reward = float(reward_value)
    else:
        reward = math.nan
        flags |= FLAG_NO_REWARD
    agent_ref = row.get("agent_ref")
    agent = agent_ref.get("name") if isinstance(agent_ref, dict) else None
    response = row.get("response")
    response = response if isinstance(response, dict) else {}
    output = response.get("output")
    output = output if isinstance(output, list) else []
    if response.get("error") or response.get("status") not in (None, "completed"):
        flags |= FLAG_RESPONSE_ERROR
    turns = tool_calls = tool_errors = 0
    in_turn = False
    call_ids: set[str] = set()
    answered: set[str] = set()
    for item in output:
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind == "function_call_output":
            in_turn = False
            answered.add(str(item.get("call_id")))
            if looks_like_error(item.get("output", "")):
                tool_errors += 1
            continue
        if not in_turn:
            turns += 1
            in_turn = True
        if kind == "function_call":
            tool_calls += 1
            call_ids.add(str(item.get("call_id")))
    if tool_errors:
        flags |= FLAG_TOOL_ERROR
    if call_ids - answered:
        flags |= FLAG_MISSING_OUTPUT
    usage = response.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    return RowFacts(
        reward=reward,
        task=_as_int(row.get("_ng_task_index")),
        rollout=_as_int(row.get("_ng_rollout_index")),
        agent=str(agent) if agent is not None else "",
        turns=turns,
        tool_calls=tool_calls,
        tool_errors=tool_errors,
        input_tokens=_as_count(usage.get("input_tokens")),
        output_tokens=_as_count(usage.get("output_tokens")),
        total_tokens=_as_count(usage.get("total_tokens")),
        flags=flags,
        preview=prompt_preview(row.get("responses_create_params")),
    )
