"""Where server folders come from: the working directory, the repository, and installed packages.

Contract
--------
* A server folder is ``<base>/<server_type>/<impl>/`` (``app.py``, ``configs/``, ...). The bases are,
  first match winning: the working directory (the ``root_dir`` of a run), the repository root
  (:data:`~nemo_gym.config.keys.PACKAGE_PARENT_DIR`), then installed packages.
* An installed package declares its servers in the entry point group :data:`ENTRY_POINT_GROUP`
  (``nemo_gym.servers``), one entry point per server, its value the dotted path of the server folder
  inside the package, ``<package>[.<sub>...].<server_type>.<impl>``, e.g.
  ``my_env = "my_env.resources_servers.my_env"`` for the folder ``my_env/resources_servers/my_env/``
  (a valid entry point reference, so setuptools accepts it; the folder needs no ``__init__.py``). The
  path is joined onto the top-level package's directory, found without importing anything (nothing of
  the package runs until its server starts). The entry point's name is the environment's name for
  ``ng_run +env=<name>`` (name it after the folder); configs use the folder's name, ``<impl>``.
* A malformed entry point, or one whose folder is missing, is skipped and reported by
  :func:`installed_servers` (``problems``) so ``ng_list`` can say so; it never breaks a run.
* :func:`server_folders` lists every folder of every kind (a name taken by an earlier base hides the
  later ones, as :func:`find_folder` would); :func:`env_config_path` is ``configs/<name>.yaml`` of an
  environment for ``ng_run +env=<name>``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from nemo_gym.config.keys import PACKAGE_PARENT_DIR, SERVER_TYPES

ENTRY_POINT_GROUP = "nemo_gym.servers"


@dataclass(frozen=True)
class ServerFolder:
    """One server folder: its kind (server type), impl name, directory and where it was found."""

    kind: str
    name: str
    path: Path
    source: str  # "folder" or "package"
    package: str | None = None  # the distribution that installed it (source "package")
    entry_point: str | None = None  # the entry point's name (source "package")


def _module_dir(module: str) -> Path | None:
    """The directory of top-level package ``module``, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))).resolve()
    if spec.origin:
        return Path(spec.origin).resolve().parent
    return None


def installed_servers() -> tuple[list[ServerFolder], list[str]]:
    """Server folders declared by installed packages, and one line per entry point that was skipped."""
    found: list[ServerFolder] = []
    problems: list[str] = []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if getattr(ep, "dist", None) is not None else "?"
        parts = ep.value.strip().split(".")
        if ":" in ep.value or len(parts) < 3 or parts[-2] not in SERVER_TYPES or not all(parts):
            problems.append(
                f"{dist}: entry point {ep.name} = {ep.value!r} in group {ENTRY_POINT_GROUP}: write it as "
                f"'<package>.<server_type>.<impl>' (the folder's dotted path) with <server_type> one of "
                f"{', '.join(SERVER_TYPES)}"
            )
            continue
        kind, impl = parts[-2], parts[-1]
        base = _module_dir(parts[0])
        folder = base.joinpath(*parts[1:]) if base is not None else None
        if folder is None or not folder.is_dir():
            problems.append(f"{dist}: entry point {ep.name} = {ep.value!r}: no folder {folder or parts[0]!s}")
            continue
        found.append(ServerFolder(kind, impl, folder, "package", package=dist, entry_point=ep.name))
    return found, problems


def _folder_bases(root_dir: Path | None) -> list[Path]:
    return list(dict.fromkeys(b.resolve() for b in (root_dir, PACKAGE_PARENT_DIR) if b is not None))


def find_folder(kind: str, impl: str, root_dir: Path | None) -> Path | None:
    """``<kind>/<impl>`` under ``root_dir``, else the repository, else an installed package; else None."""
    for base in _folder_bases(root_dir):
        candidate = base / kind / impl
        if candidate.is_dir():
            return candidate
    for server in installed_servers()[0]:
        if server.kind == kind and server.name == impl:
            return server.path
    return None


def server_folders(root_dir: Path | None, kinds: tuple[str, ...] = SERVER_TYPES) -> list[ServerFolder]:
    """Every server folder of ``kinds``: folders first (working directory, then repository), then packages.

    A ``(kind, name)`` found twice is listed once, where :func:`find_folder` would find it.
    """
    out: dict[tuple[str, str], ServerFolder] = {}
    for base in _folder_bases(root_dir):
        for kind in kinds:
            d = base / kind
            if not d.is_dir():
                continue
            for p in sorted(d.iterdir()):
                if p.is_dir() and not p.name.startswith((".", "_")):
                    out.setdefault((kind, p.name), ServerFolder(kind, p.name, p, "folder"))
    for server in installed_servers()[0]:
        if server.kind in kinds:
            out.setdefault((server.kind, server.name), server)
    return list(out.values())


def env_names(root_dir: Path | None) -> dict[str, ServerFolder]:
    """Environment name -> folder, for ``ng_run +env=<name>``: every resources server with a
    ``configs/<impl>.yaml``, by its impl name, and a package's also by its entry point name."""
    names: dict[str, ServerFolder] = {}
    for server in server_folders(root_dir, ("resources_servers",)):
        if (server.path / "configs" / f"{server.name}.yaml").is_file():
            names.setdefault(server.name, server)
            if server.entry_point:
                names.setdefault(server.entry_point, server)
    return names


def env_config_path(name: str, root_dir: Path | None) -> Path | None:
    """``configs/<impl>.yaml`` of environment ``name`` (see :func:`env_names`); None when unknown."""
    server = env_names(root_dir).get(name)
    return server.path / "configs" / f"{server.name}.yaml" if server else None
