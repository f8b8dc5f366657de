"""benchmarks/predict_accuracy.py's pure part: how ``--repeats`` folds each run's repeats into one row."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import predict_accuracy  # noqa: E402


def _row(run: str, repeat: int, predicted: float, measured: float | None) -> dict:
    return {"preset": "parity", "world_size": 2, "run": run, "strategy": run, "predicted": predicted,
            "measured": measured, "error": predicted / measured - 1 if measured else None, "split_ms": [1.0, 2.0, 3.0],
            "bound": None, "status": "ok" if measured else "failed", "repeat": repeat}


def test_repeats_set_the_median_prediction_against_the_median_measurement():
    rows = [_row("ddp", 1, 100.0, 80.0), _row("ddp", 2, 120.0, 110.0), _row("ddp", 3, 90.0, 100.0),
            _row("fsdp2", 1, 50.0, 40.0), _row("fsdp2", 2, 55.0, None)]
    combined = {r["run"]: r for r in predict_accuracy.combine(rows)}
    ddp = combined["ddp"]
    assert ddp["predicted"] == 100.0 and ddp["measured"] == 100.0 and ddp["error"] == pytest.approx(0.0)
    assert ddp["repeat_errors"] == pytest.approx([0.25, 120 / 110 - 1, -0.1])
    assert ddp["measured_spread"] == pytest.approx(110 / 80)
    # A repeat that measured nothing (a failed run) is left out of the measurement, not counted as 0.
    fsdp2 = combined["fsdp2"]
    assert fsdp2["measured"] == 40.0 and fsdp2["predicted"] == pytest.approx(52.5)
    assert fsdp2["repeat_errors"][1] is None


def test_a_run_that_never_measured_has_no_error():
    combined = predict_accuracy.combine([_row("ddp", 1, 100.0, None), _row("ddp", 2, 90.0, None)])
    assert combined[0]["error"] is None and combined[0]["measured"] is None and combined[0]["measured_spread"] is None


def test_the_report_prints_each_repeats_error(capsys):
    rows = predict_accuracy.combine([_row("ddp", 1, 100.0, 80.0), _row("ddp", 2, 120.0, 110.0)])
    predict_accuracy.report(rows, [], repeats=2)
    out = capsys.readouterr().out
    assert "| ddp | 1 |" in out  # the per-strategy table: one run
    assert "+25%, +9%" in out and "1.38" in out
