"""``ng_viewer`` driven in headless Chromium: what a person sees and clicks.

Uses Debian's ``/usr/bin/chromium`` through Playwright (no browser download); the tests are
skipped only when that browser or the playwright package is missing. Every wait is bounded (Playwright's timeout below).
The data is written by ``tests/test_viewer_support.py``, so every number on the page is known.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from nemo_gym.tools.viewer.browser import chromium_missing_reason
from tests.conftest import Launcher
from tests.test_viewer_app import URL_RE, start_viewer, wait_ready
from tests.test_viewer_support import (
    MALFORMED_A,
    NEEDLE,
    REASONING_TEXT,
    REWARDS_A,
    TOOL_ERROR,
    ViewerFiles,
    rollout,
    write_files,
)

pytestmark = pytest.mark.skipif(chromium_missing_reason() is not None, reason=str(chromium_missing_reason()))

TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> ViewerFiles:
    return write_files(tmp_path_factory.mktemp("viewer_browser"))


@pytest.fixture(scope="module")
def base(launch_module: Launcher, data: ViewerFiles, tmp_path_factory: pytest.TempPathFactory) -> str:
    _, url = start_viewer(
        launch_module,
        f"+jsonl_fpath={data.a}",
        f"+compare_jsonl_fpath={data.b}",
        f"+index_dir={tmp_path_factory.mktemp('index')}",
    )
    assert wait_ready(url, "1")["state"] == "ready" and wait_ready(url, "2")["state"] == "ready"
    return url


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from nemo_gym.tools.viewer.browser import browser_context

    with browser_context(width=1400, height=900) as ctx:
        ctx.set_default_timeout(TIMEOUT_MS)
        yield ctx


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh tab; fails the test if the page's script threw or logged an error."""
    p = browser.new_page()
    problems: list[str] = []
    p.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    p.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    yield p
    p.close()
    assert problems == []


def expect(locator: Any) -> Any:
    from playwright.sync_api import expect as pw_expect

    pw_expect.set_options(timeout=TIMEOUT_MS)
    return pw_expect(locator)


def row_index(data: ViewerFiles, task: int, rollout_index: int) -> int:
    return next(
        i
        for i, r in enumerate(data.rows_a)
        if (r["_ng_task_index"], r["_ng_rollout_index"]) == (task, rollout_index)
    )


def list_cells(page: Any, column: int) -> list[str]:
    return page.locator(f"#rows-box tbody tr td:nth-child({column})").all_inner_texts()


# ------------------------------------------------------------------------------------------------


def test_open_filter_click_and_read_a_tool_call(page: Any, base: str, data: ViewerFiles) -> None:
    page.goto(base + "/")
    expect(page.locator("#count")).to_have_text("1–18 of 18 rollouts")
    assert len(list_cells(page, 1)) == 18
    # Malformed lines: listed with their line numbers; the rest of the file is shown.
    page.click("#malformed-banner summary")
    expect(page.locator("#malformed-table tbody tr")).to_have_count(2)
    assert page.locator("#malformed-table tbody tr td:first-child").all_inner_texts() == [
        str(n) for n in sorted(MALFORMED_A)
    ]

    page.fill("#f-rmax", "0.5")
    page.fill("#f-tasks", "2-5")
    expect(page.locator("#count")).to_have_text("1–8 of 8 matching (18 in the file)")
    rewards = [float(x) for x in list_cells(page, 4)]
    tasks = [int(x) for x in list_cells(page, 2)]
    assert all(r <= 0.5 for r in rewards) and all(2 <= t <= 5 for t in tasks)
    assert sorted(zip(tasks, rewards, strict=True)) == sorted(
        (t, float(r)) for t, rs in REWARDS_A.items() for r in rs if 2 <= t <= 5 and r <= 0.5
    )
    assert "reward_max=0.5" in page.url and "tasks=2-5" in page.url

    page.fill("#f-q", NEEDLE)
    expect(page.locator("#search-done")).to_have_text("full-text: 1 match")
    expect(page.locator("#rows-box tbody tr")).to_have_count(1)
    page.click("#rows-box tbody tr")

    expect(page.locator("#trajhead .title")).to_have_text("Task 4 · rollout 0")
    call = page.locator("#conversation .call")
    expect(call).to_have_count(1)
    expect(call.locator(".fname")).to_have_text("get_weather")
    args = call.locator(".pane").nth(0).locator("pre").inner_text()
    assert orjson.loads(args) == {"city": "Oslo"} and args.startswith("{\n  ")  # pretty-printed
    output = orjson.loads(call.locator(".pane").nth(1).locator("pre").inner_text())
    assert output["note"] == NEEDLE
    expect(page.locator("#verify .reward-big")).to_have_text("0")
    verify_rows = dict(
        zip(
            page.locator("#verify td:first-child").all_inner_texts(),
            page.locator("#verify td:nth-child(2)").all_inner_texts(),
            strict=True,
        )
    )
    assert verify_rows["expected_city"] == "Oslo" and verify_rows["_ng_task_index"] == "4"
    expect(page.locator("#position")).to_have_text("1 of 1")


