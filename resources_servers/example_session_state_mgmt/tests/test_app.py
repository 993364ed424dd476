"""example_session_state_mgmt against real servers: rewards, metrics, and strict per-session isolation.

The rollout tests drive the agent with a scripted model (a row's own text selects the correct
trajectory; a ``[variant=... row=...]`` tag appended to it selects a different one). The isolation
tests talk to the resources server directly, holding each session's cookie the way the agent does.
"""

from __future__ import annotations

import asyncio
import copy
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson
import pytest

from nemo_gym.auth import auth_headers, client_token_for_url
from nemo_gym.cli import RunHelper
from nemo_gym.server.asgi.sessions import cookie_name_for
from nemo_gym.tools.testing import example_rows, post_json, run_rollout, running_servers, server_url

ENV = "example_session_state_mgmt"
CONFIG = f"resources_servers/{ENV}/configs/{ENV}.yaml"
AGENT = f"{ENV}_simple_agent"
COOKIE = cookie_name_for(ENV)
ROWS = example_rows(ENV)
VERIFY_STUB = {"responses_create_params": {"input": "direct call"}, "response": {"output": []}}


def _answered(value: int) -> dict[str, Any]:
    """A verify body whose response read the counter (``value``) and told it, as a right rollout does."""
    output = [
        {"type": "function_call", "call_id": "r", "name": "get_counter_value", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "r", "output": orjson.dumps({"count": value}).decode()},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": f"It is {value}."}],
        },
    ]
    return {**VERIFY_STUB, "response": {"output": output}}


def _inc(*counts: int) -> dict[str, Any]:
    return {"tool_calls": [{"name": "increment_counter", "arguments": {"count": c}} for c in counts]}


GET = {"tool_calls": [{"name": "get_counter_value", "arguments": {}}]}


def _done(value: int) -> dict[str, Any]:
    return {"text": f"Done: the counter now reads {value}."}


# The correct trajectory per example row (same order as data/example.jsonl).
CORRECT_TURNS: list[list[dict[str, Any]]] = [
    [_inc(5, 12), GET, _done(17)],  # 0 -> 17, both increments in one turn
    [_inc(3), _inc(3), _inc(3), GET, _done(19)],  # 10 -> 19, one per turn
    [_inc(-25, 7), GET, {"text": "It went from 100 to 82 (-25, then +7)."}],  # 100 -> 82
    [GET, _inc(10), GET, {"text": "It was -4; after adding 10 it is 6."}],  # -4 -> 6
    [GET, _done(42)],  # 42 -> 42, nothing to change
]


def _user_text(row: dict[str, Any]) -> str:
    return next(m["content"] for m in row["responses_create_params"]["input"] if m["role"] == "user")


def _tag(variant: str, index: int) -> str:
    return f"[variant={variant} row={index}]"


def _tagged(row: dict[str, Any], variant: str, index: int) -> dict[str, Any]:
    out = copy.deepcopy(row)
    for message in out["responses_create_params"]["input"]:
        if message["role"] == "user":
            message["content"] = f"{message['content']} {_tag(variant, index)}"
    return out


def _scripts() -> list[dict[str, Any]]:
    # A wrong trajectory per row: the correct one plus one extra increment of 1 before answering.
    wrong = [
        {"contains": _tag("off_by_one", i), "turns": [*turns[:-1], _inc(1), turns[-1]]}
        for i, turns in enumerate(CORRECT_TURNS)
    ]
    partial = [{"contains": _tag("partial", 0), "turns": [_inc(5), GET, _done(17)]}]  # forgets the +12
    # Row 4 changes nothing: doing and saying nothing, or reading and not telling, must not pay.
    silent = [
        {"contains": _tag("silent", 4), "turns": [{"text": ""}]},
        {"contains": _tag("untold", 4), "turns": [GET, {"text": "Done: the counter shows the value above."}]},
        {"contains": _tag("unread", 0), "turns": [_inc(5, 12), _done(17)]},
        # Read before the change only, the new value worked out: a right answer.
        {"contains": _tag("read_first", 3), "turns": [GET, _inc(10), _done(6)]},
    ]
    correct = [
        {"contains": _user_text(row), "turns": turns} for row, turns in zip(ROWS, CORRECT_TURNS, strict=True)
    ]
    return (
        wrong + partial + silent + correct
    )  # tagged rules first: a tagged message also contains the plain text


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    extra = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": _scripts()}}}}
    with running_servers([CONFIG], extra) as h:
        yield h


def _counter_reads(result: dict[str, Any]) -> list[int]:
    """The values get_counter_value returned during a rollout, in order."""
    output = result["response"]["output"]
    get_ids = {
        o["call_id"] for o in output if o["type"] == "function_call" and o["name"] == "get_counter_value"
    }
    return [
        orjson.loads(o["output"])["count"]
        for o in output
        if o["type"] == "function_call_output" and o["call_id"] in get_ids
    ]


# ------------------------------------------------------------------------------------------------
# Rollouts through the agent.


