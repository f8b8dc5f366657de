"""The in-rank torch.profiler window: steps [start_step, start_step + steps).

Exports, per rank, a Chrome/Perfetto trace ``<run_dir>/traces/rank<R>.trace.json`` and the
TensorBoard profiler plugin layout under ``<run_dir>/traces/tb/`` (via
``torch.profiler.tensorboard_trace_handler``), and returns one ``trace`` record payload per file.
The profiler records only inside the window (after one discarded warm-up step) and is fully
stopped right after its last step; ``close()`` stops it if training ended inside the window.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from shardscope.core.outspace import filesystem_problem
from shardscope.core.rundir import RunFiles, tb_worker


class ProfilerWindow:
    """Profiles a fixed window of steps on one rank.

    Call ``begin_step(step)`` before and ``end_step(step)`` after every step; ``end_step`` returns
    the trace record payloads (dicts with path, format, steps) once the window closes, else [].

    A ``torch.profiler.schedule`` drives the window so the trace carries ``ProfilerStep#<step>``
    markers numbered by training step: idle until the step before the window (one warm-up step
    whose events are discarded, so profiler start-up cost stays out of the trace), recording for
    the window, then saved and stopped. The warm-up step is slowed too, so ``in_window`` covers it.
    """

    def __init__(self, run_dir: str, rank: int, *, enabled: bool, start_step: int, steps: int,
                 total_steps: int, record_shapes: bool, cuda: bool, profile_memory: bool = False) -> None:
        self.run_dir, self.rank = run_dir, rank
        self.start, self.stop = start_step, start_step + steps
        # Profile only when the whole window fits in the run.
        self.enabled = enabled and steps > 0 and self.stop <= total_steps
        self.warmup = 1 if start_step >= 1 else 0
        self.record_shapes = record_shapes  # keep on: gloo collectives' sizes come only from recorded shapes
        self.profile_memory = profile_memory  # off by default: allocation events are ~15% of a trace's bytes
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._prof: profile | None = None
        self._records: list[dict[str, Any]] = []

    def in_window(self, step: int) -> bool:
        """Return True when ``step`` runs under the profiler (warm-up included): keep it out of throughput."""
        return self.enabled and self.start - self.warmup <= step < self.stop

    def begin_step(self, step: int) -> None:
        """Enter the (idle) profiler before the first step; the schedule wakes it for the window."""
        if self.enabled and step == 0 and self._prof is None:
            sched = schedule(skip_first=self.start - self.warmup, wait=0, warmup=self.warmup,
                             active=self.stop - self.start, repeat=1)
            self._prof = profile(activities=self.activities, schedule=sched, on_trace_ready=self._export,
                                 record_shapes=self.record_shapes, profile_memory=self.profile_memory,
                                 with_stack=False)
            self._prof.__enter__()

    def end_step(self, step: int) -> list[dict[str, Any]]:
        """Advance the schedule; after the window's last step the trace is saved and the profiler
        fully stopped. Returns the trace record payloads written by this call."""
        if self._prof is None:
            return []
        self._prof.step()  # after the last window step this saves the trace (calls _export)
        if step >= self.stop - 1:
            self.close()
        out, self._records = self._records, []
        return out

    def close(self) -> None:
        """Stop the profiler if it is still running (training ended or failed inside the window)."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)

    def _export(self, prof: profile) -> None:
        try:
            self._write(prof)
        except Exception as err:  # torch reports a full disk as a bare RuntimeError: name the true cause
            files = RunFiles(self.run_dir)
            partial = files.tb_partials(self.rank)
            for path in partial:  # torch's half-written temporary traces
                os.remove(path)
            problem = filesystem_problem(os.path.splitext(partial[0])[0] if partial else files.traces)
            if problem is not None:
                raise problem from err
            raise

    def _write(self, prof: profile) -> None:
        steps = [self.start, self.stop - 1]
        files = RunFiles(self.run_dir)
        os.makedirs(files.tb, exist_ok=True)
        tensorboard_trace_handler(files.tb, worker_name=tb_worker(self.rank))(prof)
        written = sorted(files.tb_files(self.rank), key=os.path.getmtime)
        chrome = files.chrome_trace(self.rank)
        if written:  # same Chrome-format content: a hard link (a copy where links fail) rather than a second export
            try:
                if os.path.exists(chrome):
                    os.remove(chrome)
                os.link(written[-1], chrome)
            except OSError:
                shutil.copyfile(written[-1], chrome)
        else:
            prof.export_chrome_trace(chrome)
        self._records.append({"path": os.path.relpath(chrome, self.run_dir), "format": "chrome", "steps": steps})
        if written:
            self._records.append({"path": os.path.relpath(written[-1], self.run_dir), "format": "tensorboard",
                                  "steps": steps})
