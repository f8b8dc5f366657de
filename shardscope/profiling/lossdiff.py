"""The one comparison of two loss curves, used by summary.json, the diff command and the locator.

A non-finite loss is a difference, never "equal": a step where either side is NaN (or the two are
different infinities) is beyond any tolerance and is listed, and max/mean |Δ| are taken over the
steps where both are finite only, so that a NaN never turns into a 0 that reads as agreement.
"""

from __future__ import annotations

import math
from typing import Any


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def step_difference(value: float, base: float) -> float:
    """|value - base| when both are finite; ``inf`` when either is NaN or they are different
    infinities; 0 when both are the same infinity."""
    if _finite(value) and _finite(base):
        return abs(value - base)
    return 0.0 if value == base and not math.isnan(value) else math.inf


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def loss_diff(old: list[tuple[int, float]], new: list[tuple[int, float]], tol: float) -> dict[str, Any]:
    """Compare losses at common steps. A step where either side is non-finite (and they are not the
    same infinity) counts as beyond tolerance and is listed in ``nonfinite_steps``; max/mean |Δ| are
    over the finite steps (None when there are none)."""
    a = dict(old)
    diffs: list[float] = []
    nonfinite: list[int] = []
    first: dict[str, Any] | None = None
    common = 0
    for step, value in sorted(new):
        if step not in a:
            continue
        common += 1
        base = a[step]
        d = step_difference(value, base)
        if _finite(value) and _finite(base):
            diffs.append(d)
            beyond = d > tol
        else:
            beyond = d > 0  # NaN never equals; +inf == +inf
            if beyond:
                nonfinite.append(step)
        if beyond and first is None:
            first = {"step": step, "old": base, "new": value, "abs_diff": d}
    return {"steps_compared": common, "max_abs_diff": max(diffs) if diffs else None,
            "mean_abs_diff": sum(diffs) / len(diffs) if diffs else None, "nonfinite_steps": nonfinite,
            "first_beyond": first, "tolerance": tol}
