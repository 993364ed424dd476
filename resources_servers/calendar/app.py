"""calendar: multi-turn scheduling. Over several user turns the model is told events and time
constraints and keeps a calendar, printed as a JSON list in every answer; the verifier checks every
constraint of the row's ``exp_cal_state`` on the calendar of the model's last answer.

Contract
--------
* Row fields: ``responses_create_params`` (the conversation so far: system rules, earlier user and
  assistant turns, the last user turn) and ``exp_cal_state``: ``{"<event_id>": {"event_id", "duration"
  (minutes), "constraint" ("before 1:45pm" | "after 2pm" | "between 10am and 11:45am" | "at 11:15am" |
  null), "min_time", "max_time" (the day's window, "HH:MM")}}`` (NVIDIA NeMo Gym's field names).
* ``/verify`` reads the text of the last assistant message of ``response``; the calendar is the JSON
  list of objects in it (:func:`calendar_lists`; entries ``event_id``, ``event_name``, ``start_time``
  "HH:MM" or "2:30pm", ``duration`` minutes). The answer must show exactly one such list: several
  (even equal ones) are a hedge, not a calendar. Reward 1.0 iff: no ``<think>`` left in the answer,
  the calendar has exactly the expected event ids, no two events overlap, and every event has its
  expected duration, lies inside [min_time, max_time] and satisfies its constraint ("before T": ends
  at or before T; "after T": starts at or after T; "between A and B": both; "at T": starts at T).
  Entries are read strictly: ``event_id`` and ``duration`` are whole numbers (a JSON integer, an
  integral float such as 30.0, or a string of ASCII digits; never a boolean or 30.5) and times use
  ASCII digits. An empty ``exp_cal_state`` (nothing scheduled yet) scores 1.0 for an answer that is
  not blank and shows no event (upstream scores any answer 1.0 there).
* Reading the answer takes time linear in its length, whatever it holds (no recursive descent into
  nested brackets, no retry from every bracket), so no answer can crash or stall the verifier.
* The answer adds ``failure_reason`` (``pass``, ``no_answer``, ``think_found``, ``no_json_list``,
  ``several_calendars``, ``bad_event`` (an entry without a valid id, start time or duration),
  ``different_number_of_events``, ``conflicting_events``, ``constraint_violated``) and ``num_events``.
  Each is the model's doing.
* A row whose ``exp_cal_state`` cannot be read (an unparseable time or constraint) is a broken row:
  ``/verify`` answers 422 naming the event and the field, never reward 0 (upstream scores 0 then).
* Stateless: no tools, no session; stored rollouts re-verify (``GET /reverify_mode``: stateless).
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from fastapi import HTTPException
from pydantic import BaseModel

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseRunRequest,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)
from nemo_gym.openai_utils import NeMoGymResponse


class CalendarResourcesServerConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS


class ExpectedEvent(BaseModel):
    event_id: int
    duration: int
    constraint: str | None = None
    min_time: str = "00:00"
    max_time: str = "24:00"


class CalendarRunRequest(BaseRunRequest):
    exp_cal_state: dict[str, ExpectedEvent]


class CalendarVerifyRequest(CalendarRunRequest, BaseVerifyRequest):
    pass


class CalendarVerifyResponse(CalendarVerifyRequest, BaseVerifyResponse):
    failure_reason: str
    num_events: int


_TIME = re.compile(r"^(\d{1,2})(?::(\d{2}))?\s*([ap]\.?m\.?)?$", re.I | re.ASCII)


def minutes(text: str) -> int:
    """Minutes after midnight of "14:30", "2:30pm", "2 pm", "12am"; ValueError otherwise."""
    clean = text.replace("\u202f", " ").replace("\u00a0", " ").strip().lower()
    match = _TIME.match(clean)
    if not match:
        raise ValueError(f"not a time: {text!r}")
    hour, minute = int(match.group(1)), int(match.group(2) or 0)
    period = (match.group(3) or "").replace(".", "")
    if minute > 59 or (period and not 1 <= hour <= 12) or hour > 24:
        raise ValueError(f"not a time: {text!r}")
    if period:
        hour = hour % 12 + (12 if period == "pm" else 0)
    elif match.group(2) is None:
        raise ValueError(f"not a time (24-hour times need minutes, e.g. 14:00): {text!r}")
    return hour * 60 + minute


def constraint_window(constraint: str | None) -> tuple[int | None, int | None, int | None]:
    """(earliest start, latest end, exact start) a constraint imposes; ValueError if unreadable."""
    if constraint is None or not constraint.strip():
        return None, None, None
    text = constraint.replace("\u202f", " ").strip().lower()
    kind, _, rest = text.partition(" ")
    if kind == "before":
        return None, minutes(rest), None
    if kind == "after":
        return minutes(rest), None, None
    if kind == "at":
        return None, None, minutes(rest)
    if kind == "between":
        low, sep, high = rest.partition(" and ")
        if sep:
            return minutes(low), minutes(high), None
    raise ValueError(f"unknown constraint {constraint!r} (before T, after T, between A and B, at T)")


def last_answer_text(response: NeMoGymResponse) -> str:
    """The text of the response's last assistant message ('' if there is none)."""
    for item in reversed(response.output):
        if item.type == "message" and getattr(item, "role", "assistant") == "assistant":
            content = item.content
            if isinstance(content, str):
                return content
            return "".join(getattr(c, "text", "") or "" for c in content)
    return ""


