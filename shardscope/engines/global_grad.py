"""Gradient figures made global, the one way every strategy does it.

``full_value``: a DTensor (FSDP2, tensor parallel) holds a shard or a partial sum until it is reduced;
``full_tensor()`` reduces it according to its placements, a plain tensor is already whole.
``clip_coefficient``: torch's ``clip_grad_norm_`` rule, shared by the strategies that clip by hand
(the hand-written FSDP, FSDP2 + TP, DeepSpeed's hook), so every run clips the same way.
"""

from __future__ import annotations

from typing import TypeVar

import torch

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
