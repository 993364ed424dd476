"""``ng_check_upstream_env``: run upstream NeMo Gym environment folders on this runtime and say what holds.

Contract
--------
* ``+upstream_checkout=<path>`` is a work tree of upstream NeMo Gym (it has ``resources_servers/`` and
  ``nemo_gym/``); ``+upstream_wheel=<requirement or .whl>`` (``nemo-gym==0.7.0``) is a released wheel
  instead, downloaded by pip from the package index (``--no-deps``, within ``+install_timeout_s``; a
  ``.whl`` path is used as it is) and unpacked in scratch, removed afterwards. One of the two, not both.
  ``+envs=[a,b]`` picks folders of its ``resources_servers/`` (default: all). A path that is not such a
  checkout, a wheel pip cannot fetch, or an env that is not a folder there, is an error naming it (exit
  status 2).
* Each env is checked in its own scratch copy of this repository (``nemo_gym/``, our agents and model
  servers, ``pyproject.toml``; never the user's tree), with upstream's folder copied into its
  ``resources_servers/`` (replacing ours of that name). A server folder the env's config names that we
  lack (an upstream-only agent) is copied from upstream too, and so are the server folders its code
  imports (``+imported_from=ours``: ours of that name when we have one) and upstream's
  ``benchmarks/<name>`` folders its code or configs use; the note says so. Then:

  (a) its own tests: ``python -m pytest tests`` in the folder, as ``ng_test`` runs them, bounded by
      ``+test_timeout_s``; passed / failed / errors counted from pytest's JUnit XML, first failure kept;
  (b) ``ng_run`` with the env's config (``configs/<env>.yaml``, else the one whose agent recorded the
      rollouts, else the first) and ``responses_api_models/scripted_model`` as ``policy_model``, bounded
      by ``+start_timeout_s``; started yes/no and why not;
  (c) each line of its recorded ``data/example_rollouts.jsonl`` posted to the env's ``/verify`` the way
      ``ng_reverify`` builds it (the task row from ``data/example.jsonl`` plus the recorded
      ``response``); first ``/seed_session`` with the row and, unless ``+replay_tool_calls=false``, the
      recorded tool calls replayed in that session (stateful environments score the state they left).
      The row is the line's ``_ng_task_index`` row, else the row with the same input, else the one row with
      the same ``instance_id`` (or ``task_id``, ``uuid``, ...: :data:`_ID_KEYS`), else the line
      itself when it carries task fields of its own (``expected_answer``, ...), else the row of the
      same number (the table's note counts those). The first call that times out (+verify_timeout_s)
      ends the env's re-verification (the note counts the lines not tried). A server without ``/verify`` (404: gymnasium-style,
      the reward comes from its steps) shows ``no /verify``. A reward reproduces when it equals the recorded one (0 and 1 exactly, others
      within 1e-6). A ``/verify`` that fails (5xx, timeout) is listed as a failure, never a mismatch.
* Requirements: a ``requirements.txt`` the shared environment satisfies is used as is; otherwise the
  folder gets its own venv (``nemo_gym.run.server_venvs``, the same cache as ``+isolate_server_venvs``;
  ``+venv_cache_dir``), built within ``+install_timeout_s``; an install that fails or runs over is its
  own status, ``install failed``.
* Skipped, not failed (the rule, in order): requirements naming a GPU-only or CUDA package
  (:data:`GPU_PACKAGES`) or a download outside the package registries (``git+``, ``https://``): the env
  is not run; a config with a model server besides ``policy_model`` (a judge), or that ``ng_run`` refuses
  because it names a model server the config does not define (a judge the user adds) or values only the
  user can give (an API key, a judge URL): tests run, start and verify are skipped;
  a suite whose every failure is a network error (:data:`NETWORK_ERROR`): tests counted, marked skipped.
* Output: a Markdown table (env | suite passed | started | recorded rewards reproduced k/n | note) on
  stdout and the same as JSON at ``+output`` (default ``results/upstream_check/<UTC time>.json`` under the
  working directory), rewritten after each env. Exit status 0 when it ran (whatever the envs showed), 2 bad options, 130 interrupted.
* Every wait is bounded; Ctrl+C or SIGTERM stops the running step, kills the process groups it started
  and removes the scratch directory (kept with ``+keep_scratch=true``, then its path is printed).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from nemo_gym.auth import auth_headers, read_token_file, token_file_for
from nemo_gym.config.command import command
from nemo_gym.config.keys import PACKAGE_PARENT_DIR, SERVER_TYPES
from nemo_gym.config.loading import load_global_config
from nemo_gym.config.options import check_options
from nemo_gym.config.problems import ConfigError
from nemo_gym.run.server_venvs import (
    DEFAULT_VENV_CACHE_DIR,
    ensure_server_venv,
    names_nemo_gym,
    requirements_path,
    unmet_requirements,
)
from nemo_gym.tools.reverify import iter_jsonl
from nemo_gym.tools.server_tests import PYTEST_OPTIONS

COMMAND = "ng_check_upstream_env"
SUMMARY = (
    "Run upstream NeMo Gym environment folders here: their tests, start-up, recorded rewards via /verify."
)
DEFAULT_TEST_TIMEOUT_S = 600.0
DEFAULT_START_TIMEOUT_S = 180.0
DEFAULT_VERIFY_TIMEOUT_S = 120.0
DEFAULT_INSTALL_TIMEOUT_S = 600.0
STOP_GRACE_S = 30.0
REWARD_TOLERANCE = 1e-6
NOTE_WIDTH = 320  # characters of the table's note column (the JSON has everything)
SCRIPTED_MODEL_CONFIG = "responses_api_models/scripted_model/configs/scripted_model.yaml"
# Packages that need a GPU (or CUDA) or are the large GPU-first ML stack; an env naming one is skipped.
GPU_PACKAGES = frozenset(
    {
        "torch", "torchvision", "torchaudio", "vllm", "flash-attn", "triton", "cupy", "tensorrt", "deepspeed",
        "xformers", "bitsandbytes", "apex", "nvidia-dali", "jax-cuda12-plugin", "mamba-ssm", "causal-conv1d",
    }
)  # fmt: skip
# A failure whose text matches this is a network failure (no route, DNS, refused remote, HTTP hub errors).
NETWORK_ERROR = re.compile(
    r"(Temporary failure in name resolution|Name or service not known|nodename nor servname|"
    r"Network is unreachable|getaddrinfo failed|No address associated with hostname|"
    r"Max retries exceeded with url|HfHubHTTPError|LocalEntryNotFoundError|OfflineModeIsEnabled|"
    r"Cannot connect to host (?!127\.0\.0\.1|localhost)|ConnectTimeout|api_key client option must be set|"
    r"couldn't connect to 'https?://|urlopen error|'git', 'clone'|git clone https?://|"
    r"OPENAI_API_KEY)",
    re.I,
)
TABLE_HEADER = (
    "| env | suite passed | started | recorded rewards reproduced k/n | note |\n|---|---|---|---|---|"
)


class CheckError(Exception):
    """Bad options or checkout: nothing was run."""


class _Stopped(Exception):
    """Ctrl+C or SIGTERM while checking."""


@dataclass
class SuiteResult:
    ran: bool = False
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    exit_code: int | None = None
    timed_out: bool = False
    first_failure: str = ""
    network_only: bool = False


@dataclass
class EnvResult:
    env: str
    status: str = "checked"  # checked | skipped | install failed | error
    reason: str = ""
    config: str | None = None
    suite: SuiteResult = field(default_factory=SuiteResult)
    started: bool | None = None
    start_note: str = ""
    recorded: int | None = None  # lines with a numeric recorded reward (None: no example_rollouts.jsonl)
    no_verify: bool = False  # the server has no /verify (404): its reward comes from its steps
    reproduced: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    verify_failures: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class Options:
    upstream: Path
    envs: list[str]
    output: Path
    keep_scratch: bool = False
    scratch_dir: Path | None = None
    test_timeout_s: float = DEFAULT_TEST_TIMEOUT_S
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    verify_timeout_s: float = DEFAULT_VERIFY_TIMEOUT_S
    venv_cache_dir: Path | None = None
    replay_tool_calls: bool = True
    run_tests: bool = True
    install_timeout_s: float = DEFAULT_INSTALL_TIMEOUT_S
    imported_from: str = "upstream"
    wheel: str | None = None  # +upstream_wheel, when ``upstream`` is that wheel unpacked (removed at the end)


WHEEL_OPTION = "upstream_wheel"
OPTION_HELP: dict[str, tuple[str, str]] = {
    "upstream_checkout": ("PATH", "a work tree of upstream NeMo Gym (this or +upstream_wheel)"),
    "upstream_wheel": ("REQ", "a released wheel instead: nemo-gym==0.7.0 (fetched by pip) or a .whl file"),
    "envs": ("[a,b]", "folders of its resources_servers/ to check (default: all)"),
    "output": ("FILE", "where the JSON goes (default results/upstream_check/<UTC time>.json)"),
    "keep_scratch": ("true", "keep the scratch copies (their path is printed)"),
    "scratch_dir": ("DIR", "make the scratch copies under DIR (default: the system temp dir)"),
    "test_timeout_s": ("SECONDS", f"bound on each env's own tests (default {DEFAULT_TEST_TIMEOUT_S:g})"),
    "start_timeout_s": ("SECONDS", f"bound on each env's ng_run start-up (default {DEFAULT_START_TIMEOUT_S:g})"),
    "verify_timeout_s": ("SECONDS", f"bound on each /verify and replayed call (default {DEFAULT_VERIFY_TIMEOUT_S:g})"),
    "venv_cache_dir": ("DIR", f"where envs with unmet requirements get their venv (default {DEFAULT_VENV_CACHE_DIR})"),
    "replay_tool_calls": ("false", "post /verify without replaying the recorded tool calls first"),
    "run_tests": ("false", "do not run the envs' own tests"),
    "install_timeout_s": (
        "SECONDS",
        f"bound on building an env's venv when its requirements are unmet (default {DEFAULT_INSTALL_TIMEOUT_S:g})",
    ),
    "imported_from": (
        "ours",
        "resources-server folders the env imports come from this repo when it has them (default: upstream's)",
    ),
}  # fmt: skip
OPTIONS = frozenset(OPTION_HELP)


def usage() -> str:
    width = max(len(f"+{k}={v}") for k, (v, _) in OPTION_HELP.items())
    lines = [
        f"{COMMAND}: {SUMMARY}",
        "",
        f"usage: {COMMAND} +upstream_checkout=<path> [+envs=[a,b]] [+output=<file.json>] [+option=value ...]",
        f"       {COMMAND} +upstream_wheel=<nemo-gym==X.Y.Z or file.whl> [...]",
        "",
        "Examples:",
        f"  {COMMAND} +upstream_checkout=../Gym",
        f"  {COMMAND} +upstream_wheel=nemo-gym==0.7.0 +envs=[example_single_tool_call]",
        f'  {COMMAND} +upstream_checkout=../Gym "+envs=[example_single_tool_call,calendar]" +output=check.json',
        "",
        "Options:",
    ]
    lines += [f"  {f'+{k}={v}':<{width}}  {text}" for k, (v, text) in OPTION_HELP.items()]
    lines += [
        "",
        "Exit status: 0 ran (the table says what held), 2 bad options, 130 interrupted.",
        "Docs: docs/writing_an_environment.md (Upstream NeMo Gym environments)",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Options and the checkout


def upstream_envs(upstream: Path) -> list[str]:
    """The environment folders of an upstream checkout, sorted."""
    root = upstream / "resources_servers"
    return sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith((".", "_")))


def parse_options(argv: list[str]) -> Options:
    """The options of ``argv`` (Hydra-style ``+key=value``), checked; :class:`CheckError` names the problem."""
    from omegaconf import OmegaConf

    # A requirement's `==` (nemo-gym==0.7.0) is no Hydra override value: the option is read as written.
    wheel_args = [a for a in argv if a.startswith(f"+{WHEEL_OPTION}=")]
    argv = [a for a in argv if a not in wheel_args]
    try:
        loaded = load_global_config(argv, load_env_yaml=False)
        check_options(loaded, COMMAND, strict_cli=True)
    except ConfigError as e:
        raise CheckError(str(e)) from None
    cfg = OmegaConf.to_container(loaded.config, resolve=True)
    assert isinstance(cfg, dict)
    if wheel_args:
        cfg[WHEEL_OPTION] = wheel_args[-1].split("=", 1)[1].strip("'\"")
    number = _seconds(cfg)
    checkout, wheel = cfg.get("upstream_checkout"), cfg.get("upstream_wheel")
    if checkout and wheel:
        raise CheckError("pass +upstream_checkout or +upstream_wheel, not both")
    if not checkout and not wheel:
        raise CheckError(
            "pass +upstream_checkout=<path of an upstream NeMo Gym work tree> or "
            "+upstream_wheel=<nemo-gym==X.Y.Z or a .whl file>. See --help."
        )
    install_timeout_s = number("install_timeout_s", DEFAULT_INSTALL_TIMEOUT_S)
    scratch_dir = Path(str(cfg["scratch_dir"])).expanduser() if cfg.get("scratch_dir") else None
    if wheel:
        upstream = unpacked_wheel(str(wheel), scratch_dir, install_timeout_s)
    else:
        upstream = Path(str(checkout)).expanduser().resolve()
    try:
        return _options(cfg, upstream, str(wheel) if wheel else None, scratch_dir, install_timeout_s, number)
    except BaseException:
        if wheel:
            shutil.rmtree(upstream.parent, ignore_errors=True)
        raise


def _options(
    cfg: dict[str, Any],
    upstream: Path,
    wheel: str | None,
    scratch_dir: Path | None,
    install_timeout_s: float,
    number: Any,
) -> Options:
    source = f"+upstream_wheel={wheel}" if wheel else f"+upstream_checkout={upstream}"
    if not upstream.is_dir():
        raise CheckError(f"{source}: no such directory")
    if not (upstream / "resources_servers").is_dir() or not (upstream / "nemo_gym").is_dir():
        raise CheckError(
            f"{source} is not an upstream NeMo Gym checkout or wheel "
            "(it needs resources_servers/ and nemo_gym/ at its top)"
        )
    available = upstream_envs(upstream)
    envs = cfg.get("envs")
    if envs is None:
        envs = available
    elif isinstance(envs, str):
        envs = [e for e in envs.split(",") if e]
    if not isinstance(envs, list) or not all(isinstance(e, str) and e for e in envs):
        raise CheckError(f"+envs must be a list of folder names, e.g. +envs=[calendar,mcqa]; got {envs!r}")
    missing = [e for e in envs if e not in available]
    if missing:
        import difflib

        hints = []
        for e in missing:
            near = difflib.get_close_matches(e, available, n=2)
            hints.append(f"{e!r}" + (f" (did you mean {' or '.join(map(repr, near))}?)" if near else ""))
        raise CheckError(
            f"+envs: no such environment folder under {upstream / 'resources_servers'}: {', '.join(hints)}"
        )
    if cfg.get("output"):
        output = Path(str(cfg["output"])).expanduser()
    else:
        stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        output = Path.cwd() / "results" / "upstream_check" / f"{stamp}.json"

    def flag(key: str, default: bool) -> bool:
        value = cfg.get(key, default)
        if not isinstance(value, bool):
            raise CheckError(f"+{key} must be true or false; got {value!r}")
        return value

    return Options(
        upstream=upstream,
        envs=list(dict.fromkeys(envs)),
        output=output,
        keep_scratch=flag("keep_scratch", False),
        scratch_dir=scratch_dir,
        test_timeout_s=number("test_timeout_s", DEFAULT_TEST_TIMEOUT_S),
        start_timeout_s=number("start_timeout_s", DEFAULT_START_TIMEOUT_S),
        verify_timeout_s=number("verify_timeout_s", DEFAULT_VERIFY_TIMEOUT_S),
        venv_cache_dir=Path(str(cfg["venv_cache_dir"])).expanduser() if cfg.get("venv_cache_dir") else None,
        replay_tool_calls=flag("replay_tool_calls", True),
        run_tests=flag("run_tests", True),
        install_timeout_s=install_timeout_s,
        imported_from=_imported_from(cfg.get("imported_from", "upstream")),
        wheel=wheel,
    )


def _seconds(cfg: dict[str, Any]) -> Any:
    """``number(key, default)``: option ``key`` of ``cfg`` as a positive, finite number of seconds."""

    def number(key: str, default: float) -> float:
        value = cfg.get(key, default)
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise CheckError(f"+{key} must be a number of seconds; got {value!r}") from None
        if not value > 0 or math.isinf(value):
            raise CheckError(f"+{key} must be a positive number of seconds; got {value!r}")
        return value

    return number


def unpacked_wheel(spec: str, scratch_dir: Path | None, timeout_s: float) -> Path:
    """``spec`` (a requirement pip resolves on the package index, or a ``.whl`` file) unpacked into a new
    directory ``<tmp>/wheel``; the caller removes ``<tmp>``. :class:`CheckError` names what failed."""
    import zipfile

    if scratch_dir:
        scratch_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="ng_check_upstream_wheel_", dir=scratch_dir))
    try:
        local = Path(spec).expanduser()
        if spec.endswith(".whl"):
            if not local.is_file():
                raise CheckError(f"+upstream_wheel={spec}: no such file")
            wheel = local
        else:
            wheel = _download_wheel(spec, tmp / "download", timeout_s)
        target = tmp / "wheel"
        try:
            with zipfile.ZipFile(wheel) as archive:
                for member in archive.infolist():  # a wheel is data: nothing may land outside target
                    if member.filename.startswith("/") or ".." in Path(member.filename).parts:
                        raise CheckError(
                            f"+upstream_wheel={spec}: unsafe path in the wheel: {member.filename}"
                        )
                archive.extractall(target)
        except zipfile.BadZipFile as exc:
            raise CheckError(f"+upstream_wheel={spec}: {wheel.name} is not a wheel ({exc})") from None
        return target
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _download_wheel(spec: str, dest: Path, timeout_s: float) -> Path:
    """The wheel pip downloads for the requirement ``spec`` (no dependencies, any Python version)."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--ignore-requires-python", "--disable-pip-version-check", "-q", "-d", str(dest), spec,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise CheckError(f"+upstream_wheel={spec}: pip did not download it within {timeout_s:g} s") from None
    finally:
        _kill_group(proc)
    wheels = sorted(dest.glob("*.whl")) if dest.is_dir() else []
    if proc.returncode != 0 or len(wheels) != 1:
        lines = [
            ln for ln in out.decode(errors="replace").splitlines() if ln.strip() and "is ignored" not in ln
        ]
        raise CheckError(
            f"+upstream_wheel={spec}: pip download failed (exit {proc.returncode}): {' | '.join(lines[-3:])}"
        )
    return wheels[0]


