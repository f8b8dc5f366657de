"""FSDP2 + DTensor tensor parallelism on a 2-D ``("dp", "tp")`` mesh.

Order (see ``parallelize``): tensor parallel first, on the plain ``nn.Linear`` modules, with the
plan from ``tp_plan`` (q/k/v and MLP up/gate column-wise, output and down projections row-wise)
over the ``tp`` sub-mesh; then ``fully_shard`` per block and on the root over the ``dp`` sub-mesh.
TP weights end up as 2-D DTensors (sharded on dim 0 over dp and on their TP dim over tp);
replicated weights (embeddings, norms, head) as 1-D DTensors sharded over dp.

Loss: tensor-parallel peers see the same micro-batch and compute the same loss, so averaging
over the data-parallel group alone (the loop's dp group) is the global mean. Gradients: FSDP
reduce-scatters over dp; the TP styles already sum the partial input-gradients over tp.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from shardscope.engines import settings_code, tp_plan
from shardscope.engines.api import Prepared, RankContext, TrainSettings
from shardscope.engines.fsdp2 import dp_mesh, fsdp2_prepared, mixed_precision, shard_code, shard_model
from shardscope.engines.global_grad import clip_coefficient, total_norm
from shardscope.engines.parallelize import blocks_of, parallelize
from shardscope.engines.settings_code import Name, call


def apply_tp(model: nn.Module, tp_mesh: Any, plan: dict[str, str]) -> None:
    """Shard ``model``'s linears over ``tp_mesh`` with ``plan`` ({pattern: "colwise" | "rowwise"}), in place."""
    parallelize_module(model, tp_mesh, tp_plan.styled(plan))


def global_grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """Return the L2 norm of all gradients over every shard and TP rank (a plain scalar tensor).

    Gradients live on two meshes (2-D for TP weights, the dp sub-mesh for the rest), and one stacked
    norm cannot mix DTensors of different meshes (torch's ``clip_grad_norm_`` fails on them); so local
    squared sums are added per group (``total_norm``: the world for the 2-D ones, replicated dims scaled
    out; dp for the rest), one all-reduce each.
    """
    return total_norm(p.grad for p in params if p.grad is not None)


def clip_and_step_fn(params: list[torch.Tensor], optimizer: torch.optim.Optimizer):
    """Return a ``Prepared.clip_and_step``: global norm over dp and tp, clip, step."""

    def clip_and_step(max_norm: float) -> float:
        norm = float(global_grad_norm(params))
        if max_norm > 0:
            coef = clip_coefficient(max_norm, norm)
            if coef < 1.0:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        optimizer.step()
        return norm

    return clip_and_step


def apply(model: nn.Module, ctx: RankContext, settings: TrainSettings, options: dict[str, Any]) -> Prepared:
    """Tensor-parallel over ``tp``, then FSDP2 over ``dp``; return the Prepared the loop drives.

    Options: ``tp`` (degree; the worker built the mesh from it), ``reshard_after_forward``.
    Raises ValueError when the rank context has no 2-D mesh matching ``tp`` or the model has no plan.
    """
    tp = int(options.get("tp", 2))
    names = tuple(getattr(ctx.mesh, "mesh_dim_names", None) or ())
    if names != ("dp", "tp") or ctx.tp_size != tp:
        raise ValueError(f"FSDP2 with tensor parallelism needs a ('dp', 'tp') mesh with tp = {tp}; got dims {names} and tp_size {ctx.tp_size}")
    plan = tp_plan.plan_of(model)
    mp = mixed_precision({}, settings.precision)
    reshard = bool(options.get("reshard_after_forward", True))
    sharded = parallelize(
        model, ctx, settings,
        tensor_parallel=lambda m: apply_tp(m, ctx.mesh["tp"], plan),
        data_parallel=lambda m: shard_model(m, dp_mesh(ctx), reshard_after_forward=reshard, mp=mp),
    )
    notes = {"tp": tp, "dp": ctx.dp_size, "tp_plan": dict(plan),
             "param_dtype": str(mp.param_dtype or "float32"), "reshard_after_forward": reshard,
             "units": len(blocks_of(sharded)) + 1}
    prepared = fsdp2_prepared(sharded, settings, mp, notes)
    styles = {pattern: Name(f"{type(style).__name__}()") for pattern, style in tp_plan.styled(plan).items()}
    prepared.code = shard_code(sharded, settings, reshard, mp, imports=[
        "from torch.distributed.device_mesh import init_device_mesh",
        "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module"], first=[
        settings_code.mesh(ctx.device.type, ctx.mesh, "world_mesh"),
        "tp_plan = {" + "".join(f"\n    {pattern!r}: {style}," for pattern, style in styles.items()) + "\n}",
        call("parallelize_module", Name("model"), Name('world_mesh["tp"]'), Name("tp_plan")),
        'mesh = world_mesh["dp"]'])
    prepared.clip_and_step = clip_and_step_fn(list(sharded.parameters()), prepared.optimizer)
    return prepared
