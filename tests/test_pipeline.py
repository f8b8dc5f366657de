"""Pipeline parallelism (issue 46): the stage split, the bubble's theory against a hand count of the action grid,
the checks before the start, and every schedule end to end on gloo against DDP — loss parity, point-to-point
bytes counted in the rank against theory, per-stage model states exact, the bubble measured per rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardscope import config
from shardscope.config import ModelSpec, RunSpec
from shardscope.core import pipeline_layout as pl
from shardscope.profiling import comm_theory, memory_model, pipeline_model

MODEL = ModelSpec(vocab_size=128, d_model=32, n_layers=4, n_heads=4, d_ff=64, seq_len=16)


def _comparison(*runs: RunSpec, ws: int = 2, **kw) -> config.Comparison:
    c = config.Comparison(name="t", model=MODEL, runs=list(runs), world_size=ws, global_batch=kw.pop("global_batch", 8),
                          profile=config.ProfileSpec(enabled=False), **kw)
    return config.validate(c)


# --- the split -------------------------------------------------------------------------------------------------

def test_split_is_contiguous_and_minimises_the_largest_stage():
    assert pl.split([5, 1, 1, 1, 1, 5], 2) == [(0, 3), (3, 6)]
    assert pl.split([10, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]  # a big embedding alone on the first stage
    assert pl.split([1, 1, 1, 1], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for sizes in ([3, 1, 4, 1, 5, 9, 2, 6], [1] * 7, [100, 1, 1, 100]):
        for n in range(1, len(sizes) + 1):
            ranges = pl.split(sizes, n)
            assert ranges[0][0] == 0 and ranges[-1][1] == len(sizes)
            assert all(a < b for a, b in ranges) and all(ranges[i][1] == ranges[i + 1][0] for i in range(n - 1))
            worst = max(sum(sizes[a:b]) for a, b in ranges)
            # no contiguous split does better: brute force over every cut
            import itertools
            best = min(max(sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, len(sizes))))
                       for cuts in itertools.combinations(range(1, len(sizes)), n - 1))
            assert worst == best
    with pytest.raises(ValueError, match="3 units cannot fill 4 stages"):
        pl.split([1, 1, 1], 4)


def test_units_put_root_parameters_before_the_blocks_in_the_embeddings_and_after_them_in_the_head():
    params = memory_model.model_params(MODEL)
    units = pl.units_of([(p.name, p.numel) for p in params])
    assert [u.name for u in units] == ["embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    assert units[0].numel == 128 * 32 + 16 * 32  # token and position embeddings
    assert units[-1].numel == 2 * 32 + 32 * 128  # final norm, untied head
    assert sum(u.numel for u in units) == sum(p.numel for p in params)


def test_stages_loop_over_the_ranks():
    assert pl.stages_of(0, 2, 2) == [0, 2] and pl.stages_of(1, 2, 2) == [1, 3]
    assert pl.stages_of(3, 4, 1) == [3]


# --- the bubble's theory ---------------------------------------------------------------------------------------

def _gpipe_grid(p: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    return {r: [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(p)}


def _one_f_one_b_grid(p: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    grid = {}
    for r in range(p):
        warm = min(m, p - r)
        acts = [("F", r, i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            acts.append(("B", r, b))
            b += 1
            if f < m:
                acts.append(("F", r, f))
                f += 1
        grid[r] = acts
    return grid


@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 8), (3, 5)])
def test_the_formula_equals_a_hand_count_of_the_action_grid(p, m):
    """GPipe's and 1F1B's grids (written out here, not read from torch), simulated action by action with a
    backward twice a forward: idle share = (p − 1)/(m + p − 1), as the formula says."""
    stage_rank = {s: s for s in range(p)}
    for grid in (_gpipe_grid(p, m), _one_f_one_b_grid(p, m)):
        assert pl.grid_bubble(grid, stage_rank) == pytest.approx(pl.bubble_theory("gpipe", p, m))
    assert pl.bubble_theory("1f1b", p, m) == pl.bubble_theory("gpipe", p, m) == (p - 1) / (m + p - 1)
    assert pl.bubble_theory("interleaved-1f1b", p, m, 2) == (p - 1) / (2 * m + p - 1)
    assert pl.bubble_theory("zero-bubble", p, m, 2) is None  # from its own grid


def test_a_grid_that_cannot_complete_is_an_error_not_a_hang():
    with pytest.raises(ValueError, match="cannot complete"):
        pl.grid_bubble({0: [("B", 0, 0)], 1: [("F", 1, 0)]}, {0: 0, 1: 1})


def test_held_activations_per_schedule():
    assert pipeline_model.held_chunks("gpipe", 4, 8, 1, 0) == 8
    assert [pipeline_model.held_chunks("1f1b", 4, 8, 1, r) for r in range(4)] == [4, 3, 2, 1]
    assert pipeline_model.held_chunks("1f1b", 4, 2, 1, 0) == 2
    assert pipeline_model.held_chunks("interleaved-1f1b", 2, 4, 2, 0) == min(8, 2 + 2 + 1)


# --- the models ------------------------------------------------------------------------------------------------

def test_each_rank_is_predicted_the_states_of_its_own_stages():
    c = _comparison(RunSpec("g", "pp-gpipe", options={"pp": 2}), RunSpec("i", "pp-interleaved", options={"pp": 2}))
    params = memory_model.model_params(MODEL)
    for run in c.runs:
        layout = memory_model.layout_for(c, run)
        assert (layout.pp, layout.dp) == (2, 1)
        held = [pipeline_model.rank_params(params, 2, layout.v, r) for r in range(2)]
        assert sorted(p.name for h in held for p in h) == sorted(p.name for p in params)  # each exactly once
        for r in range(2):
            states = memory_model.model_state_bytes(params, layout, pp_rank=r)
            n = sum(p.numel for p in held[r])
            assert states["param_bytes"] == 4 * n and states["grad_bytes"] == 4 * n
            assert states["optim_bytes"] == 8 * n + 4 * len(held[r])


def test_point_to_point_theory_counts_every_boundary_both_ways():
    for strategy, pp, v, ws in (("pp-gpipe", 2, 1, 2), ("pp-1f1b", 4, 1, 4), ("pp-zero-bubble", 2, 2, 2),
                                ("pp-1f1b", 2, 1, 4)):
        c = _comparison(RunSpec("r", strategy, options={"pp": pp}), ws=ws)
        spec = config.run_spec_payload(c, c.runs[0], out_dir="/tmp/x", device="cpu")
        theory = comm_theory.expected_comm(spec)
        dp = ws // pp
        chunk = 8 // dp // 4
        boundary = chunk * 16 * 32 * 4
        assert theory["by_type"]["send"] == theory["by_type"]["recv"] == 2 * (pp * v - 1) * 4 * boundary / pp
        assert spec["run"]["pp"] == pp and spec["run"]["dp"] == dp


@pytest.mark.parametrize("run, message", [
    (RunSpec("r", "pp-gpipe", precision="fp16"), "precision = 'fp16': pipeline schedules run fp32 or bf16-autocast"),
    (RunSpec("r", "pp-gpipe", options={"microbatches": 3}), "options.microbatches = 3: must divide each pipeline's batch"),
    (RunSpec("r", "pp-interleaved", options={"microbatches": 4, "pp": 4}, world_size=4), None),
    (RunSpec("r", "pp-interleaved", options={"microbatches": 1}), "need a multiple of pp = 2"),
    (RunSpec("r", "pp-gpipe", options={"pp": 4}), "world_size 2 is not dp x pp with options.pp = 4"),
    (RunSpec("r", "pp-gpipe", activation_checkpointing=True), "activation_checkpointing = true: not built"),
    (RunSpec("r", "pp-1f1b", options={"stages_per_rank": 2}), "stages_per_rank = 2: allowed: one of 1"),
    (RunSpec("r", "pp-1f1b", options={"dp_shard": "fsdp2"}), "options.dp_shard = 'fsdp2': one pipeline"),
    (RunSpec("r", "pp-1f1b", options={"dp_shard": "zero"}), "dp_shard = 'zero': allowed: one of"),
])
def test_what_cannot_be_built_is_refused_before_the_start(run, message):
    if message is None:  # 4 x 2 = 8 stages but 6 units
        message = "8 stages, but the model has 6 units"
    with pytest.raises(config.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _comparison(run, ws=4 if run.world_size == 4 else 2)


# --- end to end ----------------------------------------------------------------------------------------------

PRESET = """
description = "pipeline schedules against ddp"
steps = 5
global_batch = 8
lr = 3e-3
warmup_steps = 1
precision = "fp32"
world_size = 2
seed = 7
loss_tolerance = 1e-5
stall_timeout_s = 120
parity = true