def _imported_from(value: Any) -> str:
    if value not in ("upstream", "ours"):
        raise CheckError(f"+imported_from must be upstream or ours; got {value!r}")
    return str(value)


# ------------------------------------------------------------------------------------------------
# Classification rules


def requirement_skip_reason(req_file: Path | None) -> str | None:
    """Why an env's requirements keep it from running here (GPU package, download outside registries)."""
    if req_file is None:
        return None
    from packaging.requirements import InvalidRequirement, Requirement

    from nemo_gym.run.server_venvs import requirement_lines

    for _origin, line in requirement_lines(req_file):
        if names_nemo_gym(line) or line.startswith("-e ../") or line in ("-e .", "-e ../../"):
            continue
        bare = line.split("#egg=")[0]
        if "git+" in line or re.match(r"^[a-z]+://", bare) or " @ " in line and "://" in line:
            return f"requirements need a download outside the package registries ({line.split()[0]})"
        try:
            name = Requirement(line).name.lower().replace("_", "-")
        except InvalidRequirement:
            continue
        if name in GPU_PACKAGES or name.startswith("nvidia-"):
            return f"requirements name a GPU package ({line.split()[0]})"
    return None


def _config_instances(config: dict[str, Any]) -> Iterator[tuple[str, str, str, dict[str, Any]]]:
    """``(instance, server type, impl, block)`` of each server instance a config file defines."""
    for name, block in config.items():
        if not isinstance(block, dict):
            continue
        for server_type in SERVER_TYPES:
            impls = block.get(server_type)
            if isinstance(impls, dict):
                for impl, inner in impls.items():
                    yield str(name), server_type, str(impl), inner if isinstance(inner, dict) else {}


