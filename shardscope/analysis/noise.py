"""How much a throughput figure can be trusted on this machine, now: summary.json's ``noise`` section.

Two measurements, both from the comparison's own records:
- **between runs**: the A/A control (``schema.with_control``: the baseline run again, last, same lr schedule) against
  the baseline over the same steps: how far a run's median tokens/s moves when nothing about it changes. Every
  throughput verdict is held against it (``numbers.speed_verdict``): one sample of the between-run movement, stated
  as such, never smaller than the runs' own step-to-step spread.
- **core wait**: the share of the time a run's ranks were ready to run and found no free core (the run queue's
  wait, ``straggler_report.core_wait_share``). Past ``CONTENDED`` the wall-clock figures of that run measure the
  machine's load as much as the strategy; a CPU comparison is then ranked by busy CPU time per token, which the
  wait does not distort (each rank's own CPU time in a step, summed over ranks, over the tokens of a step).
"""

from __future__ import annotations

from typing import Any

from shardscope.config import Comparison, control_runs
from shardscope.presets.schema import CONTROL_MIN_STEPS
from shardscope.core.numbers import median_rate, move_of
from shardscope.analysis.straggler_report import BUSY, CONTENDED, core_wait_share
from shardscope.profiling.state import RunState

OK = "ok"


def between_runs(c: Comparison, states: dict[str, RunState]) -> dict[str, Any]:
    """The A/A control against its baseline over the same steps: ``moved`` (the larger of the two medians over the
    smaller, minus 1), the two rates and steps; ``measured`` False with ``why`` when there is no control to read."""
    controls = control_runs(c)
    if not controls:
        if not c.control:
            why = "control = false"
        elif len(c.runs) >= 2 and c.steps >= CONTROL_MIN_STEPS:
            why = "no A/A control in this run directory (written before shardscope ran one)"
        else:
            why = (f"no A/A control: it needs 2 runs or more and at least {CONTROL_MIN_STEPS} steps (this comparison: "
                   f"{len(c.runs)} run(s), {c.steps} steps)")
        return {"measured": False, "why": why}
    control = controls[0]
    ctl, base = states.get(control.name), states.get(control.control_of)
    if ctl is None or base is None or ctl.status != OK or base.status != OK:
        return {"measured": False, "control": control.name, "baseline": control.control_of,
                "why": f"the A/A control {control.name} or its baseline {control.control_of} did not end ok"}
    steps = control.steps or c.steps
    base_rate = median_rate([(s, r) for s, r in base.throughput if s < steps])
    ctl_rate = median_rate(ctl.throughput)
    if not base_rate or not ctl_rate:
        return {"measured": False, "control": control.name, "baseline": control.control_of,
                "why": "no timed step to compare"}
    return {"measured": True, "control": control.name, "baseline": control.control_of, "steps": steps,
            "baseline_rate": base_rate, "control_rate": ctl_rate, "moved": move_of(ctl_rate, base_rate)}


def busy_per_token(st: RunState, entry: dict[str, Any]) -> float | None:
    """CPU seconds the run's ranks used per token (each rank's median busy time per step, summed, over the tokens of a
    step); None where not measured."""
    ranks = [r.get(BUSY) for r in (entry.get("per_rank") or {}).values()]
    if not ranks or any(b is None for b in ranks) or not st.tokens_per_step:
        return None
    return sum(ranks) / st.tokens_per_step


def section(c: Comparison, states: dict[str, RunState], stragglers: dict[str, Any]) -> dict[str, Any]:
    """summary.json's ``noise``: ``between`` (the A/A control), ``core_wait`` (share per run), ``contended`` (the
    runs past ``CONTENDED``) and ``busy_per_token`` (CPU seconds per token per run)."""
    waits = {name: core_wait_share(stragglers.get(name) or {}) for name in states}
    busy = {name: busy_per_token(st, stragglers.get(name) or {}) for name, st in states.items()}
    return {"between": between_runs(c, states), "core_wait": waits, "contended_share": CONTENDED,
            "contended": sorted(n for n, w in waits.items() if w is not None and w >= CONTENDED),
            "busy_per_token": busy}


def busy_move(noise: dict[str, Any]) -> float | None:
    """How far the A/A control moved from its baseline in busy CPU time per token (None where either is missing)."""
    between = (noise or {}).get("between") or {}
    per_token = (noise or {}).get("busy_per_token") or {}
    a, b = per_token.get(between.get("control")), per_token.get(between.get("baseline"))
    return move_of(a, b) if between.get("measured") and a and b else None


def line(noise: dict[str, Any], busy: bool = False) -> str:
    """One sentence on the between-run noise, for the answer and the recommendation, on the basis the runs are
    ranked by: wall-clock tokens/s, or with ``busy`` busy CPU time per token (one figure per answer, said once)."""
    between = (noise or {}).get("between") or {}
    if not between.get("measured"):
        return f"between-run noise not measured ({between.get('why', 'no A/A control')})"
    moved = busy_move(noise) if busy else None
    if moved is not None:
        return (f"A/A control, in busy CPU time per token (the basis of the ranking): {between['baseline']} run again "
                f"moved {moved:.1%}: a difference inside that is not a difference on this machine now")
    return (f"A/A control, in wall-clock tokens/s: {between['baseline']} run again moved {between['moved']:.1%} "
            f"({between['control_rate']:,.0f} vs {between['baseline_rate']:,.0f} over its first {between['steps']} "
            "steps): a throughput difference inside that is not a difference on this machine now")
