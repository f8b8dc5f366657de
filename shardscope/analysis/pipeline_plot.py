"""The pipeline timeline: each rank's stage actions in one step, measured, above the ideal schedule of the same
actions at the same costs (the figure of the pipeline papers), one PNG per pipeline run.

Measured: the actions' intervals the rank recorded (engines/pipeline.py: ``pp_timeline``), forward, full backward,
input-gradient and weight-gradient passes coloured apart, the gaps between them idle (the bubble, with the
transfers and, on a shared CPU, the waits for a core). Ideal: ``bubble.ideal_timeline``: the same actions in the same
order, each lasting its kind's median measured duration, no transfer time.
"""

from __future__ import annotations

from typing import Any

from shardscope.analysis.plots import _pyplot, _save, no_data
from shardscope.core.rundir import plot_file
from shardscope.profiling.bubble import ideal_timeline, timeline_of

KIND_COLORS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}
KIND_NAMES = {"F": "forward", "B": "backward (input + weight)", "I": "backward: input gradient",
              "W": "backward: weight gradient"}


def _checked(raw: Any) -> dict[int, list[list[Any]]]:
    """The summary's per-rank timelines, each re-checked (a summary file is read from disk)."""
    out: dict[int, list[list[Any]]] = {}
    if isinstance(raw, dict):
        for rank, value in raw.items():
            actions = timeline_of(value)
            if actions is not None and str(rank).isdigit():
                out[int(rank)] = actions
    return dict(sorted(out.items()))


# Drawn in bounded time whatever a summary file holds: one bar collection per rank and kind, the micro-batch numbers
# only while they can be read, at most MAX_RANKS rows; more is said in the title, never drawn (a crafted timeline
# of every rank's MAX_ACTIONS kept `report` in matplotlib for minutes when each action was its own artist).
MAX_RANKS = 64
MAX_LABELS = 600
MAX_IDEAL_ACTIONS = 20_000  # the ideal schedule is simulated action by action: past this it is not drawn


def _bounded(timelines: dict[int, list[list[Any]]]) -> tuple[dict[int, list[list[Any]]], str]:
    """At most ``MAX_RANKS`` ranks' timelines, and what was left out ("" when nothing)."""
    if len(timelines) <= MAX_RANKS:
        return timelines, ""
    kept = dict(list(timelines.items())[:MAX_RANKS])
    return kept, f"; the first {MAX_RANKS} of {len(timelines)} ranks drawn"


def _draw(ax: Any, timelines: dict[int, list[list[Any]]], title: str) -> set[str]:
    kinds: set[str] = set()
    labels = sum(len(a) for a in timelines.values()) <= MAX_LABELS
    for row, (rank, actions) in enumerate(timelines.items()):
        by_kind: dict[str, list[tuple[float, float]]] = {}
        for kind, stage, mb, start, end in actions:
            by_kind.setdefault(kind, []).append((start, max(end - start, 1e-3)))
            if labels and end - start > 0:
                ax.text((start + end) / 2, row, f"{mb}", ha="center", va="center", fontsize=6, color="white")
        for kind, bars in by_kind.items():
            ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=KIND_COLORS[kind], edgecolor="white", linewidth=0.4)
            kinds.add(kind)
    if not labels:
        title += " (too many actions to number)"
    ax.set_yticks(range(len(timelines)), [f"rank {r}" for r in timelines])
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("ms since the schedule started")
    return kinds


def timeline_plot(run: dict[str, Any], path: str) -> str | None:
    """Write ``run``'s pipeline timeline (measured above ideal) to ``path``; None for a run without one."""
    pipeline = run.get("pipeline") if isinstance(run, dict) else None
    if not isinstance(pipeline, dict):
        return None
    measured, cut = _bounded(_checked(pipeline.get("timeline")))
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 1.6 + 0.9 * max(2, len(measured))), sharex=True)
    name = str(run.get("name", ""))
    if not measured:
        no_data(top, "no step's actions were recorded")
        no_data(bottom, "nothing to schedule")
        return _save(fig, path)
    bubble = pipeline.get("bubble_measured")
    theory = pipeline.get("bubble_theory")
    kinds = _draw(top, measured, f"{name}: measured ({pipeline.get('schedule')}, p = {pipeline.get('pp')}, "
                                 f"v = {pipeline.get('stages_per_rank')}, m = {pipeline.get('microbatches')}; bubble "
                                 + (f"{bubble:.0%} over the run" if isinstance(bubble, (int, float)) else "not measured")
                                 + f"); numbers are micro-batches, gaps idle{cut}")
    actions = sum(len(a) for a in measured.values())
    ideal = ideal_timeline(measured) if actions <= MAX_IDEAL_ACTIONS else {}
    if actions > MAX_IDEAL_ACTIONS:
        no_data(bottom, f"not simulated: {actions:,} actions, over the {MAX_IDEAL_ACTIONS:,} drawn as an ideal schedule")
    elif ideal:
        _draw(bottom, ideal, "ideal: the same actions at their median measured durations, no transfer time"
              + (f" (theory: bubble {theory:.0%})" if isinstance(theory, (int, float)) else ""))
    else:
        no_data(bottom, "the recorded actions do not form a complete schedule")
    top.set_xlabel("")
    from matplotlib.patches import Patch

    # outside the axes, never over the bars (plots.legend_outside reads labelled artists; these bars carry none)
    top.legend(handles=[Patch(color=KIND_COLORS[k], label=KIND_NAMES[k]) for k in "FBIW" if k in kinds],
               loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8)
    return _save(fig, path)


def write_timelines(summary: dict[str, Any], plots_dir: str) -> dict[str, str]:
    """A timeline PNG for each pipeline run of ``summary`` under ``plots_dir``; {plot name: path}."""
    out = {}
    for run in summary.get("runs", []):
        if isinstance(run, dict) and isinstance(run.get("pipeline"), dict):
            key = f"pipeline_{run.get('name')}"
            path = timeline_plot(run, plot_file(plots_dir, key))
            if path:
                out[key] = path
    return out
