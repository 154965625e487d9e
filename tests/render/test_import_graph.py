"""No import cycles inside sbatch_gen: the graph of which module imports which, read with ast from the
sources (nothing is imported), has no cycle.

Every import statement counts, wherever it is: at module level, inside a function (a lazy import), and
under ``if TYPE_CHECKING:``. An edge goes to the module named (``from .x import y`` to ``x``, or to ``x.y``
when that is a module of its own); the package ``__init__`` a submodule import runs on the way is not an
edge of its own (``sbatch_gen/__init__.py`` would otherwise close a cycle with every module it names).
"""

from __future__ import annotations

import ast
from pathlib import Path

from .conftest import REPO

PACKAGE = "sbatch_gen"


def module_files(root: Path = REPO / PACKAGE) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file of the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name ``from <node.module>`` refers to, inside ``module``."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (anywhere in its source)."""
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(module, is_package, node)
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in files else src for a in node.names]
            graph[module] |= {t for t in targets if t in files and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module, as a closed path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_path_in(graph, set(comp), comp[0]) for comp in components]


def _path_in(graph: dict[str, set[str]], comp: set[str], start: str) -> list[str]:
    """A closed path start -> ... -> start inside one strongly connected component (breadth first)."""
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def test_no_import_cycle_in_the_package():
    graph = import_graph(module_files())
    assert len(graph) > 50 and graph["sbatch_gen.train.trainer"]  # the graph was read
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_a_cycle_is_named(tmp_path):
    """The check itself: a package whose modules import each other (one of them lazily) is reported with
    the cycle's path."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import x\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\nx = 1\n"
    )
    (pkg / "d.py").write_text("from . import c\n")
    graph = import_graph(module_files(pkg))
    assert graph["pkg.d"] == {"pkg.c"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
