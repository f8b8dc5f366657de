"""The in-rank torch.profiler window: steps [start_step, start_step + steps).

Exports, per rank, a Chrome/Perfetto trace ``<run_dir>/traces/rank<R>.trace.json`` and the
TensorBoard profiler plugin layout under ``<run_dir>/traces/tb/`` (via
``torch.profiler.tensorboard_trace_handler``), and returns one ``trace`` record payload per file.
The profiler is started just before the first window step and stopped right after the last, so it
never runs outside the window; ``close()`` stops it if training ended inside the window.
"""

from __future__ import annotations

import glob
import os
import shutil
from typing import Any

from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler


class ProfilerWindow:
    """Profiles a fixed window of steps on one rank.

    Call ``begin_step(step)`` before and ``end_step(step)`` after every step; ``end_step`` returns
    the trace record payloads (dicts with path, format, steps) once the window closes, else [].
    """

    def __init__(self, run_dir: str, rank: int, *, enabled: bool, start_step: int, steps: int,
                 total_steps: int, record_shapes: bool, cuda: bool) -> None:
        self.run_dir, self.rank = run_dir, rank
        self.start, self.stop = start_step, start_step + steps
        # Profile only when the whole window fits in the run.
        self.enabled = enabled and steps > 0 and self.stop <= total_steps
        self.record_shapes = record_shapes
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._prof: profile | None = None

    def in_window(self, step: int) -> bool:
        """Return True when ``step`` is profiled."""
        return self.enabled and self.start <= step < self.stop

    def begin_step(self, step: int) -> None:
        """Start the profiler before the window's first step."""
        if self.enabled and step == self.start and self._prof is None:
            self._prof = profile(activities=self.activities, record_shapes=self.record_shapes,
                                 profile_memory=True, with_stack=False)
            self._prof.__enter__()

    def end_step(self, step: int) -> list[dict[str, Any]]:
        """Stop and export after the window's last step; return the trace record payloads."""
        if self._prof is None or step != self.stop - 1:
            return []
        return self._finish()

    def close(self) -> None:
        """Stop the profiler if it is still running (training ended or failed inside the window)."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)

    def _finish(self) -> list[dict[str, Any]]:
        prof, self._prof = self._prof, None
        assert prof is not None
        prof.__exit__(None, None, None)  # fully stopped before anything is written
        steps = [self.start, self.stop - 1]
        traces = os.path.join(self.run_dir, "traces")
        tb_dir = os.path.join(traces, "tb")
        os.makedirs(tb_dir, exist_ok=True)
        worker = f"rank{self.rank}"
        tensorboard_trace_handler(tb_dir, worker_name=worker)(prof)
        written = sorted(glob.glob(os.path.join(tb_dir, f"{worker}.*.pt.trace.json")), key=os.path.getmtime)
        chrome = os.path.join(traces, f"rank{self.rank}.trace.json")
        if written:  # same Chrome-format content; copy rather than export a second time
            shutil.copyfile(written[-1], chrome)
        else:
            prof.export_chrome_trace(chrome)
        out = [{"path": os.path.relpath(chrome, self.run_dir), "format": "chrome", "steps": steps}]
        if written:
            out.append({"path": os.path.relpath(written[-1], self.run_dir), "format": "tensorboard", "steps": steps})
        return out

