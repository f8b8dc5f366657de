"""What a one-rank compute probe misses on this machine, measured on the calibration's own runs (CPU, gloo).

``predict --probe`` measures each run's compute in a probe: one rank, on a group whose collectives return at
once, and adds communication from the collective fit. On a CPU a real step of the same run costs more than
that sum: its ranks' gloo threads take CPU from their compute, a rank waiting in a collective is woken through
the kernel, and ranks that share the machine's caches and memory bandwidth slow each other. Interleaved
repeats on a 2-core VM (``benchmarks/RESULTS.md``, stop 39) put 33 of 36 data-parallel runs at 2 ranks
slower than predicted, by a median of about a quarter: a bias, not noise.

The calibration's runs are real runs of this machine, finished: each is probed the way the runs being
predicted are (at its own world size, ``REPEATS`` times, since a probe's speed here moves by ±25% over
seconds) and predicted from each probe. The median of measured / predicted step time is the machine's probe
factor; ``predict`` multiplies the predicted step of a probed run at the same world size by it (the extra time
is reported as ``rest_s``) and says so in the run's notes. Nothing is taken from the runs being predicted.
Runs at another world size get no factor: it was not measured there (4 ranks on 2 cores take turns on the
cores, which ``predict_fit.slowdown`` counts). GPUs get none either: at one rank the probe was within 5% of
real runs on an H200 with no factor (RESULTS, stop 38).

Parent side, torch-free: the probes are ``predict_probe.probe_runs`` subprocesses.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from typing import Any, Callable

from shardscope.analysis import fold
from shardscope.analysis.predict_fit import MachineModel

REPEATS = 3  # probes per calibration run: the median ratio stands against the probe's own scatter


def measure(model: MachineModel, out_dirs: list[str], probe: Callable[..., dict[str, dict[str, Any]]],
            predict_run: Callable[..., dict[str, Any]], repeats: int = REPEATS,
            progress: Callable[[str], None] | None = None) -> MachineModel:
    """Return ``model`` with ``probe_factor`` set from the calibration comparisons ``out_dirs`` (those ``model`` was
    fitted on): ``{"world_size", "factor", "ratios": {run: [measured / predicted, ...]}}``, or unchanged (no factor)
    when the backend is not gloo, the calibration's runs ran at several world sizes, or no run could be probed.
    ``probe(c, progress=...)``: ``predict_probe.probe_runs``; ``predict_run``: ``predict.predict_run``."""
    if model.backend != "gloo":
        return model
    measured = model.fit_error.get("runs", {})
    base = dataclasses.replace(model, probe_factor={})  # each calibration run predicted as with no factor
    ratios: dict[str, list[float]] = {}
    sizes = set()
    for d in out_dirs:
        c = fold.load_comparison(d)
        for _ in range(repeats):
            probes = probe(c, progress=progress)
            for run in c.runs:
                key = run.name if len(out_dirs) == 1 else f"{os.path.basename(os.path.normpath(d))}/{run.name}"
                got = probes.get(run.name) or {}
                if key not in measured or "error" in got:
                    continue
                row = predict_run(c, run, base, probed=got)
                if row["why"] or not row["step_time_s"]:
                    continue
                sizes.add(row["world_size"])
                ratios.setdefault(key, []).append(measured[key]["measured_step_s"] / row["step_time_s"])
    if len(sizes) != 1 or not ratios:
        return model
    factor = statistics.median(x for values in ratios.values() for x in values)
    return dataclasses.replace(model, probe_factor={"world_size": sizes.pop(), "factor": factor, "ratios": ratios})


def applies(model: MachineModel, world_size: int) -> float | None:
    """The probe factor for a probed run at ``world_size``, or None where none was measured."""
    pf = model.probe_factor
    return float(pf["factor"]) if pf and pf.get("world_size") == world_size else None


def note(model: MachineModel, world_size: int) -> str:
    """The sentence a probed run's notes carry about the factor (applied, or why not)."""
    pf = model.probe_factor
    if not pf:
        return ""
    if pf["world_size"] != world_size:
        return (f"no probe factor: it was measured on the calibration's runs at {pf['world_size']} ranks, "
                f"not at {world_size}")
    n = sum(len(v) for v in pf["ratios"].values())
    return (f"step x{pf['factor']:.2f}: what a real step at {world_size} ranks paid beyond its probe's prediction on "
            f"the calibration's own runs ({', '.join(pf['ratios'])}; median of {n} probes)")
