"""Optimizer, learning-rate schedule, global-norm clipping and fp16 loss scaling, shared by
every strategy so that a difference in results is a difference of strategy, not of recipe.

Weight decay applies to every parameter (one parameter group): AdamW's decay is elementwise, so
a strategy that keeps flat shards (the hand-written FSDP) steps exactly like one that keeps
per-parameter tensors.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist

from shardscope.engines.api import TrainSettings
from shardscope.engines.global_grad import full_value
from shardscope.engines.memory_accounting import local_tensor


def make_optimizer(params: Iterable[torch.Tensor], settings: TrainSettings) -> torch.optim.AdamW:
    """Return AdamW over ``params`` with the comparison's lr, betas, eps and weight decay."""
    return torch.optim.AdamW(
        list(params), lr=settings.lr, betas=settings.betas, eps=settings.eps, weight_decay=settings.weight_decay
    )


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Return the learning rate at 0-based ``step``: linear warmup over ``warmup_steps`` (reaching
    ``lr`` at step warmup_steps-1), then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = total_steps - warmup_steps - 1
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - warmup_steps) / decay_steps)
    floor = lr * min_lr_ratio
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def clip_by_global_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the gradients of ``params`` to ``max_norm`` (0 = no clipping) by their global norm and
    return that norm (a plain tensor). Correct for replicated tensors (DDP) and for DTensors (FSDP2,
    TP), whose per-shard norms are reduced across the mesh by ``full_tensor``."""
    with_grads = [p for p in params if p.grad is not None]
    norm = full_value(torch.nn.utils.get_total_norm([p.grad for p in with_grads], 2.0))
    if max_norm > 0:
        # Takes the parameters (it scales their .grad), not the gradient tensors.
        torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, norm)
    return norm


def optimizer_clip_and_step(params: list[torch.Tensor], optimizer: torch.optim.Optimizer):
    """Return a ``Prepared.clip_and_step`` for a plain optimizer over (possibly DTensor) params."""

    def clip_and_step(max_norm: float) -> float:
        norm = clip_by_global_norm(params, max_norm)
        optimizer.step()
        return float(norm)

    return clip_and_step


class LossScaler:
    """Dynamic fp16 loss scaling with GradScaler semantics for any strategy with a torch optimizer.

    The loss is multiplied by ``scale``; before stepping, gradients (the optimizer's tensors, so
    local shards for sharded strategies) are divided by it. If any rank saw inf/nan the step is
    skipped and the scale halves; after ``growth_interval`` good steps it doubles.

    Written here rather than using ``torch.amp.GradScaler``: that one owns ``optimizer.step`` (we
    must clip by the global norm across shards and TP ranks in between), checks only local
    tensors (FSDP needs ``ShardedGradScaler``; the hand-written FSDP and DTensor TP need their
    own reduction), and keeps its state per device. One scaler for every strategy keeps fp16
    runs comparable.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale = init_scale
        self.growth_interval = growth_interval
        self._good_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Return ``loss * scale``."""
        return loss * self.scale

    def unscale_and_check(self, optimizer: torch.optim.Optimizer, group: Any = None) -> bool:
        """Divide the optimizer's gradients by the scale; return True when all are finite on all ranks."""
        found_inf = None
        for pg in optimizer.param_groups:
            for p in pg["params"]:
                if p.grad is None:
                    continue
                # DTensor grads (FSDP2, TP) live on different meshes: check the local shard, then
                # reduce the flag over the whole group below.
                local = local_tensor(p.grad)
                local.div_(self.scale)
                bad = (~torch.isfinite(local)).any().float()
                found_inf = bad if found_inf is None else torch.maximum(found_inf, bad)
        flag = found_inf if found_inf is not None else torch.zeros((), device="cpu")
        flag = flag.reshape(1).float()
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item() == 0)

    def update(self, finite: bool) -> None:
        """Halve the scale after an overflow; double it after ``growth_interval`` finite steps."""
        if not finite:
            self.scale /= 2.0
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self.scale *= 2.0
            self._good_steps = 0
