"""Model-call capture (``+observability_enabled=true``, nemo_gym.server.model_calls) with real servers.

Servers: example_single_tool_call + simple_agent + the scripted model, whose scripts give each task
a different number of model calls (Paris 3, Tokyo 2) and make one task's model answer 500 (Oslo).
Collected through ``ng_collect_rollouts`` (its entry point, in this process) with several rollouts
in flight, then checked line by line against the rollouts file.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from nemo_gym.redaction import REDACTED, add_secret_values
from nemo_gym.server.model_calls import ModelCallStore
from nemo_gym.tools.testing import collect_rollouts, post_json, running_servers, server_url, weather_row

EXAMPLE_CONFIG = "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml"
AGENT = "example_single_tool_call_simple_agent"
SECRET = "sk-capture-test-0123456789abcdef"  # a value the collector knows as secret: never written
CALLS_PER_CITY = {"Paris": 3, "Tokyo": 2}


def _tool(city: str) -> dict[str, Any]:
    return {"name": "get_weather", "arguments": {"city": city}}


SCRIPTS = [
    {
        "contains": "Paris",
        "turns": [
            {"tool_calls": [_tool("Paris")], "delay_s": 0.05},
            {"tool_calls": [_tool("Paris")]},
            {"text": f"Paris is sunny. {SECRET}"},
        ],
    },
    {
        "contains": "Tokyo",
        "turns": [{"tool_calls": [_tool("Tokyo")], "delay_s": 0.1}, {"text": "Tokyo: rain."}],
    },
    {"contains": "Oslo", "turns": [{"http_error": 500}]},
]


def _config(**top: Any) -> dict[str, Any]:
    return {
        "policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": SCRIPTS}}},
        **top,
    }


def _lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run with capture on: 3 tasks x 4 repeats, 12 in flight."""
    add_secret_values([SECRET])
    work = tmp_path_factory.mktemp("capture_on")
    with running_servers([EXAMPLE_CONFIG], _config(observability_enabled=True)) as helper:
        model_url = server_url(helper, "policy_model")
        # A call an earlier (say, interrupted) run left for rollout 1-0: not written for this run's 1-0.
        stale = post_json(model_url + "/ng-rollout/1-0/v1/responses", {"input": "a stale call"})
        assert stale.status_code == 200, stale.text
        rows = [weather_row("Paris"), weather_row("Tokyo"), weather_row("Oslo")]
        code, out, err = collect_rollouts(
            helper, rows, work, AGENT, "+num_repeats=4", "+num_samples_in_parallel=12"
        )
        # After the run the store holds nothing: every rollout's calls were taken.
        leftover = post_json(model_url + "/ng_model_calls/pop", {"rollout_ids": ["0-0", "2-3"]}).json()
        # Chat Completions calls are captured too (their usage names differ).
        chat = post_json(
            model_url + "/ng-rollout/chat-7/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "What's the weather in Tokyo?"}]},
        )
        assert chat.status_code == 200, chat.text
        chat_calls = post_json(model_url + "/ng_model_calls/pop", {"rollout_ids": ["chat-7"]}).json()
    return {
        "code": code,
        "out": out,
        "err": err,
        "work": work,
        "leftover": leftover,
        "chat": chat.json(),
        "chat_calls": chat_calls,
    }


