"""FSDP2 (``fully_shard``): every parameter becomes a DTensor sharded on dim 0 across the
data-parallel mesh. One FSDP unit per transformer block, then the root (embeddings, final norm,
head). Each unit all-gathers its parameters before its forward, frees them after it when
``reshard_after_forward`` (re-gathering in backward), and reduce-scatters gradients in backward.
The root is left to torch's default: it stays gathered from forward to backward.

HSDP (``replicate`` > 1, torchtitan's ``data_parallel_replicate_degree``): ``fully_shard`` on a 2-D
("replicate", "shard") mesh built here from the data-parallel ranks; parameters are sharded over
the shard dimension (dp / replicate ranks) and replicated across the other, and each unit's
reduce-scattered gradient shard is all-reduced across the replicas."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from shardscope.engines import memory_accounting, norms, settings_code
from shardscope.engines.api import PrecisionPolicy, Prepared, RankContext, TrainSettings
from shardscope.engines.optim import make_optimizer, optimizer_clip_and_step
from shardscope.engines.parallelize import blocks_of, parallelize
from shardscope.engines.precision import option_dtype
from shardscope.engines.settings_code import Code, Name, call
from shardscope.core.registry import split_data_parallel


def mixed_precision(options: dict[str, Any], policy: PrecisionPolicy) -> MixedPrecisionPolicy:
    """Return FSDP2's MixedPrecisionPolicy from the ``param_dtype``/``reduce_dtype`` options
    ("auto" = the precision policy's parameter and reduction dtypes)."""
    param = option_dtype(options.get("param_dtype", "auto"), policy.param_dtype)
    reduce = option_dtype(options.get("reduce_dtype", "auto"), policy.reduce_dtype)
    # None = keep the sharded parameter's dtype (fp32): no casts at all in the fp32 case.
    return MixedPrecisionPolicy(
        param_dtype=None if param == torch.float32 else param,
        reduce_dtype=None if reduce == torch.float32 and param == torch.float32 else reduce,
    )


def dp_mesh(ctx: RankContext) -> Any:
    """Return the data-parallel sub-mesh (the whole mesh when it is 1-D)."""
    names = getattr(ctx.mesh, "mesh_dim_names", None) or ()
    return ctx.mesh["dp"] if len(names) > 1 else ctx.mesh


def hsdp_mesh(ctx: RankContext, replicas: int) -> Any:
    """Return the 2-D ("replicate", "shard") mesh of HSDP over the data-parallel ranks (``replicas`` x
    dp / ``replicas``, consecutive ranks in one shard group), or the data-parallel mesh when ``replicas``
    is 1. Raises ValueError when ``replicas`` does not divide the data-parallel size or leaves shard
    groups of one rank."""
    if replicas <= 1:
        return dp_mesh(ctx)
    if ctx.tp_size > 1:
        raise ValueError("replicate > 1 (HSDP) is built over the whole world: it does not combine with tensor parallel")
    replicas, shard = split_data_parallel(ctx.dp_size, replicas=replicas, name="HSDP")
    return init_device_mesh(ctx.device.type, (replicas, shard), mesh_dim_names=("replicate", "shard"))


def block_groups(model: nn.Module, unit_blocks: int) -> list[list[nn.Module]]:
    """The model's blocks in groups of ``unit_blocks`` consecutive ones (the last may hold fewer): one FSDP unit each."""
    blocks = list(blocks_of(model))
    k = max(1, unit_blocks)
    return [blocks[i:i + k] for i in range(0, len(blocks), k)]


def shard_model(model: nn.Module, mesh: Any, *, reshard_after_forward: bool, mp: MixedPrecisionPolicy,
                unit_blocks: int = 1) -> nn.Module:
    """``fully_shard`` each block (or each group of ``unit_blocks`` blocks, one unit), then the root; return the
    model (now an FSDPModule).

    The root's ``reshard_after_forward`` is left to torch (None): its parameters are used first in
    forward and first again in backward, so torch keeps them gathered in between. Passing True there
    would free them after forward and all-gather them again at the start of backward."""
    unit, root = shard_arguments(reshard_after_forward, mp)
    for group in block_groups(model, unit_blocks):
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh, **unit)
    fully_shard(model, mesh=mesh, **root)
    return model


