"""How one step's time splits on this rank, measured without a host sync.

The loop calls ``begin()`` before it builds the step's batches and ``lap(phase)`` after each part:
``data`` (batches built and moved), ``forward``, ``backward`` (summed over micro-batches),
``optimizer`` (unscale, clip and step) and ``comm_wait`` (waiting for the loss all-reduce).
``fields()`` returns them as ``time_<phase>_s`` plus ``busy_s``: the CPU time this process used
during the step. A rank blocked in a collective waits without using CPU, so ``busy_s`` is the
rank's own work; a straggler's stays above its peers' while every rank's wall-clock step time is
the same (peers wait for it). Busy time is also immune to the rank being descheduled on a shared
machine, where wall clock is not.

On CUDA, wall clock around asynchronous kernel launches measures launches, not work, so the
split is not recorded there (no ``time_*`` keys: readers show "not measured"); reading CUDA events
one step later is the way to add it.
"""

from __future__ import annotations

import time

PHASES = ("data", "forward", "backward", "optimizer", "comm_wait")


class StepClock:
    """Per-step phase times by wall clock and the step's process CPU time (CPU devices only)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._times = dict.fromkeys(PHASES, 0.0)
        self._last = 0.0
        self._cpu0 = 0.0

    def begin(self) -> None:
        """Start a step: zero the phases and take the first readings."""
        if self.enabled:
            self._times = dict.fromkeys(PHASES, 0.0)
            self._cpu0 = time.process_time()
            self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Add the wall time since the last reading to ``phase``."""
        if self.enabled:
            now = time.perf_counter()
            self._times[phase] += now - self._last
            self._last = now

    def fields(self) -> dict[str, float]:
        """Return ``time_<phase>_s`` for each phase and ``busy_s`` (empty when disabled)."""
        if not self.enabled:
            return {}
        out = {f"time_{p}_s": t for p, t in self._times.items()}
        out["busy_s"] = time.process_time() - self._cpu0
        return out
