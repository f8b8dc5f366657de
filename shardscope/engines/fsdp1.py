"""FSDP1 (``FullyShardedDataParallel``): each transformer block is auto-wrapped into its own FSDP
unit whose parameters are flattened into one FlatParameter and sharded across the data-parallel
ranks; the root unit holds the rest (embeddings, final norm, head).

Sharding strategies: FULL_SHARD (parameters, gradients and optimizer state sharded; parameters
re-gathered in backward), SHARD_GRAD_OP (parameters kept gathered from forward to the end of
backward), HYBRID_SHARD (FULL_SHARD inside a shard group of ``hybrid_shard_size`` ranks, default one
node, replicated across the groups: each unit's reduce-scattered gradient shard is then all-reduced
across the replicas), NO_SHARD (DDP-like).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from shardscope.engines import memory_accounting, norms, settings_code
from shardscope.engines.api import PrecisionPolicy, Prepared, RankContext, TrainSettings
from shardscope.engines.optim import make_optimizer
from shardscope.engines.parallelize import blocks_of, parallelize
from shardscope.engines.settings_code import Code, Name, call
from shardscope.core.registry import split_data_parallel

PREFETCH = {"pre": BackwardPrefetch.BACKWARD_PRE, "post": BackwardPrefetch.BACKWARD_POST, "none": None}


def mixed_precision(policy: PrecisionPolicy) -> MixedPrecision | None:
    """Return FSDP1's MixedPrecision for ``policy`` (None when parameters stay fp32)."""
    if policy.param_dtype == torch.float32:
        return None
    return MixedPrecision(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                          buffer_dtype=policy.param_dtype)


def hybrid_mesh(ctx: RankContext, shard_size: int) -> Any:
    """Return the 2-D ("replicate", "shard") mesh for HYBRID_SHARD: parameters are sharded over
    ``shard_size`` ranks (0 = the ranks of one node) and replicated across the groups.

    Given explicitly because FSDP1's default groups are sized by the CUDA device count, which is
    wrong on CPU. Raises ValueError (``registry.split_data_parallel``) when ``shard_size`` does not
    divide the data-parallel size, or is 1 with several replicas: FSDP1 then clamps the unit to
    NO_SHARD over its one-rank shard group and never all-reduces across replicas (measured: gradients
    silently stay per-rank).
    """
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.dp_size))
    replicas, size = split_data_parallel(ctx.dp_size, shard=shard_size or min(ctx.dp_size, per_node),
                                         name="HYBRID_SHARD")
    return init_device_mesh(ctx.device.type, (replicas, size), mesh_dim_names=("replicate", "shard"))


def apply(model: nn.Module, ctx: RankContext, settings: TrainSettings, options: dict[str, Any]) -> Prepared:
    """Wrap ``model`` with FSDP1, one unit per block; return the Prepared the loop drives.

    Options: ``sharding_strategy`` (FULL_SHARD | SHARD_GRAD_OP | HYBRID_SHARD | NO_SHARD),
    ``backward_prefetch`` (pre | post | none), ``limit_all_gathers`` (bool), ``use_orig_params`` (bool),
    ``hybrid_shard_size`` (HYBRID_SHARD's shard group; its replicas all-reduce each gradient shard).
    """
    strategy = ShardingStrategy[options["sharding_strategy"]]
    mp = mixed_precision(settings.precision)
    mesh = hybrid_mesh(ctx, options["hybrid_shard_size"]) if strategy == ShardingStrategy.HYBRID_SHARD else None

    block_types = {type(b) for b in blocks_of(model)}  # checkpointing and compile keep each block's class
    where = settings_code.blocks_path(model, blocks_of(model))
    kwargs = {"sharding_strategy": strategy, "backward_prefetch": PREFETCH[options["backward_prefetch"]],
              "limit_all_gathers": options["limit_all_gathers"], "use_orig_params": options["use_orig_params"],
              "mixed_precision": mp}

    def wrap(m: nn.Module) -> nn.Module:
        return FSDP(m, process_group=None if mesh is not None else ctx.dp_group, device_mesh=mesh,
                    auto_wrap_policy=ModuleWrapPolicy(block_types), device_id=ctx.device, **kwargs)

    fsdp = parallelize(model, ctx, settings, data_parallel=wrap)
    params = list(fsdp.parameters())  # FlatParameters (local shards), or views of them with use_orig_params
    optimizer = make_optimizer(params, settings)

    def clip_and_step(max_norm: float) -> float:
        # FSDP1's own clip computes the norm across every shard (for HYBRID, over the shard group: every
        # replica holds the same all-reduced gradient shards).
        norm = fsdp.clip_grad_norm_(max_norm if max_norm > 0 else float("inf"))
        optimizer.step()
        return float(norm)

    layer_norms = None
    if options["use_orig_params"]:  # per-layer norms need the original parameter names
        named = list(fsdp.named_parameters())
        sharded = strategy != ShardingStrategy.NO_SHARD
        group = fsdp.process_group  # the shard group (intra-node for HYBRID_SHARD)
        layer_norms = lambda: norms.param_and_grad_norms(named, shard_group=group, sharded=sharded)  # noqa: E731
    notes = {"sharding_strategy": strategy.name, "backward_prefetch": options["backward_prefetch"],
             "limit_all_gathers": options["limit_all_gathers"], "use_orig_params": options["use_orig_params"],
             "shard_group_size": fsdp.process_group.size(),
             "replicas": mesh.size(0) if mesh is not None else 1,
             "param_dtype": str(mp.param_dtype if mp else torch.float32), "units": len(blocks_of(model)) + 1}
    return Prepared(
        model=fsdp,
        optimizer=optimizer,
        clip_and_step=clip_and_step,
        model_state_bytes=lambda: memory_accounting.model_state_bytes(params, optimizer),
        no_sync=fsdp.no_sync,
        layer_norms=layer_norms,
        handles_precision=mp is not None,
        notes=notes,
        code=_code(ctx, settings, mesh, where, kwargs),
    )


def _code(ctx: RankContext, settings: TrainSettings, mesh: Any, blocks: str, kwargs: dict[str, Any]) -> Code:
    """The FSDP call as the run made it (``settings_code``)."""
    imports = ["from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, BackwardPrefetch, "
               "MixedPrecision, ShardingStrategy", "from torch.distributed.fsdp.wrap import ModuleWrapPolicy"]
    first = []
    where: dict[str, Any] = {}
    if mesh is not None:
        imports.append("from torch.distributed.device_mesh import init_device_mesh")
        first.append(settings_code.mesh(ctx.device.type, mesh))
        where["device_mesh"] = Name("mesh")
    elif ctx.dp_size != ctx.world_size:
        where["process_group"] = Name("dp_group")
    device = Name("torch.device('cuda', local_rank)") if ctx.device.type == "cuda" else ctx.device
    policy = Name(f"ModuleWrapPolicy({{type(block) for block in {blocks}}})")  # the classes of your blocks
    return Code(imports, first, [call("model = FSDP", Name("model"), **where, auto_wrap_policy=policy, device_id=device,
                                      **kwargs), settings_code.optimizer(settings)])
