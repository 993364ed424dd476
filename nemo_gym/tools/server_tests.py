"""``ng_test``: run one server folder's tests the way upstream NeMo Gym lays them out.

Contract
--------
* ``ng_test +entrypoint=<server_type>/<name>`` runs ``python -m pytest tests`` with the server
  folder as working directory and ``PYTHONPATH=<server dir>:<root>:<nemo_gym's root>:$PYTHONPATH``,
  where ``<root>`` is the folder holding ``<server_type>/`` (so ``from app import ...`` and
  ``from resources_servers.<name>.app import ...`` both work, as in upstream). The folder is looked
  up relative to the working directory first, then the repository root. Arguments after ``--`` go to
  pytest. The exit code is pytest's. ``asyncio_mode=auto`` is always set (upstream's setting; unmarked
  ``async def`` tests run).
* Dependencies: by default the shared environment is used and the folder's ``requirements.txt`` is
  checked first (a line naming nemo-gym itself, e.g. ``-e nemo-gym[dev] @ ../../``, counts as
  satisfied); anything missing is one error naming the file and the fix. With
  ``+isolate_server_venvs=true`` the tests run in the server's own venv (``nemo_gym.run.server_venvs``,
  built once and reused; ``+venv_cache_dir`` chooses where).
* ``+should_validate_data=true`` (resources servers) then checks the folder's example data as
  upstream does: ``data/example.jsonl`` has exactly 5 rows, ``data/example_metrics.json`` says
  ``"Number of examples": 5``, no ``data/*conflict*`` file exists, ``data/example_rollouts.jsonl``
  has exactly 5 rows; every problem is listed with the command that fixes it, exit status 1.
* A server folder's tests run without the secret-looking environment variables (``OPENAI_API_KEY``,
  ``HF_TOKEN``, a proxy URL with a password: :func:`nemo_gym.redaction.child_environ`), as a server
  under ``ng_run`` does, except those named by ``+pass_env=[NAME,...]``.
* The pytest run is bounded by ``+test_timeout_s`` (default 3600 s); on timeout its whole process
  group is killed and the exit status is 124.
* Without ``+entrypoint`` the whole project's test suite runs from the repository root.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from nemo_gym.config.command import command
from nemo_gym.config.keys import PACKAGE_PARENT_DIR, SERVER_TYPES
from nemo_gym.config.loading import load_global_config
from nemo_gym.config.options import check_options
from nemo_gym.config.problems import ConfigError
from nemo_gym.redaction import child_environ, scrub

DEFAULT_TEST_TIMEOUT_S = 3600.0
EXAMPLE_ROWS = 5
# Upstream's pytest settings that tests rely on, also where no project pyproject.toml is found above the
# folder (a scratch root): unmarked ``async def`` tests run under pytest-asyncio.
PYTEST_OPTIONS = ("-o", "asyncio_mode=auto", "-o", "asyncio_default_fixture_loop_scope=function")
USAGE = """\
usage: ng_test [+entrypoint=<server_type>/<name>] [+should_validate_data=true] [+isolate_server_venvs=true]
               [+venv_cache_dir=DIR] [+test_timeout_s=SECONDS] [+pass_env=[NAME,...]] [-- pytest args]
Runs the folder's tests from inside the folder (cd <folder> && pytest tests), as upstream NeMo Gym does.
A folder's tests do not see secret-looking environment variables (*KEY*, *TOKEN*, ...) unless +pass_env names them."""


def _fail(message: str, code: int = 2) -> None:
    sys.stderr.write(scrub(message.rstrip()) + "\n")
    sys.exit(code)


def resolve_server_folder(entry: str, cwd: Path | None = None) -> Path:
    """The server folder ``entry`` names: relative to ``cwd`` first, then the repository root."""
    cwd = cwd or Path.cwd()
    for base in (cwd, PACKAGE_PARENT_DIR):
        folder = (base / entry).resolve()
        if folder.is_dir():
            return folder
    raise ConfigError(
        f"ng_test: no server folder {entry!r} (looked in {cwd} and {PACKAGE_PARENT_DIR}; expected e.g. "
        "+entrypoint=resources_servers/example_single_tool_call)."
    )


def folder_root(folder: Path) -> Path:
    """The root that holds ``<server_type>/<name>`` (the repository root, or a scratch checkout)."""
    return folder.parent.parent if folder.parent.name in SERVER_TYPES else PACKAGE_PARENT_DIR


def test_env(folder: Path, pass_env: list[str] | None = None) -> dict[str, str]:
    """The environment pytest runs with: the server dir, its root and nemo_gym's root on PYTHONPATH.

    With ``pass_env`` (a server folder's tests: code of whoever wrote the environment), the secret-looking
    variables are left out as for a server under ``ng_run`` (:func:`nemo_gym.redaction.child_environ`),
    except those ``pass_env`` names; without it (the project's own suite) the environment passes whole.
    """
    env = dict(os.environ) if pass_env is None else child_environ(os.environ, pass_env)
    parts = [str(folder), str(folder_root(folder)), str(PACKAGE_PARENT_DIR)]
    parts += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    return env