[model]
kind = "transformer"
vocab_size = 128
d_model = 32
n_layers = 4
n_heads = 4
d_ff = 64
seq_len = 16

[profile]
start_step = 2
steps = 1
count_collectives = true

[[runs]]
name = "ddp"
strategy = "ddp"
"""
RUNS = {"gpipe": ("pp-gpipe", "", 2), "1f1b": ("pp-1f1b", "", 2), "interleaved": ("pp-interleaved", "", 2),
        "zb": ("pp-zero-bubble", "", 2), "1f1b-2x2": ("pp-1f1b", "", 4),
        "zb-fsdp2-2x2": ("pp-zero-bubble", 'options = { dp_shard = "fsdp2" }', 4)}
SHARDED = ("zb-fsdp2-2x2",)  # FSDP2 on each stage across the two pipelines


@pytest.fixture(scope="module")
def comparison(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    tmp = tmp_path_factory.mktemp("pipeline")
    text = PRESET + "".join(f'\n[[runs]]\nname = "{n}"\nstrategy = "{s}"\nworld_size = {ws}\n{o}\n'
                            for n, (s, o, ws) in RUNS.items())
    (tmp / "p.toml").write_text(text, encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "run", "--preset", str(tmp / "p.toml"), "--headless",
                           "--out", str(tmp / "out")], capture_output=True, text=True, timeout=1500, cwd=tmp)
    return proc, tmp / "out"


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text(encoding="utf-8"))


@pytest.mark.slow
@pytest.mark.floor
def test_every_schedule_trains_like_ddp(comparison):
    proc, out = comparison
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    runs = {r["name"]: r for r in _summary(out)["runs"]}
    for name in RUNS:
        assert runs[name]["status"] == "ok", runs[name].get("error")
        assert runs[name]["loss_max_abs_diff"] <= 1e-5, name
        assert runs[name]["loss_steps_compared"] == 5


@pytest.mark.slow
@pytest.mark.floor
def test_point_to_point_bytes_counted_in_the_rank_equal_the_theory(comparison):
    out = comparison[1]
    summary = _summary(out)
    for name in RUNS:
        comm = summary["communication"]["runs"][name]
        counted = []
        for f in sorted(os.listdir(out / name / "metrics")):
            lines = (out / name / "metrics" / f).read_text(encoding="utf-8").splitlines()
            counted.append([json.loads(x) for x in lines if '"comm"' in x][-1]["collectives"])
        theory = comm["theory"]["by_type"]
        kinds = ("send", "recv", "all_reduce") + (("all_gather", "reduce_scatter") if name in SHARDED else ())
        assert set(theory) == set(kinds), (name, theory)
        for kind in kinds:
            mean = sum(rank[kind]["bytes_per_step"] for rank in counted) / len(counted)
            assert mean == pytest.approx(theory[kind], rel=1e-12), (name, kind)  # the in-rank count
            assert comm["collectives"][kind]["bytes_per_step"] == pytest.approx(theory[kind], rel=1e-12), (name, kind)
        assert comm["theory"]["ratio"] == pytest.approx(1.0, abs=1e-12)


@pytest.mark.slow
@pytest.mark.floor
def test_each_rank_holds_exactly_the_predicted_states_of_its_stages(comparison):
    summary = _summary(comparison[1])
    for name in RUNS:
        per_rank = summary["memory"]["runs"][name]["per_rank"]
        assert len(per_rank) == RUNS[name][2]
        for rank, row in per_rank.items():
            for key in ("param_bytes", "grad_bytes", "optim_bytes", "model_state_bytes"):
                assert row["predicted"][key] == row["measured"][key], (name, rank, key)
        sizes = {row["measured"]["param_bytes"] for row in per_rank.values()}
        full = summary["memory"]["runs"]["ddp"]["per_rank"]["0"]["measured"]["param_bytes"]
        assert max(sizes) < (full / 3 if name in SHARDED else full)  # split, not replicated; and sharded


@pytest.mark.slow
@pytest.mark.floor
def test_the_bubble_is_measured_per_rank_beside_its_theory(comparison):
    proc, out = comparison
    runs = {r["name"]: r for r in _summary(out)["runs"]}
    assert "ddp" in runs and "pipeline" not in runs["ddp"]
    expected = {"gpipe": 1 / 5, "1f1b": 1 / 5, "interleaved": 1 / 9, "1f1b-2x2": 1 / 5}  # the rest: zero bubble
    for name in RUNS:
        p = runs[name]["pipeline"]
        assert 0.0 <= p["bubble_measured"] <= 1.0 and len(p["bubble_by_rank"]) == RUNS[name][2]
        if name in expected:
            assert p["bubble_theory"] == pytest.approx(expected[name])
        else:  # zero bubble: from torch's own grid, below interleaved 1F1B's
            assert 0.0 <= p["bubble_theory"] < 1 / 9
    assert "pipeline: the bubble" in proc.stdout


@pytest.mark.slow
def test_every_command_reads_a_pipeline_comparison(comparison):
    out = comparison[1]
    for args in (["report", str(out)], ["explain", "pp-zero-bubble", str(out)], ["recommend", str(out)],
                 ["estimate", "--preset", str(out.parent / "p.toml"), "-n", "4"]):
        proc = subprocess.run([sys.executable, "-m", "shardscope.cli", *args], capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode in (0, 1), (args, proc.stdout[-2000:], proc.stderr[-2000:])
        assert "Traceback" not in proc.stdout + proc.stderr, args
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "bubble" in report


def test_the_bubble_folds_from_step_records_and_reaches_the_screens():
    """A crafted run's records: pp_bubble per rank per step (steps after the first, outside the profiler), the
    timeline checked; the summary entry, the headless text, the app's rank timing and report.md read it."""
    from rich.console import Console

    from shardscope.analysis import markdown
    from shardscope.profiling import bubble
    from shardscope.profiling.state import RunState
    from shardscope.tui.widgets.rank_timing import render

    st = RunState("g", world_size=2)
    notes = {"schedule": "gpipe", "pp": 2, "microbatches": 4, "stages_per_rank": 1, "bubble_theory": 0.2,
             "bubble_formula": pl.FORMULAS["gpipe"]}
    for rank in (0, 1):
        st.apply_record({"kind": "start", "rank": rank, "run": "g", "t": 1.0, "notes": notes})
        for step, value in ((0, 0.9), (1, 0.3), (2, 0.5), (3, 0.4), (4, "soon")):
            st.apply_record({"kind": "step", "rank": rank, "run": "g", "t": 2.0 + step, "step": step,
                             "local_loss": 1.0, "grad_norm": 1.0, "step_time_s": 0.01, "busy_s": 0.005,
                             "pp_bubble": value + 0.1 * rank if isinstance(value, float) else value,
                             **({"pp_timeline": [["F", rank, 0, 0.0, 1.0], ["B", rank, 0, 2.0, 4.0]]} if step == 1
                                else {})})
    entry = bubble.pipeline_entry(st.bubble, notes)
    assert entry["bubble_by_rank"] == {"0": pytest.approx(0.4), "1": pytest.approx(0.5)}  # step 0 and "soon" out
    assert entry["bubble_measured"] == pytest.approx(0.45) and entry["bubble_theory"] == 0.2
    assert set(entry["timeline"]) == {"0", "1"}
    assert bubble.bubble_text(entry) == "45.0% (theory 20.0%)"
    console = Console(width=100, record=True)
    console.print(render(st, None, 100))
    assert "bubble by rank: 0 40% · 1 50% (theory 20%: (p−1)/(m+p−1))" in console.export_text()
    summary = {"runs": [{"name": "g", "pipeline": entry}]}
    assert "| g | gpipe | 2 × 1 | 4 | 45.0% | 20.0% | 40.0% 50.0% |" in markdown._pipeline_md(summary)
    assert bubble.timeline_of([["F", 0, 0, 1.0, 0.5]]) is None  # ends before it starts
    assert bubble.timeline_of([["X", 0, 0, 0.0, 1.0]]) is None and bubble.timeline_of("F") is None
    ideal = bubble.ideal_timeline(entry["timeline"] and {0: [["F", 0, 0, 0.0, 1.0], ["B", 0, 0, 2.0, 4.0]],
                                                         1: [["F", 1, 0, 0.0, 1.0], ["B", 1, 0, 2.0, 4.0]]})
    assert ideal[1] == [["F", 1, 0, 1.0, 2.0], ["B", 1, 0, 2.0, 4.0]] and ideal[0][1] == ["B", 0, 0, 4.0, 6.0]
