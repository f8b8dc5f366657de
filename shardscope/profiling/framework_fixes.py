"""Fixes shardscope can apply to a framework, and the figures the framework gives without them.

A run measures each framework as its users get it: options flagged ``framework_fix`` in the
registry (e.g. DeepSpeed ZeRO-3's ``reuse_fp32_partitions``) default off. When a user turns one
on, the report states both memory-model predictions, with the fix and as the framework ships.
Pure Python (no torch).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardscope.config import Comparison, RunSpec, resolved_options
from shardscope.core import registry
from shardscope.profiling import memory_model
from shardscope.core.numbers import fmt_bytes


def fixes_on(run: RunSpec) -> list[str]:
    """Names of the run's options that change its framework's own behaviour and are turned on."""
    info = registry.get(run.strategy)
    options = resolved_options(run)
    return sorted(k for k, spec in info.options.items() if spec.framework_fix and options.get(k) is True)


def as_shipped(c: Comparison, run: RunSpec, world_size: int | None = None) -> dict[str, Any] | None:
    """Memory-model prediction of ``run`` with its framework fixes off; None when none is on.

    Returns ``{"fixes": [option names], "predicted": memory_model.predict_run(...) without them}``.
    """
    fixes = fixes_on(run)
    if not fixes:
        return None
    shipped = dataclasses.replace(run, options={**run.options, **{k: False for k in fixes}})
    return {"fixes": fixes, "predicted": memory_model.predict_run(c, shipped, world_size)}


def note_md(name: str, predicted: dict[str, Any], shipped: dict[str, Any] | None) -> str:
    """One report line stating model states with the fix and as the framework ships; "" without a fix."""
    if not shipped:
        return ""
    with_fix, without = predicted["model_state_bytes"], shipped["predicted"]["model_state_bytes"]
    fixes = ", ".join(f"`{k} = true`" for k in shipped["fixes"])
    return (f"- {name}: {fixes} is a fix shardscope applies to the framework; predicted model states "
            f"{fmt_bytes(with_fix)} per rank with it, {fmt_bytes(without)} as the framework ships "
            f"({with_fix / without:.3f}x).\n" if without else "")
