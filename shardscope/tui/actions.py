"""The app's actions that open a screen or write a file for the selected run: the report, a strategy's explainer,
``why``'s re-runs, the keys of the current screen, the export. A mixin of ``ShardscopeApp`` (it reads the app's
``source``, ``comparison``, ``board`` and ``out_dir``), apart so that the app's own module stays about its data flow.
"""

from __future__ import annotations

import os
from typing import Any

from shardscope.config import write_atomic
from shardscope.core.rundir import SCREENSHOT, RunDir
from shardscope.core.text import clean
from shardscope.tui.format import display_path, literal


class ScreenActions:
    """``action_report``, ``action_explain``, ``action_why``, ``action_toggle_keys`` and ``action_export``."""

    source: Any
    comparison: Any
    board: Any
    out_dir: str
    started: bool

    def action_report(self) -> None:
        """Open the report screen."""
        from shardscope.tui.screens.report import ReportScreen

        if self.source is None:
            self.notify("Start a comparison first.")
        elif not isinstance(self.screen, ReportScreen):
            self.push_screen(ReportScreen(self.out_dir, self.board))

    def action_explain(self) -> None:
        """Open the selected run's strategy explainer, filled with that run's numbers."""
        from shardscope.tui.screens.explainer import ExplainScreen, explanation_for

        run = self._selected()
        if not run or self.comparison is None:
            self.notify("Select a run first.")
            return
        from shardscope.analysis.explain import ExplainError

        try:
            result = explanation_for(self.comparison, run, self.out_dir)
        except (ExplainError, TypeError, ValueError, KeyError, AttributeError, IndexError) as err:
            # no such run, or a summary.json of the wrong shape: said, never a crash
            self.notify(f"Cannot explain {literal(run)}: {literal(err)}", severity="error", timeout=10)
            return
        # markdown, never markup; a run directory's names and notes with their control characters spelled
        self.push_screen(ExplainScreen(clean("\n\n".join([result["text"], *map(str, result["notes"])]))))

    def action_why(self) -> None:
        """Why the selected run's loss differs from the baseline's: ``shardscope why``'s re-runs, with progress."""
        from shardscope.tui.screens.why import WhyScreen

        run = self._selected()
        if not run or not self.out_dir:
            self.notify("Select a run first.")
        elif self.source is not None and self.started and not self.source.finished:
            self.notify("Why needs a finished comparison: wait for every run to end.")
        else:
            self.push_screen(WhyScreen(self.out_dir, run))

    def action_toggle_keys(self) -> None:
        """Show the keys of the current screen (every binding and what it does) beside it, or hide them."""
        from textual.widgets import HelpPanel

        panels = self.screen.query(HelpPanel)
        if panels:
            panels.remove()
        else:
            self.action_show_help_panel()

    def action_export(self) -> None:
        """Save a picture of the screen next to the results and copy every artefact path."""
        if not self.out_dir:
            self.notify("Nothing to export yet.")
            return
        lines = [os.path.abspath(self.out_dir)]
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            target = os.path.join(self.out_dir, SCREENSHOT)
            svg = self.export_screenshot()
            # A partial file and a rename, as report.md: never written through a link that leads out of the directory
            write_atomic(target, lambda fh: fh.write(svg))
            lines.append(target)
        except OSError as err:
            self.notify(f"Cannot write the screenshot: {literal(err)}", severity="error")
        out = RunDir(self.out_dir)
        for path in (out.summary, out.report, out.plots):
            if os.path.exists(path):
                lines.append(os.path.abspath(path))
        self.copy_to_clipboard("\n".join(lines))
        self.notify("Copied to the clipboard:\n" + "\n".join(literal(display_path(p)) for p in lines), timeout=8)
