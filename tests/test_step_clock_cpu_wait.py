"""``cpu_wait_s``: the run-queue wait of the thread that runs the steps, from /proc/thread-self/schedstat,
checked against a competitor pinned to the same core and against the step's own wall and CPU time."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from shardscope.engines.step_clock import StepClock, run_queue_wait_s

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat") or not hasattr(os, "sched_setaffinity"),
                                reason="needs Linux's per-thread schedstat and CPU affinity")


def _spin_cpu(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def _competitor(cpu: int, started) -> None:
    os.sched_setaffinity(0, {cpu})
    started.set()
    while True:
        pass


def test_a_competitor_on_the_same_core_shows_as_run_queue_wait_within_the_steps_idle_time():
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    started = multiprocessing.get_context("spawn").Event()
    rival = multiprocessing.get_context("spawn").Process(target=_competitor, args=(cpu, started), daemon=True)
    rival.start()
    try:
        assert started.wait(120), "the competitor did not start"
        os.sched_setaffinity(0, {cpu})
        alone = StepClock(True, aside=lambda: (0.0, 0.0))
        alone.begin()
        _spin_cpu(0.3)  # 0.3 s of CPU time on a core another busy process wants too
        alone.lap("forward")
        got = alone.fields()
    finally:
        os.sched_setaffinity(0, before)
        rival.kill()
        rival.join(30)
    # The fair scheduler shares the core: this thread waited for it while runnable (a floor well below the
    # ~0.3 s an even split gives; more load only adds), and the wait lies inside the step's time off the CPU.
    assert got["cpu_wait_s"] >= 0.05, got
    assert got["cpu_wait_s"] <= got["idle_s"] + 0.01, got


def test_the_reader_gives_none_without_a_descriptor_and_the_wait_never_goes_back():
    assert run_queue_wait_s(None) is None
    fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    try:
        first = run_queue_wait_s(fd)
        _spin_cpu(0.01)
        assert first is not None and run_queue_wait_s(fd) >= first
    finally:
        os.close(fd)