@pytest.mark.slow
def test_capture_on_records_every_model_call_of_each_rollout(captured: dict[str, Any]) -> None:
    assert captured["code"] == 1, captured["err"]  # the Oslo rollouts failed (model 500): not reward 0
    out = captured["out"]
    assert len(out) == 8 and all(r["expected_city"] in CALLS_PER_CITY for r in out)
    calls = [c for c in _lines(captured["work"] / "output_model_calls.jsonl") if c["kind"] == "model_call"]
    by_rollout: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for c in calls:
        by_rollout.setdefault((c["_ng_task_index"], c["_ng_rollout_index"]), []).append(c)
    for rollout in out:
        key = (rollout["_ng_task_index"], rollout["_ng_rollout_index"])
        mine = by_rollout[key]
        # As many calls as model turns in the trajectory (each tool call came from one model turn).
        turns = sum(1 for item in rollout["response"]["output"] if item["type"] == "function_call") + 1
        assert len(mine) == turns == CALLS_PER_CITY[rollout["expected_city"]]
        assert [c["call_index"] for c in mine] == list(range(turns))
        usage = rollout["response"]["usage"]  # the agent's sum over turns: the calls' counts add up to it
        assert sum(c["tokens_in"] for c in mine) == usage["input_tokens"]
        assert sum(c["tokens_out"] for c in mine) == usage["output_tokens"]
        for c in mine:
            # The right rollout: the request is this row's conversation, not another one in flight.
            assert f"weather in {rollout['expected_city']}?" in orjson.dumps(c["request"]["input"]).decode()
            assert c["rollout_status"] == "ok" and c["status_code"] == 200 and c["error"] is None
            assert c["agent_ref"]["name"] == AGENT and c["model_ref"]["name"] == "policy_model"
            assert c["latency_ms"] >= 0 and c["completed_at"] >= c["started_at"]
            assert c["tokens_in"] > 0 and c["tokens_out"] > 0
            assert c["tokens_total"] == c["tokens_in"] + c["tokens_out"] == c["usage"]["total_tokens"]
        # The last call's answer is the trajectory's last message (with the secret scrubbed).
        last = orjson.dumps(rollout["response"]["output"][-1]["content"]).decode().replace(SECRET, REDACTED)
        assert orjson.dumps(mine[-1]["response"]["output"][-1]["content"]).decode() == last
    assert captured["leftover"]["enabled"] is True and captured["leftover"]["calls"] == {}


@pytest.mark.slow
def test_chat_completions_calls_are_captured(captured: dict[str, Any]) -> None:
    (call,) = captured["chat_calls"]["calls"]["chat-7"]
    usage = captured["chat"]["usage"]
    assert call["dialect"] == "chat_completions" and call["path"] == "/v1/chat/completions"
    assert (call["tokens_in"], call["tokens_out"]) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert call["response"] == captured["chat"] and call["request"]["messages"][0]["content"].endswith(
        "Tokyo?"
    )


@pytest.mark.slow
def test_a_model_error_is_an_error_entry_and_secrets_are_redacted(captured: dict[str, Any]) -> None:
    lines = _lines(captured["work"] / "output_model_calls.jsonl")
    failed = [c for c in lines if c["rollout_status"] == "failed"]
    assert len(failed) == 4 and {c["_ng_task_index"] for c in failed} == {2}
    for c in failed:
        assert c["status_code"] == 500 and c["error_category"] == "server_error" and c["error"]
        assert "Oslo" in orjson.dumps(c["request"]).decode()
    failures = _lines(captured["work"] / "output_failures.jsonl")
    assert sorted((f["_ng_task_index"], f["_ng_rollout_index"]) for f in failures) == [
        (2, r) for r in range(4)
    ]
    text = (captured["work"] / "output_model_calls.jsonl").read_text()
    assert SECRET not in text and REDACTED in text
    summary = orjson.loads((captured["work"] / "output_aggregate_metrics.json").read_bytes())
    assert summary["model_calls"]["calls_written"] == len(lines) == 4 * 3 + 4 * 2 + 4
    assert summary["model_calls"]["pull_errors"] == 0
    assert summary["model_calls"]["stale_discarded"] == 1 and "a stale call" not in text


@pytest.mark.slow
def test_viewer_trajectory_page_shows_the_model_calls(captured: dict[str, Any], launch: Any) -> None:
    from nemo_gym.tools.viewer.browser import chromium_missing_reason
    from tests.test_viewer_app import get, start_viewer, wait_ready

    work: Path = captured["work"]
    _, base = start_viewer(launch, f"+jsonl_fpath={work / 'output.jsonl'}", f"+index_dir={work / 'index'}")
    assert wait_ready(base, "1")["state"] == "ready"
    rows = get(f"{base}/api/files/1/rows", sort="task", limit=50).json()["rows"]
    paris = next(r for r in rows if r["task"] == 0)
    api = get(f"{base}/api/files/1/rollouts/{paris['row']}/model_calls").json()
    assert api["present"] is True and len(api["calls"]) == 3
    assert {(c["_ng_task_index"], c["_ng_rollout_index"]) for c in api["calls"]} == {(0, paris["rollout"])}
    if chromium_missing_reason() is not None:
        pytest.skip(str(chromium_missing_reason()))
    from playwright.sync_api import expect

    from nemo_gym.tools.viewer.browser import browser_context

    with browser_context() as ctx:
        page = ctx.new_page()
        page.set_default_timeout(30_000)
        page.goto(f"{base}/#/rollout/{paris['row']}")
        page.locator("#model-calls-count").wait_for()
        assert page.locator("#model-calls-count").inner_text() == "3 calls"
        cards = page.locator("#model-calls .mcall")
        assert cards.count() == 3
        assert " ms" in cards.nth(0).locator(".mc-latency").inner_text()
        tokens = cards.nth(0).locator(".mc-tokens").inner_text()
        assert tokens == f"{api['calls'][0]['tokens_in']} in / {api['calls'][0]['tokens_out']} out"
        request = cards.nth(0).locator("details.mc-request")
        assert "weather in Paris" not in request.inner_text()  # collapsed
        request.locator("summary").click()
        expect(request).to_contain_text("weather in Paris")  # waits (bounded) for the opened details


