"""A small model of this machine, fitted on a finished comparison: ``fit(read_calibration(dirs))``.

What is fitted, and from what:

- **Collectives**, per type: time = latency + bytes x bus factor(n) / bus bandwidth (nccl-tests'
  factors, ``traces.BUS_FACTORS``), least squares over every collective the calibration runs really
  did in their profiled steps (size and duration from the traces: gloo's thread or NCCL's kernel). A
  type seen at one size only has no separable latency: its time is charged to bandwidth. A type no
  run did is derived from a measured one (same latency and bus bandwidth) and says so; with no
  collective measured at all there is nothing to derive from. At another group size the latency
  scales with the ring's steps, the bandwidth term with the bus factor.
- **Compute**, per phase: each run's median forward, backward and optimizer time (the step records'
  wall-clock split, steps 1.. outside the profiler window) less the communication the schedule
  (``predict_schedule``) says was exposed in that phase. Forward and backward are fitted on the
  FLOPs per rank (and, given two or more model sizes, on layers x tokens too: a per-layer-and-token
  cost), the optimizer on the elements it steps (and, given two sizes, the tensors); the reference
  is the replicated runs (DDP), else every run.
- **Framework overhead**, per strategy and phase: its compute beyond the reference's, in seconds per
  parameter tensor (hooks, flat-parameter views, DTensor dispatch are per tensor, not per FLOP); a
  strategy the calibration lacks takes its family's, else none, and the prediction says so.
- **The rest**: step time outside the three phases (learning rate, zero_grad, loss read-back).
- On CPU, ranks share the cores with each other and with whatever else runs: each rank gets
  min(1, cores / (ranks + background)) of a core, ``background`` read from the CPU time the calibration's
  ranks got (``background_load``); compute is normalised to a core of its own and scaled back at the
  predicted world size (on an idle machine, ranks beyond the cores slow each other by ranks / cores).

``fit_error``: each calibration run predicted back from the fit, and each collective type's relative
RMS error. Pure Python, no torch.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from shardscope.analysis import fold
from shardscope.profiling import memory_model
from shardscope.analysis.predict.in_step import table as in_step_table
from shardscope.analysis.predict.comm_fit import (  # noqa: F401  (predict_fit.X for callers)
    DERIVABLE, CollectiveFit, bus_factor, fit_collectives, rel_rms, ring_steps, solve,
)
from shardscope.analysis.predict.schedule import simulate
from shardscope.analysis.predict.work import NotPredicted, REPLICATED, Work, work_of
from shardscope.profiling.trace_reading import load_rank_trace, rank_trace_paths
from shardscope.core.rundir import RunDir

PHASE_KEYS = {"forward": "time_forward_s", "backward": "time_backward_s", "optimizer": "time_optimizer_s"}
COMPUTE_BYTES = {4: "fp32", 2: "16-bit"}


@dataclass
class CalibrationRun:
    """What one finished run tells about the machine."""

    out_dir: str
    name: str
    strategy: str
    work: Work | None
    phases: dict[str, float]  # forward / backward / optimizer medians (seconds)
    step_s: float | None
    measured_rate: float | None
    busy_s: float | None  # process CPU time per step (mean over ranks, median over steps; CPU only)
    backend: str
    device: str
    device_name: str
    collectives: list[tuple[str, float, float, int]]  # (type, bytes, seconds, group size): per call, its fastest rank
    why_not: str = ""  # why it cannot calibrate anything ("" when it can)
    cpu_wait_s: float | None = None  # main thread's run-queue wait per step (same statistic as busy_s; Linux CPU)


@dataclass
class MachineModel:
    """The fitted machine: compute coefficients per phase, overheads per strategy and family, collectives."""

    backend: str
    device: str
    device_name: str
    cores: int
    compute_bytes: list[int]  # compute dtypes calibrated (4: fp32, 2: bf16/fp16)
    coefficients: dict[str, dict[str, float]]  # phase -> {"per_flop_s" | "per_element_s", "per_layer_token_s" | "per_tensor_s"}
    overhead: dict[str, dict[str, float]]  # strategy -> phase -> seconds per parameter tensor beyond the reference
    family_overhead: dict[str, dict[str, float]]
    rest_s: float
    background: float  # other busy processes sharing the CPU cores during the calibration (gloo), see background_load
    collectives: dict[str, CollectiveFit]
    runs: list[str]
    families: list[str]
    notes: list[str] = field(default_factory=list)
    fit_error: dict[str, Any] = field(default_factory=dict)
    fwd_flops: list[float] = field(default_factory=list)  # per rank per step, of the runs the compute was fitted on
    comm_cost: dict[str, Any] = field(default_factory=dict)  # predict_comm_cost: real steps' communication / the fit's
    in_step: dict[str, Any] = field(default_factory=dict)  # gloo: the collective job's figures per size (predict_in_step)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def _compute_bytes(precision: str) -> int:
    return memory_model.PRECISION_BYTES.get(precision, (4, 4, 4))[2]


def cpu_share(ranks: int, cores: int, background: float) -> float:
    """The fraction of a core each of ``ranks`` single-threaded ranks gets beside ``background`` other busy
    processes on ``cores`` cores (a fair scheduler): min(1, cores / (ranks + background))."""
    return min(1.0, cores / max(1e-9, ranks + background))


def slowdown(w: Work, backend: str, cores: int, background: float) -> float:
    """How much longer a rank's compute takes than on a core of its own (1 on GPUs)."""
    return 1.0 / cpu_share(w.world_size, cores, background) if backend == "gloo" else 1.0


