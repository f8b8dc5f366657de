"""Divergence locator: a planted difference found at the right step and layer, with its cause;
and a real tiny pair (fp32 vs bf16 autocast) run under torchrun."""

from __future__ import annotations

import json

import pytest

from shardscope import config
from shardscope.core import events
from shardscope.config import RunSpec
from shardscope.profiling.state import RunState
from shardscope.analysis import divergence

LAYERS = ["tok_emb", "layers.0", "layers.1", "lm_head"]


def _records(run: str, *, clip: float, plant_at: int | None) -> list[dict]:
    """Six steps of step/layers records; from ``plant_at`` on, layers.1 and lm_head gradients
    (and then the loss) move away, as when clipping stops holding a spike down."""
    out = [events.make_record("start", run, 0, world_size=2, device="cpu", backend="gloo",
                              precision={"policy": "fp32", "reduce": "float32"},
                              spec={"strategy": "ddp", "options": {}}, notes={"grad_clip": clip}, params=1000)]
    for step in range(6):
        drift = 0.0 if plant_at is None or step < plant_at else 0.05 * (step - plant_at + 1)
        out.append(events.make_record("step", run, 0, step=step, loss=5.0 - 0.1 * step + drift, tokens=64,
                                      tokens_per_s=1000.0))
        grads = {name: 1.0 + 0.1 * i for i, name in enumerate(LAYERS)}
        if drift:
            grads["layers.1"] *= 1.001
            grads["lm_head"] *= 1.5
        params = {name: 10.0 + i for i, name in enumerate(LAYERS)}
        out.append(events.make_record("layers", run, 0, step=step, grad_norms=grads, param_norms=params))
    return out


def _state(name: str, records: list[dict]) -> RunState:
    st = RunState(name=name, strategy="ddp", world_size=2, precision="fp32")
    for r in records:
        st.apply_record(r)
    return st


def test_planted_clipping_difference_is_located():
    base_recs, run_recs = _records("ddp", clip=1.0, plant_at=None), _records("noclip", clip=0.0, plant_at=3)
    comparison = config.Comparison(name="t", runs=[RunSpec("ddp", "ddp"), RunSpec("noclip", "ddp")], baseline="ddp")
    states = {"ddp": _state("ddp", base_recs), "noclip": _state("noclip", run_recs)}
    layers = {name: {r["step"]: r for r in recs if r["kind"] == "layers"}
              for name, recs in (("ddp", base_recs), ("noclip", run_recs))}
    section = divergence.parity_section(comparison, states, layers)
    entry = section["runs"]["noclip"]
    assert section["baseline"] == "ddp" and entry["diverged"]
    assert entry["first_loss_step"] == 3
    grad = entry["first_grad_layer"]
    assert (grad["step"], grad["layer"], grad["worst_layer"]) == (3, "layers.1", "lm_head")
    assert grad["layers"] == ["layers.1", "lm_head"]
    assert entry["first_param_layer"] is None
    assert any("gradient clipping differs" in c for c in entry["likely_causes"])
    assert "step 3" in entry["finding"] and "layers.1" in entry["finding"] and "clipping" in entry["finding"]


def test_identical_runs_do_not_diverge_and_missing_layers_are_said():
    recs = _records("a", clip=1.0, plant_at=None)
    entry = divergence.compare_runs([(s, 1.0) for s in range(3)], [(s, 1.0) for s in range(3)], {}, {}, {}, {},
                                    tolerance=1e-5, layer_rtol=1e-4)
    assert not entry["diverged"] and "parity = true" in entry["finding"]
    assert divergence.likely_causes(recs[0], recs[0]) == []


def test_precision_and_reduce_dtype_named_as_causes():
    base = {"precision": {"policy": "fp32", "reduce": "float32"}, "spec": {"strategy": "fsdp2", "options": {"reduce_dtype": "auto"}}}
    run = {"precision": {"policy": "bf16-params", "reduce": "bfloat16"}, "spec": {"strategy": "fsdp2", "options": {"reduce_dtype": "bf16"}}}
    causes = divergence.likely_causes(base, run)
    assert causes[0].startswith("precision policy differs")
    assert any("reduction dtype" in c for c in causes) and any("reduce_dtype" in c for c in causes)


def test_read_layers_from_rank_files(tmp_path):
    run_dir = tmp_path / "noclip"
    with events.RecordWriter(run_dir / "metrics" / "rank0.jsonl", "noclip", 0) as w:
        for r in _records("noclip", clip=0.0, plant_at=3):
            w.write(r["kind"], **{k: v for k, v in r.items() if k not in events.COMMON_KEYS})
    layers = divergence.read_layers(str(run_dir))
    assert sorted(layers) == list(range(6)) and layers[4]["grad_norms"]["lm_head"] > 1.5


@pytest.mark.slow
def test_real_pair_fp32_vs_bf16_autocast(tmp_path):
    from tests._launch import assert_ok, launch, prepare, tiny_comparison

    from shardscope.analysis import fold

    comparison = tiny_comparison([RunSpec("fp32", "ddp"), RunSpec("bf16", "ddp", precision="bf16-autocast")],
                                 steps=3, parity=True)
    out = prepare(tmp_path, comparison)
    for run in ("fp32", "bf16"):
        assert_ok(launch(out, comparison, run))
    states = fold.replay_states(str(out))
    layers = {name: divergence.read_layers(str(out / name)) for name in states}
    assert layers["fp32"] and layers["bf16"], "parity mode wrote no layers records"
    entry = divergence.parity_section(comparison, states, layers)["runs"]["bf16"]
    assert entry["diverged"] and entry["first_loss_step"] == 0
    assert entry["first_grad_layer"] is not None and entry["first_grad_layer"]["step"] == 0
    assert entry["likely_causes"][0].startswith("precision policy differs")
    json.dumps(entry)  # the summary section is plain JSON
