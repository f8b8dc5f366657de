"""The predictor's pieces on synthetic inputs (fast, no torchrun): the fit recovers known coefficients,
the schedules move the theory's bytes and overlap where the strategy does, and the runs it cannot
support say why."""

from __future__ import annotations

import math

import pytest

from shardscope import config
from shardscope.config import RunSpec
from shardscope.analysis.predict import predictor as predict, fit as predict_fit
from shardscope.analysis.predict.devices import device_spec
from shardscope.analysis.predict.fit import CalibrationRun, CollectiveFit, reference_compute, solve
from shardscope.analysis.predict.schedule import simulate
from shardscope.analysis.predict.work import work_of

CPU = config.HostInfo("cpu", 64, "test")
COLLECTIVES = {k: CollectiveFit(k, 40e-6, bw, 2, 0, 0, None, "measured")
               for k, bw in (("all_reduce", 2e9), ("all_gather", 1.5e9), ("reduce_scatter", 1e9))}
FORWARD, BACKWARD, OPTIMIZER = 2e-11, 5e-11, 3e-9
ONE_SIZE = {"forward": {"per_flop_s": FORWARD}, "backward": {"per_flop_s": BACKWARD},
            "optimizer": {"per_element_s": OPTIMIZER}}
OVERHEAD = {"forward": 1e-4, "backward": 5e-5, "optimizer": 2e-4}  # fsdp2's, seconds per parameter tensor


def smoke(*sets):
    return config.load_preset("smoke", list(sets), host=CPU)


def _comm(kind, nbytes, n):
    return COLLECTIVES[kind].seconds(nbytes, n)


def synthetic(c, run_name, coefficients, overhead=None, rest=1e-3):
    """A calibration run whose phases follow ``coefficients`` (plus ``overhead`` per tensor) exactly, with the
    schedule's exposed communication, and whose traces hold calls timed exactly by COLLECTIVES."""
    run = c.run(run_name)
    w = work_of(c, run)
    ref = reference_compute(w, coefficients)
    comp = {p: ref[p] + (overhead or {}).get(p, 0.0) * w.param_tensors for p in ref}
    timing = simulate(w, comp["forward"], comp["backward"], comp["optimizer"], _comm, overlap=False)
    calls = [(k, float(size), COLLECTIVES[k].seconds(size, 2), 2) for k in COLLECTIVES for size in (1e3, 1e5, 4e6)]
    return CalibrationRun("syn", run_name, run.strategy, w, dict(timing.phase_s), timing.step_s + rest, None, None,
                          "gloo", "cpu", "synthetic", calls)


def test_solve_is_least_squares_with_nonnegative_coefficients():
    assert solve([[1.0, 2.0], [1.0, 3.0], [1.0, 5.0]], [5.0, 7.0, 11.0]) == pytest.approx([1.0, 2.0])
    # a column that would come out negative is dropped, the other refitted alone
    assert solve([[1.0, 1.0], [1.0, 2.0]], [2.0, 1.0]) == pytest.approx([1.5, 0.0])


def test_collective_fit_recovers_latency_and_bus_bandwidth():
    c = smoke()
    fits = predict_fit.fit_collectives(synthetic(c, "ddp", {}).collectives, [])
    for kind, known in COLLECTIVES.items():
        got = fits[kind]
        assert got.source == "measured" and got.points == 3
        assert got.step_latency_s == pytest.approx(known.step_latency_s, rel=1e-6)
        assert got.busbw_Bps == pytest.approx(known.busbw_Bps, rel=1e-6)
        assert got.rel_rms_error == pytest.approx(0.0, abs=1e-9)
    assert fits["broadcast"].source == "derived from all_gather"  # a type no run did: said where it came from


