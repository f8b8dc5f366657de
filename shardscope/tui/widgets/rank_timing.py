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
from shardscope.profiling import bubble
from shardscope.core.text import clean
from shardscope.profiling.state import RunState
from shardscope.tui.format import literal

REFRESH_S = 1.0
# straggler_report.HEADER, shortened for a panel a third of the screen wide (device is on the flag line).
COLUMNS = ("rank", "host", "busy", "data", "fwd", "bwd", "opt", "idle", "wait")
# Left out in this order while the table is wider than the panel (at 100 columns the panel is ~30 wide):
# rank, busy, idle and wait stay, the straggler and contention signals.
NARROW_DROPS = ("host", "data", "opt", "bwd", "fwd")


class RankTiming(Static):
    """Per-rank medians of one run's step timing, in ms; ⚠ marks a flagged straggler."""

    def __init__(self, **kwargs) -> None:
        super().__init__("", **kwargs)
        self.run = ""
        self._t = 0.0
        self._drawn: tuple = ()
        self._last: tuple[RunState, dict | None] | None = None

    def show(self, state: RunState | None, analysis: dict | None = None, *, force: bool = False) -> None:
        """Redraw for ``state`` when it moved on since the last drawing, at most once a second (``force``:
        now, as when the selected run changes). ``analysis``: the run's trace analysis once its profiler
        window was written (stragglers judged from GPU traces)."""
        now = time.monotonic()
        if state is None:
            return
        width = self.content_size.width
        key = (state.name, state.steps_completed, state.status, len(state.stragglers.flagged), id(analysis), width)
        if not force and (key == self._drawn or now - self._t < REFRESH_S):
            return
        self.run, self._t, self._drawn, self._last = state.name, now, key, (state, analysis)
        self.border_title = f"rank timing · {literal(state.name)} (median ms)"
        self.update(render(state, analysis, width or None))

    def on_resize(self) -> None:
        """Lay the table out again for the new width (columns are left out or come back)."""
        if self._last is not None and self.display:
            self.show(*self._last, force=True)


def fit_columns(rows: list[list[str]], width: int | None) -> list[int]:
    """Indices into COLUMNS that fit ``width`` cells (three between columns), leaving out NARROW_DROPS in
    order while they do not; all of them when ``width`` is None."""
    keep = list(range(len(COLUMNS)))
    if width is None:
        return keep

    def need(cols: list[int]) -> int:
        # between two columns: a cell of padding on each side and the box's divider
        return sum(max(len(COLUMNS[c]), *(len(r[c]) for r in rows)) for c in cols) + 3 * (len(cols) - 1)

    for name in NARROW_DROPS:
        if need(keep) <= width:
            break
        keep.remove(COLUMNS.index(name))
    return keep


def render(state: RunState, analysis: dict | None = None, width: int | None = None) -> Group | Text:
    """The table (or why there is none) for one run, and what its traces say; ``width``: the panel's cells
    (columns are left out to fit, and a line says which)."""
    entry = straggler_report.section({state.name: state}, {state.name: analysis or {}})[state.name]
    if entry.get("per_rank") is None:
        why = "waiting for steps" if state.steps_completed == 0 else entry.get("reason", "")
        return Text(clean(str(why)), style="dim")
    # rank, host, then busy, data, fwd, bwd, opt, idle, core wait (the device is on the flag line)
    # host names come from the ranks' start records: every cell is text (a str cell would be markup to rich)
    rows = [[clean(str(c)) for c in (row[0], row[1], *row[3:])] for row in straggler_report.rows(entry)]
    keep = fit_columns(rows, width)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), expand=False)
    for c in keep:
        table.add_column(COLUMNS[c], justify="left" if COLUMNS[c] in ("rank", "host") else "right", no_wrap=True)
    for row in rows:
        table.add_row(*(Text(row[c]) for c in keep), style="bold red" if "⚠" in row[0] else None)
    lines = [Text(clean(f"⚠ {f['line']}"), style="bold red") for f in entry["flagged"]]
    hidden = [COLUMNS[c] for c in range(len(COLUMNS)) if c not in keep]
    if hidden:
        lines.append(Text(f"{', '.join(hidden)} left out at this width (report, headless table: all)", style="dim"))
    if straggler_report.contention_line(state.name, entry):  # the machine's other load slowed its wall clock
        share = straggler_report.core_wait_share(entry) or 0.0
        lines.append(Text(f"waited for a core {share:.0%} of its ready time: wall-clock figures slowed by other "
                          "load, busy times not", style="yellow"))
    piped = bubble.pipeline_entry(state.bubble, (state.start.get(0) or {}).get("notes") or {})
    if piped and piped.get("bubble_by_rank"):  # a pipeline: each rank's idle share of its schedule, beside theory
        ranks = " · ".join(f"{r} {v:.0%}" for r, v in piped["bubble_by_rank"].items())
        theory = piped.get("bubble_theory")
        lines.append(Text(clean(f"bubble by rank: {ranks}" + (f" (theory {theory:.0%}: {piped['bubble_formula']})"
                                                              if theory is not None else "")), style="cyan"))
    if entry.get("reason"):  # CUDA: the stream-time split, not judged
        lines.append(Text(clean(str(entry["reason"])), style="dim"))
    traced = entry.get("trace")
    if traced:  # after the profiler window: each rank's compute in its trace (judged on GPU traces)
        ranks = " · ".join(f"{r} {1000 * v:.1f}" for r, v in traced["compute_s"].items())
        unjudged = " (CPU traces: not judged)" if traced.get("note") else ""
        lines.append(Text(clean(f"trace compute ms/step by rank: {ranks}{unjudged}"), style="dim"))
        lines += [Text(clean(f"⚠ {f['line']}"), style="bold red") for f in traced["flagged"]]
    caption = Text(f"busy: own CPU time · wait: ready, no free core · ⚠ above {entry['threshold']:g}x peers' median "
                   f"for {entry['window']} steps",
                   style="dim")
    return Group(table, *lines, caption)
