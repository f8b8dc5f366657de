"""Device sampler: the NVML-absent fallback (process RSS), a fake NVML, and the non-overlapping loop."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

from shardscope.profiling.nvml import DeviceSampler


class BrokenNvml:
    """Stands for a container where the library loads but the driver is missing."""

    def nvmlInit(self):
        raise RuntimeError("NVML Shared Library Not Found")


def test_without_nvml_readings_are_labelled_process_rss():
    sampler = DeviceSampler(nvml=BrokenNvml())
    assert not sampler.has_nvml and "NVML unavailable" in sampler.unavailable_reason
    sample = sampler.sample({"ddp": {0: os.getpid()}, "gone": {0: 999_999_999}})
    assert sample.source == "process-rss"
    (reading,) = sample.readings  # the dead pid is skipped, not fatal
    assert reading.kind == "process" and reading.run == "ddp" and reading.ranks == (0,)
    assert reading.label == "ddp rank 0 (process RSS)" and reading.used_bytes > 10 * 2**20
    assert reading.total_bytes and reading.total_bytes > reading.used_bytes


class FakeNvml:
    """The pynvml calls the sampler uses, for one GPU holding one rank's worker process."""

    def __init__(self, worker_pid: int, fail_after: int | None = None):
        self.worker_pid, self.calls, self.fail_after = worker_pid, 0, fail_after
        self.process_list_calls = 0

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return f"h{i}"

    def nvmlDeviceGetName(self, handle):
        return b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetMemoryInfo(self, handle):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("GPU is lost")
        return SimpleNamespace(used=30 * 2**30, total=80 * 2**30)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=87)

    def nvmlDeviceGetPowerUsage(self, handle):
        raise RuntimeError("not supported")  # some boards: the figure is None, the sample stands

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        self.process_list_calls += 1
        return [SimpleNamespace(pid=self.worker_pid, usedGpuMemory=12 * 2**30), SimpleNamespace(pid=1, usedGpuMemory=1)]


def test_gpu_readings_and_process_memory_mapped_through_the_process_tree():
    # A parent (torchrun's agent) whose child (the rank worker) holds the GPU memory.
    agent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', "
                              "'import time; time.sleep(30)'])"])
    try:
        import psutil

        deadline = time.monotonic() + 60  # two interpreters starting on a loaded machine
        children = []
        while not children and time.monotonic() < deadline:
            children = psutil.Process(agent.pid).children()
            time.sleep(0.05)
        assert children, "the agent's child did not start within 60 s"
        worker = children[0].pid
        fake = FakeNvml(worker)
        sampler = DeviceSampler(nvml=fake, process_interval_s=60)
        sample = sampler.sample({"fsdp2": {1: agent.pid}})
        assert sample.source == "nvml"
        gpu = [r for r in sample.readings if r.kind == "gpu"][0]
        assert gpu.label == "GPU0 NVIDIA H100 80GB HBM3" and gpu.used_bytes == 30 * 2**30
        assert gpu.util_pct == 87.0 and gpu.power_w is None and gpu.run == "fsdp2" and gpu.ranks == (1,)
        proc = [r for r in sample.readings if r.kind == "process"]
        assert [(p.run, p.ranks, p.used_bytes) for p in proc] == [("fsdp2", (1,), 12 * 2**30)]
        sampler.sample({"fsdp2": {1: agent.pid}})
        assert fake.process_list_calls == 1  # process lists are polled rarely; device figures every time
    finally:
        for child in psutil.Process(agent.pid).children(recursive=True):
            child.kill()
        agent.kill()
        agent.wait()


def test_nvml_failure_mid_run_falls_back():
    sampler = DeviceSampler(nvml=FakeNvml(os.getpid(), fail_after=1))
    assert sampler.sample({}).source == "nvml"
    sample = sampler.sample({"ddp": {0: os.getpid()}})
    assert sample.source == "process-rss" and "GPU is lost" in sampler.unavailable_reason


def test_loop_never_overlaps_and_stops():
    sampler = DeviceSampler(interval_s=0.01, nvml=BrokenNvml())
    active, overlaps, count = [0], [0], [0]
    lock = threading.Lock()

    def slow_callback(sample):
        with lock:
            active[0] += 1
            overlaps[0] += active[0] > 1
        time.sleep(0.03)  # slower than the interval
        with lock:
            active[0] -= 1
            count[0] += 1
        if count[0] == 2:
            raise ValueError("a failing subscriber does not stop sampling")

    sampler.start(slow_callback, lambda: {"me": {0: os.getpid()}})
    deadline = time.monotonic() + 60  # a loaded machine only makes this wait longer
    while count[0] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    seen = count[0]
    time.sleep(0.1)
    assert overlaps[0] == 0 and seen >= 3 and count[0] == seen
    assert "failing subscriber" in sampler.last_error
