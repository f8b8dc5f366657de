"""The headless view: a live progress table while runs go, then the comparison table.

Consumes the same update stream as the Textual app (``profiling/state.py``'s updates, from the
session's thread and the device sampler's). On a terminal it
draws a rich ``Live`` table; elsewhere (CI logs, pipes) it prints one line per status change and
per tenth of progress, so logs stay readable.

Run names, strategies, statuses, hosts, errors and notices come from files, records and ranks: every table cell
holding one is a ``Text`` (a str cell is markup to rich) and every printed line has its control characters spelled
``\\xNN`` (``core.text.clean``), so no byte from outside reaches the terminal as markup or as a control.
"""

from __future__ import annotations

import threading
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from shardscope.core.numbers import fmt_bytes
from shardscope.core.text import clean
from shardscope.profiling import state
from shardscope.profiling.state import STATUS_STYLE, RunState, Update
from shardscope.analysis import straggler_report
from shardscope.profiling import stragglers
from shardscope.analysis.summary import memory_headers, on_gpu, throughput_unit
from shardscope.profiling import bubble


def fmt_num(x: float | None, spec: str = ".4f") -> str:
    """Format a number or return ``-`` for None (or what a file held that is not a number)."""
    return format(x, spec) if _number(x) else "-"


def fmt_rate(x: float | None) -> str:
    """Format a throughput with thousands separators."""
    return f"{x:,.0f}" if _number(x) else "-"


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def cell(value: Any, style: str = "") -> Text:
    """A table cell from outside (a name, a status, an error): text, never markup, its controls spelled."""
    return Text(clean(str(value)), style)


def say(console: Console, line: str, **kwargs: Any) -> None:
    """Print one line from outside as text: no markup read, no highlighting, control characters spelled."""
    console.print(clean(line), highlight=False, markup=False, **kwargs)


def fmt_eta(seconds: float | None) -> str:
    """Format seconds as ``1m05s``."""
    if seconds is None:
        return "-"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