def read_calibration(out_dirs: list[str], only: list[str] | None = None) -> list[CalibrationRun]:
    """Every run of the finished comparisons ``out_dirs`` (only the runs named in ``only``, when given), their A/A
    controls left out (a short repeat of the baseline: its noise, not another configuration to fit).

    Raises OSError or ValueError when a directory holds no readable comparison.
    """
    out = []
    for d in out_dirs:
        c = fold.load_comparison(d)
        states = fold.replay_states(d)
        for run in c.runs:
            if run.control_of or (only is not None and run.name not in only):
                continue
            st = states.get(run.name)
            out.append(_read_run(d, c, run, st))
    return out


def _read_run(d: str, c: Any, run: Any, st: Any) -> CalibrationRun:
    start = (st.start.get(0) if st else None) or {}
    cal = CalibrationRun(d, run.name, run.strategy, None, {}, None, None, None, str(start.get("backend") or ""),
                         str(start.get("device") or ""), str(start.get("device_name") or ""), [])
    if st is None or st.status != "ok":
        cal.why_not = f"{run.name} did not end ok ({st.status if st else 'no records'})"
        return cal
    try:
        cal.work = work_of(c, run, st.world_size or None)
    except (NotPredicted, KeyError, ValueError) as err:
        cal.why_not = f"{run.name}: {err}"
        return cal
    if cal.work.pipeline is not None:
        cal.why_not = f"{run.name}: a pipeline run does not calibrate (its step is its schedule's span, not phases)"
        return cal
    timed = {s for s, _ in st.throughput if s > 0}  # outside the profiler window, after step 0
    per_step: dict[int, list[dict[str, float]]] = {}
    for rank_steps in st.stragglers.timing.values():
        for s, figures in rank_steps.items():
            if s in timed:
                per_step.setdefault(s, []).append(figures)
    for phase, key in {**PHASE_KEYS, "busy": "busy_s", "cpu_wait": "cpu_wait_s"}.items():
        values = [statistics.fmean(f[key] for f in fs) for fs in per_step.values() if all(key in f for f in fs)]
        if values:
            cal.phases[phase] = statistics.median(values)
    cal.busy_s = cal.phases.pop("busy", None)
    cal.cpu_wait_s = cal.phases.pop("cpu_wait", None)
    steps = [t for s, t in st.step_times if s in timed]
    cal.step_s = statistics.median(steps) if steps else None
    cal.measured_rate = statistics.median(r for s, r in st.throughput if s in timed) if timed else None
    if len(cal.phases) < len(PHASE_KEYS) or cal.step_s is None:
        cal.why_not = f"{run.name}: its step records carry no forward/backward/optimizer split"
    window = max(1, int(c.profile.steps or 1))
    calls: dict[tuple[int, str, int], tuple[str, float, float, int]] = {}
    for path in rank_trace_paths(RunDir(d).run(run.name).path):
        try:
            trace = load_rank_trace(path, window)
        except (OSError, ValueError, KeyError):
            continue
        seen: dict[tuple[int, str], int] = {}
        for col in trace.collectives:
            if col.step is None or col.instrumentation or not col.size_bytes or col.dur_us <= 0:
                continue
            index = seen[(col.step, col.type)] = seen.get((col.step, col.type), -1) + 1
            # Every rank enters each call in program order. A rank that arrives early waits for the last one
            # inside the collective (gloo's thread, NCCL's kernel): the call's own cost is its fastest rank's time.
            key = (col.step, col.type, index)
            item = (col.type, float(col.size_bytes), col.dur_us / 1e6, int(col.group_size or trace.world_size))
            if key not in calls or item[2] < calls[key][2]:
                calls[key] = item
    cal.collectives = list(calls.values())
    return cal


