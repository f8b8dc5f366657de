"""Memory model against exact accounting: real models' parameters, real FSDP2 sharding on a fake
process group (world sizes 1, 2, 4, in one process), and the estimate table."""

from __future__ import annotations

import importlib.util

import pytest

from shardscope import config
from shardscope.config import ModelSpec, RunSpec
from shardscope.profiling import comm_theory, estimate, memory_model

torch = pytest.importorskip("torch")

# Dimensions that do not divide by 4, so dim-0 chunks are uneven across ranks.
UNEVEN = ModelSpec(vocab_size=250, d_model=36, n_layers=2, n_heads=4, d_ff=100, seq_len=30)


def _comparison(model: ModelSpec, *runs: RunSpec, ws: int = 2) -> config.Comparison:
    c = config.Comparison(name="t", model=model, runs=list(runs), world_size=ws, global_batch=8,
                          profile=config.ProfileSpec(enabled=False))
    c = config.validate(c)
    return c


@pytest.mark.parametrize("spec", [
    ModelSpec(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=256, seq_len=64),
    UNEVEN,
    ModelSpec(kind="vit", d_model=48, n_layers=2, n_heads=4, d_ff=96, image_size=32, patch_size=4),
    pytest.param(ModelSpec(kind="hf", hf_layers=1), marks=[pytest.mark.slow, pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None, reason="needs transformers")]),  # 136 M embedding: ~15 s
])
def test_parameter_shapes_match_the_real_model(spec):
    from shardscope.engines.model import build_model

    model = build_model(spec, 0)
    real = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    assert real == [(p.name, p.shape) for p in memory_model.model_params(spec)]
    assert memory_model.param_count(spec) == sum(p.numel() for p in model.parameters())


def _exact_states(model, optimizer):
    from shardscope.engines import memory_accounting

    x = torch.randint(0, UNEVEN.vocab_size, (2, UNEVEN.seq_len))
    model(x).float().mean().backward()
    optimizer.step()
    return memory_accounting.model_state_bytes(list(model.parameters()), optimizer)