def test_every_row_correct_trajectory_scores_one(helper: RunHelper) -> None:
    assert len(ROWS) == len(CORRECT_TURNS) == 5
    for row in ROWS:
        result = run_rollout(helper, AGENT, row)
        assert result["reward"] == 1.0, result
        assert result["final_count"] == row["expected_count"] and result["abs_count_error"] == 0
        assert _counter_reads(result)[-1] == row["expected_count"]
        # Task fields survive /run.
        assert result["initial_count"] == row["initial_count"]
        assert result["expected_count"] == row["expected_count"]
        assert result["responses_create_params"]["tools"] == row["responses_create_params"]["tools"]


def test_counter_starts_at_the_rows_initial_count(helper: RunHelper) -> None:
    row = ROWS[3]  # reads first, then adds 10, then reads again
    assert _counter_reads(run_rollout(helper, AGENT, row)) == [
        row["initial_count"],
        row["initial_count"] + 10,
    ]


def test_every_row_wrong_trajectory_scores_zero(helper: RunHelper) -> None:
    for i, row in enumerate(ROWS):
        result = run_rollout(helper, AGENT, _tagged(row, "off_by_one", i))
        assert result["reward"] == 0.0
        assert result["final_count"] == row["expected_count"] + 1 and result["abs_count_error"] == 1
        assert result["expected_count"] == row["expected_count"]


def test_partial_answer_metrics(helper: RunHelper) -> None:
    row = ROWS[0]  # 0, +5, +12 expected; the partial script forgets the +12
    result = run_rollout(helper, AGENT, _tagged(row, "partial", 0))
    assert result["reward"] == 0.0
    assert result["final_count"] == 5 and result["abs_count_error"] == 12
    assert _counter_reads(result) == [5]


def test_the_value_must_be_read_and_told(helper: RunHelper) -> None:
    reasons = {
        "silent": "the counter was never read with get_counter_value",
        "untold": "the final answer does not state the counter's value (42)",
        "unread": "the counter was never read with get_counter_value",
    }
    for variant, reason in reasons.items():
        row_index = 0 if variant == "unread" else 4
        result = run_rollout(helper, AGENT, _tagged(ROWS[row_index], variant, row_index))
        assert result["final_count"] == ROWS[row_index]["expected_count"]  # the right state ...
        assert result["reward"] == 0.0 and result["failure_reason"].startswith(reason), result  # ... untold
    for row_index, right in ((4, ROWS[4]), (3, _tagged(ROWS[3], "read_first", 3))):
        result = run_rollout(helper, AGENT, right)
        assert result["reward"] == 1.0 and result["failure_reason"] is None, (row_index, result)


def test_concurrent_rollouts_each_score_one(helper: RunHelper) -> None:
    jobs = [row for row in ROWS for _ in range(4)]
    random.Random(7).shuffle(jobs)
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda r: run_rollout(helper, AGENT, r, timeout=60), jobs))
    for row, result in zip(jobs, results, strict=True):
        assert result["reward"] == 1.0 and result["final_count"] == row["expected_count"], (row, result)


# ------------------------------------------------------------------------------------------------
# Isolation, straight over HTTP.


def _seed(base: str, initial_count: int, cookies: dict[str, str] | None = None) -> dict[str, str]:
    resp = post_json(base + "/seed_session", {**VERIFY_STUB, "initial_count": initial_count}, cookies=cookies)
    assert resp.status_code == 200, resp.text
    return {COOKIE: resp.cookies[COOKIE]} if COOKIE in resp.cookies else dict(cookies or {})


def _read(base: str, cookies: dict[str, str] | None) -> httpx.Response:
    return post_json(base + "/get_counter_value", {}, cookies=cookies)


def _session_id(cookies: dict[str, str]) -> str:
    return cookies[COOKIE].partition(".")[0]


