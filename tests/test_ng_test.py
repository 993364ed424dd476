"""ng_test runs a server folder's tests the way upstream lays them out, in the shared environment.

Each test builds a scratch root with ``resources_servers/<name>/`` in upstream's shape (tests that
import ``from app import ...`` and ``from resources_servers.<name>.app import ...``, unmarked async
tests, ``requirements.txt`` starting with ``-e nemo-gym[dev] @ ../../``) and runs the real command.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson

from tests.conftest import REPO

NAME = "upstream_style_env"

APP = """
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)


class UpstreamStyleEnvResourcesServerConfig(BaseResourcesServerConfig):
    pass


class UpstreamStyleEnvResourcesServer(SimpleResourcesServer):
    config: UpstreamStyleEnvResourcesServerConfig

    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse:
        return BaseVerifyResponse(**body.model_dump(), reward=1.0)


def double(x: int) -> int:
    return 2 * x
"""

TEST_BARE = """
from app import double


async def test_unmarked_async_test_runs():
    assert double(2) == 4
"""

TEST_PACKAGE = f"""
from resources_servers.{NAME}.app import UpstreamStyleEnvResourcesServerConfig, double


def test_package_import():
    assert double(3) == 6
    assert UpstreamStyleEnvResourcesServerConfig(host="0.0.0.0", port=8080, entrypoint="", name="").port == 8080
