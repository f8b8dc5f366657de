"""A comparison in progress: prepares shared weights, runs each run's torchrun job, publishes updates.

``Session`` is the one source of live state for both views (the headless printer and the
Textual app). All work happens on one background thread; subscribers receive batches of
``state.Update`` objects on that thread and must hand them to their own thread (the app posts
a message). Control calls (``stop_run``, ``restart_run``, ``stop_all``) are thread-safe requests
the background thread acts on at its next poll.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

from shardscope import config, outspace
from shardscope.config import Comparison, dump_json
from shardscope.orchestrator import launcher, lifeline, nodes, verdict
from shardscope.profiling import state
from shardscope.orchestrator.completion import Completion
from shardscope.orchestrator.device_log import DeviceLog
from shardscope.profiling.report import write_reports
from shardscope.profiling.root_cause import is_secondary, root_cause
from shardscope.profiling.state import RunState, Update
from shardscope.orchestrator.tail import ConsoleTailer, MetricsTailer
from shardscope.rundir import tail_text

Subscriber = Callable[[list[Update]], None]
_LIVE: "weakref.WeakSet[Session]" = weakref.WeakSet()  # sessions started in this process


def terminate_all(grace_s: float = 3.0) -> None:
    """Stop the torchrun jobs of every live session in this process now (for SIGTERM/SIGHUP handlers).

    Safe to call from a signal handler on the main thread: it signals and reaps processes itself
    instead of waiting for the session threads.
    """
    for session in list(_LIVE):
        session.stop_all()
        for active in list(session._active.values()):
            active.stop_reason = active.stop_reason or "stopped"
            active.proc.stop(grace_s)


def default_out_dir(preset_name: str, root: str = "shardscope-runs") -> str:
    """Return ``./shardscope-runs/<YYYYmmdd-HHMMSS>-<preset>`` (not created)."""
    return os.path.join(root, f"{time.strftime('%Y%m%d-%H%M%S')}-{preset_name}")


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


class Session(Completion):
    """Runs a comparison's runs as real torchrun jobs and publishes what happens."""

    def __init__(
        self,
        comparison: Comparison,
        out_dir: str,
        *,
        device: str = "cpu",
        sample_devices: bool = True,
        poll_interval_s: float = 0.2,
        python: str = sys.executable,
    ) -> None:
        self.comparison = comparison
        self.out_dir = os.path.abspath(out_dir)
        self.device = device
        self.sample_devices = sample_devices
        self.poll_interval_s = poll_interval_s
        self.python = python
        self.run_names = [r.name for r in comparison.runs]
        self.states: dict[str, RunState] = {}  # the session thread's own fold (for the summary)
        self.exit_code: int | None = None
        self.paths: dict[str, str] = {}
        self._subscribers: list[Subscriber] = []
        self._lock = threading.Lock()
        self._requests: collections.deque[tuple[str, str]] = collections.deque()
        self._queue: collections.deque[str] = collections.deque()
        self._active: dict[str, _Active] = {}
        self._attempts: dict[str, int] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._pending: list[Update] = []
        self._sampler: DeviceLog | None = None
        self._spare = outspace.Spare(self.out_dir)  # freed on a disk fault, so the summary fits
        launch = comparison.launch
        self._watch = nodes.NodeWatch(self.out_dir, launch.node_rank, launch.nnodes, launch.node_timeout_s)

    # ---- public API (any thread) -------------------------------------------------------------

    def subscribe(self, callback: Subscriber) -> None:
        """Call ``callback(updates)`` with every batch of updates from now on (on the session thread)."""
        with self._lock:
            self._subscribers.append(callback)

    def plans(self) -> list[launcher.LaunchPlan]:
        """Return the launch plan of every run (what ``--dry-run`` prints); writes nothing."""
        return [self._plan(run) for run in self.comparison.runs]

    def start(self) -> None:
        """Start the comparison on a background thread and return at once."""
        if self._thread is not None:
            raise RuntimeError("session already started")
        self._thread = threading.Thread(target=self._main, name="shardscope-session", daemon=True)
        _LIVE.add(self)
        self._thread.start()

    def stop_run(self, name: str) -> None:
        """Ask for one run to be stopped (status ``stopped``); a queued run is skipped."""
        self._requests.append(("stop", name))

    def restart_run(self, name: str) -> None:
        """Ask for a run to be run again from scratch (stopped first if active)."""
        self._requests.append(("restart", name))

    def stop_all(self) -> None:
        """Stop every run; queued runs are marked ``stopped``. The summary is still written."""
        self._requests.append(("stop_all", ""))

    # ---- the session thread ------------------------------------------------------------------

    def _emit(self, update: Update) -> None:
        self._pending.append(update)
        state.fold([update], self.states)
        owner = nodes.owns_verdict(self.comparison.launch.node_rank)
        if owner and isinstance(update, state.StatusChanged) and update.status in state.FINISHED:
            # The orchestrator's verdict goes on disk too, so reports rebuilt from files agree with it.
            run_dir = os.path.join(self.out_dir, update.run)
            try:
                os.makedirs(run_dir, exist_ok=True)
                dump_json(os.path.join(run_dir, "status.json"), {"status": update.status, "error": update.error,
                                                                 "traceback": update.traceback, "t": update.t})
            except OSError as err:  # a full disk: the live view and the summary still carry the verdict
                self._pending.append(state.Notice(f"{update.run}: status.json not written: {err}", "warning"))

    def _flush(self) -> None:
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        with self._lock:
            subscribers = list(self._subscribers)
        for callback in subscribers:
            try:
                callback(batch)
            except Exception as err:  # a broken view must not kill the runs; say so on stderr
                print(f"shardscope: subscriber failed: {err!r}", file=sys.stderr)

    def _main(self) -> None:
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            self._spare.reserve()
            if self.comparison.launch.node_rank == 0:
                lifeline.write_identity(self.out_dir)
            self._watch.start()
            for run in self.comparison.runs:
                self._define(run)
            self._queue.extend(self.run_names)
            self._flush()
            if self.comparison.launch.node_rank == 0:
                dump_json(os.path.join(self.out_dir, "comparison.json"), self.comparison.to_dict())
            if not self._write_init_weights():
                self._queue.clear()
            self._start_sampler()
            self._loop()
        except Exception as err:  # keep the contract: every run ends with a status, a summary is written
            import traceback

            disk = outspace.disk_error(err)
            message = outspace.describe(disk) if disk is not None else f"orchestrator error: {err!r}"
            if disk is not None:
                self._spare.release()
            self._emit(state.Notice(message, "error"))
            for name in self.run_names:
                if self.states[name].status not in state.FINISHED:
                    self._emit(state.StatusChanged(name, state.FAILED, message, traceback.format_exc()))
            for active in list(self._active.values()):
                active.proc.kill()
        finally:
            self._stop_sampler()
            self._watch.stop()
            self._finish()

    def _define(self, run: config.RunSpec) -> None:
        self._emit(state.RunDefined(
            run=run.name,
            strategy=run.strategy,
            world_size=config.resolved_world_size(self.comparison, run),
            steps_total=self.comparison.steps,
            precision=config.resolved_precision(self.comparison, run),
            options=config.resolved_options(run),
            run_dir=os.path.join(self.out_dir, run.name),
        ))

    def _write_init_weights(self) -> bool:
        """Materialise the shared initial weights once, in a torch subprocess (this process never imports torch)."""
        init_path = os.path.join(self.out_dir, "init.safetensors")
        if os.path.exists(init_path):
            return True
        if self.comparison.launch.node_rank > 0:
            return self._wait_for_file(init_path)
        self._emit(state.Notice("writing shared initial weights (init.safetensors)"))
        self._flush()
        log_path = os.path.join(self.out_dir, "init.log")
        with open(log_path, "wb") as log:
            proc = subprocess.run(
                [self.python, "-m", "shardscope.engines.init_weights",
                 os.path.join(self.out_dir, "comparison.json"), init_path],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        if proc.returncode == 0:
            return True
        text = tail_text(log_path, 20)
        message = f"writing initial weights failed (exit {proc.returncode}): {_last_line(text)}"
        self._emit(state.Notice(message, "error"))
        for name in self.run_names:
            self._emit(state.StatusChanged(name, state.FAILED, message, text))
        return False

    def _wait_for_file(self, path: str, timeout_s: float = 600.0) -> bool:
        """Other nodes of a multi-node comparison wait for node 0's shared weights (shared filesystem)."""
        self._emit(state.Notice(f"waiting for node 0 to write {path}"))
        self._flush()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if os.path.exists(path):
                return True
            time.sleep(1.0)
        for name in self.run_names:
            self._emit(state.StatusChanged(name, state.FAILED, f"node 0 never wrote {path}"))
        return False

    def _loop(self) -> None:
        max_active = len(self.run_names) if self.comparison.launch.concurrent else 1
        while True:
            self._handle_requests()
            self._check_nodes()
            while self._queue and len(self._active) < max_active and not self._stopping:
                self._launch(self._queue.popleft())
            if not self._active and (not self._queue or self._stopping):
                break
            for active in list(self._active.values()):
                self._poll(active)
            self._flush()
            time.sleep(self.poll_interval_s)
        for name in list(self._queue):
            self._emit(state.StatusChanged(name, state.STOPPED, "stopped before it started"))
        self._queue.clear()
        self._flush()

    def _check_nodes(self) -> None:
        """Node 0: a lost node fails the active runs (their ranks here are stopped) and every queued run."""
        lost = self._watch.lost()
        if not lost:
            return
        message = nodes.lost_message(lost, self._watch.timeout_s)
        for active in self._active.values():
            active.stop_reason = active.stop_reason or message
        while self._queue:
            self._emit(state.StatusChanged(self._queue.popleft(), state.FAILED, message))

    def _handle_requests(self) -> None:
        while self._requests:
            what, name = self._requests.popleft()
            if what == "stop_all":
                self._stopping = True
                for active in self._active.values():
                    active.stop_reason = active.stop_reason or "stopped"
            elif name not in self.run_names:
                self._emit(state.Notice(f"no run named {name!r}", "warning"))
            elif what == "stop":
                if name in self._active:
                    self._active[name].stop_reason = "stopped"
                elif name in self._queue:
                    self._queue.remove(name)
                    self._emit(state.StatusChanged(name, state.STOPPED, "stopped before it started"))
            elif what == "restart":
                if name in self._active:
                    self._active[name].stop_reason = "stopped"
                if name not in self._queue:
                    self._queue.append(name)
                    self._stopping = False

    def _plan(self, run: config.RunSpec) -> launcher.LaunchPlan:
        run_dir = os.path.join(self.out_dir, run.name)
        ws = config.resolved_world_size(self.comparison, run)
        launch = self.comparison.launch
        prefix = launch.rdzv_id or f"shardscope-{self.comparison.name}"
        argv = launcher.torchrun_argv(
            os.path.join(run_dir, "spec.json"),
            nproc_per_node=ws // launch.nnodes,
            nnodes=launch.nnodes,
            node_rank=launch.node_rank,
            rdzv_endpoint=launcher.endpoint_for_run(launch.rdzv_endpoint, self.run_names.index(run.name)),
            rdzv_id=f"{prefix}-{run.name}",
            python=self.python,
        )
        return launcher.LaunchPlan(run.name, argv, launcher.worker_env(self.device),
                                   os.path.join(run_dir, nodes.console_name(launch.node_rank)), os.getcwd())

    def _launch(self, name: str) -> None:
        run = self.comparison.run(name)
        run_dir = os.path.join(self.out_dir, name)
        attempt = self._attempts.get(name, 0)
        if attempt and os.path.isdir(run_dir):
            # A restart starts afresh; the earlier attempt's files are kept beside it.
            os.replace(run_dir, os.path.join(self.out_dir, f"{name}.attempt{attempt}"))
            self._define(run)
        self._attempts[name] = attempt + 1
        plan = self._plan(run)
        self._emit(state.StatusChanged(name, state.STARTING))
        self._emit(state.Notice(f"{name}: {plan.shell_line()}"))
        try:
            os.makedirs(os.path.join(run_dir, "metrics"), exist_ok=True)
            dump_json(os.path.join(run_dir, "spec.json"),
                      config.run_spec_payload(self.comparison, run, out_dir=self.out_dir, device=self.device))
            proc = launcher.start(plan)
        except OSError as err:
            disk = outspace.disk_error(err)
            if disk is None:
                raise
            self._halt_for_disk(name, verdict.Verdict(outspace.describe(disk), "", verdict.DISK))
            return
        self._active[name] = _Active(name, proc, MetricsTailer(os.path.join(run_dir, "metrics")),
                                     ConsoleTailer(plan.console_path), time.monotonic())

    def _poll(self, active: _Active) -> None:
        """Read what the run wrote, and settle it if it ended, stalled or was asked to stop."""
        self._read(active)
        code = active.proc.poll()
        if code is None:
            active.ranks = active.proc.refresh_descendants()
            stalled = time.monotonic() - active.last_progress > self._stall_limit(active)
            if stalled and not active.stop_reason:
                active.stop_reason = "stalled"
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
                elif r.get("kind") == "error":
                    active.errors.append(r)
                    active.error, active.traceback = root_cause(active.errors)
                    active.cause = verdict.cause_of(active.errors, active.error)
                elif r.get("kind") == "end":
                    active.ended.add(int(r.get("rank", -1)))
                    if r.get("rank") == 0:
                        active.saw_end = str(r.get("status", ""))
            self._emit(state.RecordsArrived(active.name, tuple(records), active.metrics.invalid_lines))
        text = active.console.poll()
        if text:
            self._emit(state.ConsoleText(active.name, text))

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
        limit = self._stall_limit(active)
        if active.stop_reason == "stopped":
            update = state.StatusChanged(active.name, state.STOPPED, "stopped by the user")
        elif active.stop_reason == "stalled":
            update = state.StatusChanged(
                active.name, state.FAILED, f"stalled: no progress for {limit:g} s ("
                f"{'stall_timeout_s' if active.started else 'launch.startup_timeout_s: no record since launch'})",
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
            if not active.error or is_secondary(active.error):  # peers' errors only: did a node vanish?
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
        return (verdict.from_kill(console, active.last_steps) or recorded  # a killed rank's peers only saw it go
                or verdict.from_output(os.path.join(self.out_dir, active.name), console)
                or verdict.Verdict(_last_line(console) or f"torchrun exited with code {code}", console))

    def _halt_for_disk(self, name: str, found: verdict.Verdict) -> None:
        """A full or unwritable output: fail the run, start no other (they would fail the same way)."""
        self._spare.release()
        self._emit(state.StatusChanged(name, state.FAILED, found.error, found.traceback))
        for queued in list(self._queue):
            self._emit(state.StatusChanged(queued, state.STOPPED, f"not started: {found.error}"))
        self._queue.clear()

    # ---- device sampling and the end ----------------------------------------------------------

    def _pids_by_run(self) -> dict[str, dict[int, int]]:
        return {a.name: {rank: pid for pid, rank in a.ranks.items()} for a in list(self._active.values())}

    def _start_sampler(self) -> None:
        if not self.sample_devices:
            return
        launch = self.comparison.launch
        self._sampler = DeviceLog(os.path.join(self.out_dir, nodes.devices_name(launch.node_rank)),
                                  nodes.node_label(launch.node_rank, launch.nnodes))

        def publish(sample: state.DeviceSample) -> None:
            with self._lock:
                subscribers = list(self._subscribers)
            for callback in subscribers:
                callback([sample])

        why = self._sampler.start(publish, self._pids_by_run)
        if why:
            self._emit(state.Notice(why, "warning"))

    def _stop_sampler(self) -> None:
        if self._sampler is not None:
            self._sampler.close()

    def _finish(self) -> None:
        statuses = [self.states[n].status for n in self.run_names]
        self.exit_code = 0 if statuses and all(s == state.OK for s in statuses) else 1
        summary_path = report_path = ""
        if self.comparison.launch.node_rank > 0:  # node 0 writes the reports
            self._emit(state.ComparisonFinished(self.out_dir, self.exit_code))
            self._flush()
            self._done.set()
            return
        self._spare.release()  # its room is for the summary
        try:
            self.paths = write_reports(self.out_dir, self.comparison, self.states)
            summary_path, report_path = self.paths.get("summary", ""), self.paths.get("report", "")
        except Exception as err:
            disk = outspace.disk_error(err)
            why = outspace.describe(disk) if disk is not None else repr(err)
            self._emit(state.Notice(f"writing the reports failed: {why}", "error"))
        self._emit(state.ComparisonFinished(self.out_dir, self.exit_code, summary_path, report_path))
        self._flush()
        self._done.set()


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""
