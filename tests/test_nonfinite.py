"""A non-finite loss or gradient norm: the run is `diverged` at its first such step, stops there by
default, the command exits 1, and with per-layer norms the first non-finite layer is named.

One real comparison through the command line (smoke, lr=1e6: the loss is NaN at step 2), plus unit
checks of the rule (an fp16 loss scaler's skipped step is not divergence) and of the preset key.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from shardscope import config, events
from shardscope.orchestrator import replay, state
from shardscope.profiling import display, divergence

CLI = [sys.executable, "-m", "shardscope.cli"]


@pytest.fixture(scope="module")
def blown_up(tmp_path_factory):
    out = tmp_path_factory.mktemp("nonfinite") / "run"
    proc = subprocess.run([*CLI, "run", "--preset", "smoke", "--headless", "--out", str(out), "--set", "lr=1e6",
                           "--set", "steps=6", "--set", "parity=true", "--set", "profile.enabled=false"],
                          capture_output=True, text=True, timeout=300)
    return out, proc


@pytest.mark.slow
def test_nan_loss_marks_runs_diverged_and_stops_them(blown_up):
    out, proc = blown_up
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    for run in summary["runs"]:
        steps = {}
        for rank in (0, 1):
            records, _ = events.read_records(out / run["name"] / "metrics" / f"rank{rank}.jsonl")
            steps[rank] = [r for r in records if r["kind"] == "step"]
            ends = [r for r in records if r["kind"] == "end"]
            # every rank stopped at the same step, the first whose loss or norm is not finite
            first_bad = next(r["step"] for r in steps[rank]
                             if not (math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])))
            assert ends == [ends[0]] and ends[0]["status"] == "diverged" and ends[0]["diverged_step"] == first_bad
            assert steps[rank][-1]["step"] == first_bad and steps[rank][-1]["nonfinite"] is True
        assert run["status"] == "diverged" and run["diverged_step"] == steps[0][-1]["step"] < 5
        assert run["steps_completed"] == run["diverged_step"] + 1
        located = summary["divergence"][run["name"]]
        # parity mode recorded per-layer norms: the named layer is the first non-finite one in model order
        layers, _ = events.read_records(out / run["name"] / "metrics" / "rank0.jsonl")
        norms = next(r["grad_norms"] for r in layers if r["kind"] == "layers" and r["step"] == located["first_layer"]["step"])
        assert located["first_layer"]["layer"] == next(k for k, v in norms.items() if not math.isfinite(v))
    assert "[ddp] diverged: non-finite loss or gradient norm at step" in proc.stdout
    report = (out / "report.md").read_text()
    assert "diverged at step" in report and "## Non-finite loss" in report
    # NaN on both sides is a difference, never 0.00e+00
    assert "0.00e+00" not in report and "non-finite at step" in report
    # profiling was off: communication is "not measured" with the reason, null in summary.json, never 0
    for name, comm in summary["communication"]["runs"].items():
        assert comm["not_measured"] == "profiling off (profile.enabled = false)"
        assert comm["comm_bytes_per_step"] is None and comm["collectives"] is None
        assert f"- {name}: not measured: profiling off (profile.enabled = false)" in report
    assert "0.000" not in report.split("## Communication")[1].split("##")[0]


@pytest.mark.slow
def test_report_rebuilt_from_files_keeps_diverged(blown_up, tmp_path):
    out, _ = blown_up
    (out / "ddp" / "status.json").unlink()  # no verdict file: the end records alone say diverged
    states = replay.replay_states(str(out))
    assert states["ddp"].status == state.DIVERGED and states["ddp"].diverged_step is not None


def test_divergence_rule_skipped_fp16_step_is_not_divergence():
    from shardscope.engines.loop import is_divergent

    assert is_divergent(float("nan"), 1.0, False)
    assert is_divergent(1.0, float("inf"), False)
    assert not is_divergent(1.0, float("inf"), True)  # the loss scaler skipped it
    assert not is_divergent(1.0, None, False)  # a norm not measured is not a sign
    assert not is_divergent(2.5, 0.7, False)


def test_on_nonfinite_key_is_validated():
    assert config.load_preset("smoke").on_nonfinite == "stop"
    assert config.load_preset("smoke", ["on_nonfinite=continue"]).on_nonfinite == "continue"
    with pytest.raises(config.ConfigError, match=r"on_nonfinite = 'halt': allowed: stop, continue"):
        config.load_preset("smoke", ["on_nonfinite=halt"])


def test_first_nonfinite_layer_in_model_order():
    layers = {3: {"grad_norms": {"embed": 1.0, "blocks.0": 2.0}},
              4: {"grad_norms": {"embed": 1.0, "blocks.0": float("nan"), "blocks.1": float("inf")}}}
    found = divergence.first_nonfinite_layer(layers)
    assert found["step"] == 4 and found["layer"] == "blocks.0" and found["layers"] == ["blocks.0", "blocks.1"]
    assert divergence.first_nonfinite_layer({3: layers[3]}) is None


def test_status_text_names_the_step():
    assert display.status_text({"status": "diverged", "diverged_step": 2}) == "diverged at step 2"
    assert display.status_text({"status": "ok", "diverged_step": None}) == "ok"
