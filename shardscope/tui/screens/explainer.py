"""The explainer of the selected run's strategy, filled with that run's numbers (key ``i`` on the dashboard)."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Footer, Markdown

from shardscope.config import Comparison
from shardscope.analysis import explain
from shardscope.core.rundir import read_summary


def explanation_for(comparison: Comparison, run: str, out_dir: str | None) -> dict[str, Any]:
    """The run's explanation: predicted beside measured once ``out_dir`` has a summary.json with the run,
    else the memory model's and the communication theory's figures. Raises ExplainError for an unknown run."""
    summary = read_summary(out_dir) if out_dir else None
    if summary is not None and any(isinstance(r, dict) and r.get("name") == run for r in summary["runs"]):
        return explain.explain_summary(comparison, summary, run)
    strategy = next((r.strategy for r in comparison.runs if r.name == run), "")
    return explain.explain_preset(comparison, strategy, run)


class ExplainScreen(ModalScreen[None]):
    """A scrollable markdown explainer; escape or q closes it."""

    BINDINGS = [Binding("escape,q,i", "app.pop_screen", "Close")]

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        """The explainer's markdown in a scroll view."""
        with VerticalScroll(id="explainer"):
            yield Markdown(self.text, id="explainer-text", open_links=False)  # text from a run directory: no link opens
        yield Footer()  # the keys, and the way back
