"""The pipeline bubble, folded from the ranks' step records (``pp_bubble``, ``pp_span_s``: engines/pipeline.py).

A rank's bubble in a step is the share of its schedule's span it spent outside its stages' compute (waiting for an
input or a gradient, and the point-to-point transfers themselves); the run's is the mean over ranks of each rank's
median over the steps after the first, outside the profiler's window (the papers' 1 − busy / (ranks × makespan),
with each rank's span as the makespan). Must not import torch."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from shardscope.core import pipeline_layout


@dataclass
class BubbleWatch:
    """Per-rank bubble per step of a pipeline run."""

    per_rank: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # rank -> [(step, bubble)]
    timelines: dict[int, list[list[Any]]] = field(default_factory=dict)  # rank -> one step's actions (checked)

    def add(self, rank: int, step: int, record: dict[str, Any]) -> None:
        """Fold a step record's ``pp_bubble`` (a finite number in [0, 1]; anything else is left out)."""
        value = record.get("pp_bubble")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                and 0.0 <= value <= 1.0 and step > 0 and not record.get("profiled"):
            self.per_rank.setdefault(rank, []).append((step, float(value)))
        actions = timeline_of(record.get("pp_timeline"))
        if actions is not None:
            self.timelines[rank] = actions

    def by_rank(self) -> dict[int, float]:
        """Each rank's median bubble."""
        return {r: statistics.median(v for _, v in rows) for r, rows in sorted(self.per_rank.items()) if rows}

    def measured(self) -> float | None:
        """The run's bubble: the mean of the ranks' medians; None before a step after the first."""
        ranks = self.by_rank()
        return statistics.fmean(ranks.values()) if ranks else None


MAX_ACTIONS = 4096


def timeline_of(value: Any) -> list[list[Any]] | None:
    """A step's actions (``[kind, stage, micro-batch, start ms, end ms]``, kind F, B, I or W) when ``value`` is
    exactly that shape, within ``MAX_ACTIONS``, with finite non-negative times; None for anything else."""
    if not isinstance(value, list) or not value or len(value) > MAX_ACTIONS:
        return None
    out = []
    for a in value:
        if not (isinstance(a, list) and len(a) == 5 and a[0] in ("F", "B", "I", "W")
                and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 20 for x in a[1:3])
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and 0 <= x < 1e9
                        for x in a[3:]) and a[3] <= a[4]):
            return None
        out.append(list(a))
    return out


def ideal_timeline(timelines: dict[int, list[list[Any]]]) -> dict[int, list[list[Any]]]:
    """The same actions in the same order per rank, each lasting its kind's median measured duration, each starting
    as soon as its inputs are ready with no transfer time (``pipeline_layout.simulate``): the schedule as its theory
    draws it, at this run's own costs. {} when the actions do not form a complete grid."""
    durations: dict[str, list[float]] = {}
    for actions in timelines.values():
        for kind, _, _, start, end in actions:
            durations.setdefault(kind, []).append(end - start)
    cost = {k: statistics.median(v) for k, v in durations.items()}
    n_stages = 1 + max((a[1] for actions in timelines.values() for a in actions), default=0)
    try:
        timed = pipeline_layout.simulate({r: [tuple(a[:3]) for a in v] for r, v in timelines.items()}, n_stages, cost)
    except ValueError:
        return {}
    return {r: [list(a) for a in v] for r, v in timed.items()}


def pipeline_entry(watch: BubbleWatch, notes: dict[str, Any]) -> dict[str, Any] | None:
    """The summary's ``pipeline`` entry of a run: schedule, degrees, the bubble measured (run and per rank) beside
    its theory and the formula; None for a run whose start record names no schedule."""
    schedule = notes.get("schedule")
    if not isinstance(schedule, str) or not schedule:
        return None
    theory = notes.get("bubble_theory")
    measured = watch.measured()
    return {
        "schedule": schedule,
        "pp": notes.get("pp"), "microbatches": notes.get("microbatches"), "stages_per_rank": notes.get("stages_per_rank"),
        "bubble_measured": measured,
        "bubble_by_rank": {str(r): v for r, v in watch.by_rank().items()},
        "bubble_theory": theory if isinstance(theory, (int, float)) and not isinstance(theory, bool) else None,
        "bubble_formula": str(notes.get("bubble_formula") or ""),
        "not_measured": None if measured is not None else "no step after the first outside the profiler's window",
        "timeline": {str(r): v for r, v in sorted(watch.timelines.items())},
    }


def bubble_text(entry: dict[str, Any] | None) -> str:
    """``12.3% (theory 20.0%)`` for tables; "" for a run that is not a pipeline."""
    if not entry:
        return ""
    measured, theory = entry.get("bubble_measured"), entry.get("bubble_theory")
    shown = "not measured" if measured is None else f"{measured:.1%}"
    return shown + (f" (theory {theory:.1%})" if theory is not None else "")
