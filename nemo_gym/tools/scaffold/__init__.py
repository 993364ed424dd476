"""``ng_init_resources_server``: scaffold a new environment folder that passes its tests and runs at once.

Contract
--------
``ng_init_resources_server NAME`` (or upstream's ``+entrypoint=resources_servers/NAME``) creates
``resources_servers/NAME/`` under the working directory with: ``app.py`` (one tool,
``count_letters``, and a verifier: reward 1.0 when the last assistant message contains the row's
``expected_answer``), ``configs/NAME.yaml`` (instance ``NAME`` and its agent ``NAME_simple_agent``
pointing at ``policy_model``, with an ``example`` dataset), ``data/example.jsonl`` (5 rows),
``data/.gitignore``, ``tests/test_app.py`` (real servers on 127.0.0.1 with the scripted model),
``requirements.txt`` and ``README.md``. ``NAME`` must be a lowercase Python identifier (not a
keyword); a folder that already exists is never touched. Refusals exit with status 2 and a message.

With ``+package=true`` it makes an installable package instead, ``NAME/`` under the working directory:
``pyproject.toml`` (setuptools; the server's files as package data; entry point ``NAME =
"NAME.resources_servers.NAME"`` in group ``nemo_gym.servers``), ``NAME/__init__.py`` and the same server
folder at ``NAME/resources_servers/NAME/`` (its ``requirements.txt`` names only nemo-gym). Once installed,
``ng_list`` shows it and ``ng_run +env=NAME`` starts it (:mod:`nemo_gym.config.discovery`).
"""

from __future__ import annotations

import keyword
import re
import sys
from pathlib import Path

from nemo_gym.config.command import command
from nemo_gym.tools.scaffold.templates import render_files, render_package_files

NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
USAGE = "usage: ng_init_resources_server NAME   (or +entrypoint=resources_servers/NAME) [+package=true]"


class ScaffoldError(Exception):
    """A refused scaffold request; the message is meant to be printed as is."""


def parse_name(argv: list[str]) -> str:
    """The environment name from ``NAME``, ``+name=NAME`` or ``+entrypoint=resources_servers/NAME``."""
    return parse_args(argv)[0]


def parse_args(argv: list[str]) -> tuple[str, bool]:
    """The environment name (see :func:`parse_name`) and whether ``+package=true`` asks for a package."""
    names = []
    package = False
    for arg in argv:
        key, eq, value = arg.lstrip("+").partition("=")
        if not eq:
            names.append(arg)
        elif key == "entrypoint":
            parent, _, leaf = value.strip().rstrip("/").rpartition("/")
            if parent not in ("", "resources_servers"):
                raise ScaffoldError(f"+entrypoint={value}: must be resources_servers/<name>")
            names.append(leaf)
        elif key == "name":
            names.append(value.strip())
        elif key == "package" and value.strip().lower() in ("true", "false"):
            package = value.strip().lower() == "true"
        else:
            raise ScaffoldError(f"unknown option {arg!r}. {USAGE}")
    if len(names) != 1:
        raise ScaffoldError(USAGE)
    return names[0], package


def check_name(name: str, root: Path, package: bool = False) -> Path:
    """The folder to create (the package's project directory with ``package``); raises ScaffoldError
    for a bad or taken name."""
    if not NAME_RE.match(name) or keyword.iskeyword(name):
        raise ScaffoldError(
            f"{name!r} is not a valid environment name: use a lowercase Python identifier "
            "(letters, digits, underscores; starting with a letter), e.g. my_env."
        )
    folder = root / name if package else root / "resources_servers" / name
    if folder.exists():
        raise ScaffoldError(f"{folder} already exists; nothing was changed. Pick another name.")
    return folder


def scaffold(name: str, root: Path, package: bool = False) -> Path:
    """Create the environment folder ``root/resources_servers/name`` (with ``package``: the package's
    project directory ``root/name``); returns it."""
    folder = check_name(name, root, package)
    files = render_package_files(name) if package else render_files(name)
    folder.mkdir(parents=True)
    for rel, text in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder


@command("ng_init_resources_server")
def main(argv: list[str] | None = None) -> None:
    """``ng_init_resources_server`` entry point."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(USAGE)
        return
    try:
        name, package = parse_args(argv)
        folder = scaffold(name, Path.cwd(), package)
    except ScaffoldError as e:
        sys.stderr.write(f"ng_init_resources_server: {e}\n")
        sys.exit(2)
    print(f"Created {folder}")
    if package:
        print(f"  install it:  pip install {name}/   (or pip install -e {name}/ while you work on it)")
        print(f"  test it:     ng_test +entrypoint={name}/{name}/resources_servers/{name}")
        print("  list it:     ng_list +kind=resources_servers")
        print(
            f"  run it:      ng_run +env={name} "
            '"+config_paths=[responses_api_models/scripted_model/configs/scripted_model.yaml]"'
        )
        return
    print(f"  test it:  ng_test +entrypoint=resources_servers/{name}")
    print(
        f'  run it:   ng_run "+config_paths=[resources_servers/{name}/configs/{name}.yaml,'
        'responses_api_models/scripted_model/configs/scripted_model.yaml]"'
    )
