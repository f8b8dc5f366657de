"""A run directory is data from outside: what is read from it never names a path, and nothing is written out of it
(issue 43). Crafted directories are made from the recorded smoke run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

FIXTURE = Path(__file__).parent / "data" / "replay-smoke"


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "shardscope.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_a_run_name_that_would_leave_the_directory_is_refused(tmp_path):
    run = tmp_path / "inner" / "run"
    shutil.copytree(FIXTURE, run)
    comparison = json.loads((run / "comparison.json").read_text())
    comparison["runs"][0]["name"] = "../escape"
    (run / "comparison.json").write_text(json.dumps(comparison))
    for args in (["report", str(run)], ["diff", str(run), str(run)]):
        proc = _cli(*args)
        assert proc.returncode == 2, (args, proc.stdout[-1000:], proc.stderr)
        assert "is not a run name" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not list((tmp_path / "inner").glob("escape*")) and not list(tmp_path.rglob("escape*"))


def test_diff_writes_no_plot_through_a_link_out_of_the_directory(tmp_path):
    old, new, outside = tmp_path / "old", tmp_path / "new", tmp_path / "outside"
    shutil.copytree(FIXTURE, old)
    shutil.copytree(FIXTURE, new)
    outside.mkdir()
    (new / "diff").symlink_to(outside, target_is_directory=True)
    proc = _cli("diff", str(old), str(new), "--speed-tol", "100")
    assert "is a link out of" in proc.stderr and "plots not written" in proc.stderr, proc.stderr
    assert list(outside.iterdir()) == []
    assert "Traceback" not in proc.stderr


def test_terminal_controls_in_a_console_or_an_error_reach_no_view(tmp_path):
    """An OSC sequence in a rank's output or an error record would set the terminal's title from inside the app or
    the command line: every such byte is shown as its \\xNN spelling."""
    from shardscope.analysis import fold
    from shardscope.core.text import clean

    assert clean("ok\x1b]0;pwned\x07 done\n\tnext\x9b") == "ok\\x1b]0;pwned\\x07 done\n\tnext\\x9b"
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    name = json.loads((run / "comparison.json").read_text())["runs"][0]["name"]
    with open(run / name / "console.log", "a", encoding="utf-8") as fh:
        fh.write("a line \x1b]0;pwned\x07 from a rank\n")
    with open(run / name / "metrics" / "rank0.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"v": 1, "kind": "error", "run": name, "rank": 0, "t": 1.0,
                             "message": "boom \x1b]0;pwned\x07", "traceback": "\x1b[2J"}) + "\n")
    states = fold.replay_states(str(run))
    assert "\x1b" not in states[name].error and "\x07" not in states[name].error
    proc = _cli("report", str(run))
    assert "\x1b]0" not in proc.stdout + proc.stderr
    assert "\x1b]0" not in (run / "report.md").read_text()


def test_damaged_records_and_files_are_counted_never_a_traceback(tmp_path):
    """Lines a prober wrote into a rank file (a string where a time belongs, nesting past the decoder, a 500-digit
    integer, a 3 MiB line) and a nested summary-side file are skipped; report, diff and recommend still answer,
    and the record server's counts (nodes/record_server.json) reach summary.json and report.md, typed."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    name = json.loads((run / "comparison.json").read_text())["runs"][0]["name"]
    with open(run / name / "metrics" / "rank0.jsonl", "a", encoding="utf-8") as fh:
        fh.write('{"v":1,"kind":"step","run":"%s","rank":0,"step":2,"t":"soon"}\n' % name)
        fh.write("[" * 100000 + "]" * 100000 + "\n")
        fh.write('{"v":1,"kind":"step","run":"%s","rank":0,"step":' % name + "9" * 500 + ',"t":1.0}\n')
        fh.write("x" * (3 << 20) + "\n")
    (run / "nodes").mkdir(exist_ok=True)
    (run / "nodes" / "record_server.json").write_text(json.dumps({
        "refused": {"unauthenticated pool full": 3412, "bad": "many", "deep": [[[1]]]},
        "refused_from": {"10.0.0.9": 3412}, "written": 40, "duplicates": 0, "beats": 12}))
    for args in (["report", str(run)], ["diff", str(run), str(run)], ["recommend", str(run)]):
        proc = _cli(*args)
        assert proc.returncode in (0, 1), (args, proc.stdout[-1000:], proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr and "Error" not in proc.stderr.split("\n")[0], proc.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["record_server"]["refused"] == {"unauthenticated pool full": 3412}
    report = (run / "report.md").read_text()
    assert "Refused: 3,412 unauthenticated pool full." in report and "10.0.0.9 3,412" in report


def test_a_directory_whose_path_holds_glob_characters_is_read(tmp_path):
    """Records are found by pattern inside the run directory: the directory's own name is never a pattern."""
    run = tmp_path / "run[1]*?"
    shutil.copytree(FIXTURE, run)
    proc = _cli("report", str(run))
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert all(r.get("steps_completed", 0) > 0 for r in summary["runs"] if r["status"] == "ok"), summary["runs"]


def test_a_figure_of_the_wrong_type_is_counted_not_raised():
    from shardscope.profiling.state import RunState

    st = RunState(name="ddp", strategy="ddp")
    st.apply_record({"kind": "step", "run": "ddp", "rank": 0, "step": 1, "t": 1.0, "tokens_per_s": "fast",
                     "step_time_s": "slow"})
    st.apply_record({"kind": "step", "run": "ddp", "rank": 0, "step": 2, "t": 2.0, "tokens_per_s": 10.0,
                     "step_time_s": 0.5})
    assert st.unfoldable == 1 and "fast" in st.unfoldable_why and st.step_times[-1] == (2, 0.5)


def test_damaged_devices_identity_and_traces_are_skipped(tmp_path):
    """devices.jsonl with a nested line and a 500-digit time, an identity file nested past the decoder and a trace
    that is no trace: report still answers; the unreadable trace is named, not raised."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    name = json.loads((run / "comparison.json").read_text())["runs"][0]["name"]
    with open(run / "devices.jsonl", "a", encoding="utf-8") as fh:
        fh.write("[" * 100000 + "]" * 100000 + "\n")
        fh.write('{"readings": [], "t": ' + "9" * 500 + "}\n")
    (run / "orchestrator.json").write_text("{" + '"a":{' * 50000 + "}" * 50001)
    traces = run / name / "traces"
    traces.mkdir(exist_ok=True)
    (traces / "rank0.trace.json").write_text('{"traceEvents": ' + "[" * 100000 + "]" * 100000 + "}")
    proc = _cli("report", str(run))
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stderr[-2000:]
