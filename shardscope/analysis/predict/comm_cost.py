"""What a real step pays for its collectives on a CPU, measured on the calibration's own runs (gloo).

``predict --probe`` measures each run's compute in a one-rank probe and adds the communication the collective
fit and the strategy's schedule place in the step. On a CPU with one core per rank a real step pays more for
its collectives than that fit says: gloo's thread takes its CPU from the compute (nothing overlaps), a rank
waiting in a call is woken through the kernel, and every blocking call makes the faster rank wait for the slower
one. Interleaved repeats on a 2-core VM (``benchmarks/RESULTS.md``, 2026-11-27) found 31 of 33 data-parallel runs at
2 ranks slower than predicted, and none at 1 rank, where no collective moves data; what the steps were missing was
about as large again as the communication predicted for them.

A factor on the whole step (the 2026-11-27 "probe factor") over-corrected larger models, whose communication is a
smaller share of the step. This factor is on the communication only: the calibration's runs are real runs of
this machine, finished; each is probed as the runs being predicted are (at its own world size, ``REPEATS``
times, since a probe's speed here moves by ±25% over seconds) and predicted from each probe. What its real
step took beyond the predicted compute and rest is what it paid for communication; summed over the runs and
probes, less the exposed communication predicted for them, it is what the steps paid beyond the fit. That
excess is put on the latency part of their communication (each call's latency x ring steps, not its bytes over
the bandwidth): a blocking call on gloo costs a step a wake-up and a wait for the slower rank whatever its size,
while the fit's bandwidth is already what a call of its size adds to a loop of compute (``predict_collectives``).
The factor is ``1 + excess / latency part``; ``predict`` adds ``(factor - 1) x`` the latency part of a probed
run's exposed communication at the same world size and says so in the run's notes. Where the collective job
ran, the blocking calls of exact bytes (tensor-parallel activations, the gradient norm) are priced at its in-step
figures and have no latency part (``predict_in_step``), in the calibration's runs and in the predicted ones.
2026-11-27 multiplied the whole exposed communication instead: fitted on smoke's small calls (x1.5-5.8), that made
the large all-gathers of fsdp-impls' 768-wide model cost more than their measured steps left for them (every FSDP
run there 16-52% slow). Nothing is taken from the runs being predicted. The factor is measured at one world
size, the one most of the calibration's runs ran at (the others are named as left out); runs at another world
size get none (not measured there); GPUs get none (at one rank the probe was within 5% of real runs on an H200,
RESULTS 2026-11-27).

Parent side, torch-free: the probes are ``predict_probe.probe_runs`` subprocesses.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from shardscope.analysis import fold
from shardscope.analysis.predict.fit import MachineModel

REPEATS = 3  # probes per calibration run: the sums stand against the probe's own scatter
LATENCY_SHARE = 0.05  # a latency part below this share of the exposed communication cannot carry the excess


def measure(model: MachineModel, out_dirs: list[str], probe: Callable[..., dict[str, dict[str, Any]]],
            predict_run: Callable[..., dict[str, Any]], repeats: int = REPEATS,
            progress: Callable[[str], None] | None = None) -> MachineModel:
    """Return ``model`` with ``comm_cost`` set from the calibration comparisons ``out_dirs`` (those ``model`` was
    fitted on): ``{"world_size", "factor", "paid_s", "predicted_s", "runs": {run: [paid / predicted per probe]}}``,
    ``latency_s`` and ``left_out`` ({world size: [runs]} of calibration runs at other world sizes than the one with
    the most runs, where the factor is measured), or unchanged (no factor) when the backend is not gloo, the
    calibration's runs ran at one rank, or no run could be probed. ``probe(c, progress=...)``:
    ``predict_probe.probe_runs``; ``predict_run``: ``predict.predict_run``."""
    if model.backend != "gloo":
        return model
    measured = model.fit_error.get("runs", {})
    base = dataclasses.replace(model, comm_cost={})  # each calibration run predicted as with no factor
    sums: dict[int, dict[str, Any]] = {}  # world size -> paid, predicted, latency, runs
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
                if row["why"] or not row["step_time_s"] or not row["exposed_comm_s"] or row.get("comm_latency_s") is None:
                    continue
                at = sums.setdefault(row["world_size"], {"paid": 0.0, "predicted": 0.0, "latency": 0.0, "runs": {}})
                paid = measured[key]["measured_step_s"] - (row["step_time_s"] - row["exposed_comm_s"])
                at["paid"] += paid
                at["predicted"] += row["exposed_comm_s"]
                at["latency"] += row["comm_latency_s"]
                at["runs"].setdefault(key, []).append(paid / row["exposed_comm_s"])
    if not sums:
        return model
    # One factor, at the world size most runs ran at (the fewer ranks on a tie): parity's tensor-parallel runs at 4
    # ranks beside the rest at 2 are left out and named. The excess goes on the latency part (module docstring).
    size = min(sums, key=lambda n: (-len(sums[n]["runs"]), n))
    at = sums[size]
    left_out = {str(n): sorted(v["runs"]) for n, v in sums.items() if n != size}
    # A fit that could not separate latency (one message size per type: all its time charged to bandwidth) leaves a
    # latency part of ~0: a factor on it explodes (x2.3e15 measured on the pipeline preset, 2026-11-28) and adds
    # nothing. Below LATENCY_SHARE of the exposed communication the excess goes on the whole exposed part instead.
    on = "latency" if at["latency"] >= LATENCY_SHARE * at["predicted"] else "exposed"
    factor = max(0.0, 1.0 + (at["paid"] - at["predicted"]) / at["latency" if on == "latency" else "predicted"])
    return dataclasses.replace(model, comm_cost={"world_size": size, "factor": factor, "on": on, "paid_s": at["paid"],
                                                 "predicted_s": at["predicted"], "latency_s": at["latency"],
                                                 "runs": at["runs"], "left_out": left_out})


def extra_s(model: MachineModel, world_size: int, exposed_s: float, latency_s: float) -> float:
    """What a probed run at ``world_size`` pays for its collectives beyond the fit's ``exposed_s``: the factor's
    share of their latency part ``latency_s``; 0 where no factor was measured at that world size. At least
    ``-exposed_s`` (a step never pays less than nothing for its collectives)."""
    cc = model.comm_cost
    if not cc or cc.get("world_size") != world_size:
        return 0.0
    return max(-exposed_s, (float(cc["factor"]) - 1.0) * (exposed_s if cc.get("on") == "exposed" else latency_s))


def note(model: MachineModel, world_size: int, extra: float | None = None) -> str:
    """The sentence a probed run's notes carry about the factor (applied, or why not); ``extra``: the seconds a step
    of the run pays for it (``extra_s``)."""
    cc = model.comm_cost
    if not cc:
        return ""
    if cc["world_size"] != world_size:
        return (f"exposed communication as fitted: its cost in a real step was measured on the calibration's runs "
                f"at {cc['world_size']} ranks, not at {world_size}")
    n = sum(len(v) for v in cc["runs"].values())
    paid = f"communication +{extra * 1e3:,.1f} ms a step, " if extra is not None else ""
    return (f"{paid}{_what(cc)} x{cc['factor']:.2f}: what the calibration's own real steps at {world_size} ranks "
            f"paid for their collectives beyond the fit, put on {_where(cc)} ({', '.join(cc['runs'])}; {n} probes)")


def _what(cc: dict) -> str:
    return "exposed communication" if cc.get("on") == "exposed" else "collective latency"


def _where(cc: dict) -> str:
    return ("the whole exposed communication (the fit could not separate the calls' latency from their bytes)"
            if cc.get("on") == "exposed" else "the calls' latency part")


def assumption(model: MachineModel) -> str:
    """The sentence the prediction's assumptions carry when a factor was measured."""
    cc = model.comm_cost
    per_run = ", ".join(f"{k} {sorted(v)[len(v) // 2]:.2f}" for k, v in cc["runs"].items())
    return (f"probed runs at {cc['world_size']} ranks: {_what(cc)} x{cc['factor']:.2f}: the calibration's own "
            f"steps paid {cc['paid_s'] * 1e3:,.1f} ms for their collectives where the fit placed "
            f"{cc['predicted_s'] * 1e3:,.1f} ms, {cc.get('latency_s', 0.0) * 1e3:,.1f} ms of it the calls' latency, "
            f"summed over their probes (paid / fit, median per run: {per_run}); the difference is put on "
            + ("the latency part, the bytes' part stays as fitted" if cc.get("on") != "exposed" else _where(cc))
            + "; none at other world sizes (predict/comm_cost.py)"
            + "".join(f"; the calibration's runs at {n} ranks ({', '.join(runs)}) are left out: one factor is "
                      f"measured at one world size" for n, runs in cc.get("left_out", {}).items()))