def test_two_concurrent_sessions_never_see_each_others_state(helper: RunHelper) -> None:
    base = server_url(helper, ENV)
    start = {"a": 0, "b": 1_000_000}
    step = {"a": 1, "b": 1000}  # any leak from b into a (or back) shows up as an impossible value
    n = 60
    cookies = {name: _seed(base, start[name]) for name in start}
    assert _session_id(cookies["a"]) != _session_id(cookies["b"])

    def possible(name: str, value: int) -> bool:
        k, rem = divmod(value - start[name], step[name])
        return rem == 0 and 0 <= k <= n

    async def drive() -> dict[str, list[int]]:
        reads: dict[str, list[int]] = {"a": [], "b": []}
        limits = httpx.Limits(max_connections=16)
        token_headers = auth_headers(client_token_for_url(base))
        async with httpx.AsyncClient(
            base_url=base, timeout=30, trust_env=False, limits=limits, headers=token_headers
        ) as client:

            async def call(name: str, path: str, body: dict[str, Any]) -> httpx.Response:
                # The session cookie goes in the header, as the agent sends it; the client keeps no jar state.
                header = "; ".join(f"{k}={v}" for k, v in cookies[name].items())
                resp = await client.post(path, json=body, headers={"cookie": header})
                assert resp.status_code == 200, resp.text
                # A valid cookie keeps its session: the answer re-issues the same cookie.
                assert dict(resp.cookies) == cookies[name]
                return resp

            async def work(name: str) -> None:
                resp = await call(name, "/increment_counter", {"count": step[name]})
                assert resp.json() == {"success": True}
                reads[name].append((await call(name, "/get_counter_value", {})).json()["count"])

            # a and b alternate in one batch of concurrent requests.
            await asyncio.gather(*(work(name) for _ in range(n) for name in ("a", "b")))
        return reads

    reads = asyncio.run(asyncio.wait_for(drive(), timeout=120))
    for name in ("a", "b"):
        assert len(reads[name]) == n
        assert all(possible(name, v) for v in reads[name]), (name, reads[name])
        final = start[name] + n * step[name]
        assert max(reads[name]) == final
        assert _read(base, cookies[name]).json() == {"count": final}
    # Verify scores each session on its own counter only, then drops it.
    for name, other in (("a", "b"), ("b", "a")):
        final = start[name] + n * step[name]
        resp = post_json(
            base + "/verify", {**_answered(final), "expected_count": final}, cookies=cookies[name]
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["reward"] == 1.0 and resp.json()["final_count"] == final
        assert _read(base, cookies[name]).status_code == 500  # gone after verify
        if name == "a":
            assert _read(base, cookies[other]).json() == {"count": start[other] + n * step[other]}


def test_missing_or_forged_cookie_sees_no_other_session(helper: RunHelper) -> None:
    base = server_url(helper, ENV)
    owner = _seed(base, 777)
    sid, _, signature = owner[COOKIE].partition(".")
    forged = [
        None,  # no cookie at all
        {COOKIE: sid},  # the session id without its signature
        {COOKIE: f"{sid}.{'A' * len(signature)}"},  # the session id with a made-up signature
        {COOKIE: f"{'0' * len(sid)}.{signature}"},  # another session id with the owner's signature
        {
            cookie_name_for("some_other_server"): owner[COOKIE]
        },  # the owner's value under another server's name
    ]
    for cookies in forged:
        resp = _read(base, cookies)
        assert resp.status_code == 500, (cookies, resp.text)
        assert "no counter" in resp.json()["error"]["message"] and "777" not in resp.text
        minted = resp.cookies.get(COOKIE)  # (a 500 from the generic error handler carries no cookie)
        assert minted is None or minted.partition(".")[0] != sid
        assert post_json(base + "/increment_counter", {"count": 5}, cookies=cookies).status_code == 500
        verify = post_json(base + "/verify", {**VERIFY_STUB, "expected_count": 777}, cookies=cookies)
        assert verify.status_code == 500  # never a score for a session that has no counter
        # Seeding with a forged cookie mints a fresh session; it cannot reset the owner's counter.
        seeded = post_json(base + "/seed_session", {**VERIFY_STUB, "initial_count": -1}, cookies=cookies)
        assert seeded.status_code == 200 and COOKIE in seeded.cookies
        new = {COOKIE: seeded.cookies[COOKIE]}
        assert _session_id(new) != sid
        assert _read(base, new).json() == {"count": -1}
        assert (
            post_json(base + "/verify", {**_answered(-1), "expected_count": -1}, cookies=new).json()["reward"]
            == 1.0
        )
    assert _read(base, owner).json() == {"count": 777}
    resp = post_json(base + "/verify", {**VERIFY_STUB, "expected_count": 778}, cookies=owner)
    assert resp.json()["reward"] == 0.0 and resp.json()["abs_count_error"] == 1


def test_reseeding_resets_and_bad_rows_are_rejected(helper: RunHelper) -> None:
    base = server_url(helper, ENV)
    cookies = _seed(base, 3)
    assert post_json(base + "/increment_counter", {"count": 4}, cookies=cookies).status_code == 200
    assert _seed(base, 10, cookies) == cookies  # same session, reset
    assert _read(base, cookies).json() == {"count": 10}
    assert (
        post_json(base + "/verify", {**_answered(10), "expected_count": 10}, cookies=cookies).json()["reward"]
        == 1.0
    )
    missing = post_json(base + "/seed_session", VERIFY_STUB)
    assert missing.status_code == 422 and "initial_count" in missing.json()["error"]["message"]


def test_unverified_sessions_are_bounded() -> None:
    instance = {ENV: {"resources_servers": {ENV: {"entrypoint": "app.py", "max_sessions": 3}}}}
    with running_servers([], instance, with_scripted_model=False) as h:
        base = server_url(h, ENV)
        sessions = [_seed(base, i) for i in range(5)]
        assert [_read(base, c).status_code for c in sessions] == [500, 500, 200, 200, 200]
        assert [_read(base, c).json()["count"] for c in sessions[2:]] == [2, 3, 4]
