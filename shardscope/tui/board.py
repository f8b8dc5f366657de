"""What the app knows about a comparison, folded from the source's updates.

The UI thread owns one ``Board``: it folds every batch with ``state.fold`` and remembers which
parts of the screen are now stale, so a timer can redraw only those, at a bounded rate.
Nothing here imports textual.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from shardscope.profiling import state as st
from shardscope.orchestrator.device_history import DeviceHistory

CONSOLE_LINES = 2000  # console lines kept per run (older ones are dropped from view, never from disk)
# What folding a record of the wrong shape raises (a string where a number belongs, a list for an object).
FOLD_ERRORS = (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError)


def _text(value: Any) -> str:
    """An error or traceback as text, whatever a file held there ("" for nothing)."""
    return value if isinstance(value, str) else "" if value is None else str(value)


def _sound_reading(r: Any) -> bool:
    """True for a device reading whose fields have their types (text, numbers, integer ranks)."""
    def num(x: Any, optional: bool = True) -> bool:
        return (optional and x is None) or (isinstance(x, (int, float)) and not isinstance(x, bool))

    return (isinstance(r, st.DeviceReading) and all(isinstance(x, str) for x in (r.label, r.kind, r.run))
            and num(r.used_bytes, False) and num(r.total_bytes) and num(r.util_pct) and num(r.power_w)
            and isinstance(r.ranks, tuple) and all(type(x) is int for x in r.ranks))


@dataclass
class Console:
    """The tail of one run's console, as whole lines plus the unterminated last piece."""

    lines: deque[str] = field(default_factory=lambda: deque(maxlen=CONSOLE_LINES))
    partial: str = ""
    total: int = 0  # lines ever added, so a view can tell which ones it has not shown yet

    def add(self, text: str) -> None:
        """Append console text, splitting it into lines."""
        pieces = (self.partial + text).split("\n")
        self.partial = pieces.pop()
        self.lines.extend(pieces)
        self.total += len(pieces)

    def since(self, seen: int) -> list[str]:
        """Return the lines added after the first ``seen`` ones (as many as are still kept)."""
        new = self.total - seen
        if new <= 0:
            return []
        return list(self.lines)[-min(new, len(self.lines)):]


