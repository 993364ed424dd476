"""The README shows what is there: every server folder in its tables, every doc in its Documentation
list, every installed command (pyproject's ``[project.scripts]``) in its Commands list and in ``ng_help``.

Each failure names what is missing, so adding a folder, a doc or a command without mentioning it fails here.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from nemo_gym.run.cli import help_main

ROOT = Path(__file__).resolve().parent.parent
SERVER_TYPES = ("resources_servers", "responses_api_agents", "responses_api_models")


def _readme() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


def _section(text: str, heading: str) -> str:
    """The text under the Markdown heading ``heading`` up to the next heading of the same or higher level."""
    m = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, flags=re.M)
    assert m is not None, f"README.md has no '{heading}' heading"
    level = len(m.group(1))
    end = re.search(rf"^#{{1,{level}}} ", text[m.end() :], flags=re.M)
    return text[m.end() : m.end() + end.start()] if end else text[m.end() :]


def _scripts() -> list[str]:
    return sorted(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])


def _server_folders() -> list[str]:
    return sorted(
        f"{kind}/{d.name}"
        for kind in SERVER_TYPES
        for d in (ROOT / kind).iterdir()
        if d.is_dir() and not d.name.startswith((".", "_"))
    )


def test_every_server_folder_is_in_the_readme_tables() -> None:
    table_rows = "\n".join(line for line in _readme().splitlines() if line.startswith("|"))
    missing = [f for f in _server_folders() if not re.search(rf"`{re.escape(f)}[`/]", table_rows)]
    assert not missing, f"server folders missing from the README's tables: {', '.join(missing)}"


def test_every_doc_is_in_the_documentation_list() -> None:
    listed = _section(_readme(), "Documentation")
    docs = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert docs, "no docs/*.md found"
    missing = [d for d in docs if f"](docs/{d})" not in listed]
    assert not missing, f"docs missing from the README's Documentation list: {', '.join(missing)}"


def test_readme_commands_list_every_installed_command() -> None:
    listed = set(re.findall(r"`(ng_\w+)`", _section(_readme(), "Commands")))
    scripts = set(_scripts())
    assert not scripts - listed, (
        f"commands missing from the README's Commands list: {sorted(scripts - listed)}"
    )
    assert not listed - scripts, (
        f"README's Commands list names commands pyproject does not install: {sorted(listed - scripts)}"
    )


def test_ng_help_lists_every_installed_command(capsys: pytest.CaptureFixture[str]) -> None:
    help_main([])
    shown = set(re.findall(r"^\s+(ng_\w+)\s", capsys.readouterr().out, flags=re.M))
    scripts = set(_scripts())
    assert not scripts - shown, f"commands missing from ng_help: {sorted(scripts - shown)}"
    assert not shown - scripts, (
        f"ng_help lists commands pyproject does not install: {sorted(shown - scripts)}"
    )


def test_every_environment_readme_states_its_reward_contract() -> None:
    """docs/rewards.md: what earns 1, what is a 0 (and its reasons), what is a 503 and why the model
    cannot cause it, in a section of each environment's README."""
    missing = []
    for folder in sorted((ROOT / "resources_servers").iterdir()):
        if not (folder / "app.py").is_file():
            continue
        readme = folder / "README.md"
        text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
        m = re.search(r"^## Reward contract\s*$", text, flags=re.M)
        body = text[m.end() :].split("\n## ", 1)[0] if m else ""
        if not m or "503" not in body or "ng_reward_audit" not in body:
            missing.append(folder.name)
    assert not missing, (
        "environment READMEs without a '## Reward contract' section that says what a 503 is and names "
        f"ng_reward_audit (docs/rewards.md): {', '.join(missing)}"
    )
