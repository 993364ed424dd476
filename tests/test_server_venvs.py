"""Per-server dependencies: the shared-environment check and isolated per-server venvs.

The isolated-venv tests need no network: they build a tiny wheel by hand and list its absolute
path in the server's requirements.txt.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import re
import signal
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from nemo_gym.global_config import ConfigError
from nemo_gym.run.server_venvs import (
    READY_MARKER,
    check_shared_requirements,
    ensure_server_venv,
    requirements_path,
    unmet_requirements,
    venv_dir_for,
    venv_key,
)
from tests.conftest import (
    READY_WAIT_S,
    Launcher,
    get_json,
    simple_resources_app,
    write_instance_config,
    write_server_folder,
)

PKG = "ngvenvprobe_pkg"
PKG_VERSION = "1.2.3"
MISSING = "definitely-not-installed-pkg-xyz==1.0"


def build_wheel(out_dir: Path, name: str = PKG, version: str = PKG_VERSION) -> Path:
    """A minimal pure-Python wheel: ``<name>/__init__.py`` plus METADATA, WHEEL and RECORD."""
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f'__version__ = "{version}"\n'.encode(),
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: nemo-gym-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = out_dir / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel


# ------------------------------------------------------------------------------------------------
# Shared mode: the requirements check.


def test_unmet_requirements(tmp_path: Path) -> None:
    fastapi_version = metadata.version("fastapi")
    (tmp_path / "more.txt").write_text(f"{MISSING}\n")
    req = tmp_path / "requirements.txt"
    req.write_text(
        "\n".join(
            [
                "# a comment",
                "fastapi>=0.1  # satisfied",
                "fastapi<0.0.1",
                'never-on-this-platform-pkg==1; sys_platform == "nonexistent"',
                "--extra-index-url https://example.invalid/simple",
                "-r more.txt",
                f"{PKG} @ file:///nonexistent/{PKG}-1.0-py3-none-any.whl",
                f"/nonexistent/{PKG}-{PKG_VERSION}-py3-none-any.whl",
                f"/nonexistent/fastapi-{fastapi_version}-py3-none-any.whl",
                "./some/local/dir",
                "",
            ]
        )
    )
    assert unmet_requirements(req) == [
        f"fastapi<0.0.1 (installed: {fastapi_version})",
        f"{MISSING} (not installed)",
        f"{PKG} @ file:///nonexistent/{PKG}-1.0-py3-none-any.whl (not installed)",
        f"/nonexistent/{PKG}-{PKG_VERSION}-py3-none-any.whl (not installed)",
    ]


def test_check_shared_requirements_names_server_and_fix(tmp_path: Path) -> None:
    ok_dir = tmp_path / "ok"
    ok_dir.mkdir()
    (ok_dir / "requirements.txt").write_text("pyyaml\n")
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    (bad_dir / "requirements.txt").write_text(f"{MISSING}\n")
    check_shared_requirements({"fine": ok_dir, "no_reqs": tmp_path})
    with pytest.raises(ConfigError) as err:
        check_shared_requirements({"fine": ok_dir, "broken": bad_dir})
    msg = str(err.value)
    assert (
        "server 'broken'" in msg
        and MISSING in msg
        and f"pip install -r {bad_dir / 'requirements.txt'}" in msg
    )
    assert "'fine'" not in msg


def test_unmet_requirement_fails_ng_run_before_start(tmp_path: Path, launch: Launcher) -> None:
    write_server_folder(
        tmp_path,
        "resources_servers",
        "needy_probe",
        simple_resources_app(),
        requirements=f"pyyaml\n{MISSING}\n",
    )
    config = write_instance_config(tmp_path, "needy", "resources_servers", "needy_probe")
    log_dir = tmp_path / "logs"
    run = launch(f"+config_paths=[{config}]", "+head_server.port=0", f"+log_dir={log_dir}", cwd=tmp_path)
    code = run.wait_exit(READY_WAIT_S)
    assert code == 2, f"exit code {code}\n{run.output}"
    assert "server 'needy'" in run.stderr and f"{MISSING} (not installed)" in run.stderr
    assert "pip install -r" in run.stderr and "+isolate_server_venvs=true" in run.stderr
    assert "Traceback" not in run.output and "servers ready" not in run.stdout
    assert not log_dir.exists()  # nothing was spawned
    assert not run.our_processes()


# ------------------------------------------------------------------------------------------------
# Isolated mode.


def test_venv_key_follows_requirements(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    req = tmp_path / "requirements.txt"
    req.write_text(f"{wheel}\n")
    first = venv_key(req)
    assert venv_key(req) == first
    req.write_text(f"{wheel}\npyyaml\n")
    assert venv_key(req) != first
    req.write_text(f"{wheel}\n")
    assert venv_key(req) == first
    with open(wheel, "ab") as f:  # the wheel is rebuilt with other content
        f.write(b"\0")
    assert venv_key(req) != first


def test_folder_without_requirements_uses_launcher_python(tmp_path: Path) -> None:
    assert ensure_server_venv(tmp_path, "plain", tmp_path / "cache") == Path(sys.executable)
    assert not (tmp_path / "cache").exists()


def test_failed_install_is_a_clear_error_and_not_marked_ready(tmp_path: Path) -> None:
    server = tmp_path / "srv"
    server.mkdir()
    (server / "requirements.txt").write_text(f"{tmp_path / 'missing-0.1-py3-none-any.whl'}\n")
    lines: list[str] = []
    with pytest.raises(ConfigError, match="Installing .* for 'broken' failed"):
        ensure_server_venv(server, "broken", tmp_path / "cache", echo=lines.append)
    venv_dir = venv_dir_for(server, tmp_path / "cache")
    assert venv_dir is not None and not (venv_dir / READY_MARKER).exists()


def test_stop_request_aborts_the_install(tmp_path: Path) -> None:
    server = tmp_path / "srv"
    server.mkdir()
    (server / "requirements.txt").write_text(f"{build_wheel(tmp_path)}\n")
    with pytest.raises(ConfigError, match="Stopped while installing"):
        ensure_server_venv(
            server, "stopped", tmp_path / "cache", echo=lambda _line: None, should_stop=lambda: True
        )
    venv_dir = venv_dir_for(server, tmp_path / "cache")
    assert venv_dir is not None and not (venv_dir / READY_MARKER).exists()


PROBE_PRELUDE = f"""
import {PKG}

