"""file_edit_tasks' /verify over real HTTP: the final text of the files decides the reward; a request
without the files is a setup error (422 naming ``final_files``), never a 0. End to end with a real
coding agent (mini-swe-agent run by harness_agent): responses_api_agents/harness_agent/tests/."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from nemo_gym.run.cli import RunHelper
from nemo_gym.tools.testing import example_rows, get, post_json, running_servers, server_url, text_response
from resources_servers.file_edit_tasks.app import normalized

CONFIG = "resources_servers/file_edit_tasks/configs/file_edit_tasks.yaml"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    helper: RunHelper
    with running_servers([CONFIG]) as helper:
        yield server_url(helper, "file_edit_tasks")


def _verify(url: str, row: dict[str, Any], final_files: dict[str, str | None] | None) -> Any:
    body = {**row, "response": text_response("done")}
    if final_files is not None:
        body["final_files"] = final_files
    return post_json(url + "/verify", body)


def test_every_example_row_scores_1_with_its_expected_files_and_0_untouched(server: str) -> None:
    for row in example_rows("file_edit_tasks"):
        resp = _verify(server, row, dict(row["expected_files"]))
        assert resp.status_code == 200, resp.text
        assert resp.json()["reward"] == 1.0 and resp.json()["failure_reason"] is None
        untouched = _verify(server, row, dict(row["harness_files"]))
        assert untouched.json()["reward"] == 0.0
        assert untouched.json()["failure_reason"] == "wrong_content"


def test_line_endings_trailing_whitespace_and_blank_lines_do_not_count(server: str) -> None:
    row = example_rows("file_edit_tasks")[0]
    edited = "def add(a, b):   \r\n    return a + b\r\n\n\n"
    resp = _verify(server, row, {"calc.py": edited, "other.py": "x = 1\n"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["reward"] == 1.0 and resp.json()["files_matched"] == {"calc.py": True}


def test_a_wrong_edit_or_a_deleted_file_scores_0_with_the_reason(server: str) -> None:
    row = example_rows("file_edit_tasks")[0]
    wrong = _verify(server, row, {"calc.py": "def add(a, b):\n    return a * b\n"}).json()
    assert (wrong["reward"], wrong["failure_reason"], wrong["files_matched"]) == (
        0.0,
        "wrong_content",
        {"calc.py": False},
    )
    for files in ({"calc.py": None}, {}):  # reported as gone, or not reported at all
        gone = _verify(server, row, files).json()
        assert (gone["reward"], gone["failure_reason"]) == (0.0, "missing_file")


def test_verify_without_final_files_is_a_422_naming_it_never_a_reward(server: str) -> None:
    resp = _verify(server, example_rows("file_edit_tasks")[0], None)
    assert resp.status_code == 422, resp.text
    assert "final_files" in resp.text and "reward" not in resp.json()


def test_a_row_needs_expected_files(server: str) -> None:
    schema = get(server + "/row_schema").json()
    assert "expected_files" in schema["required"] and "final_files" not in schema["required"]
    row = {k: v for k, v in example_rows("file_edit_tasks")[0].items() if k != "expected_files"}
    resp = _verify(server, row, {"calc.py": "x"})
    assert resp.status_code == 422 and "expected_files" in resp.text


def test_normalized_keeps_leading_whitespace_and_inner_blank_lines() -> None:
    assert normalized("  a\n\n b \r\n\n") == ["  a", "", " b"]
    assert normalized("") == []


def test_harness_agent_reports_the_files_it_is_told_to_and_nothing_outside() -> None:
    """harness_agent's ``final_files``: globbed in the working directory after the harness ended; a name
    without wildcards that is gone is reported as null; a symlink out of the directory is not read."""
    harness = (
        "import os, openai; "
        "openai.OpenAI().chat.completions.create(model=os.environ['NG_MODEL'], "
        "messages=[{'role': 'user', 'content': open('TASK.md').read()}]); "
        "open('calc.py', 'w').write('def add(a, b):\\n    return a + b\\n'); "
        "os.symlink('/etc/hostname', 'leak.py'); os.remove('notes.py')"
    )
    extra = {
        "observability_enabled": True,
        "python_editor": {
            "responses_api_agents": {
                "harness_agent": {
                    "entrypoint": "app.py",
                    "resources_server": {"type": "resources_servers", "name": "file_edit_tasks"},
                    "model_server": {"type": "responses_api_models", "name": "policy_model"},
                    "command": ["python", "-c", harness],
                    "task_input": "file",
                    "final_files": ["*.py", "notes.py", "gone/never.py"],
                }
            }
        },
    }
    row = example_rows("file_edit_tasks")[0]
    row = {**row, "harness_files": {**row["harness_files"], "notes.py": "# scratch\n"}}
    with running_servers([CONFIG], extra) as helper:
        resp = post_json(server_url(helper, "python_editor") + "/run", row, timeout=120)
    assert resp.status_code == 200, resp.text
    result = resp.json()
    assert result["final_files"] == {
        "calc.py": "def add(a, b):\n    return a + b\n",
        "notes.py": None,
        "gone/never.py": None,
    }
    assert result["reward"] == 1.0 and result["harness"]["model_calls"] == 1