def test_each_type_gets_its_own_latency_when_every_type_was_timed_at_three_sizes_or_more():
    known = {"all_reduce": (2e-3, 2e9), "all_gather": (1e-3, 1.5e9), "reduce_scatter": (2.5e-3, 1e9),
             "broadcast": (0.3e-3, 3e9)}  # (latency per ring step, bus bandwidth): in-step figures differ by type
    truth = {k: CollectiveFit(k, lat, bw, 4, 0, 0, None, "measured") for k, (lat, bw) in known.items()}
    calls = [(k, b, truth[k].seconds(b, 4), 4) for k in known for b in (4e3, 6.4e4, 1e6, 8e6)]
    fits = predict_fit.fit_collectives(calls, [])
    for kind, (lat, bw) in known.items():
        assert fits[kind].step_latency_s == pytest.approx(lat, rel=1e-6)
        assert fits[kind].busbw_Bps == pytest.approx(bw, rel=1e-6)
    # the world's subgroups timed too (a pair of 4 ranks sharing 2 cores): a latency per type and group size
    pair = {k: CollectiveFit(k, 3 * lat, bw, 2, 0, 0, None, "measured") for k, (lat, bw) in known.items()}
    both = calls + [(k, b, pair[k].seconds(b, 2), 2) for k in known for b in (4e3, 6.4e4, 1e6, 8e6)]
    fits = predict_fit.fit_collectives(both, [])
    for kind, (lat, bw) in known.items():
        assert fits[kind].group == 4 and fits[kind].step_latency_s == pytest.approx(lat, rel=1e-6)
        assert fits[kind].latency_by_group == {2: pytest.approx(3 * lat, rel=1e-6)}
        assert fits[kind].seconds(1e6, 2) == pytest.approx(pair[kind].seconds(1e6, 2), rel=1e-6)
    # two sizes of a type (a smoke comparison's traces): one latency shared by every type, as before
    shared = predict_fit.fit_collectives([c for c in calls if c[1] in (4e3, 8e6)], [])
    assert len({f.step_latency_s for f in shared.values()}) == 1


def test_one_size_per_type_charges_its_time_to_bandwidth_and_says_so():
    notes: list[str] = []
    fit = predict_fit.fit_collectives([("all_reduce", 5e5, 1e-3, 2)] * 3 + [("all_reduce", 5e5, 0.0, 2)],
                                      notes)["all_reduce"]
    assert fit.points == 3  # a call timed at 0 (noise) is left out, not divided by
    assert fit.step_latency_s == 0 and fit.seconds(5e5, 2) == pytest.approx(1e-3)
    assert any("latency not separable" in n for n in notes)


def test_fit_recovers_known_compute_and_overhead_from_one_size():
    model = predict_fit.fit(_runs(smoke()), cores=8)
    assert model.coefficients["forward"] == pytest.approx({"per_flop_s": FORWARD}, rel=1e-6)
    assert model.coefficients["backward"] == pytest.approx({"per_flop_s": BACKWARD}, rel=1e-6)
    assert model.coefficients["optimizer"] == pytest.approx({"per_element_s": OPTIMIZER}, rel=1e-6)
    assert model.overhead["ddp"] == pytest.approx(dict.fromkeys(OVERHEAD, 0.0), abs=1e-12)
    assert model.overhead["fsdp2"] == pytest.approx(OVERHEAD, rel=1e-6)
    assert model.rest_s == pytest.approx(1e-3, rel=1e-6)
    assert any("one model size" in n for n in model.notes)


def test_fit_recovers_the_per_layer_and_token_cost_from_two_sizes():
    coefficients = {"forward": {"per_layer_token_s": 3e-7, "per_flop_s": FORWARD},
                    "backward": {"per_layer_token_s": 6e-7, "per_flop_s": BACKWARD},
                    "optimizer": {"per_tensor_s": 2e-5, "per_element_s": OPTIMIZER}}
    small = synthetic(smoke(), "ddp", coefficients)
    wide = smoke("model.d_model=128", "model.d_ff=512", "model.seq_len=128", "model.n_layers=3")
    big = synthetic(wide, "ddp", coefficients)
    big.out_dir = "syn-wide"
    model = predict_fit.fit([small, big], cores=8)
    for phase, known in coefficients.items():
        assert model.coefficients[phase] == pytest.approx(known, rel=1e-6), phase


def _runs(c):
    return [synthetic(c, "ddp", ONE_SIZE), synthetic(c, "fsdp2", ONE_SIZE, OVERHEAD)]


