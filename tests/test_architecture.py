"""The shape of ``nemo_gym/``, read from its own imports: no import cycles, no private names across parts.

An import counts wherever it stands (module level, inside a function, under ``if TYPE_CHECKING:``):
a cycle closed by a function-level import is still two parts that cannot be understood apart.
A part is ``nemo_gym.<name>`` (a subpackage or a top-level module); a ``_private`` name is private to
its part, so another part importing it is reaching into code it should not depend on.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from nemo_gym.config.keys import PACKAGE_PARENT_DIR

PACKAGE = "nemo_gym"


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted((PACKAGE_PARENT_DIR / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_PARENT_DIR).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(modules: dict[str, Path]) -> list[tuple[str, str, str | None]]:
    """(importer, imported module, name taken from it or None) for every import inside the package."""

    def owner(dotted: str) -> str | None:  # the longest prefix that is one of our modules
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if (target := owner(alias.name)) and target != name:
                        found.append((name, target, None))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in modules:  # `from package import submodule`
                        if full != name:
                            found.append((name, full, None))
                    elif (target := owner(base)) and target != name:
                        found.append((name, target, alias.name))
    return found


def _cycles(modules: dict[str, Path], edges: list[tuple[str, str, str | None]]) -> list[list[str]]:
    """The strongly connected components of more than one module (iterative Tarjan)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for a, b, _ in edges:
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def _part(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_the_reader_sees_every_import_kind(tmp_path: Path) -> None:
    """The checks below are only as good as the reader: it must see function-level, TYPE_CHECKING and
    relative imports, and a cycle they close."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub.b import _hidden\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import a\n_hidden = 1\n"
    )
    modules = {
        "pkg": pkg / "__init__.py",
        "pkg.a": pkg / "a.py",
        "pkg.sub": pkg / "sub" / "__init__.py",
        "pkg.sub.b": pkg / "sub" / "b.py",
    }
    edges = _imports(modules)
    assert ("pkg.a", "pkg.sub.b", "_hidden") in edges and ("pkg.sub.b", "pkg.a", None) in edges
    assert _cycles(modules, edges) == [["pkg.a", "pkg.sub.b"]]


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, Path], list[tuple[str, str, str | None]]]:
    modules = _modules()
    return modules, _imports(modules)


def test_no_import_cycles(graph: tuple[dict[str, Path], list[tuple[str, str, str | None]]]) -> None:
    modules, edges = graph
    cycles = _cycles(modules, edges)
    assert not cycles, "import cycles (move what both sides need down a layer):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_no_private_names_imported_across_parts(
    graph: tuple[dict[str, Path], list[tuple[str, str, str | None]]],
) -> None:
    _modules_, edges = graph
    crossing = sorted(
        f"{a} imports {name} from {b}"
        for a, b, name in edges
        if name and name.startswith("_") and not name.startswith("__") and _part(a) != _part(b)
    )
    assert not crossing, (
        "private names used outside their part (make them public, or move the code):\n" + "\n".join(crossing)
    )


def test_error_answers_are_built_in_one_place(
    graph: tuple[dict[str, Path], list[tuple[str, str, str | None]]],
) -> None:
    """Every error answer's ``{"error": {"kind": ...}}`` comes from :func:`nemo_gym.errors.error_envelope`
    (it was hand-built in nine places, each free to drift from what the collector sorts failures by)."""
    modules, _edges = graph
    hand_built = []
    for name, path in modules.items():
        if name == "nemo_gym.errors":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Dict):
                continue
            for key, value in zip(node.keys, node.values, strict=True):
                inner = (
                    {k.value for k in value.keys if isinstance(k, ast.Constant)}
                    if isinstance(value, ast.Dict)
                    else set()
                )
                if isinstance(key, ast.Constant) and key.value == "error" and "kind" in inner:
                    hand_built.append(f"{path.relative_to(PACKAGE_PARENT_DIR)}:{node.lineno}")
    assert not hand_built, "error envelopes built by hand (use nemo_gym.errors.error_envelope): " + ", ".join(
        hand_built
    )


# The wings of nemo_gym/, bottom first: a module may import only from its own wing and the wings before
# it. Each wing's ``__init__`` docstring says the same in words; nemo_gym/__init__.py shows the tree.
WINGS: list[tuple[str, set[str]]] = [
    ("base", {"errors", "redaction", "jsonl", "auth", "launch"}),
    ("config", {"config", "config_types", "global_config"}),
    ("openai_utils", {"openai_utils"}),
    ("kit", {"kit", "sandbox", "judge", "prompt", "reward_profile", "responses_converter"}),
    ("client", {"client"}),
    (
        "server",
        {
            "server",
            "server_utils",
            "base_resources_server",
            "base_responses_api_agent",
            "base_responses_api_model",
            "mcp_auto_exposure",
            "rollout_correlation",
            "base_environment_server",
            "episode_types",
        },
    ),
    ("environment_servers", {"environment_servers"}),  # server folders that ship with the package
    ("run", {"run"}),
    ("collection", {"collection"}),
    ("tools", {"tools"}),
    # upstream's paths facing the wings above
    ("faces", {"cli", "rollout_collection", "path_utils", "verifier_fixture", "testing"}),
]
BASE_MODULES = WINGS[0][1]
# Every other top-level module is upstream NeMo Gym's path, kept as a thin face.
THIN_FACES = sorted(
    f"nemo_gym.{path.stem}"
    for path in (PACKAGE_PARENT_DIR / PACKAGE).glob("*.py")
    if path.stem != "__init__" and path.stem not in BASE_MODULES
)
# 20 until NeMo Gym 0.7 added three paths its environments import (episode_types, base_environment_server,
# verifier_fixture).
MAX_LOOSE_MODULES = 23


def _wing_of(module: str) -> int | None:
    top = module.split(".")[1] if "." in module else None
    return next((i for i, (_, parts) in enumerate(WINGS) if top in parts), None)


def test_every_part_of_the_package_is_in_a_wing(graph: tuple[dict[str, Path], list]) -> None:
    modules, _edges = graph
    unplaced = sorted({m.split(".")[1] for m in modules if "." in m and _wing_of(m) is None})
    assert not unplaced, (
        f"parts of nemo_gym in no wing (add them to WINGS and to nemo_gym/__init__.py): {unplaced}"
    )


def test_wings_import_only_the_wings_below(graph: tuple[dict[str, Path], list]) -> None:
    _modules_, edges = graph
    upward = sorted(
        f"{a} ({WINGS[_wing_of(a)][0]}) imports {b} ({WINGS[_wing_of(b)][0]})"
        for a, b, _name in edges
        if "." in a and "." in b and _wing_of(a) < _wing_of(b)  # type: ignore[operator]
    )
    assert not upward, "imports running back up the wings (move the code down, or up):\n" + "\n".join(upward)


def test_the_top_of_the_package_stays_small(graph: tuple[dict[str, Path], list]) -> None:
    modules, _edges = graph
    loose = sorted(m for m, path in modules.items() if m.count(".") == 1 and path.name != "__init__.py")
    assert len(loose) <= MAX_LOOSE_MODULES, f"{len(loose)} loose modules at the top of nemo_gym/: {loose}"


def _reexports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Names a module binds by importing them from another module of the package."""
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
            names |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" not in modules}
    return names


def test_our_code_imports_each_name_from_where_it_is_defined(graph: tuple[dict[str, Path], list]) -> None:
    """One address per name: inside nemo_gym/ nothing imports a name through a module that only
    re-exports it (the faces at upstream's paths are for code written against upstream)."""
    modules, edges = graph
    reexported = {m: _reexports(p, modules) for m, p in modules.items()}
    indirect = sorted(
        f"{a} imports {name} from {b}" for a, b, name in edges if name and name in reexported[b]
    )
    assert not indirect, (
        "names imported through a re-export (import from the defining module):\n" + "\n".join(indirect)
    )


@pytest.mark.parametrize("face", THIN_FACES)
def test_upstream_faces_are_thin(face: str) -> None:
    """A face at upstream's path holds a docstring, imports and ``__all__``: exactly the upstream public
    names we implement, each defined elsewhere."""
    path = _modules()[face]
    tree = ast.parse(path.read_text(), str(path))
    extra = [
        ast.unparse(node)[:60]
        for node in tree.body
        if not isinstance(node, (ast.Import, ast.ImportFrom))
        and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
        and not (isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__all__"])
    ]
    assert not extra, f"{face} defines code (move it to its wing): {extra}"
    imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    module = importlib.import_module(face)
    assert set(module.__all__) == imported - {"annotations"}


# ------------------------------------------------------------------------------------------------
# What a server process loads. Each of the three processes ng_run starts per example pays for every
# module it imports, in start-up time and in memory; these are the ones none of them needs to start
# (they are loaded, where used at all, by the code that uses them: the launcher, a tool, a server
# that turns the feature on).

HEAVY_PACKAGES = frozenset(
    {
        "hydra",  # the command-line override grammar: the launcher's
        "httpx",  # servers call each other through nemo_gym.client
        "aiohttp",  # only the model servers that proxy a remote API
        "openai",  # the SDK's Chat Completions types, loaded by nemo_gym.openai_utils.chat on use
        "mcp",  # tools over MCP, with expose_tools_over_mcp only
        "ray",
        "cryptography",
        "numpy",
        "pandas",
        "torch",
        "transformers",
        "matplotlib",
        "rich",
        "pygments",
        "requests",
        "mlflow",
        "wandb",
    }
)
HEAVY_MODULE_PREFIXES = (
    "opentelemetry.sdk",  # +tracing=otlp only (FastAPI itself imports opentelemetry's API)
    "opentelemetry.exporter",
    "nemo_gym.run",  # the launcher
    "nemo_gym.collection",
    "nemo_gym.tools",
    "nemo_gym.config.loading",  # reading config files and a command line: the launcher's
    "nemo_gym.config.parser",
    "nemo_gym.config.validation",
    "nemo_gym.config.overrides",
    "nemo_gym.kit.verify_pool.local",  # the verify pool (multiprocessing): on first use
)
# A server kind's module never loads another kind's (their models, routes and helpers).
SERVER_KIND_MODULES = {
    "nemo_gym.server.resources": ("nemo_gym.server.agent", "nemo_gym.server.model"),
    "nemo_gym.server.agent": ("nemo_gym.server.model", "nemo_gym.server.resources"),
    "nemo_gym.server.model": ("nemo_gym.server.agent", "nemo_gym.server.resources"),
}
# What ng_run starts for the README's example, and each one's instance block.
EXAMPLE_SERVERS = {
    "resources_servers.example_single_tool_call.app": (
        "example_single_tool_call",
        {"resources_servers": {"example_single_tool_call": {"domain": "other"}}},
    ),
    "responses_api_agents.simple_agent.app": (
        "example_agent",
        {
            "responses_api_agents": {
                "simple_agent": {
                    "resources_server": {"type": "resources_servers", "name": "example_single_tool_call"},
                    "model_server": {"type": "responses_api_models", "name": "policy_model"},
                }
            }
        },
    ),
    "responses_api_models.scripted_model.app": (
        "policy_model",
        {"responses_api_models": {"scripted_model": {"model_name": "scripted-model"}}},
    ),
}
_LOADED = """
import sys
print("\\n".join(sorted(sys.modules)))
"""
# A server's start-up up to serving, as BaseServer.run_webserver does it (config read and checked, app
# built, uvicorn's protocols loaded), without the launcher's pipes and without serving.
_STARTED = """
import importlib, sys
from nemo_gym.client.fd_limits import raise_open_file_limit, split_server_budget
from nemo_gym.client.server_client import ServerClient
from nemo_gym.config.ports import reserve_listening_socket
from nemo_gym.config.problems import ConfigError
from nemo_gym.server.accept_limit import bounded_server
from nemo_gym.server.base import BaseServer

module = importlib.import_module(sys.argv[1])
cls = next(
    v for v in vars(module).values()
    if isinstance(v, type) and issubclass(v, BaseServer) and v.__module__ == module.__name__
)
config = cls.load_instance_config()
server = cls(config=config, server_client=ServerClient())
app = server.complete_app(server.setup_webserver())
bounded_server(app, 16, *server.connection_limits()).config.load()
print("\\n".join(sorted(sys.modules)))
"""


def _modules_loaded(code: str, *args: str, env: dict[str, str] | None = None) -> set[str]:
    import os
    import subprocess
    import sys

    run_env = {k: v for k, v in os.environ.items() if not k.startswith("NEMO_GYM_")}
    run_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PACKAGE_PARENT_DIR), run_env.get("PYTHONPATH")) if p
    )
    run_env.update(env or {})
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=PACKAGE_PARENT_DIR,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return set(done.stdout.split())


