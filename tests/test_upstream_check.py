"""``ng_check_upstream_env`` on small fake upstream checkouts built here: real scratch copies, real pytest
runs, real ``ng_run`` with the scripted model, real HTTP to ``/seed_session``, the tools and ``/verify``.

One run covers five fake environments (suite passes and rewards reproduce; suite fails; a recorded reward
differs; start-up fails; no recorded rollouts); the cheap checks (options, skip rules) start nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from nemo_gym.config.keys import PACKAGE_PARENT_DIR
from nemo_gym.tools.upstream_check import (
    CheckError,
    Options,
    make_scratch,
    parse_options,
    requirement_skip_reason,
    rewards_match,
    run_checks,
)

# A stateful resources server in upstream's style: the tool `note` stores a word in the rollout's session;
# /verify rewards the word noted in that session against the row's `expected` (REWARD is filled in).
APP = """\
from fastapi import FastAPI, Request
from pydantic import BaseModel, Field

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_gym.server_utils import SESSION_ID_KEY

{prelude}


class NoteConfig(BaseResourcesServerConfig):
    pass


class NoteRequest(BaseModel):
    word: str


class NoteVerifyRequest(BaseVerifyRequest):
    expected: str


class NoteServer(SimpleResourcesServer):
    config: NoteConfig
    noted: dict = Field(default_factory=dict)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/note")(self.note)
        return app

    async def note(self, request: Request, body: NoteRequest) -> dict:
        self.noted[request.session[SESSION_ID_KEY]] = body.word
        return {{"ok": True}}

    async def verify(self, request: Request, body: NoteVerifyRequest) -> BaseVerifyResponse:
        noted = self.noted.get(request.session[SESSION_ID_KEY])
        return BaseVerifyResponse(**body.model_dump(), reward={reward})


if __name__ == "__main__":
    NoteServer.run_webserver()
"""
HONEST = "1.0 if noted == body.expected else 0.0"

PASSING_TESTS = """\
from app import NoteVerifyRequest


def test_the_verify_request_needs_expected():
    assert "expected" in NoteVerifyRequest.model_fields
"""
FAILING_TESTS = """\
def test_passes():
    assert True


def test_fails():
    assert 2 + 2 == 5, "arithmetic is broken in this fake env"
