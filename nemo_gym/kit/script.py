"""Scripted model turns: what ``responses_api_models/scripted_model`` plays, and what ``ng_reward_audit``
writes for it.

A **turn** is one model answer; a **rule** picks a list of turns for a conversation. The turn played is
the number of model turns already in the conversation, so the scripted model keeps no state. A rule
matches when every condition it gives holds: ``contains`` (a substring of the first user message) and
``rollout_id`` (the rollout the request belongs to: the ``/ng-rollout/<id>/`` prefix agents put on
model calls when ``observability_enabled`` is set). Rules too large or too many for a config file live
in a JSON or YAML file (:func:`load_rules`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import orjson
import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

# What an ``echo`` turn says, read from the conversation it answers (so a turn can repeat what the
# environment said without knowing it in advance).
EchoSource = Literal["prompt", "tool_outputs", "tool_outputs_plain"]
_PLAIN_DROPPED = str.maketrans("", "", '{}[]"')


class ScriptedToolCall(BaseModel):
    """One function call of a scripted turn."""

    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: Any = Field(default_factory=dict)

    def arguments_text(self) -> str:
        """The ``arguments`` string the model sends: a raw string as is, anything else as JSON."""
        return self.arguments if isinstance(self.arguments, str) else orjson.dumps(self.arguments).decode()


class ScriptedTurn(BaseModel):
    """One scripted model answer."""

    model_config = ConfigDict(extra="forbid")

    text: str | None = None
    # The message's text taken from the conversation: the first user message (``prompt``), every tool
    # output so far, one per line (``tool_outputs``), or the same without JSON's braces, brackets and
    # quotes (``tool_outputs_plain``).
    echo: EchoSource | None = None
    reasoning: str | None = None
    tool_calls: list[ScriptedToolCall] | None = None
    http_error: int | None = Field(default=None, ge=400, le=599)
    delay_s: float = Field(default=0.0, ge=0.0, le=600.0)
    incomplete: bool = False

    @model_validator(mode="after")
    def _one_text(self) -> ScriptedTurn:
        if self.text is not None and self.echo is not None:
            raise ValueError("a turn has either `text` or `echo`, not both")
        return self


class ScriptRule(BaseModel):
    """Turns played for the conversations that match every condition given (at least one)."""

    model_config = ConfigDict(extra="forbid")

    contains: str | None = None
    rollout_id: str | None = None
    turns: list[ScriptedTurn]

    @model_validator(mode="after")
    def _has_a_condition(self) -> ScriptRule:
        if self.contains is None and self.rollout_id is None:
            raise ValueError(
                "a rule needs `contains` (a substring of the first user message) or `rollout_id`"
            )
        return self

    def matches(self, first_user_text: str | None, rollout_id: str | None) -> bool:
        if self.rollout_id is not None and self.rollout_id != rollout_id:
            return False
        return self.contains is None or (first_user_text is not None and self.contains in first_user_text)


_RULES = TypeAdapter(list[ScriptRule])


def load_rules(path: str | Path) -> list[ScriptRule]:
    """The rules in a JSON or YAML file (a list of rules); a missing file or a bad rule is a
    ``ValueError`` naming the file and the rule's place."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the script rules file {path}: {exc.strerror or exc}") from None
    try:
        data = orjson.loads(raw) if path.suffix == ".json" else yaml.safe_load(raw)
    except (orjson.JSONDecodeError, yaml.YAMLError) as exc:
        raise ValueError(
            f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}"
        ) from None
    try:
        return _RULES.validate_python(data)
    except ValidationError as exc:
        where = "; ".join(f"rule {'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
        raise ValueError(f"{path}: {where}") from None


def echoed_text(source: EchoSource, items: list[dict[str, Any]], first_user_text: str | None) -> str:
    """What an ``echo`` turn says for a conversation of Responses input ``items``."""
    if source == "prompt":
        return first_user_text or ""
    outputs = []
    for item in items:
        if item.get("type") == "function_call_output":
            output = item.get("output")
            outputs.append(output if isinstance(output, str) else orjson.dumps(output).decode())
    text = "\n".join(outputs)
    return text.translate(_PLAIN_DROPPED) if source == "tool_outputs_plain" else text