@pytest.mark.slow
def test_capture_off_records_nothing(tmp_path: Path) -> None:
    with running_servers([EXAMPLE_CONFIG], _config()) as helper:
        code, out, err = collect_rollouts(helper, [weather_row("Tokyo")], tmp_path, AGENT, "+num_repeats=2")
        answer = post_json(
            server_url(helper, "policy_model") + "/ng_model_calls/pop", {"rollout_ids": ["0-0", "0-1"]}
        ).json()
        # A prefixed call is answered, and still not recorded.
        prefixed = post_json(
            server_url(helper, "policy_model") + "/ng-rollout/0-0/v1/responses",
            weather_row("Tokyo")["responses_create_params"],
        )
        after = post_json(
            server_url(helper, "policy_model") + "/ng_model_calls/pop", {"rollout_ids": ["0-0"]}
        )
        # Asking the collector for capture the servers do not do is a clear error, nothing written.
        code2, _, err2 = collect_rollouts(
            helper, [weather_row("Tokyo")], tmp_path / "again", AGENT, "+observability_enabled=true"
        )
    assert code == 0 and len(out) == 2, err
    assert answer == {"enabled": False, "calls": {}, "dropped": {}, "stored_calls": 0, "dropped_total": 0}
    assert prefixed.status_code == 200 and after.json()["calls"] == {}
    assert not (tmp_path / "output_model_calls.jsonl").exists()
    assert code2 == 2 and "restart ng_run with +observability_enabled=true" in err2
    assert not (tmp_path / "again" / "output.jsonl").exists()


@pytest.mark.slow
def test_the_bound_drops_oldest_calls_and_counts_them(tmp_path: Path) -> None:
    config = _config(observability_enabled=True, model_call_capture_max_calls=1)
    with running_servers([EXAMPLE_CONFIG], config) as helper:
        code, out, err = collect_rollouts(
            helper, [weather_row("Paris")], tmp_path, AGENT, "+num_repeats=2", "+num_samples_in_parallel=1"
        )
    assert code == 0 and len(out) == 2, err
    lines = _lines(tmp_path / "output_model_calls.jsonl")
    for rollout in range(2):
        mine = [c for c in lines if c["_ng_rollout_index"] == rollout]
        kinds = Counter(c["kind"] for c in mine)
        assert kinds == {"model_call": 1, "dropped": 1}
        dropped = next(c for c in mine if c["kind"] == "dropped")
        assert dropped["dropped_calls"] == 2  # 3 calls, room for 1: the 2 oldest went
        kept = next(c for c in mine if c["kind"] == "model_call")
        assert kept["call_index"] == 2  # the newest (the final answer) is the one kept


