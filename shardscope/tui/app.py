"""The shardscope Textual app and its one factory, ``build_app``, used by the CLI and the tests.

``build_app(*, preset=None, source_factory=None, out_dir=None, replay_dir=None, replay_speed=None,
host="detect", overrides=(), autostart=False)``:

- no ``replay_dir``: opens the presets screen (``preset`` pre-selected, a built-in name or a path);
  starting a comparison calls ``source_factory(comparison, out_dir)`` (default: a live
  ``orchestrator.session.Session``) with ``out_dir`` or ``./shardscope-runs/<timestamp>-<preset>``;
- ``replay_dir``: opens the dashboard on a recorded run directory, replayed by
  ``orchestrator.replay.ReplaySource`` (``replay_speed`` None = all at once), or by
  ``source_factory(comparison, replay_dir)`` when one is given (tests use that);
- ``autostart`` with ``preset`` and ``overrides`` (``shardscope run`` without ``--headless``): starts
  that comparison at once, the dashboard first.

Threading: the source calls back on its own threads; the callback only posts one
``UpdatesArrived`` message per batch. The UI thread folds batches into the ``Board`` and a timer
redraws what changed at most ten times a second (charts four times).
"""

from __future__ import annotations

import os
from typing import Iterable

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from shardscope.config import Comparison, ConfigError, load_preset, with_control
from shardscope.orchestrator.preflight import check_memory, check_space, claim_out_dir
from shardscope.profiling.state import Notice, Update
from shardscope.tui import source as sources
from shardscope.tui.actions import ScreenActions
from shardscope.tui.board import Board
from shardscope.tui.format import literal
from shardscope.tui.messages import CommAnalysed, UpdatesArrived
from shardscope.tui.screens.dialogs import ConfirmQuit, TooSmall
from shardscope.tui.screens.presets import PresetsScreen

# The dashboard (plotext) and the report are imported when first shown: the presets screen opens sooner.

REDRAW_INTERVAL_S = 0.1
MIN_SIZE = (80, 24)  # below this the layout cannot show cards, charts and panels at once
STOP_WAIT_S = 30.0  # how long quitting waits for stopped runs to exit


