"""Line charts over steps (loss, difference from baseline, throughput), drawn with plotext.

The parent hands a chart its series with ``set_series``; the chart only redraws when its data
changed and counts its redraws (the ingest benchmark checks the rate stays bounded).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from rich.align import Align
from rich.console import Group
from rich.text import Text
from textual_plotext import PlotextPlot

from shardscope.core.numbers import common_steps, fmt_sig
from shardscope.core.text import clean
from shardscope.profiling.state import RunState
from shardscope.tui.format import rgb

MAX_POINTS = 400  # points drawn per series at most; longer series are thinned evenly


@dataclass(frozen=True)
class Series:
    """One line on a chart."""

    label: str
    xs: tuple[float, ...]
    ys: tuple[float, ...]
    colour: str


def thin(points: list[tuple[int, float]], limit: int = MAX_POINTS) -> list[tuple[int, float]]:
    """Return at most ``limit`` points spread evenly over ``points``, always keeping the last one."""
    if len(points) <= limit:
        return list(points)
    stride = len(points) / limit
    out = [points[int(i * stride)] for i in range(limit - 1)]
    out.append(points[-1])
    return out


def series_of(pairs: list[tuple[int, float]], label: str, colour: str, limit: int = MAX_POINTS) -> Series:
    """Return a Series from (step, value) pairs, thinned to ``limit`` points for drawing; non-finite
    values are left out (a line cannot show them; the run's card says it diverged)."""
    pts = thin([p for p in pairs if math.isfinite(p[1])], limit)
    return Series(label, tuple(p[0] for p in pts), tuple(p[1] for p in pts), colour)


def loss_diff(run: RunState, base: RunState) -> list[tuple[int, float]]:
    """Return (step, loss - baseline loss) at the steps both runs reported (signed, for the chart;
    nan where both are the same infinity, which ``diff_note`` flags as non-finite)."""
    return [(step, loss - base_loss) for step, loss, base_loss in common_steps(run.losses, base.losses)]


def y_ticks(ys: list[float], count: int = 5) -> list[float]:
    """Return ``count`` evenly spaced tick values over the range of ``ys`` ([] when empty; one tick
    when every value is the same)."""
    if not ys:
        return []
    lo, hi = min(ys), max(ys)
    if hi == lo:
        return [lo]
    return [lo + (hi - lo) * i / (count - 1) for i in range(count)]


def step_ticks(xs: list[float], count: int = 5) -> list[int]:
    """At most about ``count`` whole-number steps over the range of ``xs``, evenly spaced (there is no step 0.5,
    which plotext's own ticks would show for a short run); [] when empty."""
    if not xs:
        return []
    lo, hi = int(min(xs)), int(max(xs))
    stride = max(1, -(-(hi - lo) // max(1, count - 1)))
    return list(range(lo, hi + 1, stride))


def diff_note(diffs: dict[str, list[tuple[int, float]]]) -> str:
    """Return the difference chart's title note: " (non-finite from step N)" when a difference is
    nan or inf (never "identical"), " (identical)" when every difference is exactly 0, else ""."""
    bad = [step for pairs in diffs.values() for step, d in pairs if not math.isfinite(d)]
    if bad:
        return f" (non-finite from step {min(bad)})"
    values = [d for pairs in diffs.values() for _, d in pairs]
    return " (identical)" if values and not any(values) else ""


class StepChart(PlotextPlot):
    """A titled chart of several runs over steps, its legend on a line of its own beneath the plot (plotext draws
    one inside the data, over the curves)."""

    DEFAULT_CSS = "StepChart { height: 1fr; width: 1fr; min-height: 5; }"

    def __init__(self, title: str, empty: str = "waiting for steps…", **kwargs) -> None:
        super().__init__(**kwargs)
        self.title = title
        self.empty = empty
        self.redraws = 0
        self.render_s = 0.0  # how long the last redraw took; the dashboard spaces redraws by it
        self._series: tuple[Series, ...] = ()

    def set_series(self, series: list[Series], title: str | None = None) -> None:
        """Replace the drawn series (and optionally the title); redraws only if something changed."""
        new = tuple(series)
        if new == self._series and (title is None or title == self.title):
            return
        self._series = new
        if title is not None:
            self.title = title
        self.refresh()

    @property
    def points(self) -> int:
        """Points worth drawing per series: braille draws two per cell across."""
        return max(40, min(MAX_POINTS, 2 * (self.size.width or 100)))

    def render(self):
        """Rebuild the plot from the current series."""
        started = time.perf_counter()
        try:
            return self._render_plot()
        finally:
            self.render_s = time.perf_counter() - started

    def _render_plot(self):
        self.redraws += 1
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        drawn = [s for s in self._series if s.xs]
        if not drawn:  # plotext drops a title wider than the chart: say it as wrapped text, not an empty frame
            return Align.center(Text(clean(f"{self.title} by step\n\n{self.empty}"), style="dim", justify="center"),
                                vertical="middle")
        plt.title(clean(f"{self.title} by step"))  # plotext's output is read as ANSI: no control gets in
        for s in drawn:
            plt.plot(list(s.xs), list(s.ys), color=rgb(s.colour), marker="braille")
        ticks = y_ticks([y for s in drawn for y in s.ys])
        if ticks:  # plotext would write 0.000000119; tiny differences read better as 1.19e-07
            plt.yticks(ticks, [fmt_sig(t) for t in ticks])
        steps = step_ticks([x for s in drawn for x in s.xs])
        plt.xticks(steps, [str(t) for t in steps])
        width, height = self.size.width, max(3, self.size.height - 1)
        plt.theme(self._get_plotext_theme_name(self.app.theme))
        built = ""
        for asked in (height, height - 1, height - 2):  # plotext may draw a line more than asked: ask for fewer
            plt.plotsize(width, max(3, asked))
            plt._set_size(width, max(3, asked))  # as PlotextPlot.render does (textual-plotext issue 5)
            built = plt.build()
            if built.count("\n") + 1 <= height:
                break
        legend = Text(no_wrap=True, overflow="ellipsis", justify="center")
        for s in drawn:
            legend.append("■ ", style=s.colour).append(clean(s.label) + "  ")
        legend.rstrip()
        legend.truncate(width, overflow="ellipsis")
        return Group(Text.from_ansi(built), legend)