print(f"venvprobe: {PKG} {{{PKG}.__version__}} prefix={{sys.prefix}}", flush=True)
"""


def test_isolated_venv_built_once_and_reused(tmp_path: Path, launch: Launcher) -> None:
    assert importlib.util.find_spec(PKG) is None, "the probe package must not be in the launcher env"
    wheel = build_wheel(tmp_path)
    folder = write_server_folder(
        tmp_path,
        "resources_servers",
        "venv_probe",
        simple_resources_app(prelude=PROBE_PRELUDE, env_info_extra=f'"pkg_version": {PKG}.__version__'),
        requirements=f"{wheel}\n",
    )
    config = write_instance_config(tmp_path, "venvprobe", "resources_servers", "venv_probe")
    cache = tmp_path / "venv-cache"
    args = [
        f"+config_paths=[{config}]",
        "+head_server.port=0",
        "+isolate_server_venvs=true",
        f"+venv_cache_dir={cache}",
    ]
    venv_dir = venv_dir_for(folder, cache)
    assert venv_dir is not None

    # First start: builds the venv and runs the server with the venv's interpreter.
    first = launch(*args, cwd=tmp_path)
    first.wait_ready()
    assert f"[venvprobe] building venv {venv_dir}" in first.stdout
    row = get_json(first.head_url + "/server_instances", token=first.token)[0]
    info = get_json(row["url"] + "/env_info", token=first.token)
    assert info["pkg_version"] == PKG_VERSION
    assert Path(info["prefix"]) == venv_dir
    assert Path(info["executable"]) == venv_dir / "bin" / "python"
    with open(f"/proc/{row['pid']}/cmdline", "rb") as f:
        assert f.read().split(b"\0")[0].decode() == str(venv_dir / "bin" / "python")
    startup_line = f"[venvprobe] venvprobe: {PKG} {PKG_VERSION} prefix={venv_dir}"
    assert first.wait_for_line(re.escape(startup_line), 10) is not None, first.stdout
    # ...and the package is only in the venv, not in the launcher's environment.
    probe = subprocess.run([sys.executable, "-c", f"import {PKG}"], capture_output=True, timeout=60)
    assert probe.returncode != 0
    first.send_signal(signal.SIGINT)
    assert first.wait_exit(10) == 0, first.output

    marker = venv_dir / READY_MARKER
    marker_mtime = marker.stat().st_mtime_ns
    installed = sorted(p.relative_to(venv_dir) for p in venv_dir.rglob("*"))
    record = next(venv_dir.rglob(f"{PKG}-{PKG_VERSION}.dist-info/RECORD"))
    record_mtime = record.stat().st_mtime_ns

    # Second start: reuses it and installs nothing.
    second = launch(*args, cwd=tmp_path)
    second.wait_ready()
    assert f"[venvprobe] reusing venv {venv_dir}" in second.stdout
    assert "building venv" not in second.stdout
    row = get_json(second.head_url + "/server_instances", token=second.token)[0]
    info = get_json(row["url"] + "/env_info", token=second.token)
    assert Path(info["prefix"]) == venv_dir and info["pkg_version"] == PKG_VERSION
    assert marker.stat().st_mtime_ns == marker_mtime
    assert record.stat().st_mtime_ns == record_mtime
    assert sorted(p.relative_to(venv_dir) for p in venv_dir.rglob("*")) == installed
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [venv_dir.name]
    second.send_signal(signal.SIGINT)
    assert second.wait_exit(10) == 0, second.output


def test_a_pyproject_toml_declares_a_folders_requirements_when_it_has_no_requirements_txt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three of upstream's server folders declare dependencies in a pyproject.toml (code_fim takes one from
    git through uv's sources): they are checked (and installed in isolated mode) like a requirements.txt."""
    monkeypatch.setattr("nemo_gym.run.server_venvs.DERIVED_REQUIREMENTS_DIR", tmp_path / "derived")
    folder = tmp_path / "code_fim"
    folder.mkdir()
    (folder / "pyproject.toml").write_text(
        '[project]\nname = "code-fim"\ndependencies = ["nemo-gym[dev]", "human-eval-infilling", "packaging>=1"]\n'
        '[tool.uv.sources]\nnemo-gym = { path = "../..", editable = true }\n'
        'human-eval-infilling = { git = "https://example.org/h.git", rev = "abc" }\n'
    )
    req = requirements_path(folder)
    assert req is not None and not req.is_relative_to(folder)  # the server folder is never written to
    assert req.read_text().splitlines()[1:] == [
        "nemo-gym[dev]",
        "human-eval-infilling @ git+https://example.org/h.git@abc",
        "packaging>=1",
    ]
    assert unmet_requirements(req) == [
        "human-eval-infilling @ git+https://example.org/h.git@abc (not installed)"
    ]
    with pytest.raises(ConfigError, match="code_fim"):
        check_shared_requirements({"code_fim": folder})
    # A requirements.txt wins; a folder declaring nothing has no requirements; bad TOML is named.
    (folder / "requirements.txt").write_text("packaging\n")
    assert requirements_path(folder) == folder / "requirements.txt"
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "pyproject.toml").write_text('[project]\nname = "bare"\n')
    assert requirements_path(bare) is None
    (bare / "pyproject.toml").write_text("[project\n")
    with pytest.raises(ConfigError, match=r"bare/pyproject.toml: not a valid TOML file"):
        requirements_path(bare)