def _load_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def choose_config(folder: Path, recorded_agents: set[str]) -> Path | None:
    """The env's config: ``configs/<env>.yaml``, else the one defining the agent that recorded the
    rollouts, else the first that serves the env's folder, else the first."""
    configs = sorted((folder / "configs").glob("*.yaml")) if (folder / "configs").is_dir() else []
    if not configs:
        return None
    own = folder / "configs" / f"{folder.name}.yaml"
    if own in configs:
        return own
    serving = []
    for path in configs:
        instances = list(_config_instances(_load_yaml(path)))
        if recorded_agents & {name for name, *_ in instances}:
            return path
        if any(t == "resources_servers" and impl == folder.name for _, t, impl, _ in instances):
            serving.append(path)
    return (serving or configs)[0]


def config_skip_reason(config: Path) -> str | None:
    """Why the config cannot start here: a model server besides ``policy_model`` (a judge endpoint)."""
    others = [
        f"{name} ({impl})"
        for name, server_type, impl, _ in _config_instances(_load_yaml(config))
        if server_type == "responses_api_models" and name != "policy_model"
    ]
    if others:
        return f"config needs a model endpoint besides policy_model: {', '.join(others)}"
    return None


_REFUSED_FIELD = re.compile(r"- '([\w.\[\]-]+)' \([^)]*\): (?:Field required|Input should be a valid \w+)")
_CREDENTIAL = re.compile(r"key|token|secret|password", re.I)


