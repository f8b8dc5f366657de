"""``predict_comm_cost``: what the calibration's own real steps paid for their collectives, against what the fit
placed in them, measured from probes of those runs and applied to the exposed communication of probed runs at
the same world size (and nowhere else)."""

from __future__ import annotations

import dataclasses

import pytest

from shardscope import config
from shardscope.analysis.predict import predictor as predict, comm_cost as predict_comm_cost

from test_predict import CPU, _model, smoke

PROBED = {"forward": 0.010, "backward": 0.020, "optimizer": 0.005}


def _calibrated(tmp_path, paid: dict[str, float]):
    """A model whose calibration runs (smoke's ddp and fsdp2, written to ``tmp_path``) measured their probed
    prediction's compute and rest plus ``paid[run]`` x its predicted exposed communication."""
    cal = smoke()
    config.dump_json(str(tmp_path / "comparison.json"), cal.to_dict())
    model = _model()
    rows = {r.name: predict.predict_run(cal, r, model, probed=PROBED) for r in cal.runs}
    model.fit_error["runs"] = {name: {"measured_step_s": row["step_time_s"] + (paid[name] - 1) * row["exposed_comm_s"]}
                               for name, row in rows.items()}
    return cal, model, rows


def test_the_factor_is_what_the_calibrations_steps_paid_over_the_fit(tmp_path):
    cal, model, rows = _calibrated(tmp_path, {"ddp": 1.5, "fsdp2": 2.5})
    calls = []

    def probe(c, progress=None):
        calls.append(c.name)
        return {r.name: dict(PROBED) for r in c.runs}

    got = predict_comm_cost.measure(model, [str(tmp_path)], probe, predict.predict_run)
    assert len(calls) == predict_comm_cost.REPEATS and not model.comm_cost  # the model given is left as it was
    cc = got.comm_cost
    assert cc["world_size"] == 2 and cc["runs"] == {"ddp": [pytest.approx(1.5)] * 3, "fsdp2": [pytest.approx(2.5)] * 3}
    # what they paid beyond the fit, summed, over the latency part the fit placed in them: the latency's factor
    ddp, fsdp2 = rows["ddp"]["exposed_comm_s"], rows["fsdp2"]["exposed_comm_s"]
    lat = rows["ddp"]["comm_latency_s"] + rows["fsdp2"]["comm_latency_s"]
    assert 0 < lat < ddp + fsdp2
    assert cc["factor"] == pytest.approx(1 + (0.5 * ddp + 1.5 * fsdp2) / lat)
    assert cc["paid_s"] == pytest.approx(3 * (1.5 * ddp + 2.5 * fsdp2))
    assert cc["latency_s"] == pytest.approx(3 * lat)


def test_applied_to_the_exposed_communication_of_probed_runs_at_its_world_size_only(tmp_path):
    _, model, _ = _calibrated(tmp_path, {"ddp": 2.0, "fsdp2": 2.0})
    got = predict_comm_cost.measure(model, [str(tmp_path)], lambda c, progress=None: {r.name: dict(PROBED) for r in c.runs},
                                    predict.predict_run)
    factor = got.comm_cost["factor"]
    assert factor > 2.0  # the whole communication paid twice, put on its latency part alone
    c = config.load_preset("ddp-vs-fsdp", ["world_size=2"], host=CPU)
    for run in c.runs:
        plain, with_factor = (predict.predict_run(c, run, m, probed=PROBED) for m in (model, got))
        assert plain["exposed_comm_s"] > plain["comm_latency_s"] > 0
        extra = (factor - 1) * plain["comm_latency_s"]
        assert with_factor["exposed_comm_s"] == pytest.approx(plain["exposed_comm_s"] + extra)
        assert with_factor["step_time_s"] == pytest.approx(plain["step_time_s"] + extra)
        assert with_factor["compute_s"] == pytest.approx(plain["compute_s"])
        assert with_factor["rest_s"] == pytest.approx(plain["rest_s"])
        assert any(f"communication +{extra * 1e3:,.1f} ms a step, collective latency x{factor:.2f}" in n
                   for n in with_factor["notes"])
    run = dataclasses.replace(c.run("ddp"), world_size=4)
    at4 = [predict.predict_run(c, run, m, probed=PROBED) for m in (model, got)]
    assert at4[1]["step_time_s"] == pytest.approx(at4[0]["step_time_s"])
    assert any("not at 4" in n for n in at4[1]["notes"])
    # a run predicted without a probe gets none
    assert predict.predict_run(c, c.run("ddp"), got)["step_time_s"] == pytest.approx(
        predict.predict_run(c, c.run("ddp"), model)["step_time_s"])
    text = predict.predict_comparison(c, got, probes={r.name: dict(PROBED) for r in c.runs})["assumptions"]
    assert any(f"collective latency x{factor:.2f}" in a and "predict/comm_cost.py" in a for a in text)


