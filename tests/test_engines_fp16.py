"""End to end: fp16 autocast with dynamic loss scaling (``precision = "fp16"``) on CPU with gloo.

torch's CPU autocast computes in fp16 on any x86 CPU, so the loss-scaling path (scale the loss,
unscale the local gradient shards, agree on overflow across ranks, skip and halve) runs here for
every torch strategy: DDP, FSDP1, FSDP2, the hand-written FSDP and FSDP2 + DTensor TP (whose
gradients are DTensors on two meshes). DeepSpeed's fp16 needs a GPU or an AVX512-FP16 CPU.

Tolerances, measured on this 2-core VM with the tiny model (6 steps): fp16 strategies vs fp16 DDP
<= 2.1e-5 (different reduction orders of the same fp16 products), fp16 vs fp32 DDP 6.5e-4 (fp16
has 10 mantissa bits). They are asserted at 1e-4 and 2e-2 (the bf16 bound of the parity spec).
"""

from __future__ import annotations

import math

import pytest
import torch

from _launch import grad_norms, launch_all, max_abs_diff, tiny_comparison
from shardscope.config import RunSpec
from shardscope.engines.optim import LossScaler

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # a module fixture of several runs counts against its first test

FP16_RUNS = ["ddp16", "fsdp2", "fsdp1", "hw", "fsdp2-tp"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = [RunSpec("ddp32", "ddp", precision="fp32"), RunSpec("ddp16", "ddp"), RunSpec("fsdp2", "fsdp2"),
            RunSpec("fsdp1", "fsdp1"), RunSpec("hw", "fsdp-handwritten"),
            RunSpec("fsdp2-tp", "fsdp2-tp", world_size=4, options={"tp": 2})]
    comparison = tiny_comparison(runs, steps=6, precision="fp16", parity=True)
    return launch_all(tmp_path_factory.mktemp("fp16"), comparison)


@pytest.mark.parametrize("name", FP16_RUNS)
def test_start_record_states_fp16_with_loss_scaling(results, name):
    precision = results[name].of_kind("start")[0]["precision"]
    assert precision["policy"] == "fp16" and precision["compute"] == "float16"
    assert precision["loss_scaling"] == "true" and precision["master"] == "float32"


@pytest.mark.parametrize("name", FP16_RUNS[1:])
def test_fp16_strategies_track_fp16_ddp(results, name):
    base, other = results["ddp16"], results[name]
    measured = max_abs_diff(other.losses(), base.losses())
    print(f"fp16 {name} vs fp16 ddp: max |dloss| = {measured:.2e}")
    assert measured <= 1e-4
    assert max_abs_diff(grad_norms(other), grad_norms(base)) <= 1e-4
    assert not any(s.get("skipped") for s in other.steps())


def test_fp16_is_really_fp16_and_close_to_fp32(results):
    fp32, fp16 = results["ddp32"].losses(), results["ddp16"].losses()
    measured = max_abs_diff(fp16, fp32)
    print(f"fp16 ddp vs fp32 ddp: max |dloss| = {measured:.2e}")
    assert 0 < measured <= 2e-2  # not bit-identical: the compute really ran in fp16
    assert fp16[-1] < fp16[0]


def test_layer_norms_are_of_unscaled_gradients(results):
    """The divergence locator's per-layer grad norms are read after unscaling (a scale of 2^16
    left in would make them ~65536x fp32's)."""
    for a, b in zip(results["ddp32"].of_kind("layers"), results["ddp16"].of_kind("layers")):
        for layer, value in a["grad_norms"].items():
            assert math.isclose(b["grad_norms"][layer], value, rel_tol=0.05), (a["step"], layer)


def test_loss_scaler_skips_and_halves_on_overflow_then_grows():
    """LossScaler alone (one process, no process group): inf gradients -> skip and halve;
    ``growth_interval`` finite steps -> double."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    p.grad = torch.tensor([8.0, float("inf"), 0.0])
    finite = scaler.unscale_and_check(opt)
    scaler.update(finite)
    assert not finite and scaler.scale == 4.0
    for _ in range(2):
        p.grad = torch.tensor([4.0, 8.0, 0.0])
        finite = scaler.unscale_and_check(opt)
        assert finite and torch.equal(p.grad, torch.tensor([1.0, 2.0, 0.0]))
        scaler.update(finite)
    assert scaler.scale == 8.0
