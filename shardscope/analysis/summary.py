"""The core of summary.json: per-run results and their comparison with the baseline run.

Keys named in DESIGN.md keep their names and meaning; other modules add sections. Pure Python
(no torch): the orchestrator calls it.
"""

from __future__ import annotations

import math
import time
from typing import Any

from shardscope import config
from shardscope.config import Comparison
from shardscope.core import model_facts
from shardscope.core.numbers import loss_difference, loss_differences, median_rate
from shardscope.profiling import bubble
from shardscope.profiling.state import FINISHED, STOPPED, RunState

SUMMARY_VERSION = 1


def throughput_unit(runs: list[dict[str, Any]]) -> str:
    """Return the unit of the summary runs' median throughput: "tokens/s", "samples/s", or both
    names when runs differ (image models count samples, language models tokens)."""
    units = {"samples/s" if r.get("median_samples_per_s") is not None else "tokens/s" for r in runs
             if r.get("median_samples_per_s") is not None or r.get("median_tokens_per_s") is not None}
    return " or ".join(sorted(units)) if len(units) > 1 else (units.pop() if units else "tokens/s")


def loss_diffs(run: RunState, base: RunState) -> tuple[float | None, float | None, int | None]:
    """Return (max |diff|, mean |diff|, number of common steps) of two runs' losses at common steps
    (None without common steps); a step where either loss is non-finite counts as an infinite difference."""
    diffs = [d for _, d in loss_differences(run.losses, base.losses)]
    if not diffs:
        return None, None, None
    return max(diffs), sum(diffs) / len(diffs), len(diffs)


def loss_stats(run: RunState, base: RunState) -> dict[str, Any]:
    """Return initial/final/min/mean loss of ``run`` (min and mean over its finite losses), how many of
    its losses were non-finite, and its final |difference| from the baseline."""
    values = [loss for _, loss in run.losses]
    finite = [v for v in values if math.isfinite(v)]
    diffs = loss_differences(run.losses, base.losses)
    final_diff = diffs[-1][1] if diffs else None
    return {
        "initial_loss": values[0] if values else None,
        "min_loss": min(finite) if finite else None,
        "mean_loss": sum(finite) / len(finite) if finite else None,
        "nonfinite_losses": len(values) - len(finite),
        "loss_final_abs_diff": final_diff,
    }


def fairness_flags(c: Comparison, run: RunState, base: RunState) -> list[str]:
    """Return human-readable reasons why ``run`` is not like-for-like with the baseline (empty if fair)."""
    flags = []
    if run.precision != base.precision:
        flags.append(f"precision {run.precision} vs baseline {base.precision}")
    if run.tokens_per_step is not None and base.tokens_per_step is not None and run.tokens_per_step != base.tokens_per_step:
        flags.append(f"tokens per step {run.tokens_per_step} vs baseline {base.tokens_per_step}")
    if run.losses and base.losses and run.losses[0][0] == base.losses[0][0] == 0:
        gap = loss_difference(run.losses[0][1], base.losses[0][1])
        if gap > max(c.loss_tolerance, 1e-3 if run.precision != "fp32" or base.precision != "fp32" else 0):
            flags.append(f"step-0 loss differs by {gap:.2e}: initial weights or data order differ")
    hashes = {_start_value(s, "init_sha256") for s in (run, base)}
    if None not in hashes and len(hashes) > 1:
        flags.append("initial weights differ (init_sha256)")
    for key in ("data_order", "global_batch"):
        values = {_start_value(s, key) for s in (run, base)}
        if None not in values and len(values) > 1:
            flags.append(f"{key} differs")
    return flags


def _start_value(state: RunState, key: str) -> Any:
    record = state.start.get(0) or {}
    value = record.get(key)
    return str(value) if value is not None else None


def on_gpu(state: RunState) -> bool:
    """True when the run's memory figures come from the CUDA allocator (else process RSS)."""
    mem0 = state.memory.get(0) or {}
    return "mem_alloc_bytes" in mem0 or str((state.start.get(0) or {}).get("device", "")).startswith("cuda")