def test_calibration_runs_predict_back_their_own_step_time():
    c = smoke()
    runs = _runs(c)
    model = predict_fit.fit(runs, cores=8)
    for r in runs:
        row = predict.predict_run(c, c.run(r.name), model)
        assert row["why"] is None
        assert row["step_time_s"] == pytest.approx(r.step_s, rel=1e-6)
        assert row["compute_s"] + row["exposed_comm_s"] + row["rest_s"] == pytest.approx(row["step_time_s"])
        assert row["tokens_per_s"] == pytest.approx(c.global_batch * c.model.seq_len / r.step_s)
        assert row["peak_mem_bytes"] > 0


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "zero3", "fsdp2"])
def test_schedule_moves_exactly_the_theorys_bytes(name):
    c = config.load_preset("zero-stages", host=CPU)
    w = work_of(c, c.run(name))
    timing = simulate(w, 0.01, 0.02, 0.005, _comm, overlap=False)
    moved = {k: v for k, v in timing.bytes_by_type.items() if v}
    theory = dict(w.by_type)
    if w.traits.norm_allreduce:  # the global norm's scalar is the only addition
        theory["all_reduce"] = theory.get("all_reduce", 0) + 8
    assert moved == pytest.approx(theory)


@pytest.mark.parametrize("accum", [1, 2])
def test_zero3_gathers_and_reduces_in_its_buckets(accum):
    """DeepSpeed ZeRO-3 fetches runs of units in one coalesced all-gather up to its bucket and reduce-scatters a
    bucket of gradients at a time; a model within its live limit is not gathered again in backward. The bytes
    stay the theory's either way (tests/test_layout_matrix.py checks the counts against a real step)."""
    c = config.load_preset("zero-stages", [f"grad_accum={accum}"], host=CPU)  # ~1.3M elements
    w = work_of(c, c.run("zero3"))
    assert not w.traits.regather and w.traits.gather_bucket == w.traits.reduce_bucket == 25 * 2**20 // 4
    calls = simulate(w, 0.01, 0.02, 0.005, _comm, overlap=False).calls_by_type
    assert calls["all_gather"] == calls["reduce_scatter"] == accum  # the whole model in one bucket
    c = config.load_preset("zero-stages", [f"grad_accum={accum}", "runs.zero3.options.bucket_mb=2"], host=CPU)
    w = work_of(c, c.run("zero3"))
    assert w.traits.regather  # over the live limit: gathered again in backward
    timing = simulate(w, 0.01, 0.02, 0.005, _comm, overlap=False)
    assert 1 < timing.calls_by_type["reduce_scatter"] / accum < len(w.units)  # several units to a bucket
    assert 2 < timing.calls_by_type["all_gather"] / accum < 2 * len(w.units)  # forward and backward
    assert timing.bytes_by_type["all_gather"] == pytest.approx(w.by_type["all_gather"])
    assert timing.bytes_by_type["reduce_scatter"] == pytest.approx(w.by_type["reduce_scatter"])


def test_gloo_blocks_on_every_fsdp_collective_and_gpus_overlap_them():
    c = smoke("model.n_layers=6")
    w = work_of(c, c.run("fsdp2"))
    gloo = simulate(w, 0.01, 0.02, 0.005, _comm, overlap=False)
    nccl = simulate(w, 0.01, 0.02, 0.005, _comm, overlap=True)
    assert gloo.exposed_comm_s == pytest.approx(gloo.comm_s)
    assert nccl.comm_s == pytest.approx(gloo.comm_s)
    assert nccl.exposed_comm_s < 0.5 * gloo.exposed_comm_s  # prefetching hides most gathers behind compute


def test_ddp_buckets_overlap_backward_once_there_are_several():
    one = work_of(smoke(), smoke().run("ddp"))  # 0.5 MB of gradients: one bucket, all-reduced after backward
    c = smoke("model.d_model=256", "model.d_ff=1024", "model.n_layers=4", "runs.ddp.options.bucket_cap_mb=1")
    many = work_of(c, c.run("ddp"))
    slow = (lambda kind, nbytes, n: 1e-3 + nbytes / 1e8)
    single = simulate(one, 0.01, 0.02, 0.005, slow, overlap=False)
    assert single.exposed_comm_s == pytest.approx(single.comm_s)
    several = simulate(many, 0.01, 0.2, 0.005, slow, overlap=False)
    assert several.exposed_comm_s < 0.7 * several.comm_s


def _model():
    return predict_fit.fit(_runs(smoke()), cores=8)


