"""calendar against real servers: right and wrong final calendars for every example row, answered by
the scripted model after the row's earlier turns; broken rows; the grading rules themselves."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest

from nemo_gym.cli import RunHelper
from nemo_gym.tools.testing import example_rows, post_json, run_rollout, running_servers, server_url
from resources_servers.calendar.app import ExpectedEvent, calendar_lists, grade, last_json_list, minutes

ENV = "calendar"
CONFIG = f"resources_servers/{ENV}/configs/{ENV}.yaml"
AGENT = f"{ENV}_simple_agent"
ROWS = example_rows(ENV)


def cal(*events: tuple[int, str, int]) -> str:
    return json.dumps(
        [{"event_id": i, "event_name": f"event {i}", "start_time": s, "duration": d} for i, s, d in events]
    )


RIGHT = [
    "Moved it. " + cal((1, "10:30", 60), (0, "14:00", 30)),
    cal((0, "10:00", 15), (1, "10:15", 90)),
    "Here you go:\n" + cal((2, "10:00", 30), (1, "13:00", 60), (0, "14:00", 45)),
    "Set an agenda and a timekeeper. Calendar: " + cal((0, "12:00", 120)),
    cal((1, "10:00", 45), (0, "11:15", 30), (2, "11:45", 45)),
]
WRONG = [
    (cal((0, "10:00", 30), (1, "10:30", 60)), "constraint_violated"),  # ignored "after 2pm"
    (cal((0, "10:00", 15), (1, "11:00", 90)), "constraint_violated"),  # ends 12:30, not before noon
    (cal((2, "13:30", 30), (1, "13:00", 60), (0, "14:00", 45)), "conflicting_events"),
    ("Set an agenda and a timekeeper.", "no_json_list"),  # forgot to show the calendar
    (cal((1, "10:00", 30), (0, "11:15", 30), (2, "11:45", 45)), "constraint_violated"),  # still 30 minutes
]


def _last_user(row: dict[str, Any]) -> str:
    return row["responses_create_params"]["input"][-1]["content"]


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    # The scripted model picks turns by the FIRST user message (distinct per row); a tag appended to
    # it selects the wrong or <think> variant (tagged rules come first).
    # The scripted model plays turn N when the input already holds N model turns, so the row's earlier
    # assistant turns are skipped with placeholders.
    scripts = []
    for i, row in enumerate(ROWS):
        first = row["responses_create_params"]["input"][1]["content"]
        earlier = [{"text": "(earlier turn)"}] * sum(
            m["role"] == "assistant" for m in row["responses_create_params"]["input"]
        )
        scripts.append({"contains": f"{first} [wrong]", "turns": [*earlier, {"text": WRONG[i][0]}]})
        scripts.append(
            {"contains": f"{first} [think]", "turns": [*earlier, {"text": "<think>hmm</think>" + RIGHT[i]}]}
        )
        scripts.append({"contains": first, "turns": [*earlier, {"text": RIGHT[i]}]})
    extra = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": scripts}}}}
    with running_servers([CONFIG], extra) as h:
        yield h


def _variant(row: dict[str, Any], tag: str) -> dict[str, Any]:
    out = copy.deepcopy(row)
    out["responses_create_params"]["input"][1]["content"] += f" [{tag}]"
    return out


def test_rows_are_multi_turn_and_in_upstream_format() -> None:
    assert len(ROWS) == 5
    for row in ROWS:
        roles = [m["role"] for m in row["responses_create_params"]["input"]]
        assert roles[0] == "system" and roles[-1] == "user" and roles.count("user") >= 2
        assert "assistant" in roles
        for key, exp in row["exp_cal_state"].items():
            assert set(exp) == {"event_id", "duration", "constraint", "min_time", "max_time"}
            assert str(exp["event_id"]) == key


def test_right_calendars_score_one(helper: RunHelper) -> None:
    for row in ROWS:
        result = run_rollout(helper, AGENT, row)
        assert result["reward"] == 1.0, (_last_user(row), result["failure_reason"])
        assert result["failure_reason"] == "pass" and result["num_events"] == len(row["exp_cal_state"])


def test_wrong_calendars_score_zero_with_the_reason(helper: RunHelper) -> None:
    for i, row in enumerate(ROWS):
        result = run_rollout(helper, AGENT, _variant(row, "wrong"))
        assert (result["reward"], result["failure_reason"]) == (0.0, WRONG[i][1]), i
        think = run_rollout(helper, AGENT, _variant(row, "think"))
        assert (think["reward"], think["failure_reason"]) == (0.0, "think_found")


def test_broken_row_is_an_error_not_zero(helper: RunHelper) -> None:
    stored = run_rollout(helper, AGENT, ROWS[0])
    for field, value, message in (
        ("constraint", "sometime soon", "unknown constraint"),
        ("min_time", "ten", "not a time"),
        ("event_id", 7, "event_id is 7"),
    ):
        row = copy.deepcopy(stored)
        row["exp_cal_state"]["0"][field] = value
        resp = post_json(server_url(helper, ENV) + "/verify", row)
        assert resp.status_code == 422 and message in resp.text and "exp_cal_state['0']" in resp.text, (
            resp.text
        )
    # The stored rollout re-verifies to the same reward.
    again = post_json(server_url(helper, ENV) + "/verify", stored)
    assert again.status_code == 200 and again.json()["reward"] == 1.0


def _exp(**events: tuple[int, str | None]) -> dict[str, ExpectedEvent]:
    return {
        k: ExpectedEvent(event_id=int(k), duration=d, constraint=c, min_time="10:00", max_time="16:00")
        for k, (d, c) in events.items()
    }


def test_grading_rules() -> None:
    exp = _exp(**{"0": (60, "before 1:45\u202fpm"), "1": (30, None)})
    assert grade(cal((0, "12:45", 60), (1, "10:00", 30)), exp) == (1.0, "pass", 2)
    assert grade(cal((0, "12:46", 60), (1, "10:00", 30)), exp)[1] == "constraint_violated"  # ends 13:46
    assert grade(cal((0, "10:00", 60), (1, "10:59", 30)), exp)[1] == "conflicting_events"
    assert grade(cal((0, "10:00", 60), (1, "11:00", 30)), exp)[0] == 1.0  # touching is not overlapping
    assert grade(cal((0, "10:00", 60)), exp)[1] == "different_number_of_events"
    assert grade(cal((0, "10:00", 60), (1, "15:45", 30)), exp)[1] == "constraint_violated"  # past 16:00
    assert grade('[{"event_id": 0}]', exp)[1] == "bad_event"
    assert grade("", exp)[1] == "no_answer"
    # Nothing scheduled yet: an answer that is not blank and shows no event.
    assert grade("anything", {})[0] == 1.0 and grade("Nothing yet: []", {})[0] == 1.0
    assert (
        grade(" ", {})[1] == "no_answer"
        and grade(cal((0, "10:00", 60)), {})[1] == "different_number_of_events"
    )
    # The one calendar of the answer is graded; 12-hour start times are read too.
    after = json.dumps(
        [
            {"event_id": 0, "start_time": "2pm", "duration": 60},
            {"event_id": 1, "start_time": "10:00", "duration": 30},
        ]
    )
    exp_after = _exp(**{"0": (60, "after 1pm"), "1": (30, None)})
    assert last_json_list("Done: " + after)[0]["start_time"] == "2pm"
    assert grade("Done: " + after, exp_after)[0] == 1.0
    # Several calendars in one answer (even "before" and "after", or one shown twice) are a hedge.
    assert grade("Before: " + cal((0, "10:00", 60)) + " After: " + after, exp_after) == (
        0.0,
        "several_calendars",
        0,
    )
    assert grade(after + "\n" + after, exp_after)[1] == "several_calendars"
    # Entries are read strictly: whole numbers for ids and durations, ASCII digits in times.
    good = {"event_id": 0, "event_name": "x", "start_time": "14:00", "duration": 60}
    assert (
        grade(
            json.dumps([good, {**good, "event_id": "1", "start_time": "10:00", "duration": 30.0}]), exp_after
        )[0]
        == 1.0
    )
    for bad in (
        {"event_id": False},
        {"event_id": 0.4},
        {"duration": 60.5},
        {"duration": True},
        {"start_time": "１４:００"},
        {"start_time": 14},
        {"duration": "60 min"},
    ):
        answer = json.dumps([{**good, **bad}, {**good, "event_id": 1, "start_time": "10:00", "duration": 30}])
        assert grade(answer, exp_after)[1] == "bad_event", bad
    # Reading is linear and never recursive: floods of brackets find nothing, nested values are read.
    assert calendar_lists("[" * 200_000 + '[{"event_id": ' * 20_000) == []
    nested = '[{"event_id": 0, "tags": ["a", "b"], "where": {"room": "[3] {b}"}}]'
    assert calendar_lists("x " + "[" * 5000 + nested) == [json.loads(nested)]
    assert [minutes(t) for t in ("12am", "12pm", "9:05 a.m.", "16:00")] == [0, 720, 545, 960]
    with pytest.raises(ValueError):
        minutes("13pm")