@dataclass
class Board:
    """Run states, console tails, device readings and notices of one comparison."""

    states: dict[str, st.RunState] = field(default_factory=dict)
    consoles: dict[str, Console] = field(default_factory=dict)
    devices: st.DeviceSample | None = None
    device_history: DeviceHistory = field(default_factory=DeviceHistory)  # last reading and peak per device
    finished: st.ComparisonFinished | None = None
    notices: list[st.Notice] = field(default_factory=list)
    baseline: str = ""
    records: int = 0  # records folded so far (the benchmark checks none are dropped)
    analyses: dict[str, dict] = field(default_factory=dict)  # run -> profiling.traces.analyse_run result
    to_analyse: set[str] = field(default_factory=set)  # runs whose traces may have changed
    analysis_seq: dict[str, int] = field(default_factory=dict)  # run -> sequence of the newest analysis asked for
    analysis_applied: dict[str, int] = field(default_factory=dict)  # run -> sequence of the newest one applied
    # What changed since the last redraw.
    dirty_runs: set[str] = field(default_factory=set)
    dirty_consoles: set[str] = field(default_factory=set)
    dirty_devices: bool = False
    dirty_charts: bool = False
    dirty_comm: bool = False
    new_notices: list[st.Notice] = field(default_factory=list)
    # Write times of records not yet on screen (only when a benchmark asks for them).
    track_latency: bool = False
    pending_t: list[float] = field(default_factory=list)
    _said_devices: bool = False  # a device reading of the wrong shape was said once

    @property
    def names(self) -> list[str]:
        """Run names in the order they were defined."""
        return list(self.states)

    def ingest(self, updates: list[st.Update]) -> None:
        """Fold one batch of updates and mark what must be redrawn.

        A run starting again after it had steps (a restart) begins with a fresh history, so its
        charts do not mix two attempts; its console keeps both, with a marker between them.
        """
        segment: list[st.Update] = []
        for update in updates:
            if isinstance(update, st.StatusChanged) and update.status == st.STARTING:
                old = self.states.get(update.run)
                if old is not None and old.steps_completed:
                    self.dirty_runs |= self._fold(segment)
                    segment = []
                    self.states[update.run] = st.RunState(
                        name=old.name, strategy=old.strategy, world_size=old.world_size, steps_total=old.steps_total,
                        precision=old.precision, options=old.options, run_dir=old.run_dir)
                    self.console(update.run).add("\n── restarted ──\n")
                    self.dirty_charts = True
            segment.append(update)
        self.dirty_runs |= self._fold(segment)
        for update in updates:
            if isinstance(update, st.RecordsArrived):
                self.records += len(update.records)
                self.dirty_charts = True
                kinds = {r.get("kind") for r in update.records}
                if "trace" in kinds:
                    self.to_analyse.add(update.run)
                if "comm" in kinds:
                    self.dirty_comm = True
                if self.track_latency:
                    self.pending_t.extend(float(r.get("t", 0.0)) for r in update.records)
            elif isinstance(update, st.ConsoleText):
                self.consoles.setdefault(update.run, Console()).add(update.text)
                self.dirty_consoles.add(update.run)
            elif isinstance(update, st.DeviceSample):
                update = self._sound_sample(update)
                self.devices = update
                self.device_history.add(update)
                self.dirty_devices = True
            elif isinstance(update, st.ComparisonFinished):
                self.finished = update
                self.dirty_runs |= set(self.states)
            elif isinstance(update, st.Notice):
                self.notices.append(update)
                self.new_notices.append(update)
            elif isinstance(update, st.StatusChanged):
                self.dirty_consoles.add(update.run)  # a failure shows its traceback in the log
                if update.status in st.FINISHED:
                    self.to_analyse.add(update.run)
        if not self.baseline and self.states:
            self.baseline = next(iter(self.states))

    def _fold(self, updates: list[st.Update]) -> set[str]:
        """``state.fold``, one record at a time: a record that cannot be folded (a crafted or damaged file's
        ``"tokens_per_s": "fast"``) is left out and said in a notice, never raised into the app."""
        changed: set[str] = set()
        for update in updates:
            if isinstance(update, st.StatusChanged):  # a replay's status can come from a summary.json of any shape
                if update.status not in st.STATUSES:
                    self._unreadable(update.run, 1, ValueError(f"status {str(update.status)[:40]!r}"))
                    continue
                if not isinstance(update.error, str) or not isinstance(update.traceback, str):
                    update = replace(update, error=_text(update.error), traceback=_text(update.traceback))
            if not isinstance(update, st.RecordsArrived):
                try:
                    changed |= st.fold([update], self.states)
                except FOLD_ERRORS as err:
                    self._unreadable(getattr(update, "run", "?"), 1, err)
                continue
            state = self.states.setdefault(update.run, st.RunState(name=update.run))
            if update.invalid_lines and not state.invalid_lines:  # said once a run: its files hold what is no record
                self._say(f"{update.run}: {update.invalid_lines} line(s) of its record files unreadable, skipped "
                          "(not a record: damaged, cut or of the wrong shape)")
            state.invalid_lines = update.invalid_lines
            bad, first, before = 0, None, state.unfoldable
            for record in update.records:
                try:
                    state.apply_record(record)
                except FOLD_ERRORS as err:
                    bad, first = bad + 1, first or err
            if state.unfoldable > before:  # the fold left them out itself (a figure of the wrong type)
                bad, first = bad + state.unfoldable - before, first or ValueError(state.unfoldable_why)
            if first is not None:
                self._unreadable(update.run, bad, first)
            if update.records:
                changed.add(update.run)
        return changed

    def _sound_sample(self, sample: st.DeviceSample) -> st.DeviceSample:
        """``sample`` without the readings of the wrong shape (a replay reads them from devices.jsonl), said once."""
        readings = tuple(r for r in sample.readings if _sound_reading(r))
        if len(readings) == len(sample.readings):
            return sample
        if not self._said_devices:
            self._said_devices = True
            self._unreadable("devices", len(sample.readings) - len(readings), ValueError("readings of the wrong shape"))
        return replace(sample, readings=readings)

    def _unreadable(self, run: Any, count: int, err: Exception) -> None:
        self._say(f"{run}: {count} record(s) unreadable, left out: {type(err).__name__}: {err}")

    def _say(self, text: str, level: str = "warning") -> None:
        notice = st.Notice(text, level)
        self.notices.append(notice)
        self.new_notices.append(notice)

    def console(self, run: str) -> Console:
        """Return the console tail of ``run`` (empty if none arrived yet)."""
        return self.consoles.setdefault(run, Console())

    @property
    def active(self) -> list[str]:
        """Names of runs that are starting or running."""
        return [n for n, s in self.states.items() if s.status in st.ACTIVE]

    def take_latency(self, now: float | None = None) -> list[float]:
        """Return write-to-display delays (s) of records shown by this redraw, and forget them."""
        now = time.time() if now is None else now
        out = [now - t for t in self.pending_t]
        self.pending_t = []
        return out
