"""Run state and the updates the orchestrator publishes.

The orchestrator (or a replay of a run directory) publishes batches of ``Update`` objects to
subscribers: the session from its own thread, device samples from the sampler's thread, a replay
from its thread. Each view keeps its own ``RunState`` per run and folds updates into it with
``fold`` (``RunState.apply`` per update) — the same fold for the headless printer, the Textual app
and the report (``analysis/fold.py`` after the fact), so they can never disagree. Nothing here
imports torch or textual.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field
from typing import Any, Union

from shardscope.core import events
from shardscope.core.text import clean
from shardscope.core.numbers import median_rate
from shardscope.profiling.bubble import BubbleWatch
from shardscope.profiling.loss_fold import LossMean
from shardscope.profiling.stragglers import StragglerWatch

# The one set of run statuses. A finished run is ok, failed (an error, a stall, a lost process),
# stopped (by the user or before it started) or diverged (a non-finite loss or gradient norm).
QUEUED, STARTING, RUNNING = "queued", "starting", "running"
OK, FAILED, STOPPED, DIVERGED = "ok", "failed", "stopped", "diverged"
ACTIVE = (STARTING, RUNNING)
FINISHED = (OK, FAILED, STOPPED, DIVERGED)
STATUSES = (QUEUED, STARTING, RUNNING, *FINISHED)
# How each status is drawn (rich/textual style strings), the same in the app and the headless table.
STATUS_STYLE = {QUEUED: "dim", STARTING: "yellow", RUNNING: "bold cyan", OK: "bold green", FAILED: "bold red",
                STOPPED: "magenta", DIVERGED: "bold #ff8700"}


# --- updates -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunDefined:
    """A run exists (sent once per run, first): its static facts."""

    run: str
    strategy: str
    world_size: int
    steps_total: int
    precision: str
    options: dict[str, Any]
    run_dir: str


@dataclass(frozen=True)
class RecordsArrived:
    """New records read from the run's rank files (any ranks, file order within a rank)."""

    run: str
    records: tuple[dict[str, Any], ...]
    invalid_lines: int = 0  # running total of skipped invalid lines for this run


@dataclass(frozen=True)
class StatusChanged:
    """The run moved to a new status. ``error``/``traceback`` are set for failed runs."""

    run: str
    status: str
    error: str = ""
    traceback: str = ""
    t: float = field(default_factory=time.time)


@dataclass(frozen=True)
class ConsoleText:
    """Text appended to the run's console.log (stdout and stderr of torchrun)."""

    run: str
    text: str


@dataclass(frozen=True)
class DeviceReading:
    """One device (GPU via NVML) or one rank process (CPU fallback) at one moment."""

    label: str  # "GPU0 NVIDIA H100" or "ddp rank 1 (process RSS)"
    kind: str  # "gpu" | "process"
    used_bytes: int
    total_bytes: int | None = None
    util_pct: float | None = None
    power_w: float | None = None
    run: str = ""
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class DeviceSample:
    """A batch of device readings taken together."""

    readings: tuple[DeviceReading, ...]
    source: str  # "nvml" | "process-rss"
    t: float = field(default_factory=time.time)


@dataclass(frozen=True)
class ComparisonFinished:
    """All runs ended (or were stopped); reports were written."""

    out_dir: str
    exit_code: int
    summary_path: str = ""
    report_path: str = ""


@dataclass(frozen=True)
class Notice:
    """A human-readable message for the user (launch commands, warnings, report progress)."""

    text: str
    level: str = "info"  # info | warning | error


Update = Union[RunDefined, RecordsArrived, StatusChanged, ConsoleText, DeviceSample, ComparisonFinished, Notice]


# --- the fold ----------------------------------------------------------------------------------


