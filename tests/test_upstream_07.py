"""NeMo Gym 0.7.0's own example_single_tool_call, taken unchanged from the released wheel (fetched by pip
from the package index, as ``ng_check_upstream_env +upstream_wheel=`` fetches it), runs here: its config
starts its four servers (the environment server in front of the agent), its rows go through the
environment server at reward 1, its resources server keeps the 0.7 session protocol over HTTP, and its
own test suite (session contract, verifier fixture) passes on this runtime. Nothing of the wheel is
committed: it is read in scratch and deleted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from nemo_gym.tools.testing import collect_rollouts, post_json, running_servers, server_url
from nemo_gym.tools.upstream_check import CheckError, unpacked_wheel

REPO = Path(__file__).resolve().parents[1]
WHEEL = "nemo-gym==0.7.0"
ENV = "example_single_tool_call"
AGENT = "example_single_tool_call_simple_agent"
ENV_SERVER = "example_single_tool_call_environment_server"
REPLY = "It is cold in San Francisco."


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """0.7.0's wheel, unpacked (its top: nemo_gym/, resources_servers/, environment_servers/, ...)."""
    unpacked = unpacked_wheel(WHEEL, tmp_path_factory.mktemp("wheel"), timeout_s=300)
    try:
        yield unpacked
    finally:
        shutil.rmtree(unpacked.parent, ignore_errors=True)


def test_its_environment_runs_through_its_environment_server_and_keeps_the_session_protocol(
    wheel: Path, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    shutil.copytree(
        wheel / "resources_servers" / ENV, work / "resources_servers" / ENV
    )  # as a user copies it
    rows = [
        orjson.loads(line)
        for line in (work / "resources_servers" / ENV / "data" / "example.jsonl").open("rb")
    ]
    assert len(rows) == 5
    weather = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "San Francisco"}}]}
    rules = [{"contains": "helpful personal assistant", "turns": [weather, {"text": REPLY}]}]
    extra = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": rules}}}}
    cwd = os.getcwd()
    os.chdir(work)  # the user's folder is found in the working directory, where its config names its data
    try:
        with running_servers([f"resources_servers/{ENV}/configs/{ENV}.yaml"], extra) as helper:
            names = sorted(r["name"] for r in helper.server_instances())
            assert names == sorted([ENV, AGENT, ENV_SERVER, "policy_model"]), names
            code, out, err = collect_rollouts(helper, rows, tmp_path / "collect", AGENT)
            assert code == 0, err[-3000:]
            assert [r["reward"] for r in out] == [1.0] * 5, err[-3000:]
            assert {r["_ng_environment_server"] for r in out} == {ENV_SERVER}
            # Its resources server, seeded and closed the 0.7 way over HTTP (its own session rules).
            url = server_url(helper, ENV)
            episode = {"rollout_id": "r-1", "attempt": 0}
            seed = {
                "resources_session_id": "s-1",
                "episode_id": episode,
                "task_id": {"taskset": "example", "task_id": "0"},
                "task_data": {},
            }
            for _ in range(2):
                seeded = post_json(url + "/seed_session", seed)
                assert seeded.status_code == 200 and seeded.json()["resources_session_id"] == "s-1", (
                    seeded.text
                )
            closed = post_json(url + "/close_session", {"resources_session_id": "s-1", "episode_id": episode})
            assert closed.status_code == 200 and closed.json() == {"resources_session_id": "s-1"}, closed.text
            late = post_json(url + "/seed_session", seed)
            assert late.status_code >= 400 and "already closed" in late.text, late.text
    finally:
        os.chdir(cwd)


def test_its_own_tests_pass_and_it_starts_under_the_upstream_check(wheel: Path, tmp_path: Path) -> None:
    """``ng_check_upstream_env +upstream_wheel=<the .whl>``: the folder's own tests (which check the
    session contract and the verifier fixture) pass here, its config starts, its recorded rewards reproduce."""
    downloaded = next((wheel.parent / "download").glob("*.whl"))
    output = tmp_path / "check.json"
    run = subprocess.run(
        [sys.executable, "-c", "from nemo_gym.tools.upstream_check import main; main()", f"+upstream_wheel={downloaded}",
         f"+envs=[{ENV}]", f"+output={output}", f"+scratch_dir={tmp_path / 'scratch'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [env] = json.loads(output.read_text())["envs"]
    assert env["status"] == "checked", env
    assert env["suite"]["failed"] == env["suite"]["errors"] == 0 and env["suite"]["passed"] >= 5, env
    assert env["started"] is True, env
    # legacy_agent is the package's own, never upstream's copied in.
    assert not any("legacy_agent" in note for note in env["notes"]), env
    assert env["reproduced"] == env["recorded"] > 0 and not env["mismatches"], env
    assert json.loads(output.read_text())["upstream_wheel"] == str(downloaded)
    assert not list((tmp_path / "scratch").iterdir())  # the unpacked wheel and the copies are gone


def test_the_wheel_option_takes_a_requirement_as_typed(tmp_path: Path) -> None:
    """``+upstream_wheel=nemo-gym==0.7.0`` as the docs spell it (Hydra's grammar refuses a bare ``==``): the
    requirement reaches pip as written; here one no index has, so the error names it, exit status 2."""
    run = subprocess.run(
        [sys.executable, "-c", "from nemo_gym.tools.upstream_check import main; main()",
         "+upstream_wheel=nemo-gym==0.0.0.999", f"+scratch_dir={tmp_path}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert "+upstream_wheel=nemo-gym==0.0.0.999: pip download failed" in run.stderr, run.stderr
    assert "Cannot parse" not in run.stderr and not list(tmp_path.iterdir())


def test_a_wheel_that_cannot_be_had_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(CheckError, match=r"\+upstream_wheel=.*missing\.whl: no such file"):
        unpacked_wheel(str(tmp_path / "missing.whl"), tmp_path, timeout_s=60)
    fake = tmp_path / "fake-1.0-py3-none-any.whl"
    fake.write_text("not a zip")
    with pytest.raises(CheckError, match="fake-1.0-py3-none-any.whl is not a wheel"):
        unpacked_wheel(str(fake), tmp_path, timeout_s=60)
    with pytest.raises(CheckError, match=r"\+upstream_wheel=nemo-gym==0\.0\.0\.999: pip download failed"):
        unpacked_wheel("nemo-gym==0.0.0.999", tmp_path, timeout_s=120)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake-1.0-py3-none-any.whl"]  # no scratch left
