"""shardscope why, piece by piece and without torchrun: suspects and variants, the round's comparison, the
module comparison, the verdict, the registry's declarations and the fingerprints the probe takes."""

from __future__ import annotations

import math

import pytest

from shardscope import config
from shardscope.core import registry
from shardscope.config import ConfigError, ModelSpec, ProfileSpec, RunSpec
from shardscope.analysis.why import verdict as why, probe as why_probe, variants as why_variants
from shardscope.analysis.why.verdict import Plan

F32 = {"precision": {"policy": "fp32", "param": "float32", "compute": "float32", "reduce": "float32",
                     "master": "float32", "loss_scaling": "false"}}


def comparison(*runs: RunSpec, **kw) -> config.Comparison:
    fields = dict(name="t", steps=6, global_batch=4, world_size=2, profile=ProfileSpec(enabled=False),
                  model=ModelSpec(vocab_size=128, d_model=32, n_layers=2, n_heads=4, d_ff=64, seq_len=16))
    fields.update(kw)
    return config.validate(config.Comparison(runs=[RunSpec("ddp", "ddp"), *runs], **fields))


def variants_of(c: config.Comparison, name: str, run_start=F32, base_start=F32) -> list[why_variants.Variant]:
    return why_variants.suspects(c, c.run(name), c.run("ddp"), base_start, run_start)


def test_each_setting_that_differs_is_one_variant_towards_the_baseline():
    c = comparison(RunSpec("r", "fsdp2", options={"reduce_dtype": "bf16"}),
                   RunSpec("two", "fsdp2", precision="bf16-params", activation_checkpointing=True,
                           options={"param_dtype": "bf16", "grad_accum_loss": "sum"}),
                   RunSpec("same", "fsdp2"), RunSpec("clip", "deepspeed-zero1", options={"gradient_clipping": 0.5}))
    (reduce,) = variants_of(c, "r")
    assert reduce.settings == ["reduce dtype"] and reduce.changes == {"options": {"reduce_dtype": "fp32"}}
    assert reduce.describe == "reduce_dtype bf16 -> fp32" and "reduce-scatters" in reduce.quirk
    assert variants_of(c, "same") == []  # "auto" under fp32 is fp32: nothing to change
    bf16 = {"precision": {**F32["precision"], "policy": "bf16-params", "param": "bfloat16", "compute": "bfloat16"}}
    found = variants_of(c, "two", run_start=bf16)
    assert [v.settings[0] for v in found] == ["precision policy", "activation checkpointing", "parameter dtype",
                                               "gradient-accumulation semantics"]
    assert found[0].changes == {"precision": "fp32"} and "compute dtype bfloat16 vs float32" in found[0].quirk
    assert found[3].changes == {"options": {"grad_accum_loss": "mean"}}
    assert [v.settings[0] for v in variants_of(c, "clip")] == ["clipping", "optimizer implementation"]
    assert variants_of(c, "clip")[0].changes == {"options": {"gradient_clipping": -1.0}}
    # without start records, a dtype moves back to "auto": the run's own policy, the baseline's here
    assert variants_of(c, "r", run_start={}, base_start={})[0].changes == {"options": {"reduce_dtype": "auto"}}


def test_pairs_combine_two_changes_and_skip_conflicts():
    a = why_variants.Variant("why-a", ["a"], {"options": {"x": 1}}, "x 0 -> 1")
    b = why_variants.Variant("why-b", ["b"], {"options": {"y": 1}}, "y 0 -> 1")
    same = why_variants.Variant("why-c", ["c"], {"options": {"x": 2}}, "x 0 -> 2")
    pairs = why_variants.pairs([a, b, same], {"why-b": 0.1, "why-a": 0.5, "why-c": 0.9})
    assert [p.name for p in pairs] == ["why-b.a", "why-b.c"]  # a and c both set x: no pair
    assert pairs[0].changes == {"options": {"y": 1, "x": 1}} and pairs[0].settings == ["b", "a"]


