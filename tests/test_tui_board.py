"""The app's board and knob rules, without the app."""

from __future__ import annotations

from shardscope.config import load_preset
from shardscope.profiling import state as st
from shardscope.tui.board import Board, Console
from shardscope.tui.screens.knobs import overrides, route_error, without_source
from shardscope.tui.widgets.charts import loss_diff, thin
from shardscope.tui.widgets.comm_panel import collectives


def _step(run: str, step: int, loss: float) -> dict:
    return {"v": 1, "kind": "step", "run": run, "rank": 0, "t": 100.0 + step, "step": step, "loss": loss,
            "tokens_per_s": 10.0}


def test_board_folds_and_marks_dirty():
    board = Board()
    board.ingest([st.RunDefined("a", "ddp", 2, 5, "fp32", {}, "/x/a"),
                  st.RecordsArrived("a", (_step("a", 0, 2.0), _step("a", 1, 1.5))),
                  st.ConsoleText("a", "hello\nwor"), st.ConsoleText("a", "ld\n")])
    assert board.records == 2 and board.baseline == "a"
    assert board.states["a"].steps_completed == 2 and board.dirty_charts and "a" in board.dirty_runs
    assert list(board.console("a").lines) == ["hello", "world"]


def test_restart_starts_a_fresh_history():
    board = Board()
    board.ingest([st.RunDefined("a", "ddp", 2, 5, "fp32", {"x": 1}, "/x/a"), st.StatusChanged("a", st.STARTING),
                  st.RecordsArrived("a", (_step("a", 0, 2.0), _step("a", 1, 1.5))), st.StatusChanged("a", st.STOPPED)])
    board.ingest([st.StatusChanged("a", st.QUEUED), st.StatusChanged("a", st.STARTING),
                  st.RecordsArrived("a", (_step("a", 0, 2.0),))])
    state = board.states["a"]
    assert state.losses == [(0, 2.0)] and state.options == {"x": 1} and state.status == st.RUNNING
    assert "── restarted ──" in board.console("a").lines


def test_console_since_counts_dropped_lines():
    console = Console()
    console.add("a\nb\n")
    seen = console.total
    console.add("c\n")
    assert console.since(seen) == ["c"] and console.since(0) == ["a", "b", "c"]


def test_knob_overrides_and_error_routing():
    base = load_preset("smoke")
    values = {"steps": "12", "world_size": "2", "model.d_model": "x", "model.n_layers": "2", "precision": "bf16-autocast",
              "baseline": "ddp"}
    sets, errors = overrides(base, values)
    assert sets == ["steps=12", 'precision="bf16-autocast"']
    assert errors == {"model.d_model": "model.d_model = 'x': expected an integer"}
    assert route_error("model.n_heads = 4: must divide model.d_model = 30") == "model.d_model"
    assert route_error("global_batch = 8: must be divisible by dp (3) x grad_accum (1) for run ddp") == "world_size"
    assert route_error("steps = 0: must be > 0") == "steps"
    assert route_error("profile.steps = -1: must be >= 0") == ""
    assert without_source("/a/b/smoke.toml: steps = 0: must be > 0") == "steps = 0: must be > 0"


def test_chart_helpers():
    pts = [(i, float(i)) for i in range(1000)]
    thinned = thin(pts, 100)
    assert len(thinned) == 100 and thinned[-1] == (999, 999.0)
    a, b = st.RunState("a"), st.RunState("b")
    a.losses, b.losses = [(0, 2.0), (1, 1.0)], [(0, 2.5), (2, 1.0)]
    assert loss_diff(b, a) == [(0, 0.5)]


def test_collectives_read_both_record_shapes():
    record = {"collectives": {"all_reduce": {"count": 2, "time_s": 0.5, "bytes": 10}}}
    analysis = {"collectives": {"all_gather": {"count_per_step": 3.0, "time_per_step_s": 0.1, "bytes_per_step": 8.0},
                                "reduce_scatter": {"count_per_step": 1.0, "time_per_step_s": 0.2, "bytes_per_step": 4.0}}}
    assert collectives(record) == [("all_reduce", 0.5, 2, 10)]
    assert [c[0] for c in collectives(analysis)] == ["reduce_scatter", "all_gather"]
    assert collectives({"collectives": [{"op": "broadcast", "time_ms": 5}]}) == [("broadcast", 0.005, None, None)]
    assert collectives({"collectives": 3}) == []


def test_collectives_of_a_counted_window_are_per_step():
    """A ``comm`` record from ``profile.count_collectives`` (engines/comm_count.py) over a 2-step window:
    its ``count`` and ``size_bytes`` cover the window, the panel shows the per-step figures (no time)."""
    record = {"kind": "comm", "steps": [3, 4], "window_steps": 2,
              "collectives": {"all_reduce": {"count": 4, "size_bytes": 800, "count_per_step": 2.0,
                                             "bytes_per_step": 400.0}}}
    assert collectives(record) == [("all_reduce", None, 2.0, 400.0)]


def test_comm_panel_shows_observed_over_theory_and_says_when_it_cannot():
    from shardscope.tui.widgets.comm_panel import theory_text

    assert theory_text(None).plain == ""  # not analysed yet
    assert theory_text({"ratio": 1.0001, "bytes_per_step": 10}).plain == "1.00× th"
    assert theory_text({"ratio": 0.333}).style == "yellow"  # off the theory: flagged, not hidden
    assert theory_text({"error": "unknown strategy"}).plain == "th ?"  # never a made-up ratio


def test_console_pane_shows_the_launch_line_short():
    from shardscope.tui.format import short_command

    line = ("$ KINETO_LOG_LEVEL=6 OMP_NUM_THREADS=1 /venv/bin/python3 -m torch.distributed.run --nnodes 1 "
            "--nproc-per-node 2 -m shardscope.engines.worker /out/ddp/spec.json")
    assert short_command(line) == "$ torchrun --nnodes 1 --nproc-per-node 2 -m shardscope.engines.worker /out/ddp/spec.json"
    assert short_command("loss went up") == "loss went up"  # the ranks' own lines pass as they are