def test_store_bounds_entries_and_bytes_oldest_first() -> None:
    store = ModelCallStore(max_calls=3, max_bytes=10_000)
    for i in range(5):
        store.add("a" if i % 2 == 0 else "b", {"n": i}, b'{"i": %d}' % i, b"{}")
    assert len(store) == 3 and store.dropped_total == 2
    calls, dropped = store.pop(["a", "b", "missing"])
    assert [c["n"] for c in calls["a"]] == [2, 4] and [c["n"] for c in calls["b"]] == [3]
    assert calls["a"][0]["request"] == {"i": 2} and dropped == {"a": 1, "b": 1}
    assert len(store) == 0 and store.bytes == 0
    assert store.pop(["a"]) == ({}, {})  # popped once: gone

    # A rollout whose every stored call was dropped keeps counting its calls.
    one = ModelCallStore(max_calls=1, max_bytes=10_000)
    one.add("r", {}, b"{}", b"{}")
    one.add("other", {}, b"{}", b"{}")  # drops r's only call
    one.add("r", {}, b"{}", b"{}")  # drops other's
    calls, dropped = one.pop(["r", "other"])
    assert [c["call_index"] for c in calls["r"]] == [1] and dropped == {"r": 1, "other": 1}

    small = ModelCallStore(max_calls=100, max_bytes=2_000)
    small.add("x", {"n": 0}, b"x" * 600, b"{}")
    small.add("x", {"n": 1}, b"y" * 600, b"{}")  # 2 x (600 + overhead) > 2000: the first goes
    small.add("x", {"n": 2}, b"z" * 5_000, b"{}")  # alone larger than the bound: kept without bodies
    calls, dropped = small.pop(["x"])
    assert [c["n"] for c in calls["x"]] == [1, 2] and dropped == {"x": 1}
    assert calls["x"][0]["request"] == "y" * 600 and calls["x"][1]["request"] is None
    assert "model_call_capture_max_bytes" in calls["x"][1]["payload_omitted"]


@pytest.mark.slow
def test_ng_e2e_collect_rollouts_writes_the_model_calls_per_agent(tmp_path: Path, launch: Any) -> None:
    import sys

    model = "responses_api_models/scripted_model/configs/scripted_model.yaml"
    out = tmp_path / "eval.jsonl"
    run = launch(
        "-m",
        "nemo_gym.tools.eval.e2e",
        f"+config_paths=[{EXAMPLE_CONFIG},{model}]",
        "+head_server.port=0",
        "+progress=false",
        "+split=example",
        f"+output_jsonl_fpath={out}",
        "+observability_enabled=true",
        cmd=sys.executable,
    )
    assert run.wait_exit(240) == 0, run.output
    assert run.wait_no_processes() == []
    rollouts = _lines(tmp_path / "eval" / "rollouts" / f"{AGENT}.jsonl")
    calls = _lines(tmp_path / "eval" / "rollouts" / f"{AGENT}_model_calls.jsonl")
    assert len(rollouts) == 5
    per_rollout = Counter((c["_ng_task_index"], c["_ng_rollout_index"]) for c in calls)
    # The scripted model's default: a get_weather call, then an answer: two model calls per rollout.
    assert per_rollout == {(r["_ng_task_index"], r["_ng_rollout_index"]): 2 for r in rollouts}
    for c in calls:
        row = next(r for r in rollouts if r["_ng_task_index"] == c["_ng_task_index"])
        question = [m["content"] for m in row["responses_create_params"]["input"] if m.get("role") == "user"]
        asked = [m["content"] for m in c["request"]["input"] if m.get("role") == "user"]
        assert asked == question and c["status_code"] == 200 and c["rollout_status"] == "ok"


def test_a_streamed_answer_is_recorded_as_one_object() -> None:
    """Server-sent events of each API become one object: a Responses stream's final response; a Chat or
    Messages stream's usage and token-id fields (what harness training reads)."""
    from nemo_gym.server.model_calls import _parse

    responses = (
        b'event: response.created\ndata: {"type":"response.created","response":{"id":"r","output":[]}}\n\n'
        b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"r","output":'
        b'[{"type":"message","generation_token_ids":[5]}],"usage":{"input_tokens":3,"output_tokens":1}}}\n\n'
    )
    parsed = _parse(responses)
    assert (
        parsed["id"] == "r" and parsed["output"][0]["generation_token_ids"] == [5] and parsed["event_stream"]
    )
    chat = (
        b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{"prompt_token_ids":[1,2],"generation_token_ids":[3],'
        b'"generation_log_probs":[-0.1]},"finish_reason":"stop"}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":1}}\n\ndata: [DONE]\n\n'
    )
    parsed = _parse(chat)
    assert parsed["prompt_token_ids"] == [1, 2] and parsed["generation_token_ids"] == [3]
    assert parsed["usage"]["completion_tokens"] == 1 and parsed["events"] == 3
    messages = (
        b'event: message_start\ndata: {"type":"message_start","message":{"id":"m"}}\n\n'
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
        b'"usage":{"input_tokens":4,"output_tokens":2},"prompt_token_ids":[9],"generation_token_ids":[8,7]}\n\n'
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )
    parsed = _parse(messages)
    assert parsed["generation_token_ids"] == [8, 7] and parsed["usage"]["output_tokens"] == 2