def test_a_round_is_a_valid_short_comparison_on_the_original_schedule():
    c = comparison(RunSpec("r", "fsdp2", options={"reduce_dtype": "bf16"}, fault="rank=1,step=5,kind=raise"),
                   steps=30)
    (v,) = variants_of(c, "r")
    steps = why_variants.window(2, c.steps)
    r = why_variants.round_comparison(c, c.run("ddp"), c.run("r"), [v], steps=steps, probe_step=2, name="why-r-r1")
    r = config.validate(r)
    assert (steps, r.steps, r.schedule_steps, r.parity, r.profile.enabled) == (6, 6, 30, True, False)
    assert [(x.name, x.probe_step, x.fault) for x in r.runs] == [
        ("ddp", 2, ""), ("r", 2, "rank=1,step=5,kind=raise"), ("why-reduce-dtype", -1, "")]
    assert r.run("why-reduce-dtype").options["reduce_dtype"] == "fp32"
    later = why_variants.round_comparison(c, c.run("ddp"), c.run("r"), [v], steps=steps, probe_step=None, name="x")
    assert [x.name for x in later.runs] == ["ddp", "why-reduce-dtype"]


def test_the_loop_option_and_why_settings_are_validated():
    c = comparison(RunSpec("s", "fsdp-handwritten", options={"grad_accum_loss": "sum"}))
    assert c.run("s").options == {"grad_accum_loss": "sum"}
    assert "grad_accum_loss" not in config.resolved_options(c.run("ddp"))  # a loop option is not filled in
    with pytest.raises(ConfigError, match="grad_accum_loss = 'twice'.*one of 'mean', 'sum'"):
        comparison(RunSpec("s", "ddp", options={"grad_accum_loss": "twice"}))
    with pytest.raises(ConfigError, match="allowed: .*grad_accum_loss"):
        comparison(RunSpec("s", "ddp", options={"nope": 1}))
    with pytest.raises(ConfigError, match="probe_step = 6"):
        comparison(RunSpec("s", "ddp", probe_step=6))
    with pytest.raises(ConfigError, match="schedule_steps = 3"):
        comparison(schedule_steps=3)


def test_every_declared_suspect_names_an_option_its_strategy_takes():
    for info in registry.STRATEGIES.values():
        for suspect in (*info.suspects, *registry.LOOP_SUSPECTS):
            spec = info.option(suspect.option)
            assert spec is not None, (info.name, suspect.option)
            if spec.choices and not str(suspect.towards).startswith("baseline:"):
                assert suspect.towards in spec.choices, (info.name, suspect)
        assert info.probe_grads in ("", "tensors", "summon", "deepspeed")


def entry(name, norm, proj=(1.0, 2.0), digest="h", numel=4, dtype="float32"):
    return [name, norm, list(proj), digest, numel, dtype]


def probes(forward, grads=None, note=""):
    return {"forward": {0: forward}, "grads": grads, "grads_note": note}


def test_the_first_module_to_differ_and_in_which_phase():
    same = [entry("emb", 1.0), entry("head", 2.0)]
    grads = [entry("emb", 1.0), entry("head", 2.0)]
    off_grads = [entry("emb", 1.0, digest="x"), entry("head", 2.0, (1.0, 2.5), digest="y")]
    found = why_probe.first_difference({0: probes(same, grads)}, {0: probes(same, off_grads)}, 1e-4)
    assert (found["step"], found["phase"], found["module"]) == (0, "backward", "head")  # backward runs head first
    assert "bitwise equal" in found["finding"] and math.isclose(found["rel"], 0.25)
    # step 0 matched entirely; step 1's outputs differ: the update did it
    moved = [entry("emb", 1.0, (1.0, 2.001), digest="z"), entry("head", 2.0, digest="w")]
    found = why_probe.first_difference({0: probes(same, grads), 1: probes(same, grads)},
                                       {0: probes(same, grads), 1: probes(moved, grads)}, 1e-4)
    assert (found["step"], found["phase"], found["module"], found["seen_at"]) == (0, "optimizer step", "emb", 1)
    # gradients not probed: say so instead of blaming the update
    found = why_probe.first_difference({0: probes(same, None, "flat"), 1: probes(same, None, "flat")},
                                       {0: probes(same, None, "flat"), 1: probes(moved, None, "flat")}, 1e-4)
    assert found["phase"] == "forward" and found["step"] == 1 and "(flat)" in found["finding"]
    # float noise is not a difference; a tensor-parallel shard is not comparable
    noise = [entry("emb", 1.0 + 1e-7, digest="n"), entry("head", 2.0, numel=2, digest="m")]
    found = why_probe.first_difference({0: probes(same)}, {0: probes(noise)}, 1e-4)
    assert not found["found"] and "matched within float noise" in found["finding"] and "head" in found["notes"][0]
    assert why_probe.score(entry("a", 1.0), entry("a", math.nan, digest="q")) == math.inf