def user_credentials_missing(output: str) -> list[str]:
    """The settings ng_run refused as missing (or null) when one of them is a credential (an API key, a
    token, ...): such a config needs values only its user can give (google_search's key and engine id,
    critpt's key). Empty when no credential is among them."""
    fields = []
    for loc in _REFUSED_FIELD.findall(output):
        parts = loc.split(".")
        if len(parts) >= 4 and parts[1] in SERVER_TYPES:
            fields.append(parts[3])
    fields = list(dict.fromkeys(fields))
    return fields if any(_CREDENTIAL.search(f) for f in fields) else []


def judge_note(config: Path, env: str) -> str | None:
    """A note when the env's own server judges with ``policy_model`` (here: the scripted model)."""
    for _name, server_type, impl, block in _config_instances(_load_yaml(config)):
        if server_type != "resources_servers" or impl != env:
            continue
        for key, value in block.items():
            if "judge" in str(key) and isinstance(value, dict) and value.get("name") == "policy_model":
                return (
                    f"its judge ({key}) is policy_model, the scripted model here: recorded judge verdicts "
                    "are not expected to reproduce"
                )
    return None


def rewards_match(recorded: float, got: float) -> bool:
    """0 and 1 exactly; any other reward within :data:`REWARD_TOLERANCE`."""
    if recorded in (0, 1):
        return got == recorded
    return abs(got - recorded) <= REWARD_TOLERANCE


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ------------------------------------------------------------------------------------------------
# Scratch copy


_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".venv", "venv", ".pytest_cache", "*.egg-info")


def make_scratch(
    base: Path, upstream: Path, env: str, config_text_paths: list[Path], imported_from: str = "upstream"
) -> tuple[Path, list[str]]:
    """A scratch copy of this repository under ``base`` with upstream's ``env`` folder in it; returns its
    root and notes (server folders taken from upstream besides the env). With ``imported_from="ours"``
    a resources-server folder the env imports is this repository's when it has one (does an environment
    built on upstream's mcqa run on ours?)."""
    root = base / env
    root.mkdir(parents=True)
    shutil.copytree(PACKAGE_PARENT_DIR / "nemo_gym", root / "nemo_gym", ignore=_IGNORE, symlinks=True)
    if (PACKAGE_PARENT_DIR / "pyproject.toml").is_file():
        shutil.copy2(PACKAGE_PARENT_DIR / "pyproject.toml", root / "pyproject.toml")
    for server_type in ("responses_api_agents", "responses_api_models"):
        (root / server_type).mkdir()
        ours = PACKAGE_PARENT_DIR / server_type
        for d in sorted(ours.iterdir()) if ours.is_dir() else []:
            if d.is_dir() and not d.name.startswith((".", "_")):
                shutil.copytree(d, root / server_type / d.name, ignore=_IGNORE, symlinks=True)
    (root / "resources_servers").mkdir()
    shutil.copytree(
        upstream / "resources_servers" / env, root / "resources_servers" / env, ignore=_IGNORE, symlinks=True
    )
    notes = []
    for config in config_text_paths:
        for _name, server_type, impl, _ in _config_instances(_load_yaml(config)):
            target = root / server_type / impl
            source = upstream / server_type / impl
            # A server the package ships (nemo_gym/environment_servers/legacy_agent) is the runtime's own.
            shipped = (root / "nemo_gym" / server_type / impl).is_dir()
            if not target.exists() and not shipped and source.is_dir():
                shutil.copytree(source, target, ignore=_IGNORE, symlinks=True)
                notes.append(f"{server_type}/{impl} taken from upstream (not in this repo)")
    # Server folders the copied code imports (blackjack imports resources_servers.gymnasium): upstream's,
    # since that is the code it was written against (or ours, by imported_from); followed until nothing
    # new is imported.
    todo = [root / "resources_servers" / env]
    while todo:
        for server_type, impl in sorted(_imported_server_folders(todo.pop())):
            target, source = root / server_type / impl, upstream / server_type / impl
            if target.exists():  # ours stay: our agents and models are the runtime
                continue
            mine = PACKAGE_PARENT_DIR / server_type / impl
            if imported_from == "ours" and mine.is_dir():
                shutil.copytree(mine, target, ignore=_IGNORE, symlinks=True)
                notes.append(f"{server_type}/{impl} (imported by its code) is this repo's")
                todo.append(target)
            elif source.is_dir():
                shutil.copytree(source, target, ignore=_IGNORE, symlinks=True)
                notes.append(f"{server_type}/{impl} (imported by its code) taken from upstream")
                todo.append(target)
    # Upstream's benchmarks/<name> folders the env's code or configs use (scicode's prompts,
    # bunsenbench's row materializer): part of the env as upstream ships it.
    for name in sorted(_used_benchmark_folders([root / t for t in SERVER_TYPES], config_text_paths)):
        source, target = upstream / "benchmarks" / name, root / "benchmarks" / name
        if source.is_dir() and not target.exists():
            if (upstream / "benchmarks" / "__init__.py").is_file() and not (root / "benchmarks").exists():
                (root / "benchmarks").mkdir()
                shutil.copy2(upstream / "benchmarks" / "__init__.py", root / "benchmarks" / "__init__.py")
            shutil.copytree(source, target, ignore=_IGNORE, symlinks=True)
            notes.append(f"benchmarks/{name} (used by its code or config) taken from upstream")
    return root, notes


