"""Trace analysis: collectives, bytes, bandwidth, compute vs communication, MFU.

The pieces: ``trace_reading`` reads a rank's Chrome trace (steps, collective events, compute),
``collectives`` sizes and times every collective, ``trace_merge`` writes one merged trace for
several runs, ``comm_theory`` predicts the bytes. This module turns them into per-rank and
per-run figures for summary.json, the report and the app.

Sizes follow nccl-tests: all-reduce and broadcast count the buffer, all-gather the gathered
output, reduce-scatter the full input; algbw = size / time, busbw = algbw x 2(n-1)/n for
all-reduce, x (n-1)/n for all-gather, reduce-scatter and all-to-all, x 1 for broadcast/reduce.
A size the trace does not give is None (``unknown_ops`` says which op and why), never 0.
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

from shardscope.profiling.collectives import BUS_FACTORS, dtype_bytes, per_type
from shardscope.profiling.intervals import clip, length, overlap, union
from shardscope.profiling.trace_reading import RankTrace, load_rank_trace, rank_trace_paths
from shardscope.profiling.trace_merge import write_merged_trace

__all__ = ["BUS_FACTORS", "dtype_bytes", "load_rank_trace", "rank_trace_paths", "write_merged_trace", "analyse_rank",
           "combine_ranks", "analyse_traces", "analyse_run", "peak_flops", "mfu"]


def analyse_rank(trace: RankTrace) -> dict[str, Any]:
    """Return per-collective counts, bytes, times and bandwidths, and per-step compute/comm/exposed time.

    Figures are per profiled step (averaged over the steps the trace holds). Times in seconds,
    bytes in bytes, bandwidths in GB/s (1e9). Collectives outside the profiled steps, and
    those of shardscope's own measuring (``comm_count.instrument``), are left out.
    """
    inside = [c for c in trace.collectives if c.step is not None or not trace.steps]
    collectives = per_type([c for c in inside if not c.instrument], trace.window_steps)
    instrument = sum(c.instrument for c in inside) / trace.window_steps
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
        "collectives": collectives,
        "steps": steps,
        "per_step": {k: mean(k) for k in ("step_time_s", "compute_time_s", "comm_time_s", "exposed_comm_s")},
        "comm_bytes_per_step": total_bytes(collectives),
        "instrument_collectives_per_step": instrument,  # parity-mode norms' own collectives, left out
    }


def total_bytes(collectives: dict[str, dict[str, Any]]) -> float | None:
    """Bytes per step over every collective type; None when any type's size is unknown."""
    values = [c["bytes_per_step"] for c in collectives.values()]
    return None if any(v is None for v in values) else float(sum(values))



# --- one run -------------------------------------------------------------------------------------


def combine_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Average per-rank analyses into one run-level figure set (counts and bytes from the mean too)."""
    if not per_rank:
        return {}
    kinds = sorted({k for r in per_rank for k in r["collectives"]})
    collectives = {}
    for kind in kinds:
        rows = [r["collectives"][kind] for r in per_rank if kind in r["collectives"]]
        row: dict[str, Any] = {}
        for key in ("count_per_step", "time_per_step_s", "mean_time_s", "known_bytes_per_step"):
            row[key] = statistics.fmean(x[key] for x in rows)
        for key in ("bytes_per_step", "mean_bytes", "algbw_GBps", "busbw_GBps"):
            vals = [x[key] for x in rows]
            row[key] = None if any(v is None for v in vals) else statistics.fmean(vals)
        row["unknown_ops"] = {k: v for x in rows for k, v in x["unknown_ops"].items()}
        row["group_size"] = max(x["group_size"] for x in rows)
        row["dtype"] = rows[0]["dtype"]
        row["timed_by"] = rows[0]["timed_by"]
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
        "collectives": collectives,
        "per_step": per_step,
        "comm_bytes_per_step": total_bytes(collectives),
        "instrument_collectives_per_step": statistics.fmean(r.get("instrument_collectives_per_step", 0)
                                                            for r in per_rank),
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
        except (OSError, ValueError, KeyError) as err:
            unreadable.append(f"{path}: {err}")
    out = combine_ranks(per_rank)
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
    spec = None
    spec_path = os.path.join(run_dir, "spec.json")
    if os.path.isfile(spec_path):
        try:
            with open(spec_path, encoding="utf-8") as fh:
                spec = json.load(fh)
        except (OSError, ValueError):
            spec = None
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
    unknown = sorted({op for c in out.get("collectives", {}).values() for op in c["unknown_ops"]})
    if unknown:
        out["note"] = "collective sizes unknown for " + "; ".join(unknown)
    return out



# --- MFU -----------------------------------------------------------------------------------------

PEAK_TFLOPS = (  # dense bf16/fp16, no sparsity (REFERENCE.md); first match wins
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

