"""DeepSpeed AutoTP: tensor parallelism found automatically in a Hugging Face model, plus ZeRO 0-2.

With ``tensor_parallel.autotp_size`` in the config, ``deepspeed.initialize`` walks the model and
replaces its linears: q/k/v and MLP up/gate become column-parallel (``LinearLayer``: output
dim split), the attention output and MLP down projections row-parallel (``LinearAllreduce``:
input dim split, partial sums all-reduced). Embeddings, norms and a tied LM head stay
replicated; an untied LM head is split by vocabulary (``LinearLayer(gather_output=True)``: logits
all-gathered, its input's gradient all-reduced; the memory model and the communication theory count
it through the registry's "vocab-split-head"). Data-parallel size = world / tp; ZeRO (stage 0, 1 or 2) shards over the
data-parallel group only. ZeRO-3 is refused at validation: DeepSpeed's AutoTP training
tutorial documents stages 0-2 (0.19.8's engine source claims stage 3 works too, but that path is
neither documented for training nor tested here); for sharded parameters with TP use FSDP2 + TP.

DeepSpeed makes its own TP and DP groups (TP = consecutive ranks). They must be the groups the
worker's ``("dp", "tp")`` mesh made, or the shared data slices would not line up; ``apply``
checks that.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardscope.engines.api import Prepared, RankContext, TrainSettings
from shardscope.engines.deepspeed_measure import tp_shard
from shardscope.engines.deepspeed_zero import build_config, prepare_engine


def apply(model: nn.Module, ctx: RankContext, settings: TrainSettings, options: dict[str, Any]) -> Prepared:
    """Apply AutoTP with degree ``options["tp"]`` and ZeRO ``options["stage"]`` (0-2); return the Prepared.

    Raises ValueError for ZeRO-3, a tp that does not match the rank context, or DeepSpeed groups
    that disagree with the worker's mesh.
    """
    tp, stage = int(options.get("tp", 2)), int(options.get("stage", 1))
    if stage not in (0, 1, 2):
        raise ValueError(f"options.stage = {stage}: AutoTP supports ZeRO stages 0, 1 and 2")
    if ctx.tp_size != tp:
        raise ValueError(f"options.tp = {tp} but the rank context has tp_size {ctx.tp_size}")
    config = build_config(settings, ctx, stage=stage, bucket_mb=int(options.get("bucket_mb", 25)), tensor_parallel=tp)
    # Without a ZeRO (or bf16/fp16) optimizer wrapper DeepSpeed keeps no gradient norm; compute it.
    own_norm = stage == 0 and settings.precision.name in ("fp32", "bf16-autocast")
    prepared = prepare_engine(model, ctx, settings, config, notes={"zero_stage": stage, "autotp_size": tp},
                              grad_norm=tp_grad_norm if own_norm else None)
    _check_groups(ctx)
    return prepared


def _check_groups(ctx: RankContext) -> None:
    from deepspeed.utils import groups

    ds = (groups.get_tensor_model_parallel_world_size(), groups.get_tensor_model_parallel_rank(),
          groups.get_data_parallel_world_size(), groups.get_data_parallel_rank())
    ours = (ctx.tp_size, ctx.tp_rank, ctx.dp_size, ctx.dp_rank)
    if ds != ours:
        raise ValueError(f"DeepSpeed's groups (tp size, tp rank, dp size, dp rank) = {ds} differ from the "
                         f"worker's mesh {ours}; the data slices would not match")


def tp_grad_norm(model: nn.Module) -> torch.Tensor:
    """Return the global gradient norm of an AutoTP model (fp64 scalar).

    Tensor-parallel shards (DeepSpeed marks them ``tensor_model_parallel``) hold disjoint pieces:
    their square sums are added over the TP group. Replicated parameters hold the same gradient
    on every TP rank and are counted once. Gradients are already averaged over data parallel.
    """
    import deepspeed.comm as ds_comm
    from deepspeed.utils import groups

    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is None:
            continue
        sq = p.grad.detach().double().pow(2).sum().cpu()
        if tp_shard(p):
            sharded += sq
        else:
            replicated += sq
    device = next(model.parameters()).device
    sharded = sharded.to(device)
    ds_comm.all_reduce(sharded, group=groups.get_tensor_model_parallel_group())
    return (sharded.cpu() + replicated).sqrt()
