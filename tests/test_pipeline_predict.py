"""`shardscope predict` for the pipeline schedules (issue 46): each schedule's action grid played out with its
stages' compute. Synthetic calibrations (no torchrun); the interleaved grids are read from torch in a subprocess."""

from __future__ import annotations

import pytest

from shardscope import config
from shardscope.analysis.predict import pipeline, predictor
from shardscope.analysis.predict.fit import CalibrationRun
from shardscope.analysis.predict.probe import probe_runs
from shardscope.analysis.predict.work import PIPELINE, work_of
from shardscope.config import RunSpec
from shardscope.core import pipeline_layout as pl

from test_predict import _model

MODEL = config.ModelSpec(kind="transformer", vocab_size=128, d_model=32, n_layers=4, n_heads=2, d_ff=64, seq_len=16)


def _comparison(*runs: RunSpec, ws: int = 4) -> config.Comparison:
    return config.validate(config.Comparison(name="t", model=MODEL, runs=list(runs), world_size=ws, global_batch=16,
                                             profile=config.ProfileSpec(enabled=False)))


@pytest.mark.parametrize("schedule, v", [("interleaved-1f1b", 2), ("zero-bubble", 2)])
def test_torchs_grid_holds_every_action_once_and_interleaved_equals_its_formula(schedule, v):
    """The grid read from torch's schedule object (engines/pipeline_grid, in a subprocess): every stage's forward
    and backward (or input and weight passes) of every micro-batch exactly once, on the rank holding that stage;
    played with equal costs, interleaved 1F1B's idle share is (p − 1)/(v·m + p − 1) and zero bubble's below it."""
    p, m = 2, 4
    grid = pipeline.grid(schedule, p, m, v)
    stage_rank = pl.stage_ranks(p * v, p)
    seen = sorted((k, s, i) for r, acts in grid.items() for k, s, i in acts if stage_rank[s] == r)
    assert len(seen) == sum(len(a) for a in grid.values())
    kinds = ("F", "B") if schedule == "interleaved-1f1b" else ("F", "I", "W")
    assert seen == sorted((k, s, i) for k in kinds for s in range(p * v) for i in range(m))
    formula = pl.bubble_theory("interleaved-1f1b", p, m, v)
    if schedule == "interleaved-1f1b":
        assert pl.grid_bubble(grid, stage_rank) == pytest.approx(formula)
    else:
        assert pl.grid_bubble(grid, stage_rank) < formula


def test_grids_read_together_are_the_grids_read_alone_from_one_torch_process(monkeypatch):
    """Tune and predict read every grid their pipeline runs need in one subprocess (each alone started torch anew):
    one process for three grids, the same grids as read alone, and nothing read again afterwards."""
    keys = [("interleaved-1f1b", 2, 4, 2), ("zero-bubble", 2, 4, 2), ("interleaved-1f1b", 2, 6, 2), ("1f1b", 2, 4, 1)]
    alone = {k: pipeline.grid(*k) for k in keys}
    monkeypatch.setattr(pipeline, "_READ", {})
    pipeline._grid_text.cache_clear()
    started = []
    real = pipeline.run_bounded

    def counted(argv, *args, **kwargs):
        started.append(argv)
        return real(argv, *args, **kwargs)

    monkeypatch.setattr(pipeline, "run_bounded", counted)
    pipeline.read_grids(keys)
    assert len(started) == 1 and started[0][-12:] == [str(x) for k in sorted(keys[:3]) for x in k]  # 1F1B: no torch
    assert {k: pipeline.grid(*k) for k in keys} == alone and len(started) == 1


def test_the_step_model_gives_the_formula_for_equal_stages_and_free_transfers():
    """Stages of equal compute, transfers and all-reduces costing nothing, no optimizer: the span is (m + p − 1)
    slots of forward + backward, the bubble (p − 1)/(m + p − 1) for GPipe and 1F1B."""
    p, m = 4, 8
    facts = {"schedule": "1f1b", "pp": p, "v": 1, "m": m, "shares": [1 / p] * p, "boundary_bytes": 64,
             "rank_elements": [10] * p}
    for schedule in ("gpipe", "1f1b"):
        got = pipeline.step({**facts, "schedule": schedule}, 1.0, 2.0, 0.0, lambda kind, nbytes, n: 0.0, 1, 4,
                            pl.single_stage_order(schedule, p, m))
        assert got["bubble"] == pytest.approx(pl.bubble_theory(schedule, p, m))
        assert got["span_s"] == pytest.approx((m + p - 1) * 3.0 / (p * m))
    slow = pipeline.step(facts, 1.0, 2.0, 0.0, lambda kind, nbytes, n: 0.01, 1, 4, pl.single_stage_order("1f1b", p, m))
    assert slow["bubble"] > pl.bubble_theory("1f1b", p, m) and slow["comm_s"] > 0  # transfers wait in the path