def _comm_fn(fits: dict[str, CollectiveFit], latency_only: bool = False) -> Any:
    def seconds(kind: str, nbytes: float, n: int) -> float:
        """One collective's seconds from its type's fit (only its latency part with ``latency_only``); raises
        NotPredicted without one."""
        fit = fits.get(kind)
        if fit is None:
            raise NotPredicted(f"no {kind} timing: the calibration measured no collective of any type "
                               "(world size 1, or no profiled steps: profile.enabled = false, or "
                               "profile.start_step at or past the last step)")
        return fit.latency_seconds(n) if latency_only else fit.seconds(nbytes, n)
    return seconds


def reference_compute(w: Work, coefficients: dict[str, dict[str, float]]) -> dict[str, float]:
    """The reference's compute per phase for ``w`` (seconds; backward includes a recomputed forward)."""
    def phase(name: str, small: float, big: float) -> float:
        """One phase's seconds from its coefficients."""
        co = coefficients.get(name, {})
        return co.get("per_layer_token_s", co.get("per_tensor_s", 0.0)) * small + co.get("per_flop_s", co.get("per_element_s", 0.0)) * big
    fwd = phase("forward", w.layer_tokens, w.fwd_flops)
    bwd = phase("backward", w.layer_tokens, w.bwd_flops) + (fwd if w.activation_checkpointing else 0.0)
    return {"forward": fwd, "backward": bwd, "optimizer": phase("optimizer", w.optim_tensors, w.optim_elements)}


def _features(w: Work, phase: str) -> tuple[float, float]:
    if phase == "optimizer":
        return float(w.optim_tensors), float(w.optim_elements)
    return w.layer_tokens, w.fwd_flops if phase == "forward" else w.bwd_flops


def _measured_compute(r: CalibrationRun, fits: dict[str, CollectiveFit], overlap: bool) -> dict[str, float]:
    """The run's compute per phase: measured phase time less the communication the schedule exposes there."""
    comp = dict(r.phases)
    assert r.work is not None
    for _ in range(2):  # the exposed time depends (a little, through overlap) on the compute
        timing = simulate(r.work, comp["forward"], comp["backward"], comp["optimizer"], _comm_fn(fits), overlap)
        comp = {p: max(0.1 * r.phases[p], r.phases[p] - timing.exposed_s[p]) for p in PHASE_KEYS}
    return comp


def _timed(runs: list[CalibrationRun]) -> tuple[list[CalibrationRun], bool]:
    """The runs with busy and step times, and whether each of them has its run-queue wait too."""
    timed = [r for r in runs if r.busy_s and r.step_s and r.work is not None]
    return timed, bool(timed) and all(r.cpu_wait_s is not None for r in timed)


