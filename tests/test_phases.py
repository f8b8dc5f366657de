"""The step phase by phase: theory split over forward/backward/step, the profiled step's collectives put in
their phase and layer, and the text picture of it."""

from __future__ import annotations

import pytest
from test_traces import GLOO, _x, write_trace

from shardscope import config
from shardscope.core import registry
from shardscope.profiling import comm_theory, phases
from shardscope.analysis import explain


@pytest.mark.parametrize("preset", ["ddp-vs-fsdp", "tp-verification", "zero-stages"])
def test_theory_phases_add_up_to_the_theory(preset):
    c = config.load_preset(preset)
    for name in registry.names():
        run, _ = explain.pick_run(c, name)
        theory = comm_theory.expected_comm(config.run_spec_payload(c, run, out_dir=".", device="cpu"))
        rows = phases.theory_phases(c, run, theory)
        for kind, total in theory["by_type"].items():
            split = sum(r["bytes"] for r in rows if r["type"] == kind and r["bytes"] is not None)
            assert split == pytest.approx(total), (preset, name, kind)
        for r in rows:
            assert r["phase"] in phases.PHASES


def test_fsdp_forward_gathers_one_unit_per_block_and_the_root():
    c = config.load_preset("ddp-vs-fsdp")
    run, _ = explain.pick_run(c, "fsdp2")
    theory = comm_theory.expected_comm(config.run_spec_payload(c, run, out_dir=".", device="cpu"))
    rows = {(r["phase"], r["type"]): r for r in phases.theory_phases(c, run, theory)}
    assert rows[("forward", "all_gather")]["count"] == c.model.n_layers + 1
    assert rows[("backward", "reduce_scatter")]["count"] == c.model.n_layers + 1
    no_reshard = config.load_preset("ddp-vs-fsdp", [f"runs.{run.name}.options.reshard_after_forward=false"])
    run2, _ = explain.pick_run(no_reshard, "fsdp2")
    theory2 = comm_theory.expected_comm(config.run_spec_payload(no_reshard, run2, out_dir=".", device="cpu"))
    assert ("backward", "all_gather") not in {(r["phase"], r["type"]) for r in phases.theory_phases(no_reshard, run2, theory2)}


def _gather(ts, numel):
    return [_x("c10d::_allgather_base_", ts, 5, args={"Input Dims": [[numel * 2], [numel], [], [], []],
                                                      "Input type": ["float", "float", "", "Scalar", "Scalar"]}),
            _x("gloo:all_gather", ts + 10, 40, cat="user_annotation", tid=GLOO)]


def _step_events(marked: bool) -> list[dict]:
    ev = [_x("ProfilerStep#7", 0, 1000, cat="user_annotation")]
    if marked:
        ev += [_x("shardscope.forward", 10, 290, cat="user_annotation"),
               _x("shardscope.backward", 310, 400, cat="user_annotation")]
    else:
        ev += [_x("autograd::engine::evaluate_function: MmBackward0", 310, 200),
               _x("FSDP::post_backward_reduce (layers.0)", 600, 100, cat="user_annotation")]
    ev += [_x("FSDP::all_gather (layers.0)", 20, 60, cat="user_annotation"), *_gather(25, 100),
           _x("FSDP::all_gather (layers.1)", 100, 60, cat="user_annotation"), *_gather(105, 50),
           _x("FSDP::post_backward_reduce (layers.0)", 600, 100, cat="user_annotation"),
           _x("c10d::_reduce_scatter_base_", 610, 5, args={"Input Dims": [[100], [200], [], [], [], []],
                                                           "Input type": ["float", "float", "", "", "Scalar", "Scalar"]}),
           _x("gloo:all_reduce", 620, 50, cat="user_annotation", tid=GLOO),
           _x("c10d::allreduce_", 800, 5, args={"Input Dims": [[[1]], [], [], [], [], []],
                                                "Input type": ["TensorList", "", "", "", "Scalar", "Scalar"]}),
           _x("gloo:all_reduce", 810, 20, cat="user_annotation", tid=GLOO, args={"Input Dims": [[1]], "Input type": ["float"]})]
    return ev