_BENCHMARK_RE = re.compile(r"(?:^\s*(?:from|import)\s+benchmarks\.(\w+)|\bbenchmarks/(\w+)/)", re.M)


def _used_benchmark_folders(folders: list[Path], configs: list[Path]) -> set[str]:
    """Names of ``benchmarks/<name>`` the Python files of ``folders`` import or name as a path, or the
    ``configs`` name as a path."""
    found: set[str] = set()
    paths = [p for folder in folders if folder.is_dir() for p in folder.rglob("*.py")]
    paths += [p for folder in folders if folder.is_dir() for p in folder.rglob("*.yaml")]
    for path in [*paths, *configs]:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        found.update(a or b for a, b in _BENCHMARK_RE.findall(text))
    return found


_IMPORT_RE = re.compile(
    r"^\s*(?:from|import)\s+(resources_servers|responses_api_agents|responses_api_models)\.(\w+)", re.M
)


def _imported_server_folders(folder: Path) -> set[tuple[str, str]]:
    """``(server type, folder)`` of every other server folder the Python files of ``folder`` import."""
    found: set[tuple[str, str]] = set()
    for path in folder.rglob("*.py"):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        found.update(_IMPORT_RE.findall(text))
    found.discard((folder.parent.name, folder.name))
    return found


# ------------------------------------------------------------------------------------------------
# Processes


