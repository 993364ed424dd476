"""Aviary GSM8K and HotPotQA against real servers: the real fhaviary envs, the aviary_agent, the scripted model.

One set of servers serves the module: the GSM8K and HotPotQA configs as shipped, a GSM8K server with
tiny bounds (one live env, a three-second idle timeout), and a second agent that nudges the
model instead of stopping when it answers without a tool call. The scripted model picks its turns by a
substring of the first user message: the env's problem text, or a tag the row puts in its input.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
import pytest

from nemo_gym.cli import RunHelper
from nemo_gym.client.server_client import close_shared_session, response_cookies
from nemo_gym.server_utils import request
from nemo_gym.tools.testing import get, post_json, run_rollout, running_servers, server_url

HERE = Path(__file__).resolve().parents[1]
GSM8K_CONFIG = "resources_servers/aviary/configs/gsm8k_aviary.yaml"
HOTPOT_CONFIG = "resources_servers/aviary/configs/hotpotqa_aviary.yaml"
GSM8K, GSM8K_AGENT = "gsm8k_aviary_resources_server", "gsm8k_aviary_agent"
HOTPOT, HOTPOT_AGENT = "hotpotqa_aviary_resources_server", "hotpotqa_aviary_agent"
BOUNDED, NUDGE_AGENT = "gsm8k_bounded", "gsm8k_nudge_agent"
MAX_LIVE = 16

PROBLEMS = [json.loads(line) for line in (HERE / "data" / "gsm8k_problems.jsonl").read_text().splitlines()]
ANSWERS = [p["answer"].rsplit("####", 1)[1].strip() for p in PROBLEMS]


def _submit(answer: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "submit_answer", "arguments": {"answer": answer}}]}


def _calc(expr: Any) -> dict[str, Any]:
    return {"tool_calls": [{"name": "calculator", "arguments": expr}]}


TAGGED: dict[str, list[dict[str, Any]]] = {
    "[right]": [_calc({"expr": "3*12-7"}), _submit("29")],
    "[wrong]": [_calc({"expr": "3*12+7"}), _submit("43")],
    "[malformed]": [_submit("twenty-nine")],
    "[unknown-tool]": [{"tool_calls": [{"name": "abacus", "arguments": {"beads": 3}}]}],
    "[slow-model]": [{"delay_s": 60.0, **_calc({"expr": "3*12-7"})}, _submit("29")],
    "[env-raises]": [_calc({}), _submit("29")],
    "[bad-json]": [{"tool_calls": [{"name": "calculator", "arguments": "{not json"}]}, _submit("29")],
    "[no-tool]": [{"text": "I think the answer is 29."}, _submit("29")],
    "[two-calls]": [
        {
            "tool_calls": [
                {"name": "calculator", "arguments": {"expr": "3*12"}},
                {"name": "calculator", "arguments": {"expr": "36-7"}},
            ]
        },
        _submit("29"),
    ],
    "[hotpot-right]": [
        {"tool_calls": [{"name": "search", "arguments": {"entity": "Harbor Lantern Festival"}}]},
        {"tool_calls": [{"name": "search", "arguments": {"entity": "Ilse Marrow"}}]},
        {"tool_calls": [{"name": "lookup", "arguments": {"keyword": "born"}}]},
        _submit("Kessel Ridge"),
    ],
    "[hotpot-wrong]": [
        {"tool_calls": [{"name": "search", "arguments": {"entity": "Lantern Festival of the Moon"}}]},
        _submit("Velmora"),
    ],
}


def _scripts() -> list[dict[str, Any]]:
    rules = [{"contains": tag, "turns": turns} for tag, turns in TAGGED.items()]
    # An untagged row: its problem text picks a trajectory that submits the right answer.
    rules += [
        {"contains": p["question"], "turns": [_submit(a)]} for p, a in zip(PROBLEMS, ANSWERS, strict=True)
    ]
    return rules


def _row(task_idx: int, tag: str | None = None) -> dict[str, Any]:
    items = [{"role": "user", "content": f"Solve the problem. {tag}"}] if tag else []
    return {"task_idx": task_idx, "responses_create_params": {"input": items}}


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    gsm8k_block = {"entrypoint": "gsm8k_app.py", "domain": "math"}
    extra = {
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": _scripts()}}},
        GSM8K: {"resources_servers": {"aviary": {"max_live_envs": MAX_LIVE, "seed_wait_timeout_s": 120}}},
        BOUNDED: {
            "resources_servers": {
                "aviary": {
                    **gsm8k_block,
                    "max_live_envs": 1,
                    "idle_timeout_s": 3.0,
                }
            }
        },
        NUDGE_AGENT: {
            "responses_api_agents": {
                "aviary_agent": {
                    "entrypoint": "app.py",
                    "resources_server": {"type": "resources_servers", "name": GSM8K},
                    "model_server": {"type": "responses_api_models", "name": "policy_model"},
                    "max_steps": 5,
                    "done_if_no_tool_calls": False,
                }
            }
        },
    }
    with running_servers([GSM8K_CONFIG, HOTPOT_CONFIG], extra) as h:
        yield h


def _stats(helper: RunHelper, server: str) -> dict[str, Any]:
    resp = get(server_url(helper, server) + "/env_stats")
    assert resp.status_code == 200, resp.text
    return resp.json()


def _outputs(result: dict[str, Any]) -> list[str]:
    return [o["output"] for o in result["response"]["output"] if o.get("type") == "function_call_output"]


# ------------------------------------------------------------------------------------------------
# GSM8K: Aviary's rewards end to end.


def test_right_wrong_and_malformed_answers_get_aviarys_rewards(helper: RunHelper) -> None:
    right = run_rollout(helper, GSM8K_AGENT, _row(0, "[right]"))
    assert right["reward"] == 1.0 and right["step_rewards"] == [0.0, 1.0] and right["env_done"]
    assert _outputs(right) == ["29", "True"]
    wrong = run_rollout(helper, GSM8K_AGENT, _row(0, "[wrong]"))
    assert wrong["reward"] == 0.0 and wrong["step_rewards"] == [0.0, 0.0]
    assert _outputs(wrong) == ["43", "False"]
    malformed = run_rollout(helper, GSM8K_AGENT, _row(0, "[malformed]"))
    assert malformed["reward"] == -1.0 and malformed["step_rewards"] == [-1.0]
    unknown = run_rollout(helper, GSM8K_AGENT, _row(0, "[unknown-tool]"))
    assert unknown["reward"] == -1.0 and unknown["response"]["stop_reason"] == "done"
    # Aviary's reward stays; the model's call gets an answer and the rollout says why it ended.
    (why,) = _outputs(unknown)
    assert "'abacus' is not a tool of this environment" in why and "calculator, submit_answer" in why
    assert "ended the episode" in why and unknown["response"]["steps"][-1]["reason"] == why
    for r in (right, wrong, malformed, unknown):
        assert r["task_idx"] == 0 and r["response"]["group_id"] == "0"
        assert [s["reward"] for s in r["response"]["steps"]] == r["step_rewards"]
    # Every rollout closed its env.
    assert _stats(helper, GSM8K)["live"] == 0


def test_trajectory_shape_and_step_records(helper: RunHelper) -> None:
    result = run_rollout(helper, GSM8K_AGENT, _row(0, "[two-calls]"))
    resp = result["response"]
    out = resp["output"]
    # The row's own input stays in responses_create_params; output starts with the env's first observation.
    assert out[0]["role"] == "user" and out[0]["content"] == PROBLEMS[0]["question"]
    assert [o["type"] for o in out[1:]] == ["function_call"] * 2 + ["function_call_output"] * 2 + [
        "function_call",
        "function_call_output",
    ]
    # Both calls of the first turn went to the env in one /step, answered in order.
    assert [o["output"] for o in out[3:5]] == ["36", "29"]
    assert [o["call_id"] for o in out[1:3]] == [o["call_id"] for o in out[3:5]]
    s1, s2 = resp["steps"]
    assert (s1["output_start"], s1["action_end"], s1["output_end"]) == (1, 3, 5)
    assert (s2["output_start"], s2["action_end"], s2["output_end"]) == (5, 6, 7)
    assert s1["obs"] == out[3:5] and not s1["done"] and s2["done"] and s2["reward"] == 1.0
    assert {t["name"] for t in resp["tools"]} == {"calculator", "submit_answer"}
    assert result["reward"] == 1.0 and result["num_steps"] == 2


def test_every_example_row_scores_one(helper: RunHelper) -> None:
    rows = [orjson.loads(line) for line in (HERE / "data" / "gsm8k_example.jsonl").read_text().splitlines()]
    assert len(rows) == 5
    for row in rows:
        result = run_rollout(helper, GSM8K_AGENT, row)
        assert result["reward"] == 1.0, (row, _outputs(result))
        assert result["response"]["output"][0]["content"] == PROBLEMS[row["task_idx"]]["question"]


def test_env_raising_mid_step_is_a_tool_error_the_model_reads(helper: RunHelper) -> None:
    result = run_rollout(helper, GSM8K_AGENT, _row(0, "[env-raises]"))
    first, second = _outputs(result)
    assert first.startswith("Error: TypeError:") and "expr" in first
    assert second == "True" and result["reward"] == 1.0 and result["step_rewards"] == [0.0, 1.0]


def test_arguments_that_are_not_json_are_a_tool_error(helper: RunHelper) -> None:
    result = run_rollout(helper, GSM8K_AGENT, _row(0, "[bad-json]"))
    first, second = _outputs(result)
    assert "not valid JSON" in first and "calculator" in first
    assert second == "True" and result["reward"] == 1.0


def test_no_tool_call_stops_or_nudges(helper: RunHelper) -> None:
    stopped = run_rollout(helper, GSM8K_AGENT, _row(0, "[no-tool]"))
    assert stopped["reward"] == 0.0 and stopped["num_steps"] == 0
    assert stopped["response"]["stop_reason"] == "no_tool_call"
    nudged = run_rollout(helper, NUDGE_AGENT, _row(0, "[no-tool]"))
    assert nudged["reward"] == 1.0 and nudged["response"]["stop_reason"] == "done"
    texts = [o.get("content") for o in nudged["response"]["output"] if o.get("role") == "user"]
    assert any("did not call a tool" in str(t) for t in texts)


# ------------------------------------------------------------------------------------------------
# Clear errors for bad input.


def test_bad_requests_get_clear_4xx(helper: RunHelper) -> None:
    base = server_url(helper, GSM8K)
    resp = post_json(base + "/seed_session", {"task_idx": 99})
    assert resp.status_code == 422 and "task_idx 99 is out of range" in resp.text and "12 tasks" in resp.text
    resp = post_json(base + "/seed_session", {"task_idx": "first"})
    assert resp.status_code == 422 and "task_idx" in resp.text
    resp = post_json(base + "/step", {"env_id": "nope", "action": []})
    assert resp.status_code == 404 and "unknown env_id 'nope'" in resp.text
    seeded = post_json(base + "/seed_session", {"task_idx": 1})
    env_id, cookies = seeded.json()["env_id"], dict(seeded.cookies)
    bad_call = {"env_id": env_id, "action": [{"type": "function_call", "name": "x"}]}
    resp = post_json(base + "/step", bad_call, cookies=cookies)
    assert resp.status_code == 422 and "call_id" in resp.text and "arguments" in resp.text
    resp = post_json(base + "/step", {"env_id": env_id, "action": "submit 170"}, cookies=cookies)
    assert resp.status_code == 422 and "action" in resp.text
    closed = post_json(base + "/close", {"env_id": env_id}, cookies=cookies).json()
    assert closed == {"message": "Success", "success": True}
    again = post_json(base + "/close", {"env_id": env_id}, cookies=cookies).json()
    assert again["success"] and "already closed" in again["message"]
    resp = post_json(base + "/step", {"env_id": env_id, "action": []}, cookies=cookies)
    assert resp.status_code == 409 and "closed by client" in resp.text
    # /run with a task the server does not have: a failed rollout naming the server, never a reward.
    resp = post_json(server_url(helper, GSM8K_AGENT) + "/run", _row(99))
    assert resp.status_code == 502 and GSM8K in resp.text and "out of range" in resp.text
    resp = post_json(server_url(helper, GSM8K_AGENT) + "/run", {"responses_create_params": {"input": []}})
    assert resp.status_code == 422 and "task_idx" in resp.text
    assert _stats(helper, GSM8K)["live"] == 0


def test_an_env_answers_only_the_session_that_seeded_it(helper: RunHelper) -> None:
    base = server_url(helper, GSM8K)
    seeded = post_json(base + "/seed_session", {"task_idx": 0})
    env_id, cookies = seeded.json()["env_id"], dict(seeded.cookies)
    args = json.dumps({"answer": ANSWERS[0]})
    step = {
        "env_id": env_id,
        "action": [{"type": "function_call", "call_id": "c", "name": "submit_answer", "arguments": args}],
    }
    # Another client (no cookie: a session of its own) knows the id and the run token, and is refused.
    for path, body in (("/step", step), ("/close", {"env_id": env_id})):
        resp = post_json(base + path, body)
        assert resp.status_code == 403, (path, resp.text)
        assert f"env_id {env_id!r} belongs to another session" in resp.text and "cookie" in resp.text
    verify = {**_row(0), "response": {"env_id": env_id, "group_id": "0", "output": []}}
    assert post_json(base + "/verify", verify).status_code == 403
    assert _stats(helper, GSM8K)["live"] >= 1  # still alive: the refused close did nothing
    # The seeding session steps, verifies and closes it.
    assert post_json(base + "/step", step, cookies=cookies).json()["reward"] == 1.0
    assert post_json(base + "/verify", verify, cookies=cookies).json()["reward"] == 1.0
    assert post_json(base + "/close", {"env_id": env_id}, cookies=cookies).json()["success"]


def test_a_dropped_rollout_closes_its_env_at_once(helper: RunHelper) -> None:
    """The client gives up while the model is thinking (a 60 s turn); the agent notices at once,
    stops and closes the env. The server's idle timeout is the production 900 s, so only the agent
    can have closed it."""
    before = _stats(helper, GSM8K)
    with pytest.raises(httpx.ReadTimeout):
        post_json(server_url(helper, GSM8K_AGENT) + "/run", _row(0, "[slow-model]"), timeout=3)
    dropped = time.monotonic()
    while time.monotonic() - dropped < 10 and _stats(helper, GSM8K)["live"] > before["live"]:
        time.sleep(0.05)
    after = _stats(helper, GSM8K)
    assert after["seeded"] == before["seeded"] + 1 and after["live"] == before["live"], after
    assert after["closed_client_disconnected"] == before.get("closed_client_disconnected", 0) + 1, after


def test_verify_of_an_unknown_env_is_an_error_not_a_reward(helper: RunHelper) -> None:
    body = {**_row(0), "response": {"env_id": "never-seeded", "group_id": "0", "output": []}}
    resp = post_json(server_url(helper, GSM8K) + "/verify", body)
    assert resp.status_code == 404 and "never-seeded" in resp.text


def test_row_schema_names_task_idx(helper: RunHelper) -> None:
    schema = get(server_url(helper, GSM8K) + "/row_schema").json()
    assert "task_idx" in schema["required"] and schema["properties"]["task_idx"]["type"] == "integer"


# ------------------------------------------------------------------------------------------------
# Bounds: max live envs, idle reaping, 1,000 concurrent sessions.


def test_slot_bound_and_idle_reaper(helper: RunHelper) -> None:
    base = server_url(helper, BOUNDED)
    first = post_json(base + "/seed_session", {"task_idx": 0})
    assert first.status_code == 200
    # Full: refused at once (the default seed_wait_timeout_s is short), with a Retry-After, naming the cap.
    second = post_json(base + "/seed_session", {"task_idx": 1}, timeout=10)
    assert second.status_code == 503 and "max_live_envs=1" in second.text, second.text
    assert "seed_wait_timeout_s" in second.text and int(second.headers["retry-after"]) >= 1
    # The abandoned env is closed by the reaper after idle_timeout_s (3 s); bound the wait at 30 s.
    deadline = time.monotonic() + 30
    while _stats(helper, BOUNDED)["live"] and time.monotonic() < deadline:
        time.sleep(0.2)
    stats = _stats(helper, BOUNDED)
    assert stats["live"] == 0 and stats["closed_idle"] >= 1
    resp = post_json(base + "/step", {"env_id": first.json()["env_id"], "action": []}, cookies=first.cookies)
    assert resp.status_code == 409 and "idle" in resp.text
    third = post_json(base + "/seed_session", {"task_idx": 1})
    assert third.status_code == 200
    assert post_json(base + "/close", {"env_id": third.json()["env_id"]}, cookies=third.cookies).json()[
        "success"
    ]


def test_a_thousand_concurrent_sessions_stay_bounded_and_all_close(helper: RunHelper) -> None:
    """1,000 sessions at once against a server allowed MAX_LIVE live envs: seeds queue in the server
    (first come, first served) while others step and close; all finish, none is left alive."""
    base = server_url(helper, GSM8K)
    pid = next(r["pid"] for r in helper.server_instances() if r["name"] == GSM8K)
    proc = psutil.Process(pid)
    rss_before = proc.memory_info().rss
    n = 1000

    async def post(path: str, body: dict[str, Any], cookies: dict[str, str] | None = None) -> Any:
        resp = await request("POST", base + path, json=body, timeout=120, cookies=cookies)
        assert resp.status == 200, (path, resp.status)
        return await resp.json(), response_cookies(resp)

    async def one(i: int) -> float:
        task = i % len(PROBLEMS)
        seeded, cookies = await post("/seed_session", {"task_idx": task})
        env_id = seeded["env_id"]
        args = json.dumps({"answer": ANSWERS[task]})
        call = {"type": "function_call", "call_id": f"c{i}", "name": "submit_answer", "arguments": args}
        step, _ = await post("/step", {"env_id": env_id, "action": [call]}, cookies)
        assert (await post("/close", {"env_id": env_id}, cookies))[0]["success"]
        return step["reward"]

    async def main() -> list[float]:
        try:
            return await asyncio.gather(*(one(i) for i in range(n)))
        finally:
            # Close the ~1,000 pooled connections: later tests in this process start servers, and
            # the launcher waits on descriptors with select(), which cannot take fds above 1023.
            await close_shared_session()

    rewards = asyncio.run(main())
    assert rewards == [1.0] * n
    stats = _stats(helper, GSM8K)
    assert stats["live"] == 0
    assert stats["peak_live"] == MAX_LIVE  # the bound was reached and never exceeded
    assert stats["seeded"] >= n and stats["seed_rejected"] == 0
    # Closed envs leave only a small reward record behind.
    assert proc.memory_info().rss - rss_before < 64 * 1024 * 1024


# ------------------------------------------------------------------------------------------------
# HotPotQA over the local corpus.


def test_hotpotqa_searches_the_local_corpus(helper: RunHelper) -> None:
    result = run_rollout(helper, HOTPOT_AGENT, _row(0, "[hotpot-right]"))
    search1, search2, lookup, submit = _outputs(result)
    assert "founded in 1962 by the painter Ilse Marrow" in search1
    assert "born in the mountain village of Kessel Ridge" in search2
    assert lookup.startswith("(Result 1 / 1)") and "Kessel Ridge" in lookup
    assert submit == "Finished."
    assert result["reward"] == 1.0 and result["step_rewards"] == [0.0, 0.0, 0.0, 1.0]
    assert {t["name"] for t in result["response"]["tools"]} == {"search", "lookup", "submit_answer"}


def test_hotpotqa_missing_entity_lists_similar_titles_and_wrong_answer_scores_zero(helper: RunHelper) -> None:
    result = run_rollout(helper, HOTPOT_AGENT, _row(0, "[hotpot-wrong]"))
    search, submit = _outputs(result)
    assert "returned no results" in search and "Harbor Lantern Festival" in search
    assert result["reward"] == 0.0
    assert _stats(helper, HOTPOT)["live"] == 0