def plan(**kw) -> Plan:
    c = comparison(RunSpec("r", "fsdp2", options={"reduce_dtype": "bf16", "param_dtype": "bf16"}))
    fields = dict(out_dir="DIR", run="r", baseline="ddp", tolerance=1e-5, comparison=c,
                  original={"max_abs": 3e-4, "mean_abs": 1e-4, "steps": 6}, within=False, first_step=1, steps=5,
                  singles=variants_of(c, "r"))
    fields.update(kw)
    return Plan(**fields)


def gap(max_abs, status="ok"):
    return {"status": status, "error": "", "max_abs": max_abs, "mean_abs": max_abs, "steps": 5, "grad_rel": 0.1,
            "grad_layer": "lm_head", "init_sha256": "abc"}


def test_the_verdict_names_the_change_that_closes_the_gap_or_says_none_does():
    p = plan(init_sha256="abc")
    singles = p.singles
    gaps = {"ddp": gap(0.0), "r": gap(3e-4), singles[0].name: gap(2e-4), singles[1].name: gap(0.0)}
    res = why.result(p, [("DIR/why/r/round1", singles)], gaps, None)
    assert (res["status"], res["cause"], res["gap_after"]["max_abs"]) == ("explained", "reduce dtype", 0.0)
    assert res["gap_before"]["max_abs"] == 3e-4 and res["same_initial_weights"] is True
    assert [v["within"] for v in res["variants"]] == [False, True]
    gaps[singles[1].name] = gap(1e-4)
    res = why.result(p, [("DIR/why/r/round1", singles)], gaps, None)
    assert res["status"] == "not explained" and res["cause"] is None and "closest" in res["message"]
    pair = why_variants.pairs(singles, {})[0]
    res = why.result(p, [("r1", singles), ("r2", [pair])], {**gaps, pair.name: gap(0.0)}, None)
    assert res["cause"] == "parameter dtype + reduce dtype" and res["variants"][-1]["round"] == 2
    assert why.result(p, [("r1", singles)], {**gaps, "r": gap(1e-6)}, None)["status"] == "not reproduced"
    assert why.result(p, [("r1", singles)], {**gaps, "ddp": gap(None, "failed")}, None)["status"] == "failed"
    res = why.result(plan(singles=[]), [("r1", [])], {"ddp": gap(0.0), "r": gap(3e-4)}, None)
    assert res["status"] == "not explained" and "no setting" in res["message"]
    text = why.markdown(why.result(p, [("r1", singles), ("r2", [pair])], {**gaps, pair.name: gap(0.0)}, None))
    assert text.startswith("## Why r differs from ddp") and "| as it is (before) |" in text
    nothing = why.nothing_to_explain(plan(within=True, original={"max_abs": 0.0, "mean_abs": 0.0, "steps": 6}))
    assert nothing["message"].startswith("nothing to explain: within tolerance") and nothing["cause"] is None


def test_fingerprints_see_rounding_that_norms_hide():
    torch = pytest.importorskip("torch")
    from shardscope.engines.module_probe import Fingerprint

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    rounded = x.bfloat16().float()
    a, b, c = Fingerprint(), Fingerprint(), Fingerprint()
    a.add(x)
    b.add(x.clone())
    c.add(rounded)
    ea, eb, ec = a.entry("m"), b.entry("m"), c.entry("m")
    assert why_probe.score(ea, eb) == 0.0 and ea[3] == eb[3]
    assert abs(ea[1] - ec[1]) / ea[1] < 1e-4  # the norms alone would call them equal ...
    assert why_probe.score(ea, ec) > 1e-4  # ... the projections do not


def test_why_keeps_its_files_under_the_comparison(tmp_path):
    from shardscope.core.rundir import RunDir

    out = RunDir(str(tmp_path))
    assert out.why_dir("r") == str(tmp_path / "why" / "r")
    assert out.why_round("r", 2) == str(tmp_path / "why" / "r" / "round2")
    assert out.why_result("r") == str(tmp_path / "why" / "r" / "why.json")
    assert out.why_results() == [] and why.report_section(str(tmp_path)) == "" and why.report_section("") == ""
    (tmp_path / "why" / "r").mkdir(parents=True)
    (tmp_path / "why" / "r" / "why.json").write_text("{")
    assert "unreadable" in why.report_section(str(tmp_path))