@dataclass
class RunState:
    """Everything a view knows about one run, folded from updates."""

    name: str
    strategy: str = ""
    world_size: int = 0
    steps_total: int = 0
    precision: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    run_dir: str = ""
    status: str = QUEUED
    step: int = -1  # last step reported by rank 0
    steps_completed: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    peak_mem_bytes: int | None = None  # max over ranks of mem_peak_bytes (allocator or RSS)
    losses: list[tuple[int, float]] = field(default_factory=list)
    throughput: list[tuple[int, float]] = field(default_factory=list)  # (step, tokens/s or samples/s)
    profiled_steps: set[int] = field(default_factory=set)  # steps inside the profiler's window (they run slower)
    step_times: list[tuple[int, float]] = field(default_factory=list)
    memory: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> latest memory record
    start: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> start record
    traces: list[dict[str, Any]] = field(default_factory=list)
    comm: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> latest comm record
    error: str = ""
    traceback: str = ""
    invalid_lines: int = 0
    unfoldable: int = 0  # records whose figures were not of their type (left out of the state)
    unfoldable_why: str = ""
    tokens_per_step: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    first_step_t: float | None = None
    last_step_t: float | None = None
    first_nonfinite_step: int | None = None  # first step whose loss or grad norm was inf/nan (not an fp16 skip)
    nonfinite_what: str = ""  # "loss", "grad_norm" or "loss and grad_norm" at that step
    stragglers: StragglerWatch = field(default_factory=StragglerWatch)  # per-rank step timings, flagged ranks
    loss_mean: LossMean = field(default_factory=LossMean)  # ranks' local losses -> the run's loss per step
    bubble: BubbleWatch = field(default_factory=BubbleWatch)  # pipeline runs: each rank's bubble per step
    # ``median``'s cache: the throughput list it read, how many of its points it has taken in, their rates after
    # step 0, sorted
    _sorted: tuple[Any, int, list[float]] = field(default_factory=lambda: (None, 0, []), repr=False, compare=False)

    # -- queries --
    @property
    def unit(self) -> str:
        """'samples/s' for image models, else 'tokens/s'."""
        return "samples/s" if self.samples_per_s is not None and self.tokens_per_s is None else "tokens/s"

    @property
    def divergence(self) -> str:
        """One line saying where the run went non-finite ("" when it did not)."""
        if self.first_nonfinite_step is None:
            return ""
        return f"non-finite {self.nonfinite_what} at step {self.first_nonfinite_step}"

    @property
    def rate(self) -> float | None:
        """The last step's throughput in ``unit``."""
        return self.tokens_per_s if self.tokens_per_s is not None else self.samples_per_s

    @property
    def median(self) -> float | None:
        """The median throughput so far, as the summary computes it (``numbers.median_rate``: step 0 and
        profiled steps left out); what every live view shows, labelled "median".

        The live views ask for it at every redraw (4 a second, for every run on screen): sorting every step's rate
        each time took 2.8 ms a run at 20,000 steps and 29 ms at 100,000 (RESULTS.md), on the orchestrator's
        thread, on the cores the ranks train on. The rates of the steps after 0 are kept sorted (``_sorted``); a call
        merges in only the points appended since, into a new list (one pass: two sorted runs), so a reader on
        another thread never sees it half done."""
        points = self.throughput
        seen, upto, rates = self._sorted
        end = len(points)
        if seen is not points or upto > end:  # another list than the one taken in: start again
            upto, rates = 0, []
        fresh = [rate for step, rate in points[upto:end] if step > 0]
        if fresh:
            rates = sorted(rates + fresh)
        self._sorted = (points, end, rates)
        if not rates:  # no step after 0 timed yet: step 0's rate alone, as the summary says it
            return median_rate(points[:end])
        mid = len(rates) // 2
        return rates[mid] if len(rates) % 2 else (rates[mid - 1] + rates[mid]) / 2

    @property
    def progress(self) -> float:
        """Fraction of steps completed, 0..1."""
        return min(1.0, self.steps_completed / self.steps_total) if self.steps_total else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the mean step time so far, or None before two steps."""
        if self.first_step_t is None or self.last_step_t is None or self.steps_completed < 2:
            return None
        per_step = (self.last_step_t - self.first_step_t) / (self.steps_completed - 1)
        return max(0.0, per_step * (self.steps_total - self.steps_completed))

    # -- the fold --
    def apply(self, update: Update) -> bool:
        """Fold one update addressed to this run into the state; return True if anything changed."""
        if isinstance(update, RunDefined):
            self.strategy, self.world_size = update.strategy, update.world_size
            self.steps_total, self.precision = update.steps_total, update.precision
            self.options, self.run_dir = dict(update.options), update.run_dir
            return True
        if isinstance(update, StatusChanged):
            self.status = update.status
            if update.status == STARTING:
                self.started_at, self.ended_at = update.t, None
            if update.status in FINISHED:
                self.ended_at = update.t
            if update.error:
                self.error = clean(update.error)
            if update.traceback:
                self.traceback = clean(update.traceback)
            return True
        if isinstance(update, RecordsArrived):
            self.invalid_lines = update.invalid_lines
            for record in update.records:
                self.apply_record(record)
            return bool(update.records)
        return False

    def _add_loss(self, step: int, loss: float) -> None:
        """Record a step's loss (the mean over ranks), keeping ``losses`` in step order."""
        if self.losses and step < self.losses[-1][0]:  # a rare out-of-order completion
            bisect.insort(self.losses, (step, loss))
        else:
            self.losses.append((step, loss))
            self.loss = loss
        if not math.isfinite(loss):
            self._mark_nonfinite(step, "loss")

    def _mark_nonfinite(self, step: int, what: str) -> None:
        """Keep the earliest step with a non-finite loss or norm (both named when at the same step)."""
        if not what:
            return
        if self.first_nonfinite_step is None or step < self.first_nonfinite_step:
            self.first_nonfinite_step, self.nonfinite_what = step, what
        elif step == self.first_nonfinite_step and what not in self.nonfinite_what:
            both = {*self.nonfinite_what.split(" and "), *what.split(" and ")}
            self.nonfinite_what = " and ".join(k for k in ("loss", "grad_norm") if k in both)

    def apply_record(self, r: dict[str, Any]) -> None:
        """Fold one metric record (see ``events``) into the state. A record whose figures are not of their type (a
        string where a number belongs: a damaged or crafted file) is counted in ``unfoldable`` (the error in
        ``unfoldable_why``) and left out of what it did not reach, never an exception for the reader."""
        try:
            self._apply_record(r)
        except (TypeError, ValueError, OverflowError, AttributeError, KeyError) as err:
            self.unfoldable += 1
            self.unfoldable_why = str(err)[:200]

    def _apply_record(self, r: dict[str, Any]) -> None:
        kind, rank = r.get("kind"), int(r.get("rank", 0))
        if kind == events.STEP:
            peak = r.get("mem_peak_bytes")
            if isinstance(peak, (int, float)):
                self.peak_mem_bytes = max(self.peak_mem_bytes or 0, int(peak))
            self.stragglers.add(rank, int(r.get("step", 0)), r, self.world_size)
            self.bubble.add(rank, int(r.get("step", 0)), r)
            loss = self.loss_mean.add(rank, int(r.get("step", 0)), r, self.world_size)
            if loss is not None:
                self._add_loss(int(r.get("step", 0)), loss)
            if rank != 0:
                return
            step = int(r.get("step", self.step + 1))
            self.step = step
            self.steps_completed = step + 1
            self.grad_norm = r.get("grad_norm", self.grad_norm)
            self.lr = r.get("lr", self.lr)
            if "tokens_per_s" in r:
                self.tokens_per_s = r["tokens_per_s"]
            if "samples_per_s" in r:
                self.samples_per_s = r["samples_per_s"]
            # The norm is global: rank 0's says it (the loss's verdict comes with the mean, in _add_loss).
            self._mark_nonfinite(step, events.nonfinite_fields({"grad_norm": r.get("grad_norm"),
                                                                "skipped": r.get("skipped")}))
            if r.get("profiled"):
                self.profiled_steps.add(step)
            elif self.rate is not None:  # profiled steps run slower: keep them out
                self.throughput.append((step, float(self.rate)))
            if "tokens" in r:
                self.tokens_per_step = r["tokens"]
            if "step_time_s" in r:
                self.step_times.append((step, float(r["step_time_s"])))
            t = float(r.get("t", time.time()))
            if self.first_step_t is None:
                self.first_step_t = t
            self.last_step_t = t
            if self.status in (QUEUED, STARTING):
                self.status = RUNNING
        elif kind == events.MEMORY:
            self.memory[rank] = r
            peak = r.get("mem_peak_bytes")
            if isinstance(peak, (int, float)):
                self.peak_mem_bytes = max(self.peak_mem_bytes or 0, int(peak))
        elif kind == events.START:
            self.start[rank] = r
            self.stragglers.configure(r.get("straggler"))
            if self.status in (QUEUED, STARTING):
                self.status = RUNNING
        elif kind == events.TRACE:
            self.traces.append(r)
        elif kind == events.COMM:
            self.comm[rank] = r
        elif kind == events.ERROR and not self.error:
            self.error = clean(str(r.get("message", "error")))  # a record's text: no terminal control gets through
            self.traceback = clean(str(r.get("traceback", "")))


def fold(updates: list[Update], states: dict[str, RunState]) -> set[str]:
    """Fold a batch of updates into ``states`` (creating runs on RunDefined); return changed run names."""
    changed: set[str] = set()
    for update in updates:
        name = getattr(update, "run", None)
        if name is None:
            continue
        state = states.get(name)
        if state is None or isinstance(update, RunDefined):  # RunDefined starts a run afresh (restart)
            state = states[name] = RunState(name=name)
        if state.apply(update):
            changed.add(name)
    return changed