def test_runs_the_calibration_cannot_support_say_why():
    model = _model()
    rows = {r["name"]: r for r in predict.predict_comparison(config.load_preset("tp-verification", host=CPU), model)["runs"]}
    assert rows["ddp"]["why"] is None and rows["ddp"]["tokens_per_s"] > 0
    for name in ("autotp", "fsdp2-tp"):
        assert "no tensor-parallel run" in rows[name]["why"]
        assert all(rows[name][k] is None for k in predict.FIGURES)
    bf16 = predict.predict_comparison(config.load_preset("fsdp-impls", host=CPU), model)["runs"]
    assert {r["name"] for r in bf16 if r["why"] is None} == {"ddp-fp32"}
    assert all("unmeasured" in r["why"] for r in bf16 if r["name"] != "ddp-fp32")
    zero = {r["name"]: r for r in predict.predict_comparison(config.load_preset("zero-stages", host=CPU), model)["runs"]}
    assert any("not calibrated for deepspeed-zero1" in n for n in zero["zero1"]["notes"])
    assert zero["zero1"]["bound"] == "upper"  # no overhead counted: its tokens/s can only be lower
    assert zero["zero3"]["bound"] is None and any("family's (fully-sharded)" in n for n in zero["zero3"]["notes"])
    assert zero["fsdp2"]["notes"] == [] and zero["fsdp2"]["bound"] is None


def test_what_if_on_gpus_is_marked_and_lists_its_assumptions():
    c = config.load_preset("ddp-vs-fsdp", ["world_size=16"])
    out = predict.predict_comparison(c, _model(), device_spec("h100"))
    assert out["what_if"] and out["device"] == "H100"
    assert any(a.startswith("WHAT-IF on H100") for a in out["assumptions"])
    for r in out["runs"]:
        assert r["why"] is None and r["tokens_per_s"] > 0 and r["world_size"] == 16
        assert any("InfiniBand" in n for n in r["notes"]) and any("assumed 40%" in n for n in r["notes"])
    ddp = out["runs"][0]
    # 16 x H100 at 40% of the fp32 (non-tensor-core) peak: FLOPs per rank / (0.4 x 67 TFLOP/s) at least
    w = work_of(c, c.runs[0])
    assert ddp["compute_s"] >= (w.fwd_flops + w.bwd_flops) / (0.4 * 67e12) * (1 - 1e-9)
    with pytest.raises(KeyError, match="known: A100, H100, H200, B200"):
        device_spec("TPU")


def test_a_what_if_lists_none_of_this_machines_collective_or_core_notes():
    # A calibration with no collective traced says its runs that communicate are not predicted here; a what-if
    # predicts them from the device table, so that line (and the fits' and cores' lines) must not head its rows.
    model = _model()
    local = ["no collective measured in the calibration's traces: runs that communicate are not predicted",
             "collective fits resting on few sizes or scattered calls: all_gather (10 calls, 2 sizes, rms error 53%)",
             "the calibration's ranks got 92% of a core each (CPU time / (CPU time + run-queue wait)): 0.2 other busy"]
    model.notes[:] = [*local, "one model size calibrated: compute scales with FLOPs"]
    c = config.load_preset("ddp-vs-fsdp", ["world_size=16"])
    what_if = predict.predict_comparison(c, model, device_spec("h100"))["assumptions"]
    assert not any(n in what_if for n in local) and "one model size calibrated: compute scales with FLOPs" in what_if
    here = predict.predict_comparison(smoke(), model)["assumptions"]
    assert all(n in here for n in local)


def test_background_load_read_from_cpu_time_scales_compute_with_the_ranks():
    runs = _runs(smoke())
    for r in runs:  # each rank got 40% of a core: 2 cores shared by 2 ranks and 3 other busy processes
        r.busy_s = 0.4 * r.step_s
    model = predict_fit.fit(runs, cores=2)
    assert model.background == pytest.approx(3.0)
    assert any("3.0 other busy processes" in n for n in model.notes)
    for r in runs:  # normalised to a core of its own and back: the calibration runs predict back unchanged
        row = predict.predict_run(smoke(), smoke().run(r.name), model)
        assert row["step_time_s"] == pytest.approx(r.step_s, rel=1e-6)
    one = predict.predict_run(smoke("world_size=1"), smoke("world_size=1").run("ddp"), model)
    four = predict.predict_run(smoke("world_size=4"), smoke("world_size=4").run("ddp"), model)
    assert predict_fit.cpu_share(1, 2, 3.0) == pytest.approx(0.5) and predict_fit.cpu_share(4, 2, 3.0) == pytest.approx(2 / 7)
    # per rank, compute at 1 rank is 2.5/2 times faster than at 2 ranks, at 4 ranks 2.5/3.5 as fast
    w2 = predict.predict_run(smoke(), smoke().run("ddp"), model)
    assert one["compute_s"] == pytest.approx(w2["compute_s"] * 0.4 / 0.5)
    assert four["compute_s"] == pytest.approx(w2["compute_s"] * 0.4 / (2 / 7))
    assert any("with 3.0 other busy processes" in n for n in four["notes"])