def memory_figures(state: RunState, base: RunState) -> dict[str, Any]:
    """The run's memory headline, like with like: ``peak_mem_kind`` (what ``peak_mem_bytes`` is: the CUDA
    allocator's peak, or the process's RSS, which holds the runtime and libraries and is not comparable across
    strategies), ``model_state_bytes`` (rank 0's parameters, gradients and optimizer state, counted exactly),
    and ``mem_ratio`` against the baseline of the comparable quantity named in ``mem_ratio_of``: the
    allocator peak on a GPU, the model states on CPU."""
    gpu = on_gpu(state) and on_gpu(base)
    states, base_states = ((s.memory.get(0) or {}).get("model_state_bytes") for s in (state, base))
    if gpu:
        num, den, of = state.peak_mem_bytes, base.peak_mem_bytes, "allocator peak"
    else:
        num, den, of = states, base_states, "model states"
    return {"peak_mem_kind": "allocator peak" if on_gpu(state) else "process RSS", "model_state_bytes": states,
            "mem_ratio": (num / den) if num and den else None, "mem_ratio_of": of}


def memory_headers(runs: list[dict[str, Any]]) -> tuple[str, str]:
    """Column titles of ``peak_mem_bytes`` and ``mem_ratio`` for these runs: what they really are."""
    kinds = {r.get("peak_mem_kind") for r in runs if isinstance(r, dict)}
    if "process RSS" in kinds:
        return "peak RSS (process)", "model-state ratio"
    if kinds == {"allocator peak"}:
        return "peak mem (allocator)", "peak-mem ratio"
    return "peak mem", "mem ratio"  # a summary written before the kind was recorded


def run_entry(c: Comparison, state: RunState, base: RunState) -> dict[str, Any]:
    """Return the summary entry of one run (core keys plus error and fairness details)."""
    rate, base_rate = median_rate(state.throughput), median_rate(base.throughput)
    max_diff, mean_diff, common = loss_diffs(state, base)
    spec = next((r for r in c.runs if r.name == state.name), None)
    entry: dict[str, Any] = {
        "name": state.name,
        "strategy": state.strategy,
        "world_size": state.world_size,
        "status": state.status if state.status in FINISHED else STOPPED,
        "steps_completed": state.steps_completed,
        "final_loss": state.losses[-1][1] if state.losses else None,
        "median_tokens_per_s": rate if state.unit == "tokens/s" else None,
        "median_samples_per_s": rate if state.unit == "samples/s" else None,
        "peak_mem_bytes": state.peak_mem_bytes,
        "loss_max_abs_diff": max_diff,
        "loss_mean_abs_diff": mean_diff,
        "loss_steps_compared": common,
        "first_nonfinite_step": state.first_nonfinite_step,
        "nonfinite": state.nonfinite_what or None,
        **loss_stats(state, base),
        "speedup": (rate / base_rate) if rate and base_rate else None,
        **memory_figures(state, base),
        "precision": state.precision,
        "options": state.options,
        "tp": (spec and config.registry.get(spec.strategy).tp_degree(state.options)) or 1,
        "control_of": (spec.control_of if spec is not None else "") or None,  # the A/A control of that run
        "fairness_flags": fairness_flags(c, state, base) if state is not base else [],
        "within_tolerance": (max_diff <= c.loss_tolerance) if max_diff is not None else None,
        "invalid_lines": state.invalid_lines,
        "wall_time_s": (state.ended_at - state.started_at) if state.started_at and state.ended_at else None,
    }
    pipeline = bubble.pipeline_entry(state.bubble, (state.start.get(0) or {}).get("notes") or {})
    if pipeline is not None:
        entry["pipeline"] = pipeline
    code = (state.start.get(0) or {}).get("code")
    if isinstance(code, str) and code:  # the strategy's settings as a user pastes them (engines/settings_code)
        entry["code"] = code
    if state.error:
        entry["error"] = state.error
        entry["traceback_tail"] = "\n".join(state.traceback.splitlines()[-15:])
    return entry


def build_summary(c: Comparison, states: dict[str, RunState], out_dir: str) -> dict[str, Any]:
    """Return the core summary dict for a comparison whose runs are folded into ``states``."""
    order = [r.name for r in c.runs if r.name in states] or list(states)
    baseline = c.baseline if c.baseline in states else order[0]
    base = states[baseline]
    runs = [run_entry(c, states[name], base) for name in order]
    return {
        "summary_version": SUMMARY_VERSION,
        "preset": c.name,
        "description": c.description,
        "baseline": baseline,
        "out_dir": out_dir,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "loss_tolerance": c.loss_tolerance,
        "shared": {
            "steps": c.steps, "global_batch": c.global_batch, "grad_accum": c.grad_accum, "seed": c.seed,
            "precision": c.precision, "model": c.shown()["model"], "data": c.shown()["data"],
            "model_label": model_facts.label(c.model), "data_label": model_facts.data_label(c.data, c.model),
        },
        "all_ok": all(r["status"] == "ok" for r in runs),
        "runs": runs,
    }
