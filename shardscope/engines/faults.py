"""Fault injection for tests and demos: ``run.fault = "rank=1,step=3,kind=..."``.

At the start of the given step, on the given rank:

- ``raise``: raises RuntimeError (the worker writes an error record);
- ``exit`` (``kind=exit,code=0``): ``os._exit(code)``, 3 by default (no records, like a crash, or a library's
  ``sys.exit`` deep inside a step);
- ``hang``: sleeps forever (like a deadlock; the orchestrator's stall timeout must kill it);
- ``skip``: every rank but the given one enters an all-reduce (on a process group of the fault's own, made at
  start-up) that the given rank skips, as a rank taking another branch would; it goes on into the step's own
  collectives and waits there for peers that wait for it: a deadlock the stall verdict must untangle;
- ``oom``: raises torch's ``OutOfMemoryError``, as a CUDA allocation that does not fit does;
- ``memlimit``: caps the rank's address space (RLIMIT_AS) just above what it uses, then allocates
  1 GiB: the allocator fails as it does on a host without memory;
- ``oomkill``: moves the rank into a memory cgroup (v1 or v2; needs root) limited just above its
  use and touches more than that limit, so the kernel's OOM killer SIGKILLs it; raises RuntimeError where no
  cgroup can be made;
- ``nospace``: from this step on the rank's record writer fails with ENOSPC, as on a full disk,
  until the rank frees its reserved spare (what it does to write its last records);
- ``netdrop``: the rank's TCP connection to node 0's record server (no shared filesystem) drops; the
  rank reconnects and resends from the last acknowledged record;
- ``slow`` (``kind=slow,ms=50``): the rank's device does ``ms`` more milliseconds of work in every
  step from the given one on, like a slower device: matrix products on CPU (``ms`` of CPU time, and
  operators the trace counts as compute; a rank that only slept would look like one waiting in a
  collective), a spinning kernel on CUDA (``torch.cuda._sleep``, calibrated once with CUDA events, so
  the host goes on launching and the GPU is the slow part, as with a slow GPU).
"""

from __future__ import annotations

import errno
import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from shardscope.config import parse_fault

_GIB = 1 << 30