def test_trajectory_shows_errors_reasoning_and_side_panel(page: Any, base: str, data: ViewerFiles) -> None:
    page.goto(f"{base}/#/rollout/{row_index(data, 1, 2)}")
    bad = page.locator("#conversation .call.error")
    expect(bad).to_have_count(1)
    expect(bad.locator(".badge.err")).to_have_text("tool error")
    assert TOOL_ERROR in bad.locator(".pane.err").inner_text()
    roles = page.locator("#conversation .msg").evaluate_all("els => els.map((e) => e.dataset.role)")
    assert roles == ["developer", "user", "assistant"]
    expect(page.locator("#tools-panel summary")).to_have_text(["get_weather"])
    params = dict(
        zip(
            page.locator("#params-panel dt").all_inner_texts(),
            page.locator("#params-panel dd").all_inner_texts(),
            strict=True,
        )
    )
    assert params == {"temperature": "0.6", "max_output_tokens": "512"}

    page.goto(f"{base}/#/rollout/{row_index(data, 3, 1)}")
    reasoning = page.locator("details.reasoning")
    expect(reasoning).to_have_count(1)
    expect(page.get_by_text(REASONING_TEXT)).to_be_hidden()  # collapsed by default
    page.keyboard.press("e")
    expect(page.get_by_text(REASONING_TEXT)).to_be_visible()
    page.keyboard.press("r")
    expect(page.locator("#raw")).to_contain_text('"_ng_rollout_index": 1')


def test_keyboard_navigation_follows_the_list_order(page: Any, base: str, data: ViewerFiles) -> None:
    page.goto(base + "/#/list?sort=reward&desc=1")
    expect(page.locator("#rows-box tbody tr")).to_have_count(18)
    order = sorted(range(18), key=lambda i: -float(data.rows_a[i]["reward"]))
    page.keyboard.press("j")
    page.keyboard.press("j")
    page.keyboard.press("Enter")
    expect(page.locator("#position")).to_have_text("3 of 18")
    assert re.search(rf"#/rollout/{order[2]}\?", page.url)
    page.keyboard.press("j")
    expect(page.locator("#position")).to_have_text("4 of 18")
    assert re.search(rf"#/rollout/{order[3]}\?", page.url)
    page.keyboard.press("ArrowLeft")
    page.keyboard.press("k")
    expect(page.locator("#position")).to_have_text("2 of 18")
    page.keyboard.press("Escape")
    expect(page.locator("#rows-box tbody tr.sel")).to_have_attribute("data-row", str(order[1]))
    assert "sort=reward" in page.url


