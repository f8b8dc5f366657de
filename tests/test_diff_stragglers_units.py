"""Unit tests of the pure parts: loss comparison (NaN is a difference), noise band, straggler watch."""

from __future__ import annotations

import math

import pytest

from shardscope.analysis import diff
from shardscope.profiling.stragglers import StragglerWatch


def test_loss_diff_counts_nan_and_inf_as_differences():
    old = [(0, 5.0), (1, 4.0), (2, 3.0), (3, float("inf"))]
    new = [(0, 5.0), (1, float("nan")), (2, 3.5), (3, float("inf")), (4, 1.0)]
    d = diff.loss_diff(old, new, tol=1e-3)
    assert d["steps_compared"] == 4
    assert d["nonfinite_steps"] == [1]  # the same infinity on both sides is not a difference
    assert d["first_beyond"]["step"] == 1 and math.isinf(d["first_beyond"]["abs_diff"])
    assert d["max_abs_diff"] == 0.5 and d["mean_abs_diff"] == 0.25  # over the finite steps 0 and 2


def test_loss_diff_within_tolerance_and_no_common_step():
    assert diff.loss_diff([(0, 1.0)], [(0, 1.0 + 1e-6)], tol=1e-5)["first_beyond"] is None
    assert diff.loss_diff([(0, 1.0)], [(1, 1.0)], tol=1e-5)["max_abs_diff"] is None


def test_relative_spread_is_half_iqr_over_median():
    assert diff.relative_spread([1.0, 2.0, 3.0]) is None  # too few steps to say
    rates = [90.0, 95.0, 100.0, 105.0, 110.0]
    q1, _, q3 = __import__("statistics").quantiles(rates, n=4)
    assert diff.relative_spread(rates) == (q3 - q1) / 2 / 100.0


def test_parse_map_rejects_malformed():
    assert diff.parse_map(["a=b"]) == [("a", "b")]
    for bad in ("a", "=b", "a="):
        try:
            diff.parse_map([bad])
        except diff.DiffInputError as err:
            assert "OLD_RUN=NEW_RUN" in str(err)
        else:
            raise AssertionError(bad)


def _feed(watch, busy_by_rank, steps, order=None):
    world = len(busy_by_rank)
    for step in steps:
        for rank in order or range(world):
            watch.add(rank, step, {"busy_s": busy_by_rank[rank](step), "time_forward_s": 0.01}, world)


def test_watch_flags_the_slow_rank_after_the_window():
    watch = StragglerWatch(threshold=1.5, window=3)
    busy = [lambda s: 0.01, lambda s: 0.01, lambda s: 0.05 if s >= 4 else 0.01, lambda s: 0.011]
    _feed(watch, busy, range(6))
    assert watch.flagged == {}  # steps 4 and 5: a streak of 2 < window
    _feed(watch, busy, range(6, 9), order=[3, 2, 1, 0])  # arrival order across ranks does not matter
    assert list(watch.flagged) == [2]
    s = watch.flagged[2]
    assert s.from_step == 4 and s.steps == 5 and abs(s.ratio - 0.05 / 0.01) < 1e-9
    assert watch.per_rank()[2]["busy_s"] == 0.05 and watch.per_rank()[0]["time_forward_s"] == 0.01


def test_watch_no_flag_for_noise_below_threshold_or_broken_streaks():
    watch = StragglerWatch(threshold=1.5, window=3)
    busy = [lambda s: 0.01, lambda s: 0.03 if s % 3 == 0 else 0.012]  # spikes never 3 steps in a row
    _feed(watch, busy, range(30))
    assert watch.flagged == {}


def test_watch_ignores_step_zero_and_records_without_busy_time():
    watch = StragglerWatch(threshold=1.5, window=1)
    _feed(watch, [lambda s: 0.01, lambda s: 1.0], [0])
    assert watch.flagged == {}
    watch.add(0, 1, {"time_forward_s": 0.1}, 2)  # a CUDA record: the split is kept, nothing judged
    watch.add(1, 1, {"time_forward_s": 9.0}, 2)
    assert watch.timing[0][1] == {"time_forward_s": 0.1} and watch.flagged == {}
    watch.configure({"threshold": 2.0, "window": 4})
    assert (watch.threshold, watch.window) == (2.0, 4)
    watch.configure({"threshold": -1, "window": "x"})
    assert (watch.threshold, watch.window) == (2.0, 4)


