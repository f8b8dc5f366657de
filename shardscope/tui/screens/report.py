"""The final comparison table from ``<out>/summary.json``, and where the artefacts were written.

Before the summary exists (runs still going, or stopped before reports), the table is built from
the live run states instead and says so; a summary.json that cannot be read (damaged, crafted) is said in red
("summary.json unreadable: why") above those live figures. Every name, path and line from the files is shown as
text (``format.plain``/``literal``); a figure that is not a number is shown as missing.
"""

from __future__ import annotations

import os
from typing import Any

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, HelpPanel, Static

from shardscope.config import MAX_NAME, NAME_RE
from shardscope.core.numbers import fmt_sig, median_rate
from shardscope.analysis import answer, noise
from shardscope.analysis.predict import report as predict_report
from shardscope.analysis.summary import memory_headers, on_gpu, throughput_unit
from shardscope.core.rundir import SUMMARY, RunDir, load_summary
from shardscope.tui.board import FOLD_ERRORS, Board
from shardscope.tui.format import display_path, fmt_float, fmt_loss, human_bytes, human_rate, literal, number, plain
from shardscope.tui.screens import report_columns
from shardscope.tui.source import unreadable

COLUMNS = ("run", "strategy", "ranks", "status", "steps", "final loss", "{unit} (median)", "{peak}",
           "Δloss max", "Δloss mean", "speedup", "{ratio}")


def columns(summary: dict[str, Any]) -> tuple[str, ...]:
    """Return the table's headers, the throughput one in the runs' unit (tokens/s or samples/s)."""
    runs = [r for r in summary.get("runs", [])
            if isinstance(r, dict) and not isinstance(r.get("peak_mem_kind"), (list, dict))]  # a file's any shape
    peak, ratio = memory_headers(runs)
    return tuple(c.format(unit=throughput_unit(runs), peak=peak, ratio=ratio) for c in COLUMNS)


def live_summary(board: Board) -> dict[str, Any]:
    """Return a summary-shaped dict from the live states (no diff or ratio figures)."""
    runs = []
    for name, s in board.states.items():
        runs.append({"name": name, "strategy": s.strategy, "world_size": s.world_size, "status": s.status,
                     "steps_completed": s.steps_completed, "final_loss": s.loss,
                     f"median_{s.unit.replace('/', '_per_')}": median_rate(s.throughput),
                     "peak_mem_bytes": s.peak_mem_bytes,
                     "peak_mem_kind": "allocator peak" if on_gpu(s) else "process RSS"})
    return {"baseline": board.baseline, "runs": runs}


def read_report_summary(out_dir: str) -> tuple[dict[str, Any] | None, str]:
    """Return (``<out>/summary.json``, "") when it reads, (None, "") before it is written, and (None, why) when it
    is there but cannot be read ("summary.json unreadable: nested too deeply")."""
    path = RunDir(out_dir).summary
    if not os.path.lexists(path):
        return None, ""
    try:
        return load_summary(out_dir), ""
    except (OSError, ValueError) as err:
        return None, unreadable(path, err)


def summary_rows(summary: dict[str, Any]) -> list[tuple[Text, ...]]:
    """Return one row per run of a summary, each cell a ``Text`` (a name or status from the file is never markup;
    a figure that is not a number is "–")."""
    rows = []
    for r in summary.get("runs", []):
        if not isinstance(r, dict):
            continue
        speed = number(r.get("speedup"))
        ratio = number(r.get("mem_ratio"))
        rate = number(r.get("median_tokens_per_s")) or number(r.get("median_samples_per_s"))
        rows.append(tuple(plain(cell) for cell in (
            str(r.get("name", "?")) + (" (baseline)" if r.get("name") == summary.get("baseline") else " (A/A control)" if r.get("control_of") else ""),
            str(r.get("strategy", "")), str(r.get("world_size", "")), str(r.get("status", "")),
            str(r.get("steps_completed", "")), fmt_loss(r.get("final_loss")),
            human_rate(rate), human_bytes(number(r.get("peak_mem_bytes"))),
            fmt_sig(number(r.get("loss_max_abs_diff"))), fmt_sig(number(r.get("loss_mean_abs_diff"))),
            "–" if speed is None else f"{fmt_float(speed, '.2f')}×",
            "–" if ratio is None else f"{fmt_float(ratio, '.2f')}×",
        )))
    return rows