# A JSON list of objects, found without recursion: each object's values are scalars, strings, or flat
# lists / objects of those (a calendar entry is flat). Every alternative starts with its own character,
# so a failed attempt never backtracks more than it read, and the whole search is linear in the text.
_STR = r'"(?:[^"\\]|\\.)*"'
_SCALAR = r'[^{}\[\]"]'
_FLAT = rf"(?:{_SCALAR}|{_STR})*"
_OBJECT = rf"\{{(?:{_SCALAR}|{_STR}|\[{_FLAT}\]|\{{{_FLAT}\}})*\}}"
_LIST_OF_OBJECTS = re.compile(rf"\[\s*{_OBJECT}(?:\s*,\s*{_OBJECT})*\s*\]")


def calendar_lists(text: str) -> list[list[dict[str, Any]]]:
    """Every JSON list of objects in ``text``, in order (see ``_LIST_OF_OBJECTS``)."""
    found = []
    for match in _LIST_OF_OBJECTS.finditer(text):
        try:
            value = json.loads(match.group())
        except (json.JSONDecodeError, RecursionError):
            continue
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            found.append(value)
    return found


def last_json_list(text: str) -> list[dict[str, Any]] | None:
    """The last JSON list of objects in ``text`` (None if there is none)."""
    lists = calendar_lists(text)
    return lists[-1] if lists else None


def whole_number(value: Any) -> int:
    """A JSON integer, an integral float (30.0) or a string of ASCII digits as an int; ValueError for
    anything else (booleans, 30.5, "30 min")."""
    if isinstance(value, bool):
        raise ValueError(f"not a whole number: {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        return int(value.strip())
    raise ValueError(f"not a whole number: {value!r}")


def grade(answer: str, expected: dict[str, ExpectedEvent]) -> tuple[float, str, int]:
    """(reward, failure_reason, number of events in the answer's calendar)."""
    if not answer.strip():
        return 0.0, "no_answer", 0
    if "<think>" in answer:
        return 0.0, "think_found", 0
    calendars = calendar_lists(answer)
    if len(calendars) > 1:
        return 0.0, "several_calendars", 0
    if not expected:  # nothing scheduled yet: any answer that shows no event
        return (0.0, "different_number_of_events", len(calendars[0])) if calendars else (1.0, "pass", 0)
    if not calendars:
        return 0.0, "no_json_list", 0
    calendar = calendars[0]
    events: dict[str, tuple[int, int]] = {}  # id -> (start, end)
    durations: dict[str, int] = {}
    for entry in calendar:
        try:
            event_id = str(whole_number(entry["event_id"]))
            start_time = entry["start_time"]
            if not isinstance(start_time, str):
                raise TypeError(f"start_time is not a string: {start_time!r}")
            start = minutes(start_time)
            duration = whole_number(entry["duration"])
        except (KeyError, TypeError, ValueError):
            return 0.0, "bad_event", len(calendar)
        if event_id in events or duration <= 0:
            return 0.0, "bad_event", len(calendar)
        events[event_id], durations[event_id] = (start, start + duration), duration
    if set(events) != set(expected):
        return 0.0, "different_number_of_events", len(events)
    spans = sorted(events.values())
    if any(spans[k][1] > spans[k + 1][0] for k in range(len(spans) - 1)):
        return 0.0, "conflicting_events", len(events)
    for event_id, exp in expected.items():
        start, end = events[event_id]
        earliest, latest, exact = constraint_window(exp.constraint)
        ok = (
            durations[event_id] == exp.duration
            and start >= minutes(exp.min_time)
            and end <= minutes(exp.max_time)
            and (earliest is None or start >= earliest)
            and (latest is None or end <= latest)
            and (exact is None or start == exact)
        )
        if not ok:
            return 0.0, "constraint_violated", len(events)
    return 1.0, "pass", len(events)


def check_expected(expected: dict[str, ExpectedEvent]) -> None:
    """Raise ValueError naming the event and field of an unreadable ``exp_cal_state``."""
    for key, exp in expected.items():
        if str(exp.event_id) != key:
            raise ValueError(f"exp_cal_state[{key!r}].event_id is {exp.event_id}, not {key}")
        for field in ("min_time", "max_time"):
            try:
                minutes(getattr(exp, field))
            except ValueError as e:
                raise ValueError(f"exp_cal_state[{key!r}].{field}: {e}") from None
        try:
            constraint_window(exp.constraint)
        except ValueError as e:
            raise ValueError(f"exp_cal_state[{key!r}].constraint: {e}") from None


class CalendarResourcesServer(SimpleResourcesServer):
    config: CalendarResourcesServerConfig

    async def verify(self, body: CalendarVerifyRequest) -> CalendarVerifyResponse:
        try:
            check_expected(body.exp_cal_state)
        except ValueError as e:
            raise HTTPException(422, f"broken row: {e}") from None
        reward, reason, count = grade(last_answer_text(body.response), body.exp_cal_state)
        return CalendarVerifyResponse.from_request(
            body, reward=reward, failure_reason=reason, num_events=count
        )


if __name__ == "__main__":
    CalendarResourcesServer.run_webserver()
