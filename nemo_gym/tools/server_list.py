"""``ng_list``: every environment, agent and model server that can be started here, one line each.

Contract
--------
* Lists the server folders :func:`nemo_gym.config.discovery.server_folders` finds (working directory,
  repository, installed packages' ``nemo_gym.servers`` entry points), nothing started and nothing of a
  server imported. Per server: kind, name, where from (folder path or ``package <dist>``),
  requirements status (``requirements.txt`` against this environment,
  :func:`nemo_gym.run.server_venvs.unmet_requirements`), tools, reward rule and description.
* Tools are read from ``app.py``'s source (``app.post("/<tool>")`` with a literal path), not by starting
  the server: routes built at run time (``/{tool_name}``, f-strings) are shown as ``(dynamic)``; the
  protocol's own routes (``/seed_session``, ``/verify``, ``/run``, ...) are left out.
* The description is the ``description`` of the server's block in ``configs/<name>.yaml``, else
  README.md's first paragraph line; the reward rule is the first line of README.md's "Reward" or
  "Verification" section (a heading or a ``**Reward.**`` paragraph).
* Options: ``+kind=resources_servers`` (or an agent/model kind) filters; ``+json=true`` prints a JSON
  list. Entry points that name no folder are listed on stderr. Bad options exit with status 2.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import yaml

from nemo_gym.config.command import command
from nemo_gym.config.discovery import ServerFolder, installed_servers, server_folders
from nemo_gym.config.keys import SERVER_TYPES
from nemo_gym.config.problems import ConfigError, did_you_mean
from nemo_gym.run.server_venvs import requirements_path, unmet_requirements

USAGE = "usage: ng_list [+kind=resources_servers|responses_api_agents|responses_api_models] [+json=true]"
PROTOCOL_ROUTES = frozenset(
    {"/seed_session", "/verify", "/run", "/aggregate_metrics", "/v1/responses", "/v1/chat/completions"}
)
KIND_LABELS = {"resources_servers": "env", "responses_api_agents": "agent", "responses_api_models": "model"}


def tools_of(app_py: Path) -> list[str]:
    """The POST routes ``app_py`` registers besides the protocol's, read from its source."""
    try:
        tree = ast.parse(app_py.read_text(), str(app_py))
    except (OSError, SyntaxError, ValueError):
        return []
    tools: list[str] = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "post"
        ):
            continue
        if not node.args:
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("/"):
            if "{" in arg.value:
                tools.append("(dynamic)")
            elif arg.value not in PROTOCOL_ROUTES:
                tools.append(arg.value.lstrip("/"))
        elif isinstance(arg, ast.JoinedStr):
            tools.append("(dynamic)")
    return list(dict.fromkeys(tools))


def _plain(line: str) -> str:
    """A markdown line as plain text (no bold markers, no leading list bullets)."""
    return re.sub(r"\*\*|__", "", line).strip().lstrip("-* ").strip()


def readme_facts(readme: Path) -> tuple[str, str]:
    """(first paragraph line, first line of the Reward/Verification section) of ``readme``; "" when absent."""
    try:
        lines = readme.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return "", ""
    first = next(
        (_plain(ln) for ln in lines if ln.strip() and not ln.lstrip().startswith(("#", "<", "!["))), ""
    )
    reward = ""
    for i, ln in enumerate(lines):
        stripped = ln.strip()
        bold = re.match(r"^\*\*(reward|verification)[^*]*\*\*[:.]?\s*(.*)$", stripped, re.IGNORECASE)
        if bold and bold.group(2).strip():
            reward = _plain(bold.group(2))
            break
        if stripped.startswith("#") and re.search(r"reward|verification", stripped, re.IGNORECASE):
            reward = next((_plain(x) for x in lines[i + 1 :] if x.strip() and not x.startswith("#")), "")
            break
    return first, reward


