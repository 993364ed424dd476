"""bash_agent over real HTTP: parsing, the observation, every stop reason, errors, the collector's metrics.

The servers: the scripted ``policy_model`` (a script per ``[case:...]`` marker in the task message), the
test-only resources server ``bash_test_shell`` (tests/fixture_root/resources_servers/bash_test_shell/:
a ``bash`` tool with workspace_tasks' contract over a per-session dict of files, whose commands print
exactly what the tests expect) and two bash_agent instances: ``test_bash_agent`` (max_steps 4, 2
format errors in a row, outputs cut past 200 characters) and ``budget_bash_agent`` (1 token).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from nemo_gym.openai_utils import NeMoGymResponse
from nemo_gym.run.cli import RunHelper
from nemo_gym.tools.testing import collect_rollouts, post_json, running_servers, server_url

FIXTURE_ROOT = Path(__file__).resolve().parent / "fixture_root"
CONFIG = str(FIXTURE_ROOT / "resources_servers" / "bash_test_shell" / "configs" / "bash_test_shell.yaml")
MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
FENCE = "```"


def say(command: str, thought: str = "Next step.") -> dict[str, Any]:
    """A model turn holding one bash block."""
    return {"text": f"{thought}\n\n{FENCE}bash\n{command}\n{FENCE}"}


SUBMIT = say(f"echo {MARKER}", "Done.")


def _case(marker: str, *turns: dict[str, Any]) -> dict[str, Any]:
    return {"contains": f"[case:{marker}]", "turns": list(turns)}


SCRIPTS = [
    _case("right", say("cat answer.txt"), say("echo 42 > answer.txt"), SUBMIT),
    _case("wrong", say("echo 41 > answer.txt"), SUBMIT),
    _case("no_block", {"text": "I think the answer is 42."}, say("echo 42 > answer.txt"), SUBMIT),
    _case(
        "two_blocks",
        {"text": f"{FENCE}bash\necho 42 > answer.txt\n{FENCE}\nthen\n{FENCE}bash\necho {MARKER}\n{FENCE}"},
        say("echo 42 > answer.txt"),
        SUBMIT,
    ),
    _case(
        "other_languages",
        {"text": f"{FENCE}sh\necho 1 > answer.txt\n{FENCE}"},
        {
            "text": f"Like this:\n{FENCE}python\nprint(42)\n{FENCE}\nso:\n{FENCE}bash\necho 42 > answer.txt\n{FENCE}"
        },
        SUBMIT,
    ),
    _case(
        "errors_then_recover",  # 1 error, a command, 1 error, submit: never 2 in a row, so no stop
        {"text": "thinking"},
        say("echo 42 > answer.txt"),
        {"text": "still thinking"},
        SUBMIT,
    ),
    # 1 MB of unclosed openers: the default action regex backtracks quadratically on it (hours, on the
    # agent's event loop, before); bash_blocks reads it in one pass.
    _case("unclosed_openers", {"text": f"{FENCE}bash\nx" * 110_000}, say("echo 42 > answer.txt"), SUBMIT),
    _case("format_stop", {"text": "no command"}, {"text": f"{FENCE}\nls\n{FENCE}"}, SUBMIT),
    _case("tool_call", {"tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}]}, SUBMIT),
    _case("long_output", say("seq 1000"), SUBMIT),
    _case("loop", *[say(f"echo step{i}") for i in range(10)]),
    _case(
        "submit_forms",
        say(f"echo 'not yet {MARKER}'"),  # the marker, but not as the output's first line
        say(f"echo {MARKER} && exit 3"),  # the marker first, but the command failed
        say("echo 42 > answer.txt"),
        say(f"echo {MARKER} && cat answer.txt"),  # submits; the rest of the output is the submission
    ),
    _case("timeout", say("sleep 100"), SUBMIT),
    _case("refused", say("refuse"), SUBMIT),
    _case("crash", say("crash"), SUBMIT),
    _case("garble", say("garble"), SUBMIT),
    _case("model_down", {"http_error": 503}),
    _case("context_full", say("echo 42 > answer.txt"), {"incomplete": True}, SUBMIT),
    _case(
        "cut_off",
        {"incomplete": True, "text": f"Let me write it:\n{FENCE}bash\necho 4"},
        say("echo 42 > answer.txt"),
        SUBMIT,
    ),
]

EXTRA_CONFIG = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": SCRIPTS}}}}
TOOLS = [
    {
        "type": "function",
        "name": "bash",
        "description": "Run a command.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    }
]


@pytest.fixture(scope="module")
def helper() -> Iterator[RunHelper]:
    old_cwd = os.getcwd()
    os.chdir(FIXTURE_ROOT)  # so resources_servers/bash_test_shell/ resolves; servers keep this cwd
    try:
        with running_servers([CONFIG], EXTRA_CONFIG) as run_helper:
            os.chdir(old_cwd)
            yield run_helper
    finally:
        os.chdir(old_cwd)


@pytest.fixture(scope="module")
def urls(helper: RunHelper) -> dict[str, str]:
    names = ("test_bash_agent", "budget_bash_agent", "policy_model", "bash_test_shell")
    return {name: server_url(helper, name) for name in names}


def make_row(marker: str, task_id: int = 7, expected_answer: str = "42") -> dict[str, Any]:
    return {
        "responses_create_params": {
            "input": [{"role": "user", "content": f"[case:{marker}] Write the answer to answer.txt."}],
            "tools": TOOLS,  # offered to simple_agent; bash_agent drops them
        },
        "task_id": task_id,
        "expected_answer": expected_answer,
    }


def run(urls: dict[str, str], marker: str, agent: str = "test_bash_agent") -> dict[str, Any]:
    resp = post_json(urls[agent] + "/run", make_row(marker), timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def user_texts(result: dict[str, Any]) -> list[str]:
    """The messages the agent fed back (observations and format errors), in order."""
    return [
        item["content"]
        for item in result["response"]["output"]
        if item.get("type") == "message" and item.get("role") == "user"
    ]


def loop_numbers(result: dict[str, Any]) -> tuple[str, int, int, int]:
    return result["stop_reason"], result["num_steps"], result["num_commands"], result["num_format_errors"]


# -- the loop ---------------------------------------------------------------------------------------------


def test_right_commands_score_1_and_submit(urls: dict[str, str]) -> None:
    result = run(urls, "right")
    assert result["reward"] == 1.0 and result["submitted"] == 1.0
    assert loop_numbers(result) == ("submitted", 3, 3, 0)
    assert result["commands_run"] == ["cat answer.txt", "echo 42 > answer.txt", f"echo {MARKER}"]
    assert result["seen_task_id"] == 7 and result["expected_answer"] == "42"  # seeded; row fields kept
    # Each command's output came back as the next user message; the submission's did not.
    assert user_texts(result) == [
        "<returncode>1</returncode>\n<output>\ncat: answer.txt: No such file or directory\n\n</output>",
        "<returncode>0</returncode>\n<output>\n\n</output>",
    ]
    kinds = [(i["type"], i.get("role")) for i in result["response"]["output"]]
    assert kinds == [("message", "assistant"), ("message", "user")] * 2 + [("message", "assistant")]


def test_wrong_commands_score_0(urls: dict[str, str]) -> None:
    result = run(urls, "wrong")
    assert result["reward"] == 0.0 and loop_numbers(result) == ("submitted", 2, 2, 0)


def test_the_model_is_offered_no_tools(urls: dict[str, str]) -> None:
    """With no script the scripted model calls the first offered tool; here it answers text instead
    (so no tools reached it), which has no bash block: a format error."""
    result = run(urls, "unscripted")
    assert loop_numbers(result) == ("format_errors", 2, 0, 2)
    assert "no bash code block" in user_texts(result)[0]
    assert "tools" not in result["response"] or not result["response"]["tools"]


@pytest.mark.parametrize(
    ("marker", "problem"),
    [
        ("no_block", "your answer has no bash code block."),
        ("two_blocks", "your answer has 2 bash code blocks; exactly one is run per turn."),
        ("other_languages", "your answer has no bash code block."),  # an ```sh block is not a command
        ("unclosed_openers", "your answer has no bash code block."),
    ],
)
def test_a_turn_without_exactly_one_bash_block_runs_nothing_and_gets_a_format_error(
    urls: dict[str, str], marker: str, problem: str
) -> None:
    result = run(urls, marker)
    first = user_texts(result)[0]
    assert first.startswith(f"Format error: {problem}") and f"echo {MARKER}" in first
    # Nothing of the bad turn ran; the next turn's single command did, then the submission.
    assert result["commands_run"] == ["echo 42 > answer.txt", f"echo {MARKER}"]
    assert loop_numbers(result) == ("submitted", 3, 2, 1) and result["reward"] == 1.0


def test_format_errors_in_a_row_stop_the_rollout_and_a_good_turn_resets_the_count(
    urls: dict[str, str],
) -> None:
    stopped = run(urls, "format_stop")  # a bare ``` block is not a bash block either
    assert loop_numbers(stopped) == ("format_errors", 2, 0, 2)
    assert stopped["commands_run"] == [] and stopped["reward"] == 0.0 and stopped["submitted"] == 0.0
    assert len(user_texts(stopped)) == 1  # the last error is not fed back: there is no next turn

    recovered = run(urls, "errors_then_recover")
    assert loop_numbers(recovered) == ("submitted", 4, 2, 2) and recovered["reward"] == 1.0


def test_a_tool_call_is_a_format_error_with_its_call_answered(urls: dict[str, str]) -> None:
    result = run(urls, "tool_call")
    output = result["response"]["output"]
    assert [i["type"] for i in output[:2]] == ["function_call", "function_call_output"]
    assert output[1]["call_id"] == output[0]["call_id"] and "no tools" in output[1]["output"]
    assert "you called a tool ('bash')" in user_texts(result)[0]
    assert loop_numbers(result) == ("submitted", 2, 1, 1)


def test_long_output_keeps_head_and_tail_and_says_how_much_was_cut(urls: dict[str, str]) -> None:
    full = "".join(f"{i}\n" for i in range(1, 1001))  # 3,893 characters; test_bash_agent keeps 200
    text = user_texts(run(urls, "long_output"))[0]
    cut = len(full) - 200
    assert text.startswith(f"<returncode>0</returncode>\n<output>\n{full[:100]}\n[... {cut} characters cut")
    assert f"({len(full)} in all)" in text
    assert text.endswith(f"...]\n{full[-100:]}\n</output>")


def test_max_steps_bounds_the_turns(urls: dict[str, str]) -> None:
    result = run(urls, "loop")  # the script would go on for 10 turns
    assert loop_numbers(result) == ("max_steps", 4, 4, 0) and result["submitted"] == 0.0
    assert result["commands_run"] == [f"echo step{i}" for i in range(4)]
    assert result["reward"] == 0.0  # verified all the same


def test_the_token_budget_stops_the_rollout(urls: dict[str, str]) -> None:
    result = run(urls, "loop", agent="budget_bash_agent")
    assert loop_numbers(result) == ("max_total_tokens", 1, 1, 0)
    assert result["response"]["usage"]["total_tokens"] >= 1


def test_an_incomplete_answer_is_a_format_error_and_an_empty_one_ends_the_rollout(
    urls: dict[str, str],
) -> None:
    cut = run(urls, "cut_off")  # the output budget ran out mid-block: the model can be shorter next turn
    assert user_texts(cut)[0].startswith("Format error: your answer was cut off")
    assert loop_numbers(cut) == ("submitted", 3, 2, 1) and cut["reward"] == 1.0
    full = run(urls, "context_full")  # nothing at all: the context is full, no later turn can do better
    assert loop_numbers(full) == ("incomplete", 2, 1, 0) and full["reward"] == 1.0
    assert full["commands_run"] == ["echo 42 > answer.txt"]


def test_only_a_successful_command_whose_output_starts_with_the_marker_submits(urls: dict[str, str]) -> None:
    result = run(urls, "submit_forms")
    assert loop_numbers(result) == ("submitted", 4, 4, 0) and result["reward"] == 1.0
    texts = user_texts(result)
    assert texts[0] == f"<returncode>0</returncode>\n<output>\nnot yet {MARKER}\n\n</output>"
    assert texts[1] == f"<returncode>3</returncode>\n<output>\n{MARKER}\n\n</output>"


def test_a_timed_out_command_is_output_the_model_reads(urls: dict[str, str]) -> None:
    result = run(urls, "timeout")
    assert user_texts(result)[0] == (
        "<warning>The command ran past its time limit and was killed.</warning>\n"
        "<returncode>none</returncode>\n<output>\n\n</output>"
    )
    assert result["stop_reason"] == "submitted"


def test_a_refused_command_is_output_the_model_reads(urls: dict[str, str]) -> None:
    result = run(urls, "refused")
    assert "refused (HTTP 400): this shell refuses that command" in user_texts(result)[0]
    assert result["stop_reason"] == "submitted"


def test_the_agent_responses_endpoint_returns_the_trajectory(urls: dict[str, str]) -> None:
    """Commands run in the caller's resources session (here: none seeded), no verify. The observations
    are user messages among the output items, as simulated_user_agent's are (not the SDK's strict shape)."""
    body = make_row("right")["responses_create_params"]
    resp = post_json(urls["test_bash_agent"] + "/v1/responses", body, timeout=60)
    assert resp.status_code == 200, resp.text
    parsed = NeMoGymResponse.model_validate(resp.json())
    assert parsed.output_text.endswith(f"echo {MARKER}\n{FENCE}")
    assert [getattr(item, "role", None) for item in parsed.output] == ["assistant", "user"] * 2 + [
        "assistant"
    ]
    assert parsed.usage is not None and parsed.usage.total_tokens > 0


# -- infrastructure failures: errors, never rewards ----------------------------------------------------------


@pytest.mark.parametrize(
    ("marker", "server", "path", "status", "kind", "detail"),
    [
        ("crash", "bash_test_shell", "/bash", 503, "http_error", "sandbox unavailable"),
        ("garble", "bash_test_shell", "/bash", 200, "bad_response", "must answer"),
        ("model_down", "policy_model", "/v1/responses", 503, "http_error", "scripted HTTP 503"),
    ],
)
def test_an_infrastructure_failure_fails_the_rollout_naming_it(
    urls: dict[str, str], marker: str, server: str, path: str, status: int, kind: str, detail: str
) -> None:
    resp = post_json(urls["test_bash_agent"] + "/run", make_row(marker))
    assert resp.status_code == 502, resp.text
    error = resp.json()["error"]
    assert error["kind"] == "upstream_error" and error["server"] == "test_bash_agent"
    inner = error["inner"]
    assert (inner["server"], inner["path"], inner["status"], inner["kind"]) == (server, path, status, kind)
    assert detail in orjson.dumps(inner["detail"]).decode()


def test_the_collector_records_rewards_loop_metrics_and_failures(helper: RunHelper, tmp_path: Path) -> None:
    rows = [make_row("right"), make_row("wrong"), make_row("format_stop"), make_row("crash")]
    code, out, err = collect_rollouts(helper, rows, tmp_path, "test_bash_agent", "+max_attempts=1")
    assert [(r["reward"], r["stop_reason"]) for r in out] == [
        (1.0, "submitted"),
        (0.0, "submitted"),
        (0.0, "format_errors"),
    ], err[-2000:]
    assert code == 1  # the crashed row is a failure, not a reward
    failures = [orjson.loads(line) for line in (tmp_path / "output_failures.jsonl").read_text().splitlines()]
    assert [f["_ng_task_index"] for f in failures] == [3]
    metrics = orjson.loads((tmp_path / "output_aggregate_metrics.json").read_bytes())
    assert metrics["mean/submitted"] == pytest.approx(2 / 3)
    assert metrics["mean/num_steps"] == pytest.approx((3 + 2 + 2) / 3)
    assert metrics["mean/num_format_errors"] == pytest.approx(2 / 3)


# -- config --------------------------------------------------------------------------------------------------


def import_app() -> Any:
    path = Path(__file__).resolve().parent.parent / "app.py"
    spec = importlib.util.spec_from_file_location("bash_agent_app_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_config_checks_its_bounds_and_the_action_regex() -> None:
    config = import_app().BashAgentConfig
    refs = {
        "name": "a",
        "resources_server": {"type": "resources_servers", "name": "r"},
        "model_server": {"type": "responses_api_models", "name": "m"},
    }
    default = config.model_validate(refs)
    assert (default.max_steps, default.max_consecutive_format_errors, default.max_total_tokens) == (
        30,
        3,
        None,
    )
    for bad, field in (
        ({"max_steps": 0}, "max_steps"),
        ({"max_total_tokens": 0}, "max_total_tokens"),
        ({"action_regex": "```bash\\n.*```"}, "exactly one group"),
        ({"action_regex": "```(bash"}, "not a regular expression"),
        ({"max_step": 3}, "max_step"),
    ):
        with pytest.raises(ValidationError, match=field):
            config.model_validate({**refs, **bad})


def test_the_model_input_starts_with_the_system_prompt_and_drops_the_tools() -> None:
    module = import_app()
    refs = {
        "name": "a",
        "resources_server": {"type": "resources_servers", "name": "r"},
        "model_server": {"type": "responses_api_models", "name": "m"},
    }
    params = {"input": "Fix it.", "tools": TOOLS, "tool_choice": "auto", "temperature": 0.5}
    for overrides, first in (
        ({}, f"echo {MARKER}"),
        ({"submit_marker": "I_AM_DONE"}, "echo I_AM_DONE"),
    ):
        agent = SimpleNamespace(config=module.BashAgentConfig.model_validate({**refs, **overrides}))
        base, items = module.BashAgent._model_params(agent, params)
        assert base == {"temperature": 0.5}
        assert [i["role"] for i in items] == ["system", "user"] and items[1]["content"] == "Fix it."
        assert first in items[0]["content"] and "exactly ONE bash code block" in items[0]["content"]
    agent = SimpleNamespace(
        config=module.BashAgentConfig.model_validate({**refs, "system_prompt": "", "drop_tools": False})
    )
    base, items = module.BashAgent._model_params(agent, params)
    assert base["tools"] == TOOLS and [i["role"] for i in items] == ["user"]
    # A row's own system message gets the prompt appended: still one system message, first.
    agent = SimpleNamespace(config=module.BashAgentConfig.model_validate(refs))
    row_input = [{"role": "system", "content": "Use the bash tool."}, {"role": "user", "content": "Fix it."}]
    _, items = module.BashAgent._model_params(agent, {"input": row_input})
    assert [i["role"] for i in items] == ["system", "user"]
    assert items[0]["content"].startswith("Use the bash tool.\n\nYou act only through shell commands")
