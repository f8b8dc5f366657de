"""Divergence locator: where, when and (likely) why a run's loss leaves the baseline's.

From the step losses of each run and, in parity mode, its ``layers`` records (per-layer gradient
and parameter norms of the full tensors, per step), this finds for every run versus the baseline:

- the first step whose loss differs by more than ``comparison.loss_tolerance``;
- the first step where any layer's gradient norm differs by more than a relative tolerance, and
  which layers do (in model order, with the worst one);
- the first step where a parameter norm differs (parameters at step s carry the updates of s-1);
- likely causes: what differs between the two runs' ``start`` records (precision policy and
  reduce dtype, strategy options such as clipping, activation checkpointing, compile, gradient
  accumulation and micro-batch, initial-weights hash, data order, device and backend).

Pure Python; the orchestrator and ``shardscope report`` call it.
"""

from __future__ import annotations

import math
from typing import Any

from shardscope.core.events import read_records
from shardscope.core.numbers import common_steps, loss_difference
from shardscope.core.rundir import RunFiles
from shardscope.core.numbers import dotted_get

DEFAULT_LAYER_RTOL = 1e-4  # fp32: different reduction orders stay well below this
LOW_PRECISION_LAYER_RTOL = 1e-2  # bf16/fp16 compute

# Start-record fields worth comparing, with why a difference would move the loss.
CAUSES = (
    ("precision.policy", "precision policy differs"),
    ("precision.param", "parameter dtype differs"),
    ("precision.compute", "compute dtype differs"),
    ("precision.reduce", "gradient reduction dtype differs (e.g. bf16 vs fp32 reduce-scatter)"),
    ("precision.master", "master-weight dtype differs"),
    ("precision.loss_scaling", "loss scaling differs"),
    ("grad_clip", "gradient clipping differs"),
    ("spec.options.grad_clip", "gradient clipping differs"),
    ("notes.grad_clip", "gradient clipping differs"),
    ("spec.activation_checkpointing", "activation checkpointing differs (recomputation can change rounding)"),
    ("spec.compile", "torch.compile differs (fused kernels round differently)"),
    ("grad_accum", "gradient accumulation differs (different micro-batch sums)"),
    ("micro_batch_size", "micro-batch size differs"),
    ("init_sha256", "initial weights differ"),
    ("data_order", "data order differs"),
    ("params", "parameter count differs: not the same model"),
    ("tp", "tensor-parallel degree differs (different matmul split and reduction order)"),
    ("dp", "data-parallel degree differs (different gradient reduction order)"),
    ("backend", "communication backend differs"),
    ("device", "device differs"),
)


def likely_causes(base_start: dict[str, Any], run_start: dict[str, Any]) -> list[str]:
    """Return sentences naming what differs between two runs' rank-0 ``start`` records (known fields
    first, then differing strategy options and notes), each with both values."""
    out: list[str] = []
    seen: set[str] = set()
    for key, why in CAUSES:
        a, b = dotted_get(base_start, key), dotted_get(run_start, key)
        if a is None and b is None or a == b:
            continue
        if why in seen and key.endswith("grad_clip"):
            continue
        seen.add(why)
        out.append(f"{why}: {b!r} vs baseline {a!r} ({key})")
    for section in ("spec.options", "notes"):
        a, b = dotted_get(base_start, section) or {}, dotted_get(run_start, section) or {}
        if not isinstance(a, dict) or not isinstance(b, dict):
            continue
        for k in sorted(set(a) & set(b)):
            if a[k] != b[k] and not k.endswith("grad_clip"):
                out.append(f"{section.split('.')[-1]} {k}: {b[k]!r} vs baseline {a[k]!r}")
    if (dotted_get(base_start, "spec.strategy") or "") != (dotted_get(run_start, "spec.strategy") or ""):
        out.append("different strategies reduce gradients in a different order: expect differences at the level "
                   "of rounding (about 1e-7 relative in fp32), not more")
    return out


def first_loss_divergence(base: list[tuple[int, float]], run: list[tuple[int, float]],
                          tolerance: float) -> dict[str, Any] | None:
    """First common step where |loss - baseline loss| > tolerance: ``{step, loss, baseline_loss, abs_diff}``."""
    for step, loss, base_loss in common_steps(sorted(run), base):
        diff = loss_difference(loss, base_loss)  # a NaN is never "equal"
        if diff > tolerance:
            return {"step": step, "loss": loss, "baseline_loss": base_loss, "abs_diff": diff}
    return None


