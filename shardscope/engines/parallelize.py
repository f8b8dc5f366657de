"""The one place where parallelisms are applied to a model, in a fixed order.

Order (as in torchtitan's ``parallelize`` functions), and why:
  1. tensor parallel   - it must see plain ``nn.Linear`` modules, before anything wraps them;
  2. activation checkpointing, per block - recomputation must sit inside the FSDP/DDP unit so the
     unit's hooks gather parameters before the block is recomputed in backward;
  3. torch.compile, per block - compiles the (checkpointed) block forward;
  4. data parallel (FSDP or DDP) - last, so it wraps/shards exactly what will run.
Strategies call ``parallelize`` with their own tensor-parallel and data-parallel functions.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn
from torch.utils.checkpoint import checkpoint

from shardscope.engines.api import RankContext, TrainSettings


# The attribute path of a model's blocks, noted on the instance when it is built, before anything wraps it
# (engines/user_module.py for a user's module, engines/hf_model.py for a Hugging Face model): wrappers rename
# classes (``fully_shard`` makes ``GPT2Block`` ``FSDPGPT2Block``) but keep attribute paths.
BLOCKS_ATTR = "_shardscope_blocks"


def declared_blocks(model: nn.Module, path: str) -> nn.ModuleList:
    """The non-empty ``nn.ModuleList`` at attribute path ``path`` of ``model`` (the preset's ``model.blocks``).
    Raises ValueError (one line) naming what is there instead."""
    owner: Any = model
    for part in path.split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            raise ValueError(f"model.blocks = {path!r}: {type(model).__name__} has no attribute {part!r}")
    if not isinstance(owner, nn.ModuleList):
        raise ValueError(f"model.blocks = {path!r}: a {type(owner).__name__}, not an nn.ModuleList")
    if not len(owner):
        raise ValueError(f"model.blocks = {path!r}: an empty nn.ModuleList")
    return owner


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """Return the model's repeated blocks, the unit FSDP wraps, tensor parallelism splits and checkpointing
    recomputes: the path noted on the instance when it was built (``BLOCKS_ATTR``), found through any wrapper,
    else the built-in transformer's ``model.layers``. Raises TypeError when none exists."""
    path = getattr(model, BLOCKS_ATTR, "")
    if path:
        owner: Any = model
        for part in path.split("."):
            owner = getattr(owner, part)
        return owner
    for owner in (model, getattr(model, "model", None)):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise TypeError(f"{type(model).__name__} exposes no nn.ModuleList at .layers (or .model.layers); "
                    "strategies shard and checkpoint per block there")


def checkpoint_blocks(model: nn.Module) -> None:
    """Recompute each block's activations in backward (torch.utils.checkpoint, non-reentrant).

    The block's ``forward`` is replaced on the instance rather than the block being wrapped in a new
    module, so parameter names (and so per-layer norms and state dicts) stay the same.
    """
    for block in blocks_of(model):
        inner = block.forward

        def forward(*args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward  # type: ignore[method-assign]


def compile_blocks(model: nn.Module) -> None:
    """``torch.compile`` each block in place (per block keeps compile units aligned with FSDP units)."""
    for block in blocks_of(model):
        block.compile()


def parallelize(
    model: nn.Module,
    ctx: RankContext,
    settings: TrainSettings,
    *,
    data_parallel: Callable[[nn.Module], nn.Module],
    tensor_parallel: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Apply TP, activation checkpointing, compile, then ``data_parallel``; return its result."""
    if tensor_parallel is not None and ctx.tp_size > 1:
        tensor_parallel(model)  # 1
    if settings.activation_checkpointing:
        checkpoint_blocks(model)  # 2
    if settings.compile:
        compile_blocks(model)  # 3
    return data_parallel(model)  # 4


def device_ids(ctx: RankContext) -> list[int] | None:
    """Return ``[local device index]`` on CUDA, None on CPU (the ``device_ids`` DDP/FSDP expect)."""
    return [ctx.device.index] if ctx.device.type == "cuda" else None

