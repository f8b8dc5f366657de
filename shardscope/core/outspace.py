"""The output directory's disk: what a comparison will write, whether it fits, and naming a write that failed.

Torch-free; used by the orchestrator (before launching, and when a run fails) and by ranks
(``engines/failure.py``, ``engines/capture.py``).

Trace bytes per profiled step, per rank, measured with
``shardscope run --preset smoke --headless --set steps=13 --set model.n_layers=L`` (L = 2 and 4; CPU,
gloo, torch 2.13.0+cpu, profile.steps 2, record_shapes on, profile_memory off) as the size of
``<run>/traces/tb/rank0.*.pt.trace.json`` (the Chrome trace beside it is a hard link: no extra bytes):

    ddp    L=2: 3,499,102 B   L=4: 5,550,057 B   -> 512,739 B per layer per step, floor 724,312 B per step
    fsdp2  L=2: 4,374,343 B   L=4: 7,119,927 B   -> 686,396 B per layer per step, floor 814,379 B per step

The merged Perfetto trace of the report (3,604,580 B on smoke) holds less than one rank's trace per
run; it is counted as one. The estimate uses FSDP2's figures (its per-parameter collectives make the most events). Records:
5,513 B for 13 steps of rank 0 on smoke (start, step, memory and end records), 424 B per step.
The estimate is a bound to refuse a directory that cannot hold the comparison, never shown as a
measurement; a margin of 25% covers strategies and models not measured here.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from typing import Any

from shardscope.core import model_facts

from shardscope.core.numbers import fmt_bytes
from shardscope.core.rundir import RunDir

DISK_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
               errno.EROFS: "read-only file system"}

TRACE_BYTES_PER_STEP_PER_LAYER = 686_396  # fsdp2 on smoke, above
TRACE_BYTES_FLOOR_PER_STEP = 814_379  # events outside the blocks (embedding, loss, optimizer), fsdp2 on smoke
RECORD_BYTES_PER_STEP = 424  # per rank, smoke, above
REPORT_BYTES = 512 << 10  # summary.json, report.md and plots of smoke: 176,449 B measured, with room
SPARE_BYTES = 1 << 20  # kept free by the orchestrator so that the summary fits after a disk fault
MARGIN = 1.25


def disk_error(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc`` (itself, its cause or context) when the disk is full, read-only or over quota."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in DISK_ERRNOS:
            return cur
        cur = cur.__cause__ or cur.__context__
    return None


def describe(err: OSError) -> str:
    """One line for a disk error: ``no space left on device writing <path>``."""
    what = DISK_ERRNOS.get(err.errno or 0, err.strerror or "write failed")
    return f"{what} writing {err.filename}" if err.filename else what


def filesystem_problem(path: str, *, low_bytes: int = 64 * 1024) -> OSError | None:
    """An OSError naming ``path`` when its filesystem is read-only or has under ``low_bytes`` free, else None."""
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        st = os.statvfs(probe or ".")
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return OSError(errno.EROFS, os.strerror(errno.EROFS), path)
    if st.f_bavail * st.f_frsize < low_bytes:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    return None


@dataclass(frozen=True)
class SpaceEstimate:
    """What a comparison will write, by part, in bytes."""

    traces: int
    records: int
    weights: int
    reports: int

    @property
    def total(self) -> int:
        """All parts together with the margin, plus the orchestrator's spare."""
        return int(MARGIN * (self.traces + self.records + self.weights + self.reports)) + SPARE_BYTES


def estimate(comparison: Any, world_sizes: list[int], weight_bytes: int = 0) -> SpaceEstimate:
    """Estimate what ``comparison`` writes, its runs having ``world_sizes`` ranks (traces dominate). A run with steps
    of its own (the A/A control: fewer, no profiler) counts its own."""
    prof = comparison.profile
    runs = list(getattr(comparison, "runs", []))
    steps = [getattr(r, "steps", 0) or comparison.steps for r in runs] if len(runs) == len(world_sizes) else \
        [comparison.steps] * len(world_sizes)
    profiling = [not getattr(r, "control_of", "") for r in runs] if len(runs) == len(world_sizes) else \
        [True] * len(world_sizes)
    profiled = prof.steps if prof.enabled and prof.start_step + prof.steps <= comparison.steps else 0
    layers = max(1, model_facts.layers(comparison.model))
    per_step = TRACE_BYTES_FLOOR_PER_STEP + TRACE_BYTES_PER_STEP_PER_LAYER * layers
    traced = [ws for ws, on in zip(world_sizes, profiling) if on]
    merged = profiled * len(traced) * per_step  # the report's merged trace
    return SpaceEstimate(traces=profiled * sum(traced) * per_step,
                         records=sum(s * ws for s, ws in zip(steps, world_sizes)) * RECORD_BYTES_PER_STEP,
                         weights=weight_bytes, reports=REPORT_BYTES + merged)


def shortfall(out_dir: str, needed: SpaceEstimate) -> str | None:
    """One line saying why ``out_dir`` cannot hold ``needed`` (short of space or read-only), else None."""
    probe = os.path.abspath(out_dir)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    problem = filesystem_problem(probe, low_bytes=0)
    if problem is not None and problem.errno == errno.EROFS:
        return f"--out {out_dir}: read-only file system"
    free = shutil.disk_usage(probe).free
    if free >= needed.total:
        return None
    return (f"--out {out_dir}: {fmt_bytes(free)} free, the comparison needs about {fmt_bytes(needed.total)} "
            f"(traces {fmt_bytes(needed.traces)}, records {fmt_bytes(needed.records)}, initial weights "
            f"{fmt_bytes(needed.weights)}, reports {fmt_bytes(needed.reports + SPARE_BYTES)}); free space or "
            f"{_hint(needed)}")


def _hint(needed: SpaceEstimate) -> str:
    """What to change for the largest part of the estimate."""
    parts = {"traces": needed.traces, "records": needed.records, "weights": needed.weights}
    largest = max(parts, key=lambda k: parts[k])
    return {"traces": "set profile.enabled=false (the traces are the largest part)",
            "records": "run fewer steps (the records are the largest part: a few hundred bytes per rank and step)",
            "weights": "choose another --out (the initial weights are the largest part)"}[largest]


class Spare:
    """A file of ``SPARE_BYTES`` kept in the output directory and freed when the disk fills,
    so that the verdicts and the summary still fit."""

    def __init__(self, out_dir: str) -> None:
        self.path = RunDir(out_dir).spare

    def reserve(self) -> None:
        """Write the spare file (silently skipped when even that does not fit)."""
        try:
            with open(self.path, "wb") as fh:
                fh.write(b"\0" * SPARE_BYTES)
        except OSError:
            self.release()

    def release(self) -> None:
        """Delete the spare file."""
        try:
            os.remove(self.path)
        except OSError:
            pass
