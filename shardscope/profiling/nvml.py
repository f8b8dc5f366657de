"""Device sampling in the orchestrator: GPU figures via NVML, or process RSS where there is no NVML.

``DeviceSampler.sample(pids_by_run)`` returns one ``DeviceSample``: per GPU its used/total
memory, utilisation and power (one batched read per device), and per rank process its GPU memory,
mapped to run and rank through the torchrun process tree. Per-process lists are slow NVML calls
(milliseconds), so they are refreshed every ``process_interval_s`` only; device figures on every
poll. Without NVML (no GPU, no driver, a container without the library) every reading is the
rank process's resident set size instead, labelled ``process RSS`` (source ``process-rss``). An
NVML failure mid-run switches to that fallback; sampling never raises into the caller.

``start(callback, pids)`` polls on a daemon thread and schedules the next poll only after the
previous one finished (and its callback returned), so polls never overlap. Torch-free.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import psutil

from shardscope.core import rank_process
from shardscope.profiling.state import DeviceReading, DeviceSample

PidsByRun = dict[str, dict[int, int]]  # run -> {rank: pid}


class DeviceSampler:
    """Samples GPUs through NVML (or rank processes' RSS without it)."""

    def __init__(self, interval_s: float = 0.5, process_interval_s: float = 5.0, *, nvml: Any = None,
                 use_nvml: bool = True) -> None:
        self.interval_s = interval_s
        self.process_interval_s = process_interval_s
        self.source = "process-rss"
        self.unavailable_reason = ""
        self.last_error = ""
        self._nvml = None
        self._handles: list[Any] = []
        self._names: list[str] = []
        self._proc_cache: dict[int, psutil.Process] = {}
        self._gpu_procs: list[DeviceReading] = []
        self._gpu_procs_t = 0.0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        if use_nvml:
            self._init_nvml(nvml)
        else:
            self.unavailable_reason = "NVML disabled"

    # -- NVML set-up ---------------------------------------------------------------------------

    def _init_nvml(self, module: Any) -> None:
        try:
            if module is None:
                import pynvml as module  # nvidia-ml-py
            module.nvmlInit()
            count = module.nvmlDeviceGetCount()
            handles = [module.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            names = [_text(module.nvmlDeviceGetName(h)) for h in handles]
        except Exception as err:  # ImportError, NVMLError_LibraryNotFound, driver/container quirks
            self.unavailable_reason = f"NVML unavailable ({type(err).__name__}: {err})"
            return
        if not handles:
            self.unavailable_reason = "NVML found no GPU"
            return
        self._nvml, self._handles, self._names, self.source = module, handles, names, "nvml"

    @property
    def has_nvml(self) -> bool:
        """True when readings come from NVML."""
        return self._nvml is not None

    # -- one sample ----------------------------------------------------------------------------

    def sample(self, pids_by_run: PidsByRun | None = None) -> DeviceSample:
        """Return one batch of readings for the runs' rank processes (``run -> {rank: pid}``)."""
        pids_by_run = pids_by_run or {}
        if self._nvml is not None:
            try:
                return self._sample_nvml(pids_by_run)
            except Exception as err:  # a GPU fell off the bus, the driver went away: fall back, keep going
                self.unavailable_reason = f"NVML failed ({type(err).__name__}: {err}); using process RSS"
                self.last_error = self.unavailable_reason
                self._nvml, self.source = None, "process-rss"
        return DeviceSample(tuple(self._rss_readings(pids_by_run)), "process-rss")

    def _sample_nvml(self, pids_by_run: PidsByRun) -> DeviceSample:
        nv = self._nvml
        owners = self._owners(pids_by_run)
        now = time.monotonic()
        refresh = now - self._gpu_procs_t >= self.process_interval_s
        readings, procs = [], []
        for i, (handle, name) in enumerate(zip(self._handles, self._names)):
            mem = nv.nvmlDeviceGetMemoryInfo(handle)
            util = _optional(lambda: float(nv.nvmlDeviceGetUtilizationRates(handle).gpu))
            power = _optional(lambda: nv.nvmlDeviceGetPowerUsage(handle) / 1000.0)
            run, ranks = "", ()
            if refresh:
                procs.extend(self._gpu_processes(i, handle, owners))
            on_gpu = [p for p in (procs if refresh else self._gpu_procs) if p.label.endswith(f"GPU{i})")]
            runs = {p.run for p in on_gpu}
            if len(runs) == 1:
                run = runs.pop()
                ranks = tuple(sorted(r for p in on_gpu for r in p.ranks))
            readings.append(DeviceReading(label=f"GPU{i} {name}", kind="gpu", used_bytes=int(mem.used),
                                          total_bytes=int(mem.total), util_pct=util, power_w=power, run=run, ranks=ranks))
        if refresh:
            self._gpu_procs, self._gpu_procs_t = procs, now
        return DeviceSample(tuple(readings + self._gpu_procs), "nvml")

    def _gpu_processes(self, index: int, handle: Any, owners: dict[int, tuple[str, int]]) -> list[DeviceReading]:
        nv = self._nvml
        found = []
        for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            fn = getattr(nv, getter, None)
            if fn is None:
                continue
            try:
                found.extend(fn(handle))
            except Exception:  # not supported on this GPU/driver: device figures still stand
                continue
        out = []
        for p in found:
            owner = owners.get(int(p.pid))
            if owner is None:
                continue
            used = getattr(p, "usedGpuMemory", None)
            run, rank = owner
            out.append(DeviceReading(label=f"{run} rank {rank} (GPU process memory, GPU{index})", kind="process",
                                     used_bytes=int(used) if isinstance(used, int) else 0, run=run, ranks=(rank,)))
        return out

    def _owners(self, pids_by_run: PidsByRun) -> dict[int, tuple[str, int]]:
        """pid -> (run, rank) for every rank pid and its descendants (a rank's pid may be torchrun's
        agent or the worker; CUDA contexts live in the worker)."""
        owners: dict[int, tuple[str, int]] = {}
        for run, ranks in pids_by_run.items():
            for rank, pid in ranks.items():
                owners.setdefault(int(pid), (run, int(rank)))
        for run, ranks in pids_by_run.items():
            shared = len(set(ranks.values())) < len(ranks)  # every rank given as the agent's pid
            for rank, pid in ranks.items():
                for child in _descendants(int(pid)):
                    child_rank = _env_rank(child) if shared else None
                    owners.setdefault(child.pid, (run, child_rank if child_rank is not None else int(rank)))
        return owners

    def _rss_readings(self, pids_by_run: PidsByRun) -> list[DeviceReading]:
        total = psutil.virtual_memory().total
        out = []
        alive = set()
        for run, ranks in pids_by_run.items():
            for rank, pid in sorted(ranks.items()):
                proc = self._proc(int(pid))
                if proc is None:
                    continue
                alive.add(proc.pid)
                try:
                    with proc.oneshot():
                        rss = proc.memory_info().rss
                        cpu = proc.cpu_percent(None)  # since the previous poll (0.0 on the first)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                out.append(DeviceReading(label=f"{run} rank {rank} (process RSS)", kind="process", used_bytes=int(rss),
                                         total_bytes=int(total), util_pct=cpu, run=run, ranks=(int(rank),)))
        for pid in list(self._proc_cache):
            if pid not in alive:
                del self._proc_cache[pid]
        return out

    def _proc(self, pid: int) -> psutil.Process | None:
        proc = self._proc_cache.get(pid)
        if proc is None:
            try:
                proc = self._proc_cache[pid] = psutil.Process(pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                return None
        return proc

    # -- the polling loop ----------------------------------------------------------------------

    def start(self, callback: Callable[[DeviceSample], None],
              pids_by_run: Callable[[], PidsByRun] | PidsByRun | None = None) -> None:
        """Poll every ``interval_s`` on a daemon thread, calling ``callback(sample)``.

        ``pids_by_run`` is a dict or a function returning one (read at each poll, as runs come and
        go). The next poll is scheduled only after the previous one and its callback finished.
        Raises RuntimeError when already started.
        """
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("DeviceSampler already started")
        source = pids_by_run if callable(pids_by_run) else (lambda: pids_by_run or {})  # type: ignore[misc]
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, args=(callback, source), name="shardscope-devices",
                                        daemon=True)
        self._thread.start()

    def _loop(self, callback: Callable[[DeviceSample], None], source: Callable[[], PidsByRun]) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                callback(self.sample(source()))
            except Exception as err:  # a failing subscriber must not end sampling; keep the reason
                self.last_error = f"{type(err).__name__}: {err}"
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - began)))

    def stop(self, timeout: float = 2.0) -> None:
        """Stop polling and wait for the thread to finish its current poll (``sample`` still works)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def close(self) -> None:
        """Stop polling and shut NVML down; later samples use process RSS."""
        self.stop()
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # already shut down, or the driver went away: nothing left to release
                pass
            self._nvml, self.source = None, "process-rss"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _optional(read: Callable[[], float]) -> float | None:
    """An NVML figure some devices do not support (power on some boards): None instead of raising."""
    try:
        return read()
    except Exception:
        return None


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def _env_rank(proc: psutil.Process) -> int | None:
    try:
        return rank_process.rank_of(proc)  # RANK in its environment, or a forked rank's name
    except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
        return None
