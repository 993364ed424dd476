"""Per-server dependencies: check them in the shared environment, or give a server its own venv.

Contract
--------
* Shared mode (the default): a server folder's ``requirements.txt`` is checked against the
  launcher's environment before anything starts; anything missing is one error naming the server,
  the requirement and the command that fixes it.
* Isolated mode (``+isolate_server_venvs=true``): each server folder with a ``requirements.txt``
  gets a venv under the cache dir keyed by a hash of the requirements and the interpreter. It is
  built once (under a file lock, so concurrent launchers build it once) and reused while the key
  is unchanged, so a second start installs nothing. The venv's own packages come first; the
  launcher's environment (where ``nemo_gym`` itself lives) is appended after them.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import site
import subprocess
import sys
import venv
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from nemo_gym.global_config import ConfigError

READY_MARKER = ".nemo_gym_ready"
DEFAULT_VENV_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nemo_gym" / "venvs"
INSTALL_TIMEOUT_S = 1800


def requirements_path(server_dir: Path) -> Path | None:
    p = server_dir / "requirements.txt"
    return p if p.is_file() else None


def unmet_requirements(req_file: Path) -> list[str]:
    """Requirements in ``req_file`` the current environment does not satisfy (paths/URLs/options skipped)."""
    unmet = []
    for raw in req_file.read_text().splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith(("#", "-")) or "://" in line or line.startswith((".", "/")):
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            installed = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            unmet.append(f"{line} (not installed)")
            continue
        if req.specifier and not req.specifier.contains(installed, prereleases=True):
            unmet.append(f"{line} (installed: {installed})")
    return unmet


def check_shared_requirements(server_dirs: dict[str, Path]) -> None:
    problems = []
    for name, folder in server_dirs.items():
        req = requirements_path(folder)
        if req is None:
            continue
        missing = unmet_requirements(req)
        if missing:
            problems.append(
                f"  - server '{name}' ({req}) needs: {', '.join(missing)}\n"
                f"      fix: pip install -r {req}   (or run with +isolate_server_venvs=true)"
            )
    if problems:
        raise ConfigError("Server requirements are not installed in this environment:\n" + "\n".join(problems))


def venv_key(req_file: Path) -> str:
    h = hashlib.sha256()
    h.update(req_file.read_bytes())
    h.update(sys.version.encode())
    h.update(os.path.realpath(sys.executable).encode())
    return h.hexdigest()[:16]


def _venv_python(venv_dir: Path) -> Path:
    return venv_dir / "bin" / "python"


def _launcher_site_dirs() -> list[str]:
    dirs = list(site.getsitepackages())
    user = site.getusersitepackages()
    if isinstance(user, str) and os.path.isdir(user):
        dirs.append(user)
    return [d for d in dirs if os.path.isdir(d)]


def ensure_server_venv(
    server_dir: Path, label: str, cache_dir: Path | None = None, echo: Callable[[str], None] = print
) -> Path:
    """The python executable of this server's venv, building the venv only if its key changed."""
    req = requirements_path(server_dir)
    if req is None:
        return Path(sys.executable)
    cache_dir = Path(cache_dir or DEFAULT_VENV_CACHE_DIR)
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = venv_key(req)
    venv_dir = cache_dir / f"{server_dir.parent.name}__{server_dir.name}__{key}"
    if (venv_dir / READY_MARKER).is_file():
        echo(f"[{label}] reusing venv {venv_dir}")
        return _venv_python(venv_dir)
    with open(cache_dir / f"{venv_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (venv_dir / READY_MARKER).is_file():
            echo(f"[{label}] reusing venv {venv_dir}")
            return _venv_python(venv_dir)
        echo(f"[{label}] building venv {venv_dir} from {req}")
        shutil.rmtree(venv_dir, ignore_errors=True)
        venv.EnvBuilder(with_pip=False, symlinks=True).create(venv_dir)
        purelib = subprocess.run(
            [str(_venv_python(venv_dir)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout.strip()
        lines = ["import site; site.addsitedir(%r)" % d for d in _launcher_site_dirs()]
        Path(purelib, "_nemo_gym_launcher_env.pth").write_text("\n".join(lines) + "\n")
        uv = shutil.which("uv")
        if uv:
            cmd = [uv, "pip", "install", "--python", str(_venv_python(venv_dir)), "-r", str(req)]
        else:
            cmd = [sys.executable, "-m", "pip", "--python", str(_venv_python(venv_dir)), "install",
                   "--disable-pip-version-check", "-q", "-r", str(req)]
        try:
            proc = subprocess.run(cmd, cwd=server_dir, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ConfigError(f"Installing {req} for '{label}' took over {INSTALL_TIMEOUT_S} s; gave up.") from None
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise ConfigError(f"Installing {req} for '{label}' failed ({' '.join(cmd[:3])} ...):\n{tail}")
        (venv_dir / READY_MARKER).write_text(key + "\n")
        return _venv_python(venv_dir)
