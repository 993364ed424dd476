"""workplace_assistant against real servers: scripted right and wrong trajectories end to end, order
independence, replay re-verification, bad rows, and isolation of 500 concurrent sessions.

The scripted model picks its turns by a substring of the row's user message; ``[variant=...]`` tags
appended to a row's message select other trajectories for the same task.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from nemo_gym.auth import auth_headers, client_token_for_url
from nemo_gym.cli import RunHelper
from nemo_gym.server.asgi.sessions import cookie_name_for
from nemo_gym.tools.testing import example_rows, post_json, run_rollout, running_servers, server_url
from resources_servers.workplace_assistant.world import (
    TOOLS,
    ToolError,
    apply_calls,
    new_world,
    state_differences,
)

ENV = "workplace_assistant"
CONFIG = f"resources_servers/{ENV}/configs/{ENV}.yaml"
AGENT = f"{ENV}_simple_agent"
COOKIE = cookie_name_for(ENV)
ROWS = example_rows(ENV)
PRIYA = "priya.raman@atlas-works.com"
FATIMA = "fatima.haddad@atlas-works.com"
DONE = {"text": "All done."}


def call(tool: str, /, **arguments: Any) -> dict[str, Any]:
    return {"tool_calls": [{"name": tool, "arguments": arguments}]}


def _gt_turns(row: dict[str, Any]) -> list[dict[str, Any]]:
    return [call(c["name"], **json.loads(c["arguments"])) for c in row["ground_truth"]]


# Correct trajectories: lookups first (as a model must: it does not know the ids), then the actions.
LOOKUPS: list[list[dict[str, Any]]] = [
    [call("email_search_emails", query="churn samir")],
    [
        call(
            "calendar_search_events",
            query="chloe",
            time_min="2023-12-01 00:00:00",
            time_max="2023-12-01 23:59:59",
        ),
        call("company_directory_find_email_address", name="priya"),
    ],
    [
        call("company_directory_find_email_address", name="tomas"),
        call(
            "customer_relationship_manager_search_customers",
            assigned_to_email="tomas.lindqvist@atlas-works.com",
            status="Lost",
        ),
    ],
    [call("project_management_search_tasks", assigned_to_email="lukas", list_name="In Review")],
    [call("analytics_total_visits_count", time_min="2023-11-01", time_max="2023-11-30")],
]


def _tag(variant: str, index: int) -> str:
    return f"[variant={variant} row={index}]"


def _tagged(row: dict[str, Any], variant: str, index: int) -> dict[str, Any]:
    out = copy.deepcopy(row)
    out["responses_create_params"]["input"][-1]["content"] += " " + _tag(variant, index)
    return out


# Wrong trajectories: plausible mistakes, one per row.
WRONG: list[list[dict[str, Any]]] = [
    # replies to the older churn email (to Felix) instead of Samir's
    [call("email_reply_email", email_id="00000026", body="I will decide by Thursday.")],
    # moves the event but books the sync for 45 minutes
    [
        call(
            "calendar_update_event", event_id="00000013", field="event_start", new_value="2023-12-01 15:00:00"
        ),
        call(
            "calendar_create_event",
            event_name="Budget sync",
            participant_email=PRIYA,
            event_start="2023-12-05 10:00:00",
            duration="45",
        ),
    ],
    # misses one of the four customers (page one of a page_size=3 search)
    [
        call(
            "customer_relationship_manager_update_customer",
            customer_id=i,
            field="assigned_to_email",
            new_value=FATIMA,
        )
        for i in ("00000009", "00000014", "00000018")
    ],
    # also moves a task of someone else
    [
        *[
            call("project_management_update_task", task_id=i, field="list_name", new_value="Completed")
            for i in ("00000004", "00000007", "00000012")
        ],
        call("project_management_update_task", task_id="00000001", field="list_name", new_value="Completed"),
    ],
    # plots but never sends the email (it only answers in chat)
    [
        call(
            "analytics_create_plot",
            time_min="2023-11-01",
            time_max="2023-11-30",
            value_to_plot="total_visits",
            plot_type="line",
        )
    ],
]


def _scripts() -> list[dict[str, Any]]:
    scripts = []
    for i, row in enumerate(ROWS):
        gt = _gt_turns(row)
        scripts.append({"contains": _tag("wrong", i), "turns": [*LOOKUPS[i], *WRONG[i], DONE]})
        # The same actions in reverse order (and with the text in other letter case where allowed).
        scripts.append({"contains": _tag("reversed", i), "turns": [*LOOKUPS[i], *reversed(gt), DONE]})
        # A failing call first (unknown id), then the right actions: the error costs nothing.
        scripts.append(
            {
                "contains": _tag("recovers", i),
                "turns": [call("email_delete_email", email_id="99999999"), *gt, DONE],
            }
        )
    scripts.append(
        {
            "contains": _tag("case", 0),
            "turns": [call("email_reply_email", email_id="00000010", body="i will DECIDE by thursday.")],
        }
    )
    # The right actions, for a rollout that is run without a session (see the test using it).
    scripts.append({"contains": _tag("unseeded", 2), "turns": [*_gt_turns(ROWS[2]), DONE]})
    for i, row in enumerate(ROWS):  # untagged last: a tagged message also contains the plain text
        scripts.append(
            {
                "contains": row["responses_create_params"]["input"][-1]["content"],
                "turns": [*LOOKUPS[i], *_gt_turns(row), DONE],
            }
        )
    return scripts


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    extra = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": _scripts()}}}}
    with running_servers([CONFIG], extra) as h:
        yield h


def _outputs(result: dict[str, Any]) -> list[Any]:
    return [
        json.loads(o["output"])["output"]
        for o in result["response"]["output"]
        if o["type"] == "function_call_output"
    ]


# ------------------------------------------------------------------------------------------------
# The world itself (no server): ground truths are real changes; the comparison sees them.


def test_rows_are_in_upstream_format_and_ground_truths_change_the_world() -> None:
    assert len(ROWS) == 5
    for row in ROWS:
        assert set(row) == {"id", "responses_create_params", "ground_truth", "category", "environment_name"}
        assert row["environment_name"] == ENV and row["category"].startswith("workplace_assistant_")
        assert [t["name"] for t in row["responses_create_params"]["tools"]] == list(TOOLS)
        world = new_world()
        apply_calls(world, row["ground_truth"], strict=True)
        assert state_differences(world, new_world())  # the task changes something
        assert state_differences(new_world(), new_world()) == []


def test_worlds_share_nothing() -> None:
    a, b = new_world(), new_world()
    status = b["customers"][0]["status"]
    a["customers"][0]["status"] = "changed"
    a["emails"].clear()
    assert b["customers"][0]["status"] == status == new_world()["customers"][0]["status"]
    assert len(b["emails"]) == len(new_world()["emails"]) == 40


def test_only_what_differs_after_normalising_is_a_difference() -> None:
    """Tables equal as stored are skipped without normalising; the others are still compared as
    before: another record order, or another case of a case-insensitive field, is no difference."""
    expected = new_world()
    actual = new_world()
    actual["emails"].reverse()  # keyed table: compared by id
    actual["analytics"].reverse()  # keyless table: compared as a multiset
    actual["customers"][0]["customer_name"] = actual["customers"][0]["customer_name"].upper()
    assert actual != expected and state_differences(actual, expected) == []
    actual["emails"][0]["subject"] += " (changed)"
    assert state_differences(actual, expected) == [
        f"emails: email_id {actual['emails'][0]['email_id']} differs in subject"
    ]


def test_bad_ground_truth_call_raises() -> None:
    with pytest.raises(ToolError, match="call 0"):
        apply_calls(
            new_world(), [{"name": "email_delete_email", "arguments": '{"email_id": "404"}'}], strict=True
        )


# ------------------------------------------------------------------------------------------------
# Rollouts through the agent.


def test_every_row_correct_trajectory_scores_one(helper: RunHelper) -> None:
    for row in ROWS:
        result = run_rollout(helper, AGENT, row)
        assert result["reward"] == 1.0, result["state_differences"]
        assert result["state_source"] == "session" and result["num_state_differences"] == 0
        assert result["ground_truth"] == row["ground_truth"] and result["category"] == row["category"]
        outputs = _outputs(result)
        assert not any(isinstance(o, str) and o.startswith("Error") for o in outputs), outputs


def test_lookups_return_the_worlds_data(helper: RunHelper) -> None:
    result = run_rollout(helper, AGENT, ROWS[2])
    found, search = _outputs(result)[:2]
    assert found == ["tomas.lindqvist@atlas-works.com"]
    assert sorted(c["customer_id"] for c in search["customers"]) == [
        "00000009",
        "00000014",
        "00000018",
        "00000019",
    ]


def test_every_row_wrong_trajectory_scores_zero(helper: RunHelper) -> None:
    for i, row in enumerate(ROWS):
        result = run_rollout(helper, AGENT, _tagged(row, "wrong", i))
        assert result["reward"] == 0.0, i
        assert result["num_state_differences"] >= 1 and result["state_differences"]


def test_other_order_and_recovered_errors_score_one(helper: RunHelper) -> None:
    for i, row in enumerate(ROWS):
        for variant in ("reversed", "recovers"):
            result = run_rollout(helper, AGENT, _tagged(row, variant, i))
            assert result["reward"] == 1.0, (variant, i, result["state_differences"])
    recovered = run_rollout(helper, AGENT, _tagged(ROWS[0], "recovers", 0))
    assert _outputs(recovered)[0].startswith("Error: No record in emails has email_id '99999999'")


def test_text_compares_case_insensitively(helper: RunHelper) -> None:
    assert run_rollout(helper, AGENT, _tagged(ROWS[0], "case", 0))["reward"] == 1.0


def test_stored_rollout_reverifies_by_replay(helper: RunHelper) -> None:
    base = server_url(helper, ENV)
    for variant, reward in (("plain", 1.0), ("wrong", 0.0)):
        row = ROWS[4] if variant == "plain" else _tagged(ROWS[4], "wrong", 4)
        stored = run_rollout(helper, AGENT, row)
        resp = post_json(base + "/verify", stored)  # no session cookie: the calls are replayed
        assert resp.status_code == 200, resp.text
        assert resp.json()["state_source"] == "replay" and resp.json()["reward"] == reward


def test_broken_ground_truth_is_an_error_not_zero(helper: RunHelper) -> None:
    stored = run_rollout(helper, AGENT, ROWS[0])
    for bad in (
        [{"name": "email_reply_email", "arguments": '{"email_id": "12345678", "body": "x"}'}],
        [{"name": "no_such_tool", "arguments": "{}"}],
        "not json",
    ):
        resp = post_json(server_url(helper, ENV) + "/verify", {**stored, "ground_truth": bad})
        assert resp.status_code == 422, resp.text
        assert "ground_truth" in resp.text and "row id 0" in resp.text


def test_tool_errors_reach_the_model_and_unseeded_sessions_are_refused(helper: RunHelper) -> None:
    base = server_url(helper, ENV)
    seeded = post_json(base + "/seed_session", ROWS[0])
    cookies = {COOKIE: seeded.cookies[COOKIE]}
    cases = {
        "calendar_update_event": (
            {"event_id": "00000013", "field": "colour", "new_value": "red"},
            "cannot be updated",
        ),
        "email_send_email": ({"recipient": "nobody", "subject": "s", "body": "b"}, "not a valid email"),
        "project_management_create_task": ({"task_name": "x"}, "missing required argument"),
        "analytics_create_plot": (
            {
                "time_min": "2023-11-01",
                "time_max": "2023-11-02",
                "value_to_plot": "x",
                "plot_type": "bar",
                "z": 1,
            },
            "unknown argument",
        ),
    }
    for tool, (args, message) in cases.items():
        resp = post_json(f"{base}/{tool}", args, cookies=cookies)
        assert resp.status_code == 200 and message in resp.json()["output"], resp.text
    assert post_json(base + "/email_search_emails", {"query": "churn"}).status_code == 409  # no cookie


def test_tools_run_on_no_session_are_not_scored(helper: RunHelper) -> None:
    """A harness that never seeded the session (or lost it): every tool call answered 409 and changed
    nothing. Replaying those calls at /verify would score actions that never took effect: a 503."""
    row = _tagged(ROWS[2], "unseeded", 2)
    # The agent's /v1/responses runs the model/tool loop without /seed_session.
    loop = post_json(server_url(helper, AGENT) + "/v1/responses", row["responses_create_params"])
    assert loop.status_code == 200, loop.text[:2000]
    outputs = [o["output"] for o in loop.json()["output"] if o["type"] == "function_call_output"]
    assert len(outputs) == 4 and all("answered HTTP 409" in o for o in outputs), outputs
    resp = post_json(server_url(helper, ENV) + "/verify", {**row, "response": loop.json()})
    assert resp.status_code == 503, resp.text[:2000]
    assert "ran on no session" in resp.text and "not scored" in resp.text
    # The same calls in a live session are scored, with failure_reason only when something differs.
    right = run_rollout(helper, AGENT, row)
    assert right["reward"] == 1.0 and right["failure_reason"] is None
    wrong = run_rollout(helper, AGENT, _tagged(ROWS[2], "wrong", 2))
    assert wrong["reward"] == 0.0
    assert wrong["failure_reason"].startswith(
        "1 difference(s) from the expected final data, first: customers"
    )


# ------------------------------------------------------------------------------------------------
# Isolation: 500 concurrent sessions each make their own changes; any leak fails verification.

N_SESSIONS = 500


def _session_calls(i: int) -> list[tuple[str, dict[str, Any]]]:
    customer = f"{i % 25 + 1:08d}"
    return [
        ("email_send_email", {"recipient": PRIYA, "subject": f"session {i}", "body": f"from session {i}"}),
        (
            "customer_relationship_manager_update_customer",
            {"customer_id": customer, "field": "notes", "new_value": f"n{i}"},
        ),
        ("calendar_delete_event", {"event_id": f"{i % 30 + 1:08d}"}),
        (
            "project_management_create_task",
            {
                "task_name": f"task {i}",
                "assigned_to_email": FATIMA,
                "list_name": "Backlog",
                "due_date": "2023-12-31",
                "board": "Design",
            },
        ),
    ]


async def _drive_sessions(base: str) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=64)
    headers = auth_headers(client_token_for_url(base))
    verify_stub = {"responses_create_params": {"input": "direct"}, "response": {"output": []}}
    async with httpx.AsyncClient(
        base_url=base, timeout=60, trust_env=False, limits=limits, headers=headers
    ) as client:

        async def post(path: str, body: dict[str, Any], cookie: str | None) -> httpx.Response:
            resp = await client.post(
                path, json=body, headers={"cookie": f"{COOKIE}={cookie}"} if cookie else {}
            )
            assert resp.status_code == 200, resp.text
            return resp

        async def session(i: int) -> dict[str, Any]:
            cookie = (await post("/seed_session", ROWS[0], None)).cookies[COOKIE]
            for name, args in _session_calls(i):
                out = (await post(f"/{name}", args, cookie)).json()["output"]
                assert not str(out).startswith("Error"), out
                await asyncio.sleep(0)  # interleave the sessions' calls
            gt = [{"name": n, "arguments": json.dumps(a)} for n, a in _session_calls(i)]
            body = {
                **verify_stub,
                "ground_truth": gt,
                "id": i,
                "category": "isolation",
                "environment_name": ENV,
            }
            return (await post("/verify", body, cookie)).json()

        return await asyncio.gather(*(session(i) for i in range(N_SESSIONS)))


@pytest.mark.slow
def test_500_concurrent_sessions_mutate_only_their_own_data(helper: RunHelper) -> None:
    results = asyncio.run(asyncio.wait_for(_drive_sessions(server_url(helper, ENV)), timeout=300))
    assert len(results) == N_SESSIONS
    leaks = [(r["id"], r["state_differences"]) for r in results if r["reward"] != 1.0]
    assert not leaks, leaks[:3]
    assert all(r["state_source"] == "session" for r in results)


def test_seed_session_refuses_what_is_not_a_task_row(helper: RunHelper) -> None:
    """/seed_session starts a session only for a row of this environment: a body missing a field, or
    with a malformed one, is a 422 naming the field; a body past max_seed_session_body_bytes a 413."""
    base = server_url(helper, ENV)
    resp = post_json(base + "/seed_session", {})
    assert resp.status_code == 422 and "ground_truth" in resp.text and "responses_create_params" in resp.text
    for field in ("ground_truth", "id", "category", "environment_name", "responses_create_params"):
        row = {k: v for k, v in ROWS[0].items() if k != field}
        resp = post_json(base + "/seed_session", row)
        assert resp.status_code == 422 and field in resp.text, (field, resp.text)
    resp = post_json(base + "/seed_session", {**ROWS[0], "ground_truth": "not json"})
    assert resp.status_code == 422 and "ground_truth" in resp.text, resp.text
    resp = post_json(base + "/seed_session", {**ROWS[0], "junk": "x" * 10_000_000})
    assert resp.status_code == 413 and "max_seed_session_body_bytes" in resp.text, resp.text[:500]
    assert post_json(base + "/seed_session", ROWS[0]).status_code == 200
