"""report.md's "Predicted beside measured", as text: a bound is shown as a bound (held or broken), never as an
error; a section that predicts nothing beyond bounds is one line; the sitting's between-run noise stands beside the
errors. Pure text from summary.json rows (the rows themselves are checked end to end in test_predict_cli.py)."""

from __future__ import annotations

from shardscope.analysis.predict import report

SPLIT = {"step_time_s": 0.1, "compute_s": 0.08, "exposed_comm_s": 0.01, "rest_s": 0.01, "peak_mem_bytes": 1 << 20}


def _row(name, got, measured, bound=None):
    return {"name": name, "strategy": name, "tokens_per_s": got, "measured_tokens_per_s": measured,
            "error": got / measured - 1, "measured_spread": 0.05, "bound": bound, "notes": [], "why": None,
            "calibration_run": False, **SPLIT}


def _section(*rows):
    return {"calibrated_on": report.LEAVE_ONE_OUT, "probed": False, "runs": {r["name"]: r for r in rows},
            "assumptions": ["a"], "fit_error": None}


def test_bounds_held_or_broken_never_an_error():
    sec = _section(_row("ddp", 1000.0, 1100.0), _row("zero1", 2000.0, 1500.0, "upper"),
                   _row("zero2", 2000.0, 4000.0, "upper"))
    text = report.markdown(sec, "A/A control: ddp run again moved 3.0%")
    assert "| ddp | ddp | 1,000 | 1,100 | -9.1% (own spread ±5.0%)" in text
    assert "| zero1 | zero1 | ≤ 2,000 | 1,500 | upper bound, held: measured 25% below it |" in text
    assert "| zero2 | zero2 | ≤ 2,000 | 4,000 | upper bound, broken: measured 2.00x it" in text
    assert "+100.0%" not in text and "-25.0%" not in text
    assert "In this sitting, A/A control: ddp run again moved 3.0%." in text
    lines = report.plain_lines(sec, "A/A control: ddp run again moved 3.0%")
    assert "zero1: predicted ≤ 2,000 tokens/s, measured 1,500 (upper bound, held: measured 25% below it)" in lines
    assert lines[-1] == "in this sitting, A/A control: ddp run again moved 3.0%"


def test_only_bounds_is_one_line():
    sec = _section(_row("ddp", 1000.0, 900.0, "upper"), _row("fsdp2", 2000.0, 1500.0, "upper"))
    body = report.markdown(sec).split("## Predicted beside measured")[1].strip()
    assert body.startswith("Not shown: only upper bounds") and "\n" not in body and "|" not in body
    assert report.plain_lines(sec) == [f"not shown: {report.left_out(sec)}"]
    assert not report.useful(sec)
    assert report.useful(_section(_row("ddp", 1000.0, 900.0), _row("fsdp2", 2000.0, 1500.0, "upper")))
