"""``predict_in_step``: the blocking calls of exact bytes (tensor-parallel activations, the gradient norm) priced at
the collective job's in-step figure at their size, and kept out of the calibration's latency factor."""

from __future__ import annotations

import dataclasses
import math

import pytest

from shardscope import config
from shardscope.analysis.predict import predictor as predict, fit as predict_fit, in_step as predict_in_step
from shardscope.analysis.predict.comm_fit import bus_factor
from shardscope.analysis.predict.schedule import simulate
from shardscope.analysis.predict.work import work_of

from test_predict import CPU, _comm, _model, _runs, smoke

PROBED = {"forward": 0.010, "backward": 0.020, "optimizer": 0.005}
ROWS = [("all_reduce", 4096.0, 0.0010, 2), ("all_reduce", 4096.0, 0.0030, 2), ("all_reduce", 4096.0, 0.0012, 2),
        ("all_reduce", 65536.0, 0.0020, 2), ("all_reduce", 1048576.0, 0.0050, 2), ("all_gather", 4096.0, 0.0004, 2),
        ("all_reduce", 65536.0, 0.0040, 4)]


def test_the_table_is_the_median_per_type_group_and_size():
    tab = predict_in_step.table(ROWS)
    assert tab["all_reduce"]["2"] == [[4096.0, 0.0012], [65536.0, 0.0020], [1048576.0, 0.0050]]
    assert tab["all_reduce"]["4"] == [[65536.0, 0.0040]]
    assert tab["all_gather"]["2"] == [[4096.0, 0.0004]]


def test_a_call_is_priced_at_the_jobs_figure_log_log_between_sizes():
    tab = predict_in_step.table(ROWS)
    price = predict_in_step.seconds
    assert price(tab, "all_reduce", 65536, 2) == pytest.approx(0.0020)  # a timed size: its median
    # halfway in log size between 4 KiB and 64 KiB: the geometric mean of their times
    assert price(tab, "all_reduce", 16384, 2) == pytest.approx(math.sqrt(0.0012 * 0.0020))
    assert price(tab, "all_reduce", 8, 2) == pytest.approx(0.0012)  # below the smallest: latency-bound
    # above the largest: its time plus the extra bytes at the fit's bus bandwidth
    assert price(tab, "all_reduce", 3 * 1048576, 2, busbw_Bps=1e9) == pytest.approx(
        0.0050 + 2 * 1048576 * bus_factor("all_reduce", 2) / 1e9)
    assert price(tab, "all_reduce", 65536, 4) == pytest.approx(0.0040)
    assert price(tab, "all_reduce", 65536, 8) is None  # not timed over 8 ranks: the caller falls back to the fit
    assert price(tab, "broadcast", 65536, 2) is None
    assert price(tab, "all_reduce", 65536, 1) == 0.0


def test_fit_keeps_the_jobs_figures_on_gloo():
    model = predict_fit.fit(_runs(smoke()), cores=8, collectives=ROWS)
    assert model.in_step == predict_in_step.table(ROWS)
    assert predict_fit.fit(_runs(smoke()), cores=8).in_step == {}


def _tp_at_2():
    return config.load_preset("tp-verification", ["world_size=2", "runs.autotp.world_size=2",
                                                  "runs.fsdp2-tp.world_size=2"], host=CPU)


def test_blocking_tp_calls_pay_the_jobs_figure_and_not_the_latency_factor():
    flat = 0.0017  # every all-reduce over 2 ranks, whatever its size, in this job
    base = dataclasses.replace(_model(), families=sorted({*_model().families, "tensor-parallel"}))
    factor = {"world_size": 2, "factor": 3.0, "paid_s": 1.0, "predicted_s": 0.5, "latency_s": 0.25,
              "runs": {"ddp": [2.0]}, "left_out": {}}
    with_job = dataclasses.replace(base, comm_cost=factor,
                                   in_step={"all_reduce": {"2": [[1.0, flat], [1e12, flat]]}})
    without_job = dataclasses.replace(base, comm_cost=factor)
    c = _tp_at_2()
    for name in ("autotp", "fsdp2-tp"):
        w = work_of(c, c.run(name))
        assert (w.tp, w.dp) == (2, 1)  # tp 2 x dp 1: every call is a tensor-parallel or norm all-reduce
        calls = simulate(w, 0.01, 0.02, 0.005, _comm, overlap=False).calls_by_type
        assert set(calls) == {"all_reduce"} and calls["all_reduce"] > 10
        got = predict.predict_run(c, c.run(name), with_job, probed=PROBED)
        assert got["exposed_comm_s"] == pytest.approx(flat * calls["all_reduce"])
        assert got["comm_latency_s"] == 0.0  # none of it carries the factor
        assert predict_in_step.NOTE in got["notes"]
        assert not any("collective latency x" in n for n in got["notes"])  # no factor claimed where none applies
        old = predict.predict_run(c, c.run(name), without_job, probed=PROBED)
        assert old["comm_latency_s"] > 0 and old["exposed_comm_s"] > old["comm_s"]  # the factor's share on top
    # a replicated run (no norm all-reduce, no tensor parallelism) is priced as before
    ddp = [predict.predict_run(c, c.run("ddp"), m, probed=PROBED) for m in (with_job, without_job)]
    assert ddp[0]["step_time_s"] == pytest.approx(ddp[1]["step_time_s"])
    assert predict_in_step.NOTE not in ddp[0]["notes"]


def test_the_jobs_small_all_reduces_run_long_loops_and_are_not_floored_at_the_barrier_timed_call():
    from shardscope.analysis.predict import collectives as pc

    assert pc._rounds("all_reduce", 65536) == pc.SMALL_ROUNDS > pc.ROUNDS
    assert pc._rounds("all_reduce", 1 << 20) == pc._rounds("all_gather", 4096) == pc.ROUNDS
    ranks = [[("all_reduce", 4096.0, 3.7e-3, "barrier", 2), ("all_reduce", 4096.0, 1.4e-3, "in_step", 2),
              ("all_reduce", 1 << 20, 3.7e-3, "barrier", 2), ("all_reduce", float(1 << 20), 1.4e-3, "in_step", 2)]] * 2
    got = pc._calls(ranks)
    # the 4 KiB all-reduce keeps its in-step figure; a 1 MiB one is still at least its barrier-timed call
    assert got == [("all_reduce", 4096.0, pytest.approx(1.4e-3), 2), ("all_reduce", float(1 << 20), pytest.approx(3.7e-3), 2)]


def test_the_prediction_lists_the_pricing_among_its_assumptions_when_the_job_ran():
    c = _tp_at_2()
    probes = {r.name: dict(PROBED) for r in c.runs}
    with_job = dataclasses.replace(_model(), in_step=predict_in_step.table(ROWS))
    assert predict_in_step.NOTE in predict.predict_comparison(c, with_job, probes=probes)["assumptions"]
    assert predict_in_step.NOTE not in predict.predict_comparison(c, _model(), probes=probes)["assumptions"]
    assert predict_in_step.NOTE not in predict.predict_comparison(c, with_job)["assumptions"]  # no probe: the fit