"""


def _config(env: str) -> str:
    return (
        f"{env}_resources_server:\n  resources_servers:\n    {env}:\n      entrypoint: app.py\n"
        f"{env}_simple_agent:\n  responses_api_agents:\n    simple_agent:\n      entrypoint: app.py\n"
        f"      resources_server: {{type: resources_servers, name: {env}_resources_server}}\n"
        "      model_server: {type: responses_api_models, name: policy_model}\n"
    )


def _row(word: str) -> dict[str, Any]:
    return {
        "responses_create_params": {"input": [{"role": "user", "content": f"note the word {word}"}]},
        "expected": word,
    }


def _rollout(word: str, noted: str, reward: float) -> dict[str, Any]:
    """A recorded line as upstream records it: its input normalised by the model server, one tool call."""
    return {
        "responses_create_params": {
            "input": [{"role": "user", "content": f"note the word {word}", "type": "message"}]
        },
        "response": {
            "id": "resp_1",
            "created_at": 0.0,
            "model": "recorded",
            "object": "response",
            "output": [
                {
                    "type": "function_call",
                    "name": "note",
                    "arguments": json.dumps({"word": noted}),
                    "call_id": "c1",
                },
                {
                    "type": "message",
                    "id": "m1",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "noted", "annotations": []}],
                },
            ],
            "parallel_tool_calls": False,
            "tool_choice": "auto",
            "tools": [],
        },
        "reward": reward,
    }


def _write_env(
    upstream: Path,
    env: str,
    *,
    reward: str = HONEST,
    prelude: str = "",
    tests: str = PASSING_TESTS,
    rollouts: list[dict[str, Any]] | None = None,
    requirements: str = "-e nemo-gym[dev] @ ../../\n",
) -> Path:
    folder = upstream / "resources_servers" / env
    (folder / "configs").mkdir(parents=True)
    (folder / "tests").mkdir()
    (folder / "data").mkdir()
    (folder / "app.py").write_text(APP.format(prelude=prelude, reward=reward))
    (folder / "configs" / f"{env}.yaml").write_text(_config(env))
    (folder / "tests" / "test_app.py").write_text(tests)
    (folder / "requirements.txt").write_text(requirements)
    rows = [_row("apple"), _row("pear")]
    (folder / "data" / "example.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if rollouts is not None:
        (folder / "data" / "example_rollouts.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rollouts)
        )
    return folder


def _checkout(tmp_path: Path) -> Path:
    upstream = tmp_path / "upstream"
    (upstream / "nemo_gym").mkdir(parents=True)
    (upstream / "resources_servers").mkdir()
    return upstream


# Recorded: 'pear' noted as 'plum' (0.0), 'apple' noted right (1.0): not in example.jsonl's order, so
# each line must find its task row by its input (normalised by the model server), not by its number.
RECORDED = [_rollout("pear", "plum", 0.0), _rollout("apple", "apple", 1.0)]


@pytest.fixture(scope="module")
def fake_upstream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    upstream = _checkout(tmp_path_factory.mktemp("fake"))
    _write_env(upstream, "good_env", rollouts=RECORDED)
    _write_env(upstream, "failing_suite_env", tests=FAILING_TESTS, rollouts=RECORDED)
    _write_env(upstream, "differing_env", reward="1.0", rollouts=RECORDED)  # scores every line 1.0
    _write_env(
        upstream,
        "no_start_env",
        prelude='raise RuntimeError("this fake env cannot start")',
        tests=FAILING_TESTS,
    )
    _write_env(upstream, "no_rollouts_env", rollouts=None)
    return upstream


def _options(upstream: Path, tmp_path: Path, envs: list[str], **kw: Any) -> Options:
    return Options(
        upstream=upstream,
        envs=envs,
        output=tmp_path / "out.json",
        scratch_dir=tmp_path / "scratch",
        test_timeout_s=kw.pop("test_timeout_s", 120),
        start_timeout_s=60,
        verify_timeout_s=30,
        **kw,
    )


def _cli(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_PARENT_DIR)}
    return subprocess.run(
        [sys.executable, "-c", "from nemo_gym.tools.upstream_check import main; main()", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_five_fake_envs_one_run_table_and_json(fake_upstream: Path, tmp_path: Path) -> None:
    before = sorted(p.relative_to(fake_upstream) for p in fake_upstream.rglob("*"))
    out = tmp_path / "result.json"
    scratch = tmp_path / "scratch"
    proc = _cli(
        [
            f"+upstream_checkout={fake_upstream}",
            f"+output={out}",
            f"+scratch_dir={scratch}",
            "+start_timeout_s=60",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in proc.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| env |")
    }
    assert set(rows) == {
        "good_env",
        "failing_suite_env",
        "differing_env",
        "no_start_env",
        "no_rollouts_env",
    }, proc.stdout
    # env | suite passed | started | reproduced | note
    assert rows["good_env"][:3] == ["1/1", "yes", "2/2"], rows["good_env"]
    assert rows["failing_suite_env"][:3] == ["1/2", "yes", "2/2"]
    assert (
        "test_fails" in rows["failing_suite_env"][3]
        and "arithmetic is broken" in rows["failing_suite_env"][3]
    )
    assert rows["differing_env"][:3] == ["1/1", "yes", "1/2"]
    assert "line 1 0.0 -> 1.0" in rows["differing_env"][3]
    assert rows["no_start_env"][1] == "no" and "this fake env cannot start" in rows["no_start_env"][3]
    assert rows["no_rollouts_env"][:3] == ["1/1", "yes", "no example_rollouts"]

    data = json.loads(out.read_text())
    by_env = {e["env"]: e for e in data["envs"]}
    assert by_env["good_env"]["reproduced"] == 2 and by_env["good_env"]["recorded"] == 2
    assert by_env["differing_env"]["mismatches"] == [{"line": 1, "recorded": 0.0, "got": 1.0}]
    assert (
        by_env["failing_suite_env"]["suite"]["failed"] == 1
        and by_env["failing_suite_env"]["suite"]["passed"] == 1
    )
    assert by_env["no_start_env"]["started"] is False
    assert by_env["no_rollouts_env"]["recorded"] is None
    # The scratch copies are gone, the upstream checkout is as it was, and this repo got no env folder.
    assert list(scratch.iterdir()) == []
    assert sorted(p.relative_to(fake_upstream) for p in fake_upstream.rglob("*")) == before
    assert not any((PACKAGE_PARENT_DIR / "resources_servers" / e).exists() for e in by_env)


@pytest.mark.slow
def test_replaying_the_recorded_tool_calls_is_what_reproduces_a_stateful_reward(
    fake_upstream: Path, tmp_path: Path
) -> None:
    """Without the replay, the 'apple' line's session holds no note and scores 0, not the recorded 1."""
    with_replay, _ = run_checks(
        _options(fake_upstream, tmp_path, ["good_env"], run_tests=False), echo=lambda s: None
    )
    without, _ = run_checks(
        _options(fake_upstream, tmp_path, ["good_env"], run_tests=False, replay_tool_calls=False),
        echo=lambda s: None,
    )
    assert (with_replay[0].reproduced, with_replay[0].recorded) == (2, 2)
    assert (without[0].reproduced, without[0].recorded) == (1, 2)
    assert without[0].mismatches == [{"line": 2, "recorded": 1.0, "got": 0.0}]