def test_large_calls_pay_the_factor_on_their_latency_not_on_their_bytes(tmp_path):
    """the 2026-11-27 bias: a factor fitted on smoke's small calls, applied to a 768-wide model's all-gathers whole, made
    each of fsdp-impls' FSDP runs predicted 16-52% slow. Calls that move more bytes pay a smaller share extra."""
    _, model, _ = _calibrated(tmp_path, {"ddp": 3.0, "fsdp2": 3.0})
    got = predict_comm_cost.measure(model, [str(tmp_path)], lambda c, progress=None: {r.name: dict(PROBED) for r in c.runs},
                                    predict.predict_run)
    small = config.load_preset("smoke", [], host=CPU)
    big = config.load_preset("fsdp-impls", [], host=CPU)
    share = {}
    for c, name in ((small, "fsdp2"), (big, "fsdp2-no-ac")):
        plain, with_factor = (predict.predict_run(c, c.run(name), m, probed=PROBED) for m in (model, got))
        share[c.name] = with_factor["exposed_comm_s"] / plain["exposed_comm_s"]
    assert share["smoke"] == pytest.approx(3.0, rel=0.25)  # the calibration's own kind of run pays what it paid
    assert 1.0 < share["fsdp-impls"] < 0.5 * share["smoke"]


def test_no_factor_on_gpus_without_probes_or_from_steps_that_paid_nothing(tmp_path):
    _, model, _ = _calibrated(tmp_path, {"ddp": 0.0, "fsdp2": 0.0})
    probe = (lambda c, progress=None: {r.name: dict(PROBED) for r in c.runs})
    gpu = dataclasses.replace(model, backend="nccl")
    assert predict_comm_cost.measure(gpu, [str(tmp_path)], probe, predict.predict_run) is gpu
    failed = (lambda c, progress=None: {r.name: {"error": "the probe failed"} for r in c.runs})
    assert predict_comm_cost.measure(model, [str(tmp_path)], failed, predict.predict_run) is model
    # steps that paid nothing for their collectives: a factor of 0 (never negative), not a guess
    assert predict_comm_cost.measure(model, [str(tmp_path)], probe, predict.predict_run).comm_cost["factor"] == 0.0


def test_a_calibration_at_two_world_sizes_gets_its_factor_where_most_runs_are_and_names_the_rest(tmp_path):
    """parity's tensor-parallel runs run at 4 ranks beside the rest at 2: one factor is measured at one world size
    (where most runs are), and the runs at the other are named as left out, not silently dropped."""
    cal = smoke("runs.fsdp2.world_size=4")
    config.dump_json(str(tmp_path / "comparison.json"), cal.to_dict())
    model = _model()
    rows = {r.name: predict.predict_run(cal, r, model, probed=PROBED) for r in cal.runs}
    assert rows["ddp"]["world_size"] == 2 and rows["fsdp2"]["world_size"] == 4
    model.fit_error["runs"] = {name: {"measured_step_s": row["step_time_s"] + row["exposed_comm_s"]}
                               for name, row in rows.items()}  # each paid twice the fit
    got = predict_comm_cost.measure(model, [str(tmp_path)], lambda c, progress=None: {r.name: dict(PROBED) for r in c.runs},
                                    predict.predict_run)
    cc = got.comm_cost
    assert cc["world_size"] == 2 and set(cc["runs"]) == {"ddp"} and cc["left_out"] == {"4": ["fsdp2"]}
    assert cc["factor"] == pytest.approx(1 + rows["ddp"]["exposed_comm_s"] / rows["ddp"]["comm_latency_s"])
    text = predict_comm_cost.assumption(got)
    assert "at 4 ranks (fsdp2) are left out" in text


def test_a_fit_with_no_latency_part_puts_the_excess_on_the_whole_exposed_communication(tmp_path):
    """One message size per type: the fit charges every call's time to bandwidth, its latency part is ~0. A factor on
    that part exploded (x2.3e15 on the pipeline preset, 2026-11-28) and added nothing: the DDP run it calibrated was
    then predicted 52% too fast. The excess goes on the whole exposed communication instead, and says so."""
    cal, model, rows = _calibrated(tmp_path, {"ddp": 3.0, "fsdp2": 3.0})
    model = dataclasses.replace(model, collectives={k: dataclasses.replace(f, step_latency_s=0.0)
                                                    for k, f in model.collectives.items()})
    rows = {r.name: predict.predict_run(cal, r, model, probed=PROBED) for r in cal.runs}
    model.fit_error["runs"] = {name: {"measured_step_s": row["step_time_s"] + 2 * row["exposed_comm_s"]}
                               for name, row in rows.items()}
    got = predict_comm_cost.measure(model, [str(tmp_path)], lambda c, progress=None: {r.name: dict(PROBED) for r in c.runs},
                                    predict.predict_run)
    cc = got.comm_cost
    assert cc["on"] == "exposed" and cc["factor"] == pytest.approx(3.0)
    for run in cal.runs:  # each calibration run predicted back at what it paid
        back = predict.predict_run(cal, run, got, probed=PROBED)
        assert back["step_time_s"] == pytest.approx(model.fit_error["runs"][run.name]["measured_step_s"])
        assert any("exposed communication x3.00" in n and "could not separate" in n for n in back["notes"]), back["notes"]