def _rel(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf  # a non-finite norm on either side is a difference
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def first_nonfinite_layer(layers: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """Return ``{step, layer, norm}`` for the first step (and first layer in model order) whose
    gradient norm is inf or nan in a run's ``layers`` records, or None."""
    for step in sorted(layers):
        for layer, norm in (layers[step].get("grad_norms") or {}).items():
            if isinstance(norm, (int, float)) and not math.isfinite(norm):
                return {"step": step, "layer": layer, "norm": float(norm)}
    return None


def first_layer_divergence(base: dict[int, dict[str, Any]], run: dict[int, dict[str, Any]], key: str,
                           rtol: float) -> dict[str, Any] | None:
    """First step where any layer's ``key`` ("grad_norms" | "param_norms") differs by more than ``rtol``.

    ``base``/``run`` map step -> layers record. Returns ``{step, layer (first in model order),
    worst_layer, rel_diff, run_norm, baseline_norm, layers (all beyond rtol, model order)}``.
    """
    for step in sorted(set(base) & set(run)):
        a, b = base[step].get(key) or {}, run[step].get(key) or {}
        beyond = []
        for layer, norm_a in a.items():  # record order is model order
            norm_b = b.get(layer)
            if isinstance(norm_a, (int, float)) and isinstance(norm_b, (int, float)):
                rel = _rel(float(norm_a), float(norm_b))
                if rel > rtol:
                    beyond.append((layer, rel, float(norm_b), float(norm_a)))
        if beyond:
            worst = max(beyond, key=lambda x: x[1])
            first = beyond[0]
            return {"step": step, "layer": first[0], "rel_diff": first[1], "run_norm": first[2],
                    "baseline_norm": first[3], "worst_layer": worst[0], "worst_rel_diff": worst[1],
                    "layers": [x[0] for x in beyond]}
    return None


def read_layers(run_dir: str) -> dict[int, dict[str, Any]]:
    """Return step -> ``layers`` record from a run's rank files (rank 0 first; norms are global)."""
    out: dict[int, dict[str, Any]] = {}
    for path in RunFiles(run_dir).rank_files():
        records, _ = read_records(path)
        for r in records:
            if r.get("kind") == "layers" and "step" in r:
                out.setdefault(int(r["step"]), r)
        if out:
            break
    return out


def layer_rtol_for(base_precision: str, run_precision: str) -> float:
    """Relative tolerance on layer norms: tight (1e-4) when both runs are fp32 or their precisions
    differ (the difference is what we look for); loose (1e-2) when both share a 16-bit policy,
    whose rounding alone moves norms by about 1e-3."""
    if base_precision in ("fp32", "") or base_precision != run_precision:
        return DEFAULT_LAYER_RTOL
    return LOW_PRECISION_LAYER_RTOL


def compare_runs(base_losses: list[tuple[int, float]], run_losses: list[tuple[int, float]],
                 base_layers: dict[int, dict[str, Any]], run_layers: dict[int, dict[str, Any]],
                 base_start: dict[str, Any], run_start: dict[str, Any], *, tolerance: float,
                 layer_rtol: float, parity_on: bool = False) -> dict[str, Any]:
    """Locate the divergence of one run from the baseline; return the run's parity entry with a ``finding`` sentence."""
    loss = first_loss_divergence(base_losses, run_losses, tolerance)
    grad = first_layer_divergence(base_layers, run_layers, "grad_norms", layer_rtol) if base_layers and run_layers else None
    param = first_layer_divergence(base_layers, run_layers, "param_norms", layer_rtol) if base_layers and run_layers else None
    causes = likely_causes(base_start, run_start) if base_start and run_start else []
    entry = {
        "diverged": loss is not None,
        "common_steps": len({s for s, _ in base_losses} & {s for s, _ in run_losses}),
        "first_loss_step": loss["step"] if loss else None,
        "loss": loss,
        "first_grad_layer": grad,
        "first_param_layer": param,
        "layers_recorded": bool(base_layers and run_layers),
        "first_nonfinite_grad_layer": first_nonfinite_layer(run_layers) if run_layers else None,
        "likely_causes": causes,
    }
    entry["finding"] = _finding(entry, tolerance, parity_on)
    return entry


def _finding(e: dict[str, Any], tolerance: float, parity_on: bool = False) -> str:
    parts = []
    if e["loss"]:
        lo = e["loss"]
        parts.append(f"loss first differs at step {lo['step']} (|Δ| {lo['abs_diff']:.3g} > {tolerance:g})")
    elif not e.get("common_steps"):
        parts.append("no common steps with the baseline to compare")
    else:
        parts.append(f"loss within {tolerance:g} of the baseline at all {e['common_steps']} common steps")
    g = e["first_grad_layer"]
    if g:
        parts.append(f"gradient norms first differ at step {g['step']} in {g['layer']} "
                     f"(rel {g['rel_diff']:.2g}; worst {g['worst_layer']})")
    elif e["layers_recorded"]:
        parts.append("per-layer gradient norms agree")
    else:
        parts.append("no per-layer norms recorded (a run ended before writing any)" if parity_on else
                     "no per-layer norms recorded (set parity = true to locate the layer)")
    bad = e.get("first_nonfinite_grad_layer")
    if bad:
        parts.append(f"first non-finite gradient at step {bad['step']} in {bad['layer']} ({bad['norm']})")
    if e["likely_causes"] and (e["loss"] or g):
        parts.append("likely cause: " + e["likely_causes"][0])
    elif e["likely_causes"]:
        parts.append("differences noted: " + e["likely_causes"][0])
    return "; ".join(parts) + "."


def parity_section(comparison: Any, states: dict[str, Any], layers: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """The summary's ``parity`` section: every run against the baseline.

    ``states`` maps run name -> RunState (losses, start records); ``layers`` maps run name ->
    ``read_layers`` output. Returns ``{baseline, tolerance, runs: {name: entry}}``.
    """
    names = [r.name for r in comparison.runs if r.name in states] or list(states)
    if not names:
        return {"baseline": None, "tolerance": comparison.loss_tolerance, "runs": {}}
    baseline = comparison.baseline if comparison.baseline in states else names[0]
    base = states[baseline]
    runs = {}
    for name in names:
        if name == baseline:
            continue
        st = states[name]
        rtol = layer_rtol_for(base.precision, st.precision)
        runs[name] = compare_runs(base.losses, st.losses, layers.get(baseline, {}), layers.get(name, {}),
                                  base.start.get(0, {}), st.start.get(0, {}), tolerance=comparison.loss_tolerance,
                                  layer_rtol=rtol, parity_on=bool(getattr(comparison, "parity", False)))
        runs[name]["layer_rtol"] = rtol
    nonfinite = {name: found for name in names if (found := first_nonfinite_layer(layers.get(name, {})))}
    return {"baseline": baseline, "tolerance": comparison.loss_tolerance, "runs": runs,
            "first_nonfinite_grad_layer": nonfinite}
