"""An environment as a pip package: scaffolded with ``+package=true``, built and installed without the
network, then found by ``ng_list`` and started by ``ng_run +env=<name>`` like a folder of the repository."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import setuptools
from packaging.version import Version

from nemo_gym.config.discovery import ENTRY_POINT_GROUP
from nemo_gym.tools.scaffold import main as scaffold_main
from tests.conftest import REPO, SCRIPTED_MODEL_CONFIG, LaunchedProcess

NAME = "pkg_word_env"


def _env(target: Path) -> dict[str, str]:
    """This worktree's nemo_gym first, then the installed package."""
    return {"PYTHONPATH": os.pathsep.join([str(REPO), str(target), os.environ.get("PYTHONPATH", "")])}


def _python(
    cwd: Path, target: Path, code: str, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        env={**os.environ, **_env(target)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _install(project: Path, target: Path, work: Path) -> None:
    """Build ``project`` and install it into ``target`` (a directory put on PYTHONPATH), offline.

    With ``wheel`` available (or setuptools >= 70.1, which builds wheels itself) this is ``pip wheel``
    then ``pip install --target``. Without it, setuptools does what installing the wheel would: the
    metadata with the entry points (``egg_info``) and the package with its data (``build_py``), both
    from the same pyproject.toml.
    """
    can_wheel = importlib.util.find_spec("wheel") is not None or Version(setuptools.__version__) >= Version(
        "70.1"
    )
    if can_wheel:
        dist = work / "dist"
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
        built = subprocess.run(
            [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist), str(project)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert built.returncode == 0, built.stderr[-3000:]
        wheels = list(dist.glob("*.whl"))
        installed = subprocess.run(
            [*pip, "install", "--no-deps", "--no-index", "--target", str(target), *map(str, wheels)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert installed.returncode == 0, installed.stderr[-3000:]
        return
    built = subprocess.run(
        [sys.executable, "-c", "from setuptools import setup; setup()", "-q"]
        + ["egg_info", "--egg-base", str(target), "build_py", "-d", str(target)],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr[-3000:]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The scaffolded package, installed into a target directory; returns that directory."""
    work = tmp_path_factory.mktemp("envpkg")
    cwd = os.getcwd()
    os.chdir(work)
    try:
        scaffold_main([f"+entrypoint=resources_servers/{NAME}", "+package=true"])
    finally:
        os.chdir(cwd)
    project = work / NAME
    target = work / "site"
    target.mkdir()
    _install(project, target, work)
    return target


def test_the_scaffold_is_a_package_with_its_server_folder_inside(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    scaffold_main(["+name=my_env", "+package=true"])
    project = tmp_path / "my_env"
    folder = project / "my_env" / "resources_servers" / "my_env"
    assert {p.name for p in project.iterdir()} == {"pyproject.toml", "README.md", "my_env"}
    assert (project / "my_env" / "__init__.py").is_file()
    assert {"app.py", "configs", "data", "tests", "README.md", "requirements.txt"} <= {
        p.name for p in folder.iterdir()
    }
    text = (project / "pyproject.toml").read_text()
    assert f'[project.entry-points."{ENTRY_POINT_GROUP}"]' in text
    assert 'my_env = "my_env.resources_servers.my_env"' in text
    assert not (tmp_path / "resources_servers").exists()


def test_the_installed_package_holds_the_whole_server_folder(installed: Path) -> None:
    folder = installed / NAME / "resources_servers" / NAME
    for rel in ("app.py", f"configs/{NAME}.yaml", "data/example.jsonl", "README.md", "requirements.txt"):
        assert (folder / rel).is_file(), rel


def test_ng_list_shows_the_package(installed: Path, tmp_path: Path) -> None:
    code = "import sys; from nemo_gym.tools.server_list import main; main(sys.argv[1:])"
    listed = _python(tmp_path, installed, code, "+kind=resources_servers", "+json=true")
    assert listed.returncode == 0, listed.stderr
    rows = {r["name"]: r for r in json.loads(listed.stdout)}
    row = rows[NAME]
    assert row["source"] == "package" and row["package"] == NAME.replace("_", "-")
    assert row["from"] == f"package {row['package']}"
    assert row["tools"] == ["count_letters"] and row["requirements"] == "ok"
    assert row["description"].startswith("Count the letters")
    assert row["reward"].startswith("1.0 when the final assistant text")
    assert rows["example_single_tool_call"]["source"] == "folder"  # folders still listed
    table = _python(tmp_path, installed, code)
    line = next(ln for ln in table.stdout.splitlines() if f" {NAME} " in ln)
    assert line.startswith("env") and f"package {NAME.replace('_', '-')}" in line


def test_ng_run_env_of_an_unknown_name_suggests_the_package(installed: Path, tmp_path: Path) -> None:
    code = "import sys; from nemo_gym.run.cli import run_main; run_main(sys.argv[1:])"
    ran = _python(tmp_path, installed, code, f"+env={NAME}x", f"+config_paths=[{SCRIPTED_MODEL_CONFIG}]")
    assert ran.returncode == 2
    assert f"no environment named '{NAME}x'" in ran.stderr and f"Did you mean '{NAME}'?" in ran.stderr


def test_ng_dump_config_env_adds_the_package_config_to_config_paths(installed: Path, tmp_path: Path) -> None:
    code = "import sys; from nemo_gym.run.cli import dump_config_main; dump_config_main(sys.argv[1:])"
    dumped = _python(tmp_path, installed, code, f"+env={NAME}", f"+config_paths=[{SCRIPTED_MODEL_CONFIG}]")
    assert dumped.returncode == 0, dumped.stderr
    for instance in (f"{NAME}:", f"{NAME}_simple_agent:", "policy_model:"):
        assert f"\n{instance}" in "\n" + dumped.stdout
    assert "\nenv:" not in "\n" + dumped.stdout  # +env is an option, not a config value


def test_ng_run_env_starts_the_package_and_a_rollout_goes_through_it(installed: Path, tmp_path: Path) -> None:
    """From a directory that holds no server folder: the environment comes from the package only."""
    run_code = "import sys; from nemo_gym.run.cli import run_main; run_main(sys.argv[1:])"
    argv = [f"+env={NAME}", f"+config_paths=[{SCRIPTED_MODEL_CONFIG}]", "+head_server.port=0"]
    run = LaunchedProcess([sys.executable, "-c", run_code, *argv], tmp_path, _env(installed))
    collect = None
    try:
        assert run.wait_ready() == 3, run.output[-3000:]
        port = run.head_url.rsplit(":", 1)[1]
        rows = installed / NAME / "resources_servers" / NAME / "data" / "example.jsonl"
        out = tmp_path / "rollouts.jsonl"
        collect_code = (
            "import sys; from nemo_gym.rollout_collection import collect_main; collect_main(sys.argv[1:])"
        )
        collect = LaunchedProcess(
            [
                sys.executable,
                "-c",
                collect_code,
                f"+head_server.port={port}",
                f"+agent_name={NAME}_simple_agent",
            ]
            + [f"+input_jsonl_fpath={rows}", f"+output_jsonl_fpath={out}", "+limit=1"],
            tmp_path,
            _env(installed),
        )
        assert collect.wait_exit(120) == 0, collect.output[-3000:]
        results = [orjson.loads(line) for line in out.read_text().splitlines()]
        assert len(results) == 1 and results[0]["reward"] in (0.0, 1.0)
        # The scripted model's default turn calls the tool: the package's server answered it.
        assert any(i["type"] == "function_call_output" for i in results[0]["response"]["output"])
        run.send_signal(signal.SIGINT)
        assert run.wait_exit(30) == 0, run.output[-3000:]
        assert run.wait_no_processes() == []
    finally:
        if collect is not None:
            collect.cleanup()
        run.cleanup()


def test_a_malformed_entry_point_is_reported_and_skipped(tmp_path: Path) -> None:
    """A package's bad entry point never breaks a run: ng_list names it on stderr and lists the rest."""
    target = tmp_path / "site"
    info = target / "broken_envs-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-envs\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nwrong_kind = broken_envs.tools.x\nno_folder = broken_envs.resources_servers.gone\n"
    )
    (target / "broken_envs").mkdir()
    (target / "broken_envs" / "__init__.py").write_text("")
    code = "import sys; from nemo_gym.tools.server_list import main; main(sys.argv[1:])"
    listed = _python(tmp_path, target, code, "+json=true")
    assert listed.returncode == 0, listed.stderr
    assert "wrong_kind" in listed.stderr and "'<package>.<server_type>.<impl>'" in listed.stderr
    assert "no_folder" in listed.stderr and "no folder" in listed.stderr
    # Nothing of the broken package is listed: only folders, and the servers this package ships.
    listed_rows = json.loads(listed.stdout)
    assert all(r["source"] == "folder" or r.get("package") == "nemo-gym" for r in listed_rows), listed_rows