class HeadlessView:
    """Folds updates into run states (any thread) and renders them (main thread)."""

    def __init__(self, console: Console | None = None, names: list[str] | None = None) -> None:
        self.console = console or Console(stderr=False)
        self.states: dict[str, RunState] = {}
        self.order = list(names or [])
        self.notices: list[state.Notice] = []
        self._lock = threading.Lock()
        self._plain_marks: dict[str, int] = {}
        self.straggler_lines: dict[tuple[str, int], str] = {}  # (run, rank) -> line, once flagged
        self.live = self.console.is_terminal

    def __call__(self, updates: list[Update]) -> None:
        """Subscriber entry: fold a batch; in plain mode print what changed."""
        with self._lock:
            changed = state.fold(updates, self.states)
            for u in updates:
                if isinstance(u, state.RunDefined) and u.run not in self.order:
                    self.order.append(u.run)
                if isinstance(u, state.Notice):
                    self.notices.append(u)
            fresh = self._new_stragglers(changed)
        for line in fresh if not self.live else ():
            say(self.console, line)
        if not self.live:
            self._print_plain(updates, changed)

    def _new_stragglers(self, changed: set[str]) -> list[str]:
        fresh = []
        for name in changed:
            st = self.states[name]
            for rank, s in st.stragglers.flagged.items():
                if (name, rank) not in self.straggler_lines:
                    line = stragglers.describe(name, s, st.start.get(rank), st.stragglers.threshold)
                    self.straggler_lines[(name, rank)] = line
                    fresh.append(line)
        return fresh

    def _print_plain(self, updates: list[Update], changed: set[str]) -> None:
        for u in updates:
            if isinstance(u, state.StatusChanged):
                st = self.states.get(u.run)
                extra = f": {u.error}" if u.error else ""
                busy = [n for n, other in self.states.items() if n != u.run and other.status == state.RUNNING]
                if u.status == state.STARTING and busy:  # launched ahead, during the last steps of the run before it
                    say(self.console, f"[{u.run}] preparing (its first step waits until {busy[0]} has ended)")
                    continue
                say(self.console, f"[{u.run}] {u.status}{extra}")
                if st and u.status in state.FINISHED and st.loss is not None:
                    say(self.console, f"[{u.run}] steps {st.steps_completed}/{st.steps_total} loss {fmt_num(st.loss)}")
            elif isinstance(u, state.Notice) and u.level != "info":
                say(self.console, f"{u.level}: {u.text}")
        for name in changed:
            st = self.states[name]
            if not st.steps_total or st.loss is None:
                continue
            tenth = int(10 * st.progress)
            if tenth > self._plain_marks.get(name, 0):
                self._plain_marks[name] = tenth
                say(self.console,
                    f"[{name}] step {st.steps_completed}/{st.steps_total} loss {fmt_num(st.loss)} "
                    f"median {st.unit} {fmt_rate(st.median)} {'mem' if on_gpu(st) else 'RSS'} "
                    f"{fmt_bytes(st.peak_mem_bytes)}")

    def table(self) -> Table:
        """Return the live progress table."""
        caption = "\n".join(self.straggler_lines.values())  # hosts and devices from the ranks' records: text
        table = Table(title="shardscope", expand=False, caption=cell(caption) if caption else None)
        with self._lock:
            units = {st.unit for st in self.states.values() if st.rate is not None} or {"tokens/s"}
            gpu = any(on_gpu(st) for st in self.states.values())  # else every figure is the process's RSS
            piped = any(_pipeline_of(st) for st in self.states.values())
        for col, justify in (("run", "left"), ("strategy", "left"), ("ranks", "right"), ("status", "left"),
                             ("step", "right"), ("loss", "right"), ("median " + " or ".join(sorted(units)), "right"),
                             ("peak mem" if gpu else "peak RSS", "right"), ("eta", "right")) + (
                                 (("bubble", "right"),) if piped else ()):
            table.add_column(col, justify=justify)
        with self._lock:
            for name in self.order:
                st = self.states.get(name)
                if st is None:
                    continue
                unit_rate = fmt_rate(st.median) + (f" {st.unit}" if len(units) > 1 else "")
                table.add_row(
                    cell(name), cell(st.strategy), str(st.world_size),
                    cell(st.status, STATUS_STYLE.get(st.status, "")),
                    f"{max(st.steps_completed, 0)}/{st.steps_total}", fmt_num(st.loss), unit_rate,
                    fmt_bytes(st.peak_mem_bytes), fmt_eta(st.eta_s) if st.status == "running" else "-",
                    *((bubble.bubble_text(_pipeline_of(st)) or "-",) if piped else ()),
                )
        return table

    def run_live(self, wait_step) -> None:
        """Redraw the table until ``wait_step()`` returns True (it should block briefly)."""
        if not self.live:
            while not wait_step():
                pass
            return
        with Live(self.table(), console=self.console, refresh_per_second=4, transient=False) as live:
            while not wait_step():
                live.update(self.table())
            live.update(self.table())


def _pipeline_of(st: Any) -> dict[str, Any] | None:
    """A pipeline run's bubble entry so far (profiling/bubble.py), None for any other run."""
    return bubble.pipeline_entry(st.bubble, (st.start.get(0) or {}).get("notes") or {})


def pipeline_table(summary: dict[str, Any]) -> Table | None:
    """The pipeline runs' schedules, bubbles (measured per rank beside theory) and point-to-point bytes; None when
    no run is a pipeline."""
    runs = [r for r in summary.get("runs", []) if isinstance(r.get("pipeline"), dict)]
    if not runs:
        return None
    comm = (summary.get("communication") or {}).get("runs") or {}
    table = Table(title="pipeline: the bubble (idle share of each rank's schedule span) and point-to-point bytes")
    for col in ("run", "schedule", "pp × v", "m", "bubble", "theory", "per rank", "p2p sent / step", "vs theory"):
        table.add_column(col, justify="left" if col in ("run", "schedule", "per rank") else "right")
    formulas = []
    for r in runs:
        p = r["pipeline"]
        c = comm.get(r["name"]) or {}
        sent = ((c.get("collectives") or {}).get("send") or {}).get("bytes_per_step")
        theory = ((c.get("theory") or {}).get("by_type") or {}).get("send")
        measured, expected = p.get("bubble_measured"), p.get("bubble_theory")
        table.add_row(cell(r["name"]), cell(p.get("schedule", "")), cell(f"{p.get('pp')} × {p.get('stages_per_rank')}"),
                      cell(p.get("microbatches", "")),
                      "not measured" if measured is None else f"{measured:.1%}",
                      "-" if expected is None else f"{expected:.1%}",
                      cell(" ".join(f"{float(v):.0%}" for v in (p.get("bubble_by_rank") or {}).values())),
                      fmt_bytes(sent) if _number(sent) else "not profiled",
                      fmt_num(sent / theory, ".3f") if _number(sent) and _number(theory) and theory else "-")
        formulas.append(f"{p.get('schedule')}: {p.get('bubble_formula')}")
    table.caption = cell("theory: " + "; ".join(dict.fromkeys(formulas)) + ". Measured: 1 − the rank's stage "
                         "compute / its schedule span (waits for inputs and the transfers themselves are idle)")
    return table


