"""``shardscope tune`` in the app (key ``u`` on the preset screen): the search shown live.

The candidates appear as the space is listed, each one's prediction and what happened to it as it becomes known
(cannot run, does not fit, predicted slower, queued, running, measured), the winner and its launch line at the end.
The search is ``analysis/tune/search``, the same as the command line's; its comparisons run through
``orchestrator/tune_runs.TuneRunner`` on a worker thread, which only posts messages. Closing the screen stops them.
"""

from __future__ import annotations

from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import DataTable, Footer, Static

from shardscope.config import Comparison
from shardscope.core.numbers import fmt_bytes
from shardscope.tui.screens.dialogs import RunnerScreen
from shardscope.tui.format import literal, plain

COLUMNS = ("candidate", "predicted ms/step", "predicted mem/rank", "measured", "outcome")


class TuneLine(Message):
    """A phase's line (posted from the search's thread)."""

    def __init__(self, line: str) -> None:
        super().__init__()
        self.line = line


class TuneRows(Message):
    """Every candidate's row as now known: (name, predicted ms, predicted memory, measured, outcome)."""

    def __init__(self, rows: list[tuple[str, str, str, str, str]]) -> None:
        super().__init__()
        self.rows = rows


class TuneStatus(Message):
    """A proving run's status changed (starting, running, ok, failed, stopped)."""

    def __init__(self, run: str, status: str, error: str) -> None:
        super().__init__()
        self.run, self.status, self.error = run, status, error


class TuneDone(Message):
    """The search ended: its answer, or the one line saying why it could not."""

    def __init__(self, answer: dict[str, Any] | None, error: str = "") -> None:
        super().__init__()
        self.answer, self.error = answer, error


def rows_of(cands: list[Any], answer: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """The table's rows for ``cands`` (``analysis/tune/choose``'s order and outcome words)."""
    from shardscope.analysis.tune import choose

    out = []
    for x in choose.in_table_order(cands):
        rate = x.measured.get("tokens_per_s") if x.measured else None
        out.append((x.name, "-" if x.predicted_step_s is None else f"{x.predicted_step_s * 1e3:.1f}",
                    "-" if x.predicted_mem_bytes is None else fmt_bytes(x.predicted_mem_bytes),
                    f"{rate:,.0f}" if isinstance(rate, (int, float)) else "-", choose.outcome(x, answer)))
    return out


class TuneScreen(RunnerScreen):
    """Runs a tune of ``comparison`` (its model, data and global batch) into ``out_dir`` and shows it live; escape
    or q closes it (and stops the runs still going)."""

    BINDINGS = [Binding("escape,q", "close", "Close")]
    stop_note = "Stopping the tune's runs…"

    def __init__(self, comparison: Comparison, out_dir: str, budget_s: float = 300.0, steps: int = 12,
                 only: tuple[str, ...] = (), max_rounds: int = 3) -> None:
        super().__init__()
        self.comparison, self.out_dir, self.budget_s, self.steps = comparison, out_dir, budget_s, steps
        self.max_rounds = max_rounds  # rounds of the proof at most, as the command line's --rounds
        self.only = only  # these strategies (all when empty), as the command line's --strategies
        self.lines: list[str] = []
        self.statuses: list[tuple[str, str]] = []  # (run, status) of the proving runs, as they changed
        self.answer: dict[str, Any] | None = None

    def compose(self) -> ComposeResult:
        """The phase lines, the table of candidates, the answer."""
        with Vertical(id="tune"):
            yield Static("", id="tune-progress")
            yield DataTable(id="tune-table", zebra_stripes=True, cursor_type="row")
            yield Static("", id="tune-answer")
        yield Footer()

    def on_mount(self) -> None:
        """Start the search on a worker thread."""
        from shardscope.orchestrator.tune_runs import TuneRunner

        self.runner = TuneRunner("", on_status=lambda run, status, error: self.post_message(TuneStatus(run, status, error)))
        self.running = True
        self.lines = [f"tune {self.comparison.name}: budget {self.budget_s:.0f} s, {self.steps} steps a proving run, "
                      f"into {self.out_dir}"]
        self._show()
        self._search()

    @work(thread=True, exclusive=True, group="tune")
    def _search(self) -> None:
        from shardscope.analysis.tune import search
        from shardscope.orchestrator import devices
        from shardscope.presets.files import ConfigError

        try:
            dev = devices.resolve_device(self.comparison.launch.device)
            self.runner.device = dev
            req = search.Request(self.comparison, self.comparison.world_size, self.out_dir, budget_s=self.budget_s,
                                 steps=self.steps, only=self.only, host=devices.host_info(dev),
                                 max_rounds=self.max_rounds)
            cands, answer = search.search(req, self.runner.run, lambda line: self.post_message(TuneLine(line)),
                                          lambda cands: self.post_message(TuneRows(rows_of(cands, {}))))
            self.post_message(TuneRows(rows_of(cands, answer)))
            self.post_message(TuneDone(answer))
        except (search.CannotCalibrate, ConfigError) as err:
            self.post_message(TuneDone(None, str(err)))
        except Exception as err:  # noqa: BLE001 - shown in the screen, never lost in a thread
            self.post_message(TuneDone(None, f"tune failed: {err!r}"))

    def on_tune_line(self, message: TuneLine) -> None:
        """Add a phase's line."""
        self.lines.append(message.line)
        self._show()

    def on_tune_rows(self, message: TuneRows) -> None:
        """Show every candidate as now known (cells from the search are text, never markup)."""
        table = self.query_one("#tune-table", DataTable)
        table.clear(columns=True)  # the columns size to the new rows (kept ones kept their first widths)
        for col in COLUMNS:
            table.add_column(col, key=col)
        for row in message.rows:
            table.add_row(*(plain(cell) for cell in row), key=row[0])

    def on_tune_status(self, message: TuneStatus) -> None:
        """A proving run started or ended: its outcome cell says so at once."""
        self.statuses.append((message.run, message.status))
        table = self.query_one("#tune-table", DataTable)
        if message.run in table.rows:
            what = f"measuring: {message.status}" + (f" ({message.error})" if message.error else "")
            table.update_cell(message.run, "outcome", plain(what))

    def on_tune_done(self, message: TuneDone) -> None:
        """Show the answer (or why there is none)."""
        self.running = False
        self.answer = message.answer
        a = message.answer or {}
        if message.error:
            text = f"cannot tune: {message.error}"
        elif a.get("winner"):
            tie = f"; not distinguishable from {', '.join(a['tie'])} on this machine now" if a.get("tie") else ""
            text = (f"winner: {a['winner']}{tie}\n{a.get('against_preset') or ''}\npreset: {a.get('preset', '')}\nlaunch: {a.get('launch', '')}\n"
                    f"report: {a.get('report', '')}"
                    + ("  (with the winner's settings to paste into your own training script)"
                       if (a.get("settings") or {}).get("code") else "")
                    + f"\nthe proving runs took {a.get('proof_s', 0):.0f} s of a "
                    f"{a.get('budget_s', 0):.0f} s budget")
        else:
            text = "no winner: no candidate was measured ok"
        self.query_one("#tune-answer", Static).update(literal(text))
        self._show()

    def _show(self) -> None:
        state = "searching… (escape stops)" if self.running else "done"
        self.query_one("#tune-progress", Static).update("\n".join(literal(x) for x in [state, *self.lines]))