@pytest.mark.parametrize("marked", [True, False])
def test_measured_collectives_get_their_phase_and_layer(tmp_path, marked):
    path = write_trace(tmp_path / "rank0.trace.json", _step_events(marked))
    m = phases.measured_phases(str(path))
    assert m["step"] == 7 and m["marked"] is marked
    got = [(e["phase"], e["type"], e["layer"], e["bytes"]) for e in m["events"]]
    assert got == [("forward", "all_gather", "layers.0", 800), ("forward", "all_gather", "layers.1", 400),
                   ("backward", "reduce_scatter", "layers.0", 800), ("step", "all_reduce", None, 4)]
    rows = {(r["phase"], r["type"]): r for r in m["rows"]}
    assert rows[("forward", "all_gather")]["count"] == 2 and rows[("forward", "all_gather")]["bytes"] == 1200
    picture = phases.timeline(m, width=40)
    lines = picture.splitlines()
    assert lines[1].startswith("phase") and "F" in lines[1] and "B" in lines[1] and "S" in lines[1]
    ag_row = next(line for line in lines if line.startswith("all_gather "))
    bar = ag_row.split("|")[1]
    assert bar.count("G") >= 2 and bar.index("G") < 5  # forward, early in the 1 ms step
    assert "layers.1" in picture and "800 B" in picture


def test_sequence_lines_say_not_measured_with_the_reason():
    theory = [{"phase": "forward", "type": "all_gather", "count": 3, "bytes": 300.0, "bytes_each": 100.0, "what": "w"}]
    lines = phases.sequence_lines(theory, {"why": "trace unreadable (x)"}, "unused")
    assert lines == ["- **forward**: 3 all-gathers = 300 B (mean 100 B) predicted (w); not measured (trace unreadable (x))"]
    measured = {"rows": [{"phase": "backward", "type": "reduce_scatter", "count": 1, "bytes": 64, "bytes_each": 64.0}]}
    lines = phases.sequence_lines(theory, measured, "unused")
    assert lines[0].endswith("; none measured")
    assert lines[1] == "- **backward**: no reduce-scatter predicted; measured 1 reduce-scatter = 64 B"


def test_a_collective_of_unknown_size_leaves_its_row_not_measured(tmp_path):
    """A tensor-list all-gather whose group the trace cannot tell (groups of sizes 4, 2, 2, and a thread that
    ran nothing else): its row's bytes are None, never a partial sum, and the sequence says why."""
    from test_traces import HYBRID_GROUPS, OTHER_T, _exec, _list_op

    events = [_x("ProfilerStep#2", 0, 1000, cat="user_annotation"),
              _x("shardscope.forward", 5, 290, cat="user_annotation"),
              _list_op("c10d::allgather_", 10, [[], [[100]], [], [], []]), _exec("all_gather", 20, 50, OTHER_T, [[100]]),
              _list_op("c10d::allgather_", 100, [[], [[100]], [], [], []]), _exec("all_gather", 110, 50, OTHER_T, [[100]])]
    path = write_trace(tmp_path / "rank0.trace.json", events, world=4, groups=HYBRID_GROUPS)
    m = phases.measured_phases(str(path))
    row = m["rows"][0]
    assert (row["phase"], row["count"], row["bytes"], row["bytes_each"]) == ("forward", 2, None, None)
    theory = [{"phase": "forward", "type": "all_gather", "count": 2, "bytes": 800.0, "bytes_each": 400.0, "what": "w"}]
    line = phases.sequence_lines(theory, m, "unused")[0]
    assert line.endswith("measured 2 all-gathers, bytes not measured (size unknown: the trace records neither its "
                         "buffers nor its group)")


@pytest.mark.parametrize("strategy, options", [
    ("fsdp1", {"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 2}),
    ("fsdp2", {"replicate": 2}),
])
def test_hybrid_sharding_adds_the_replica_all_reduce_in_backward(strategy, options):
    c = config.load_preset("ddp-vs-fsdp", ["world_size=4"])
    run = config.RunSpec("h", strategy, options=options)
    theory = comm_theory.expected_comm(config.run_spec_payload(c, run, out_dir=".", device="cpu"))
    rows = phases.theory_phases(c, run, theory)
    for kind, total in theory["by_type"].items():
        assert sum(r["bytes"] for r in rows if r["type"] == kind and r["bytes"] is not None) == pytest.approx(total)
    reduce = next(r for r in rows if (r["phase"], r["type"]) == ("backward", "all_reduce"))
    assert reduce["count"] == c.model.n_layers + 1 and "2 replica(s)" in reduce["what"]
    assert reduce["bytes"] == theory["by_type"]["reduce_scatter"] / 2