def test_cuda_split_is_shown_and_said_not_judged(tmp_path):
    """CUDA step records (stream-time phases from CUDA events, no busy/idle): the report, headless table and
    plot show the split, and say why no straggler is judged, instead of "No straggler"."""
    from PIL import Image

    from shardscope.cli.headless import rank_timing_table
    from shardscope.analysis import straggler_report
    from shardscope.profiling.state import RecordsArrived, RunState

    st = RunState("ddp", "ddp", 2, 6)
    recs = [{"kind": "step", "run": "ddp", "rank": r, "step": s, "local_loss": 1.0, "step_time_s": 0.05,
             "tokens": 8, "tokens_per_s": 160.0, "time_data_s": 0.001, "time_forward_s": 0.01 * (1 + r),
             "time_backward_s": 0.02, "time_optimizer_s": 0.003} for s in range(6) for r in (0, 1)]
    st.apply(RecordsArrived("ddp", tuple(recs), 0))
    sec = straggler_report.section({"ddp": st})
    entry = sec["ddp"]
    assert entry["flagged"] == [] and entry["reason"] == straggler_report.NOT_JUDGED
    assert entry["per_rank"]["1"]["time_forward_s"] == 0.02 and entry["per_rank"]["1"]["busy_s"] is None
    assert straggler_report.rows(entry)[1][3:6] == ["-", "1.0", "20.0"]  # busy not measured; data, forward ms
    md = straggler_report.markdown(sec, lambda header, rows: "|table|\n")
    assert "No straggler" not in md and "not measured on CUDA" in md
    assert "not measured on CUDA" in str(rank_timing_table({"stragglers": sec}).caption)
    path = straggler_report.plot({"ddp": st}, str(tmp_path / "rank_timing.png"))
    assert path and Image.open(path).size[0] > 0


def test_the_busy_plot_keeps_the_steps_in_scale_and_says_the_first_is_off_it(monkeypatch, tmp_path):
    """Step 0 (start-up: 10-25x a step) alone would set the panel's scale; it is left off the scale and said so,
    and a run whose first step is like the rest keeps matplotlib's own scale."""
    from shardscope.analysis import plots, straggler_report
    from shardscope.profiling.state import RecordsArrived, RunState

    saved = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: saved.append(fig) or path)
    for first, off_scale in ((0.5, True), (0.015, False)):
        st = RunState("ddp", "ddp", 2, 8)
        recs = [{"kind": "step", "run": "ddp", "rank": r, "step": s, "local_loss": 1.0, "step_time_s": 0.05,
                 "tokens": 8, "tokens_per_s": 160.0, "busy_s": first if s == 0 else 0.01 + 0.001 * (s % 3),
                 "idle_s": 0.001, "time_forward_s": 0.01} for s in range(8) for r in (0, 1)]
        st.apply(RecordsArrived("ddp", tuple(recs), 0))
        straggler_report.plot({"ddp": st}, str(tmp_path / "rank_timing.png"))
        ax = saved[-1].axes[0]
        said = [t.get_text() for t in ax.texts]
        if off_scale:
            assert ax.get_ylim()[1] == pytest.approx(1.15 * 12.0) and said == [
                "step 0: up to 500 ms (start-up), off the scale"]
        else:
            assert ax.get_ylim()[1] >= 15.0 and said == []