def artefacts(out_dir: str, run_names: list[str]) -> list[str]:
    """Return lines naming the files written for a comparison (missing ones said so)."""
    lines = []
    out = RunDir(out_dir)
    for path in (out.summary, out.report, out.comparison, out.merged_trace):
        if os.path.exists(path) or path != out.merged_trace:
            name = os.path.basename(path)
            lines.append(f"{name:<17} {display_path(path) if os.path.exists(path) else '(not written yet)'}")
    plots = out.plot_files()
    lines.append(f"{'plots':<17} " + (", ".join(os.path.basename(p) for p in plots) + f"  in {display_path(out.plots)}"
                                      if plots else "(none yet)"))
    for run in run_names:
        files = out.run(run)
        traces = files.trace_files()
        where = display_path(files.traces)
        lines.append(f"{run + ' traces':<17} " + (f"{len(traces)} file(s) in {where}" if traces else "(none)"))
        lines.append(f"{run + ' console':<17} {display_path(files.console())}")
    return lines


class ReportBody(VerticalScroll):
    """The report's scrolling body: tells its screen the width it has whenever that changes (a resized terminal,
    `?`'s panel opened beside it), so the table is laid out again for it."""

    def on_resize(self, event: events.Resize) -> None:
        """Lay the table out for the new width."""
        screen = self.screen
        if isinstance(screen, ReportScreen):
            screen.fit_table(self.scrollable_content_region.width)