def background_load(runs: list[CalibrationRun], cores: int) -> float:
    """Other busy processes the calibration's CPU ranks shared the cores with, from the share of a core its
    ranks got: share = cores / (ranks + background). Where the step records carry ``cpu_wait_s`` (the main
    thread's run-queue wait: ready to run, no core free), share = busy / (busy + cpu_wait), the time they ran
    over the time they wanted to; a rank waiting in a collective is not runnable and does not count. Without
    it, busy over step time, where waits in collectives count as not getting the CPU and the figure leans
    high. 0 without busy times."""
    timed, waits = _timed(runs)
    if not timed:
        return 0.0
    if waits:
        busy = sum(r.busy_s for r in timed)  # type: ignore[misc]
        share = min(1.0, busy / (busy + sum(r.cpu_wait_s for r in timed)))  # type: ignore[misc]
    else:
        share = min(1.0, sum(r.busy_s for r in timed) / sum(r.step_s for r in timed))  # type: ignore[misc]
    ranks = statistics.median(r.work.world_size for r in timed)  # type: ignore[union-attr]
    return max(0.0, cores / share - ranks) if share < min(1.0, cores / ranks) else 0.0


# Notes on this machine's collective fits and its cores' load: a what-if on GPUs uses neither (its collectives come
# from the device table, its compute from FLOPs at a share of the peak), so its assumptions leave them out; "runs
# that communicate are not predicted" was listed above what-if rows that were predicted.
_THIS_MACHINE_NOTES = ("collective", "no collective measured", "the calibration's ranks got")


def about_this_machine(note: str) -> bool:
    """Whether a calibration note concerns only predictions for this machine (its collective fits, its cores' load)."""
    return note.startswith(_THIS_MACHINE_NOTES)


def fit_compute(works: list[Work], measured: list[dict[str, float]], notes: list[str]) -> dict[str, dict[str, float]]:
    """Per phase, seconds per FLOP (optimizer: per element stepped) and, when the runs span two or more
    model sizes, seconds per layer and token (optimizer: per tensor) too, by non-negative least squares."""
    coefficients: dict[str, dict[str, float]] = {}
    two_sizes = len({(w.layer_tokens, w.fwd_flops, w.optim_tensors) for w in works}) > 1
    for phase in PHASE_KEYS:
        rows = [list(_features(w, phase)) for w in works]
        ys = [m[phase] for m in measured]
        if phase == "backward":  # a checkpointed run recomputed its forward inside backward: take it out first
            ys = [y - (reference_compute(w, {**coefficients, "backward": {}, "optimizer": {}})["forward"]
                       if w.activation_checkpointing else 0.0) for y, w in zip(ys, works)]
        small, big = ("per_tensor_s", "per_element_s") if phase == "optimizer" else ("per_layer_token_s", "per_flop_s")
        coef = solve([[1.0, r[1] / r[0]] for r in rows], [y / r[0] for y, r in zip(ys, rows)]) if two_sizes else None
        if coef is not None and coef[0] > 0 and coef[1] > 0:
            coefficients[phase] = {small: coef[0], big: coef[1]}
        else:
            one = solve([[r[1]] for r in rows], ys) or [0.0]
            coefficients[phase] = {big: one[0]}
    if not two_sizes:
        notes.append("one model size calibrated: compute scales with FLOPs (the optimizer with the elements it "
                     "steps) at that size's speed; give --calibrate twice, on two model sizes, to fit a "
                     "per-layer-and-token cost too")
    return coefficients


