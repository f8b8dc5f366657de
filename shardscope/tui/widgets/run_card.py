"""One card per run: status, progress with ETA, loss, throughput, peak memory."""

from __future__ import annotations

from rich.console import Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from shardscope.orchestrator.state import RunState
from shardscope.tui.format import (
    STATUS_STYLE, fmt_loss, human_bytes, human_duration, human_rate,
)
from shardscope.tui.messages import RunSelected


class RunCard(Static):
    """A run's card. Click it to select the run; the parent sets ``state`` through ``show``."""

    DEFAULT_CSS = """
    RunCard { height: 7; border: round $panel-lighten-2; padding: 0 1; }
    RunCard.-selected { border: double $accent; }
    RunCard.-failed { border: round $error; }
    RunCard.-failed.-selected { border: double $error; }
    """

    def __init__(self, run: str, colour: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.run = run
        self.colour = colour
        self.baseline = False

    def show(self, state: RunState, *, baseline: bool) -> None:
        """Redraw the card from ``state``."""
        self.baseline = baseline
        self.set_class(state.status == "failed", "-failed")
        title = Text.assemble(("■ ", self.colour), (state.name, "bold"))
        if baseline:
            title.append("  (baseline)", "italic dim")
        self.border_title = title.markup
        self.border_subtitle = Text(state.status, STATUS_STYLE.get(state.status, "")).markup
        self.update(self._body(state))

    def _body(self, s: RunState) -> Group:
        total = s.steps_total or 1
        bar = ProgressBar(total=total, completed=min(s.steps_completed, total), complete_style=self.colour,
                          finished_style=self.colour, pulse=False, animation_time=0)
        opts = ", ".join(f"{k}={v}" for k, v in s.options.items())
        head = Table.grid(expand=True)
        head.add_column(ratio=1, no_wrap=True, overflow="ellipsis")
        head.add_row(Text(f"{s.strategy} ×{s.world_size} · {s.precision}" + (f" · {opts}" if opts else ""), "dim"))
        head.add_row(bar)
        grid = Table.grid(expand=True)
        grid.add_column(ratio=1, no_wrap=True, overflow="ellipsis")
        grid.add_column(justify="right", no_wrap=True)
        eta = f"ETA {human_duration(s.eta_s)}" if s.status == "running" else ""
        grid.add_row(Text(f"step {s.steps_completed}/{s.steps_total}"), Text(eta, "dim"))
        grid.add_row(Text.assemble("loss ", (fmt_loss(s.loss), "bold")), Text(f"{human_rate(s.rate)} {s.unit}"))
        grid.add_row(Text("peak memory", "dim"), Text(human_bytes(s.peak_mem_bytes), "dim"))
        return Group(head, grid)

    def on_click(self) -> None:
        """Tell the dashboard this run was chosen."""
        self.post_message(RunSelected(self.run))
