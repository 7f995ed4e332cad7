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


def folder_of(module: str) -> str:
    """The room a module lives in: its folder under pcpflow (``pcpflow.rank``), or itself
    for a face module at the top (``pcpflow.stage``)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    folders: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        folders.setdefault(folder_of(mod), set()).update(folder_of(d) for d in deps)
    return {f: deps - {f} for f, deps in folders.items()}


def test_no_folder_imports_a_folder_that_imports_it_back():
    """Folders stand on floors: no import runs back up (a folder cycle is one)."""
    assert cycles(folder_graph(import_graph())) == []


def test_the_ground_floor_imports_nothing_of_pcpflow():
    graph = import_graph()
    for ground in ("pcpflow.paths", "pcpflow.errors", "pcpflow.signals"):
        assert graph[ground] == set(), (ground, graph[ground])
    # The layout arithmetic is numpy only: it imports nothing else of pcpflow but errors.
    for mod in (m for m in graph if m.startswith("pcpflow.layouts")):
        assert {folder_of(d) for d in graph[mod]} <= {"pcpflow.layouts", "pcpflow.errors"}, (mod, graph[mod])
    # Only the entry points import the driver's command line: `python -m pcpflow` and the
    # in-process one of pcpflow.testing, which nothing in the package imports.
    assert sorted(m for m, deps in graph.items() if "pcpflow.driver.cli" in deps) == ["pcpflow.__main__", "pcpflow.testing"]
    assert not [m for m, deps in graph.items() if "pcpflow.testing" in deps]
    # The protocol names no stage; the config imports no registry and no simulator.
    assert not any(d.startswith("pcpflow.stages") for d in graph["pcpflow.pipeline.stage"])
    for mod in (m for m in graph if m.startswith("pcpflow.config")):
        assert not {folder_of(d) for d in graph[mod]} & {"pcpflow.pipeline", "pcpflow.simulate", "pcpflow.rank"}, mod
    # The priced run drives the public step loop, not the executed engine's internals.
    assert not any(d.startswith("pcpflow.rank") for m in graph if m.startswith("pcpflow.simulate") for d in graph[m])


def test_the_package_top_holds_folders_and_a_few_faces():
    top = sorted(p.name for p in (REPO / "pcpflow").glob("*.py"))
    assert len(top) <= 11, top
    for face in ("stage.py", "state.py", "layout.py", "slots.py", "spec.py"):
        assert face in top


def test_the_public_faces_keep_their_names():
    """What stage and plugin authors import, and the numpy-only library entry points."""
    import pcpflow.layout
    import pcpflow.slots
    import pcpflow.spec
    import pcpflow.stage
    import pcpflow.state

    assert {"Stage", "StageConfig", "register"} <= set(vars(pcpflow.stage))
    assert "StepState" in vars(pcpflow.state)
    assert "plan_layout" in vars(pcpflow.layout)
    assert {"PAD_SLOT_ID", "compute_slot_mapping", "dcp_local_seq_lens"} <= set(vars(pcpflow.slots))
    assert pcpflow.slots.PAD_SLOT_ID == -1
    assert {"MLALayerConfig", "draft_start", "scatter_proposals", "prefill_attention"} <= set(vars(pcpflow.spec))


def test_the_run_config_and_help_need_no_torch():
    """``python -m pcpflow --help`` answers in a fraction of a second: the run config (the
    ``model:`` configs in ``pcpflow.models.config``, ``moe:``, ``sampling:``) is torch-free, and
    the driver imports torch where ranks start (``pcpflow.driver.launch``)."""
    import subprocess
    import sys

    code = ("import contextlib, io, sys\n"
            "import pcpflow.config.run, pcpflow.driver.job\n"
            "from pcpflow.driver.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    assert main(['--help']) == 0\n"
            "assert 'pcp' in out.getvalue()\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
