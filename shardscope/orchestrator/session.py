"""A comparison in progress: runs each run's torchrun job and publishes updates.

``Session`` is the one source of live state for both views (the headless printer and the
Textual app). The runs are driven from one background thread, the session thread; subscribers
receive batches of ``state.Update`` objects on it, and device samples on the sampler's thread, and
must hand them to their own thread (the app posts a message). Control calls (``stop_run``,
``restart_run``, ``stop_all``) are thread-safe requests the session thread acts on at its next poll.

Here: the public API, the session loop and launching. ``supervision.RunSupervision`` follows each
active run to its verdict; ``session_ends.SessionEnds`` reaches node 0, samples devices and writes
the reports.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
import weakref
from typing import Callable

from shardscope import config
from shardscope.config import Comparison, dump_json
from shardscope.core import outspace, record_secret, record_wire
from shardscope.orchestrator.record_server import RecordServer
from shardscope.presets import trust
from shardscope.orchestrator import launcher, lifeline, nodes, prestart, verdict
from shardscope.profiling import state
from shardscope.profiling.state import RunState, Update
from shardscope.orchestrator.completion import Completion
from shardscope.orchestrator.device_log import DeviceLog
from shardscope.orchestrator.tail import ConsoleTailer, MetricsTailer
from shardscope.orchestrator.session_ends import SessionEnds
from shardscope.orchestrator.session_requests import Requests
from shardscope.orchestrator.supervision import RunSupervision, _Active
from shardscope.core.rundir import STATUS, RunDir

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
        session._discard_warm()


def default_out_dir(preset_name: str, root: str = "shardscope-runs") -> str:
    """Return ``./shardscope-runs/<YYYYmmdd-HHMMSS>-<preset>`` (not created)."""
    return os.path.join(root, f"{time.strftime('%Y%m%d-%H%M%S')}-{preset_name}")



class Session(Requests, RunSupervision, SessionEnds, Completion):
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
        trust.require_trusted(comparison)  # code named in someone's run directory runs only when the user names it
        self.comparison = comparison
        self.out_dir = os.path.abspath(out_dir)
        self.rundir = RunDir(self.out_dir)
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
        self._ended = False  # the loop is over: requests are refused, not queued for nobody
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._pending: list[Update] = []
        self._sampler: DeviceLog | None = None
        self._spare = outspace.Spare(self.out_dir)  # freed on a disk fault, so the summary fits
        launch = comparison.launch
        self._watch = nodes.NodeWatch(self.out_dir, launch.node_rank, launch.nnodes, launch.node_timeout_s,
                                      launch.records_endpoint, comparison.to_dict())
        # Several nodes without a shared filesystem: node 0 receives the others' records over TCP.
        self._records: RecordServer | None = None
        self._warm: prestart.Warm | None = None  # the next run's torchrun agent, started ahead
        self._warm_lock = threading.Lock()  # terminate_all (a signal handler) may take it too
        self._warm_count = 0

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

    # ---- the session thread ------------------------------------------------------------------

    def _emit(self, update: Update) -> None:
        self._pending.append(update)
        state.fold([update], self.states)
        owner = nodes.owns_verdict(self.comparison.launch.node_rank)
        if owner and isinstance(update, state.StatusChanged) and update.status in state.FINISHED:
            # The orchestrator's verdict goes on disk too, so reports rebuilt from files agree with it.
            files = self.rundir.run(update.run)
            try:
                os.makedirs(files.path, exist_ok=True)
                dump_json(files.status, {"status": update.status, "error": update.error,
                                         "traceback": update.traceback, "t": update.t})
            except OSError as err:  # a full disk: the live view and the summary still carry the verdict
                self._pending.append(state.Notice(f"{update.run}: {STATUS} not written: {err}", "warning"))

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
                try:
                    print(f"shardscope: subscriber failed: {err!r}", file=sys.stderr)
                except (OSError, ValueError):  # stderr a closed pipe (its reader gone): nowhere left to say it
                    pass

    def _main(self) -> None:
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            self._spare.reserve()
            launch = self.comparison.launch
            if launch.node_rank == 0:
                lifeline.write_identity(self.out_dir)
                if launch.records_endpoint and launch.nnodes > 1:
                    self._records = RecordServer(
                        self.out_dir, launch.records_endpoint,
                        secret=record_secret.comparison_key(record_secret.secret_from_env(), self.comparison.to_dict()),
                        runs={r.name: config.resolved_world_size(self.comparison, r) for r in self.comparison.runs},
                        nnodes=launch.nnodes, bind=launch.records_bind or None)
                    self._records.start()
                    self._watch.heard = self._records.heard
            self._watch.start()
            for run in self.comparison.runs:
                self._define(run)
            self._queue.extend(self.run_names)
            self._flush()
            if launch.node_rank == 0 or launch.records_endpoint:  # node 0's, or this node's own directory
                dump_json(self.rundir.comparison, self.comparison.to_dict())
            if not self._reach_node0():
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
            with self._lock:
                self._ended = True
            self._discard_warm()
            try:
                self._stop_sampler()
                self._watch.stop()
            finally:
                try:
                    self._finish()  # sets the end whatever happens in it: a waiting command line never hangs
                finally:
                    if self._records is not None:
                        self._records.stop()

    def _define(self, run: config.RunSpec) -> None:
        self._emit(state.RunDefined(
            run=run.name,
            strategy=run.strategy,
            world_size=config.resolved_world_size(self.comparison, run),
            steps_total=run.steps or self.comparison.steps,
            precision=config.resolved_precision(self.comparison, run),
            options=config.resolved_options(run),
            run_dir=self.rundir.run(run.name).path,
        ))

    def _loop(self) -> None:
        concurrent = self.comparison.launch.concurrent
        max_active = len(self.run_names) if concurrent else 1
        while True:
            self._handle_requests()
            self._check_nodes()
            while self._queue and not self._stopping:
                # A run whose ranks all ended cleanly is only tearing down: the next one starts now, and its
                # ranks wait for that run's torchrun to be gone before their first step.
                leaving = [a for a in self._active.values() if not concurrent and self._tearing_down(a)]
                if len(self._active) - len(leaving) >= max_active:
                    break
                self._launch(self._queue.popleft(), after=[a.proc for a in leaving])
            if not self._active and (not self._queue or self._stopping):
                with self._lock:
                    self._handle_requests()  # asked since the last pass: a restart keeps the loop going
                    if not self._active and (not self._queue or self._stopping):
                        self._ended = True
                if self._ended:
                    break
                continue
            for active in list(self._active.values()):
                self._poll(active)
            self._flush()
            time.sleep(self._poll_delay())
        for name in list(self._queue):
            self._emit(state.StatusChanged(name, state.STOPPED, "stopped before it started"))
        self._queue.clear()
        self._flush()

    def _poll_delay(self) -> float:
        """The poll interval, or 20 ms while a run is within one interval of its last step at its pace so far
        (or at its last step): its end starts the next run, so the next launch waits for no sleep."""
        last = self.comparison.steps - 1
        for active in self._active.values():
            left = active.seconds_left(last)
            near = active.last_steps and min(active.last_steps.values()) >= last - 1
            if self._queue and (near or (left is not None and left <= self.poll_interval_s)):
                return min(self.poll_interval_s, 0.02)
        return self.poll_interval_s

    def _check_nodes(self) -> None:
        """A lost node (node 0: any other; other nodes: node 0) fails the active runs (their ranks here are
        stopped) and every queued run, so this orchestrator ends instead of starting runs nobody joins."""
        lost = self._watch.lost() or self._watch.leader_lost()
        if not lost:
            return
        message = nodes.lost_message(lost, self._watch.timeout_s,
                                     dict(self._records.refused_from) if self._records is not None else None)
        for active in self._active.values():
            active.stop_reason = active.stop_reason or message
        while self._queue:
            self._emit(state.StatusChanged(self._queue.popleft(), state.FAILED, message))

    def _plan(self, run: config.RunSpec) -> launcher.LaunchPlan:
        files = self.rundir.run(run.name)
        ws = config.resolved_world_size(self.comparison, run)
        launch = self.comparison.launch
        prefix = launch.rdzv_id or f"shardscope-{self.comparison.name}"
        argv = launcher.torchrun_argv(
            files.spec,
            nproc_per_node=ws // launch.nnodes,
            nnodes=launch.nnodes,
            node_rank=launch.node_rank,
            rdzv_endpoint=launcher.endpoint_for_run(launch.rdzv_endpoint, self.run_names.index(run.name)),
            rdzv_id=f"{prefix}-{run.name}",
            python=self.python,
            fork=prestart.forks(self.comparison, run.name, self.device),
        )
        env = launcher.worker_env(self.device)
        if launch.records_endpoint and launch.node_rank != 0:  # no shared filesystem: records go to node 0
            env[record_wire.ENV] = launch.records_endpoint
        return launcher.LaunchPlan(run.name, argv, env,
                                   files.console(launch.node_rank), os.getcwd())

    def _launch(self, name: str, after: list[launcher.RunProcess] | tuple = ()) -> None:
        run = self.comparison.run(name)
        files = self.rundir.run(name)
        run_dir = files.path
        attempt = self._attempts.get(name, 0)
        if attempt and os.path.isdir(run_dir):
            # A restart starts afresh; the earlier attempt's files are kept beside it.
            os.replace(run_dir, self.rundir.attempt(name, attempt))
            self._define(run)
        self._attempts[name] = attempt + 1
        plan = self._plan(run)
        if after:
            plan = plan.with_env(launcher.after_env(after))
        self._emit(state.StatusChanged(name, state.STARTING))
        self._emit(state.Notice(f"{name}: {plan.shell_line()}"))
        try:
            os.makedirs(files.metrics, exist_ok=True)
            dump_json(files.spec,
                      config.run_spec_payload(self.comparison, run, out_dir=self.out_dir, device=self.device))
            warm = self._take_warm()
            try:
                plan = self._start_next_agent(plan, cold=warm is None)
                proc = (warm.launch(plan) if warm is not None else None) or self._start_cold(plan)
            except BaseException:
                if warm is not None:  # not handed its order (or its order failed): it goes now
                    warm.discard()
                raise
        except OSError as err:
            disk = outspace.disk_error(err)
            if disk is None:
                raise
            self._halt_for_disk(name, verdict.Verdict(outspace.describe(disk), "", verdict.DISK))
            return
        self._active[name] = _Active(name, proc, MetricsTailer(files.metrics),
                                     ConsoleTailer(plan.console_path), time.monotonic())

    def _start_cold(self, plan: launcher.LaunchPlan) -> launcher.RunProcess:
        """Start ``plan`` with no agent ahead: through one that preloads for forked ranks, else torchrun itself."""
        if (modules := prestart.preload_for(self.comparison, plan.run, self.device)) is None:
            return launcher.start(plan)
        self._warm_count += 1
        return prestart.launch_cold(plan, self.python,
                                    self.rundir.agent_ready(self._warm_count, self.comparison.launch.node_rank), modules)

    def _start_next_agent(self, plan: launcher.LaunchPlan, *, cold: bool) -> launcher.LaunchPlan:
        """Start the next queued run's torchrun agent beside this launch when ``prestart.worth_starting``;
        return ``plan`` with the gate that keeps its ranks' first step after that agent's imports."""
        launch = self.comparison.launch
        ranks = config.resolved_world_size(self.comparison, self.comparison.run(plan.run)) // launch.nnodes
        if (not self._queue or launch.concurrent or not launch.prestart or self._stopping
                or not prestart.worth_starting(cold=cold, local_ranks=ranks, cpus=prestart.usable_cpus())):
            return plan
        self._warm_count += 1
        ready = self.rundir.agent_ready(self._warm_count, launch.node_rank)
        try:
            warm = prestart.start(self.python, ready, launcher.worker_env(self.device), os.getcwd(),
                                  prestart.preload_for(self.comparison, self._queue[0], self.device) or ())
        except OSError as err:  # no process to spare (EAGAIN, ENOMEM): the next run starts cold, as it did before
            self._emit(state.Notice(f"the next run's torchrun agent was not started ahead: {err}", "warning"))
            return plan
        with self._warm_lock:
            self._warm = warm
        if self._stopping:  # stop_all (or a signal's terminate_all) came while it started
            self._discard_warm()
            return plan
        return plan.with_env(warm.gate_env())

    def _take_warm(self) -> prestart.Warm | None:
        """The agent started ahead, now this caller's alone (the session thread, or a signal handler's)."""
        with self._warm_lock:
            warm, self._warm = self._warm, None
        return warm

    def _discard_warm(self) -> None:
        """End the agent started ahead for a run that will not start now."""
        warm = self._take_warm()
        if warm is not None:
            warm.discard()
