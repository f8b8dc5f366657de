"""Hybrid sharding (FSDP1 HYBRID_SHARD, FSDP2 HSDP) in the memory model, the theory and the explainer, and
a report that cannot be written whole: null figures with their reasons, and a failing exit code."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from shardscope import config
from shardscope.core import registry
from shardscope.config import ModelSpec, RunSpec
from shardscope.analysis import explain, report
from shardscope.profiling import memory_model
from shardscope.cli.report_commands import report_cmd
from tests.test_report_regenerate import make_run_dir
from tests.test_traces import HYBRID_GROUPS, OTHER_T, _exec, _list_op, _x, write_trace

MODEL = ModelSpec(vocab_size=128, d_model=32, n_layers=2, n_heads=4, d_ff=64, seq_len=16)
HYBRID = {"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 2}


def _comparison(*runs: RunSpec, ws: int = 4) -> config.Comparison:
    c = config.Comparison(name="t", model=MODEL, runs=list(runs), world_size=ws, global_batch=8,
                          profile=config.ProfileSpec(enabled=False))
    return config.validate(c)


def test_hybrid_groups_from_the_registry():
    fsdp1, fsdp2 = registry.get("fsdp1").hybrid, registry.get("fsdp2").hybrid
    assert fsdp1.groups(HYBRID, 4, 4) == (2, 2)
    assert fsdp1.groups({"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 0}, 8, 4) == (2, 4)  # a node's ranks
    assert fsdp1.groups({"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 0}, 2, 2) == (1, 2)
    assert fsdp1.groups({"sharding_strategy": "FULL_SHARD", "hybrid_shard_size": 2}, 4, 4) is None
    assert fsdp2.groups({"replicate": 2}, 4, 4) == (2, 2) and fsdp2.groups({"replicate": 1}, 4, 4) is None
    with pytest.raises(ValueError, match="^HYBRID_SHARD: shard group size 3 must divide the 4 data-parallel ranks"):
        fsdp1.groups({"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 3}, 4, 4)
    with pytest.raises(ValueError, match="^HSDP with a shard group of 1 rank"):
        fsdp2.groups({"replicate": 4}, 4, 4)
    with pytest.raises(config.ConfigError, match="replicate = 0: allowed: an integer >= 1"):
        _comparison(RunSpec("h", "fsdp2", options={"replicate": 0}))


@pytest.mark.parametrize("strategy, options", [("fsdp1", HYBRID), ("fsdp2", {"replicate": 2})])
def test_hybrid_states_are_sharded_over_the_shard_group(strategy, options):
    """At 4 ranks in 2 replicas of a shard group of 2, every rank holds what a rank of a 2-rank run holds."""
    plain = {"fsdp1": {"sharding_strategy": "FULL_SHARD"}, "fsdp2": {}}[strategy]
    c4 = _comparison(RunSpec("h", strategy, options=options))
    c2 = _comparison(RunSpec("f", strategy, options=plain), ws=2)
    params = memory_model.model_params(MODEL)
    layout = memory_model.layout_for(c4, c4.runs[0])
    assert (layout.dp, layout.shard_size, layout.hybrid) == (4, 2, True)
    for rank in range(4):
        assert (memory_model.model_state_bytes(params, layout, rank)
                == memory_model.model_state_bytes(params, memory_model.layout_for(c2, c2.runs[0]), rank % 2))
    predicted = memory_model.predict_run(c4, c4.runs[0])
    assert (predicted["shard_group"], predicted["replicas"]) == (2, 2)
    # Tables (report.md, estimate) say how the 4 data-parallel ranks split, not "4×1" as if sharded over all.
    assert memory_model.layout_label(predicted) == "4×1 (2-way shard × 2 replicas)"
    assert memory_model.layout_label(memory_model.predict_run(c2, c2.runs[0])) == "2×1"


def test_fsdp1_views_leave_padding_and_untouched_tensors_out():
    """FSDP1 with use_orig_params: a rank holds optimizer state only for the tensors its shard slices."""
    sizes = [5, 3, 8]  # offsets 0-5, 8-11 (aligned to 4), 12-20; 3 ranks: chunks of 7 (the last one padded)
    assert memory_model.flat_offsets(sizes, 4) == [(0, 5), (8, 11), (12, 20)]
    assert [memory_model.flat_views(sizes, 3, r, 4) for r in range(3)] == [(5, 1), (3 + 2, 2), (6, 1)]


def test_hybrid_explainer_names_the_shard_group_and_replicas():
    c = _comparison(RunSpec("h", "fsdp1", options=HYBRID))
    out = explain.explain_preset(c, "fsdp1")
    assert "hybrid: 2 replica(s) of a shard group of 2 ranks (4 data-parallel ranks)" in out["text"]
    assert "N = 2 ranks of a shard group, replicated 2 time(s)" in out["text"]
    assert out["numbers"]["shard_group"] == 2 and out["numbers"]["comm_bytes_predicted"]
    full = out["numbers"]["full"]
    formula = sum(full[k] for k in ("param_bytes", "grad_bytes", "optim_bytes")) / 2
    assert formula == pytest.approx(out["numbers"]["model_state_bytes_predicted"], rel=2e-3)
    plain = explain.explain_preset(_comparison(RunSpec("f", "fsdp1")), "fsdp1")["text"]
    assert "This run: no hybrid sharding: states split over all 4 data-parallel rank(s)." in plain


def test_unknown_sizes_are_null_in_the_summary_and_not_measured_in_the_report(tmp_path):
    out = make_run_dir(tmp_path)
    events = [_x("ProfilerStep#1", 0, 1000, cat="user_annotation"),
              _list_op("c10d::allgather_", 10, [[], [[100]], [], [], []]), _exec("all_gather", 20, 50, OTHER_T, [[100]])]
    for rank in (0, 1):
        write_trace(out / "fsdp2" / "traces" / f"rank{rank}.trace.json", events, rank=rank, world=4,
                    groups=HYBRID_GROUPS)
    paths = report.write_reports(str(out))
    assert not paths.failed and "report" in paths
    comm = json.loads((out / "summary.json").read_text())["communication"]["runs"]["fsdp2"]
    row = comm["collectives"]["all_gather"]
    assert row["bytes_per_step"] is None and row["algbw_GBps"] is None and row["group_size"] is None
    assert comm["comm_bytes_per_step"] is None and "ratio" not in comm["theory"]
    assert "c10d::allgather_" in comm["note"]
    text = (out / "report.md").read_text()
    assert "fsdp2 all_gather bytes_per_step: not measured (size unknown for c10d::allgather_" in text


def test_a_report_that_fails_writes_the_core_summary_and_fails_the_command(tmp_path, monkeypatch, capsys):
    out = make_run_dir(tmp_path)

    def broken(*args):
        raise TypeError("unsupported operand type(s) for +=: 'int' and 'NoneType'")

    monkeypatch.setattr(report, "communication_section", broken)
    paths = report.write_reports(str(out))
    assert set(paths) == {"summary"} and paths.failed.startswith("full report failed (the communication section)")
    assert "shardscope: full report failed (the communication section), writing the core summary: TypeError(" in (
        capsys.readouterr().err)
    data = json.loads((out / "summary.json").read_text())
    assert {r["name"] for r in data["runs"]} == {"ddp", "fsdp2"} and "communication" not in data
    result = CliRunner().invoke(report_cmd, [str(out)])
    assert result.exit_code == 1, result.output
    assert "summary: " in result.output and "the communication section" in result.output
    monkeypatch.undo()
    assert CliRunner().invoke(report_cmd, [str(out)]).exit_code == 0


def test_layout_dataclass_keeps_its_positional_fields():
    """Older callers build a Layout positionally; the hybrid fields come last, defaulting to no hybrid."""
    layout = memory_model.Layout(4, 1, 4, "all", "fp32", False, False)
    assert layout.shard_size == 4 and not layout.hybrid
    assert dataclasses.replace(layout, shard_group=2).shard_size == 2