def test_an_env_needing_a_gpu_package_is_skipped_without_running(tmp_path: Path) -> None:
    upstream = _checkout(tmp_path)
    _write_env(upstream, "gpu_env", requirements="torch==2.12.0\nnumpy\n", rollouts=RECORDED)
    _write_env(upstream, "git_env", requirements="pkg @ git+https://example.invalid/pkg.git\n")
    results, interrupted = run_checks(
        _options(upstream, tmp_path, ["gpu_env", "git_env"]), echo=lambda s: None
    )
    assert not interrupted
    assert [(r.status, r.started, r.suite.ran) for r in results] == [("skipped", None, False)] * 2
    assert "GPU package (torch==2.12.0)" in results[0].reason
    assert "outside the package registries" in results[1].reason


def test_an_env_needing_a_judge_or_a_key_runs_its_tests_and_is_skipped_at_start(tmp_path: Path) -> None:
    upstream = _checkout(tmp_path)
    folder = _write_env(upstream, "judge_env", rollouts=RECORDED)
    with open(folder / "configs" / "judge_env.yaml", "a") as f:
        f.write("judge_model:\n  responses_api_models:\n    openai_model:\n      entrypoint: app.py\n")
    folder = _write_env(upstream, "key_env", rollouts=RECORDED)
    config = folder / "configs" / "key_env.yaml"
    config.write_text(
        config.read_text().replace(
            "entrypoint: app.py\n", "entrypoint: app.py\n      api_key: ${grader_api_key}\n", 1
        )
    )
    results, _ = run_checks(_options(upstream, tmp_path, ["judge_env", "key_env"]), echo=lambda s: None)
    judge, key = results
    assert judge.status == "skipped" and "judge_model (openai_model)" in judge.reason
    assert judge.suite.ran and judge.suite.passed == 1 and judge.started is None
    assert key.status == "skipped" and key.reason.endswith("user can give: grader_api_key"), key
    assert key.suite.passed == 1 and key.started is False


