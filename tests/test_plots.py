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


def test_a_crafted_pipeline_timeline_is_drawn_in_bounded_work(tmp_path):
    """Every rank's MAX_ACTIONS actions, for more ranks than are drawn: the plot is written, says what it left out,
    and draws one bar collection per rank and kind (not one artist per action)."""
    from shardscope.analysis import pipeline_plot
    from shardscope.profiling.bubble import MAX_ACTIONS

    actions = [["F" if i % 2 == 0 else "B", 0, i // 2, float(i), i + 0.5] for i in range(MAX_ACTIONS)]
    run = {"name": "crafted", "pipeline": {"schedule": "1f1b", "pp": 2, "stages_per_rank": 1, "microbatches": 2,
                                           "timeline": {str(r): actions for r in range(pipeline_plot.MAX_RANKS + 36)}}}
    drawn: list[int] = []
    real = pipeline_plot._draw

    def counting(ax, timelines, title):
        out = real(ax, timelines, title)
        drawn.append(len(ax.collections))
        assert "too many actions to number" in ax.get_title() or not timelines, ax.get_title()
        assert f"the first {pipeline_plot.MAX_RANKS} of {pipeline_plot.MAX_RANKS + 36} ranks drawn" in ax.get_title()
        return out

    pipeline_plot._draw = counting
    try:
        assert pipeline_plot.timeline_plot(run, str(tmp_path / "t.png")) == str(tmp_path / "t.png")
    finally:
        pipeline_plot._draw = real
    assert drawn == [2 * pipeline_plot.MAX_RANKS]  # F and B per rank; the ideal schedule not simulated
    assert (tmp_path / "t.png").stat().st_size > 0
