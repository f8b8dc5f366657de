"""Gradient figures made global, the one way every strategy does it.

``full_value``: a DTensor (FSDP2, tensor parallel) holds a shard or a partial sum until it is reduced;
``full_tensor()`` reduces it according to its placements, a plain tensor is already whole.
``spread_of`` / ``total_norm``: a DTensor's local squared sum added over the group its pieces are split
across, every tensor of a group in one all-reduce (a reduction per tensor cost FSDP2 + TP 15 scalar
all-reduces a step). ``clip_coefficient``: torch's ``clip_grad_norm_`` rule, shared by the strategies
that clip by hand (the hand-written FSDP, FSDP2 + TP, DeepSpeed's hook), so every run clips the same way.
"""

from __future__ import annotations

from typing import Any, Iterable, TypeVar

import torch
import torch.distributed as dist

_Norm = TypeVar("_Norm", float, torch.Tensor)

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s guard against a zero norm


def full_value(t: torch.Tensor) -> torch.Tensor:
    """Return ``t`` reduced across its device mesh when it is a DTensor (``full_tensor()``, a
    collective every rank of the mesh must join), else ``t`` itself."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def clip_coefficient(max_norm: float, norm: _Norm) -> _Norm:
    """Return ``min(1, max_norm / (norm + 1e-6))``, the factor torch's ``clip_grad_norm_`` scales
    gradients by: a float for a float norm, a tensor (no host sync) for a tensor norm."""
    coef = max_norm / (norm + CLIP_EPS)
    return torch.clamp(coef, max=1.0) if isinstance(coef, torch.Tensor) else min(1.0, coef)


def spread_of(t: torch.Tensor) -> tuple[Any, float] | None:
    """The process group a DTensor's local squared sum is added across, and the factor it is scaled by first:
    a one-dimensional mesh sharded on it (FSDP2's Shard(0)): its group, 1; a mesh of several dimensions (FSDP2
    + TP) that spans the world, each dimension sharded or replicated: the world, 1 / the replicated dimensions'
    sizes (their identical copies then add up to the tensor once). None for a plain tensor or another layout
    (a partial sum, a mesh short of the world), which ``full_value`` reduces tensor by tensor. Duck-typed, so
    that a strategy without DTensors does not import them."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return None
    mesh = t.device_mesh
    if len(placements) == 1:
        return (mesh.get_group(0), 1.0) if placements[0].is_shard() else None
    if not all(_split(p) or p.is_replicate() for p in placements) or mesh.size() != dist.get_world_size():
        return None
    scale = 1.0
    for dim, p in enumerate(placements):
        if p.is_replicate():
            scale /= mesh.size(dim)
    return dist.group.WORLD, scale


def _split(placement: Any) -> bool:
    """A placement that splits the tensor into disjoint pieces: Shard, or FSDP2 + TP's ``_StridedShard`` (a
    shard of a shard, still a partition; torch's ``is_shard()`` says False for it)."""
    return placement.is_shard() or type(placement).__name__ == "_StridedShard"


def total_norm(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Return the L2 norm over the full values of ``tensors`` (a float64 scalar on the CPU): DTensors split over
    a group (``spread_of``) add their local squared sums in one all-reduce per group, other tensors are reduced
    one by one (``full_value``). Every rank must call it with its tensors in the same order."""
    total = torch.zeros((), dtype=torch.float64)
    by_group: dict[Any, torch.Tensor] = {}  # insertion order: the tensors', the same on every rank
    for t in tensors:
        spread = spread_of(t)
        if spread is None:
            total += full_value(t.detach().float().pow(2).sum()).double().cpu()
            continue
        sq = t.to_local().detach().float().pow(2).sum() * spread[1]
        by_group[spread[0]] = by_group[spread[0]] + sq if spread[0] in by_group else sq
    for group, sq in by_group.items():
        dist.all_reduce(sq, group=group)
        total += sq.double().cpu()
    return total.sqrt()
