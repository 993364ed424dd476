"""The shape of ``nemo_gym/``, read from its own imports: no import cycles, no private names across parts.

An import counts wherever it stands (module level, inside a function, under ``if TYPE_CHECKING:``):
a cycle closed by a function-level import is still two parts that cannot be understood apart.
A part is ``nemo_gym.<name>`` (a subpackage or a top-level module); a ``_private`` name is private to
its part, so another part importing it is reaching into code it should not depend on.
"""

from __future__ import annotations

import ast
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
