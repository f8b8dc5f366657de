"""Communication per run: time, count and bytes per collective and per profiled step.

Two sources: rank 0's ``comm`` record, written by the ranks when ``profile.count_collectives`` is on
(bytes and calls counted in-rank over the profiler window; no times), else the run's trace analysis
(``profiling.traces.analyse_run``, with times) once its profiler window has been recorded.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from shardscope.core.text import clean
from shardscope.profiling.state import RunState
from shardscope.tui.format import human_bytes, is_number, number, plain
from shardscope.tui.widgets.scroll_panel import ScrollPanel

EMPTY = ("No communication figures yet. Each run's collectives (all-reduce, all-gather, reduce-scatter…) "
         "appear here once its profiler window has been recorded and analysed.")


def _first(figs: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if figs.get(key) is not None:
            return number(figs[key])  # a record's figure: a string there is no figure
    return None


NARROW = 44  # columns below which collective names are abbreviated
SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "broadcast": "BC", "all_to_all": "A2A",
         "barrier": "BAR", "all_gather_into_tensor": "AG", "reduce_scatter_tensor": "RS"}


def collectives(record: dict[str, Any]) -> list[tuple[str, float | None, float | None, float | None]]:
    """Return (name, time in s, count, bytes) per collective and per step, largest time first.

    Reads a ``comm`` record (``engines/comm_count.py``: ``count_per_step``, ``bytes_per_step``;
    its ``count`` is the whole window's, so the per-step keys win) or ``profiling.traces.analyse_run``'s
    result (``time_per_step_s`` too): ``collectives`` maps a name to figures, or is a list of dicts
    with ``name``/``op``; plain ``time_s``/``time_ms``/``count``/``bytes`` are read when a source has
    no per-step keys. A figure a source lacks is None; other shapes give [].
    """
    raw = record.get("collectives", {})
    if isinstance(raw, list):
        items = [(d.get("name") or d.get("op") or "?", d) for d in raw if isinstance(d, dict)]
    else:
        items = list(raw.items()) if isinstance(raw, dict) else []
    out = []
    for name, figs in items:
        if not isinstance(figs, dict):
            continue
        t = _first(figs, "time_per_step_s", "time_s")
        if t is None and is_number(figs.get("time_ms")):
            t = figs["time_ms"] / 1000
        out.append((str(name), t, _first(figs, "count_per_step", "count"), _first(figs, "bytes_per_step", "bytes")))
    return sorted(out, key=lambda row: -(row[1] or 0))


EMPTY_FINISHED = ("No communication figures: no run recorded a profiler window. The window is set by "
                  "profile.start_step and profile.steps in the preset (it must start before the last step).")


def theory_text(theory: dict[str, Any] | None, compact: bool = False) -> Text:
    """Observed/theory bytes of a run's trace analysis (``1.00× th``); "" before the analysis, "th ?" when the
    theory could not be computed or some sizes were unknown (the report says which)."""
    if not theory or not isinstance(theory, dict):
        return Text("")
    ratio = theory.get("ratio")
    if not is_number(ratio):
        return Text("th ?", "dim")
    style = "green" if abs(ratio - 1) <= 0.02 else "yellow"
    return Text(f"{ratio:.2f}×th" if compact else f"{ratio:.2f}× th", style)


def _heading(name: str, colour: str, exposed: Any, theory: dict[str, Any] | None, compact: bool) -> Text:
    """A run's line above its collectives: name, exposed communication per step, observed/theory bytes."""
    heading = Text.assemble((clean(f"■ {name}"), f"bold {colour}"))
    if isinstance(exposed, (int, float)):
        heading.append(f" {exposed * 1000:.1f}ms {'exp.' if compact else 'exposed'}", "dim")
    ratio = theory_text(theory, compact=compact)
    if ratio:
        heading.append(" ")
        heading.append_text(ratio)
    return heading


def _table(narrow: bool, header: bool) -> Table:
    """One run's collectives: fixed widths for the figures so that every run's columns line up."""
    table = Table(expand=True, box=None, padding=(0, 0, 0, 1), show_edge=False, show_header=header)
    table.add_column("op" if narrow else "collective", ratio=1, min_width=3, no_wrap=True, overflow="ellipsis",
                     header_style="dim")
    for col, width in (("time", 8), ("count", 5), ("bytes", 9)):
        table.add_column(col, justify="right", no_wrap=True, header_style="dim", min_width=width)
    return table


class CommPanel(ScrollPanel):
    """Shows each run's collectives (rank 0's figures); the parent calls ``show``. It scrolls: a short
    terminal hides no run's rows, it shows a scroll bar instead."""

    def show(self, states: list[tuple[RunState, str]], analyses: dict[str, dict[str, Any]],
             finished: bool = False) -> None:
        """Redraw from (state, colour) pairs: rank 0's ``comm`` record (the in-rank count), else the
        run's trace analysis."""
        width = self.line_width  # without the scroll bar
        narrow = 0 < width < NARROW  # abbreviate by rule, with a legend, instead of cutting
        blocks: list[Any] = []  # per run: a heading line (never cut: it wraps) and its table of collectives
        any_rows = False
        used: set[str] = set()  # abbreviated collective names, for the legend
        notes: list[Text] = []  # runs without figures, each with its reason
        for state, colour in states:
            if state.comm:
                source = state.comm[0 if 0 in state.comm else min(state.comm)]
            elif analyses.get(state.name, {}).get("collectives"):
                source = analyses[state.name]
            else:
                reason = analyses.get(state.name, {}).get("not_measured")
                if reason:
                    notes.append(Text.assemble((clean(f"■ {state.name}"), f"bold {colour}"),
                                               (clean(f" not measured: {reason}"), "dim")))
                continue
            per_step = source.get("per_step") if isinstance(source.get("per_step"), dict) else {}
            exposed = per_step.get("exposed_comm_s")
            heading = _heading(state.name, colour, exposed, analyses.get(state.name, {}).get("theory"), False)
            if len(heading) > width > 0:  # by rule: short words before a wrapped line
                heading = _heading(state.name, colour, exposed, analyses.get(state.name, {}).get("theory"), True)
            table = _table(narrow, header=False)
            for name, t, count, nbytes in collectives(source):
                any_rows = True
                shown = SHORT.get(name, name) if narrow else name.replace("_", "-")
                used.update([name] if narrow and name in SHORT else [])
                # a str cell is markup to rich: the name (from a record or a trace) goes in as Text
                table.add_row(plain(" " + shown), "–" if t is None else f"{t * 1000:.1f}ms",
                              "–" if count is None else f"×{count:g}", human_bytes(nbytes).replace(" ", ""))
            blocks += [heading, table]
        # The abbreviations' legend: on the border where it fits whole, else as the last lines (the panel
        # scrolls, so a short panel hides nothing).
        short = {SHORT[n]: n.replace("_", "-") for n in used}
        legend = " · ".join(f"{k} {short[k]}" for k in sorted(short))
        fits = len(legend) + 4 <= self.size.width
        self.border_subtitle = legend if fits else ""
        if any_rows:
            tail = [Text(legend, "dim")] if legend and not fits else []
            self.update(Group(Text("per profiled step", "dim italic"), _table(narrow, header=True),
                              *blocks, *notes, *tail))
        elif notes:
            self.update(Group(*notes))
        else:
            self.update(Text(EMPTY_FINISHED if finished else EMPTY, "dim"))
