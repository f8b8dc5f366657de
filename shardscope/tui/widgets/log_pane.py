"""The selected run's console tail, and a failed run's error with the end of its traceback.

A rank prints what it likes: every line is written as a ``Text`` (never markup) with its control characters
spelled ``\\xNN`` (``core.text.clean``), so ``[@click=app.quit]`` or a terminal's title sequence is shown, not obeyed.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import RichLog

from shardscope.profiling.state import FINISHED, RunState
from shardscope.core.text import clean
from shardscope.tui.board import Console
from shardscope.tui.format import literal, short_command

TRACEBACK_LINES = 25


class LogPane(RichLog):
    """Tails one run's console. The parent calls ``follow`` to switch runs and ``show`` to append."""

    def __init__(self, **kwargs) -> None:
        super().__init__(max_lines=2000, wrap=True, min_width=20, markup=False, highlight=False, **kwargs)
        self.run = ""
        self._seen = 0
        self._error_shown = ""
        self._hinted = False
        self._printed = False  # a rank wrote a line
        self._silent_said = False

    def follow(self, run: str, console: Console, state: RunState | None) -> None:
        """Start showing ``run``: clear and write its kept lines (and its error, if it failed)."""
        self.run, self._seen, self._error_shown = run, 0, ""
        self._hinted = self._printed = self._silent_said = False
        self.clear()
        self.border_title = f"console · {literal(run)}"
        self.show(console, state)

    def show(self, console: Console, state: RunState | None) -> None:
        """Append the console lines not shown yet; write the failure once it is known."""
        lines = console.since(self._seen)
        self._seen = console.total
        for line in map(clean, lines):
            if line.startswith("$ "):  # the launch line: one dim line, not a screenful (console.log has it all)
                self.write(Text(short_command(line), "dim", no_wrap=True, overflow="ellipsis"))
                if not self._hinted:
                    self.write(Text("(the ranks' own output follows as they print it)", "dim italic"))
                    self._hinted = True
            else:
                self.write(Text(line))
                self._printed = True
        if (state is not None and state.status in FINISHED and self._hinted and not self._printed
                and not self._silent_said):  # the hint promised output: say there was none
            self._silent_said = True
            self.write(Text(clean(f"(no output from the ranks; {state.name} ended {state.status})"), "dim italic"))
        if state is not None and state.status == "failed" and (state.error or state.traceback) \
                and self._error_shown != state.error + state.traceback:
            self._error_shown = state.error + state.traceback
            self.write(Text(clean(f"── {state.name} failed: {state.error or 'see traceback'}"), "bold red"))
            tail = clean(state.traceback).rstrip().splitlines()[-TRACEBACK_LINES:]
            for line in tail:
                self.write(Text(line, "red"))