def test_background_load_read_from_the_run_queue_wait_leaves_waits_in_collectives_out():
    """With ``cpu_wait_s`` (ready to run, no core free) the share is CPU time over CPU time plus that wait: a
    rank that is off the CPU waiting in a collective (here half of every step) does not read as load."""
    runs = _runs(smoke())
    for r in runs:  # half of every step waiting in collectives; a third of the time it wanted a core, it waited
        r.busy_s, r.cpu_wait_s = 0.5 * r.step_s * 2 / 3, 0.5 * r.step_s / 3
    model = predict_fit.fit(runs, cores=2)
    # share 2/3 = 2 cores / (2 ranks + 1 other): 1.0, where busy / step (1/3) would have read 4.0
    assert model.background == pytest.approx(1.0)
    assert any("run-queue wait" in n and "1.0 other busy processes" in n for n in model.notes)
    for r in runs:
        r.cpu_wait_s = 0.0  # ran whenever it wanted to: no background, whatever its waits in collectives
    assert predict_fit.fit(runs, cores=2).background == 0.0
    runs[0].cpu_wait_s = None  # one run without the figure: the whole calibration falls back to busy / step
    assert predict_fit.fit(runs, cores=2).background == pytest.approx(4.0)


def test_world_size_one_needs_no_collective_and_more_ranks_than_cores_share_them():
    model = _model()
    one = predict.predict_run(smoke("world_size=1"), smoke("world_size=1").run("fsdp2"), model)
    assert one["why"] is None and one["comm_s"] == 0 and one["exposed_comm_s"] == pytest.approx(0, abs=1e-12)
    model.cores = 2
    four = predict.predict_run(smoke("world_size=4"), smoke("world_size=4").run("ddp"), model)
    assert any("4 ranks share 2 cores" in n for n in four["notes"])
    assert math.isfinite(four["step_time_s"])


def test_no_phase_split_means_no_calibration():
    run = CalibrationRun("syn", "ddp", "ddp", None, {}, None, None, None, "gloo", "cpu", "", [],
                         why_not="ddp: its step records carry no forward/backward/optimizer split")
    with pytest.raises(predict.NotPredicted, match="no forward/backward/optimizer split"):
        predict_fit.fit([run])
    row = predict.predict_run(smoke(), RunSpec("ddp", "ddp"), None)
    assert row["why"] == "no calibration"


