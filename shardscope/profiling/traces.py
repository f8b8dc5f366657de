"""Trace analysis: collectives, bytes, bandwidth, compute vs communication, MFU, merged trace.

The pieces: ``trace_reading`` (a rank's trace: steps, collective events, compute), ``collectives``
(what each collective event moves), ``intervals`` (overlap arithmetic) and ``trace_merge`` (one
merged trace for several runs). This module turns them into per-rank and per-run figures.

Reads the Chrome JSON traces torch.profiler exports (``<run>/traces/rank<R>.trace.json``, or
``.json.gz``) with plain Python: no torch, so the orchestrator and ``shardscope report`` can use it.

What torch emits, and so what this module reads (checked on torch 2.13):

- ``ProfilerStep#N`` user annotations on the main thread bound each profiled step.
- The API-level collective is a ``cpu_op`` on the launching thread: ``c10d::allreduce_``,
  ``c10d::_allgather_base_``, ``c10d::_reduce_scatter_base_``, ``c10d::broadcast_``... with
  ``Input Dims`` / ``Input type`` args. With NCCL a ``record_param_comms`` op also carries
  ``Collective name``, ``In msg nelems``, ``Out msg nelems``, ``dtype`` and ``Group size``;
  where present it is preferred. gloo (torch 2.13) emits no ``record_param_comms``.
- The collective's execution: ``gloo:<op>`` annotations on gloo's runloop threads (gloo runs a
  reduce-scatter as an all-reduce, so the launch names the type), or ``nccl*`` GPU kernels.
  Launches and executions are paired in time order; the execution gives the time, the launch
  gives type and size.

Sizes follow nccl-tests: all-reduce and broadcast count the buffer, all-gather the gathered
output, reduce-scatter the full input; algbw = size / time, busbw = algbw x 2(n-1)/n for
all-reduce, x (n-1)/n for all-gather, reduce-scatter and all-to-all, x 1 for broadcast/reduce.

Reading the trace files (and how fast) is ``trace_reading.py``'s; this module only analyses them.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from shardscope.profiling.collectives import dtype_bytes
from shardscope.profiling.intervals import clip, length, overlap, union
from shardscope.profiling.trace_merge import write_merged_trace
from shardscope.core.rundir import RunFiles, read_json_or_none
from shardscope.profiling.trace_reading import (
    RankTrace,
    load_rank_trace,
    rank_trace_paths,
)

__all__ = ["BUS_FACTORS", "RankTrace", "analyse_rank", "analyse_run", "analyse_traces", "combine_ranks",
           "dtype_bytes", "load_rank_trace", "mfu", "peak_flops", "rank_trace_paths", "write_merged_trace"]

BUS_FACTORS = {  # busbw = algbw * factor(n), nccl-tests doc/PERFORMANCE.md
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def analyse_rank(trace: RankTrace) -> dict[str, Any]:
    """Return per-collective counts, bytes, times and bandwidths, and per-step compute/comm/exposed time.

    Figures are per profiled step (averaged over the steps the trace holds). Times in seconds,
    bytes in bytes, bandwidths in GB/s (1e9). Collectives outside the profiled steps are ignored.
    """
    n_steps = trace.window_steps
    inside = [c for c in trace.collectives if c.step is not None or not trace.steps]
    per_type: dict[str, list[Any]] = {}
    own = [c.size_bytes for c in inside if c.instrumentation]  # shardscope's own (parity-mode norms): apart
    for c in inside:
        if not c.instrumentation:
            per_type.setdefault(c.type, []).append(c)
    collectives = {kind: type_row(kind, cs, n_steps) for kind, cs in sorted(per_type.items())}
    unknown = sum((Counter(r["unknown_sizes"]) for r in collectives.values()), Counter())
    steps = []
    comm_all = union((c.start_us, c.start_us + c.dur_us) for c in trace.collectives)
    compute_all = union(trace.compute)
    per_window = 1 if trace.marked_steps else trace.window_steps
    for number, start, end in trace.steps:
        comm = clip(comm_all, start, end)
        compute = clip(compute_all, start, end)
        comm_us = length(comm)
        steps.append({
            "profiler_step": number,
            "step_time_s": (end - start) / 1e6 / per_window,
            "compute_time_s": length(compute) / 1e6 / per_window,
            "comm_time_s": comm_us / 1e6 / per_window,
            "exposed_comm_s": (comm_us - overlap(comm, compute)) / 1e6 / per_window,
        })
    mean = (lambda key: statistics.fmean(s[key] for s in steps) if steps else None)
    return {
        "rank": trace.rank,
        "world_size": trace.world_size,
        "backend": trace.backend,
        "device": trace.device_name,
        "steps_profiled": trace.window_steps,
        "step_markers": trace.marked_steps,
        "compute_source": trace.compute_source,
        "collectives": collectives,
        "steps": steps,
        "per_step": {k: mean(k) for k in ("step_time_s", "compute_time_s", "comm_time_s", "exposed_comm_s")},
        "comm_bytes_per_step": _total(collectives),
        "unknown_sizes": dict(unknown),
        "instrumentation_bytes_per_step": None if None in own else sum(own) / n_steps,
    }


def _total(collectives: dict[str, dict[str, Any]]) -> float | None:
    """Bytes per step over every type; None when a type's size is unknown (a partial sum would look measured)."""
    values = [c["bytes_per_step"] for c in collectives.values()]
    return None if any(v is None for v in values) else sum(values)