def example_data_problems(folder: Path) -> list[str]:
    """What upstream's ``+should_validate_data=true`` would reject in ``folder/data`` (empty: all good)."""
    data = folder / "data"
    rel = folder.name
    problems: list[str] = []
    example = data / "example.jsonl"
    fix_metrics = f"ng_prepare_data '+config_paths=[<{rel}'s config>]' +output_dirpath=data/{rel} +mode=example_validation"
    if not example.is_file():
        problems.append(f"{example} is missing: add {EXAMPLE_ROWS} example task rows.")
    else:
        n = sum(1 for line in example.read_text().splitlines() if line.strip())
        if n != EXAMPLE_ROWS:
            problems.append(f"{example} has {n} rows; it must have exactly {EXAMPLE_ROWS}.")
    metrics = data / "example_metrics.json"
    if not metrics.is_file():
        problems.append(f"{metrics} is missing. Fix: {fix_metrics}")
    else:
        import orjson

        try:
            count = orjson.loads(metrics.read_bytes()).get("Number of examples")
        except (orjson.JSONDecodeError, AttributeError) as e:
            count = f"unreadable ({e})"
        if count != EXAMPLE_ROWS:
            problems.append(
                f'{metrics} says "Number of examples": {count}, not {EXAMPLE_ROWS}. Fix: {fix_metrics}'
            )
    for conflict in sorted(data.glob("*conflict*")) if data.is_dir() else []:
        problems.append(
            f"{conflict} exists: the example metrics changed. Inspect it, then rerun ng_prepare_data with "
            "+overwrite_metrics_conflicts=true and delete the conflict file."
        )
    rollouts = data / "example_rollouts.jsonl"
    if not rollouts.is_file():
        problems.append(
            f"{rollouts} is missing. Fix: start the environment with ng_run, then ng_collect_rollouts "
            f"+agent_name=<its agent> +input_jsonl_fpath={example} +output_jsonl_fpath={rollouts}"
        )
    else:
        n = sum(1 for line in rollouts.read_text().splitlines() if line.strip())
        if n != EXAMPLE_ROWS:
            problems.append(f"{rollouts} has {n} rows; it must have exactly {EXAMPLE_ROWS}.")
    return problems


def _python_for(folder: Path, isolate: bool, cache_dir: str | None, label: str) -> str:
    from nemo_gym.run.server_venvs import ensure_server_venv, requirements_path, unmet_requirements

    if isolate:
        return str(ensure_server_venv(folder, label, Path(cache_dir) if cache_dir else None))
    req = requirements_path(folder)
    missing = unmet_requirements(req) if req is not None else []
    if missing:
        raise ConfigError(
            f"ng_test: {req} needs packages this environment lacks: {', '.join(missing)}\n"
            f"  fix: pip install -r {req}   (or run with +isolate_server_venvs=true)"
        )
    return sys.executable


def _run_bounded(cmd: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> int:
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        sys.stderr.write(f"ng_test: the tests ran over {timeout_s:g} s (+test_timeout_s); stopped them.\n")
        return 124
    except KeyboardInterrupt:
        return 130
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)


def main(argv: list[str]) -> None:
    """``ng_test``: see the module docstring."""
    if any(a in ("-h", "--help", "help") for a in argv):
        print(USAGE)
        return
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    try:
        loaded = load_global_config(argv, load_env_yaml=False)
        check_options(loaded, "ng_test", strict_cli=True)
    except ConfigError as e:
        _fail(str(e))
    cfg = loaded.config
    entry = OmegaConf.select(cfg, "entrypoint", default=None)
    timeout_s = float(OmegaConf.select(cfg, "test_timeout_s", default=DEFAULT_TEST_TIMEOUT_S))
    if not entry:
        cmd = [sys.executable, "-m", "pytest", *extra]
        print("+ " + " ".join(cmd), flush=True)
        sys.exit(_run_bounded(cmd, PACKAGE_PARENT_DIR, test_env(PACKAGE_PARENT_DIR), timeout_s))
    try:
        folder = resolve_server_folder(str(entry))
        python = _python_for(
            folder,
            bool(OmegaConf.select(cfg, "isolate_server_venvs", default=False)),
            OmegaConf.select(cfg, "venv_cache_dir", default=None),
            str(entry),
        )
    except ConfigError as e:
        _fail(str(e))
    target = "tests" if (folder / "tests").is_dir() else "."
    cmd = [python, "-m", "pytest", *PYTEST_OPTIONS, target, *extra]
    print(f"+ cd {folder} && {' '.join(cmd)}", flush=True)
    pass_env = [str(v) for v in OmegaConf.select(cfg, "pass_env", default=None) or []]
    code = _run_bounded(cmd, folder, test_env(folder, pass_env), timeout_s)
    if code != 0:
        sys.exit(code)
    if OmegaConf.select(cfg, "should_validate_data", default=False):
        problems = example_data_problems(folder)
        if problems:
            _fail("ng_test: example data checks failed:\n" + "\n".join(f"  - {p}" for p in problems), 1)
        print(f"ng_test: example data of {entry} is complete ({EXAMPLE_ROWS} rows, metrics, rollouts).")


@command("ng_test")
def test_main(argv: list[str] | None = None) -> None:
    """The ``ng_test`` entry point."""
    main(sys.argv[1:] if argv is None else argv)
