"""Run supervision: one live torchrun job followed to its verdict.

``RunSupervision`` is the part of ``Session`` that reads what an active run wrote, notices that it
ended, stalled or was asked to stop, and settles it with one status (the error record's root cause,
a kill, a full disk, a lost node, or the console's last line). It runs on the session thread.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from shardscope.orchestrator import launcher, nodes, stall_verdict, verdict
from shardscope.orchestrator.tail import ConsoleTailer, MetricsTailer
from shardscope.profiling import state
from shardscope.analysis.root_cause import is_secondary, root_cause
from shardscope.core.rundir import tail_text


@dataclass
class _Active:
    """A run whose torchrun job is alive (or just ended and is being settled)."""

    name: str
    proc: launcher.RunProcess
    metrics: MetricsTailer
    console: ConsoleTailer
    last_progress: float
    stop_reason: str = ""  # "" | "stopped" | "stalled"
    started: bool = False  # a first record arrived: from then on stall_timeout_s applies
    saw_end: str = ""  # status of an `end` record from rank 0, if any
    error: str = ""
    traceback: str = ""
    cause: str = ""  # the root-cause error record's cause: oom | disk | error
    last_steps: dict[int, int] = field(default_factory=dict)  # rank -> last step recorded
    ranks: dict[int, int] = field(default_factory=dict)  # pid -> global rank
    errors: list[dict] = field(default_factory=list)  # every rank's error records (root_cause picks one)
    ended: set[int] = field(default_factory=set)  # ranks whose `end` record arrived
    finished: set[int] = field(default_factory=set)  # ranks whose `end` record says ok or diverged
    stalls: dict[int, dict] = field(default_factory=dict)  # rank -> its `stall` record (where it was)
    stalled_after: float = 0.0  # the limit in force when it was found stalled (the answers then start it)
    stalled_before_start: bool = False  # found stalled before any record: launch.startup_timeout_s applied
    step_clock: list[tuple[int, float]] = field(default_factory=list)  # rank 0's first and latest (step, t)

    def seconds_left(self, last_step: int) -> float | None:
        """Rank 0's time to its last step at its pace so far (None before two of its steps arrived)."""
        if len(self.step_clock) < 2 or self.step_clock[-1][0] <= self.step_clock[0][0]:
            return None
        (s0, t0), (s1, t1) = self.step_clock[0], self.step_clock[-1]
        return (last_step - s1) * (t1 - t0) / (s1 - s0)


STALL_ANSWER_S = 10.0  # how long a stalled run's ranks get to say where they are before it is stopped