def test_replicated_states_are_exact():
    from shardscope.engines.model import build_transformer

    c = _comparison(UNEVEN, RunSpec("ddp", "ddp"), ws=1)
    model = build_transformer(UNEVEN, 0)
    exact = _exact_states(model, torch.optim.AdamW(model.parameters()))
    layout = memory_model.layout_for(c, c.runs[0])
    predicted = memory_model.model_state_bytes(memory_model.model_params(UNEVEN), layout)
    assert {k: predicted[k] for k in exact} == exact


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_fsdp2_shards_are_exact_on_every_rank(ws):
    """Real fully_shard on a fake process group: every rank's local shards, grads and AdamW state."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardscope.engines.model import build_transformer

    c = _comparison(UNEVEN, RunSpec("fsdp2", "fsdp2"), ws=ws)
    params = memory_model.model_params(UNEVEN)
    layout = memory_model.layout_for(c, c.runs[0], notes={"shard_layout": "per-parameter"})  # FSDP2's DTensors
    for rank in sorted({0, ws - 1}):
        dist.init_process_group("fake", rank=rank, world_size=ws, store=FakeStore())
        try:
            model = build_transformer(UNEVEN, 0)
            for block in model.layers:
                fully_shard(block)
            fully_shard(model)
            exact = _exact_states(model, torch.optim.AdamW(model.parameters()))
        finally:
            dist.destroy_process_group()
        predicted = memory_model.model_state_bytes(params, layout, rank)
        assert {k: predicted[k] for k in exact} == exact, f"ws {ws} rank {rank}"


def test_sharding_levels_follow_the_reference_table():
    """fp32 AdamW: 16 bytes per parameter replicated; optimizer, then grads, then params divided by N."""
    spec = ModelSpec(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=256, seq_len=64)
    psi = memory_model.param_count(spec)
    params = memory_model.model_params(spec)
    n = 4
    for shards, expected in (("none", 16 * psi), ("optim", 8 * psi + 8 * psi / n), ("grads", 4 * psi + 12 * psi / n),
                             ("all", 16 * psi / n)):
        layout = memory_model.Layout(n, 1, n, shards, "fp32", False, False)
        got = memory_model.model_state_bytes(params, layout)["model_state_bytes"]
        assert got == pytest.approx(expected, rel=0.01), shards


def test_tensor_parallel_splits_projections_only():
    spec = ModelSpec(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=256, seq_len=64)
    params = memory_model.model_params(spec)
    full = memory_model.model_state_bytes(params, memory_model.Layout(2, 1, 2, "none", "fp32", False, False))
    tp2 = memory_model.model_state_bytes(params, memory_model.Layout(2, 2, 1, "none", "fp32", False, False))
    d, f, layers = 64, 256, 2
    split = layers * (4 * d * d + 3 * d + 2 * d * f + f)  # weights + column-parallel biases
    assert full["param_bytes"] - tp2["param_bytes"] == split // 2 * 4


def test_estimate_table_and_fit():
    c = _comparison(ModelSpec(), RunSpec("ddp", "ddp"), RunSpec("fsdp2-full-shard", "fsdp2"),
                    RunSpec("fsdp2-no-reshard", "fsdp2", options={"reshard_after_forward": False}))
    rows = estimate.estimate_table(c, 4, device_memory_bytes=2 ** 30)
    by_name = {r["run"]: r for r in rows}
    assert by_name["ddp"]["model_state_bytes"] == pytest.approx(16 * 91_877_376, rel=1e-4)
    assert by_name["fsdp2-full-shard"]["model_state_bytes"] == pytest.approx(4 * 91_877_376, rel=1e-3)
    assert by_name["ddp"]["fits"] is False and by_name["fsdp2-full-shard"]["fits"] is True
    assert by_name["fsdp2-no-reshard"]["gathered_unit_bytes"] > by_name["fsdp2-full-shard"]["gathered_unit_bytes"]
    assert all(r["activation_bytes"] > 0 for r in rows)


def test_checkpointing_shrinks_predicted_activations():
    c = _comparison(ModelSpec(), RunSpec("a", "ddp"), RunSpec("b", "ddp", activation_checkpointing=True))
    a, b = memory_model.predict_comparison(c)
    assert b["activation_bytes"] < a["activation_bytes"] and a["model_state_bytes"] == b["model_state_bytes"]


def test_expected_comm_from_a_spec_payload(tmp_path):
    c = _comparison(UNEVEN, RunSpec("ddp", "ddp"), RunSpec("fsdp2", "fsdp2"),
                    RunSpec("keep", "fsdp2", options={"reshard_after_forward": False}))
    psi = memory_model.param_count(UNEVEN)
    got = {r.name: comm_theory.expected_comm(config.run_spec_payload(c, r, out_dir=str(tmp_path), device="cpu"))
           for r in c.runs}
    assert got["ddp"]["bytes_per_step"] == 4 * psi
    root = memory_model.unit_numels(memory_model.model_params(UNEVEN))["root"]  # kept gathered into backward
    assert got["fsdp2"]["bytes_per_step"] == 4 * (3 * psi - root)
    assert got["keep"]["bytes_per_step"] == 2 * 4 * psi


def test_flops_per_token_follows_torchtitan():
    spec = ModelSpec()
    n, emb = memory_model.param_count(spec), spec.vocab_size * spec.d_model + spec.seq_len * spec.d_model
    assert memory_model.flops_per_token(spec) == 6 * (n - emb) + 12 * 6 * 12 * 64 * 256


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3",
                                      "fsdp-handwritten", "fsdp1"])
def test_prediction_matches_real_runs_on_every_rank_at_4(strategy, tmp_path):
    """Real torchrun at world size 4 (gloo, the uneven model): every rank's exact model-state bytes
    (its ``memory`` record) against the model's prediction for that rank, within 3% (the issue's
    target). ZeRO-2 is the one whose ranks differ: it keeps the whole gradient of every tensor its
    partition touches."""
    from _launch import launch_all, tiny_comparison

    pytest.importorskip("deepspeed") if strategy.startswith("deepspeed") else None
    c = tiny_comparison([RunSpec("run", strategy, world_size=4)], model=UNEVEN, steps=2, global_batch=4)
    result = launch_all(tmp_path, c)["run"]
    layout = memory_model.layout_for(c, c.runs[0])
    params = memory_model.model_params(UNEVEN)
    for rank in range(4):
        measured = result.of_kind("memory", rank)[-1]["model_state_bytes"]
        predicted = memory_model.model_state_bytes(params, layout, rank)["model_state_bytes"]
        assert abs(predicted - measured) <= 0.03 * measured, (rank, predicted, measured)


@pytest.mark.parametrize("ws", [2, 8])
def test_traced_estimate_agrees_with_the_model_for_fsdp2(ws):
    """``estimate --traced``: the real fully_shard on rank 0 of a fake ``ws``-rank group, fake
    tensors, two steps under torch's FSDPMemTracker. Its resident model states equal the memory
    model's exactly (which the real runs above confirm at 4 ranks); the traced peak is above them."""
    c = _comparison(UNEVEN, RunSpec("fsdp2", "fsdp2"), RunSpec("ddp", "ddp"), ws=ws)
    traced = estimate.traced_estimates(c, ws, timeout_s=300)
    fsdp2 = traced["fsdp2"]
    predicted = memory_model.model_state_bytes(memory_model.model_params(UNEVEN), memory_model.layout_for(c, c.runs[0]))
    for key in ("param_bytes", "grad_bytes", "optim_bytes", "model_state_bytes"):
        assert fsdp2[key] == predicted[key], (key, fsdp2[key], predicted[key])
    assert fsdp2["peak_bytes"] > fsdp2["model_state_bytes"]
    assert "not traceable" in traced["ddp"]["error"]


def test_estimate_traced_command(shardscope_cmd):
    import subprocess

    proc = subprocess.run([*shardscope_cmd, "estimate", "--preset", "smoke", "--world-size", "8", "--traced"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "traced states" in proc.stdout and "fsdp2: traced on rank 0 of a fake 8-rank group" in proc.stdout
    assert "(+0.00% vs analytic)" in proc.stdout
    assert "ddp: traced: not traceable" in proc.stdout