def test_summary_histogram_tasks_failures(page: Any, base: str, data: ViewerFiles) -> None:
    page.goto(base + "/#/summary")
    expect(page.locator("#stat-rollouts .value")).to_have_text("18")
    expect(page.locator("#stat-mean .value")).to_have_text("0.4583")  # 8.25 / 18
    expect(page.locator("#stat-malformed .value")).to_have_text("2")
    expect(page.locator("#stat-failures .value")).to_have_text("2")
    bars = page.locator("#histogram rect.barrect")
    expect(bars).to_have_count(4)
    assert bars.evaluate_all("els => els.map((e) => e.querySelector('title').textContent)") == [
        "reward 0: 7 rollouts",
        "reward 0.25: 3 rollouts",
        "reward 0.5: 1 rollouts",
        "reward 1: 7 rollouts",
    ]
    expect(page.locator("#tasks tbody tr")).to_have_count(6)
    page.click('#tasks th[data-key="pass_rate"]')
    expect(page.locator('#tasks th[data-key="pass_rate"] .arrow')).to_have_text("▼")
    assert page.locator("#tasks tbody tr").evaluate_all("els => els.map((e) => e.dataset.task)") == [
        "0",
        "3",
        "2",
        "4",
        "1",
        "5",
    ]
    assert page.locator("#failures tbody tr td:nth-child(5)").all_inner_texts() == ["timeout", "server_error"]
    assert page.locator("#malformed tbody tr td:first-child").all_inner_texts() == [
        str(n) for n in sorted(MALFORMED_A)
    ]
    page.click('#tasks tbody tr[data-task="3"]')
    expect(page.locator("#count")).to_have_text("1–3 of 3 matching (18 in the file)")
    assert list_cells(page, 2) == ["3", "3", "3"]


def test_comparison_view(page: Any, base: str) -> None:
    page.goto(base + "/#/compare")
    expect(page.locator("#cmp-both .value")).to_have_text("6")
    expect(page.locator("#cmp-changes .value")).to_have_text("2 / 1")
    page.click('#cmp-table th[data-key="delta"]')
    first = page.locator("#cmp-table tbody tr").first
    expect(first).to_have_attribute("data-task", "1")
    expect(first.locator("td:nth-child(9) span").first).to_have_text("+1")
    page.click('#cmp-table [data-only="regressed"]')
    expect(page.locator("#cmp-table tbody tr")).to_have_count(1)
    expect(page.locator("#cmp-table tbody tr td:nth-child(9) span").first).to_have_text("−1")
    page.click('#cmp-table [data-only="only_b"]')
    expect(page.locator("#cmp-table tbody tr")).to_have_attribute("data-task", "6")


def test_compare_with_a_file_opened_from_the_page(
    page: Any, launch: Launcher, data: ViewerFiles, tmp_path: Path
) -> None:
    _, url = start_viewer(
        launch, f"+jsonl_fpath={data.a}", f"+index_dir={tmp_path}", f"+allowed_roots={data.b.parent}"
    )
    page.goto(url + "/#/compare")
    expect(page.locator(".banner.info")).to_contain_text("Open a second file")
    page.fill("#cmp-path", str(data.b))
    page.click("#cmp-open")
    expect(page.locator("#cmp-both .value")).to_have_text("6")
    expect(page.locator("#cmp-b option:checked")).to_contain_text("rollouts_b.jsonl")


def test_rollout_text_is_never_run_as_html(page: Any, launch: Launcher, tmp_path: Path) -> None:
    evil = '<img src=x onerror="window.__pwned = 1"><script>window.__pwned = 2</script>'
    row = rollout(0, 0, 1.0)
    row["response"]["output"][-1]["content"][0]["text"] = evil
    row["responses_create_params"]["input"][1]["content"] = evil
    row["expected_city"] = evil
    path = tmp_path / "evil.jsonl"
    path.write_bytes(orjson.dumps(row) + b"\n")
    _, url = start_viewer(launch, f"+jsonl_fpath={path}", f"+index_dir={tmp_path}")
    page.goto(url + "/")
    expect(page.locator("#rows-box tbody tr")).to_have_count(1)
    page.click("#rows-box tbody tr")
    expect(page.locator('#conversation .msg[data-role="assistant"] .text')).to_have_text(evil)
    expect(page.locator('#conversation .msg[data-role="user"] .text')).to_have_text(evil)
    assert page.evaluate("() => window.__pwned") is None
    assert page.locator("#app img").count() == 0 and page.locator("#app script").count() == 0


def test_reload_picks_up_appended_rollouts(
    page: Any, launch: Launcher, data: ViewerFiles, tmp_path: Path
) -> None:
    path = tmp_path / "growing.jsonl"
    path.write_bytes(data.b.read_bytes())
    _, url = start_viewer(launch, f"+jsonl_fpath={path}", f"+index_dir={tmp_path}")
    page.goto(url + "/#/list?sort=reward")
    expect(page.locator("#count")).to_have_text("1–21 of 21 rollouts")
    with open(path, "ab") as f:
        f.write(orjson.dumps(rollout(6, 3, 0.125)) + b"\n")
    page.click("#reload")
    expect(page.locator("#count")).to_have_text("1–22 of 22 rollouts")
    expect(page.locator("#rows-box tbody tr").first.locator("td:nth-child(4)")).to_have_text("0")
    assert list_cells(page, 4).count("0.125") == 1