def shard_arguments(reshard_after_forward: bool, mp: MixedPrecisionPolicy) -> tuple[dict[str, Any], dict[str, Any]]:
    """``fully_shard``'s keyword arguments for each block and for the root (``shard_model``)."""
    return ({"reshard_after_forward": reshard_after_forward, "mp_policy": mp},
            {"reshard_after_forward": None, "mp_policy": mp})


def shard_code(model: nn.Module, settings: TrainSettings, reshard_after_forward: bool, mp: MixedPrecisionPolicy,
               *, imports: list[str], first: list[str], unit_blocks: int = 1) -> Code:
    """``shard_model``'s calls as a user pastes them (``settings_code``), over the mesh ``first`` builds."""
    unit, root = shard_arguments(reshard_after_forward, mp)
    blocks = settings_code.blocks_path(model, blocks_of(model))
    policy = {"mp_policy": Name("mp_policy")}
    loop = ([f"for block in {blocks}:", call("fully_shard", Name("block"), indent="    ", mesh=Name("mesh"),
                                             **{**unit, **policy})] if unit_blocks <= 1 else
            [f"blocks = list({blocks})", f"for i in range(0, len(blocks), {unit_blocks}):  # {unit_blocks} blocks a unit",
             call("fully_shard", Name(f"blocks[i:i + {unit_blocks}]"), indent="    ", mesh=Name("mesh"),
                  **{**unit, **policy})])
    return Code(["from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard", *imports], first, [
        f"mp_policy = {settings_code.literal(mp)}", *loop,
        call("fully_shard", Name("model"), mesh=Name("mesh"), **{**root, **policy}),
        settings_code.optimizer(settings)])


def fsdp2_prepared(model: nn.Module, settings: TrainSettings, mp: MixedPrecisionPolicy, notes: dict[str, Any]) -> Prepared:
    """Return the Prepared for a model already sharded with ``fully_shard`` (shared with FSDP2+TP)."""
    params = list(model.parameters())
    optimizer = make_optimizer(params, settings)
    named = list(model.named_parameters())

    @contextmanager
    def no_sync() -> Iterator[None]:
        # FSDP2's equivalent of DDP.no_sync: accumulate unsharded grads, reduce-scatter on the last micro-batch.
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    return Prepared(
        model=model,
        optimizer=optimizer,
        clip_and_step=optimizer_clip_and_step(params, optimizer),
        model_state_bytes=lambda: memory_accounting.model_state_bytes(params, optimizer),
        no_sync=no_sync,
        layer_norms=lambda: norms.param_and_grad_norms(named),
        handles_precision=mp.param_dtype is not None,
        notes=notes,
    )


def apply(model: nn.Module, ctx: RankContext, settings: TrainSettings, options: dict[str, Any]) -> Prepared:
    """Shard ``model`` with FSDP2 over the data-parallel mesh; return the Prepared the loop drives.

    Options: ``reshard_after_forward`` (bool), ``param_dtype`` and ``reduce_dtype`` ("auto" | fp32 | bf16 | fp16),
    ``replicate`` (HSDP replicas; 1 = shard over every data-parallel rank), ``unit_blocks`` (blocks per unit).
    """
    mp = mixed_precision(options, settings.precision)
    reshard = options["reshard_after_forward"]
    mesh = hsdp_mesh(ctx, int(options.get("replicate", 1)))
    k = int(options.get("unit_blocks", 1))
    sharded = parallelize(
        model, ctx, settings,
        data_parallel=lambda m: shard_model(m, mesh, reshard_after_forward=reshard, mp=mp, unit_blocks=k),
    )
    replicas = mesh.size(0) if mesh.ndim == 2 else 1
    notes = {"param_dtype": str(mp.param_dtype or "float32"), "reduce_dtype": str(mp.reduce_dtype or "float32"),
             "reshard_after_forward": reshard, "units": len(block_groups(sharded, k)) + 1, "unit_blocks": k,
             "replicas": replicas, "shard_group_size": mesh.size(mesh.ndim - 1)}
    prepared = fsdp2_prepared(sharded, settings, mp, notes)
    prepared.code = shard_code(sharded, settings, reshard, mp,
                               imports=["from torch.distributed.device_mesh import init_device_mesh"],
                               first=[settings_code.mesh(ctx.device.type, mesh)], unit_blocks=k)
    return prepared
