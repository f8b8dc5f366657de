"""Parity mode's norms are shardscope's work, not the strategy's: the time inside ``instrumentation()`` is added
up once per outermost block, and the step clock takes it out of the phase and busy time it fell in."""

from __future__ import annotations

import time

from shardscope.engines.comm_count import instrumentation, instrumentation_spent
from shardscope.engines.step_clock import StepClock


def _spin(seconds_of_cpu: float) -> None:
    end = time.process_time() + seconds_of_cpu
    while time.process_time() < end:
        pass


def test_time_inside_instrumentation_is_added_up_once_however_deeply_nested():
    wall0, cpu0 = instrumentation_spent()
    outer_start = time.perf_counter()
    with instrumentation():
        _spin(0.02)
        with instrumentation():  # a nested block adds nothing on its own: its time is the outer block's
            _spin(0.02)
    outer = time.perf_counter() - outer_start
    wall, cpu = (now - then for now, then in zip(instrumentation_spent(), (wall0, cpu0)))
    assert 0 < wall <= outer  # counted twice, the nested part would push it past the outer block's own time
    assert cpu >= 0.04, (wall, cpu)  # both spins, each until the process's CPU time moved 0.02 s
    _spin(0.01)  # outside: not counted
    assert instrumentation_spent()[0] - wall0 == wall


def test_the_step_clock_leaves_instrumentation_out_of_the_phase_it_fell_in_and_out_of_busy_time():
    plain, clocked = StepClock(True, aside=lambda: (0.0, 0.0)), StepClock(True)
    for clock in (plain, clocked):
        clock.begin()
    _spin(0.02)
    for clock in (plain, clocked):
        clock.lap("forward")
    with instrumentation():  # in the backward phase
        _spin(0.2)
    _spin(0.01)
    for clock in (plain, clocked):
        clock.lap("backward")
    a, b = plain.fields(), clocked.fields()
    # two clocks over the same work, one blind to instrumentation: they differ by the instrumented block only
    # (at least its 0.2 s of CPU time; a preemption between the two laps moves them apart by far less)
    assert b["time_backward_s"] < a["time_backward_s"] - 0.1, (a, b)
    assert b["busy_s"] < a["busy_s"] - 0.1, (a, b)
    assert b["time_backward_s"] > 0 and b["busy_s"] > 0


def test_a_clock_without_instrumentation_sets_nothing_aside():
    clock = StepClock(True, aside=lambda: (0.0, 0.0))
    clock.begin()
    with instrumentation():
        _spin(0.02)
    clock.lap("optimizer")
    assert clock.fields()["busy_s"] >= 0.018  # its own aside reads nothing: the spin is the step's