class ShardscopeApp(ScreenActions, App):
    """Runs (or replays) a comparison and shows it live."""

    CSS_PATH = "app.tcss"
    TITLE = "shardscope"
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", show=False, priority=True),
                # every screen: its keys, each with what it does (Textual's own panel of the active bindings)
                Binding("question_mark", "toggle_keys", "Keys", key_display="?")]

    def __init__(self, *, preset: str | None = None, source_factory: sources.SourceFactory | None = None,
                 out_dir: str | None = None, replay_dir: str | None = None, replay_speed: float | None = None,
                 host: object = "detect", overrides: list[str] | tuple[str, ...] = (), autostart: bool = False) -> None:
        super().__init__()
        self.preset = preset
        self.overrides = list(overrides)
        self.autostart = autostart
        self.source_factory = source_factory
        self.out_dir = out_dir or ""
        self.replay_dir = replay_dir
        self.replay_speed = replay_speed
        self.host = sources.host_info() if host == "detect" else host
        self.board = Board()
        self.source: sources.Source | None = None
        self.comparison: Comparison | None = None
        self.started = False
        self.replaying = False  # a recorded run directory (``open``): nothing can be started
        self.quitting = False
        self.latencies: list[float] | None = None  # write-to-display delays, when a benchmark asks

    # -- start-up --------------------------------------------------------------------------------

    def on_mount(self) -> None:
        """Open the presets screen, or the dashboard on a recorded run directory."""
        self.set_interval(REDRAW_INTERVAL_S, self.redraw)
        if self.replay_dir:
            self.open_replay(self.replay_dir)
        elif self.autostart and self.preset:
            self.push_screen(PresetsScreen(self.preset))
            try:
                comparison = load_preset(self.preset, self.overrides, host=self.host)
            except ConfigError as err:
                self.notify(literal(err), severity="error", timeout=15)
            else:
                self.launch(comparison, self.preset, self.overrides)
        else:
            self.push_screen(PresetsScreen(self.preset))

    def open_replay(self, run_dir: str) -> None:
        """Show a recorded run directory on the dashboard and replay it (one whose comparison.json cannot be read
        shows the dashboard with a notice saying why: ``source.replay_source``)."""
        comparison = sources.read_comparison(run_dir)
        self.out_dir = run_dir
        if self.source_factory is not None and comparison is not None:
            source = self.source_factory(comparison, run_dir)
        else:
            source = sources.replay_source(run_dir, self.replay_speed)
        name = comparison.name if comparison else os.path.basename(os.path.normpath(run_dir))
        self.attach(source, comparison, f"{literal(name)} (recorded)")
        why = sources.unreadable_summary(run_dir)
        if why:  # the runs replay from their records; the comparison's own figures are lost: said, in red
            self.board.ingest([Notice(why, "error")])
        self.replaying = True
        self.action_start()

    def _memory_short(self, comparison: Comparison) -> str | None:
        """As the headless command: a comparison this host's memory cannot hold is refused before the start."""
        from shardscope.orchestrator import devices

        try:
            device = devices.resolve_device(comparison.launch.device)
        except ConfigError:
            return None  # the source names the device problem when it starts
        return check_memory(comparison, device)

    def launch(self, comparison: Comparison, preset: str, overrides: list[str]) -> None:
        """Start ``comparison`` (from the presets screen): make its source and show the dashboard."""
        if self.source is not None:
            self.notify("A comparison is already open; quit to start another.", severity="warning")
            return
        factory = self.source_factory or sources.session_source
        comparison = with_control(comparison)  # the A/A control: the baseline again, last (between-run noise)
        self.out_dir = self.out_dir or sources.default_out_dir(comparison.name)
        short = check_space(comparison, self.out_dir)  # as the headless command does: traces need room
        if not short:
            short = self._memory_short(comparison)
        if short:
            self.refuse_launch(f"Cannot start: {short}")
            return
        claimed = claim_out_dir(self.out_dir, comparison.launch.node_rank,
                                [r.name for r in comparison.runs])  # this comparison's alone
        if claimed:
            self.refuse_launch(f"Cannot start: {claimed}")
            return
        try:
            source = factory(comparison, self.out_dir)
        except (OSError, RuntimeError, ValueError, ImportError) as err:  # ConfigError is a ValueError
            self.notify(f"Cannot start: {literal(err)}", severity="error", timeout=10)
            return
        extra = f" [dim]{literal(' '.join(overrides))}[/dim]" if overrides else ""
        self.attach(source, comparison, literal(comparison.name) + extra)
        self.action_start()

    def refuse_launch(self, message: str) -> None:
        """Say why a comparison cannot start, under the launch button when the presets screen is open."""
        if isinstance(self.screen, PresetsScreen):
            self.screen.show_launch_error(message)
        self.notify(literal(message), severity="error", timeout=10)

    def attach(self, source: sources.Source, comparison: Comparison | None, title: str) -> None:
        """Subscribe to ``source`` and switch to the dashboard (``title`` is markup: its names escaped)."""
        from shardscope.tui.screens.dashboard import DashboardScreen

        self.source, self.comparison = source, comparison
        if comparison is not None:
            self.board.baseline = comparison.baseline or (comparison.runs[0].name if comparison.runs else "")
        source.subscribe(self._on_source_updates)
        if isinstance(self.screen, PresetsScreen):
            self.switch_screen(DashboardScreen(title, self.out_dir))
        else:
            self.push_screen(DashboardScreen(title, self.out_dir))

    def _on_source_updates(self, updates: list[Update]) -> None:
        # Runs on the source's threads: never touch widgets or the board here, only post.
        if updates:
            self.post_message(UpdatesArrived(list(updates)))

    # -- data in, redraw out ---------------------------------------------------------------------

    def on_updates_arrived(self, message: UpdatesArrived) -> None:
        """Fold a batch into the board (the redraw timer shows it)."""
        self.board.ingest(message.updates)
        for run in self.board.to_analyse:
            state = self.board.states.get(run)
            if state is not None and state.run_dir:
                seq = self.board.analysis_seq[run] = self.board.analysis_seq.get(run, -1) + 1
                self._analyse(run, state.run_dir, seq)
        self.board.to_analyse.clear()

    @work(thread=True, group="comm")
    def _analyse(self, run: str, run_dir: str, seq: int) -> None:
        # Trace files can be large: read them off the UI thread, post the result.
        from shardscope.profiling.traces import analyse_run

        try:
            analysis = analyse_run(run_dir)
        except Exception as err:  # noqa: BLE001 - a crafted trace file: said in the panel, never a crashed worker
            analysis = {"unreadable": [f"{type(err).__name__}: {err}"]}
        self.post_message(CommAnalysed(run, analysis, seq))

    def on_comm_analysed(self, message: CommAnalysed) -> None:
        """Keep a run's communication analysis for the communication panel (with the reason when it has
        no figures: profiling off, ended before its window, no traces)."""
        if message.seq is not None:  # one of the app's own: drop it if a newer one was applied already
            if message.seq < self.board.analysis_applied.get(message.run, -1):
                return
            self.board.analysis_applied[message.run] = message.seq
        analysis = message.analysis
        state = self.board.states.get(message.run)
        if not analysis.get("collectives") and self.comparison is not None and state is not None:
            from shardscope.analysis.report import comm_not_measured_reason

            analysis = {**analysis, "not_measured": comm_not_measured_reason(self.comparison, state, state.run_dir)}
        self.board.analyses[message.run] = analysis
        self.board.dirty_comm = True
        self.board.dirty_runs.add(message.run)  # its card names a straggler found in the traces

    def redraw(self, force: bool = False) -> None:
        """Push what changed on the board into the dashboard; raise notices as toasts."""
        self.check_size()
        board = self.board
        for notice in board.new_notices:
            if notice.level in ("warning", "error"):
                self.notify(literal(notice.text), severity=notice.level, timeout=8)
        board.new_notices = []
        dashboard = self.dashboard
        if dashboard is not None and dashboard.ready:
            dashboard.show(board, started=self.started, force=force)
        if self.latencies is not None and board.pending_t:
            self.latencies.extend(board.take_latency())

    @property
    def dashboard(self):
        """The dashboard screen (``screens.dashboard.DashboardScreen``), if one is on the stack."""
        for screen in self.screen_stack:
            if getattr(screen, "is_dashboard", False):
                return screen
        return None

    # -- actions (keys and the command palette) -------------------------------------------------

    def action_start(self) -> None:
        """Start the comparison (once)."""
        if self.source is None:
            screen = self.screen
            if isinstance(screen, PresetsScreen):
                screen.action_launch()
            return
        if self.started:
            self.notify("This is a recorded comparison (shardscope open): it replays what was written and starts "
                        "nothing. To run it again: shardscope run --preset <its preset> --headless"
                        if self.replaying else "Already started; r restarts the selected run.")
            return
        self.started = True
        self.source.start()

    def _selected(self) -> str:
        dashboard = self.dashboard
        return dashboard.selected if dashboard is not None else ""

    def action_stop_run(self) -> None:
        """Stop the selected run."""
        run = self._selected()
        if self.source is None or not run:
            return
        if self._ended() or self.source.stop_run(run) is False:
            self.notify(f"Nothing to stop: the comparison has finished ({literal(run)} ended with it).")
            return
        self.notify(f"Stopping {literal(run)}…")

    def action_restart_run(self) -> None:
        """Restart the selected run (stopping it first if it is active); once the comparison has finished its
        summary and report are written, so it says how to run it again instead."""
        run = self._selected()
        if self.source is None or not run:
            return
        if self._ended() or self.source.restart_run(run) is False:
            self.notify("The comparison has finished and its report is written (o opens it): runs restart only "
                        "while it runs. To run it again, quit (q) and launch it anew.", severity="warning")
            return
        self.notify(f"Restarting {literal(run)}…")

    def _ended(self) -> bool:
        """A live comparison that has finished (a replay answers r and x itself: it starts nothing)."""
        return self.started and not self.replaying and bool(getattr(self.source, "finished", False))

    def action_set_baseline(self) -> None:
        """Make the selected run the baseline of the difference chart."""
        run = self._selected()
        if run:
            self.board.baseline = run
            self.board.dirty_charts = True
            self.notify(f"Baseline: {literal(run)}")

    async def action_quit(self) -> None:
        """Quit; with runs still going, ask first, then stop them all and wait for them."""
        if self.quitting:
            return
        source = self.source
        if source is None or not self.started or source.finished:
            self.exit()
            return
        active = self.board.active
        if not isinstance(self.screen, ConfirmQuit):
            self.push_screen(ConfirmQuit(active), self._quit_answered)

    def _quit_answered(self, stop: bool | None) -> None:
        if stop:
            self.quitting = True
            self.notify("Stopping every run…", timeout=STOP_WAIT_S)
            self._stop_and_exit()

    @work(thread=True, exclusive=True, group="quit")
    def _stop_and_exit(self) -> None:
        source = self.source
        if source is not None:
            source.stop_all()
            source.wait(STOP_WAIT_S)
        self.call_from_thread(self.exit)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """Add the app's actions to the command palette."""
        yield from super().get_system_commands(screen)
        yield SystemCommand("Start", "Start the comparison", self.action_start)
        yield SystemCommand("Stop run", "Stop the selected run", self.action_stop_run)
        yield SystemCommand("Restart run", "Restart the selected run", self.action_restart_run)
        yield SystemCommand("Set baseline", "Compare the other runs with the selected one", self.action_set_baseline)
        yield SystemCommand("Toggle log", "Show or hide the console pane", self._toggle_log)
        yield SystemCommand("Report", "Open the comparison table", self.action_report)
        yield SystemCommand("Explain run", "How the selected run's strategy works, with its numbers",
                            self.action_explain)
        yield SystemCommand("Why", "Why the selected run's loss differs from the baseline's (re-runs)", self.action_why)
        yield SystemCommand("Export", "Save a screenshot and copy the result paths", self.action_export)

    def _toggle_log(self) -> None:
        dashboard = self.dashboard
        if dashboard is not None:
            dashboard.action_toggle_log()

    # -- size ------------------------------------------------------------------------------------

    def check_size(self) -> None:
        """Cover the app with a notice while the terminal is too small (checked by the redraw timer)."""
        w, h = self.size
        small = w < MIN_SIZE[0] or h < MIN_SIZE[1]
        top = self.screen_stack[-1] if self.screen_stack else None
        if small and not any(isinstance(s, TooSmall) for s in self.screen_stack):
            self.push_screen(TooSmall(MIN_SIZE))
        elif isinstance(top, TooSmall):
            if small:
                top.show_size()
            else:
                self.pop_screen()

    def on_unmount(self) -> None:
        """Never leave runs behind: stop them if the app goes away some other way."""
        source = self.source
        if source is not None and self.started and not source.finished and not self.quitting:
            source.stop_all()
            source.wait(STOP_WAIT_S)


def build_app(*, preset: str | None = None, source_factory: sources.SourceFactory | None = None,
              out_dir: str | None = None, replay_dir: str | None = None, replay_speed: float | None = None,
              host: object = "detect", overrides: list[str] | tuple[str, ...] = (),
              autostart: bool = False) -> ShardscopeApp:
    """Return the app, configured as the command line or a test wants it (see the module docstring).

    ``host`` is the ``config.HostInfo`` presets are validated against (default: detected; None skips
    host checks). ``overrides`` and ``autostart`` (``shardscope run`` without ``--headless``) load
    ``preset`` with those ``--set`` overrides and start it at once. Raises nothing: errors are shown in the app.
    """
    return ShardscopeApp(preset=preset, source_factory=source_factory, out_dir=out_dir, replay_dir=replay_dir,
                         replay_speed=replay_speed, host=host, overrides=overrides, autostart=autostart)


if __name__ == "__main__":  # pragma: no cover - manual runs
    import sys

    build_app(replay_dir=sys.argv[1] if len(sys.argv) > 1 else None).run()
