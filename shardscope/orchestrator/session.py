"""A comparison in progress: prepares shared weights, runs each run's torchrun job, publishes updates.

``Session`` is the one source of live state for both views (the headless printer and the
Textual app). All work happens on one background thread; subscribers receive batches of
``state.Update`` objects on that thread and must hand them to their own thread (the app posts
a message). Control calls (``stop_run``, ``restart_run``, ``stop_all``) are thread-safe requests
the background thread acts on at its next poll.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

from shardscope import config
from shardscope.config import Comparison, dump_json
from shardscope.orchestrator import launcher, state
from shardscope.orchestrator.state import RunState, Update
from shardscope.orchestrator.tail import ConsoleTailer, MetricsTailer, tail_text

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
    ranks: dict[int, int] = field(default_factory=dict)  # pid -> local rank


class Completion:
    """The end of a source's work: ``wait`` and ``finished`` (shared by Session and ReplaySource)."""

    exit_code: int | None
    _done: threading.Event

    def wait(self, timeout: float | None = None) -> int | None:
        """Block until the work ends (or ``timeout``); return the exit code, or None if not ended."""
        self._done.wait(timeout)
        return self.exit_code if self._done.is_set() else None

    @property
    def finished(self) -> bool:
        """True once everything ended (a session: every run ended and the reports were written)."""
        return self._done.is_set()


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
        self._sampler = None
        self._device_log = None

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
        if isinstance(update, state.StatusChanged) and update.status in state.FINISHED:
            # The orchestrator's verdict goes on disk too, so reports rebuilt from files agree with it.
            run_dir = os.path.join(self.out_dir, update.run)
            os.makedirs(run_dir, exist_ok=True)
            dump_json(os.path.join(run_dir, "status.json"),
                      {"status": update.status, "error": update.error, "traceback": update.traceback, "t": update.t})

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

            self._emit(state.Notice(f"orchestrator error: {err!r}", "error"))
            for name in self.run_names:
                if self.states[name].status not in state.FINISHED:
                    self._emit(state.StatusChanged(name, state.FAILED, f"orchestrator error: {err!r}",
                                                   traceback.format_exc()))
            for active in list(self._active.values()):
                active.proc.kill()
        finally:
            self._stop_sampler()
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
        argv = launcher.torchrun_argv(
            os.path.join(run_dir, "spec.json"),
            nproc_per_node=ws // launch.nnodes,
            nnodes=launch.nnodes,
            node_rank=launch.node_rank,
            rdzv_endpoint=launch.rdzv_endpoint,
            rdzv_id=f"shardscope-{self.comparison.name}-{run.name}",
            python=self.python,
        )
        return launcher.LaunchPlan(run.name, argv, launcher.worker_env(self.device),
                                   os.path.join(run_dir, "console.log"), os.getcwd())

    def _launch(self, name: str) -> None:
        run = self.comparison.run(name)
        run_dir = os.path.join(self.out_dir, name)
        attempt = self._attempts.get(name, 0)
        if attempt and os.path.isdir(run_dir):
            # A restart starts afresh; the earlier attempt's files are kept beside it.
            os.replace(run_dir, os.path.join(self.out_dir, f"{name}.attempt{attempt}"))
            self._define(run)
        self._attempts[name] = attempt + 1
        os.makedirs(os.path.join(run_dir, "metrics"), exist_ok=True)
        dump_json(os.path.join(run_dir, "spec.json"),
                  config.run_spec_payload(self.comparison, run, out_dir=self.out_dir, device=self.device))
        plan = self._plan(run)
        self._emit(state.StatusChanged(name, state.STARTING))
        self._emit(state.Notice(f"{name}: {plan.shell_line()}"))
        proc = launcher.start(plan)
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
        self._settle(active, active.proc.poll())

    def _read(self, active: _Active) -> None:
        records = active.metrics.poll()
        if records:
            active.last_progress = time.monotonic()
            active.started = True
            for r in records:
                if r.get("kind") == "error" and not active.error:
                    active.error = str(r.get("message", "error"))
                    active.traceback = str(r.get("traceback", ""))
                elif r.get("kind") == "end" and r.get("rank") == 0:
                    active.saw_end = str(r.get("status", ""))
            self._emit(state.RecordsArrived(active.name, tuple(records), active.metrics.invalid_lines))
        text = active.console.poll()
        if text:
            self._emit(state.ConsoleText(active.name, text))

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
        elif active.saw_end == state.DIVERGED:  # every rank ended at the same non-finite step
            update = state.StatusChanged(active.name, state.DIVERGED, self.states[active.name].divergence)
        elif code == 0 and active.saw_end in ("ok", ""):
            update = state.StatusChanged(active.name, state.OK)
        else:
            console = tail_text(active.proc.plan.console_path, 30)
            error = active.error or _last_line(console) or f"torchrun exited with code {code}"
            update = state.StatusChanged(active.name, state.FAILED, error, active.traceback or console)
        self._emit(update)

    # ---- device sampling and the end ----------------------------------------------------------

    def _pids_by_run(self) -> dict[str, dict[int, int]]:
        return {a.name: {rank: pid for pid, rank in a.ranks.items()} for a in list(self._active.values())}

    def _start_sampler(self) -> None:
        if not self.sample_devices:
            return
        try:
            from shardscope.profiling.nvml import DeviceSampler
        except ImportError:
            return
        sampler = DeviceSampler()
        log = open(os.path.join(self.out_dir, "devices.jsonl"), "a", encoding="utf-8", buffering=1)

        def publish(sample: state.DeviceSample) -> None:
            if sample.readings:
                log.write(json.dumps(dataclasses.asdict(sample), separators=(",", ":")) + "\n")
            with self._lock:
                subscribers = list(self._subscribers)
            for callback in subscribers:
                callback([sample])

        try:
            sampler.start(publish, self._pids_by_run)
        except Exception as err:  # sampling is optional; runs go on without it
            self._emit(state.Notice(f"device sampling unavailable: {err!r}", "warning"))
            return
        self._sampler, self._device_log = sampler, log

    def _stop_sampler(self) -> None:
        if self._sampler is not None:
            self._sampler.close()
            self._device_log.close()

    def _finish(self) -> None:
        statuses = [self.states[n].status for n in self.run_names]
        self.exit_code = 0 if statuses and all(s == state.OK for s in statuses) else 1
        summary_path = report_path = ""
        if self.comparison.launch.node_rank > 0:  # node 0 writes the reports
            self._emit(state.ComparisonFinished(self.out_dir, self.exit_code))
            self._flush()
            self._done.set()
            return
        try:
            self.paths = write_reports(self.out_dir, self.comparison, self.states)
            summary_path, report_path = self.paths.get("summary", ""), self.paths.get("report", "")
        except Exception as err:
            self._emit(state.Notice(f"writing the reports failed: {err!r}", "error"))
        self._emit(state.ComparisonFinished(self.out_dir, self.exit_code, summary_path, report_path))
        self._flush()
        self._done.set()


def write_reports(out_dir: str, comparison: Comparison, states: dict[str, RunState]) -> dict[str, str]:
    """Write summary.json (and, when the profiling reports are available, report.md and plots).

    Returns the paths written by name. Falls back to the core summary alone when the full report
    writer fails, so a summary always exists.
    """
    from shardscope.profiling import summary

    try:
        from shardscope.profiling.report import write_reports as full_reports
    except ImportError:
        full_reports = None
    if full_reports is not None:
        try:
            return full_reports(out_dir)
        except Exception as err:
            print(f"shardscope: full report failed, writing the core summary: {err!r}", file=sys.stderr)
    path = os.path.join(out_dir, "summary.json")
    dump_json(path, summary.build_summary(comparison, states, out_dir))
    return {"summary": path}


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""
