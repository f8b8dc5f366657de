"""Exact local model-state bytes: parameters, gradients and optimizer state held by this rank.

Counts tensors, not estimates: for sharded strategies the local shards (``DTensor.to_local()``,
FSDP1 flat shards, the hand-written FSDP's flat shards). A storage shared by several parameters
(tied weights) is counted once.
"""

from __future__ import annotations

from typing import Iterable

import torch


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """Return the rank-local part of ``t`` (the local shard of a DTensor, else ``t`` itself)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Return the bytes of the distinct local tensors in ``tensors`` (None skipped)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = local_tensor(t)
        key = (local.untyped_storage().data_ptr() if local.numel() else id(local), local.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total


def optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Return every tensor in the optimizer's state (moments, step counters)."""
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def model_state_bytes(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Return {param_bytes, grad_bytes, optim_bytes} for ``params`` (their grads) and ``optimizer``."""
    params = list(params)
    return {
        "param_bytes": tensor_bytes(params),
        "grad_bytes": tensor_bytes(p.grad for p in params),
        "optim_bytes": tensor_bytes(optimizer_tensors(optimizer)),
    }
