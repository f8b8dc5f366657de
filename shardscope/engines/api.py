"""The contract between the shared training loop and each strategy module.

A strategy module exposes ``apply(model, ctx, settings, options) -> Prepared``. The model arrives
on ``ctx.device`` in fp32, already loaded with the comparison's shared initial weights and
identical on every rank. The strategy wraps or shards it, builds the optimizer, and returns what
the loop needs. The loop (``engines/loop.py``) is the same for every strategy, so a difference in
results is a difference of strategy, not of loop.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch
from torch import nn


@dataclass
class RankContext:
    """Where this rank sits: global rank, device, and its data- and tensor-parallel coordinates."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  # "nccl" | "gloo"
    dp_size: int
    dp_rank: int
    tp_size: int = 1
    tp_rank: int = 0
    mesh: Any = None  # DeviceMesh: 1-D ("dp",) or 2-D ("dp", "tp")
    dp_group: Any = None  # ProcessGroup of this rank's data-parallel peers (None = world)
    tp_group: Any = None  # ProcessGroup of this rank's tensor-parallel peers (None without TP)
    pp_size: int = 1  # pipeline degree: ranks one pipeline spans (mesh ("dp", "pp"))
    pp_rank: int = 0
    pp_group: Any = None  # ProcessGroup of this rank's pipeline (None without pipelining)


@dataclass(frozen=True)
class PrecisionPolicy:
    """Explicit precision: what parameters, compute, gradient reduction and master weights use."""

    name: str  # "fp32" | "bf16-autocast" | "bf16-params" | "fp16"
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    master_dtype: torch.dtype
    autocast: bool  # the loop wraps forward in torch.autocast(compute_dtype)
    loss_scaling: bool  # fp16: dynamic loss scaling

    def describe(self) -> dict[str, str]:
        """Return the policy as strings, for the ``start`` record."""
        name = lambda d: str(d).replace("torch.", "")  # noqa: E731
        return {
            "policy": self.name,
            "param": name(self.param_dtype),
            "compute": name(self.compute_dtype),
            "reduce": name(self.reduce_dtype),
            "master": name(self.master_dtype),
            "loss_scaling": str(self.loss_scaling).lower(),
        }


@dataclass
class TrainSettings:
    """What a strategy needs from the comparison (read-only)."""

    lr: float
    weight_decay: float
    grad_clip: float  # 0 = no clipping
    grad_accum: int
    micro_batch_size: int  # sequences per rank per micro-batch
    steps: int
    warmup_steps: int
    precision: PrecisionPolicy
    activation_checkpointing: bool
    compile: bool
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    schedule_steps: int = 0  # the lr schedule's length (0 = steps): shardscope why's short re-runs keep the original's
    grad_accum_loss: str = "mean"  # "sum": micro-batch losses are not divided by grad_accum (registry.LOOP_OPTIONS)


def _nullcontext() -> ContextManager[None]:
    return contextlib.nullcontext()


@dataclass
class Prepared:
    """What the loop drives. Defaults suit strategies built on a plain torch optimizer.

    - ``model(inputs)`` returns logits ``[batch, seq, vocab]`` (or ``[batch, classes]`` for images).
    - ``backward(loss)`` back-propagates one micro-batch's (already 1/grad_accum-scaled) loss.
    - ``clip_and_step(max_norm)`` returns the *global* gradient norm before clipping (across every
      shard and tensor-parallel rank), clips to ``max_norm`` unless it is 0, and steps the optimizer;
      None when the strategy cannot measure the norm (a NaN would mark the run diverged).
    - ``set_lr(lr)`` sets the learning rate for the coming step.
    - ``no_sync()`` is entered for every micro-batch except the last when accumulating.
    - ``model_state_bytes()`` returns this rank's exact ``param_bytes``, ``grad_bytes`` and
      ``optim_bytes`` (local shards, counted from the tensors).
    - ``layer_norms()`` (parity mode) returns ``{"grad": {layer: norm}, "param": {layer: norm}}``
      computed on full tensors across shards and TP ranks, of the reduced gradients before
      clipping; None when not supported. It is called between backward and ``clip_and_step``; a
      strategy that reduces inside its step (DeepSpeed) may return a dict that step fills.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    clip_and_step: Callable[[float], float | None]
    model_state_bytes: Callable[[], dict[str, int]]
    backward: Callable[[torch.Tensor], None] = lambda loss: loss.backward()
    zero_grad: Callable[[], None] | None = None
    set_lr: Callable[[float], None] | None = None
    no_sync: Callable[[], ContextManager[Any]] = _nullcontext
    layer_norms: Callable[[], dict[str, dict[str, float]]] | None = None
    handles_precision: bool = False  # True: the strategy applies the precision policy itself (no loop autocast)
    # Whether the last step updated the parameters (False: the strategy's own fp16 loss scaler skipped it,
    # which is not divergence); None: a strategy whose steps are never skipped by itself.
    step_applied: Callable[[], bool] | None = None
    notes: dict[str, Any] = field(default_factory=dict)  # strategy facts for the start record
    # the strategy's library calls as a user pastes them (``settings_code.Code``, from the values it passed)
    code: Any = None
    # A strategy that runs a step's micro-batches itself (pipeline schedules): ``run_micro_batches(micro, divisor)``
    # runs forward and backward over every micro-batch (each loss divided by ``divisor``) and returns the detached
    # sum of the micro-batches' mean losses, as the loop's own path does, on every rank.
    run_micro_batches: Callable[[list[Any], int], torch.Tensor] | None = None
    # Its own per-step figures for the step record (pipeline: compute and span seconds), read after each step.
    step_fields: Callable[[], dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.zero_grad is None and self.optimizer is not None:
            opt = self.optimizer
            self.zero_grad = lambda: opt.zero_grad(set_to_none=True)
        if self.set_lr is None and self.optimizer is not None:
            opt = self.optimizer

            def _set_lr(lr: float) -> None:
                for group in opt.param_groups:
                    group["lr"] = lr

            self.set_lr = _set_lr