class ReportScreen(Screen):
    """The comparison table and the artefact paths. Escape goes back to the dashboard. The table is laid out for
    the width it has (``report_columns``: abbreviated headers, or split in two) and `?` explains its abbreviations."""

    BINDINGS = [
        Binding("escape,o", "app.pop_screen", "Back"),
        Binding("e", "app.export", "Export"),
        Binding("q", "app.quit", "Quit"),
    ]

    def __init__(self, out_dir: str, board: Board) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.board = board
        self.headers: tuple[str, ...] = ()  # the table's full headers, its rows, and how they are laid out now
        self.rows: list[tuple[Text, ...]] = []
        self.table_layout: report_columns.Layout | None = None

    def compose(self) -> ComposeResult:
        """Lay out the table and the paths."""
        yield Static(id="title")
        with ReportBody(id="report-body"):
            yield Static(id="report-note")
            yield Static(id="report-recommendation")  # the answer first, then the table it comes from
            yield DataTable(id="report-table", cursor_type="row", zebra_stripes=True)
            yield DataTable(id="report-table-2", cursor_type="row", zebra_stripes=True)  # when split in two
            yield Static(id="report-prediction")
            yield Static(id="report-paths")
        yield Footer()

    def on_mount(self) -> None:
        """Fill the table from summary.json, or from the live states when there is none yet or it cannot be read
        (a red line says why); a section of a summary of the wrong shape is said in red, never a crash."""
        summary, why = read_report_summary(self.out_dir)
        if summary is None:
            summary = live_summary(self.board)
            head = f"[red]{literal(why)}[/red]" if why else f"[yellow]{SUMMARY} is not written yet[/yellow]"
            note = head + (" — live figures; differences, speedup and memory ratio appear when the comparison "
                           "finishes." if not why else " — the live figures from the runs' records instead.")
        else:
            note = f"From {literal(display_path(RunDir(self.out_dir).summary))}."
        baseline = summary.get("baseline") or self.board.baseline
        preset = literal(summary.get("preset", ""))
        self.query_one("#title", Static).update(f"[b]shardscope[/b] · report · {preset} · baseline [b]{literal(baseline)}[/b]")
        problems = [f"{SUMMARY}: its {what} cannot be shown: {type(err).__name__}: {err}"
                    for what, fill in (("runs table", self._table), ("answer", self._answer),
                                       ("prediction", self._prediction))
                    if (err := _failure(fill, summary)) is not None]
        self.query_one("#report-note", Static).update(
            note + "".join(f"\n[red]{literal(line)}[/red]" for line in problems))
        names = [str(r.get("name")) for r in summary.get("runs", []) if isinstance(r, dict)]
        names = [n for n in names if NAME_RE.match(n) and len(n) <= MAX_NAME]  # a name from the file names no path
        written = artefacts(self.out_dir, names or self.board.names)
        self.query_one("#report-paths", Static).update("[b]Written[/b]\n" + "\n".join(map(literal, written)))

    def _table(self, summary: dict[str, Any]) -> None:
        self.headers, self.rows = columns(summary), summary_rows(summary)
        self.HELP = report_columns.help_markdown(self.headers)  # what `?` shows beside the keys
        # the body's width before its first layout: the screen's, less its padding and scrollbar (app.tcss)
        self.fit_table(self.app.size.width - 6)

    def fit_table(self, width: int) -> None:
        """Show the table laid out for ``width`` cells (``report_columns.layout``), when that layout changed."""
        if not self.headers or width <= 0:
            return
        texts = [[cell.plain for cell in row] for row in self.rows]
        chosen = report_columns.layout(self.headers, texts, width)
        if chosen == self.table_layout:
            return
        self.table_layout = chosen
        for t, table in enumerate((self.query_one("#report-table", DataTable),
                                   self.query_one("#report-table-2", DataTable))):
            table.clear(columns=True)
            table.display = t < len(chosen.tables)
            if table.display:
                # widths given, not measured when the table is next idle: a row drawn before that keeps its old
                # widths in the table's cache (a resize redraws at once)
                for header, width in zip(chosen.headers(self.headers, t), chosen.widths(self.headers, texts, t)):
                    table.add_column(header, width=width)
                for row in texts:
                    table.add_row(*map(plain, chosen.cells(row, t)))
        for panel in self.query(HelpPanel).results(HelpPanel):
            panel.update_help(self.focused)

    def _answer(self, summary: dict[str, Any]) -> None:
        rec = summary.get("recommendation") or {}
        shown = self.query_one("#report-recommendation", Static)
        lines = rec.get("lines") if isinstance(rec, dict) else None
        shown.display = False  # no empty row where there is no recommendation (or it cannot be shown)
        if lines:
            said = answer.lines(summary)
            rest = [line for line in lines if not any(line in s for s in said)]
            shown.update("\n[b]Answer[/b]\n" + "\n".join(literal(f"• {line}") for line in said) + "\n"
                         + ("\n[b]Each run against the baseline[/b]\n" + "\n".join(literal(f"• {line}") for line in rest)
                            + "\n" if rest else ""))
            shown.display = True

    def _prediction(self, summary: dict[str, Any]) -> None:
        shown = self.query_one("#report-prediction", Static)
        shown.display = False
        predicted = predict_report.plain_lines(summary.get("prediction") or {}, noise.line(summary.get("noise") or {}) if summary.get("noise") else "")
        if predicted:
            shown.display = True
            shown.update("[b]Predicted beside measured[/b] (shardscope predict)\n"
                         + "\n".join(literal(f"• {line}") for line in predicted) + "\n")


def _failure(fill: Any, summary: dict[str, Any]) -> Exception | None:
    """Run ``fill(summary)``; return what a summary of the wrong shape raised in it (None when it filled)."""
    try:
        fill(summary)
    except FOLD_ERRORS as err:
        return err
    return None
