"""The recommendation at a world size that was not run: every run of a finished comparison predicted at
N ranks (``analysis.predict``, calibrated on the comparison itself), ranked by predicted tokens/s, each ratio
beside the error the calibration measured on this machine (each of its runs predicted back against its
measurement). A what-if on GPUs (``device``) has no error measured here and says so. Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses

from typing import Any

from shardscope.config import Comparison
from shardscope.core import batch_follow
from shardscope.core.numbers import fmt_bytes
from shardscope.analysis.predict import predictor as predict
from shardscope.analysis.predict.devices import DeviceSpec


def comparison_at(c: Comparison, world_size: int) -> tuple[Comparison, list[str]]:
    """``c`` at ``world_size`` ranks, the global batch following so that each rank's micro-batch stays (as
    ``--set world_size=N`` does); runs with their own world size keep it. Returns it and the notes."""
    before = c.to_dict()
    after = {**before, "world_size": world_size}
    notes = batch_follow.follow_world_size(before, after, [["world_size"]])
    return Comparison.from_dict(after), notes


def _fit_error(errors: dict[str, Any], names: list[str], what_if: bool) -> str:
    """The error each run's calibration showed on this machine (its step time predicted back), or why none."""
    if what_if:
        return "what-if: error not measured"
    parts = []
    for name in names:
        e = (errors.get(name) or {}).get("error")
        parts.append(f"{name} {e:+.0%}" if e is not None else f"{name} not in the calibration: error not measured")
    return "fit error here: " + ", ".join(parts)


def at_scale(out_dir: str, world_size: int, device: DeviceSpec | None = None,
             device_memory_bytes: int | None = None) -> dict[str, Any]:
    """Predict every run of the comparison in ``out_dir`` at ``world_size`` ranks (this machine, or ``device``
    GPUs as a what-if). Returns ``{"world_size", "device", "fastest", "runs": {name: tokens_per_s (samples_per_s for an image model), bound,
    peak_mem_bytes, fits, why}, "lines", "notes", "assumptions", "fit_error"}``.

    Raises NotPredicted when the comparison cannot calibrate the machine, OSError/ValueError when ``out_dir`` is
    not a finished comparison."""
    from shardscope.analysis import fold

    loaded = fold.load_comparison(out_dir)  # the A/A control is the baseline again: never a candidate
    loaded = dataclasses.replace(loaded, runs=[r for r in loaded.runs if not r.control_of])
    c, notes = comparison_at(loaded, world_size)
    model = predict.calibrate([out_dir])
    result = predict.predict_comparison(c, model, device)
    errors = (model.fit_error or {}).get("runs") or {}
    where = (f"at {world_size} ranks of {device.name} (what-if, not measured here)" if device
             else f"at {world_size} ranks (this machine's calibration)")
    rows = [r for r in result["runs"] if not r["why"] and predict.rate(r)]
    rows.sort(key=lambda r: -predict.rate(r))  # type: ignore[operator]
    lines: list[str] = []
    per_run: dict[str, Any] = {}
    for r in result["runs"]:
        fits = (None if device_memory_bytes is None or r["peak_mem_bytes"] is None
                else r["peak_mem_bytes"] <= device_memory_bytes)
        per_run[r["name"]] = {"tokens_per_s": r["tokens_per_s"], "samples_per_s": r.get("samples_per_s"), "bound": r["bound"], "world_size": r["world_size"],
                              "peak_mem_bytes": r["peak_mem_bytes"], "fits": fits, "why": r["why"]}
    fitting = [r for r in rows if per_run[r["name"]]["fits"] is not False]
    fastest = fitting[0] if fitting else None
    if fastest is None:
        lines.append(f"{where}: no run predicted" + (" that fits" if rows else ""))
    else:
        bound = "≤ " if fastest["bound"] else ""
        lines.append(f"{where}: fastest predicted{' that fits' if device_memory_bytes else ''} {fastest['name']} "
                     f"({bound}{predict.rate(fastest):,.0f} {predict.unit(fastest)}; "
                     f"{_fit_error(errors, [fastest['name']], device is not None)})")
        for r in fitting[1:]:
            pair = _fit_error(errors, [fastest["name"], r["name"]], device is not None)
            if fastest["bound"] or r["bound"]:
                loose = fastest["name"] if fastest["bound"] else r["name"]
                lines.append(f"{fastest['name']} vs {r['name']}: no ratio predicted ({loose}'s {predict.unit(r)} is only an "
                             "upper bound: its framework overhead was not calibrated)")
                continue
            lines.append(f"{where}: {fastest['name']} is predicted {predict.rate(fastest) / predict.rate(r):.2f}× "  # type: ignore[operator]
                         f"{r['name']} ({predict.rate(fastest):,.0f} vs {predict.rate(r):,.0f} {predict.unit(r)}; {pair})")
    for r in result["runs"]:
        entry = per_run[r["name"]]
        if entry["why"]:
            lines.append(f"{r['name']}: not predicted {where}: {entry['why']}")
        elif entry["fits"] is False:
            lines.append(f"{r['name']}: predicted {fmt_bytes(entry['peak_mem_bytes'])} per rank {where}, over "
                         f"{fmt_bytes(device_memory_bytes)}")
    if fastest is not None and device is None:
        lines.append("caveat: the fit error is in-sample (the calibration's own runs, predicted back); "
                     "benchmarks/predict_accuracy.py measures the error on runs it was not fitted on")
    return {"world_size": world_size, "device": device.name if device else None,
            "fastest": fastest["name"] if fastest else None, "runs": per_run, "lines": lines, "notes": notes,
            "assumptions": result["assumptions"], "fit_error": model.fit_error}
