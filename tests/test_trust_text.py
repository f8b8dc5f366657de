"""Text from outside is text (issue 43, item 6): an error record's message, a console.log line, a note or a path that
holds Rich markup (``[@click=app.quit]boom[/]``, ``[bold red]x[/]``) or a terminal control (``\\x1b]0;pwned\\x07``
sets a terminal's title) is printed as the characters it is: the brackets literally, the control spelled ``\\x1b``.

The commands run as a user runs them (a subprocess each) on a copy of the recorded fixture; the headless view's
tables and lines are rendered in-process. ``craft`` is shared with ``test_trust_app.py``.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

from shardscope.profiling import state

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "data", "replay-smoke")

CLICK = "[@click=app.quit]boom[/]"
STYLE = "[bold red]x[/]"
OSC = "\x1b]0;pwned\x07"
MARK = f"{CLICK} {STYLE} {OSC}"
OSC_SPELLED = "\\x1b]0;pwned\\x07"  # what core.text.clean makes of it
# Variables that would make rich or click colour a pipe: the output must hold no ESC at all, styles included.
COLOUR_ENV = ("FORCE_COLOR", "CLICOLOR_FORCE", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "PY_COLORS")


def craft(dst: str) -> str:
    """Copy the fixture to ``dst`` with MARK in an error record (message and traceback), a console.log line of two
    runs, notes (a run's fairness flag, the recommendation's lines), the comparison's name and description and
    the summary's preset; return ``dst``. tests/data is never written."""
    shutil.copytree(FIXTURE, dst)
    ranks = os.path.join(dst, "fsdp2-fault", "metrics", "rank1.jsonl")
    with open(ranks, encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    for r in records:
        if r["kind"] == "error":
            r["message"] = f"RuntimeError: {MARK}"
            r["traceback"] += f"\nValueError: {MARK}"
    with open(ranks, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    for run in ("ddp", "fsdp2-fault"):
        with open(os.path.join(dst, run, "console.log"), "a", encoding="utf-8") as fh:
            fh.write(f"[rank0] console {MARK}\n")
    path = os.path.join(dst, "summary.json")
    with open(path, encoding="utf-8") as fh:
        summary = json.load(fh)
    summary["preset"] = f"smoke {MARK}"
    for r in summary["runs"]:
        r["fairness_flags"] = [f"note {MARK}"]
        if r["name"] == "fsdp2-fault":
            r["error"] = f"RuntimeError: {MARK}"
    summary["recommendation"] = {"lines": [f"fastest run: ddp {MARK}",
                                           f"fsdp2-fault failed: left out of the recommendation ({MARK})"]}
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(summary, fh)
    path = os.path.join(dst, "comparison.json")
    with open(path, encoding="utf-8") as fh:
        comparison = json.load(fh)
    comparison["name"] = f"smoke {MARK}"
    comparison["description"] = f"desc {MARK}"
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(comparison, fh)
    return dst


def cli(*args: str, cwd: str) -> subprocess.CompletedProcess:
    """The real command line in a subprocess, its output a pipe (wide: no line is wrapped inside a mark)."""
    env = {k: v for k, v in os.environ.items() if k not in COLOUR_ENV}
    env.update(COLUMNS="400", NO_COLOR="1")
    return subprocess.run([sys.executable, "-m", "shardscope.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600)


def assert_text(proc: subprocess.CompletedProcess, *literal: str) -> str:
    """No traceback, no raw ESC on stdout or stderr, and each of ``literal`` shown as it is; return the output."""
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert "\x1b" not in proc.stdout and "\x1b" not in proc.stderr, out
    for text in literal:
        assert text in out, (text, out)
    return out


def test_diff_recommend_and_report_print_marks_as_text(tmp_path):
    run = craft(str(tmp_path / "trust"))
    out = assert_text(cli("recommend", run, cwd=str(tmp_path)), CLICK, STYLE, OSC_SPELLED)
    assert "fsdp2-fault failed" in out
    proc = cli("diff", run, run, cwd=str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the failed run fails the gate, as it should
    out = assert_text(proc, CLICK, STYLE, OSC_SPELLED)
    assert "diff: fsdp2-fault: new run ended failed (RuntimeError:" in out
    proc = cli("report", run, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_text(proc, "summary: ")
    # the regenerated summary keeps the record's message; recommend prints it as text again
    assert_text(cli("recommend", run, cwd=str(tmp_path)), CLICK, STYLE, OSC_SPELLED)


def test_a_path_with_markup_and_a_control_is_printed_as_text(tmp_path):
    """A run directory's own name is text from outside too: in ``diff``'s title and ``report``'s lines."""
    name = f"run{STYLE.replace('[/]', '')}{OSC}"  # a file name cannot hold "/"
    run = craft(str(tmp_path / name))
    shown = f"run[bold red]x{OSC_SPELLED}"
    assert_text(cli("diff", name, name, cwd=str(tmp_path)), shown)
    proc = cli("report", name, cwd=str(tmp_path))
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # what it could read decides; never a traceback
    assert_text(proc, shown)
    assert os.path.isdir(run)


def test_a_record_of_the_wrong_shape_is_one_line_never_a_traceback(tmp_path):
    """A rank file's line that is no record, and a record whose figure is a string, in ``diff``, ``report`` and
    ``recommend``: a line of bad input (or a result without them), never a traceback."""
    run = str(tmp_path / "run")
    shutil.copytree(FIXTURE, run)
    with open(os.path.join(run, "ddp", "metrics", "rank0.jsonl"), "a", encoding="utf-8") as fh:
        fh.write('{"kind":"step","t":"soon"}\n')
        fh.write('{"v":1,"kind":"step","run":"ddp","rank":0,"t":1700000100.0,"step":30,"loss":0.5,'
                 '"tokens_per_s":"fast"}\n')
    for args in (("diff", run, run), ("recommend", run), ("report", run)):
        proc = cli(*args, cwd=str(tmp_path))
        assert proc.returncode in (0, 1, 2), proc.stdout + proc.stderr
        assert_text(proc)


def test_explain_prints_a_directory_as_text(tmp_path):
    run = craft(str(tmp_path / "trust"))
    assert_text(cli("explain", "fsdp2", run, cwd=str(tmp_path)), "fsdp2")


def test_predict_and_why_printers_show_marks_as_text():
    """``predict``'s and ``why``'s printers: names, strategies, notes, reasons and verdicts from run directories."""
    from shardscope.cli.predictview import print_prediction
    from shardscope.cli.whyview import print_result

    console = _console()
    row = {"name": "ddp", "strategy": f"ddp {STYLE}", "world_size": 2, "peak_mem_bytes": 1 << 20, "why": None,
           "notes": [f"note {MARK}"], "bound": None, "tokens_per_s": 1000.0, "step_time_s": 0.1, "compute_s": 0.05,
           "exposed_comm_s": 0.01, "rest_s": 0.04, "method": f"probed {CLICK}"}
    print_prediction({"what_if": False, "device": "", "preset": f"smoke {MARK}", "assumptions": [f"assume {MARK}"],
                      "runs": [row, {**row, "name": "fsdp2", "why": f"no {MARK}", "notes": []}],
                      "calibration": None, "fit_error": None}, console)
    print_result({"run": "fsdp2", "baseline": "ddp", "tolerance": 1e-5, "steps": 4, "status": "not explained",
                  "message": f"not explained: {MARK}", "quirk": f"quirk {MARK}", "module": {"finding": f"at {MARK}"},
                  "gap_before": None, "variants": [{"name": f"v {CLICK}", "round": 1, "describe": f"set {MARK}",
                                                    "within": False}]}, console)
    out = console.file.getvalue()
    assert "\x1b" not in out, out
    for shown in (f"smoke {CLICK} {STYLE} {OSC_SPELLED}", f"ddp {STYLE}", f"probed {CLICK}", f"ddp: note {CLICK}",
                  f"fsdp2: not predicted: no {CLICK}", f"assume {CLICK}", f"not explained: {CLICK} {STYLE}",
                  f"quirk {CLICK}", f"at {CLICK}", f"set {CLICK}"):
        assert shown in out, (shown, out)


def _console(width: int = 300):
    from rich.console import Console

    return Console(file=io.StringIO(), width=width, force_terminal=False, color_system=None, soft_wrap=True)


def test_headless_lines_and_tables_show_marks_as_text():
    from shardscope.cli.headless import HeadlessView, comparison_table, loss_table

    console = _console()
    view = HeadlessView(console, ["ddp"])
    view.live = False  # the plain lines a log gets
    view([state.RunDefined("ddp", "ddp", 2, 4, "fp32", {}, "/nowhere"),
          state.StatusChanged("ddp", state.FAILED, error=f"RuntimeError: {MARK}"),
          state.Notice(f"ddp: disk {MARK}", "warning")])
    console.print(view.table())
    summary = {"preset": f"smoke {MARK}", "baseline": "ddp",
               "runs": [{"name": "ddp", "strategy": f"ddp {STYLE}", "world_size": 2, "status": f"failed {CLICK}",
                         "steps_completed": 4, "final_loss": "low", "median_tokens_per_s": "fast",
                         "peak_mem_bytes": "big", "fairness_flags": [f"note {MARK}"], "error": f"boom {MARK}"}]}
    console.print(comparison_table(summary))
    console.print(loss_table(summary))
    out = console.file.getvalue()
    assert "\x1b" not in out, out
    assert f"[ddp] failed: RuntimeError: {CLICK} {STYLE} {OSC_SPELLED}" in out, out
    assert f"warning: ddp: disk {CLICK}" in out and f"smoke {CLICK} {STYLE} {OSC_SPELLED}" in out, out
    assert f"ddp {STYLE}" in out and f"failed {CLICK}" in out and f"note {CLICK}" in out, out