"""


def make_env(root: Path, failing: bool = False, requirements: str = "-e nemo-gym[dev] @ ../../\n") -> Path:
    folder = root / "resources_servers" / NAME
    (folder / "tests").mkdir(parents=True)
    (folder / "app.py").write_text(APP)
    (folder / "tests" / "test_bare.py").write_text(TEST_BARE)
    (folder / "tests" / "test_package.py").write_text(TEST_PACKAGE)
    if failing:
        (folder / "tests" / "test_fails.py").write_text("def test_fails():\n    assert 1 == 2\n")
    (folder / "requirements.txt").write_text(requirements)
    return folder


def ng_test(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    code = "import sys; from nemo_gym.tools.server_tests import test_main; test_main(sys.argv[1:])"
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_upstream_layout_tests_pass_from_a_scratch_root(tmp_path: Path) -> None:
    make_env(tmp_path)
    result = ng_test(tmp_path, f"+entrypoint=resources_servers/{NAME}")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "3 passed" in out or "2 passed" in out
    assert "test_unmarked_async_test_runs PASSED" in out or "2 passed" in out
    assert f"cd {tmp_path / 'resources_servers' / NAME}" in out


def test_a_folders_tests_do_not_see_secret_variables_unless_passed(tmp_path: Path) -> None:
    """An environment's tests are its author's code: an exported key does not reach them (before: the
    whole environment did), unless ``+pass_env`` names it."""
    folder = make_env(tmp_path)
    (folder / "tests" / "test_environ.py").write_text(
        "import os\n\n"
        "def test_environ():\n"
        "    assert os.environ.get('OPENAI_API_KEY') == os.environ.get('EXPECT_KEY')\n"
        "    assert 'HTTPS_PROXY' not in os.environ and os.environ['HF_HOME'] == '/tmp/hf'\n"
    )
    secrets = {"OPENAI_API_KEY": "sk-test-0123456789abcdef", "HTTPS_PROXY": "http://u:pw-0123456@p:3128"}
    os.environ.update({**secrets, "HF_HOME": "/tmp/hf"})
    try:
        hidden = ng_test(
            tmp_path, f"+entrypoint=resources_servers/{NAME}", "--", "-q", "tests/test_environ.py"
        )
        assert hidden.returncode == 0, hidden.stdout + hidden.stderr
        os.environ["EXPECT_KEY"] = secrets["OPENAI_API_KEY"]
        passed = ng_test(
            tmp_path,
            f"+entrypoint=resources_servers/{NAME}",
            "+pass_env=[OPENAI_API_KEY,EXPECT_KEY]",
            "--",
            "-q",
            "tests/test_environ.py",
        )
        assert passed.returncode == 0, passed.stdout + passed.stderr
    finally:
        for name in (*secrets, "HF_HOME", "EXPECT_KEY"):
            os.environ.pop(name, None)


def test_failing_test_gives_pytests_exit_code(tmp_path: Path) -> None:
    make_env(tmp_path, failing=True)
    result = ng_test(tmp_path, f"+entrypoint=resources_servers/{NAME}", "--", "-q")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed, 2 passed" in result.stdout


def test_missing_requirement_is_named_with_its_file(tmp_path: Path) -> None:
    folder = make_env(tmp_path, requirements="-e nemo-gym[dev] @ ../../\nsurely-not-installed-pkg-xyz==1.0\n")
    result = ng_test(tmp_path, f"+entrypoint=resources_servers/{NAME}")
    assert result.returncode == 2
    assert str(folder / "requirements.txt") in result.stderr
    assert "surely-not-installed-pkg-xyz==1.0 (not installed)" in result.stderr
    assert "nemo-gym" not in result.stderr.split("lacks:")[1].split("\n")[0]
    assert "+isolate_server_venvs=true" in result.stderr


def test_unknown_folder_and_mistyped_option_are_refused(tmp_path: Path) -> None:
    result = ng_test(tmp_path, "+entrypoint=resources_servers/nope")
    assert result.returncode == 2 and "no server folder 'resources_servers/nope'" in result.stderr
    result = ng_test(tmp_path, "+entrypoint=resources_servers/nope", "+should_validate_dta=true")
    assert result.returncode == 2 and "should_validate_data" in result.stderr


def test_should_validate_data_lists_every_problem_then_passes(tmp_path: Path) -> None:
    folder = make_env(tmp_path)
    data = folder / "data"
    data.mkdir()
    row = orjson.dumps({"responses_create_params": {"input": "hi"}}).decode()
    (data / "example.jsonl").write_text("\n".join([row] * 4) + "\n")
    (data / "example_metrics_conflict.json").write_text("{}")
    result = ng_test(tmp_path, f"+entrypoint=resources_servers/{NAME}", "+should_validate_data=true")
    assert result.returncode == 1
    err = result.stderr
    assert "example.jsonl has 4 rows; it must have exactly 5" in err
    assert "example_metrics.json is missing" in err and "ng_prepare_data" in err
    assert "example_metrics_conflict.json exists" in err
    assert "example_rollouts.jsonl is missing" in err and "ng_collect_rollouts" in err

    (data / "example.jsonl").write_text("\n".join([row] * 5))  # no final newline, as some upstream files
    (data / "example_metrics_conflict.json").unlink()
    (data / "example_metrics.json").write_text(orjson.dumps({"Number of examples": 5}).decode())
    (data / "example_rollouts.jsonl").write_text("\n".join([row] * 5) + "\n")
    result = ng_test(tmp_path, f"+entrypoint=resources_servers/{NAME}", "+should_validate_data=true")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "example data of resources_servers/upstream_style_env is complete" in result.stdout


def test_our_example_env_passes_from_inside_its_folder() -> None:
    result = ng_test(REPO, "+entrypoint=resources_servers/example_single_tool_call", "--", "-q")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "passed" in result.stdout


def test_nemo_gym_self_requirement_is_satisfied_and_never_installed(tmp_path: Path) -> None:
    from nemo_gym.run.server_venvs import _installable, unmet_requirements

    folder = tmp_path / "srv"
    folder.mkdir()
    (folder / "local.whl").write_text("")
    req = folder / "requirements.txt"
    req.write_text("-e nemo-gym[dev] @ ../../\nnemo_gym\nsurely-not-installed-pkg-xyz\n")
    assert unmet_requirements(req) == ["surely-not-installed-pkg-xyz (not installed)"]
    venv_dir = tmp_path / "venv"
    venv_dir.mkdir()
    flat = _installable(req, venv_dir)
    assert flat != req and flat.read_text().splitlines() == ["surely-not-installed-pkg-xyz"]
    req.write_text("orjson\n")
    assert _installable(req, venv_dir) == req