def _kill_group(proc: subprocess.Popen, grace_s: float = 0.0, sig: int = signal.SIGTERM) -> None:
    """Stop ``proc`` and its process group: ``sig`` to the leader, up to ``grace_s`` to exit, then SIGKILL
    to the group."""
    from nemo_gym.run.supervision.children import signal_group

    if proc.poll() is None and grace_s > 0:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    signal_group(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _scratch_env(root: Path, folder: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NEMO_GYM_AUTH_TOKEN")}
    env["PYTHONPATH"] = os.pathsep.join([str(folder), str(root)] if folder is not None else [str(root)])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def parse_junit(path: Path) -> SuiteResult:
    """Counts and the first failure of a pytest JUnit XML file."""
    result = SuiteResult(ran=True)
    try:
        tree = ET.parse(path)
    except (OSError, ET.ParseError):
        return result
    failures: list[str] = []
    for case in tree.iter("testcase"):
        outcome = None
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child
                break
        if outcome is None:
            result.passed += 1
            continue
        if outcome.tag == "skipped":
            result.skipped += 1
            continue
        if outcome.tag == "failure":
            result.failed += 1
        else:
            result.errors += 1
        message = (outcome.get("message") or "").strip() or (outcome.text or "").strip()
        detail = (outcome.text or "") + " " + message
        where = "::".join(x for x in (case.get("classname"), case.get("name")) if x)
        failures.append(detail)
        if not result.first_failure:
            first_line = next((ln for ln in message.splitlines() if ln.strip()), "")
            if first_line in ("", "collection failure") or first_line.startswith("failed on setup"):
                # pytest's generic message: the error itself is the last "E   ..." line of the report
                errors = [ln[1:].strip() for ln in (outcome.text or "").splitlines() if ln.startswith("E ")]
                first_line = f"{first_line}: {errors[-1]}" if errors else first_line
            result.first_failure = f"{where}: {first_line}"[:300]
    result.network_only = bool(failures) and all(NETWORK_ERROR.search(f) for f in failures)
    return result


def run_suite(root: Path, env: str, python: str, timeout_s: float, log: Path) -> SuiteResult:
    """The env's own tests, as ``ng_test`` runs them, bounded; counts from JUnit XML."""
    folder = root / "resources_servers" / env
    target = "tests" if (folder / "tests").is_dir() else None
    if target is None:
        return SuiteResult(ran=False, first_failure="no tests/ folder")
    junit = log.with_suffix(".xml")
    cmd = [
        python,
        "-m",
        "pytest",
        *PYTEST_OPTIONS,
        "-p",
        "no:cacheprovider",
        "-q",
        f"--junitxml={junit}",
        target,
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=folder, env=_scratch_env(root, folder), stdin=subprocess.DEVNULL,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            code = proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            code, timed_out = None, True
        finally:
            _kill_group(proc)
    result = parse_junit(junit)
    result.ran, result.exit_code, result.timed_out = True, code, timed_out
    if timed_out:
        result.first_failure = f"timed out after {timeout_s:g} s (+test_timeout_s)"
    elif code not in (0, 5) and not (result.failed or result.errors):
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-3:]
        result.errors += 1
        result.first_failure = f"pytest exit {code}: {' | '.join(tail)}"[:300]
    return result


class NgRun:
    """``ng_run`` in the scratch copy, as a child process group; its output goes to a log file."""

    READY = re.compile(r"^All (\d+) / (\d+) servers ready")
    HEAD = re.compile(r"^Head server: http://([^:\s]+):(\d+)")

    def __init__(self, root: Path, configs: list[str], log: Path, extra: list[str], python: str) -> None:
        self.log = log
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.head: tuple[str, int] | None = None
        cmd = [
            python, "-c", "from nemo_gym.run.cli import run_main; run_main()",
            f"+config_paths=[{','.join(configs)}]", "+head_server.port=0", *extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, cwd=root, env=_scratch_env(root), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, name="ng_run-output", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log, "wb") as out:
            for raw in self.proc.stdout:
                out.write(raw)
                out.flush()
                line = raw.decode(errors="replace").rstrip()
                self.lines.append(line)
                del self.lines[:-400]
                m = self.HEAD.match(line)
                if m:
                    self.head = (m.group(1), int(m.group(2)))
                if self.READY.match(line):
                    self.ready.set()

    def wait_ready(self, timeout_s: float) -> str | None:
        """None once every server answers and the head server is known, else why not."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready.is_set() and self.head is not None:
                return None
            if self.proc.poll() is not None:
                self._reader.join(timeout=5)
                if self.ready.is_set() and self.head is not None:
                    return None
                return f"ng_run exited with status {self.proc.returncode}: {self.why()}"
            time.sleep(0.1)
        return f"not ready within {timeout_s:g} s (+start_timeout_s): {self.why()}"

    def why(self) -> str:
        """What went wrong, from its output: the last exception line, then ng_run's own verdict."""
        lines = [
            ln.strip()
            for ln in self.lines
            if ln.strip()
            and not re.search(
                r"\bINFO\b|^--- last log lines|^Traceback|(reusing|building) venv|venv ready", ln.strip()
            )
        ]
        verdict = next(
            (
                i
                for i, ln in enumerate(lines)
                if re.search(r"start-up failed|configuration is not valid", ln, re.I)
            ),
            None,
        )
        errors = [ln for ln in lines[:verdict] if re.search(r"\b\w*(Error|Exception)\b:", ln)]
        parts = errors[-1:] + (lines[verdict : verdict + 5] if verdict is not None else lines[-4:])
        return " | ".join(parts)[:700]

    def stop(self) -> None:
        _kill_group(self.proc, STOP_GRACE_S, signal.SIGINT)
        self._reader.join(timeout=5)


# ------------------------------------------------------------------------------------------------
# Re-verifying the recorded rollouts


def _task_row(
    line: dict[str, Any], number: int, rows: list[dict[str, Any]], same_count: bool
) -> tuple[dict[str, Any] | None, str]:
    """The task row a recorded line came from and how it was found."""
    index = line.get("_ng_task_index")
    if isinstance(index, int) and not isinstance(index, bool) and 0 <= index < len(rows):
        return rows[index], "_ng_task_index"
    given = _input_key(line)
    if given is not None:
        for row in rows:
            if _input_key(row) == given:
                return row, "same input"
    unknown_id = ""
    for key in _ID_KEYS:  # swebench's recorded lines carry the task's instance_id, not its input
        value = line.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            hits = [row for row in rows if row.get(key) == value]
            if len(hits) == 1:
                return hits[0], f"same {key}"
            if not hits and any(key in row for row in rows):
                unknown_id = unknown_id or key
    own = {k for k in line if k not in _RECORD_KEYS and not k.startswith("_ng_")}
    if own:  # the line carries task fields of its own (expected_answer, ...): those are its task
        return None, f"unknown {unknown_id}" if unknown_id else "own fields"
    if same_count and number < len(rows):
        return rows[number], "same line number"
    return None, ""


# Fields that name a task: a recorded line and a task row sharing one (and only that row) are a pair.
_ID_KEYS = ("instance_id", "task_id", "problem_id", "question_id", "uuid", "id")
# Keys of a recorded line that are not task fields.
_RECORD_KEYS = frozenset({"responses_create_params", "response", "reward", "agent_ref"})


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def _input_key(row: dict[str, Any]) -> str | None:
    """A row's model input as (role, text) pairs: recorded rollouts carry the input as the model server
    normalised it (``type`` added, content as parts), so equality of the raw JSON is too strict."""
    given = (row.get("responses_create_params") or {}).get("input")
    if given is None:
        return None
    if isinstance(given, str):
        return given
    if not isinstance(given, list):
        return None
    return json.dumps(
        [
            [
                item.get("role"),
                _text_of(item.get("content")),
                item.get("name"),
                item.get("arguments"),
                item.get("output"),
            ]
            if isinstance(item, dict)
            else item
            for item in given
        ],
        sort_keys=True,
        default=str,
    )


def _function_calls(response: dict[str, Any]) -> list[tuple[str, Any]]:
    calls = []
    for item in response.get("output") or []:
        if isinstance(item, dict) and item.get("type") == "function_call" and item.get("name"):
            raw = item.get("arguments")
            try:
                args = json.loads(raw) if isinstance(raw, str) else (raw or {})
            except ValueError:
                args = raw
            calls.append((str(item["name"]), args))
    return calls


def reverify_recorded(
    folder: Path, base_url: str, token: str | None, timeout_s: float, replay: bool, result: EnvResult
) -> None:
    """Post each recorded rollout line to ``base_url``'s ``/verify`` (see the module docstring)."""
    rollouts = folder / "data" / "example_rollouts.jsonl"
    if not rollouts.is_file():
        result.recorded = None
        return
    bad: list[str] = []
    lines = [line for _, _, line in iter_jsonl(rollouts, "rollouts file", bad)]
    if bad:
        result.notes.append(f"{len(bad)} unreadable line(s) in example_rollouts.jsonl ({bad[0]})")
    tasks = folder / "data" / "example.jsonl"
    rows = [row for _, _, row in iter_jsonl(tasks, "task file", [])] if tasks.is_file() else []
    same_count = len(rows) == len(lines) + len(bad)
    result.recorded = 0
    unmatched = unrewarded = by_number = 0
    other_tasks: dict[str, int] = {}
    headers = auth_headers(token)
    for number, line in enumerate(lines):
        recorded = line.get("reward")
        if not _is_number(recorded):
            unrewarded += 1
            continue
        if not isinstance(line.get("response"), dict):
            result.verify_failures.append({"line": number + 1, "error": "no recorded 'response'"})
            result.recorded += 1
            continue
        row, how = _task_row(line, number, rows, same_count)
        by_number += how == "same line number"
        if how.startswith("unknown "):
            other_tasks[how.removeprefix("unknown ")] = other_tasks.get(how.removeprefix("unknown "), 0) + 1
        if row is None:
            unmatched += how not in ("own fields",) and not how.startswith("unknown ")
            row = {k: v for k, v in line.items() if k not in ("reward", "response")}
        payload = {**row, "response": line["response"]}
        result.recorded += 1
        try:
            with httpx.Client(
                base_url=base_url, headers=headers, timeout=timeout_s, trust_env=False
            ) as client:
                seed = client.post(
                    "/seed_session", content=orjson.dumps(row), headers={"content-type": "application/json"}
                )
                if seed.status_code >= 500:
                    raise RuntimeError(f"/seed_session answered {seed.status_code}: {seed.text[:300]}")
                if replay:
                    for name, args in _function_calls(line["response"]):
                        client.post(
                            f"/{name}",
                            content=orjson.dumps(args),
                            headers={"content-type": "application/json"},
                        )
                resp = client.post(
                    "/verify", content=orjson.dumps(payload), headers={"content-type": "application/json"}
                )
        except (httpx.HTTPError, RuntimeError) as e:
            result.verify_failures.append({"line": number + 1, "error": f"{type(e).__name__}: {e}"[:500]})
            if isinstance(e, httpx.TimeoutException):  # one bound per env, not per line: stop here
                left = len(lines) - number - 1
                if left:
                    result.notes.append(f"stopped after a timeout; {left} later line(s) not tried")
                break
            continue
        if resp.status_code == 404 and not result.reproduced and not result.mismatches:
            result.no_verify = True  # gymnasium-style: the reward comes from its steps, not from /verify
            result.recorded = None
            break
        if resp.status_code != 200:
            result.verify_failures.append(
                {"line": number + 1, "error": f"/verify answered {resp.status_code}: {resp.text[:400]}"}
            )
            continue
        try:
            got = resp.json().get("reward")
        except (ValueError, AttributeError):
            got = None
        if _is_number(got) and rewards_match(float(recorded), float(got)):
            result.reproduced += 1
        else:
            result.mismatches.append({"line": number + 1, "recorded": recorded, "got": got})
    if unrewarded:
        result.notes.append(f"{unrewarded} recorded line(s) carry no numeric reward (not counted)")
    if by_number:
        result.notes.append(
            f"{by_number} recorded line(s) matched to example.jsonl by line number only (no row has their input)"
        )
    for key, count in other_tasks.items():
        result.notes.append(
            f"{count} recorded line(s) name a {key} no row of example.jsonl has (rollouts of other tasks; "
            "posted as recorded)"
        )
    if unmatched:
        result.notes.append(
            f"{unmatched} recorded line(s) match no row of example.jsonl (posted as recorded)"
        )


def _resources_url(head: tuple[str, int], token: str | None, env: str) -> str:
    resp = httpx.get(
        f"http://{head[0]}:{head[1]}/server_instances",
        headers=auth_headers(token),
        timeout=30,
        trust_env=False,
    )
    resp.raise_for_status()
    for row in resp.json():
        if row.get("server_type") == "resources_servers" and row.get("impl") == env:
            return str(row["url"])
    raise RuntimeError(f"no resources server of impl {env!r} among the started servers")


# ------------------------------------------------------------------------------------------------
# One env


def _recorded_agents(folder: Path) -> set[str]:
    rollouts = folder / "data" / "example_rollouts.jsonl"
    if not rollouts.is_file():
        return set()
    names = set()
    for _, _, line in iter_jsonl(rollouts, "rollouts file", []):
        name = (line.get("agent_ref") or {}).get("name")
        if isinstance(name, str):
            names.add(name)
    return names


def check_env(opts: Options, env: str, base: Path, echo: Any = print) -> EnvResult:
    """Check one upstream environment in a scratch copy under ``base`` (see the module docstring)."""
    result = EnvResult(env=env)
    source = opts.upstream / "resources_servers" / env
    config = choose_config(source, _recorded_agents(source))
    result.config = f"configs/{config.name}" if config else None
    skip = requirement_skip_reason(requirements_path(source))
    if skip:
        result.status, result.reason = "skipped", skip
        return result
    root, notes = make_scratch(base, opts.upstream, env, [config] if config else [], opts.imported_from)
    result.notes += notes
    folder = root / "resources_servers" / env
    python, isolate = sys.executable, False
    req = requirements_path(folder)
    if req is not None and unmet_requirements(req):
        echo(f"[{env}] requirements not met here: building its venv")
        try:
            deadline = time.monotonic() + opts.install_timeout_s
            python = str(
                ensure_server_venv(
                    folder,
                    f"resources_servers/{env}",
                    opts.venv_cache_dir,
                    echo=lambda s: echo(s),
                    should_stop=lambda: time.monotonic() > deadline,
                )
            )
            isolate = True
        except ConfigError as e:
            why = " ".join(str(e).split())
            if time.monotonic() > deadline:
                why = (
                    f"installing its requirements took over {opts.install_timeout_s:g} s (+install_timeout_s)"
                )
            result.status, result.reason = "install failed", why[:500]
            return result
    if not isolate and any(
        unmet_requirements(r)
        for r in root.glob("responses_api_*/*/requirements.txt")
        if f"{r.parent.parent.name}/{r.parent.name}" in " ".join(notes)
    ):
        isolate = True  # a server folder taken from upstream needs packages we lack: ng_run builds its venv
    if opts.run_tests:
        echo(f"[{env}] running its tests (at most {opts.test_timeout_s:g} s)")
        result.suite = run_suite(root, env, python, opts.test_timeout_s, base / f"{env}.pytest.log")
    if config is None:
        result.started, result.start_note = False, "no configs/*.yaml"
        return result
    note = judge_note(config, env)
    if note:
        result.notes.append(note)
    skip = config_skip_reason(config)
    if skip:
        result.status, result.reason = "skipped", skip
        return result
    extra = [f"+startup_timeout_s={opts.start_timeout_s:g}"]
    if isolate:
        extra.append("+isolate_server_venvs=true")
        if opts.venv_cache_dir:
            extra.append(f"+venv_cache_dir={opts.venv_cache_dir}")
    echo(f"[{env}] starting it under ng_run ({result.config} + scripted model)")
    run = NgRun(
        root,
        [f"resources_servers/{env}/{result.config}", SCRIPTED_MODEL_CONFIG],
        base / f"{env}.ng_run.log",
        extra,
        sys.executable,
    )
    try:
        why = run.wait_ready(opts.start_timeout_s + 15)
        if why is not None:
            result.started, result.start_note = False, why
            output = " ".join(run.lines)
            needed = re.findall(r"\+\+([\w.]+)=<value>", output)
            undefined = re.findall(
                r"refers to responses_api_models instance '([^']+)', which does not exist", output
            )
            credentials = user_credentials_missing(output)
            if "Missing or unresolvable values" in why and needed:
                result.status = "skipped"
                result.reason = f"config needs values only the user can give: {', '.join(needed)}"
            elif credentials:
                result.status = "skipped"
                result.reason = f"config needs values only the user can give: {', '.join(credentials)}"
            elif NETWORK_ERROR.search(why):
                result.status = "skipped"
                result.reason = "start-up needs the network (see start note)"
            elif undefined:
                result.status = "skipped"
                result.reason = (
                    f"config needs a model server it does not define (a judge the user provides): "
                    f"{', '.join(dict.fromkeys(undefined))}"
                )
            return result
        result.started = True
        assert run.head is not None
        token = read_token_file(token_file_for(run.head[1]))
        url = _resources_url(run.head, token, env)
        echo(f"[{env}] re-verifying data/example_rollouts.jsonl through {url}/verify")
        reverify_recorded(folder, url, token, opts.verify_timeout_s, opts.replay_tool_calls, result)
    except (httpx.HTTPError, RuntimeError, ValueError) as e:
        result.status, result.reason = "error", f"{type(e).__name__}: {e}"[:500]
    finally:
        run.stop()
    return result


# ------------------------------------------------------------------------------------------------
# Output


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def row_cells(r: EnvResult) -> list[str]:
    s = r.suite
    if r.status == "skipped" and not s.ran:
        suite = "—"
    elif not s.ran:
        suite = "no tests" if s.first_failure == "no tests/ folder" else "—"
    elif s.timed_out:
        suite = "timeout"
    else:
        total = s.passed + s.failed + s.errors
        suite = f"{s.passed}/{total}" if total else "no tests"
    started = "—" if r.started is None else ("yes" if r.started else "no")
    if r.no_verify:
        reproduced = "no /verify"
    elif r.recorded is None:
        reproduced = "no example_rollouts" if r.started else "—"
    else:
        reproduced = f"{r.reproduced}/{r.recorded}"
    notes: list[str] = []
    if r.status != "checked":
        notes.append(f"{r.status}: {r.reason}")
    if s.network_only:
        notes.append("skipped: its failing tests fail only on network errors")
    if s.first_failure and (s.failed or s.errors or s.timed_out):
        notes.append(f"first failure: {s.first_failure}")
    if r.started is False and (r.status == "checked" or r.reason.endswith("(see start note)")):
        notes.append(f"start: {r.start_note}")
    if r.mismatches:
        notes.append(
            "mismatches: "
            + ", ".join(f"line {m['line']} {m['recorded']} -> {m['got']}" for m in r.mismatches[:5])
        )
    if r.verify_failures:
        notes.append(f"/verify failed on {len(r.verify_failures)} line(s): {r.verify_failures[0]['error']}")
    if r.no_verify:
        notes.append("its server has no /verify (the reward comes from its steps): nothing to re-verify")
    notes += r.notes
    note = _cell("; ".join(notes))
    if len(note) > NOTE_WIDTH:
        note = note[: NOTE_WIDTH - 1].rstrip("\\") + "…"
    return [r.env, suite, started, reproduced, note]


def format_table(results: list[EnvResult]) -> str:
    return "\n".join([TABLE_HEADER] + ["| " + " | ".join(row_cells(r)) + " |" for r in results])


def to_json(opts: Options, results: list[EnvResult], started_at: str, interrupted: bool) -> dict[str, Any]:
    return {
        "command": COMMAND,
        "upstream_checkout": str(opts.upstream) if opts.wheel is None else None,
        "upstream_wheel": opts.wheel,
        "started_at": started_at,
        "finished_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "interrupted": interrupted,
        "envs": [{**asdict(r), "table_row": row_cells(r)} for r in results],
    }


# ------------------------------------------------------------------------------------------------
# Entry point


def write_json(opts: Options, results: list[EnvResult], started_at: str, interrupted: bool) -> None:
    """The JSON at ``opts.output``, replaced whole (written next to it, then renamed)."""
    opts.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = opts.output.with_name(f".{opts.output.name}.tmp")
    tmp.write_bytes(
        orjson.dumps(to_json(opts, results, started_at, interrupted), option=orjson.OPT_INDENT_2) + b"\n"
    )
    os.replace(tmp, opts.output)


def run_checks(
    opts: Options, echo: Any = print, started_at: str | None = None
) -> tuple[list[EnvResult], bool]:
    """Check every env of ``opts`` in turn; returns the results and whether it was interrupted. With
    ``started_at``, the JSON output is rewritten after each env (a long run shows its progress there)."""
    results: list[EnvResult] = []
    if opts.scratch_dir:
        opts.scratch_dir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="ng_check_upstream_", dir=opts.scratch_dir))
    interrupted = False
    try:
        for env in opts.envs:
            t0 = time.monotonic()
            try:
                result = check_env(opts, env, base, echo)
            except (KeyboardInterrupt, _Stopped):
                interrupted = True
                break
            except Exception as e:  # one env's surprise must not stop the others
                result = EnvResult(env=env, status="error", reason=f"{type(e).__name__}: {e}"[:500])
            results.append(result)
            echo(f"[{env}] done in {time.monotonic() - t0:.0f} s: {' | '.join(row_cells(result)[1:4])}")
            if started_at is not None:
                write_json(opts, results, started_at, False)
    finally:
        if opts.keep_scratch:
            echo(f"{COMMAND}: scratch copies kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    return results, interrupted


@command("ng_check_upstream_env")
def main(argv: list[str] | None = None) -> None:
    """``ng_check_upstream_env`` (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(usage())
        return
    try:
        opts = parse_options(argv)
    except CheckError as e:
        sys.stderr.write(f"{COMMAND}: {e}\n")
        sys.exit(2)

    def on_term(_signum: int, _frame: Any) -> None:
        raise _Stopped()

    previous = signal.signal(signal.SIGTERM, on_term)
    started_at = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")

    def echo(line: str) -> None:
        sys.stderr.write(line.rstrip() + "\n")
        sys.stderr.flush()

    try:
        results, interrupted = run_checks(opts, echo, started_at)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if opts.wheel is not None:
            shutil.rmtree(opts.upstream.parent, ignore_errors=True)
    write_json(opts, results, started_at, interrupted)
    print(format_table(results), flush=True)
    print(f"\nJSON: {opts.output}", flush=True)
    if interrupted:
        sys.stderr.write(f"{COMMAND}: interrupted; the table has the envs finished before.\n")
        sys.exit(130)
