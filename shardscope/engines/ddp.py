"""DistributedDataParallel: a full replica on every rank, gradients all-reduced in buckets
during backward. The baseline the sharded strategies are compared against."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardscope.engines import memory_accounting, norms, settings_code
from shardscope.engines.api import Prepared, RankContext, TrainSettings
from shardscope.engines.optim import make_optimizer, optimizer_clip_and_step
from shardscope.engines.parallelize import device_ids, parallelize
from shardscope.engines.settings_code import Code, Name, call


def apply(model: nn.Module, ctx: RankContext, settings: TrainSettings, options: dict[str, Any]) -> Prepared:
    """Wrap ``model`` in DDP over the data-parallel group; return the Prepared the loop drives.

    Options: ``bucket_cap_mb`` (int), ``static_graph`` (bool).
    """

    kwargs = {"bucket_cap_mb": options["bucket_cap_mb"], "static_graph": options["static_graph"]}

    def wrap(m: nn.Module) -> nn.Module:
        return DistributedDataParallel(m, device_ids=device_ids(ctx), process_group=ctx.dp_group, **kwargs)

    ddp = parallelize(model, ctx, settings, data_parallel=wrap)
    params = list(ddp.parameters())
    optimizer = make_optimizer(params, settings)
    named = list(model.named_parameters())  # replicated: full tensors on every rank
    notes = {"precision": "DDP has no parameter mixed precision; bf16/fp16 compute comes from the loop's autocast"}
    return Prepared(
        model=ddp,
        optimizer=optimizer,
        clip_and_step=optimizer_clip_and_step(params, optimizer),
        model_state_bytes=lambda: memory_accounting.model_state_bytes(params, optimizer),
        no_sync=ddp.no_sync,
        layer_norms=lambda: norms.param_and_grad_norms(named),
        notes=notes,
        code=Code(["from torch.nn.parallel import DistributedDataParallel"], lines=[
            call("model = DistributedDataParallel", Name("model"), **settings_code.devices(ctx), **kwargs),
            settings_code.optimizer(settings)]),
    )
