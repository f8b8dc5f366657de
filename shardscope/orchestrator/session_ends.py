"""The two ends of a session: reaching node 0 before the first run (records over TCP), and device
sampling and the reports around and after the last. (The shared initial weights are written by the
first run's ranks: ``engines.init_weights.ensure_init``.)

``SessionEnds`` is a mixin of ``Session``. Device samples are published from the sampler's own
thread (``DeviceLog``); everything else here runs on the session thread.
"""

from __future__ import annotations

import time

from shardscope.core.liveness import make_beat
from shardscope.core.record_secret import comparison_key, secret_from_env
from shardscope.core.record_wire import Refused, send_beat
from shardscope.core import outspace
from shardscope.orchestrator import nodes
from shardscope.orchestrator.device_log import DeviceLog
from shardscope.profiling import state
from shardscope.analysis.report import write_reports


class SessionEnds:
    """Mixin of ``Session``: reaching node 0, the device sampler and the final reports."""

    def _reach_node0(self) -> bool:
        """Other nodes without a shared filesystem: make sure node 0's record server answers before any run
        starts (up to ``launch.node_timeout_s``); else fail every run with one clear line."""
        launch = self.comparison.launch
        if not launch.records_endpoint or launch.node_rank == 0:
            return True
        deadline = time.monotonic() + launch.node_timeout_s
        while True:
            try:
                send_beat(launch.records_endpoint, launch.node_rank, make_beat(launch.node_rank, False),
                           secret=comparison_key(secret_from_env(), self.comparison.to_dict()))
                return True
            except OSError as err:
                if isinstance(err, Refused) or time.monotonic() >= deadline:  # refused: waiting cannot help
                    message = (f"records: node 0's orchestrator at {launch.records_endpoint} refused this node ({err})"
                               if isinstance(err, Refused) else
                               f"records: node 0's orchestrator at {launch.records_endpoint} unreachable for "
                               f"{launch.node_timeout_s:g} s ({err})")
                    self._emit(state.Notice(message, "error"))
                    for name in self.run_names:
                        self._emit(state.StatusChanged(name, state.FAILED, message))
                    return False
                time.sleep(0.5)

    # ---- device sampling and the end ----------------------------------------------------------

    def _pids_by_run(self) -> dict[str, dict[int, int]]:
        return {a.name: {rank: pid for pid, rank in a.ranks.items()} for a in list(self._active.values())}

    def _start_sampler(self) -> None:
        if not self.sample_devices:
            return
        launch = self.comparison.launch
        self._sampler = DeviceLog(self.rundir.devices(launch.node_rank),
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
        """Write the reports, say the comparison finished, and set the end. The end is set whatever fails here
        (exit code 1 then): the command line and the app wait on it, and a session thread that died without it
        left `shardscope run` waiting forever (seen with stderr a pipe whose reader had been killed)."""
        try:
            self._write_ends()
        except BaseException:
            self.exit_code = 1
            raise
        finally:
            self._done.set()

    def _write_ends(self) -> None:
        statuses = [self.states[n].status for n in self.run_names]
        self.exit_code = 0 if statuses and all(s == state.OK for s in statuses) else 1
        summary_path = report_path = ""
        if self.comparison.launch.node_rank > 0:  # node 0 writes the reports
            self._emit(state.ComparisonFinished(self.out_dir, self.exit_code))
            self._flush()
            return
        self._spare.release()  # its room is for the summary
        try:
            self.paths = write_reports(self.out_dir, self.comparison, self.states)
            summary_path, report_path = self.paths.get("summary", ""), self.paths.get("report", "")
            failed = getattr(self.paths, "failed", "")
            if failed:  # the summary exists, but a part of the report is missing: not a clean result
                self.exit_code = 1
                self._emit(state.Notice(failed, "error"))
        except Exception as err:
            disk = outspace.disk_error(err)
            why = outspace.describe(disk) if disk is not None else repr(err)
            self.exit_code = 1
            self._emit(state.Notice(f"writing the reports failed: {why}", "error"))
        self._emit(state.ComparisonFinished(self.out_dir, self.exit_code, summary_path, report_path))
        self._flush()

