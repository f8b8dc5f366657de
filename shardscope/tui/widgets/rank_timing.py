"""The selected run's per-rank step timing: medians per rank (ms) and the stragglers flagged so far.

The same figures as the report's "Per-rank step timing" table (``analysis/straggler_report.py``),
live: the fold keeps every rank's split in ``RunState.stragglers``. Shown in place of the console
(key ``t``); refreshed at most once a second, since the medians walk every step the run recorded.
"""

from __future__ import annotations

import time

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from shardscope.analysis import straggler_report
from shardscope.profiling.state import RunState

REFRESH_S = 1.0
# straggler_report.HEADER, shortened for a panel a third of the screen wide (device is on the flag line).
COLUMNS = ("rank", "host", "busy", "data", "fwd", "bwd", "opt", "idle")


class RankTiming(Static):
    """Per-rank medians of one run's step timing, in ms; ⚠ marks a flagged straggler."""

    def __init__(self, **kwargs) -> None:
        super().__init__("", **kwargs)
        self.run = ""
        self._t = 0.0
        self._drawn: tuple = ()

    def show(self, state: RunState | None, analysis: dict | None = None, *, force: bool = False) -> None:
        """Redraw for ``state`` when it moved on since the last drawing, at most once a second (``force``:
        now, as when the selected run changes). ``analysis``: the run's trace analysis once its profiler
        window was written (stragglers judged from GPU traces)."""
        now = time.monotonic()
        if state is None:
            return
        key = (state.name, state.steps_completed, state.status, len(state.stragglers.flagged), id(analysis))
        if not force and (key == self._drawn or now - self._t < REFRESH_S):
            return
        self.run, self._t, self._drawn = state.name, now, key
        self.border_title = f"rank timing · {state.name} (median ms)"
        self.update(render(state, analysis))


def render(state: RunState, analysis: dict | None = None) -> Group | Text:
    """The table (or why there is none) for one run, and what its traces say."""
    entry = straggler_report.section({state.name: state}, {state.name: analysis or {}})[state.name]
    if entry.get("per_rank") is None:
        return Text("waiting for steps" if state.steps_completed == 0 else entry.get("reason", ""), style="dim")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), expand=False)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("rank", "host") else "right", no_wrap=True)
    for row in straggler_report.rows(entry):  # rank, host, device, busy, data, fwd, bwd, opt, idle
        table.add_row(row[0], row[1], *row[3:3 + len(COLUMNS) - 2], style="bold red" if "⚠" in row[0] else None)
    lines = [Text(f"⚠ {f['line']}", style="bold red") for f in entry["flagged"]]
    if entry.get("reason"):  # CUDA: the stream-time split, not judged
        lines.append(Text(entry["reason"], style="dim"))
    traced = entry.get("trace")
    if traced:  # after the profiler window: each rank's compute in its trace (judged on GPU traces)
        ranks = " · ".join(f"{r} {1000 * v:.1f}" for r, v in traced["compute_s"].items())
        unjudged = " (CPU traces: not judged)" if traced.get("note") else ""
        lines.append(Text(f"trace compute ms/step by rank: {ranks}{unjudged}", style="dim"))
        lines += [Text(f"⚠ {f['line']}", style="bold red") for f in traced["flagged"]]
    caption = Text(f"busy: own CPU time · ⚠ above {entry['threshold']:g}x peers' median for {entry['window']} steps",
                   style="dim")
    return Group(table, *lines, caption)
