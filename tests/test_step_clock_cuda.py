"""The step clock per device: wall and CPU time on CPU, CUDA events on CUDA (the gpu tests need a GPU and are
skipped without one: CI has none)."""

from __future__ import annotations

import time

import pytest
import torch

from shardscope.engines.step_clock import CudaStepClock, StepClock, step_clock


def test_cpu_gets_wall_and_cpu_time_other_devices_nothing():
    clock = step_clock(torch.device("cpu"))
    assert isinstance(clock, StepClock) and clock.enabled
    clock.begin()
    sum(range(200_000))
    clock.lap("forward")
    fields = clock.fields()
    assert fields["time_forward_s"] > 0 and fields["busy_s"] > 0 and "idle_s" in fields
    meta = step_clock(torch.device("meta"))
    assert isinstance(meta, StepClock) and meta.fields() == {}


@pytest.mark.gpu
def test_cuda_split_matches_the_host_clock_around_a_synchronised_region():
    """Each phase's stream time against the host's wall clock of the same work, timed with a synchronize on
    either side (an independent clock): within 20% plus 0.5 ms of launch latency; no sync added by the
    clock (fields() before the stream reached the last event returns {} rather than waiting)."""
    device = torch.device("cuda")
    clock = step_clock(device)
    assert isinstance(clock, CudaStepClock)
    a = torch.randn(4096, 4096, device=device)
    for _ in range(3):  # warm-up: cuBLAS handles, allocator
        a @ a
    torch.cuda.synchronize()

    def work(n):
        for _ in range(n):
            a @ a

    wall = {}
    for phase, n in (("forward", 20), ("backward", 40)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        work(n)
        torch.cuda.synchronize()
        wall[phase] = time.perf_counter() - t0
    torch.cuda.synchronize()
    clock.begin()
    clock.lap("data")
    work(20)
    clock.lap("forward")
    work(40)
    clock.lap("backward")
    early = clock.fields()  # 60 matmuls still queued: not reached yet
    torch.cuda.synchronize()
    fields = clock.fields()
    assert early == {}
    for phase in ("forward", "backward"):
        assert fields[f"time_{phase}_s"] == pytest.approx(wall[phase], rel=0.2, abs=5e-4), (phase, fields, wall)
    assert fields["time_data_s"] < 1e-3 and fields["time_optimizer_s"] == 0.0
    assert "busy_s" not in fields and "idle_s" not in fields  # not measured on CUDA (see step_clock.py)
