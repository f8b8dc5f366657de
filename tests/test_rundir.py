"""The run directory: ``shardscope/core/rundir.py`` alone spells the names of the files and folders under ``<out>``.

A source scan (string constants, docstrings left out) fails when another module names one of them, and
unit tests pin the paths ``RunDir`` / ``RunFiles`` give.
"""

from __future__ import annotations

import ast
import os
import re

import pytest

from shardscope.core import rundir
from shardscope.core.rundir import RunDir, RunFiles

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shardscope")

# The one module allowed to spell file names under <out>. Nothing else may join it.
ALLOWED = {"core/rundir.py"}

# A file name under <out>, anywhere in a string (f-string pieces included).
FILE_NAME = re.compile(
    r"\b(comparison|summary|spec|status|orchestrator|merged_trace)\.json\b|\breport\.md\b"
    r"|\binit\.(safetensors|log)\b|\bconsole\.(log|node)|\bdevices\.(jsonl|node)|\.jsonl\b|\.png\b"
    r"|\.trace\.json|\.tmp\b|\.attempt\b|shardscope-dashboard\.svg|\.shardscope-spare|\.shardscope-lock|\.shardscope-agent|\bstall-request\b|\.spare\b"
    r"|\b(metrics|traces|plots|nodes)/|\btraces/tb\b|\b(why|tune)\.json\b")
# A folder under <out>: flagged when it is a piece of a path (an argument of a join or a glob).
FOLDERS = {"metrics", "traces", "plots", "tb", "diff", "nodes", "why"}
PATH_CALLS = {"join", "glob", "iglob", "listdir", "isdir", "isfile", "exists", "makedirs"}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of a module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                out.add(id(body[0].value))
    return out