def _ops(counts: Counter[str]) -> str:
    return ", ".join(f"{op} ({n}x)" for op, n in sorted(counts.items()))


def type_row(kind: str, cs: list[Any], n_steps: int) -> dict[str, Any]:
    """One collective type's figures per profiled step from its launches ``cs``; a figure that needs a size
    or a group size the trace does not give is None, and ``not_measured`` says why."""
    unknown = Counter(c.op for c in cs if c.size_bytes is None)
    no_group = Counter(c.op for c in cs if not c.group_size)
    secs = sum(c.dur_us for c in cs) / 1e6
    total = None if unknown else sum(c.size_bytes for c in cs)
    groups = sorted({c.group_size for c in cs if c.group_size})
    factor = BUS_FACTORS.get(kind)
    bus = None
    if total is not None and not no_group and factor and secs > 0:
        bus = sum(c.size_bytes * factor(c.group_size) for c in cs) / secs / 1e9
    why: dict[str, str] = {}
    if unknown:
        why["bytes_per_step"] = f"size unknown for {_ops(unknown)}: the trace records neither its buffers nor its group"
    if no_group:
        why["group_size"] = f"group size unknown for {_ops(no_group)}"
    elif len(groups) > 1:
        why["group_size"] = "groups of sizes " + ", ".join(map(str, groups)) + " (group_sizes)"
    if bus is None and factor and secs > 0:
        why["busbw_GBps"] = why.get("bytes_per_step") or why["group_size"]
    return {
        "count_per_step": len(cs) / n_steps,
        "bytes_per_step": None if total is None else total / n_steps,
        "time_per_step_s": secs / n_steps,
        "mean_time_s": secs / len(cs),
        "mean_bytes": None if total is None else total / len(cs),
        "algbw_GBps": total / secs / 1e9 if total is not None and secs > 0 else None,
        "busbw_GBps": bus,
        "group_size": groups[0] if len(groups) == 1 and not no_group else None,
        "group_sizes": groups,
        "dtype": next((c.dtype for c in cs if c.dtype), ""),
        "timed_by": cs[0].timed_by,
        "unknown_sizes": dict(unknown),  # op name -> launches whose size the trace does not give
        "unknown_groups": dict(no_group),  # op name -> launches whose group size the trace does not give
        "not_measured": why,
    }



# --- one run -------------------------------------------------------------------------------------


