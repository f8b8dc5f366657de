"""report.md's and the app's "Predicted beside measured" read back a run directory's summary.json: input."""

from __future__ import annotations

from shardscope.analysis.predict import report as predict_report


def _row(**over):
    row = {"strategy": "ddp", "tokens_per_s": 1100.0, "measured_tokens_per_s": 1000.0, "error": 0.1,
           "measured_spread": 0.04, "step_time_s": 0.5, "compute_s": 0.3, "exposed_comm_s": 0.1, "rest_s": 0.1}
    return {**row, **over}


def test_a_row_whose_figures_are_not_numbers_is_said_so_and_the_others_are_shown():
    sec = {"calibrated_on": "ddp", "runs": {"good": _row(), "bad": _row(measured_spread="wide", error=True)}}
    lines = predict_report.plain_lines(sec)
    assert "good: predicted 1,100 tokens/s, measured 1,000 (+10.0%; its own spread ±4.0%)" in lines
    assert f"bad: {predict_report.UNREADABLE}" in lines
    md = predict_report.markdown(sec)
    assert "+10.0% (own spread ±4.0%)" in md and f"| bad | - | {predict_report.UNREADABLE} |" in md