def test_every_schedule_is_predicted_with_its_bubble_and_stage_imbalance():
    c = _comparison(RunSpec("ddp", "ddp"), RunSpec("g", "pp-gpipe", options={"pp": 4, "microbatches": 4}),
                    RunSpec("f", "pp-1f1b", options={"pp": 4, "microbatches": 4}),
                    RunSpec("i", "pp-interleaved", options={"pp": 2, "microbatches": 4}),
                    RunSpec("z", "pp-zero-bubble", options={"pp": 2, "microbatches": 4}),
                    RunSpec("f2", "pp-1f1b", options={"pp": 2, "microbatches": 4}))
    rows = {r["name"]: r for r in predictor.predict_comparison(c, _model())["runs"]}
    for name in ("g", "f", "i", "z", "f2"):
        r = rows[name]
        assert r["why"] is None and r["family"] == PIPELINE and r["tokens_per_s"] > 0, r
        assert 0 < r["compute_s"] < r["step_time_s"] and r["comm_s"] > 0
        assert any("predicted bubble" in n for n in r["notes"]), r["notes"]
        assert any("replicated family's taken" in n for n in r["notes"]) and r["bound"] is None
    # embeddings alone on the first stage: the imbalance puts every bubble above its equal-stage formula
    assert rows["g"]["bubble"] > pl.bubble_theory("gpipe", 4, 4)
    assert rows["i"]["bubble"] > pl.bubble_theory("interleaved-1f1b", 2, 4, 2)
    assert rows["z"]["bubble"] < rows["i"]["bubble"] and rows["f2"]["bubble"] < rows["f"]["bubble"]
    # 2 pipelines of 2 stages: half the tokens each, a shorter pipeline; each rank's states are its own stages'
    assert work_of(c, c.run("f2")).tokens_per_rank == work_of(c, c.run("f")).tokens_per_rank / 2


def test_a_pipeline_run_neither_calibrates_nor_is_probed(tmp_path):
    """Its step is the schedule's span, not forward/backward/optimizer phases: out of the fit, with the reason; the
    one-rank probe skips it (its compute comes from the calibration over its stages)."""
    c = _comparison(RunSpec("f", "pp-1f1b", options={"pp": 4}))
    assert probe_runs(c, timeout_s=5.0) == {}
    from shardscope.analysis.predict import fit

    class _State:  # what fit reads of a finished run: enough to reach the work
        status, world_size, start = "ok", 4, {0: {"backend": "gloo"}}

    cal = fit._read_run(str(tmp_path), c, c.runs[0], _State())
    assert isinstance(cal, CalibrationRun) and "does not calibrate" in cal.why_not


def test_fsdp2_on_the_stages_is_predicted_with_its_gathers_and_a_sharded_optimizer():
    """pp 2 x dp 2 with FSDP2 on each stage: the step pays each unit's all-gather and reduce-scatter across the two
    pipelines (not one all-reduce of the stage gradients) and steps a quarter of the optimizer states a rank."""
    c = _comparison(RunSpec("rep", "pp-1f1b", options={"pp": 2, "microbatches": 4}),
                    RunSpec("fsdp", "pp-1f1b", options={"pp": 2, "microbatches": 4, "dp_shard": "fsdp2"}))
    w = work_of(c, c.run("fsdp"))
    assert w.pipeline["sharded"] and not work_of(c, c.run("rep")).pipeline["sharded"]
    calls = []

    def comm(kind, nbytes, n):
        calls.append((kind, n))
        return 0.0

    order = pl.single_stage_order("1f1b", 2, 4)
    pipeline.step(w.pipeline, 1.0, 2.0, 1.0, comm, 2, 4, order)
    assert {("all_gather", 2), ("reduce_scatter", 2), ("all_reduce", 2)} <= set(calls)
    assert pipeline.step(w.pipeline, 1.0, 2.0, 1.0, comm, 2, 4, order)["after_s"] < pipeline.step(
        {**w.pipeline, "sharded": False}, 1.0, 2.0, 1.0, comm, 2, 4, order)["after_s"]  # half the optimizer a rank



def test_a_users_modules_units_follow_its_blocks_and_what_post_blocks_uses():
    """A user's module: ``<blocks>.<i>.…`` is block i wherever it is declared, the parameters post_blocks uses are
    the head, the rest the embeddings (a head declared before the blocks included)."""
    from shardscope.core import pipeline_layout

    names = ["head.weight", "position", "embed.weight", "stack.0.w", "stack.0.b", "stack.1.w", "norm.weight"]
    units = pipeline_layout.unit_names(names, blocks="stack", last={"head.weight", "norm.weight"})
    assert units == ["head", "embeddings", "embeddings", "layers.0", "layers.0", "layers.1", "head"]
    split = pipeline_layout.units_of([(n, 1) for n in names], units)
    assert [(u.name, u.numel) for u in split] == [("embeddings", 2), ("layers.0", 2), ("layers.1", 1), ("head", 2)]
