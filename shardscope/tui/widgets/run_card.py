"""One card per run: status, progress with ETA, loss, throughput, peak memory."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import Static

from shardscope.core import registry
from shardscope.core.text import clean
from shardscope.profiling import bubble
from shardscope.profiling.state import RunState
from shardscope.analysis.summary import on_gpu
from shardscope.tui.format import STATUS_STYLE, fmt_loss, human_bytes, human_duration, human_rate
from shardscope.tui.messages import RunSelected


def _row(left: Text, right: Text, width: int) -> Text:
    """Return ``left`` and ``right`` on one line of ``width`` cells (left is cut first)."""
    room = max(0, width - right.cell_len - 1)
    if left.cell_len > room:
        left.truncate(room, overflow="ellipsis")
    return Text.assemble(left, " " * max(1, width - left.cell_len - right.cell_len), right)


def _bar(fraction: float, width: int, colour: str) -> Text:
    done = int(round(max(0.0, min(1.0, fraction)) * width))
    return Text.assemble(("━" * done, colour), ("━" * (width - done), "grey30"))


def chosen_options(strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options that differ from the strategy's defaults (a live run's start record lists them all)."""
    if not isinstance(options, dict):  # a spec.json of another shape: no options to show
        return {}
    known = isinstance(strategy, str) and strategy in registry.STRATEGIES
    defaults = registry.option_defaults(strategy) if known else {}
    return {k: v for k, v in options.items() if k not in defaults or defaults[k] != v}


class RunCard(Static):
    """A run's card. Click it to select the run; the parent calls ``show`` with the run's state.

    Built from plain Text lines (no Rich tables): eight cards redraw ten times a second.
    """

    DEFAULT_CSS = """
    RunCard { height: 8; border: round $panel-lighten-2; padding: 0 1; }
    RunCard.-selected { border: double $accent; }
    RunCard.-failed { border: round $error; }
    RunCard.-failed.-selected { border: double $error; }
    """

    def __init__(self, run: str, colour: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.run = run
        self.colour = colour
        self._state: RunState | None = None
        self._baseline = False
        self._traced: tuple[int, ...] = ()
        self._drawn: tuple = ()

    def show(self, state: RunState, *, baseline: bool, traced: tuple[int, ...] = ()) -> None:
        """Redraw the card from ``state`` (only if what it shows changed); ``traced``: ranks flagged from
        the run's traces (GPU runs, once their profiler window was analysed)."""
        self._state, self._baseline, self._traced = state, baseline, traced
        width = self.content_size.width or 30
        key = (width, baseline, state.status, state.steps_completed, state.steps_total, state.loss, state.rate,
               state.peak_mem_bytes, None if state.eta_s is None else int(state.eta_s), tuple(state.stragglers.flagged),
               traced, state.bubble.measured())
        if key == self._drawn:
            return
        self._drawn = key
        self.set_class(state.status in ("failed", "diverged"), "-failed")
        title = Text.assemble(("■ ", self.colour), (clean(state.name), "bold"))  # .markup below escapes it
        if baseline:
            title.append("  (baseline)", "italic dim")
        self.border_title = title.markup
        subtitle = Text(state.status, STATUS_STYLE.get(state.status, ""))
        piped = bubble.pipeline_entry(state.bubble, (state.start.get(0) or {}).get("notes") or {})
        if piped:  # a pipeline run: the idle share of its schedule, beside theory (short: a card is ~30 wide)
            measured, theory = piped.get("bubble_measured"), piped.get("bubble_theory")
            subtitle.append(" · bubble " + ("–" if measured is None else f"{measured:.0%}")
                            + ("" if theory is None else f" (th {theory:.0%})"), "dim")
        for rank in sorted({*state.stragglers.flagged, *traced}):  # named live: run (this card), rank, host, device
            start = state.start.get(rank) or {}
            source = " (trace)" if rank not in state.stragglers.flagged else ""
            where = f"{start.get('host', '')} {start.get('device', '')}"  # as a record gave them: text
            subtitle.append(clean(f" ⚠ straggler rank {rank} {where}".rstrip() + source), "bold yellow")
        self.border_subtitle = subtitle.markup
        self.update(self._body(state, width))

    def on_resize(self) -> None:
        """Lines are laid out for a width: lay them out again."""
        if self._state is not None:
            self.show(self._state, baseline=self._baseline, traced=self._traced)

    def _body(self, s: RunState, width: int) -> Text:
        # strategy, precision and options as a spec or start record gave them: text, controls spelled
        opts = clean(", ".join(f"{k}={v}" for k, v in chosen_options(s.strategy, s.options).items()))
        what = clean(f"{s.strategy} ×{s.world_size} · {s.precision}")
        head = [Text(what + (f" · {opts}" if opts else ""), "dim")]
        if opts and len(head[0]) > width:  # by rule: the options on a line of their own before anything is cut
            head = [Text(what, "dim"), Text(opts, "dim")]
        for line in head:
            line.truncate(width, overflow="ellipsis")
        eta = f"ETA {human_duration(s.eta_s)}" if s.status == "running" else ""
        lines = [
            *head,
            # the bar repeats "step n/N": a card whose options took a line gives the bar up (fixed height)
            *([_bar(s.progress, width, self.colour)] if len(head) == 1 else []),
            _row(Text(f"step {s.steps_completed}/{s.steps_total}"), Text(eta, "dim"), width),
            # label left, value right: a narrow card (100 columns) cuts nothing but spaces
            _row(Text("loss"), Text(fmt_loss(s.loss), "bold"), width),
            _row(Text(f"median {s.unit}"), Text(human_rate(s.median)), width),
            _row(Text("peak mem" if on_gpu(s) else "peak RSS", "dim"), Text(human_bytes(s.peak_mem_bytes), "dim"), width),
        ]
        return Text("\n").join(lines)

    def on_click(self) -> None:
        """Tell the dashboard this run was chosen."""
        self.post_message(RunSelected(self.run))