def _heavy(modules: set[str]) -> list[str]:
    return sorted(
        m for m in modules if m.split(".")[0] in HEAVY_PACKAGES or m.startswith(HEAVY_MODULE_PREFIXES)
    )


@pytest.mark.parametrize("kind", sorted(SERVER_KIND_MODULES))
def test_a_server_kind_loads_nothing_it_does_not_need(kind: str) -> None:
    loaded = _modules_loaded(f"import {kind}\n" + _LOADED)
    others = sorted(m for m in loaded if m.startswith(SERVER_KIND_MODULES[kind]))
    assert not _heavy(loaded) and not others, (
        f"importing {kind} loads modules no server of its kind needs to start (import them where they are "
        f"used): {_heavy(loaded) + others}"
    )


@pytest.mark.parametrize("app", sorted(EXAMPLE_SERVERS))
def test_the_example_servers_start_without_heavy_modules(app: str) -> None:
    """The whole start-up of each server of the README's example (what ng_run runs), not only its imports:
    reading its config, building its app and loading uvicorn's protocols."""
    import yaml

    name, block = EXAMPLE_SERVERS[app]
    cfg = dict(EXAMPLE_SERVERS.values())
    env = {"NEMO_GYM_CONFIG_DICT": yaml.safe_dump(cfg), "NEMO_GYM_CONFIG_PATH": name}
    heavy = _heavy(_modules_loaded(_STARTED, app, env=env))
    assert not heavy, (
        f"{app} loads modules it does not need to start (import them where they are used): {heavy}"
    )


def test_ng_run_loads_the_head_servers_stack_only_once_the_servers_are_spawned() -> None:
    """ng_run spawns the servers before it starts its head server, so they load their code while it
    builds the head server: its web stack is not among what ``ng_run`` imports to read the config."""
    loaded = _modules_loaded("import nemo_gym.run.cli\n" + _LOADED)
    early = sorted(
        m
        for m in loaded
        if m.split(".")[0] in {"fastapi", "starlette", "uvicorn", "httpx", "prometheus_client"}
    )
    assert not early, f"importing nemo_gym.run.cli loads {early}"
