"""Precision policies: the preset's ``precision`` name -> an explicit ``api.PrecisionPolicy``.

- ``fp32``: everything in fp32.
- ``bf16-autocast``: fp32 parameters and master weights, bf16 compute via ``torch.autocast``,
  fp32 gradient reduction.
- ``bf16-params``: parameters gathered/held in bf16 where the strategy supports it (FSDP mixed
  precision, the hand-written FSDP), fp32 sharded master weights and fp32 gradient reduction. A
  strategy that cannot hold bf16 parameters (DDP) leaves ``handles_precision`` False and the loop
  falls back to bf16 autocast, so compute is bf16 either way; ``Prepared.notes`` says which.
- ``fp16``: like bf16-autocast in fp16, plus dynamic loss scaling (torch strategies on any device;
  DeepSpeed on a GPU or an AVX512-FP16/AMX-FP16 CPU).
"""

from __future__ import annotations

import torch

from shardscope.engines.api import PrecisionPolicy

_F32, _BF16, _F16 = torch.float32, torch.bfloat16, torch.float16

POLICIES: dict[str, PrecisionPolicy] = {
    "fp32": PrecisionPolicy("fp32", _F32, _F32, _F32, _F32, autocast=False, loss_scaling=False),
    "bf16-autocast": PrecisionPolicy("bf16-autocast", _F32, _BF16, _F32, _F32, autocast=True, loss_scaling=False),
    "bf16-params": PrecisionPolicy("bf16-params", _BF16, _BF16, _F32, _F32, autocast=True, loss_scaling=False),
    "fp16": PrecisionPolicy("fp16", _F32, _F16, _F32, _F32, autocast=True, loss_scaling=True),
}

DTYPES: dict[str, torch.dtype] = {"fp32": _F32, "bf16": _BF16, "fp16": _F16}


def policy_for(name: str) -> PrecisionPolicy:
    """Return the policy called ``name``; raises ValueError naming the allowed policies."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"precision = {name!r}: allowed: {', '.join(POLICIES)}") from None


def option_dtype(value: str, default: torch.dtype) -> torch.dtype:
    """Return the dtype for a strategy option ("auto" -> ``default``); raises ValueError."""
    if value == "auto":
        return default
    try:
        return DTYPES[value]
    except KeyError:
        raise ValueError(f"dtype option {value!r}: allowed: auto, {', '.join(DTYPES)}") from None


def loop_autocast_dtype(policy: PrecisionPolicy, handles_precision: bool) -> torch.dtype | None:
    """Return the dtype the loop should autocast the forward to, or None for no autocast."""
    if handles_precision or not policy.autocast or policy.compute_dtype == _F32:
        return None
    return policy.compute_dtype