def config_description(server: ServerFolder) -> str:
    """The ``description`` of the server's own block in ``configs/<name>.yaml``, else ""."""
    path = server.path / "configs" / f"{server.name}.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return ""
    if not isinstance(data, dict):
        return ""
    for block in data.values():
        impl = block.get(server.kind, {}).get(server.name) if isinstance(block, dict) else None
        if isinstance(impl, dict) and isinstance(impl.get("description"), str):
            return impl["description"].strip()
    return ""


def requirements_status(folder: Path) -> str:
    """``ok``, ``none`` (no requirements file) or ``missing: <requirement>, ...``."""
    try:
        req = requirements_path(folder)
        if req is None:
            return "none"
        unmet = unmet_requirements(req)
    except (ConfigError, OSError) as e:
        return f"unreadable: {str(e).splitlines()[0]}"
    return "ok" if not unmet else "missing: " + ", ".join(unmet)


def describe(server: ServerFolder, root: Path) -> dict[str, object]:
    """One server's row (the JSON form; the table shows the same fields)."""
    first_line, reward = readme_facts(server.path / "README.md")
    if server.source == "package":
        where = f"package {server.package}"
    else:
        try:
            where = str(server.path.relative_to(root))
        except ValueError:
            where = str(server.path)
    return {
        "kind": server.kind,
        "name": server.name,
        "source": server.source,
        "from": where,
        "path": str(server.path),
        "package": server.package,
        "description": config_description(server) or first_line,
        "tools": tools_of(server.path / "app.py"),
        "reward": reward,
        "requirements": requirements_status(server.path),
    }


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _cut_left(text: str, width: int) -> str:
    """A path cut from the left: its end (the folder's name) is what tells servers apart."""
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def format_table(rows: list[dict[str, object]]) -> str:
    """One line per server; long cells cut with an ellipsis."""
    header = ("KIND", "NAME", "FROM", "REQS", "TOOLS", "REWARD", "DESCRIPTION")
    cells = [
        (
            KIND_LABELS.get(str(r["kind"]), str(r["kind"])),
            str(r["name"]),
            _cut_left(str(r["from"]), 40),
            _cut(str(r["requirements"]), 30),
            _cut(",".join(r["tools"]) or "-", 40),  # type: ignore[arg-type]
            _cut(str(r["reward"]) or "-", 50),
            _cut(str(r["description"]) or "-", 70),
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in [header, *cells]) for i in range(len(header) - 1)]
    lines = []
    for row in [header, *cells]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1])
    return "\n".join(line.rstrip() for line in lines)


def parse_options(argv: list[str]) -> tuple[tuple[str, ...], bool]:
    """(kinds to list, JSON output) from ``+kind=...`` and ``+json=true``; ValueError on anything else."""
    kinds: tuple[str, ...] = SERVER_TYPES
    as_json = False
    by_label = {v: k for k, v in KIND_LABELS.items()}
    for arg in argv:
        key, eq, value = arg.lstrip("+").partition("=")
        value = value.strip()
        if key == "kind" and eq:
            kind = by_label.get(value, value)
            if kind not in SERVER_TYPES:
                raise ValueError(f"+kind={value}: not a server kind.{did_you_mean(value, SERVER_TYPES)}")
            kinds = (kind,)
        elif key == "json" and eq:
            if value.lower() not in ("true", "false"):
                raise ValueError(f"+json={value}: must be true or false")
            as_json = value.lower() == "true"
        else:
            raise ValueError(f"unknown option {arg!r}.{did_you_mean(key, ('kind', 'json'), '+')} {USAGE}")
    return kinds, as_json


@command("ng_list")
def main(argv: list[str] | None = None) -> None:
    """``ng_list`` entry point."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print("List every environment, agent and model server found: folders here and in the repository,")
        print("and installed packages (entry point group nemo_gym.servers; docs/writing_an_environment.md).")
        print(USAGE)
        return
    try:
        kinds, as_json = parse_options(argv)
    except ValueError as e:
        sys.stderr.write(f"ng_list: {e}\n")
        sys.exit(2)
    root = Path.cwd().resolve()
    rows = [describe(s, root) for s in server_folders(root, kinds)]
    for problem in installed_servers()[1]:
        sys.stderr.write(f"ng_list: skipped {problem}\n")
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(rows))