def test_trace_judgement_flags_compute_above_the_peers_median():
    from shardscope.analysis import straggler_report
    from shardscope.profiling.state import RunState

    st = RunState("r", "ddp", 4, 6)
    st.start[2] = {"host": "n1", "device": "cuda:0", "device_name": "NVIDIA H100"}
    judged = straggler_report.from_traces("r", st, {"steps_profiled": 2, "compute_source": "gpu-kernels",
                                                    "per_rank_compute_s": {"0": 0.010, "1": 0.011, "2": 0.030,
                                                                           "3": 0.010}}, 1.5)
    assert [f["rank"] for f in judged["flagged"]] == [2] and judged["flagged"][0]["ratio"] == pytest.approx(3.0)
    assert judged["flagged"][0]["line"] == ("straggler (traces, 2 profiled steps): r rank 2 (n1, cuda:0, NVIDIA H100): "
                                            "compute 3.00x its peers' median (threshold 1.5x)")
    assert straggler_report.from_traces("r", st, {"per_rank_compute_s": {"0": 0.01}}, 1.5) is None
    assert straggler_report.from_traces("r", st, {}, 1.5) is None
    idle = straggler_report.from_traces("r", st, {"steps_profiled": 1, "compute_source": "gpu-kernels",
                                                  "per_rank_compute_s": {"0": 0.0, "1": 0.0}}, 1.5)
    assert idle["flagged"] == []  # nothing measured on either rank is no straggler
    lines = straggler_report.trace_lines({"trace": judged})
    assert "rank 2 30.0 ms ⚠" in lines[0] and lines[1].startswith("- **straggler (traces")


def test_app_panel_shows_what_the_traces_say():
    """The app's rank timing panel (key t) with a run's trace analysis: each rank's trace compute, and a GPU
    straggler named from its kernels."""
    from rich.console import Console

    from shardscope.profiling.state import RecordsArrived, RunState
    from shardscope.tui.widgets.rank_timing import render

    st = RunState("fsdp2", "fsdp2", 2, 6)
    st.apply(RecordsArrived("fsdp2", tuple(
        {"kind": "step", "run": "fsdp2", "rank": r, "step": s, "local_loss": 1.0, "step_time_s": 0.05, "tokens": 8,
         "tokens_per_s": 160.0, "time_data_s": 0.001, "time_forward_s": 0.01, "time_backward_s": 0.02,
         "time_optimizer_s": 0.003} for s in range(4) for r in (0, 1)), 0))
    analysis = {"steps_profiled": 2, "compute_source": "gpu-kernels", "per_rank_compute_s": {"0": 0.004, "1": 0.012}}
    console = Console(width=100, record=True)
    console.print(render(st, analysis))
    text = console.export_text()
    assert "trace compute ms/step by rank: 0 4.0 · 1 12.0" in text
    assert "⚠ straggler (traces, 2 profiled steps): fsdp2 rank 1" in text and "3.00x" in text
    console = Console(width=100, record=True)
    console.print(render(st))
    assert "trace compute" not in console.export_text()  # before the profiler window: nothing said


def test_memory_diff_names_its_kind_and_never_sets_a_gpu_peak_against_rss():
    from shardscope.profiling.state import RunState

    cpu_old = RunState(name="ddp", strategy="ddp", peak_mem_bytes=100, start={0: {"device": "cpu"}})
    cpu_new = RunState(name="ddp", strategy="ddp", peak_mem_bytes=150, start={0: {"device": "cpu"}})
    gpu = RunState(name="ddp", strategy="ddp", peak_mem_bytes=150, start={0: {"device": "cuda:0"}},
                   memory={0: {"mem_alloc_bytes": 1}})
    same = diff.mem_diff(cpu_old, cpu_new)
    assert same["kind"] == "process RSS" and same["ratio"] == 1.5 and "reason" not in same
    mixed = diff.mem_diff(cpu_old, gpu)
    assert mixed["ratio"] is None and mixed["reason"] == "not comparable: old is the process RSS, new the allocator peak"


