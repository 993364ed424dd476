"""Per-server dependencies: check them in the shared environment, or give a server its own venv.

Contract
--------
* Shared mode (the default): a server folder's ``requirements.txt`` is checked against the
  launcher's environment before anything starts; anything missing is one error naming the server,
  the requirement and the command that fixes it. Named requirements (``pkg>=1``, ``pkg @ url``),
  local wheel files (name and version read from the file name) and ``-r other.txt`` includes are
  checked; bare URLs, directories and other pip options are left to pip.
* Isolated mode (``+isolate_server_venvs=true``): each server folder with a ``requirements.txt``
  gets a venv under the cache dir keyed by a hash of the requirements, the interpreter and the
  launcher's site directories. It is built once (under a file lock, so concurrent launchers build
  it once) and reused while the key is unchanged, so a second start installs nothing. The venv's
  own packages come first; the launcher's environment (where ``nemo_gym`` itself lives) is
  appended after them. The install uses ``uv`` when it is on PATH, else the launcher's pip
  (``pip --python``, pip >= 22.3); it is bounded and stops when the launcher is told to stop.
* A folder without ``requirements.txt`` whose ``pyproject.toml`` lists ``[project].dependencies`` (a few
  of upstream's, which uv installs) is treated as if those were its ``requirements.txt``
  (:func:`pyproject_requirements`; a ``[tool.uv.sources]`` git source becomes ``name @ git+URL``).
* Both modes: a requirement on nemo-gym itself (upstream folders start with
  ``-e nemo-gym[dev] @ ../../``) is satisfied by the running nemo_gym and never installed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import site
import subprocess
import sys
import tempfile
import time
import venv
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from nemo_gym.config.problems import ConfigError

READY_MARKER = ".nemo_gym_ready"
DEFAULT_VENV_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nemo_gym" / "venvs"
DERIVED_REQUIREMENTS_DIR = DEFAULT_VENV_CACHE_DIR.parent / "pyproject_requirements"
INSTALL_TIMEOUT_S = 1800
MIN_PIP_FOR_PYTHON_FLAG = "22.3"
# packaging (requirement and version parsing) is imported by the functions that read a requirement:
# ng_run checks the servers' requirements at every start, and most server folders have none.


def requirements_path(server_dir: Path) -> Path | None:
    """The folder's ``requirements.txt``; else, for a folder that declares its dependencies in a
    ``pyproject.toml`` (as a few of upstream's do), a requirements file derived from it
    (:func:`pyproject_requirements`); None when it has neither."""
    p = server_dir / "requirements.txt"
    if p.is_file():
        return p
    return pyproject_requirements(server_dir / "pyproject.toml")


def pyproject_requirements(pyproject: Path) -> Path | None:
    """A requirements file with ``pyproject``'s ``[project].dependencies``, a dependency that
    ``[tool.uv.sources]`` takes from git written ``name @ git+URL[@rev]`` (pip's form of it); None when the
    file is missing or declares none. Written once per content under :data:`DERIVED_REQUIREMENTS_DIR`
    (a server folder is never written to); a ``pyproject.toml`` that is not TOML is a ConfigError naming it."""
    if not pyproject.is_file():
        return None
    import tomllib

    text = pyproject.read_bytes()
    try:
        data = tomllib.loads(text.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{pyproject}: not a valid TOML file ({e})") from None
    deps = (data.get("project") or {}).get("dependencies") or []
    if not deps:
        return None
    from packaging.requirements import InvalidRequirement, Requirement

    sources = ((data.get("tool") or {}).get("uv") or {}).get("sources") or {}
    lines = [f"# derived from {pyproject} ([project].dependencies)"]
    for dep in deps:
        try:
            name = Requirement(dep).name
        except InvalidRequirement:
            lines.append(dep)
            continue
        source = sources.get(name) or sources.get(name.replace("-", "_")) or {}
        if isinstance(source, dict) and source.get("git"):
            rev = source.get("rev") or source.get("tag") or source.get("branch")
            lines.append(f"{name} @ git+{source['git']}" + (f"@{rev}" if rev else ""))
        else:
            lines.append(dep)
    body = "\n".join(lines) + "\n"
    out = DERIVED_REQUIREMENTS_DIR / f"{hashlib.sha256(body.encode()).hexdigest()[:16]}.txt"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(body)
        os.replace(tmp, out)
    return out


def requirement_lines(req_file: Path, seen: set[Path] | None = None) -> list[tuple[Path, str]]:
    """(file, line) for every requirement line, following ``-r``/``--requirement`` includes."""
    seen = set() if seen is None else seen
    real = req_file.resolve()
    if real in seen:
        return []
    seen.add(real)
    out: list[tuple[Path, str]] = []
    for raw in req_file.read_text().splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        for flag in ("-r", "--requirement"):
            if line.startswith(flag + " ") or line.startswith(flag + "="):
                included = Path(line[len(flag) + 1 :].strip())
                if not included.is_absolute():
                    included = req_file.parent / included
                if included.is_file():
                    out.extend(requirement_lines(included, seen))
                break
        else:
            out.append((req_file, line))
    return out


def _local_file(origin: Path, line: str) -> Path | None:
    """The existing local file a requirement line names (relative to its requirements file), if any."""
    if line.startswith("-") or "://" in line:
        return None
    path = Path(line) if Path(line).is_absolute() else origin.parent / line
    try:
        return path if path.is_file() else None
    except OSError:  # e.g. a requirement line too long to be a file name
        return None


def _installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def names_nemo_gym(line: str) -> bool:
    """True for a requirement on nemo-gym itself (upstream folders start with ``-e nemo-gym[dev] @ ../../``).

    The running nemo_gym provides it, so it counts as satisfied and is never installed into a server venv
    (a copy from a package index would shadow this implementation).
    """
    from packaging.requirements import InvalidRequirement, Requirement

    for flag in ("-e ", "--editable ", "--editable="):
        if line.startswith(flag):
            line = line[len(flag) :].strip()
            break
    try:
        return Requirement(line).name.replace("_", "-").lower() == "nemo-gym"
    except InvalidRequirement:
        return False


def unmet_requirements(req_file: Path) -> list[str]:
    """Requirements in ``req_file`` the current environment does not satisfy.

    Bare URLs, directories and pip options are skipped (pip decides what they provide); a requirement on
    nemo-gym itself is satisfied (:func:`names_nemo_gym`).
    """
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename
    from packaging.version import Version

    unmet = []
    for _origin, line in requirement_lines(req_file):
        if line.startswith("-") or names_nemo_gym(line):
            continue
        if line.endswith(".whl") and "://" not in line:
            try:
                name, version, _build, _tags = parse_wheel_filename(Path(line).name)
            except InvalidWheelFilename:
                continue
            installed = _installed_version(name)
            if installed is None:
                unmet.append(f"{line} (not installed)")
            elif Version(installed) != version:
                unmet.append(f"{line} (installed: {name} {installed})")
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue  # a bare URL or path
        if req.marker is not None and not req.marker.evaluate():
            continue
        installed = _installed_version(req.name)
        if installed is None:
            unmet.append(f"{line} (not installed)")
        elif req.specifier and not req.specifier.contains(installed, prereleases=True):
            unmet.append(f"{line} (installed: {installed})")
    return unmet


def check_shared_requirements(server_dirs: dict[str, Path]) -> None:
    """Raise one :class:`ConfigError` listing every server whose requirements this environment lacks."""
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
        raise ConfigError(
            "Server requirements are not installed in this environment:\n" + "\n".join(problems)
        )


def _launcher_site_dirs() -> list[str]:
    dirs = list(site.getsitepackages())
    user = site.getusersitepackages()
    if isinstance(user, str) and os.path.isdir(user):
        dirs.append(user)
    return [d for d in dirs if os.path.isdir(d)]


def venv_key(req_file: Path) -> str:
    """Hash of what a venv's content depends on: the requirements, the interpreter, the launcher env.

    A requirement naming a local file (a wheel, an sdist) also contributes the file's size and
    modification time, so rebuilding that file rebuilds the venv.
    """
    h = hashlib.sha256()
    for origin, line in requirement_lines(req_file):
        h.update(f"{origin.name}\0{line}\n".encode())
        local = _local_file(origin, line)
        if local is not None:
            st = local.stat()
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(sys.version.encode())
    h.update(os.path.realpath(sys.executable).encode())
    h.update("\0".join(_launcher_site_dirs()).encode())
    return h.hexdigest()[:16]


def venv_dir_for(server_dir: Path, cache_dir: Path | None = None) -> Path | None:
    """Where the venv of ``server_dir`` lives for its current requirements (None: no requirements)."""
    req = requirements_path(server_dir)
    if req is None:
        return None
    cache = Path(cache_dir or DEFAULT_VENV_CACHE_DIR)
    return cache / f"{server_dir.parent.name}__{server_dir.name}__{venv_key(req)}"


def _venv_python(venv_dir: Path) -> Path:
    return venv_dir / "bin" / "python"


def _install_command(python: Path, req: Path) -> list[str]:
    uv = shutil.which("uv")
    if uv:
        return [uv, "pip", "install", "--python", str(python), "-r", str(req)]
    from packaging.version import Version

    pip_version = _installed_version("pip")
    if pip_version is None or Version(pip_version) < Version(MIN_PIP_FOR_PYTHON_FLAG):
        found = f"pip {pip_version}" if pip_version else "no pip"
        raise ConfigError(
            f"Isolated server venvs need `uv` on PATH or pip >= {MIN_PIP_FOR_PYTHON_FLAG} in the launcher's "
            f"environment ({sys.executable} has {found}). Fix: pip install -U pip (or install uv)."
        )
    return [
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(python),
        "install",
        "--disable-pip-version-check",
        "--no-input",
        "-q",
        "-r",
        str(req),
    ]


def _installable(req: Path, venv_dir: Path) -> Path:
    """``req`` itself, or (when it names nemo-gym) a flattened copy in ``venv_dir`` without those lines,
    local files made absolute."""
    lines = requirement_lines(req)
    if not any(names_nemo_gym(line) for _origin, line in lines):
        return req
    kept = []
    for origin, line in lines:
        if names_nemo_gym(line):
            continue
        local = _local_file(origin, line)
        kept.append(str(local.resolve()) if local is not None else line)
    flat = venv_dir / "requirements.nemo_gym.txt"
    flat.write_text("\n".join(kept) + "\n")
    return flat


def _run_bounded(cmd: list[str], cwd: Path, label: str, req: Path, should_stop: Callable[[], bool]) -> None:
    """Run an install command with a time bound, giving up when ``should_stop()`` turns true."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + INSTALL_TIMEOUT_S
        try:
            while proc.poll() is None:
                if should_stop():
                    raise ConfigError(f"Stopped while installing {req} for '{label}'.")
                if time.monotonic() > deadline:
                    raise ConfigError(
                        f"Installing {req} for '{label}' took over {INSTALL_TIMEOUT_S} s; gave up."
                    )
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 9)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        if proc.returncode != 0:
            out.seek(0)
            tail = "\n".join(out.read().strip().splitlines()[-15:])
            raise ConfigError(f"Installing {req} for '{label}' failed ({' '.join(cmd[:4])} ...):\n{tail}")


def ensure_server_venv(
    server_dir: Path,
    label: str,
    cache_dir: Path | None = None,
    echo: Callable[[str], None] = print,
    should_stop: Callable[[], bool] = lambda: False,
) -> Path:
    """The python executable of this server's venv, building the venv only if its key changed.

    A folder without ``requirements.txt`` runs with the launcher's own interpreter.
    """
    req = requirements_path(server_dir)
    venv_dir = venv_dir_for(server_dir, cache_dir)
    if req is None or venv_dir is None:
        return Path(sys.executable)
    venv_dir.parent.mkdir(parents=True, exist_ok=True)
    if (venv_dir / READY_MARKER).is_file():
        echo(f"[{label}] reusing venv {venv_dir}")
        return _venv_python(venv_dir)
    with open(venv_dir.parent / f"{venv_dir.name}.lock", "w") as lock:
        while True:  # wait for a concurrent builder, but stay stoppable
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if should_stop():
                    raise ConfigError(
                        f"Stopped while waiting for another process to build {venv_dir}."
                    ) from None
                time.sleep(0.2)
        if (venv_dir / READY_MARKER).is_file():
            echo(f"[{label}] reusing venv {venv_dir}")
            return _venv_python(venv_dir)
        echo(f"[{label}] building venv {venv_dir} from {req}")
        shutil.rmtree(venv_dir, ignore_errors=True)
        venv.EnvBuilder(with_pip=False, symlinks=True).create(venv_dir)
        python = _venv_python(venv_dir)
        purelib = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
        lines = [f"import site; site.addsitedir({d!r})" for d in _launcher_site_dirs()]
        Path(purelib, "_nemo_gym_launcher_env.pth").write_text("\n".join(lines) + "\n")
        _run_bounded(
            _install_command(python, _installable(req, venv_dir)), server_dir, label, req, should_stop
        )
        (venv_dir / READY_MARKER).write_text(venv_key(req) + "\n")
        echo(f"[{label}] venv ready: {venv_dir}")
        return python