def test_a_file_outside_the_allow_list_is_refused_on_the_page(
    browser: Any, launch: Launcher, data: ViewerFiles, tmp_path: Path
) -> None:
    _, url = start_viewer(launch, f"+jsonl_fpath={data.a}", f"+index_dir={tmp_path}")
    p = browser.new_page()
    problems: list[str] = []
    p.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    try:
        p.goto(url + "/#/compare")
        p.fill("#cmp-path", str(data.b))  # beside the given file, but neither given nor under +allowed_roots
        p.click("#cmp-open")
        expect(p.locator(".picker .warnline")).to_contain_text("ng_viewer may not read")
        expect(p.locator(".picker .warnline")).to_contain_text("+allowed_roots=")
        assert p.locator("#cmp-b option").count() == 2  # placeholder + file A: nothing was opened
    finally:
        p.close()
    assert problems == []


def test_page_works_with_the_token_off_loopback(
    page: Any, launch: Launcher, data: ViewerFiles, tmp_path: Path
) -> None:
    proc = launch(f"+jsonl_fpath={data.a}", "+host=0.0.0.0", f"+index_dir={tmp_path}", cmd="ng_viewer")
    line = proc.wait_for_line(URL_RE, 60)
    assert line is not None, proc.output
    m = URL_RE.search(line)
    assert m is not None and "?token=" in m.group(1)
    printed = m.group(1)  # http://127.0.0.1:<port>/?token=...: only ever sent to 127.0.0.1
    bare = printed.split("?", 1)[0]
    page.goto(printed)
    assert page.url == bare  # the token left the address bar (it is in an HttpOnly cookie now)
    expect(page.locator("#count")).to_have_text("1–18 of 18 rollouts")
    page.click("#rows-box tbody tr >> nth=0")  # the page's own requests carry the cookie
    expect(page.locator("#verify .reward-big")).to_be_visible()
    assert page.evaluate("() => document.cookie") == ""  # not readable by scripts


def test_per_step_rewards_of_multi_step_rollouts(page: Any, launch: Launcher, tmp_path: Path) -> None:
    """Rollouts with ``response.steps`` (aviary_agent) show each step's reward after its items and a table."""
    call = {"type": "function_call", "name": "submit_answer", "arguments": '{"answer": "x"}'}
    row = {
        "_ng_task_index": 0,
        "_ng_rollout_index": 0,
        "reward": -1.0,
        "task_idx": 0,
        "step_rewards": [0.0, -1.0],
        "responses_create_params": {"input": []},
        "response": {
            "output": [
                {"type": "message", "role": "user", "content": "What is 2+3?"},
                {**call, "name": "calculator", "call_id": "c1", "arguments": '{"expr": "2+3"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "5"},
                {**call, "call_id": "c2"},
                {"type": "function_call_output", "call_id": "c2", "output": "False"},
            ],
            "steps": [
                {
                    "step": 1,
                    "output_start": 1,
                    "action_end": 2,
                    "output_end": 3,
                    "reward": 0.0,
                    "done": False,
                },
                {
                    "step": 2,
                    "output_start": 3,
                    "action_end": 4,
                    "output_end": 5,
                    "reward": -1.0,
                    "done": True,
                },
            ],
        },
    }
    path = tmp_path / "steps.jsonl"
    path.write_bytes(orjson.dumps(row) + b"\n")
    _, url = start_viewer(launch, f"+jsonl_fpath={path}", f"+index_dir={tmp_path}")
    page.goto(url + "/")
    page.click("#rows-box tbody tr")
    lines = page.locator("#conversation .step-reward")
    expect(lines).to_have_count(2)
    expect(lines.nth(0)).to_contain_text("step 1 reward")
    expect(lines.nth(1).locator(".badge").first).to_have_text("-1")
    expect(page.locator("#steps-panel h3")).to_have_text("Per-step rewards (2 steps, sum -1)")
    expect(page.locator("#steps-panel tbody tr")).to_have_count(2)
