"""A hand-written FSDP, written to be read by someone learning how fully sharded data parallelism works.

The idea. With N data-parallel ranks, DDP keeps N full copies of the parameters, gradients and
optimizer state. FSDP keeps only 1/N of each per rank, and rebuilds full parameters just in time:

  * SHARD (once, at setup): each *unit* (one transformer block, plus a "root" unit for the
    parameters outside the blocks: embeddings, final norm, head) flattens its parameters into one
    1-D tensor, pads it to a multiple of N and keeps only its own 1/N slice: the *flat shard*. The
    flat shards (fp32) are the only parameters the optimizer sees.
  * ALL-GATHER before forward: each original parameter is, from setup on, a view into the unit's
    full flat buffer. A forward pre-hook allocates that buffer's storage and all-gathers the N
    shards into it (in the parameter dtype, bf16 for mixed precision). The module's forward runs
    unchanged.
  * FREE after forward (``reshard_after_forward``): a forward hook releases the buffer's storage,
    so the full copy's memory is gone while later blocks run. Autograd kept references (views) to
    the weights it needs for backward; they share that storage and become valid again when it is
    refilled.
  * ALL-GATHER again before backward: a hook on the block's output fires when the gradient for that
    output is ready, i.e. just before autograd runs the block's backward, and gathers again.
  * REDUCE-SCATTER after backward: when every parameter of the unit has its gradient (a
    post-accumulate-grad hook counts them), the unit flattens the full gradients, reduce-scatters
    them (sum, then divided by N: the average, as DDP does) so each rank receives the gradient of
    just its own shard, adds that to the shard's ``.grad``, and frees the full gradients and the
    gathered parameters.
  * STEP on shards: the global gradient norm is the square root of the all-reduced sum of every
    rank's squared local shard norms; clipping scales the local shards; AdamW steps the local
    shards only. The next forward gathers the updated values.

The root unit gathers once before the whole forward and stays gathered until its gradients are
reduced (its parameters are used first and last in forward and first and last in backward), as
FSDP does for its root. Gradient accumulation needs nothing special: each micro-batch's backward
reduce-scatters and adds into the shard gradients (``no_sync`` is a no-op here, trading extra
communication for not keeping full gradients between micro-batches).

Left out for clarity, and done by torch's FSDP: prefetching the next unit's all-gather and running
collectives on a separate stream so communication overlaps compute. Here every collective blocks,
so this implementation is slower than torch's, but it computes the same thing: results match DDP.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from shardscope.engines import memory_accounting, norms
from shardscope.engines.api import Prepared, RankContext, TrainSettings
from shardscope.engines.global_grad import clip_coefficient
from shardscope.engines.optim import make_optimizer
from shardscope.engines.parallelize import blocks_of, parallelize
from shardscope.engines.settings_code import Code


class ShardedUnit:
    """One FSDP unit: some parameters of a model, stored as one flat fp32 shard per rank."""

    def __init__(self, name: str, named_params: list[tuple[str, nn.Parameter]], group: Any,
                 param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
        self.name = name
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        total = sum(self.numels)
        self.shard_size = -(-total // self.world)  # ceil: pad the flat tensor to a multiple of N
        self.padded_size = self.shard_size * self.world
        device = self.params[0].device

        # --- SHARD: every rank holds the same initial weights, so each just keeps its own slice.
        flat = torch.zeros(self.padded_size, dtype=torch.float32, device=device)
        flat[:total] = torch.cat([p.detach().reshape(-1).float() for p in self.params])
        lo = self.rank * self.shard_size
        self.shard = nn.Parameter(flat[lo:lo + self.shard_size].clone())  # the optimizer's parameter

        # The full flat parameters live in one buffer whose *storage* is allocated on gather and
        # released on free. Each original parameter becomes a view of its slice, once and for all:
        # autograd may keep views of a weight (e.g. its transpose) for backward, and views share
        # the storage, so refilling the storage before backward makes them valid again, and
        # releasing it really frees the memory. (This is how FSDP1 frees parameters.)
        self.full = torch.zeros(self.padded_size, dtype=param_dtype, device=device)
        offset = 0
        for p, shape, n in zip(self.params, self.shapes, self.numels):
            p.data = self.full[offset:offset + n].view(shape)
            offset += n
        self._full_bytes = self.full.untyped_storage().nbytes()
        self.gathered = True
        self._grads_ready = 0
        self.free()  # between uses, only the shard exists

    # --- ALL-GATHER: shards -> full parameters -----------------------------------------------------

    def gather(self) -> None:
        """Re-allocate the full buffer and all-gather every rank's shard into it."""
        if self.gathered:
            return
        self.full.untyped_storage().resize_(self._full_bytes)
        dist.all_gather_into_tensor(self.full, self.shard.detach().to(self.param_dtype), group=self.group)
        self.gathered = True

    def free(self) -> None:
        """Release the full buffer's memory (the parameter views stay, pointing at no memory)."""
        if self.gathered:
            self.full.untyped_storage().resize_(0)
            self.gathered = False

    # --- REDUCE-SCATTER: full gradients -> this rank's shard gradient ------------------------------

    def on_grad_ready(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: once all of the unit's gradients exist, reduce-scatter them."""
        self._grads_ready += 1
        if self._grads_ready == len(self.params):
            self.reduce_scatter_grads()

    def reduce_scatter_grads(self) -> None:
        """Average the unit's full gradients across ranks, keep this rank's shard of the result
        (added to ``shard.grad``), then free the full gradients and parameters."""
        self._grads_ready = 0
        flat = torch.zeros(self.padded_size, dtype=self.reduce_dtype, device=self.shard.device)
        offset = 0
        for p, n in zip(self.params, self.numels):
            if p.grad is not None:
                flat[offset:offset + n] = p.grad.reshape(-1)
            offset += n
        mine = torch.empty(self.shard_size, dtype=self.reduce_dtype, device=self.shard.device)
        dist.reduce_scatter_tensor(mine, flat, op=dist.ReduceOp.SUM, group=self.group)
        mine = mine.float().div_(self.world)  # sum / N = the data-parallel average, like DDP
        self.shard.grad = mine if self.shard.grad is None else self.shard.grad.add_(mine)
        for p in self.params:
            p.grad = None
        self.free()

    def flush(self) -> None:
        """Reduce-scatter now if some (not all) gradients arrived, e.g. a parameter went unused."""
        if self._grads_ready:
            self.reduce_scatter_grads()

    # --- for norms: the part of each original parameter that lies in this rank's shard --------------

    def local_pieces(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
        """Yield (parameter name, its values in the local shard, their gradient) for every parameter."""
        lo, hi = self.rank * self.shard_size, (self.rank + 1) * self.shard_size
        offset = 0
        for name, n in zip(self.names, self.numels):
            a, b = max(lo, offset), min(hi, offset + n)
            a, b = (a - lo, b - lo) if a < b else (0, 0)  # an empty piece keeps the key on every rank
            grad = self.shard.grad[a:b] if self.shard.grad is not None else self.shard.detach()[a:b] * 0
            yield name, self.shard.detach()[a:b], grad
            offset += n


def shard_model(model: nn.Module, group: Any, *, reshard_after_forward: bool, param_dtype: torch.dtype,
                reduce_dtype: torch.dtype) -> list[ShardedUnit]:
    """Turn ``model`` into sharded units (one per block, then the root) and install the hooks that
    gather, free and reduce-scatter. Returns the units; the model is modified in place."""
    block_ids: set[int] = set()
    units: list[ShardedUnit] = []
    blocks = blocks_of(model)
    prefix = next(name for name, m in model.named_modules() if m is blocks)  # "layers", "model.layers", "blocks"
    for i, block in enumerate(blocks):
        named = [(f"{prefix}.{i}.{n}", p) for n, p in block.named_parameters()]
        block_ids.update(id(p) for _, p in named)
        unit = ShardedUnit(f"layers.{i}", named, group, param_dtype, reduce_dtype)
        _install_block_hooks(block, unit, reshard_after_forward)
        units.append(unit)
    root_named = [(n, p) for n, p in model.named_parameters() if id(p) not in block_ids]
    root = ShardedUnit("root", root_named, group, param_dtype, reduce_dtype)
    # The root gathers before the model's forward and is freed only after its gradients are reduced.
    model.register_forward_pre_hook(lambda module, args: root.gather())
    for p in root.params:
        p.register_post_accumulate_grad_hook(root.on_grad_ready)
    units.append(root)
    return units


def _install_block_hooks(block: nn.Module, unit: ShardedUnit, reshard_after_forward: bool) -> None:
    def before_forward(module: nn.Module, args: Any) -> None:
        unit.gather()  # ALL-GATHER for forward

    def after_forward(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if reshard_after_forward:
            unit.free()  # FREE: the next blocks run without this block's full parameters
        if output.requires_grad:
            # ALL-GATHER again for backward: runs when d(loss)/d(output) is known, before the
            # block's own backward (and before activation-checkpoint recomputation).
            output.register_hook(lambda grad: (unit.gather(), grad)[1])

    block.register_forward_pre_hook(before_forward)
    block.register_forward_hook(after_forward)
    for p in unit.params:
        p.register_post_accumulate_grad_hook(unit.on_grad_ready)  # REDUCE-SCATTER when all are ready


def apply(model: nn.Module, ctx: RankContext, settings: TrainSettings, options: dict[str, Any]) -> Prepared:
    """Shard ``model`` with the hand-written FSDP over the data-parallel group; return the Prepared.

    Options: ``reshard_after_forward`` (bool). Precision: parameters are gathered in the policy's
    parameter dtype (bf16 for ``bf16-params``), gradients reduced in its reduce dtype, and the
    shards (master weights) stay fp32.
    """
    policy = settings.precision
    group = ctx.dp_group
    units: list[ShardedUnit] = []

    def shard(m: nn.Module) -> nn.Module:
        units.extend(shard_model(m, group, reshard_after_forward=options["reshard_after_forward"],
                                 param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype))
        return m

    model = parallelize(model, ctx, settings, data_parallel=shard)
    shards = [u.shard for u in units]
    optimizer = make_optimizer(shards, settings)

    def clip_and_step(max_norm: float) -> float:
        for unit in units:
            unit.flush()
        # Global norm: each rank's shards are disjoint pieces of the full gradient, so the squares add.
        local_sq = torch.stack([s.grad.float().pow(2).sum() for s in shards if s.grad is not None]).sum()
        dist.all_reduce(local_sq, group=group)
        norm = local_sq.sqrt()
        if max_norm > 0:
            coef = clip_coefficient(max_norm, norm)  # a tensor: no host sync before the step
            for s in shards:
                if s.grad is not None:
                    s.grad.mul_(coef)
        optimizer.step()  # AdamW on the local shards only
        return float(norm)

    def layer_norms() -> dict[str, dict[str, float]]:
        pieces = [piece for unit in units for piece in unit.local_pieces()]
        return {
            "grad": norms.layer_norms(((n, g) for n, _, g in pieces), shard_group=group, sharded=True),
            "param": norms.layer_norms(((n, v) for n, v, _ in pieces), shard_group=group, sharded=True),
        }

    return Prepared(
        model=model,
        optimizer=optimizer,
        clip_and_step=clip_and_step,
        model_state_bytes=lambda: memory_accounting.model_state_bytes(shards, optimizer),
        layer_norms=layer_norms,
        handles_precision=policy.param_dtype != torch.float32,
        notes={"units": len(units), "param_dtype": str(policy.param_dtype), "reduce_dtype": str(policy.reduce_dtype),
               "reshard_after_forward": options["reshard_after_forward"],
               "shard_numel": sum(u.shard_size for u in units)},
        # no library call to paste: the same units, flattened and sharded, are FSDP1's with use_orig_params
        code=Code(lines=[
            "# shardscope's hand-written FSDP (shardscope/engines/handwritten_fsdp.py) teaches what FSDP does: it has",
            "# no library call to paste. The same flattened units: FSDP(model, auto_wrap_policy=ModuleWrapPolicy("
            "{<your block class>}),",
            f"#     sharding_strategy=ShardingStrategy.{'FULL_SHARD' if options['reshard_after_forward'] else 'SHARD_GRAD_OP'}"
            ", use_orig_params=True) (run fsdp1 for its settings as they run)",
            f"# this run gathered parameters in {policy.param_dtype} and reduced gradients in {policy.reduce_dtype}"]),
    )