def test_a_probe_of_the_run_replaces_the_calibrations_compute_and_a_failed_one_says_why():
    from shardscope.analysis.predict.probe import core_phases

    model = _model()  # 8 cores: 2 ranks get a core each, so the probe's seconds are the ranks'
    c = config.load_preset("fsdp-impls", host=CPU)
    probed = {"forward": 0.010, "backward": 0.020, "optimizer": 0.005}
    probes = {r.name: dict(probed) for r in c.runs}
    probes["fsdp1-ac"] = {"error": "the probe failed (exit 1): boom"}
    rows = {r["name"]: r for r in predict.predict_comparison(c, model, probes=probes)["runs"]}
    # bf16 runs are predicted once their own compute is measured (without a probe they are not: see above)
    for name in ("handwritten-bf16", "fsdp2-ac", "ddp-fp32"):
        row = rows[name]
        assert row["why"] is None and row["bound"] is None
        assert row["compute_s"] == pytest.approx(0.035) and any("one-rank probe" in n for n in row["notes"])
        assert row["step_time_s"] >= 0.035 + model.rest_s
    assert rows["fsdp1-ac"]["why"] == "compute probe: the probe failed (exit 1): boom"
    assert rows["fsdp1-ac"]["tokens_per_s"] is None
    # a tensor-parallel run is predicted from its probe (no tensor-parallel run in the calibration): the probe's
    # compute plus the schedule's per-layer activation all-reduces, each blocking, on top of its data parallelism
    tp = config.load_preset("tp-verification", host=CPU)
    row = next(r for r in predict.predict_comparison(tp, model, probes={"fsdp2-tp": probed})["runs"]
               if r["name"] == "fsdp2-tp")
    assert row["why"] is None and row["compute_s"] == pytest.approx(0.035)
    w = work_of(tp, tp.run("fsdp2-tp"))
    calls = []
    simulate(w, 0.010, 0.020, 0.005, lambda k, b, n: calls.append((k, n)) or 0.0, False)
    activations = sum(k == "all_reduce" and n == w.tp for k, n in calls)
    # per layer: the attention's and the MLP's outputs in forward, one per column-parallel linear (q, k, v, gate,
    # up) in backward: 7 calls, as a real step shows (RESULTS.md, 2026-11-26), not one per direction
    assert w.tp_layer_calls == (2, 5)
    # (plus the gradient norm's second all-reduce, over dp: here dp = tp = 2)
    assert activations == tp.model.hf_layers * 7 * w.accum + (w.dp == w.tp)
    comm = predict_fit._comm_fn(model.collectives)
    assert row["exposed_comm_s"] == pytest.approx(simulate(w, 0.010, 0.020, 0.005, comm, False).exposed_comm_s)
    # a probe that got 40% of its core is counted at its CPU time: 40% of its wall-clock phases
    got = core_phases({"time_forward_s": 0.1, "time_backward_s": 0.2, "time_optimizer_s": 0.05,
                       "step_time_s": 0.5, "busy_s": 0.2})
    assert got == pytest.approx({"forward": 0.04, "backward": 0.08, "optimizer": 0.02})
    with pytest.raises(ValueError, match="time_backward_s"):
        core_phases({"time_forward_s": 0.1, "time_optimizer_s": 0.05, "step_time_s": 0.5})


def test_timed_collectives_on_cpu_are_in_step_costs_floored_at_the_barrier_timed_call():
    from shardscope.analysis.predict.collectives import _calls

    rank0 = [("all_gather", 1e3, 0.5e-3, "barrier", 4), ("all_gather", 1e3, 0.7e-3, "barrier", 4),
             ("all_gather", 1e3, 2.0e-3, "in_step", 4), ("all_gather", 1e3, 0.1e-3, "in_step", 4),
             ("all_gather", 1e3, 1.0e-3, "in_step", 2), ("all_gather", 1e3, -1.0e-3, "in_step", 2)]
    rank1 = [("all_gather", 1e3, 0.3e-3, "barrier", 4), ("all_gather", 1e3, 0.9e-3, "barrier", 4),
             ("all_gather", 1e3, 4.0e-3, "in_step", 4), ("all_gather", 1e3, -0.2e-3, "in_step", 4),
             ("all_gather", 1e3, 3.0e-3, "in_step", 2), ("all_gather", 1e3, 0.5e-3, "in_step", 2)]
    got = _calls([rank0, rank1])
    # in-step: the median over ranks (3 ms; -0.05 ms, noise) and at least the barrier-timed fastest median (0.5 ms);
    # a subgroup's call (2 of the 4 ranks) keeps its group size and has no barrier-timed floor: one whose median is
    # not above 0 (noise) is dropped
    assert got == [("all_gather", 1e3, pytest.approx(3.0e-3), 4), ("all_gather", 1e3, pytest.approx(0.5e-3), 4),
                   ("all_gather", 1e3, pytest.approx(2.0e-3), 2)]
    # a GPU's job has only barrier-timed calls: each its fastest rank's time
    got = _calls([rank0[:2], rank1[:2]])
    assert [t for *_, t, _ in got] == [pytest.approx(0.3e-3), pytest.approx(0.7e-3)]


def test_collectives_timed_in_a_loop_of_compute_replace_the_traces_figures_of_their_type_on_cpu():
    c = smoke()
    runs = _runs(c)
    slower = [(k, b, 3 * t, n) for k, b, t, n in runs[0].collectives]  # every traced type, each call 3x
    model = predict_fit.fit(runs, cores=8, collectives=slower)
    for kind in COLLECTIVES:
        fit = model.collectives[kind]
        assert fit.points == sum(k == kind for k, *_ in slower)  # the traces' calls of the type left out
        for k, b, t, n in slower:
            if k == kind:
                assert fit.seconds(b, n) == pytest.approx(t, rel=1e-6)
    assert any("the traces' figures of those types left out" in n for n in model.notes)


