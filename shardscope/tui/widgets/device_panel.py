"""Device memory and utilisation: GPUs from NVML, or each rank's process memory on CPU."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from shardscope.core.rundir import devices_name
from shardscope.core.text import clean
from shardscope.orchestrator.device_history import DeviceHistory
from shardscope.profiling.state import DeviceReading
from shardscope.tui.format import human_bytes
from shardscope.tui.widgets.scroll_panel import ScrollPanel


def _bar(fraction: float, width: int, colour: str) -> ProgressBar:
    return ProgressBar(total=1000, completed=int(max(0.0, min(1.0, fraction)) * 1000), width=width,
                       complete_style=colour, finished_style=colour, pulse=False, animation_time=0)


def _who(r: DeviceReading, narrow: bool = False) -> str:
    if not r.run:
        return "idle"
    ranks = ",".join(str(x) for x in r.ranks)
    if narrow:
        return f"{r.run} r{ranks}" if ranks else r.run
    return f"{r.run} rank{'s' if len(r.ranks) > 1 else ''} {ranks}" if ranks else r.run


class DevicePanel(ScrollPanel):
    """Shows every device's (or rank process's) last reading and peak; the parent calls ``show``.
    Runs that ended keep their last reading and peak, marked as ended."""

    def show(self, history: DeviceHistory | None, finished: bool = False) -> None:
        """Redraw from ``history`` (None or empty: explain that nothing was sampled, yet or at all once the
        comparison has ``finished``)."""
        rows = history.rows() if history is not None else []
        if not rows:
            self.update(Text(f"No device samples were recorded for this comparison ({devices_name()})." if finished
                             else "No device samples yet: they arrive while runs are live.", "dim"))
            return
        width = max(3, (self.line_width or 40) // 8)
        if all(k.source == "process-rss" for k in rows):
            return self.update(self._rss(rows, width))
        # A GPU: its name and who uses it on one line (wrapping, never cut), then its bars and figures.
        parts: list[Any] = [Text("GPU memory used/total (peak) · utilisation (NVML)", "dim italic")]
        for k in rows:
            r = k.last
            label = Text.assemble((clean(r.label), "bold"), (clean("  " + _who(r)), "dim"))  # names: text
            if not k.live:
                label.append(" (last reading)", "dim italic")
            table = _grid(width, narrow=False)
            frac = r.used_bytes / r.total_bytes if r.total_bytes else 0.0
            table.add_row(Text("  memory", "dim"), _bar(frac, width, "magenta" if k.live else "grey50"),
                          Text(f"{human_bytes(r.used_bytes)}/{human_bytes(r.total_bytes)} "
                               f"({human_bytes(k.peak_used_bytes)})"))
            if r.util_pct is not None:
                power = f" {r.power_w:.0f} W" if r.power_w is not None else ""
                table.add_row(Text("  util", "dim"), _bar(r.util_pct / 100, width, "green"),
                              Text(f"{r.util_pct:.0f}%{power}"))
            parts += [label, table]
        self.update(Group(*parts))

    def _rss(self, rows: list[Any], width: int) -> Group:
        """A CPU run's rows: each rank process's RSS, last and peak. By rule instead of cut names: when
        the longest whole row does not fit, rows drop the bar, then say "r0" for "rank 0"."""
        def label(k: Any, narrow: bool, ended: bool = True, room: int = 0) -> Text:
            text = _who(k.last, narrow) if k.last.run else k.last.label
            if room and len(text) > room and k.last.run and k.last.ranks:  # the run's name gives way, never the rank
                suffix = text[len(k.last.run):]
                text = k.last.run[:max(1, room - len(suffix) - 1)] + "…" + suffix
            who = Text(clean(text), "" if k.live else "dim")
            if not k.live and ended:  # without room, dim alone says the run ended
                who.append(" ended", "dim italic")
            return who

        figures = [f"{human_bytes(k.last.used_bytes)} ↑{human_bytes(k.peak_used_bytes)}" for k in rows]
        fig_width = max(map(len, figures)) + 1
        have = self.line_width
        longest = max(len(label(k, False)) for k in rows)
        bar = not have or longest + width + 1 + fig_width <= have  # first the bar goes, then the long labels
        narrow = bool(have) and not bar and longest + fig_width > have
        table = _grid(width, not bar)
        top = max((k.peak_used_bytes for k in rows), default=0) or 1
        ended = not narrow or max(len(label(k, True)) for k in rows) + fig_width <= have
        for k, fig in zip(rows, figures):
            cells = [label(k, narrow, ended, room=have - fig_width - 1 if narrow else 0), Text(fig)]
            if bar:
                cells.insert(1, _bar(k.last.used_bytes / top, width, "cyan" if k.live else "grey50"))
            table.add_row(*cells)
        return Group(Text("process RSS per rank (CPU run): last ↑peak", "dim italic"), table)


def _grid(width: int, narrow: bool) -> Table:
    table = Table.grid(padding=(0, 1), expand=True)
    table.add_column(no_wrap=True, overflow="ellipsis", ratio=1, min_width=6)
    if not narrow:
        table.add_column(width=width)
    table.add_column(no_wrap=True, justify="right")
    return table