def test_options_name_the_bad_path_or_env(tmp_path: Path) -> None:
    upstream = _checkout(tmp_path)
    _write_env(upstream, "calendar")
    with pytest.raises(CheckError, match="no such directory"):
        parse_options([f"+upstream_checkout={tmp_path / 'nowhere'}"])
    not_checkout = tmp_path / "plain"
    not_checkout.mkdir()
    with pytest.raises(CheckError, match=rf"{not_checkout} is not an upstream NeMo Gym checkout"):
        parse_options([f"+upstream_checkout={not_checkout}"])
    with pytest.raises(CheckError, match=r"'calender' \(did you mean 'calendar'\?\)"):
        parse_options([f"+upstream_checkout={upstream}", "+envs=[calender]"])
    with pytest.raises(CheckError, match="upstream_checkout"):
        parse_options([])
    with pytest.raises(CheckError, match="test_timout_s"):
        parse_options([f"+upstream_checkout={upstream}", "+test_timout_s=5"])
    with pytest.raises(CheckError, match=r"\+start_timeout_s must be a positive number"):
        parse_options([f"+upstream_checkout={upstream}", "+start_timeout_s=-1"])
    opts = parse_options([f"+upstream_checkout={upstream}"])
    assert opts.envs == ["calendar"] and opts.output.parent.name == "upstream_check"
    proc = _cli([f"+upstream_checkout={tmp_path / 'nowhere'}"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and str(tmp_path / "nowhere") in proc.stderr


def test_reward_comparison_rule() -> None:
    assert rewards_match(1.0, 1) and rewards_match(0.0, 0.0)
    assert not rewards_match(1.0, 0.9999999) and not rewards_match(0.0, 1e-9)
    assert rewards_match(0.75, 0.75 + 5e-7) and not rewards_match(0.75, 0.75 + 5e-6)


def test_requirement_rule_leaves_registry_packages_and_nemo_gym_alone(tmp_path: Path) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text("-e nemo-gym[dev] @ ../../\nnumpy>=1.26\ntiktoken\n")
    assert requirement_skip_reason(req) is None
    req.write_text("nvidia-cublas-cu12\n")
    assert "GPU package" in (requirement_skip_reason(req) or "")


@pytest.mark.slow
def test_ctrl_c_stops_the_running_suite_and_leaves_no_process_or_scratch(tmp_path: Path) -> None:
    upstream = _checkout(tmp_path)
    pid_file = tmp_path / "pytest.pid"
    hanging = f"import os, time\n\ndef test_hangs():\n    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n    time.sleep(300)\n"
    _write_env(upstream, "hanging_env", tests=hanging)
    scratch = tmp_path / "scratch"
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_PARENT_DIR)}
    proc = subprocess.Popen(
        [
            sys.executable, "-c", "from nemo_gym.tools.upstream_check import main; main()",
            f"+upstream_checkout={upstream}", f"+scratch_dir={scratch}", f"+output={tmp_path / 'o.json'}",
        ],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert pid_file.exists(), "the fake env's test never started"
        time.sleep(0.3)
        pytest_pid = int(pid_file.read_text())
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 130, err[-2000:]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pytest_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the env's pytest (pid {pytest_pid}) outlived Ctrl+C")
    assert list(scratch.iterdir()) == []


def test_options_registry_and_help_list_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    from nemo_gym.config.options import COMMAND_OPTIONS
    from nemo_gym.tools.upstream_check import OPTIONS, main

    assert COMMAND_OPTIONS["ng_check_upstream_env"] == OPTIONS
    main(["--help"])
    text = capsys.readouterr().out
    assert text.startswith("ng_check_upstream_env: ") and "usage:" in text
    assert not [k for k in sorted(OPTIONS) if f"+{k}=" not in text]


def test_the_scratch_copy_brings_the_server_folders_the_env_imports(tmp_path: Path) -> None:
    upstream = _checkout(tmp_path)
    folder = _write_env(upstream, "card_game")
    (folder / "app.py").write_text(
        "from resources_servers.game_base.app import Base\n" + (folder / "app.py").read_text()
    )
    base = upstream / "resources_servers" / "game_base"
    base.mkdir()
    (base / "app.py").write_text(
        "from responses_api_agents.upstream_only_agent.app import Agent\n\nBase = object\n"
    )
    (upstream / "responses_api_agents" / "upstream_only_agent").mkdir(parents=True)
    (upstream / "responses_api_agents" / "upstream_only_agent" / "app.py").write_text("Agent = object\n")
    (upstream / "responses_api_agents" / "simple_agent").mkdir()
    (upstream / "responses_api_agents" / "simple_agent" / "app.py").write_text("UPSTREAMS = 1\n")
    with open(base / "app.py", "a") as f:
        f.write("from responses_api_agents.simple_agent.app import SimpleAgent\n")
    root, notes = make_scratch(
        tmp_path / "scratch", upstream, "card_game", [folder / "configs" / "card_game.yaml"]
    )
    assert (root / "resources_servers" / "game_base" / "app.py").is_file()
    assert (root / "responses_api_agents" / "upstream_only_agent" / "app.py").is_file()
    # Our own agent stays ours (it is the runtime under test), and this repo's nemo_gym is the one copied.
    ours = (PACKAGE_PARENT_DIR / "responses_api_agents" / "simple_agent" / "app.py").read_text()
    assert (root / "responses_api_agents" / "simple_agent" / "app.py").read_text() == ours
    assert (root / "nemo_gym" / "tools" / "upstream_check.py").is_file()
    assert sorted(notes) == [
        "resources_servers/game_base (imported by its code) taken from upstream",
        "responses_api_agents/upstream_only_agent (imported by its code) taken from upstream",
    ]


def test_imported_from_ours_takes_this_repos_folder_of_that_name(tmp_path: Path) -> None:
    """An env built on mcqa runs on upstream's mcqa by default, on ours with +imported_from=ours."""
    upstream = _checkout(tmp_path)
    folder = _write_env(upstream, "letter_quiz")
    (folder / "app.py").write_text(
        "from resources_servers.mcqa.app import MCQAResourcesServer\n" + (folder / "app.py").read_text()
    )
    (upstream / "resources_servers" / "mcqa").mkdir()
    (upstream / "resources_servers" / "mcqa" / "app.py").write_text("MCQAResourcesServer = 'upstream'\n")
    ours = (PACKAGE_PARENT_DIR / "resources_servers" / "mcqa" / "app.py").read_text()

    root, notes = make_scratch(tmp_path / "a", upstream, "letter_quiz", [])
    assert (
        root / "resources_servers" / "mcqa" / "app.py"
    ).read_text() == "MCQAResourcesServer = 'upstream'\n"
    assert notes == ["resources_servers/mcqa (imported by its code) taken from upstream"]

    root, notes = make_scratch(tmp_path / "b", upstream, "letter_quiz", [], imported_from="ours")
    assert (root / "resources_servers" / "mcqa" / "app.py").read_text() == ours
    assert notes == ["resources_servers/mcqa (imported by its code) is this repo's"]

    with pytest.raises(CheckError, match=r"\+imported_from must be upstream or ours; got 'mine'"):
        parse_options([f"+upstream_checkout={upstream}", "+imported_from=mine"])


def test_a_config_refused_for_a_missing_credential_is_skipped_not_failed() -> None:
    """google_search's config leaves its API key to the user (ng_run: "Field required"); critpt's
    resolves it to null: both are configs that need values only the user can give."""
    from nemo_gym.tools.upstream_check import user_credentials_missing

    google = (
        "The configuration of the servers is not valid (2 problems; no server was started): "
        "- 'google_search.resources_servers.google_search.google_api_key' (configs/google_search.yaml:3): "
        "Field required - 'google_search.resources_servers.google_search.google_cx' "
        "(configs/google_search.yaml:3): Field required"
    )
    assert user_credentials_missing(google) == ["google_api_key", "google_cx"]
    critpt = (
        "- 'critpt_resources_server.resources_servers.critpt.api_key.str' (configs/critpt.yaml:6): Input "
        "should be a valid string - 'critpt_resources_server.resources_servers.critpt.api_key.list[str]' "
        "(configs/critpt.yaml:6): Input should be a valid list"
    )
    assert user_credentials_missing(critpt) == ["api_key"]
    # A missing setting that is no credential is the env's problem, not the user's.
    assert (
        user_credentials_missing("- 'a.resources_servers.b.max_steps' (configs/b.yaml:6): Field required")
        == []
    )


def test_a_recorded_line_finds_its_task_row_by_a_shared_id() -> None:
    """swebench's recorded lines carry the task's instance_id (and fields of their own), not its input:
    the one row with that id is the task (before: the line itself was posted, and /verify answered 422
    for the row's missing `repo`). An id two rows share pairs nothing."""
    from nemo_gym.tools.upstream_check import _task_row

    rows = [
        {"instance_id": "astropy-1", "repo": "astropy/astropy", "responses_create_params": {"input": "a"}},
        {"instance_id": "django-2", "repo": "django/django", "responses_create_params": {"input": "b"}},
    ]
    line = {
        "instance_id": "django-2",
        "resolved": True,
        "response": {},
        "responses_create_params": {"input": "x"},
    }
    assert _task_row(line, 0, rows, same_count=False) == (rows[1], "same instance_id")
    twice = [rows[1], {**rows[1], "repo": "fork/django"}]
    assert _task_row(line, 0, twice, same_count=False) == (None, "own fields")
    # Upstream's swebench recorded rollouts of other instances than its example.jsonl holds: said so.
    other = {**line, "instance_id": "jqlang__jq-2681"}
    assert _task_row(other, 0, rows, same_count=False) == (None, "unknown instance_id")


def test_the_scratch_copy_brings_the_upstream_benchmark_folders_the_env_uses(tmp_path: Path) -> None:
    """scicode's agent reads benchmarks/scicode/prompts/*.yaml; bunsenbench's code imports
    benchmarks.bunsenbench_chemistry_mcq: upstream ships those beside the env, so the scratch has them."""
    upstream = _checkout(tmp_path)
    folder = _write_env(upstream, "quiz")
    (folder / "app.py").write_text(
        "from benchmarks.quiz_rows.materialize import rows\n" + (folder / "app.py").read_text()
    )
    config = folder / "configs" / "quiz.yaml"
    config.write_text(config.read_text() + "# prompt: benchmarks/quiz_prompts/prompts/turn1.yaml\n")
    for name in ("quiz_rows", "quiz_prompts", "unused_bench"):
        (upstream / "benchmarks" / name).mkdir(parents=True)
        (upstream / "benchmarks" / name / "marker.txt").write_text(name)
    root, notes = make_scratch(tmp_path / "scratch", upstream, "quiz", [config])
    assert sorted(p.name for p in (root / "benchmarks").iterdir()) == ["quiz_prompts", "quiz_rows"]
    assert (root / "benchmarks" / "quiz_rows" / "marker.txt").read_text() == "quiz_rows"
    assert "benchmarks/quiz_prompts (used by its code or config) taken from upstream" in notes