def test_the_collectives_table_shows_each_timed_group_sizes_latency():
    from rich.console import Console

    from shardscope.cli.predictview import print_prediction

    fit = {"kind": "all_reduce", "step_latency_s": 0.0011, "busbw_Bps": 2e9, "group": 4, "points": 8, "sizes": 4,
           "rel_rms_error": 0.1, "source": "measured", "latency_by_group": {"2": 0.0023}}
    calibration = {"runs": ["ddp"], "backend": "gloo", "cores": 2, "collectives": {"all_reduce": fit}}
    console = Console(record=True, width=200)
    print_prediction({"what_if": False, "preset": "p", "device": None, "runs": [], "assumptions": [],
                      "calibration": calibration, "fit_error": None}, console)
    assert "2 ranks: 2,300  4 ranks: 1,100" in console.export_text()
    calibration["collectives"]["all_reduce"] = {**fit, "latency_by_group": {}}
    console = Console(record=True, width=200)
    print_prediction({"what_if": False, "preset": "p", "device": None, "runs": [], "assumptions": [],
                      "calibration": calibration, "fit_error": None}, console)
    assert "1,100" in console.export_text() and "ranks:" not in console.export_text()


def test_a_one_size_gpu_calibration_predicts_only_models_near_its_size():
    """An H100 ran smoke's forward at 28 GFLOP/s (kernel launches) and a model 2,091x the FLOPs in 2.5x the time:
    on a GPU one size's speed per FLOP is not carried to another size; on a CPU it is (and with two sizes)."""
    c = smoke()
    gpu = [synthetic(c, "ddp", ONE_SIZE), synthetic(c, "fsdp2", ONE_SIZE, OVERHEAD)]
    for r in gpu:
        r.backend, r.device, r.device_name = "nccl", "cuda:0", "NVIDIA H100 80GB HBM3"
    model = predict_fit.fit(gpu, cores=16)
    assert model.fwd_flops == [work_of(c, c.run("ddp")).fwd_flops]
    near = predict.predict_run(smoke("model.seq_len=96"), c.run("ddp"), model)  # 1.5x the FLOPs
    assert near["why"] is None and near["tokens_per_s"] > 0
    wide = smoke("model.d_model=256", "model.d_ff=1024")
    far = predict.predict_run(wide, wide.run("ddp"), model)
    assert "one model size calibrated on a GPU (NVIDIA H100 80GB HBM3)" in far["why"] and "--probe" in far["why"]
    assert all(far[k] is None for k in predict.FIGURES) and far["peak_mem_bytes"] > 0
    assert predict.predict_run(wide, wide.run("ddp"), _model())["why"] is None  # the same runs on a CPU
    launches = {"forward": {"per_layer_token_s": 3e-7, "per_flop_s": FORWARD},
                "backward": {"per_layer_token_s": 6e-7, "per_flop_s": BACKWARD},
                "optimizer": {"per_tensor_s": 2e-5, "per_element_s": OPTIMIZER}}
    sizes = [synthetic(c, "ddp", launches), synthetic(smoke("model.d_model=96", "model.d_ff=384"), "ddp", launches)]
    for r, where in zip(sizes, ("syn", "syn-wider")):
        r.backend, r.device, r.out_dir = "nccl", "cuda:0", where
    two = predict_fit.fit(sizes, cores=16)
    assert "per_layer_token_s" in two.coefficients["forward"]  # two sizes: a per-layer cost, carried to any size
    assert predict.predict_run(wide, wide.run("ddp"), two)["why"] is None


def test_an_overhead_that_would_fit_below_zero_is_taken_as_zero_and_said():
    """A strategy that measured faster than the reference's compute for the same FLOPs (a busy machine's noise):
    its fitted overhead is 0, never negative, and the note says so."""
    c = smoke()
    faster = {p: -v / 2 for p, v in OVERHEAD.items()}  # fsdp2 "cheaper" than DDP's compute
    runs = [synthetic(c, "ddp", ONE_SIZE), synthetic(c, "fsdp2", ONE_SIZE, faster)]
    model = predict_fit.fit(runs, cores=8)
    assert model.overhead["fsdp2"] == dict.fromkeys(OVERHEAD, 0.0)
    assert any("fsdp2: its fitted framework overhead would be below zero" in n for n in model.notes), model.notes
