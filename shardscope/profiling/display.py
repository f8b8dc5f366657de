"""How summary figures read in every view (report.md, the headless tables, the app's report screen).

One place decides how a status, a loss difference, a rate's unit and a tiny number are written, so
the views cannot disagree. Pure Python: no torch, no rich, no textual.
"""

from __future__ import annotations

import math
from typing import Any

NOT_MEASURED = "not measured"


def status_text(run: dict[str, Any]) -> str:
    """A summary run entry's status, with the first non-finite step of a diverged run."""
    status = str(run.get("status", ""))
    step = run.get("diverged_step")
    return f"{status} at step {step}" if status == "diverged" and step is not None else status


def loss_diff_text(run: dict[str, Any], key: str = "loss_max_abs_diff") -> str:
    """A loss difference from the baseline: ``non-finite at step N`` when either side was NaN/inf at a
    common step (never a 0 that reads as equal), else the figure in scientific notation, or ``-``."""
    steps = run.get("loss_nonfinite_steps") or []
    if steps and (key != "loss_final_abs_diff" or run.get(key) is None):
        return f"non-finite at step {steps[0]}"
    return sci(run.get(key))


def sci(value: Any, digits: int = 2) -> str:
    """A small or large figure in scientific notation (``1.19e-07``); ``-`` for None; ``nan``/``inf`` as such."""
    if value is None:
        return "-"
    value = float(value)
    if not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}e}"


def rate_unit(runs: list[dict[str, Any]]) -> str:
    """``tokens/s``, ``samples/s`` or both (``tokens/s | samples/s``) for the median rates of ``runs``."""
    units = []
    if any(r.get("median_tokens_per_s") is not None for r in runs):
        units.append("tokens/s")
    if any(r.get("median_samples_per_s") is not None for r in runs):
        units.append("samples/s")
    return " | ".join(units) or "tokens/s"


def comm_not_measured(profile_enabled: bool, start_step: int, steps_completed: int) -> str:
    """Why a run has no communication figures: profiling off, the run ended before the profiler's
    window, or no traces were written. Shown as "not measured: <reason>", null in summary.json."""
    if not profile_enabled:
        return "profiling off (profile.enabled = false)"
    if steps_completed <= start_step:
        return f"no traces: the run ended (step {steps_completed}) before the profiler window (step {start_step})"
    return "no traces were written"
