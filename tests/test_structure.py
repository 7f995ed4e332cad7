"""The package's structure: no import cycles (every import counts, lazy and
TYPE_CHECKING ones too: a cycle is a design knot even when Python tolerates it), and the
ground floor imports nothing of pcpflow."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in (REPO / "pcpflow").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in (REPO / "stages").glob("*.py"):
        mods["pcpflow.stages" + ("" if path.stem == "__init__" else f".{path.stem}")] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.stem == "__init__" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for name in names:
                # the module itself, else its closest enclosing module of the package
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != mod and name != "pcpflow":
                    graph[mod].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_ground_floor_imports_nothing_of_pcpflow():
    graph = import_graph()
    for ground in ("pcpflow.paths", "pcpflow.errors", "pcpflow.layouts.layout"):
        assert graph[ground] == set(), (ground, graph[ground])
    # Only the entry points import the driver's command line: `python -m pcpflow` and the
    # in-process one of pcpflow.testing, which nothing in the package imports.
    assert sorted(m for m, deps in graph.items() if "pcpflow.driver.cli" in deps) == ["pcpflow.__main__", "pcpflow.testing"]
    assert not [m for m, deps in graph.items() if "pcpflow.testing" in deps]
    # The protocol names no stage; the config imports no registry.
    assert not any(d.startswith("pcpflow.stages") for d in graph["pcpflow.pipeline.stage"])
    assert not graph["pcpflow.config.run"] & {"pcpflow.pipeline.stage", "pcpflow.pipeline.assemble"}