def test_core_wait_is_a_column_and_a_contended_run_is_said_to_be():
    """Step records with ``cpu_wait_s``: its median per rank is the table's last column; a run whose ranks
    waited for a core 20% of the time they were ready to run gets a sentence in the report and the headless
    caption, one at 5% does not, and records without the figure show "-" and say nothing."""
    from shardscope.analysis import straggler_report
    from shardscope.cli.headless import rank_timing_table
    from shardscope.profiling.state import RecordsArrived, RunState

    def state(name, wait):
        st = RunState(name, "ddp", 2, 6)
        extra = {} if wait is None else {"cpu_wait_s": wait}
        recs = [{"kind": "step", "run": name, "rank": r, "step": s, "local_loss": 1.0, "step_time_s": 0.05,
                 "tokens": 8, "tokens_per_s": 160.0, "time_data_s": 0.001, "time_forward_s": 0.01,
                 "time_backward_s": 0.02, "time_optimizer_s": 0.003, "busy_s": 0.02, "idle_s": 0.014, **extra}
                for s in range(6) for r in (0, 1)]
        st.apply(RecordsArrived(name, tuple(recs), 0))
        return st

    sec = straggler_report.section({"busy": state("busy", 0.005), "calm": state("calm", 0.02 / 19),
                                    "old": state("old", None)})
    assert straggler_report.rows(sec["busy"])[0][-1] == "5.0" and straggler_report.rows(sec["old"])[0][-1] == "-"
    assert straggler_report.core_wait_share(sec["busy"]) == pytest.approx(0.2)
    assert straggler_report.core_wait_share(sec["calm"]) == pytest.approx(0.05)
    assert straggler_report.core_wait_share(sec["old"]) is None
    md = straggler_report.markdown(sec, lambda header, rows: f"|{header[-1]}|\n")
    assert "|core wait ms|" in md and "The ranks of busy waited for a core 20%" in md
    assert "ranks of calm" not in md and "ranks of old" not in md
    caption = str(rank_timing_table({"stragglers": sec}).caption)
    assert "the ranks of busy waited for a core 20%" in caption and "calm" not in caption


def test_app_panel_fits_its_width_keeping_busy_idle_and_core_wait():
    """At the smallest promised terminal (100 columns) the panel is ~30 cells wide: it leaves out host and the
    phases (and says so) instead of truncating every cell to "…"; wide, it shows all nine columns. A contended
    run's sentence is shown there too."""
    from rich.console import Console

    from shardscope.profiling.state import RecordsArrived, RunState
    from shardscope.tui.widgets.rank_timing import COLUMNS, render

    st = RunState("ddp", "ddp", 2, 6)
    st.apply(RecordsArrived("ddp", tuple(
        {"kind": "step", "run": "ddp", "rank": r, "step": s, "local_loss": 1.0, "step_time_s": 0.05, "tokens": 8,
         "tokens_per_s": 160.0, "time_data_s": 0.001, "time_forward_s": 0.01, "time_backward_s": 0.02,
         "time_optimizer_s": 0.003, "busy_s": 0.02, "idle_s": 0.014, "cpu_wait_s": 0.005}
        for s in range(4) for r in (0, 1)), 0))

    def shown(width):
        console = Console(width=width, record=True)
        console.print(render(st, None, width))
        return console.export_text()

    narrow = shown(30)
    header = narrow.splitlines()[0].split()
    assert header == ["rank", "busy", "idle", "wait"], narrow
    words = " ".join(narrow.split())
    assert "…" not in narrow and "5.0" in narrow and "left out at this width" in words
    assert "waited for a core 20% of its ready time" in words
    wide = shown(120)
    assert wide.splitlines()[0].split() == list(COLUMNS) and "left out" not in wide


def test_timing_figures_that_are_not_finite_numbers_are_left_out():
    """Step records are read from a run directory: a string, a bool or a NaN in a timing field is not timing
    (the fold neither crashes nor shows it); the numbers beside it are kept."""
    from shardscope.analysis import straggler_report
    from shardscope.profiling.state import RecordsArrived, RunState

    st = RunState("ddp", "ddp", 2, 6)
    recs = [{"kind": "step", "run": "ddp", "rank": r, "step": s, "local_loss": 1.0, "step_time_s": 0.05, "tokens": 8,
             "tokens_per_s": 160.0, "busy_s": 0.02 if r == 0 else "evil", "time_forward_s": 0.01,
             "cpu_wait_s": float("nan") if r == 0 else True} for s in range(4) for r in (0, 1)]
    st.apply(RecordsArrived("ddp", tuple(recs), 0))
    per_rank = straggler_report.section({"ddp": st})["ddp"]["per_rank"]
    assert per_rank["0"]["busy_s"] == 0.02 and per_rank["1"]["busy_s"] is None
    assert per_rank["0"]["cpu_wait_s"] is None and per_rank["1"]["cpu_wait_s"] is None
    assert per_rank["1"]["time_forward_s"] == 0.01
