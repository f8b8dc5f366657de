"""DeepSpeed ZeRO-1/2/3 against DDP under real torchrun (gloo, 2 CPU ranks, fp32).

Checks: identical step-0 loss, every step's loss and global grad norm within 1e-5 of DDP (with
gradient accumulation and clipping active), and each stage's local model-state bytes: ZeRO-3
at 0.625x DDP in fp32 as DeepSpeed ships it (an extra fp32 copy; 0.5x with shardscope's
``reuse_fp32_partitions`` fix, which steps the parameter partitions in place) and <= 0.55x in bf16-params, ZeRO-1 and ZeRO-2 between ZeRO-3 and DDP. The bf16 ZeRO-3 run also checks
DeepSpeed's bf16 mode on CPU. The config builder is unit-tested without a launch.
"""

from __future__ import annotations

import pytest
import torch

from _launch import grad_norms, launch_all, max_abs_diff, tiny_comparison
from shardscope.config import RunSpec
from shardscope.engines.api import RankContext, TrainSettings
from shardscope.engines.deepspeed_zero import build_config
from shardscope.engines.precision import policy_for

TOL = 1e-5
STAGES = ("deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3")


def _settings(precision: str = "fp32", **kw) -> TrainSettings:
    base = dict(lr=1e-3, weight_decay=0.1, grad_clip=1.0, grad_accum=2, micro_batch_size=3, steps=5,
                warmup_steps=1, precision=policy_for(precision), activation_checkpointing=False, compile=False)
    base.update(kw)
    return TrainSettings(**base)


def _ctx(dp: int = 4) -> RankContext:
    return RankContext(rank=0, world_size=dp, local_rank=0, device=torch.device("cpu"), backend="gloo",
                       dp_size=dp, dp_rank=0)


def test_config_follows_the_settings():
    cfg = build_config(_settings(grad_clip=0.5), _ctx(), stage=2, bucket_mb=1)
    assert cfg["train_micro_batch_size_per_gpu"] == 3 and cfg["gradient_accumulation_steps"] == 2
    assert cfg["gradient_clipping"] == 0.5
    assert cfg["zero_optimization"]["stage"] == 2
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 2**20 // 4
    assert cfg["managed_gradient_accumulation"] is False  # the shared loop owns the step boundary
    assert "bf16" not in cfg and "fp16" not in cfg and "tensor_parallel" not in cfg


@pytest.mark.parametrize("precision, key", [("bf16-params", "bf16"), ("fp16", "fp16"),
                                            ("bf16-autocast", "torch_autocast")])
def test_config_precision_sections(precision, key):
    cfg = build_config(_settings(precision), _ctx(), stage=1)
    assert cfg[key]["enabled"] is True
    if precision == "fp16":
        assert cfg["fp16"]["loss_scale"] == 0  # dynamic loss scaling


def test_stage3_shards_every_parameter():
    cfg = build_config(_settings(), _ctx(), stage=3)
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 0


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = [RunSpec("ddp", "ddp")] + [RunSpec(name, name) for name in STAGES]
    runs.append(RunSpec("zero3-bf16", "deepspeed-zero3", precision="bf16-params"))
    runs.append(RunSpec("zero3-reuse", "deepspeed-zero3", options={"reuse_fp32_partitions": True}))
    comparison = tiny_comparison(runs, steps=6, grad_accum=2, grad_clip=0.5)
    return launch_all(tmp_path_factory.mktemp("zero"), comparison)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the first one pays the module fixture's six runs
@pytest.mark.parametrize("name", STAGES)
def test_zero_matches_ddp(results, name):
    ddp, zero = results["ddp"], results[name]
    assert zero.losses()[0] == ddp.losses()[0]
    assert max_abs_diff(zero.losses(), ddp.losses()) <= TOL
    assert max_abs_diff(grad_norms(zero), grad_norms(ddp)) <= TOL
    assert max(grad_norms(ddp)) > 0.5  # clipping was active, so the reported norm is pre-clip
    for rank in (0, 1):  # each rank's own loss: same samples, same weights at step 0
        assert zero.local_losses(rank)[0] == ddp.local_losses(rank)[0]


