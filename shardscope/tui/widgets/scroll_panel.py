"""A bordered panel whose text scrolls: a short terminal hides none of its rows, a scroll bar says there is more."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static


class ScrollPanel(VerticalScroll):
    """One static body inside a scrolling frame; ``update`` replaces the body, ``line_width`` is what a line may use.

    A redraw may reach the panel before its body is mounted or after it is gone (a timer ticking while the
    screen composes or tears down, seen on a loaded CI machine): the content is kept and shown once the body
    exists, never an error."""

    _waiting: Any = ""  # content given before the body was mounted

    def compose(self) -> ComposeResult:
        """The body: one Static, as tall as its text."""
        yield Static(self._waiting, classes="panel-body")

    @property
    def body(self) -> Static:
        """The text the panel shows (border title and subtitle live on the panel itself)."""
        return self.query_one(".panel-body", Static)

    @property
    def content(self) -> Any:
        """What the body shows (as ``Static.content``), or what it will show once mounted."""
        bodies = self.query(".panel-body")
        return bodies.first(Static).content if bodies else self._waiting

    @property
    def line_width(self) -> int:
        """Columns a line may use: the panel's content width without its scroll bar (0 before layout)."""
        return self.scrollable_content_region.width

    def update(self, content: Any) -> None:
        """Replace what the panel shows (kept for the body when it is not mounted yet)."""
        self._waiting = content
        bodies = self.query(".panel-body")
        if bodies:
            bodies.first(Static).update(content)
