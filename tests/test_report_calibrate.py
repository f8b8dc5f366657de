"""``run --headless --calibrate CAL [--probe]`` and ``report DIR --calibrate CAL [--probe]``: a comparison's runs set
beside their prediction from a calibration the user names (not the comparison's own baseline run), through the
real command line on real smoke comparisons (gloo on CPU). The figures are checked against ``predict --json`` on
the same calibration, an independent path through the command line; accuracy is benchmarks/predict_accuracy.py's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardscope.core.rundir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
CLI = [sys.executable, "-m", "shardscope.cli"]
STEPS = ["--set", "steps=10", "--set", "profile.start_step=4"]  # steps 4-5 traced: the collectives' timings


def run_cli(*args, timeout=600):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def summary_of(out) -> dict:
    with open(RunDir(str(out)).summary, encoding="utf-8") as fh:
        return json.load(fh)


def report_of(out) -> str:
    with open(RunDir(str(out)).report, encoding="utf-8") as fh:
        return " ".join(fh.read().split())


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(calibration, other, the run's CLI result): two finished smoke comparisons, the second run with
    ``--calibrate`` the first ``--probe``."""
    root = tmp_path_factory.mktemp("calibrate")
    cal, other = root / "cal", root / "other"
    proc = run_cli("run", "--preset", "smoke", "--headless", "--out", str(cal), *STEPS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = run_cli("run", "--preset", "smoke", "--headless", "--out", str(other), *STEPS, "--calibrate", str(cal),
                   "--probe")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return cal, other, proc


def test_run_sets_each_run_beside_its_probed_prediction_from_the_named_calibration(dirs):
    cal, other, proc = dirs
    sec = summary_of(other)["prediction"]
    assert sec["calibrated_on"] == str(cal) and sec["probed"] is True
    assert set(sec["runs"]) == {"ddp", "fsdp2"}
    for name, row in sec["runs"].items():
        assert row["calibration_run"] is False  # the baseline is predicted too: it is not the calibration
        assert row["tokens_per_s"] > 0 and row["measured_tokens_per_s"] > 0
        assert row["error"] == pytest.approx(row["tokens_per_s"] / row["measured_tokens_per_s"] - 1)
        assert any("one-rank probe of this run" in n for n in row["notes"]), row["notes"]
        assert f"probing {name} " in proc.stderr  # progress, one line per probe
    assert "predicted beside measured" in proc.stdout and "ddp: predicted" in proc.stdout
    report = report_of(other)
    assert f"Calibrated on {cal}, each run's compute measured by a one-rank probe" in report
    assert "(calibration run: fit error)" not in report


def test_report_recalibrates_as_predict_does_and_alone_goes_back_to_the_baseline(dirs):
    cal, other, _ = dirs
    proc = run_cli("report", str(other), "--calibrate", str(cal))
    assert proc.returncode == 0, proc.stderr
    sec = summary_of(other)["prediction"]
    assert sec["calibrated_on"] == str(cal) and sec["probed"] is False
    alone = json.loads(run_cli("predict", "--calibrate", str(cal), "--preset", "smoke", *STEPS, "--json", "--quick").stdout)
    for row in alone["runs"]:
        assert sec["runs"][row["name"]]["tokens_per_s"] == pytest.approx(row["tokens_per_s"], rel=1e-9)
        assert sec["runs"][row["name"]]["step_time_s"] == pytest.approx(row["step_time_s"], rel=1e-9)
    assert "carried over from the calibration per FLOP" in report_of(other)
    proc = run_cli("report", str(other))
    assert proc.returncode == 0, proc.stderr
    sec = summary_of(other)["prediction"]
    assert sec["calibrated_on"].startswith("this comparison's other runs") and not sec["runs"]["ddp"]["calibration_run"]


def test_bad_calibrations_exit_2_in_one_line_and_launch_nothing(dirs, tmp_path):
    cal, other, _ = dirs
    never = tmp_path / "never"
    for args, words in ((["report", str(other), "--probe"], "--probe needs --calibrate"),
                        (["report", str(other), "--calibrate", str(tmp_path)], "not a finished shardscope run"),
                        (["run", "--preset", "smoke", "--calibrate", str(cal), "--out", str(never)], "needs --headless"),
                        (["run", "--preset", "smoke", "--headless", "--probe", "--out", str(never)],
                         "--probe needs --calibrate"),
                        (["run", "--preset", "smoke", "--headless", "--calibrate", str(tmp_path), "--out", str(never)],
                         "not a finished shardscope run")):
        proc = run_cli(*args, timeout=120)
        assert proc.returncode == 2, (args, proc.stderr)
        assert words in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)
        assert not never.exists()