def combine_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Average per-rank analyses into one run-level figure set (counts and bytes from the mean too)."""
    if not per_rank:
        return {}
    kinds = sorted({k for r in per_rank for k in r["collectives"]})
    collectives = {}
    mean_or_none = (lambda xs: None if not xs or any(x is None for x in xs) else statistics.fmean(xs))
    for kind in kinds:
        rows = [r["collectives"][kind] for r in per_rank if kind in r["collectives"]]
        row: dict[str, Any] = {}
        for key in ("count_per_step", "time_per_step_s", "mean_time_s"):
            row[key] = statistics.fmean(x[key] for x in rows)
        for key in ("bytes_per_step", "mean_bytes", "algbw_GBps", "busbw_GBps"):
            row[key] = mean_or_none([x.get(key) for x in rows])
        sizes = {x.get("group_size") for x in rows}
        row["group_size"] = sizes.pop() if len(sizes) == 1 else None
        row["group_sizes"] = sorted({g for x in rows for g in x.get("group_sizes", [])})
        row["dtype"] = rows[0]["dtype"]
        row["timed_by"] = rows[0]["timed_by"]
        for key in ("unknown_sizes", "unknown_groups"):
            row[key] = dict(sum((Counter(x.get(key, {})) for x in rows), Counter()))
        why: dict[str, str] = {}
        for x in rows:
            for key, reason in (x.get("not_measured") or {}).items():
                why.setdefault(key, reason)
        if row["group_size"] is None and "group_size" not in why:
            why["group_size"] = "ranks differ: groups of sizes " + ", ".join(map(str, row["group_sizes"]))
        row["not_measured"] = {k: v for k, v in why.items() if row.get(k) is None}
        collectives[kind] = row
    per_step = {}
    for key in ("step_time_s", "compute_time_s", "comm_time_s", "exposed_comm_s"):
        vals = [r["per_step"][key] for r in per_rank if r["per_step"].get(key) is not None]
        per_step[key] = statistics.fmean(vals) if vals else None
    return {
        "ranks": len(per_rank),
        "world_size": per_rank[0]["world_size"],
        "backend": per_rank[0]["backend"],
        "device": per_rank[0]["device"],
        "steps_profiled": min(r["steps_profiled"] for r in per_rank),
        "step_markers": all(r["step_markers"] for r in per_rank),
        "compute_source": per_rank[0].get("compute_source", "cpu-operators"),
        "collectives": collectives,
        "per_step": per_step,
        "comm_bytes_per_step": _total(collectives),
        "unknown_sizes": dict(sum((Counter(r.get("unknown_sizes", {})) for r in per_rank), Counter())),
        "instrumentation_bytes_per_step": mean_or_none([r.get("instrumentation_bytes_per_step", 0.0)
                                                        for r in per_rank]),
    }


def analyse_traces(paths: list[str], window_steps: int | None = None) -> dict[str, Any]:
    """Analyse the rank traces at ``paths`` and combine them; ``{}`` when there are none.

    ``window_steps``: steps in a trace without ProfilerStep markers (see ``load_rank_trace``).
    A trace that cannot be read is listed under ``unreadable`` with the reason, never fatal.
    """
    per_rank, unreadable = [], []
    for path in paths:
        try:
            per_rank.append(analyse_rank(load_rank_trace(path, window_steps)))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError) as err:
            unreadable.append(f"{path}: {err}")
    out = combine_ranks(per_rank)
    if out:  # each rank's own work (its compute, waits left out): stragglers judged from the traces
        out["per_rank_compute_s"] = {str(r["rank"]): r["per_step"]["compute_time_s"] for r in per_rank
                                     if r["per_step"].get("compute_time_s") is not None}
    if out or unreadable:
        out["traces"] = list(paths)
        out["unreadable"] = unreadable
    return out


def analyse_run(run_dir: str) -> dict[str, Any]:
    """Communication analysis of one run directory, for summary.json and the TUI's communication panel.

    Reads ``<run_dir>/traces/rank*.trace.json`` and, when present, ``<run_dir>/spec.json`` to compare
    the observed bytes per step with theory (``theory``: bytes, basis, ``ratio`` observed/theory)
    and to compute MFU where the device's peak is known. Returns ``{}`` when the run has no traces.
    """
    spec = read_json_or_none(RunFiles(run_dir).spec)
    window = int(((spec or {}).get("comparison", {}).get("profile", {}) or {}).get("steps", 1) or 1)
    out = analyse_traces(rank_trace_paths(run_dir), window)
    if not out:
        return out
    if spec is not None:
        try:
            from shardscope.profiling import comm_theory

            theory = comm_theory.expected_comm(spec)
        except (OSError, ValueError, KeyError) as err:
            theory = {"error": str(err)}
        if theory.get("bytes_per_step") and out["comm_bytes_per_step"] is not None:
            theory["ratio"] = out["comm_bytes_per_step"] / theory["bytes_per_step"]
        out["theory"] = theory
    if out.get("unknown_sizes"):  # a ratio over a partial sum would look measured: leave it out
        out["note"] = "collective sizes unknown for: " + _ops(Counter(out["unknown_sizes"]))
        if all(c["bytes_per_step"] is None for c in out.get("collectives", {}).values()):
            # gloo's launch events carry sizes only in their recorded input shapes
            out["note"] += " (were the traces recorded without shapes? set profile.record_shapes = true)"
    return out



# --- MFU -----------------------------------------------------------------------------------------

PEAK_TFLOPS = (  # dense bf16/fp16, no sparsity (docs/REFERENCE.md); first match wins
    ("H100 NVL", 835.0), ("H100 PCIE", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0), ("B200", 2250.0),
)


def peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of a device from its name (``"NVIDIA H100 80GB HBM3"``), None when unknown."""
    upper = (device_name or "").upper()
    for key, tflops in PEAK_TFLOPS:
        if all(part in upper for part in key.split()):
            return tflops * 1e12
    return None


def mfu(flops_per_token: float, tokens_per_s: float, n_devices: int, device_name: str) -> float | None:
    """Model FLOPs utilisation: flops_per_token x tokens/s / (devices x peak); None for an unknown device."""
    peak = peak_flops(device_name)
    if peak is None or not n_devices or not tokens_per_s:
        return None
    return flops_per_token * tokens_per_s / (n_devices * peak)

