"""Per-rank step timing in the report: the summary section, its markdown and a plot.

Reads what the fold gathered in each run's ``StragglerWatch`` (``profiling/stragglers.py``).
"""

from __future__ import annotations

import os
from typing import Any

from shardscope.profiling.state import RunState
from shardscope.profiling import stragglers
from shardscope.profiling.stragglers import BUSY, PHASE_KEYS

NOT_MEASURED = "not measured: the ranks' step records carry no busy time (GPU runs, or records from before it)"


def section(states: dict[str, RunState]) -> dict[str, Any]:
    """Return ``{run: {threshold, window, flagged: [...], per_rank: {rank: {host, device, busy_s,
    time_*_s}}}}``; a run without timing has ``per_rank`` None and a ``reason``."""
    out: dict[str, Any] = {}
    for name, st in states.items():
        watch = st.stragglers
        entry: dict[str, Any] = {"threshold": watch.threshold, "window": watch.window, "flagged": []}
        if not watch.timing:
            entry.update(per_rank=None, reason=NOT_MEASURED)
            out[name] = entry
            continue
        entry["per_rank"] = {str(rank): {"host": (st.start.get(rank) or {}).get("host"),
                                         "device": (st.start.get(rank) or {}).get("device"), **figures}
                             for rank, figures in watch.per_rank().items()}
        for s in watch.flagged.values():
            start = st.start.get(s.rank) or {}
            entry["flagged"].append({"rank": s.rank, "host": start.get("host"), "device": start.get("device"),
                                     "from_step": s.from_step, "ratio": s.ratio, "steps": s.steps,
                                     "line": stragglers.describe(name, s, start, watch.threshold)})
        out[name] = entry
    return out


def _ms(v: Any) -> str:
    return "-" if v is None else f"{1000 * v:.1f}"


def rows(entry: dict[str, Any]) -> list[list[str]]:
    """Table rows (rank, host, device, busy ms, phase ms...) of one run's section entry."""
    flagged = {f["rank"] for f in entry.get("flagged", [])}
    return [[rank + (" ⚠" if int(rank) in flagged else ""), str(r.get("host") or "-"), str(r.get("device") or "-"),
             *(_ms(r.get(k)) for k in (BUSY, *PHASE_KEYS))] for rank, r in (entry.get("per_rank") or {}).items()]


HEADER = ["rank", "host", "device", "busy ms", "data ms", "forward ms", "backward ms", "optimizer ms", "comm wait ms"]


def markdown(sec: dict[str, Any], table: Any) -> str:
    """Return the report.md section; ``table(header, rows)`` renders a markdown table."""
    if not sec:
        return ""
    out = ["## Per-rank step timing and stragglers\n",
           "Medians over steps after step 0. *busy* is the CPU time the rank used in the step (a rank waiting in a "
           "collective uses none); the phases are wall clock, so a rank waiting for a straggler shows it in the "
           "phase where it waits. A rank is flagged when its busy time stays above its peers' median by the "
           "threshold for the window of steps.\n"]
    for name, entry in sec.items():
        out.append(f"**{name}** (threshold {entry['threshold']:g}x, window {entry['window']} steps)\n")
        if entry.get("per_rank") is None:
            out.append(f"{entry.get('reason', NOT_MEASURED)}\n")
            continue
        out.append(table(HEADER, rows(entry)))
        out += [f"- **{f['line']}**\n" for f in entry["flagged"]] or ["No straggler.\n"]
    return "\n".join(out)


def plot(states: dict[str, RunState], path: str) -> str | None:
    """Busy time per step of every rank, one panel per run with timing; returns the path or None."""
    runs = [(n, st) for n, st in states.items() if st.stragglers.timing]
    if not runs:
        return None
    from shardscope.profiling.plots import _pyplot, _save

    plt = _pyplot()
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.6 * len(runs)), squeeze=False)
    for ax, (name, st) in zip(axes[:, 0], runs):
        for rank, steps in sorted(st.stragglers.timing.items()):
            xs = sorted(steps)
            flagged = rank in st.stragglers.flagged
            ax.plot(xs, [1000 * steps[s][BUSY] for s in xs], label=f"rank {rank}" + (" (straggler)" if flagged else ""),
                    linewidth=2.0 if flagged else 1.2)
        ax.set_title(f"{name}: busy time per step")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    return _save(fig, path)
