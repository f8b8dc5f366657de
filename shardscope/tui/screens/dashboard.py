"""The main view: run cards, loss / difference / throughput charts, devices, communication, console.

The app owns the ``Board`` and calls ``show(board)`` from its redraw timer; the screen pushes
the board's data down into its widgets and only touches what changed.
"""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, HorizontalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from shardscope.analysis import straggler_report
from shardscope.profiling.state import STATUSES
from shardscope.tui.board import Board
from shardscope.tui.format import display_path, literal, run_colour
from shardscope.tui.messages import RunSelected
from shardscope.tui.widgets.charts import diff_note, StepChart, loss_diff, series_of
from shardscope.tui.widgets.comm_panel import CommPanel
from shardscope.tui.widgets.device_panel import DevicePanel
from shardscope.tui.widgets.log_pane import LogPane
from shardscope.tui.widgets.rank_timing import RankTiming
from shardscope.tui.widgets.run_card import RunCard

CHART_INTERVAL_S = 0.25  # charts redraw at most 4 times a second, however fast records arrive
MIN_CARD_WIDTH = 30
CHART_BUDGET = 0.25  # and, when drawing is slow, take at most a quarter of the UI thread


class DashboardScreen(Screen):
    """Side-by-side view of every run of one comparison."""

    is_dashboard = True  # lets the app find it without importing this module early

    BINDINGS = [
        Binding("s", "app.start", "Start"),
        Binding("x", "app.stop_run", "Stop"),
        Binding("r", "app.restart_run", "Rerun"),
        Binding("b", "app.set_baseline", "Base"),  # make the selected run the baseline
        Binding("l", "toggle_log", "Log"),
        Binding("t", "toggle_timing", "Ranks"),  # the selected run's per-rank step timing in place of its console
        Binding("o", "app.report", "Report"),
        Binding("i", "app.explain", "Info"),  # what the selected run's strategy shards and sends, with its numbers
        Binding("w", "app.why", "Why"),  # the loss differs: re-runs name the cause
        Binding("e", "app.export", "Save"),  # a screenshot beside the results, every path copied
        Binding("left,shift+tab", "select(-1)", "Prev run", show=False),
        Binding("right,tab", "select(1)", "Next run", show=False),
        Binding("q", "app.quit", "Quit"),
    ]

    def __init__(self, title: str, out_dir: str) -> None:
        """``title``: markup, with every name in it escaped (``format.literal``); ``out_dir`` as it is."""
        super().__init__()
        self.heading = title
        self.out_dir = out_dir
        self.selected = ""
        self.ready = False  # set once the widgets exist; the app's timer redraws only then
        self._cards: dict[str, RunCard] = {}
        self._chart_t = 0.0
        self._baseline_drawn = ""
        self._bars = ("", "")
        self._comm_final = False
        self._devices_final = False

    def compose(self) -> ComposeResult:
        """Lay out the dashboard (cards are mounted as runs are defined)."""
        yield Static(id="title")
        yield HorizontalScroll(id="cards")
        with Horizontal(id="charts"):
            yield StepChart("loss", id="loss-chart")
            yield StepChart("loss − baseline", id="diff-chart", empty="waiting for steps of two runs")
            yield StepChart("tokens/s", id="rate-chart")
        with Horizontal(id="panels"):
            yield DevicePanel(id="devices", classes="panel")
            yield CommPanel(id="comm", classes="panel")
            yield LogPane(id="log", classes="panel")
            yield RankTiming(id="timing", classes="panel")
        yield Static(id="status")
        yield Footer(compact=True)  # every key fits at 100 columns

    def on_mount(self) -> None:
        """Keep references to the widgets (redraws never query the DOM) and title the panels."""
        self.title_bar = self.query_one("#title", Static)
        self.status_bar = self.query_one("#status", Static)
        self.card_row = self.query_one("#cards", HorizontalScroll)
        self.loss_chart = self.query_one("#loss-chart", StepChart)
        self.diff_chart = self.query_one("#diff-chart", StepChart)
        self.rate_chart = self.query_one("#rate-chart", StepChart)
        self.devices = self.query_one(DevicePanel)
        self.comm = self.query_one(CommPanel)
        self.log_pane = self.query_one(LogPane)
        self.timing = self.query_one(RankTiming)
        self.timing.display = False
        self.devices.border_title = "devices"
        self.comm.border_title = "communication"
        self.log_pane.border_title = "console"
        self.log_pane.can_focus = False
        self.devices.show(None)
        self.comm.show([], {})
        self.ready = True

    def on_resize(self) -> None:
        """Give the charts more room on short or narrow terminals (classes styled in app.tcss)."""
        w, h = self.app.size
        self.set_class(h < 40, "-short")
        self.set_class(h < 30, "-tiny")
        self.set_class(w < 130, "-narrow")
        self._size_cards()

    def _size_cards(self) -> None:
        # Cards share the row while each gets MIN_CARD_WIDTH cells; beyond that the row scrolls.
        if not self._cards:
            return
        width = max(MIN_CARD_WIDTH, self.app.size.width // len(self._cards))
        for card in self._cards.values():
            card.styles.width = width

    # -- data down -------------------------------------------------------------------------------

    def show(self, board: Board, *, started: bool, force: bool = False) -> None:
        """Push what changed on ``board`` into the widgets."""
        for i, name in enumerate(board.names):
            if name not in self._cards:
                card = self._cards[name] = RunCard(name, run_colour(i), id=f"card-{i}")
                self.card_row.mount(card)
                board.dirty_runs.add(name)
                self._size_cards()
        if not self.selected and board.names:
            self.select(board.names[0], board)
        baseline_changed = board.baseline != self._baseline_drawn
        for name in board.names if (force or baseline_changed) else board.dirty_runs:
            if name in self._cards:
                state = board.states[name]
                self._cards[name].show(state, baseline=name == board.baseline,
                                       traced=straggler_report.traced_ranks(state, board.analyses.get(name)))
        now = time.monotonic()
        charts = (self.loss_chart, self.diff_chart, self.rate_chart)
        interval = max(CHART_INTERVAL_S, sum(c.render_s for c in charts) / CHART_BUDGET)
        if force or baseline_changed or (board.dirty_charts and now - self._chart_t >= interval):
            self._draw_charts(board)
            self._chart_t = now
            board.dirty_charts = False
            self._baseline_drawn = board.baseline
        if force or board.dirty_devices or (board.finished is not None and not self._devices_final):
            self._devices_final = board.finished is not None
            self.devices.show(board.device_history, finished=self._devices_final)
            board.dirty_devices = False
        if force or board.dirty_comm or (board.finished is not None and not self._comm_final):
            self._comm_final = board.finished is not None
            self.comm.show([(board.states[n], run_colour(i)) for i, n in enumerate(board.names)], board.analyses,
                           finished=self._comm_final)
            board.dirty_comm = False
        if self.selected and (force or self.selected in board.dirty_consoles or self.selected in board.dirty_runs):
            self.log_pane.show(board.console(self.selected), board.states.get(self.selected))
        if self.timing.display:  # every tick: it redraws only when the run moved on, at most once a second
            self.timing.show(board.states.get(self.selected), board.analyses.get(self.selected), force=force)
        self._draw_status(board, started)
        board.dirty_runs.clear()
        board.dirty_consoles.clear()

    def _draw_charts(self, board: Board) -> None:
        names = board.names
        colours = {n: run_colour(i) for i, n in enumerate(names)}
        states = board.states
        limit = self.loss_chart.points
        self.loss_chart.set_series([series_of(states[n].losses, n, colours[n], limit) for n in names])
        base = states.get(board.baseline)
        raw = {n: loss_diff(states[n], base) for n in names if base is not None and n != board.baseline}
        diffs = [series_of(pairs, n, colours[n], limit) for n, pairs in raw.items()]
        self.diff_chart.set_series(diffs, title=f"loss − {board.baseline or 'baseline'}" + diff_note(raw))
        units = {states[n].unit for n in names if states[n].throughput}
        self.rate_chart.set_series(
            [series_of(states[n].throughput, n, colours[n], limit) for n in names],
            title=" / ".join(sorted(units)) or "tokens/s")

    def _draw_status(self, board: Board, started: bool) -> None:
        counts = {s: 0 for s in STATUSES}
        for state in board.states.values():
            counts[state.status] = counts.get(state.status, 0) + 1
        parts = [f"{n} {literal(s)}" for s, n in counts.items() if n]  # a status read from a file: text
        if board.finished is not None:
            parts.append("finished — press o for the report")
        elif not started:
            parts.append("not started — press s to start")
        # The last error, else the last warning (a file that cannot be read stays said); launch lines (info) are in
        # each run's console, not repeated here.
        shown = [n for n in board.notices if n.level == "error"] or [n for n in board.notices if n.level != "info"]
        note = (shown[-1].text.splitlines() or [""])[0] if shown else ""
        title = f"[b]shardscope[/b] · {self.heading} · [dim]{literal(display_path(self.out_dir))}[/dim]"
        # an error (a file that cannot be read) in red, not dim: the one thing on an otherwise empty screen
        style = "red" if shown and shown[-1].level == "error" else "dim"
        status = " · ".join(parts) + (f"   [{style}]{literal(note)}[/{style}]" if note else "")
        if (title, status) != self._bars:  # the same text again would still cost a repaint
            self._bars = (title, status)
            self.title_bar.update(title)
            self.status_bar.update(status)

    # -- selection -------------------------------------------------------------------------------

    def select(self, run: str, board: Board) -> None:
        """Make ``run`` the selected run: highlight its card and tail its console."""
        self.selected = run
        for name, card in self._cards.items():
            card.set_class(name == run, "-selected")
            if name == run:
                card.scroll_visible()
        self.log_pane.follow(run, board.console(run), board.states.get(run))
        if self.timing.display:
            self.timing.show(board.states.get(run), board.analyses.get(run), force=True)

    def on_run_selected(self, message: RunSelected) -> None:
        """A card was clicked."""
        self.select(message.run, self.app.board)

    def action_select(self, delta: int) -> None:
        """Select the previous or next run."""
        names = self.app.board.names
        if not names:
            return
        i = names.index(self.selected) if self.selected in names else 0
        self.select(names[(i + delta) % len(names)], self.app.board)

    def action_toggle_log(self) -> None:
        """Show or hide the console pane."""
        log = self.log_pane
        log.display = not log.display

    def action_toggle_timing(self) -> None:
        """Show the selected run's per-rank step timing in place of the console, or the console again."""
        showing = not self.timing.display
        self.timing.display, self.log_pane.display = showing, not showing
        if showing:
            board = self.app.board
            self.timing.show(board.states.get(self.selected), board.analyses.get(self.selected), force=True)
