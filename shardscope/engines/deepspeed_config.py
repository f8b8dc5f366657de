"""The DeepSpeed config generated from shardscope's settings (ZeRO stage, buckets, precision, AutoTP).

Never hand-written: micro-batch, gradient accumulation, clipping and precision come from the
comparison's settings, so a ZeRO or AutoTP run trains exactly what the DDP baseline trains.
Plain dicts; nothing here imports DeepSpeed.
"""

from __future__ import annotations

from typing import Any

from shardscope.engines.api import RankContext, TrainSettings


def precision_config(settings: TrainSettings) -> dict[str, Any]:
    """Return the DeepSpeed config keys that implement ``settings.precision``.

    - ``fp32``: nothing (fp32 params, grads, master weights and reduction).
    - ``bf16-params``: DeepSpeed's ``bf16`` mode: bf16 parameters and gradients, fp32 master
      weights in the optimizer, gradients reduced in fp32 (``bf16.bf16_master_weights_and_grads``
      off, ``communication_data_type`` fp32) as the policy's reduce dtype asks.
    - ``bf16-autocast``: fp32 parameters, forward under ``torch.autocast(bfloat16)``
      (DeepSpeed's ``torch_autocast`` section).
    - ``fp16``: fp16 parameters with dynamic loss scaling (``loss_scale = 0``) and fp32 master
      weights.
    Raises ValueError for an unknown policy name.
    """
    name = settings.precision.name
    if name == "fp32":
        return {}
    if name == "bf16-params":
        return {"bf16": {"enabled": True}, "communication_data_type": "fp32"}
    if name == "bf16-autocast":
        return {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    if name == "fp16":
        return {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                         "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}}
    raise ValueError(f"precision {name!r}: DeepSpeed strategies support fp32, bf16-params, bf16-autocast, fp16")


def build_config(
    settings: TrainSettings,
    ctx: RankContext,
    *,
    stage: int,
    bucket_mb: int = 25,
    tensor_parallel: int = 1,
) -> dict[str, Any]:
    """Return the DeepSpeed config dict for these settings and ZeRO ``stage`` (0-3).

    DeepSpeed derives ``train_batch_size`` (micro-batch x grad_accum x its data-parallel size, the
    comparison's global batch); stating it would fail under AutoTP, whose config check counts
    every rank as data-parallel before the TP groups exist. Gradient accumulation is left to the caller
    (``managed_gradient_accumulation = false``): the shared loop decides when a step ends.
    ``bucket_mb`` sizes the reduce and all-gather buckets (DeepSpeed's defaults, 5e8 elements,
    would allocate gigabytes of buffers for a tiny model). ``tensor_parallel`` > 1 turns on
    AutoTP with that degree.
    """
    elements = max(1, bucket_mb * 2**20 // 4)
    zero: dict[str, Any] = {
        "stage": stage,
        "reduce_bucket_size": elements,
        "allgather_bucket_size": elements,
        "contiguous_gradients": True,
        # Unmanaged accumulation only allows overlapped communication in stage 2; overlap
        # changes nothing numerically, so keep it off everywhere for comparable runs.
        "overlap_comm": False,
    }
    if stage == 3:
        zero.update({
            "stage3_prefetch_bucket_size": elements,
            "stage3_param_persistence_threshold": 0,  # shard every parameter, even small ones
            "stage3_max_live_parameters": elements,
        })
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": settings.micro_batch_size,
        "gradient_accumulation_steps": settings.grad_accum,
        "managed_gradient_accumulation": False,
        "gradient_clipping": float(settings.grad_clip),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,  # the loop reports; keep DeepSpeed's own log quiet
        "wall_clock_breakdown": False,
    }
    config.update(precision_config(settings))
    if tensor_parallel > 1:
        # Full-vocabulary logits: the shared loop computes the loss from them. (DeepSpeed would
        # otherwise split a tied LM head by vocabulary and expect its own distributed loss.)
        config["tensor_parallel"] = {"autotp_size": tensor_parallel, "vocab_parallel_lm_head": False}
    return config
