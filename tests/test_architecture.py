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
    ("base", {"errors", "redaction", "jsonl", "auth"}),
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
        },
    ),
    ("run", {"run"}),
    ("collection", {"collection"}),
    ("tools", {"tools"}),
    ("faces", {"cli", "rollout_collection", "path_utils"}),  # upstream's paths facing the wings above
]
BASE_MODULES = WINGS[0][1]
# Every other top-level module is upstream NeMo Gym's path, kept as a thin face.
THIN_FACES = sorted(
    f"nemo_gym.{path.stem}"
    for path in (PACKAGE_PARENT_DIR / PACKAGE).glob("*.py")
    if path.stem != "__init__" and path.stem not in BASE_MODULES
)
MAX_LOOSE_MODULES = 20


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
