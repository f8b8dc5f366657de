"""The house: the import graph read from the source has no cycle and keeps the documented layers.

Layers (docs/ARCHITECTURE.md), arrows pointing down only:

    views         cli/, tui/, __main__
    orchestrator  orchestrator/
    analysis      analysis/
    measure       profiling/                      rank side   engines/
    schema        config (the presets facade), presets/, core/

The measuring rooms and the rank side sit side by side: neither imports the other. The package root holds
rooms, and at most three modules beside ``__init__`` and ``__main__``; no room holds more than a quarter of
the code.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections import defaultdict

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shardscope")
VIEWS = {"cli", "tui", "__main__"}
SCHEMA = {"config", "presets", "core", "__init__"}
# What each layer may import (besides itself).
ALLOWED = {
    "schema": {"schema"},
    "engines": {"schema"},
    "profiling": {"schema"},
    "analysis": {"schema", "profiling"},
    "orchestrator": {"schema", "profiling", "analysis"},
    "views": {"schema", "profiling", "analysis", "orchestrator", "views"},
}


def layer(room: str) -> str:
    """The layer a top-level room (package or module of shardscope) belongs to."""
    if room in VIEWS:
        return "views"
    if room in SCHEMA:
        return "schema"
    if room in ("engines", "profiling", "analysis", "orchestrator"):
        return room
    raise AssertionError(f"shardscope/{room}: not in any layer; add it to tests/test_layers.py and ARCHITECTURE.md")


def modules() -> dict[str, str]:
    """Module name -> file path for every module of the package."""
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, os.path.dirname(PKG))[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Edges module -> modules of the package it imports (anywhere in the file, lazy imports included)."""
    mods = modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    edges[mod].add(name)
    return edges


def room(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def cycles(nodes: set[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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
                found.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return found


def test_no_module_cycle():
    edges = import_graph()
    assert cycles(set(modules()), edges) == []


def test_no_room_cycle():
    rooms: dict[str, set[str]] = defaultdict(set)
    for src, dsts in import_graph().items():
        for dst in dsts:
            if room(src) != room(dst) and "__init__" not in (room(src), room(dst)):
                rooms[room(src)].add(room(dst))
    assert cycles(set(rooms) | {d for v in rooms.values() for d in v}, rooms) == []


def test_arrows_point_down():
    wrong = []
    for src, dsts in import_graph().items():
        for dst in dsts:
            a, b = layer(room(src)), layer(room(dst))
            if a != b and b not in ALLOWED[a]:
                wrong.append(f"{src} ({a}) imports {dst} ({b})")
    assert wrong == []


def test_only_the_cli_imports_the_app():
    wrong = [f"{src} imports {dst}" for src, dsts in import_graph().items() for dst in dsts
             if room(dst) == "tui" and room(src) not in ("tui", "cli")]
    assert wrong == []


def test_the_checker_sees_a_cycle_and_a_wrong_arrow():
    """The checks above can fail: a two-module cycle is found, and an analysis -> orchestrator arrow is flagged."""
    assert cycles({"a", "b", "c"}, {"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert "orchestrator" not in ALLOWED[layer("analysis")] and "analysis" not in ALLOWED[layer("profiling")]
    assert layer("cli") == "views" and layer("core") == "schema"


@pytest.mark.parametrize("command", ["report", "open-nothing"])
def test_report_loads_no_torch_psutil_or_launcher(tmp_path, command):
    """`shardscope report DIR` (and importing the app's modules) loads neither torch, psutil nor the launcher."""
    import shutil

    out = tmp_path / "replay"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "data", "replay-smoke"), out)
    if command == "report":
        call = f"main(['report', {str(out)!r}], standalone_mode=False)"
    else:
        call = "import shardscope.tui.app, shardscope.analysis.report, shardscope.analysis.diff"
    code = ("import sys\nfrom shardscope.cli import main\n" + call + "\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'psutil', 'deepspeed') "
            "or m == 'shardscope.orchestrator.launcher')\nprint('LOADED', bad)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LOADED []" in proc.stdout, proc.stdout[-2000:]


MAX_LINES = 400


def test_no_source_file_over_400_lines():
    """Every module of the package stays under MAX_LINES lines (split along a real seam instead of growing)."""
    long = {}
    for path in modules().values():
        with open(path, encoding="utf-8") as fh:
            n = sum(1 for _ in fh)
        if n > MAX_LINES:
            long[os.path.relpath(path, PKG)] = n
    assert long == {}, f"files over {MAX_LINES} lines: {long}"


def test_the_root_holds_rooms():
    """``ls shardscope/`` shows rooms and at most three modules beside ``__init__`` and ``__main__``, and every room
    says in its ``__init__`` docstring what it owns, what it may import and who imports it."""
    loose = sorted(f for f in os.listdir(PKG) if f.endswith(".py") and f not in ("__init__.py", "__main__.py"))
    assert len(loose) <= 3, loose
    rooms = sorted(d for d in os.listdir(PKG) if os.path.isfile(os.path.join(PKG, d, "__init__.py")))
    assert {"cli", "core", "analysis", "profiling", "engines", "orchestrator", "presets", "tui"} <= set(rooms)
    for d in rooms:
        with open(os.path.join(PKG, d, "__init__.py"), encoding="utf-8") as fh:
            doc = ast.get_docstring(ast.parse(fh.read())) or ""
        assert "Owns:" in doc and "May import:" in doc and "Imported by:" in doc, d


def test_no_room_holds_more_than_a_quarter_of_the_code():
    lines: dict[str, int] = defaultdict(int)
    for mod, path in modules().items():
        with open(path, encoding="utf-8") as fh:
            lines[room(mod)] += sum(1 for _ in fh)
    total = sum(lines.values())
    big = {r: f"{n / total:.0%}" for r, n in lines.items() if n > total / 4}
    assert big == {}, big


def test_a_prefix_shared_by_more_than_five_files_is_a_room():
    """``analysis/predict_*.py`` grew to ten files before it became ``analysis/predict/``: a concern that has outgrown
    a file-name prefix gets a room of its own (a folder whose ``__init__`` says what it owns)."""
    crowded = {}
    for folder, _, files in os.walk(PKG):
        prefixes: dict[str, int] = defaultdict(int)
        for f in files:
            if f.endswith(".py") and not f.startswith("_") and "_" in f:
                prefixes[f.split("_")[0]] += 1
        crowded.update({f"{os.path.relpath(folder, PKG)}/{p}_*": n for p, n in prefixes.items() if n > 5})
    assert crowded == {}, f"make these rooms: {crowded}"


# What a run's description is built from (issue 48): only ``profiling/run_description`` calls these on a model or a
# run; every other module reads a ``RunDescription`` (or ``ModelDescription``) it was handed or built once.
BUILDERS = ("layout_for", "params_for", "model_params", "flops_per_token")
BUILT_IN = {"profiling/run_description.py", "profiling/param_shapes.py"}


def test_a_runs_model_and_layout_are_described_in_one_place():
    calls = []
    for mod, path in modules().items():
        rel = os.path.relpath(path, PKG)
        if rel in BUILT_IN:
            continue
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
                if name in BUILDERS:
                    calls.append(f"{rel}:{node.lineno} {name}")
    assert calls == [], f"describe the run once (profiling/run_description.describe_run) instead: {calls}"
