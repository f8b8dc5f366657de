"""Plots: every run its own look, empty panels say why, a run without a measurement draws no bar."""

from __future__ import annotations

from shardscope.analysis import plots


def test_no_two_runs_look_alike():
    looks = {(s["color"], str(s["linestyle"])) for s in (plots.run_style(i) for i in range(40))}
    assert len(looks) == 40
    assert plots.run_style(0, baseline=True)["linestyle"] == "-" and plots.run_style(3)["linestyle"] != "-"


def test_a_baseline_alone_and_a_run_without_measurement_still_plot(tmp_path):
    assert plots.loss_plot({"ddp": [(0, 5.0), (1, 4.0)]}, "ddp", str(tmp_path / "loss.png"))
    memory = {"measured_peak_kind": "process RSS", "runs": {
        "ddp": {"predicted": {"param_bytes": 4, "grad_bytes": 4, "optim_bytes": 8, "activation_bytes": 100},
                "measured": {"param_bytes": 4, "grad_bytes": 4, "optim_bytes": 8, "peak_bytes": 1 << 20}},
        "failed": {"predicted": {"param_bytes": 4, "grad_bytes": 4, "optim_bytes": 8}, "measured": None}}}
    assert plots.memory_plot(memory, str(tmp_path / "memory.png"))
    assert (tmp_path / "loss.png").stat().st_size > 0 and (tmp_path / "memory.png").stat().st_size > 0