def loss_table(summary: dict[str, Any]) -> Table:
    """Return per-run loss statistics and differences from the baseline, from a summary dict."""
    base = summary.get("baseline", "")
    table = Table(title=cell(f"loss per run, and |difference| from {base} at common steps"))
    for col in ("run", "initial", "final", "min", "mean", "max |Δ|", "mean |Δ|", "final |Δ|"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for r in summary.get("runs", []):
        table.add_row(cell(r["name"]), *(fmt_num(r.get(k)) for k in ("initial_loss", "final_loss", "min_loss", "mean_loss")),
                      *(fmt_num(r.get(k), ".2e") for k in ("loss_max_abs_diff", "loss_mean_abs_diff",
                                                           "loss_final_abs_diff")))
    return table


def comparison_table(summary: dict[str, Any]) -> Table:
    """Return the final comparison table built from a summary dict."""
    base = summary.get("baseline", "")
    table = Table(title=cell(f"{summary.get('preset', '')}: comparison with baseline {base}"))
    runs = summary.get("runs", [])
    with_notes = any(r.get("fairness_flags") or r.get("error") for r in runs)
    peak, ratio = memory_headers(runs)
    for col in ("run", "strategy", "ranks", "status", "steps", "final loss", "max |Δloss|",
                f"median {throughput_unit(runs)}",
                "speedup", peak, ratio) + (("notes",) if with_notes else ()):
        table.add_column(col, justify="left" if col in ("run", "strategy", "status", "notes") else "right",
                         overflow="fold")
    for r in runs:
        rate = r.get("median_tokens_per_s") or r.get("median_samples_per_s")
        flags = "; ".join(map(str, r.get("fairness_flags") or []))
        if r.get("error"):
            flags = (flags + "; " if flags else "") + str(r["error"])[:80]
        status = str(r.get("status"))
        table.add_row(  # names, statuses and notes as the summary holds them: text
            cell(str(r["name"]) + (" (baseline)" if r["name"] == base else " (A/A control)" if r.get("control_of") else "")),
            cell(r.get("strategy", "")), cell(r.get("world_size", "")), cell(status, STATUS_STYLE.get(status, "")),
            cell(r.get("steps_completed", 0)), fmt_num(r.get("final_loss")),
            fmt_num(r.get("loss_max_abs_diff"), ".2e"), fmt_rate(rate),
            fmt_num(r.get("speedup"), ".2f") + ("x" if r.get("speedup") else ""),
            fmt_bytes(r.get("peak_mem_bytes") if _number(r.get("peak_mem_bytes")) else None),
            fmt_num(r.get("mem_ratio"), ".2f"),
            *((cell(flags),) if with_notes else ()),
        )
    return table


def rank_timing_table(summary: dict[str, Any]) -> Table | None:
    """Return the per-rank step timing table (ms, medians) of every run with timing, or None."""
    section = summary.get("stragglers") or {}
    if not any(e.get("per_rank") for e in section.values()):
        return None
    table = Table(title="per-rank step timing (median ms; busy = the rank's own CPU time; ⚠ straggler)")
    for col in ("run", *straggler_report.HEADER):
        table.add_column(col, justify="left" if col in ("run", "rank", "host", "device") else "right")
    for name, entry in section.items():
        for row in straggler_report.rows(entry):  # hosts and devices from the ranks' records: text
            table.add_row(cell(name), *map(cell, row))
    notes = [f"{name}: {e['reason']}" for name, e in section.items() if e.get("per_rank") and e.get("reason")]
    notes += [f"⚠ {f['line']}" for e in section.values() for f in (e.get("trace") or {}).get("flagged", [])]
    notes += [line for name, e in section.items() if (line := straggler_report.contention_line(name, e))]
    if notes:  # CUDA runs: the stream-time split, not judged live; stragglers judged from the traces
        table.caption = cell("\n".join(notes))
    return table
