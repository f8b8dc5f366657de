"""How one step's time splits on this rank, measured without a host sync.

The loop calls ``begin()`` before it builds the step's batches and ``lap(phase)`` after each part:
``data`` (batches built and moved), ``forward``, ``backward`` (summed over micro-batches) and
``optimizer`` (unscale, clip and step). ``fields()`` returns them as ``time_<phase>_s`` plus
``busy_s``: the CPU time this process used during the step, and ``idle_s``: the step's wall time
minus its busy time (floored at 0), the time the rank spent off the CPU. A rank blocked in a
collective waits without using CPU, so ``busy_s`` is the rank's own work and ``idle_s`` its time
waiting in collectives (or descheduled, on a shared machine); a straggler's busy time stays above
its peers' while every rank's wall-clock step time is the same (peers wait for it, and their idle
time grows). Busy time is also immune to the rank being descheduled, where wall clock is not.

``cpu_wait_s`` (Linux): the time the rank's main thread was ready to run but waited for a core, the
run-queue delay of ``/proc/thread-self/schedstat`` over the step: other processes (or the rank's own threads)
holding the cores. It tells a rank descheduled by a busy machine from one waiting in a collective (both are
off the CPU, in ``idle_s``); ``predict`` reads the machine's background load from it. Absent where the kernel
does not keep it.

Time spent inside ``comm_count.instrumentation()`` (shardscope's own work: parity mode's norms, ``why``'s
probes) is not the strategy's: each lap leaves out what was spent there since the previous lap, and busy time
the CPU spent there.

On CUDA, wall clock around asynchronous kernel launches measures launches, not work: ``CudaStepClock``
records a CUDA event on the compute stream at each boundary instead (enqueued, no host sync) and reads
the elapsed times once the step's own synchronisation (the one its step time already needs) has passed
every event, so reading adds no sync; an event not yet reached leaves that step's split unrecorded
rather than waiting. Those are stream times: a phase that waits for a collective (DDP's backward for its
last all-reduce, FSDP's forward for an all-gather) includes the wait, and a GPU rank's own work cannot be
told from its waiting by stream events, so ``busy_s`` and ``idle_s`` (the straggler signal) are not
recorded on CUDA: the report says "not measured" with that reason.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable

import torch

from shardscope.engines.comm_count import instrumentation_spent

PHASES = ("data", "forward", "backward", "optimizer")


def _open_schedstat() -> int | None:
    """A descriptor of the calling thread's ``schedstat`` (re-read with ``pread``: ~1 us), or None."""
    try:
        fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    except OSError:
        return None
    if run_queue_wait_s(fd) is None:
        os.close(fd)
        return None
    return fd


def run_queue_wait_s(fd: int | None) -> float | None:
    """Seconds the thread behind ``fd`` has waited on a run queue so far (schedstat's second field)."""
    if fd is None:
        return None
    try:
        return int(os.pread(fd, 128, 0).split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class StepClock:
    """Per-step phase times by wall clock and the step's process CPU time (CPU devices only)."""

    def __init__(self, enabled: bool, aside: Callable[[], tuple[float, float]] = instrumentation_spent) -> None:
        self.enabled = enabled
        self._aside = aside  # (wall, CPU) seconds of work that is not the strategy's, so far
        self._times = dict.fromkeys(PHASES, 0.0)
        self._last = 0.0
        self._cpu0 = 0.0
        self._wall_aside = 0.0
        self._cpu_aside0 = 0.0
        self._schedstat = _open_schedstat() if enabled else None  # the thread that runs the steps builds the clock
        self._wait0: float | None = None
        if self._schedstat is not None:
            weakref.finalize(self, os.close, self._schedstat)

    def begin(self) -> None:
        """Start a step: zero the phases and take the first readings."""
        if self.enabled:
            self._times = dict.fromkeys(PHASES, 0.0)
            self._wall_aside, self._cpu_aside0 = self._aside()
            self._cpu0 = time.process_time()
            self._wait0 = run_queue_wait_s(self._schedstat)
            self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Add the wall time since the last reading to ``phase``, less what was set aside in between."""
        if self.enabled:
            now, aside = time.perf_counter(), self._aside()[0]
            self._times[phase] += max(0.0, now - self._last - (aside - self._wall_aside))
            self._last, self._wall_aside = now, aside

    def fields(self) -> dict[str, float]:
        """Return ``time_<phase>_s`` for each phase, ``busy_s``, ``idle_s`` and (where the kernel keeps it)
        ``cpu_wait_s``; empty when disabled."""
        if not self.enabled:
            return {}
        out = {f"time_{p}_s": t for p, t in self._times.items()}
        out["busy_s"] = max(0.0, time.process_time() - self._cpu0 - (self._aside()[1] - self._cpu_aside0))
        out["idle_s"] = max(0.0, sum(self._times.values()) - out["busy_s"])
        wait = run_queue_wait_s(self._schedstat)
        if wait is not None and self._wait0 is not None:
            out["cpu_wait_s"] = max(0.0, wait - self._wait0)
        return out


class CudaStepClock:
    """Per-step phase times from CUDA events on the current stream (CUDA devices); no busy/idle split."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._events: list[torch.cuda.Event] = []  # reused every step; grows to the laps of the longest step
        self._laps: list[str] = []  # the phase each lap closes: lap i spans events i .. i + 1
        self._aside = dict.fromkeys(PHASES, 0.0)  # wall seconds of instrumentation within each phase
        self._wall_aside = 0.0

    def _record(self) -> None:
        index = len(self._laps)
        if index == len(self._events):
            self._events.append(torch.cuda.Event(enable_timing=True))
        self._events[index].record(torch.cuda.current_stream(self.device))

    def begin(self) -> None:
        """Start a step: forget the last step's laps and mark the stream."""
        self._laps = []
        self._aside = dict.fromkeys(PHASES, 0.0)
        self._wall_aside = instrumentation_spent()[0]
        self._record()

    def lap(self, phase: str) -> None:
        """Mark the end of a part of ``phase`` on the stream; instrumentation within it is left out (its kernels
        end in a read-back, so their wall time covers their stream time)."""
        self._laps.append(phase)
        self._record()
        aside = instrumentation_spent()[0]
        self._aside[phase] += aside - self._wall_aside
        self._wall_aside = aside

    def fields(self) -> dict[str, float]:
        """Return ``time_<phase>_s``: stream time in seconds between the step's events; {} while the stream
        has not reached the step's last event (never waits for it)."""
        if not self._laps or not self._events[len(self._laps)].query():
            return {}
        times = dict.fromkeys(PHASES, 0.0)
        for i, phase in enumerate(self._laps):
            times[phase] += self._events[i].elapsed_time(self._events[i + 1]) / 1000.0
        return {f"time_{p}_s": max(0.0, t - self._aside[p]) for p, t in times.items()}


def step_clock(device: torch.device) -> StepClock | CudaStepClock:
    """The step clock for ``device``: CUDA events on CUDA, wall and CPU time on CPU, none elsewhere."""
    return CudaStepClock(device) if device.type == "cuda" else StepClock(device.type == "cpu")