def _state_bytes(result) -> int:
    return result.of_kind("memory")[-1]["model_state_bytes"]


@pytest.mark.slow
def test_each_stage_shards_more_model_state(results):
    """fp32, 2 ranks. ZeRO-1/2 keep a separate fp32 master partition even when the parameters are
    fp32, so per parameter: ZeRO-1 4 + 4 + 12/2 = 14 bytes (0.875x DDP's 16), ZeRO-2
    4 + (4 + 12)/2 = 12 (0.75x). ZeRO-3 as DeepSpeed 0.19 ships it (the default) keeps an extra fp32
    copy too: (4 + 4 + 12)/2 = 10 (0.625x); with shardscope's ``reuse_fp32_partitions`` fix on it
    steps its fp32 parameter partitions in place: (4 + 4 + 8)/2 = 8 (0.5x)."""
    ddp = _state_bytes(results["ddp"])
    z1, z2, z3, reuse = (_state_bytes(results[name]) / ddp for name in (*STAGES, "zero3-reuse"))
    assert reuse < z3 < z2 < z1 < 1.0, (z1, z2, z3, reuse)
    for measured, expected in ((z1, 0.875), (z2, 0.75), (z3, 0.625), (reuse, 0.5)):
        assert abs(measured - expected) < 0.03, (z1, z2, z3, reuse)
    assert reuse <= 0.55
    # ZeRO-1 and 2 keep whole parameters; only ZeRO-3 partitions them.
    params = {name: results[name].of_kind("memory")[-1]["param_bytes"] for name in ("ddp", *STAGES)}
    assert params["deepspeed-zero1"] == params["deepspeed-zero2"] == params["ddp"]
    assert params["deepspeed-zero3"] <= 0.55 * params["ddp"]


@pytest.mark.slow
def test_reusing_fp32_partitions_trains_identically_and_is_stated(results):
    """Stepping the parameter partitions in place is the same arithmetic as stepping a copy."""
    copy, reuse = results["deepspeed-zero3"], results["zero3-reuse"]
    assert reuse.losses() == copy.losses() and grad_norms(reuse) == grad_norms(copy)
    assert "in place" in reuse.of_kind("start")[0]["notes"]["fp32_master"]
    assert "separate" in copy.of_kind("start")[0]["notes"]["fp32_master"]


@pytest.mark.slow
def test_zero3_in_mixed_precision_holds_at_most_055_of_ddp(results):
    """The ZeRO paper's setting: bf16 parameters and gradients, fp32 master + moments sharded:
    (2 + 2 + 12)/2 = 8 bytes per parameter against DDP's 16 (DDP keeps fp32 parameters under
    bf16-params and autocasts, so its model state is the fp32 run's)."""
    ratio = _state_bytes(results["zero3-bf16"]) / _state_bytes(results["ddp"])
    assert ratio <= 0.55, ratio


@pytest.mark.slow
def test_bf16_params_hold_bf16_weights_and_fp32_masters(results):
    shipped, reuse, bf16 = results["deepspeed-zero3"], results["zero3-reuse"], results["zero3-bf16"]
    mem32, mem_reuse, mem16 = (r.of_kind("memory")[-1] for r in (shipped, reuse, bf16))
    assert mem16["param_bytes"] == mem32["param_bytes"] // 2  # bf16 parameter partitions
    # bf16 and fp32 as DeepSpeed ships it: fp32 master + 2 moments; fp32 with the reuse fix (partitions
    # stepped in place): 2 moments (+ AdamW's step counters)
    assert mem16["optim_bytes"] == mem32["optim_bytes"]
    assert abs(mem16["optim_bytes"] / mem_reuse["optim_bytes"] - 1.5) < 0.01, (mem16["optim_bytes"],
                                                                              mem_reuse["optim_bytes"])
    assert bf16.of_kind("start")[0]["notes"]["deepspeed_config"]["bf16"] == {"enabled": True}
    # bf16 rounding, not a different model: close to the fp32 run, and it trains.
    assert max_abs_diff(bf16.losses(), results["ddp"].losses()) < 0.05
