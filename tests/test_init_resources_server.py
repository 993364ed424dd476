"""ng_init_resources_server: a new environment passes its own tests and runs under ng_run right away."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from nemo_gym.tools.scaffold import main
from tests.conftest import REPO, SCRIPTED_MODEL_CONFIG, Launcher


def run_cmd(cwd: Path, code: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def scaffold(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cmd(cwd, "import sys; from nemo_gym.tools.scaffold import main; main(sys.argv[1:])", *args)


@pytest.mark.parametrize("bad", ["My-Env", "class", "1env", "has space", "Upper"])
def test_invalid_names_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, bad: str) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main([bad])
    assert info.value.code == 2
    assert "not a valid environment name" in capsys.readouterr().err
    assert not (tmp_path / "resources_servers").exists()


def test_existing_folder_and_wrong_entrypoint_are_refused(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    existing = tmp_path / "resources_servers" / "taken"
    existing.mkdir(parents=True)
    (existing / "app.py").write_text("# mine\n")
    with pytest.raises(SystemExit):
        main(["+entrypoint=resources_servers/taken"])
    assert "already exists; nothing was changed" in capsys.readouterr().err
    assert (existing / "app.py").read_text() == "# mine\n" and len(list(existing.iterdir())) == 1
    with pytest.raises(SystemExit):
        main(["+entrypoint=responses_api_agents/x"])
    assert "must be resources_servers/<name>" in capsys.readouterr().err


def test_scaffold_passes_its_tests_and_collects_five_rollouts_under_ng_run(tmp_path: Path) -> None:
    made = scaffold(tmp_path, "+entrypoint=resources_servers/word_env")
    assert made.returncode == 0, made.stderr
    folder = tmp_path / "resources_servers" / "word_env"
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == [
        "README.md", "app.py", "configs/word_env.yaml", "data/.gitignore", "data/example.jsonl",
        "requirements.txt", "tests/test_app.py",
    ]  # fmt: skip
    assert len((folder / "data/example.jsonl").read_text().splitlines()) == 5

    tested = run_cmd(
        tmp_path, "import sys; from nemo_gym.tools.server_tests import test_main; test_main(sys.argv[1:])",
        "+entrypoint=resources_servers/word_env", "--", "-q",
    )  # fmt: skip
    assert tested.returncode == 0, tested.stdout[-3000:] + tested.stderr[-3000:]
    assert "3 passed" in tested.stdout

    launcher = Launcher()
    try:
        config = f"resources_servers/word_env/configs/word_env.yaml,{REPO / SCRIPTED_MODEL_CONFIG}"
        run = launcher(f"+config_paths=[{config}]", "+head_server.port=0", cwd=tmp_path)
        assert run.wait_ready() == 3
        port = run.head_url.rsplit(":", 1)[1]
        out = tmp_path / "rollouts.jsonl"
        collect = launcher(
            f"+head_server.port={port}",
            "+agent_name=word_env_simple_agent",
            "+input_jsonl_fpath=resources_servers/word_env/data/example.jsonl",
            f"+output_jsonl_fpath={out}",
            cmd="ng_collect_rollouts",
            cwd=tmp_path,
        )
        assert collect.wait_exit(240) == 0, collect.output[-3000:]
    finally:
        launcher.cleanup()
    rows = [orjson.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 5
    assert all(r["reward"] in (0.0, 1.0) and r["agent_ref"]["name"] == "word_env_simple_agent" for r in rows)
    # The scripted model's default turn calls the tool, so every rollout reached the resources server.
    assert all(any(i["type"] == "function_call_output" for i in r["response"]["output"]) for r in rows)
    assert (
        not (tmp_path / "rollouts_failures.jsonl").exists()
        or not (tmp_path / "rollouts_failures.jsonl").read_text()
    )
