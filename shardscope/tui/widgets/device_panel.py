"""Device memory and utilisation: GPUs from NVML, or each rank's process memory on CPU."""

from __future__ import annotations

from rich.console import Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from shardscope.orchestrator.device_history import DeviceHistory
from shardscope.profiling.state import DeviceReading
from shardscope.tui.format import human_bytes


def _bar(fraction: float, width: int, colour: str) -> ProgressBar:
    return ProgressBar(total=1000, completed=int(max(0.0, min(1.0, fraction)) * 1000), width=width,
                       complete_style=colour, finished_style=colour, pulse=False, animation_time=0)


def _who(r: DeviceReading) -> str:
    if not r.run:
        return "idle"
    ranks = ",".join(str(x) for x in r.ranks)
    return f"{r.run} rank{'s' if len(r.ranks) > 1 else ''} {ranks}" if ranks else r.run


class DevicePanel(Static):
    """Shows every device's (or rank process's) last reading and peak; the parent calls ``show``.
    Runs that ended keep their last reading and peak, marked as ended."""

    def show(self, history: DeviceHistory | None) -> None:
        """Redraw from ``history`` (None or empty: explain that nothing was sampled yet)."""
        rows = history.rows() if history is not None else []
        if not rows:
            self.update(Text("No device samples yet: they arrive while runs are live.", "dim"))
            return
        width = max(3, (self.size.width or 40) // 8)
        table = Table.grid(padding=(0, 1), expand=True)
        table.add_column(no_wrap=True, overflow="ellipsis", ratio=1, min_width=12)
        table.add_column(width=width)
        table.add_column(no_wrap=True, justify="right")
        if all(k.source == "process-rss" for k in rows):
            header = Text("process RSS per rank (CPU run): last ↑peak", "dim italic")
            top = max((k.peak_used_bytes for k in rows), default=0) or 1
            for k in rows:
                r = k.last
                who = Text(_who(r) if r.run else r.label, "" if k.live else "dim")
                if not k.live:
                    who.append(" ended", "dim italic")
                table.add_row(who, _bar(r.used_bytes / top, width, "cyan" if k.live else "grey50"),
                              Text(f"{human_bytes(r.used_bytes)} ↑{human_bytes(k.peak_used_bytes)}"))
            return self.update(Group(header, table))
        header = Text("GPU memory used/total (peak) · utilisation (NVML)", "dim italic")
        for k in rows:
            r = k.last
            frac = r.used_bytes / r.total_bytes if r.total_bytes else 0.0
            label = Text.assemble((r.label, "bold"), ("  " + _who(r), "dim"))
            if not k.live:
                label.append(" (last reading)", "dim italic")
            table.add_row(label, _bar(frac, width, "magenta" if k.live else "grey50"),
                          Text(f"{human_bytes(r.used_bytes)}/{human_bytes(r.total_bytes)} "
                               f"({human_bytes(k.peak_used_bytes)})"))
            if r.util_pct is not None:
                power = f" {r.power_w:.0f} W" if r.power_w is not None else ""
                table.add_row(Text("  utilisation", "dim"), _bar(r.util_pct / 100, width, "green"),
                              Text(f"{r.util_pct:.0f}%{power}"))
        self.update(Group(header, table))