def _call_name(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def file_name_literals(source: str) -> list[str]:
    """``line: text`` for every string constant of ``source`` that names a file or folder under ``<out>``."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if FILE_NAME.search(node.value):
                found.append(f"{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Call) and _call_name(node) in PATH_CALLS:
            for arg in node.args:
                if isinstance(arg, ast.Constant) and arg.value in FOLDERS:
                    found.append(f"{arg.lineno}: {arg.value!r}")
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def _sources() -> list[tuple[str, str]]:
    out = []
    for d, _, files in os.walk(PKG):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                out.append((os.path.relpath(path, PKG).replace(os.sep, "/"), path))
    return sorted(out)


def test_only_rundir_names_files_under_out():
    wrong = []
    for rel, path in _sources():
        if rel in ALLOWED:
            continue
        with open(path, encoding="utf-8") as fh:
            wrong += [f"shardscope/{rel}:{hit}" for hit in file_name_literals(fh.read())]
    assert wrong == [], "name these through shardscope/core/rundir.py (RunDir / RunFiles):\n" + "\n".join(wrong)


def test_the_scan_can_fail():
    """The scan flags names in plain strings, f-string pieces and path joins, and leaves docstrings and JSON keys."""
    src = '''
"""Module doc naming summary.json is fine."""
import os
def f(out, run, rank, data):
    """Writes report.md (prose)."""
    a = os.path.join(out, "summary.json")
    b = os.path.join(out, run, "metrics", f"rank{rank}.jsonl")
    c = f"{out}/console.node{rank}.log"
    d = os.path.join(out, "plots")
    e = data["plots"], data.get("traces")
    g = "see traces/tb for TensorBoard"
'''
    hits = file_name_literals(src)
    assert [h.split(":")[0] for h in hits] == ["6", "7", "7", "8", "9", "11"], hits
    assert file_name_literals('x = {"plots": 1, "diff": 2}\n"""not a docstring: spec.json"""\n') == ["2: 'not a docstring: spec.json'"]


def test_every_name_rundir_spells_is_one_the_scan_knows():
    """A name added to rundir is covered by the scan (so another module spelling it would be caught)."""
    names = [v for k, v in vars(rundir).items() if k.isupper() and isinstance(v, str) and not k.startswith("_")]
    assert len(names) >= 15
    for value in names:
        assert FILE_NAME.search(value) or value in FOLDERS or FILE_NAME.search(f"x{value}"), value
    for node in range(2):
        assert FILE_NAME.search(rundir.console_name(node)) and FILE_NAME.search(rundir.devices_name(node))


def test_allow_list_is_short_and_real():
    rels = {rel for rel, _ in _sources()}
    assert ALLOWED <= rels and len(ALLOWED) == 1


# --- paths --------------------------------------------------------------------------------------


def test_run_dir_paths(tmp_path):
    out = RunDir(str(tmp_path))
    p = str(tmp_path)
    assert out.comparison == os.path.join(p, "comparison.json")
    assert out.summary == os.path.join(p, "summary.json")
    assert out.report == os.path.join(p, "report.md")
    assert out.plots == os.path.join(p, "plots") and out.plot("loss") == os.path.join(p, "plots", "loss.png")
    assert out.diff == os.path.join(p, "diff")
    assert out.merged_trace == os.path.join(p, "merged_trace.json")
    assert out.init_weights == os.path.join(p, "init.safetensors")
    assert out.identity == os.path.join(p, "orchestrator.json")
    assert out.spare == os.path.join(p, ".shardscope-spare")
    assert out.devices() == os.path.join(p, "devices.jsonl")
    assert out.devices(2) == os.path.join(p, "devices.node2.jsonl")
    assert out.heartbeat(3) == os.path.join(p, "nodes", "node3.json")
    assert out.attempt("ddp", 2) == os.path.join(p, "ddp.attempt2")
    assert not out.holds_comparison()
    (tmp_path / "comparison.json").write_text("{}")
    assert out.holds_comparison()


def test_run_files_paths(tmp_path):
    files = RunDir(str(tmp_path)).run("ddp")
    r = os.path.join(str(tmp_path), "ddp")
    assert files == RunFiles(r) and files.name == "ddp" and RunFiles(r + os.sep).name == "ddp"
    assert files.spec == os.path.join(r, "spec.json") and files.status == os.path.join(r, "status.json")
    assert files.console() == os.path.join(r, "console.log")
    assert files.console(1) == os.path.join(r, "console.node1.log")
    assert files.metrics == os.path.join(r, "metrics")
    assert files.rank_file(12) == os.path.join(r, "metrics", "rank12.jsonl")
    assert files.traces == os.path.join(r, "traces") and files.tb == os.path.join(r, "traces", "tb")
    assert files.chrome_trace(1) == os.path.join(r, "traces", "rank1.trace.json")


def test_listings_find_what_is_there(tmp_path):
    out = RunDir(str(tmp_path))
    files = out.run("fsdp")
    os.makedirs(files.metrics)
    for name in ("rank10.jsonl", "rank2.jsonl", "rank0.jsonl", "rankx.jsonl", "rank1.txt"):
        (tmp_path / "fsdp" / "metrics" / name).write_text("")
    assert [os.path.basename(p) for p in files.rank_files()] == ["rank0.jsonl", "rank2.jsonl", "rank10.jsonl"]
    assert rundir.record_file_rank(files.rank_file(7)) == 7 and rundir.record_file_rank("rankx.jsonl") is None
    os.makedirs(files.tb)
    for name in ("rank0.trace.json", "rank1.trace.json.gz", "other.json"):
        (tmp_path / "fsdp" / "traces" / name).write_text("")
    for name in ("rank0.123.pt.trace.json", "rank1.9.pt.trace.json", "rank1.9.pt.trace.json.tmp"):
        (tmp_path / "fsdp" / "traces" / "tb" / name).write_text("")
    assert sorted(os.path.basename(p) for p in files.chrome_traces()) == ["rank0.trace.json", "rank1.trace.json.gz"]
    assert [os.path.basename(p) for p in files.tb_files()] == ["rank0.123.pt.trace.json", "rank1.9.pt.trace.json"]
    assert [os.path.basename(p) for p in files.tb_files(1)] == ["rank1.9.pt.trace.json"]
    assert [os.path.basename(p) for p in files.tb_partials(1)] == ["rank1.9.pt.trace.json.tmp"]
    assert [os.path.basename(p) for p in files.trace_partials()] == ["rank1.9.pt.trace.json.tmp"]
    assert len(files.trace_files()) == 6
    os.makedirs(out.plots)
    (tmp_path / "plots" / "loss.png").write_text("")
    (tmp_path / "plots" / "notes.txt").write_text("")
    assert out.plot_files() == [out.plot("loss")]


@pytest.mark.parametrize("content, expected", [
    (None, None), ("not json", None), ('["a list"]', None), ('{"runs": 3}', None),
    ('{"runs": [], "x": NaN}', "nan"), ('{"runs": [{"name": "ddp"}]}', "ok"),
])
def test_read_summary(tmp_path, content, expected):
    if content is not None:
        (tmp_path / "summary.json").write_text(content)
    got = rundir.read_summary(str(tmp_path))
    if expected is None:
        assert got is None
        with pytest.raises((OSError, ValueError)):
            rundir.load_summary(str(tmp_path))
    elif expected == "nan":
        assert got is not None and got["x"] != got["x"]  # the non-finite figure restored
    else:
        assert got == {"runs": [{"name": "ddp"}]}