def fit(runs: list[CalibrationRun], cores: int | None = None,
        collectives: list[tuple[str, float, float, int]] | None = None) -> MachineModel:
    """Fit the machine model on calibration runs (and ``collectives``: (type, bytes, seconds, group) timed apart,
    ``predict_collectives``). Raises NotPredicted when no run can calibrate compute."""
    usable = [r for r in runs if not r.why_not and r.work is not None]
    notes = [f"not used for calibration: {r.why_not}" for r in runs if r.why_not]
    if not usable:
        raise NotPredicted("no calibration run with a per-phase step split ended ok"
                           + (f" ({'; '.join(r.why_not for r in runs if r.why_not)})" if runs else ""))
    backend = statistics.mode(r.backend for r in usable)
    usable = [r for r in usable if r.backend == backend]
    first = usable[0]
    cores = cores or (os.cpu_count() or 1)
    overlap = backend != "gloo"
    timed = {k for k, *_ in collectives or []}
    # On CPU a timed job's figures are each call's cost inside a loop of compute (predict_collectives); a trace's
    # fastest-rank time of the same type leaves out the wake-ups a step pays, so the job's figures replace them.
    traced = [p for r in usable for p in r.collectives if not (backend == "gloo" and p[0] in timed)]
    fits = fit_collectives(traced + list(collectives or []), notes)
    if collectives:
        notes.append(f"collectives also timed by a short torchrun job ({len(collectives)} calls at "
                     f"{sorted({n for *_, n in collectives})} ranks" + (", each call's cost inside a loop of "
                     "compute; the traces' figures of those types left out" if backend == "gloo" else "") + ")")
    if not fits and any(r.work and r.work.world_size > 1 for r in usable):
        notes.append("no collective measured in the calibration's traces: runs that communicate are not predicted")
    background = background_load(usable, cores) if backend == "gloo" else 0.0
    if background > 0.05:
        how = "CPU time / (CPU time + run-queue wait)" if _timed(usable)[1] else "process CPU time / step time"
        notes.append(f"the calibration's ranks got {cpu_share(usable[0].work.world_size, cores, background):.0%} of a "  # type: ignore[union-attr]
                     f"core each ({how}): {background:.1f} other busy processes assumed to share the cores, as then")
    comp: dict[str, dict[str, float]] = {}
    for r in usable:
        try:
            measured = _measured_compute(r, fits, overlap) if fits or r.work.world_size == 1 else dict(r.phases)  # type: ignore[union-attr]
        except NotPredicted:
            measured = dict(r.phases)
        slow = slowdown(r.work, backend, cores, background)  # type: ignore[arg-type]
        comp[r.name + "@" + r.out_dir] = {p: v / slow for p, v in measured.items()}
    reference = [r for r in usable if r.work.family == REPLICATED] or usable  # type: ignore[union-attr]
    if reference is usable and len({r.strategy for r in usable}) > 1:
        notes.append("no replicated (DDP) run to calibrate: the reference compute pools every run")
    key = (lambda r: r.name + "@" + r.out_dir)
    coefficients = fit_compute([r.work for r in reference], [comp[key(r)] for r in reference], notes)  # type: ignore[misc]
    overhead: dict[str, dict[str, float]] = {}
    for strategy in sorted({r.strategy for r in usable}):
        mine = [r for r in usable if r.strategy == strategy]
        tensors = sum(r.work.param_tensors for r in mine)  # type: ignore[union-attr]
        fitted = {p: (sum(comp[key(r)][p] for r in mine) - sum(
            reference_compute(r.work, coefficients)[p] for r in mine)) / tensors for p in PHASE_KEYS}  # type: ignore[arg-type]
        below = {p: v for p, v in fitted.items() if v < 0}
        if below:  # measured faster than the reference's compute of the same FLOPs: noise, not a negative cost
            notes.append(f"{strategy}: its fitted framework overhead would be below zero in "
                         f"{', '.join(sorted(below))} (it measured faster than the reference's compute for the same "
                         "FLOPs, this machine's noise): taken as 0")
        overhead[strategy] = {p: max(0.0, v) for p, v in fitted.items()}
    families: dict[str, list[str]] = {}
    for r in usable:
        families.setdefault(r.work.family, []).append(r.strategy)  # type: ignore[union-attr]
    family_overhead = {fam: {p: statistics.median(overhead[n][p] for n in set(names)) for p in PHASE_KEYS}
                       for fam, names in families.items()}
    rests = [r.step_s - sum(r.phases.values()) for r in usable if r.step_s is not None]
    model = MachineModel(
        backend=backend, device=first.device, device_name=first.device_name, cores=cores,
        compute_bytes=sorted({_compute_bytes(r.work.precision) for r in usable}),  # type: ignore[union-attr]
        coefficients=coefficients, overhead=overhead, family_overhead=family_overhead,
        rest_s=max(0.0, statistics.median(rests)) if rests else 0.0, background=background, collectives=fits,
        runs=[f"{os.path.basename(os.path.normpath(r.out_dir))}/{r.name}" for r in usable],
        families=sorted(families), notes=notes, fwd_flops=sorted({r.work.fwd_flops for r in reference}))  # type: ignore[union-attr]
    model.fit_error = {"collectives": {k: f.rel_rms_error for k, f in fits.items() if f.source == "measured"}}
    if backend == "gloo" and collectives:
        model.in_step = in_step_table(collectives)
    return model