@dataclass(frozen=True)
class Fault:
    """One injected fault; ``writer`` is the rank's RecordWriter (for ``nospace``)."""

    rank: int
    step: int
    kind: str  # one of config.FAULT_KINDS
    ms: int = 100  # kind "slow": extra busy milliseconds per step
    code: int = 3  # kind "exit": the exit code
    writer: Any = None
    group: Any = None  # kind "skip": the process group of the collective the rank skips (``prepare``)

    @staticmethod
    def parse(text: str, writer: Any = None) -> "Fault | None":
        """Return the fault described by ``text``, or None for an empty spec; raises ValueError."""
        if not text.strip():
            return None
        spec = parse_fault(text)
        return Fault(spec["rank"], spec["step"], spec["kind"], ms=spec.get("ms", 100), code=spec.get("code", 3),
                     writer=writer)

    def prepare(self) -> "Fault":
        """Return the fault ready to fire: ``skip`` makes its process group (every rank calls this, in order)."""
        if self.kind != "skip":
            return self
        import dataclasses

        import torch.distributed as dist

        return dataclasses.replace(self, group=dist.new_group(list(range(dist.get_world_size()))))

    def maybe_fire(self, rank: int, step: int, device: torch.device | None = None) -> None:
        """Fire the fault if (rank, step) match (see the module docstring for each kind)."""
        if self.kind == "skip":
            if step == self.step and rank != self.rank:
                import torch.distributed as dist

                dist.all_reduce(torch.zeros(1, device=device), group=self.group)
            return
        if self.kind == "slow":
            if rank == self.rank and step >= self.step:
                _device_work(self.ms, device or torch.device("cpu"))
            return
        if rank != self.rank or step != self.step:
            return
        if self.kind == "netdrop":
            if self.writer is None or self.writer.forward is None:
                raise RuntimeError("netdrop: this rank sends no records over TCP (launch.records_endpoint unset)")
            self.writer.forward.drop_connection()
            print(f"shardscope: fault netdrop: rank {rank} dropped its record connection at step {step}",
                  file=sys.stderr, flush=True)
            return
        if self.kind == "raise":
            raise RuntimeError(f"injected fault at step {step} on rank {rank}")
        if self.kind == "exit":
            sys.stderr.flush()
            os._exit(self.code)
        if self.kind == "oom":
            raise torch.OutOfMemoryError(f"injected: tried to allocate 1.00 GiB at step {step} on rank {rank}")
        if self.kind == "memlimit":
            vms = psutil.Process().memory_info().vms
            resource.setrlimit(resource.RLIMIT_AS, (vms + 256 * (1 << 20), resource.RLIM_INFINITY))
            torch.ones(_GIB // 4, dtype=torch.float32)
            return
        if self.kind == "oomkill":
            limit = psutil.Process().memory_info().rss + 64 * (1 << 20)
            _join_limited_cgroup(limit)
            # More than the whole limit, written so resident: the limit is hit whether or not the rank's
            # earlier pages moved with it (a cgroup charges only new pages unless told to move them; a
            # fixed 1 GiB fitted under the limit of a rank whose CUDA libraries made its RSS near 1 GiB).
            torch.ones((limit + _GIB // 4) // 4, dtype=torch.float32)
            raise RuntimeError("oomkill: the memory cgroup limit did not stop this rank")
        if self.kind == "nospace":
            self.writer.inject_error(errno.ENOSPC)
            return
        while True:  # "hang": never returns; only a signal ends it
            time.sleep(3600)


_SPIN_CYCLES_PER_MS: dict[int, float] = {}  # CUDA device index -> torch.cuda._sleep cycles per millisecond


def _device_work(ms: int, device: torch.device) -> None:
    """``ms`` milliseconds of work on ``device`` (the ``slow`` fault)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _SPIN_CYCLES_PER_MS:  # once per process: one sync, in the fault's first step
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(50_000_000)
            end.record()
            end.synchronize()
            _SPIN_CYCLES_PER_MS[index] = 50_000_000 / max(start.elapsed_time(end), 1e-3)
        torch.cuda._sleep(int(_SPIN_CYCLES_PER_MS[index] * ms))
        return
    # A fixed amount of work (CPU time, not wall time): a slow device is slow by its own work, however
    # busy the machine's other processes keep the cores.
    a = torch.full((256, 256), 1.0 / 256)
    until = time.process_time() + ms / 1000
    while time.process_time() < until:
        a = a @ a  # stays finite: a is doubly stochastic


def _join_limited_cgroup(limit_bytes: int) -> None:
    """Move this process into a new memory cgroup limited to ``limit_bytes`` (v2, else v1)."""
    name = f"shardscope-oomkill-{os.getpid()}"
    candidates = [("/sys/fs/cgroup", "memory.max", "memory.swap.max"),
                  ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.memsw.limit_in_bytes")]
    for root, limit_file, swap_file in candidates:
        if not os.path.exists(os.path.join(root, limit_file if root.endswith("memory") else "cgroup.controllers")):
            continue
        path = os.path.join(root, name)
        try:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, limit_file), "w") as fh:
                fh.write(str(limit_bytes))
            try:  # no swapping around the limit
                with open(os.path.join(path, swap_file), "w") as fh:
                    fh.write(str(limit_bytes) if root.endswith("memory") else "0")
            except OSError:
                pass
            with open(os.path.join(path, "cgroup.procs"), "w") as fh:
                fh.write(str(os.getpid()))
            return
        except OSError:
            continue
    raise RuntimeError("oomkill: no memory cgroup could be made here (needs root and a cgroup memory controller)")
