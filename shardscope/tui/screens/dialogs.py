"""Small modal screens: confirm quitting with active runs, the too-small-terminal notice, and the base of the screens
that drive runs of their own (``why``, ``tune``)."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from shardscope.tui.format import literal


class ConfirmQuit(ModalScreen[bool]):
    """Asks before stopping active runs. Dismisses with True to stop them and quit."""

    BINDINGS = [Binding("escape,n", "dismiss(False)", "Cancel"), Binding("y", "dismiss(True)", "Stop and quit")]

    def __init__(self, active: list[str]) -> None:
        super().__init__()
        self.active = active

    def compose(self) -> ComposeResult:
        """A question and two buttons."""
        with Grid(id="confirm"):
            runs = literal(", ".join(self.active)) or "queued runs"
            yield Static(f"Runs still going: [b]{runs}[/b].\nStop them all and quit? "
                         "Finished results and reports are kept.", id="confirm-text")
            yield Button("Stop and quit (y)", variant="error", id="yes")
            yield Button("Cancel (n)", variant="primary", id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        """Answer with the button pressed."""
        self.dismiss(event.button.id == "yes")


class TooSmall(ModalScreen[None]):
    """Covers the app while the terminal is smaller than the layout needs; closes itself when it grows."""

    def __init__(self, need: tuple[int, int]) -> None:
        super().__init__()
        self.need = need

    def compose(self) -> ComposeResult:
        """One line of text."""
        yield Static(id="too-small-text")

    def on_mount(self) -> None:
        """Say what size is needed."""
        self.show_size()

    def show_size(self) -> None:
        """Update the text with the current and the needed size (nothing before the text is composed: the redraw
        timer can call this between the push and the compose, and ``on_mount`` shows it then)."""
        w, h = self.app.size
        for text in self.query("#too-small-text").results(Static):
            text.update(
                f"Terminal too small: {w}×{h}. shardscope needs at least {self.need[0]}×{self.need[1]} — "
                "enlarge the window (runs keep going meanwhile).")


class RunnerScreen(ModalScreen[None]):
    """A screen whose worker thread drives runs through ``runner`` (anything with ``stop()``) while ``running``:
    closing it (escape, q, or the screen going away) stops them, with ``stop_note`` as the toast."""

    stop_note = "Stopping the runs…"

    def __init__(self) -> None:
        super().__init__()
        self.runner: Any = None
        self.running = False

    def action_close(self) -> None:
        """Close; runs still going are stopped."""
        self._stop()
        self.app.pop_screen()

    def on_unmount(self) -> None:
        """Never leave runs behind."""
        self._stop()

    def _stop(self) -> None:
        if self.running and self.runner is not None:
            self.runner.stop()
            self.app.notify(self.stop_note)