class RunSupervision:
    """Mixin of ``Session``: polls active runs and settles their verdicts (uses the session's state)."""

    def _poll(self, active: _Active) -> None:
        """Read what the run wrote, and settle it if it ended, stalled or was asked to stop."""
        self._read(active)
        code = active.proc.poll()
        if code is None:
            world, nnodes = self.states[active.name].world_size, self.comparison.launch.nnodes
            active.ranks = active.proc.rank_processes(world // nnodes if world > 0 else 1 << 30)
            stalled = time.monotonic() - active.last_progress > self._stall_limit(active)
            if stalled and not active.stop_reason:
                active.stop_reason = "stalled"
                active.stalled_after, active.stalled_before_start = self._stall_limit(active), not active.started
                self._ask_where(active)
            if not active.stop_reason:
                return
            active.proc.stop(self.comparison.launch.grace_period_s)
        else:
            active.proc.kill()  # torchrun ended: make sure no rank outlived it
        self._read(active)
        if code != 0 and self.comparison.launch.nnodes > 1:
            self._await_other_nodes(active)
        self._settle(active, active.proc.poll())

    def _read(self, active: _Active) -> None:
        records = active.metrics.poll()
        if records:
            active.last_progress = time.monotonic()
            active.started = True
            for r in records:
                if r.get("kind") == "step":
                    active.last_steps[int(r.get("rank", 0))] = int(r.get("step", 0))
                    if r.get("rank") == 0 and isinstance(r.get("t"), (int, float)):
                        point = (int(r.get("step", 0)), float(r["t"]))
                        active.step_clock = [active.step_clock[0] if active.step_clock else point, point]
                elif r.get("kind") == "error":
                    active.errors.append(r)
                    active.error, active.traceback = root_cause(active.errors)
                    active.cause = verdict.cause_of(active.errors, active.error)
                elif r.get("kind") == "stall":
                    active.stalls[int(r.get("rank", -1))] = r
                elif r.get("kind") == "end":
                    active.ended.add(int(r.get("rank", -1)))
                    if r.get("status") in (state.OK, state.DIVERGED):
                        active.finished.add(int(r.get("rank", -1)))
                    if r.get("rank") == 0:
                        active.saw_end = str(r.get("status", ""))
            self._emit(state.RecordsArrived(active.name, tuple(records), active.metrics.invalid_lines))
        text = active.console.poll()
        if text:
            self._emit(state.ConsoleText(active.name, text))

    def _tearing_down(self, active: _Active) -> bool:
        """True when every rank of a one-node run wrote a clean ``end`` (no error, no stop asked): what is
        left is teardown (process group, exit), which the next run's start-up may overlap."""
        world = self.states[active.name].world_size
        return (self.comparison.launch.nnodes == 1 and not active.stop_reason and not active.errors
                and world > 0 and len(active.finished) >= world)

    def _silent_ranks(self, active: _Active) -> list[int]:
        """This node's ranks that wrote neither an ``end`` nor an ``error`` record. When no rank reported, those
        that trained (torchrun may kill a peer before it records the broken connection); none when the run never
        trained, and its console says why."""
        world = self.states[active.name].world_size
        launch = self.comparison.launch
        per_node = max(1, world // max(1, launch.nnodes))
        mine = range(launch.node_rank * per_node, (launch.node_rank + 1) * per_node)
        reported = active.ended | {int(e.get("rank", -1)) for e in active.errors}
        if not reported:
            return [r for r in mine if r in active.last_steps]
        return [r for r in mine if r not in reported]

    def _ask_where(self, active: _Active, wait_s: float = STALL_ANSWER_S) -> None:
        """Before a stalled run is stopped, ask its ranks where they are (``stall-request``); wait up to
        ``wait_s`` for a ``stall`` record from every rank that started and did not end."""
        try:
            with open(self.rundir.run(active.name).stall_request, "w", encoding="utf-8"):
                pass
        except OSError:
            return
        started = set(self.states[active.name].start) - active.ended
        deadline = time.monotonic() + wait_s
        while not started <= set(active.stalls) and time.monotonic() < deadline and active.proc.poll() is None:
            time.sleep(0.2)
            self._read(active)
            started = set(self.states[active.name].start) - active.ended

    def _await_other_nodes(self, active: _Active, timeout_s: float = 5.0) -> None:
        """Give other nodes' ranks a moment to land their end records, so the root cause can be theirs."""
        world = self.states[active.name].world_size
        deadline = time.monotonic() + timeout_s
        while len(active.ended) < world and time.monotonic() < deadline:
            time.sleep(0.2)
            self._read(active)

    def _stall_limit(self, active: _Active) -> float:
        """Seconds without a new record before a run counts as stalled (startup gets longer)."""
        if active.started:
            return self.comparison.stall_timeout_s
        return max(self.comparison.stall_timeout_s, self.comparison.launch.startup_timeout_s)

    def _settle(self, active: _Active, code: int | None) -> None:
        del self._active[active.name]
        files = self.rundir.run(active.name)
        # a killed rank could free neither its spare nor a trace torch's handler was half-way through writing
        for leftover in files.rank_spares() + files.trace_partials():
            try:
                os.remove(leftover)
            except OSError:
                pass
        limit = active.stalled_after or self._stall_limit(active)
        if active.stop_reason == "stopped":
            update = state.StatusChanged(active.name, state.STOPPED, "stopped by the user")
        elif active.stop_reason == "stalled" and active.stalls:  # the ranks said where they were
            line, stacks = stall_verdict.describe(active.stalls, limit, self.states[active.name].world_size)
            update = state.StatusChanged(active.name, state.FAILED, line, stacks)
        elif active.stop_reason == "stalled":
            update = state.StatusChanged(
                active.name, state.FAILED, f"stalled: no progress for {limit:g} s ("
                f"{'launch.startup_timeout_s: no record since launch' if active.stalled_before_start else 'stall_timeout_s'})",
                active.traceback or tail_text(active.proc.plan.console_path, 30))
        elif active.stop_reason:  # a lost node
            update = state.StatusChanged(active.name, state.FAILED, active.stop_reason, active.traceback)
        elif active.saw_end == state.DIVERGED:  # every rank ended at the same non-finite step
            update = state.StatusChanged(active.name, state.DIVERGED, self.states[active.name].divergence)
        elif code == 0 and active.saw_end in ("ok", ""):
            update = state.StatusChanged(active.name, state.OK)
        else:
            found = self._failure(active, code)
            if found.cause == verdict.DISK:
                self._halt_for_disk(active.name, found)
                return
            error = found.error
            if found.cause != verdict.RENDEZVOUS and (not active.error or is_secondary(active.error)):
                # peers' errors only: did a node vanish?
                lost = self._watch.judge()
                reported = active.ended | {int(e.get("rank", -1)) for e in active.errors}
                error = ((lost and nodes.lost_message(lost, self._watch.timeout_s))
                         or nodes.silent_verdict(reported, self.states[active.name].world_size, self.comparison.launch)
                         or error)
            update = state.StatusChanged(active.name, state.FAILED, error, found.traceback)
        self._emit(update)

    def _failure(self, active: _Active, code: int | None) -> verdict.Verdict:
        """Why a run failed: its error record, else a kill (OOM or not) or the output disk, else the console."""
        recorded = verdict.Verdict(active.error, active.traceback, active.cause or verdict.ERROR) if active.error else None
        if recorded is not None and recorded.cause != verdict.ERROR:
            return recorded
        console = tail_text(active.proc.plan.console_path, 60)
        if recorded is None or is_secondary(recorded.error):  # peers' broken connections: who left first?
            exited = verdict.from_kill(console, active.last_steps) or verdict.from_exit(
                console, self._silent_ranks(active), active.last_steps)
            if exited is not None:
                return exited
        return (verdict.from_kill(console, active.last_steps) or recorded  # a killed rank's peers only saw it go
                or verdict.from_output(self.rundir.run(active.name).path, console)
                or verdict.from_rendezvous(console, self.comparison.launch.nnodes)
                or verdict.Verdict(last_line(console) or f"torchrun exited with code {code}", console))

    def _halt_for_disk(self, name: str, found: verdict.Verdict) -> None:
        """A full or unwritable output: fail the run, start no other (they would fail the same way)."""
        self._spare.release()
        self._emit(state.StatusChanged(name, state.FAILED, found.error, found.traceback))
        for queued in list(self._queue):
            self._emit(state.StatusChanged(queued, state.STOPPED, f"not started: {found.error}"))
        self._queue.clear()


def last_line(text: str) -> str:
    """The last non-blank line of ``text`` ("" when there is none)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""
