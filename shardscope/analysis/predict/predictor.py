"""Step time, tokens/s and peak memory of every run of a comparison, predicted from a machine model.

``calibrate(dirs)`` fits a ``predict_fit.MachineModel`` on finished comparisons of this machine and
predicts each calibration run back (its own fit error); ``predict_comparison(c, model)`` predicts every
run of ``c``: its work (``predict_work``), this machine's compute per phase with the strategy's
measured framework overhead, its collectives played out on its schedule (``predict_schedule``), the
loop's rest, and the memory model's peak. ``device=`` turns it into a what-if on a GPU of the table
(``predict_devices``). A run the model cannot support gets ``why`` and null figures, never a guess.
Pure Python, no torch.
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterable

from shardscope.config import Comparison, RunSpec
from shardscope.profiling import memory_model
from shardscope.analysis.predict.devices import ADAMW_BYTES_PER_ELEMENT, ASSUMED_MFU, DeviceSpec
from shardscope.analysis.predict.fit import (
    PHASE_KEYS, MachineModel, _comm_fn, _compute_bytes, about_this_machine, fit, slowdown, read_calibration,
    reference_compute, ring_steps, bus_factor,
)
from shardscope.analysis.predict import comm_cost
from shardscope.analysis.predict import in_step, pipeline
from shardscope.analysis.predict.schedule import simulate
from shardscope.analysis.predict.work import FAMILY_TEXT, PIPELINE, REPLICATED, TENSOR_PARALLEL, NotPredicted, Work, work_of

FIGURES = ("tokens_per_s", "samples_per_s", "step_time_s", "compute_s", "exposed_comm_s", "rest_s", "comm_s")


def rate(row: dict[str, Any]) -> float | None:
    """A prediction row's throughput in its own unit (``unit``): tokens/s, or samples/s for an image model."""
    return row.get("tokens_per_s") or row.get("samples_per_s")


def unit(row: dict[str, Any]) -> str:
    """The unit of ``rate(row)``: "samples/s" for an image model, else "tokens/s" (a row read back from a run
    directory's summary.json is input: any other text there is not shown)."""
    return "samples/s" if row.get("unit") == "samples/s" else "tokens/s"


def calibrate(out_dirs: list[str], only: list[str] | None = None, cores: int | None = None,
              collectives: list[tuple[str, float, float, int]] | None = None) -> MachineModel:
    """Fit the machine on the finished comparisons ``out_dirs`` (only the runs in ``only`` when given; plus
    ``collectives`` timed apart) and record, in ``fit_error["runs"]``, each calibration run's step time
    predicted back against its measurement.

    Raises NotPredicted when no run can calibrate, OSError/ValueError when a directory is not a comparison.
    """
    runs = read_calibration(out_dirs, only)
    model = fit(runs, cores, collectives)
    errors = {}
    for r in runs:
        if r.why_not or r.work is None or not r.step_s:
            continue
        try:
            got = _predict_work(r.work, model, None)
        except NotPredicted:
            continue
        key = r.name if len(out_dirs) == 1 else f"{os.path.basename(os.path.normpath(r.out_dir))}/{r.name}"
        errors[key] = {"predicted_step_s": got["step_time_s"], "measured_step_s": r.step_s,
                       "error": got["step_time_s"] / r.step_s - 1}
    model.fit_error["runs"] = errors
    return model


def _overhead(w: Work, model: MachineModel) -> tuple[dict[str, float], str]:
    """The strategy's framework overhead per phase (seconds per parameter tensor), and a note when it is
    not its own."""
    if w.strategy in model.overhead:
        return model.overhead[w.strategy], ""
    if w.family in model.family_overhead:
        return model.family_overhead[w.family], (f"framework overhead not calibrated for {w.strategy}: its "
                                                 f"family's ({w.family}) taken")
    if w.family == PIPELINE and REPLICATED in model.family_overhead:  # a stage is plain autograd, as DDP's model
        return model.family_overhead[REPLICATED], (f"framework overhead not calibrated for {w.strategy}: the "
                                                   f"{REPLICATED} family's taken for its stages (the schedule's own "
                                                   "is not counted)")
    return dict.fromkeys(PHASE_KEYS, 0.0), (f"framework overhead not calibrated for {w.strategy} (no {w.family} "
                                            "run in the calibration): none counted, so its step time is a lower "
                                            "bound and its tokens/s an upper bound")


def _device_comm(device: DeviceSpec) -> Any:
    """Collective time on the device table: a ring inside a node, a tree's log2(nodes) hops across nodes (NCCL
    picks trees for latency at scale) for the latency; the bandwidth term at the slowest link's bus bandwidth."""
    def seconds(kind: str, nbytes: float, n: int) -> float:
        """One collective's seconds on the device table."""
        if n <= 1:
            return 0.0
        busbw, latency, _ = device.link(n)
        nodes = math.ceil(n / device.gpus_per_node)
        steps = ring_steps(kind, min(n, device.gpus_per_node)) + (2 * math.ceil(math.log2(nodes)) if nodes > 1 else 0)
        return latency * steps + nbytes * bus_factor(kind, n) / busbw
    return seconds


def _what_if_compute(w: Work, model: MachineModel | None, device: DeviceSpec) -> tuple[dict[str, float], list[str]]:
    """Compute per phase on ``device``: FLOPs at a fraction of its peak, the optimizer at HBM bandwidth."""
    peak = device.fp32_flops if _compute_bytes(w.precision) == 4 else device.bf16_flops
    notes = [f"{device.name}: {'fp32 (TF32 off, torch default)' if _compute_bytes(w.precision) == 4 else 'bf16'} "
             f"peak {peak / 1e12:g} TFLOP/s"]
    mfu = ASSUMED_MFU
    if model is not None and model.backend == "nccl":
        from shardscope.profiling.traces import peak_flops

        cal_peak = peak_flops(model.device_name)
        per_flop = model.coefficients["forward"].get("per_flop_s")
        if cal_peak and per_flop:
            mfu = min(1.0, 1.0 / per_flop / cal_peak)
            notes.append(f"compute at the calibration GPU's measured {mfu:.0%} of peak")
    if mfu == ASSUMED_MFU:
        notes.append(f"compute at an assumed {ASSUMED_MFU:.0%} of peak (not measured: the calibration ran on "
                     f"{model.backend if model else 'no'} {'CPU' if model and model.backend == 'gloo' else 'device'})")
    rate = peak * mfu
    fwd = w.fwd_flops / rate
    bwd = w.bwd_flops / rate + (fwd if w.activation_checkpointing else 0.0)
    opt = w.optim_elements * ADAMW_BYTES_PER_ELEMENT / device.hbm_Bps
    return {"forward": fwd, "backward": bwd, "optimizer": opt}, notes


def _probed_compute(w: Work, model: MachineModel, probed: dict[str, float]) -> tuple[dict[str, float], list[str]]:
    """The run's own compute per phase from its probe (a core of its own), shared out as the ranks share cores."""
    slow = slowdown(w, model.backend, model.cores, model.background)
    group = ("a real group of one, whose collectives move nothing but cost what the run's own do" if w.world_size == 1
             else "fake process group: its collectives return at once; communication added from the collective fit")
    notes = [f"compute and framework overhead measured by a one-rank probe of this run at {w.world_size} ranks "
             f"({group})"]
    if slow > 1:
        notes.append(f"{w.world_size} ranks share {model.cores} cores" + (f" with {model.background:.1f} other "
                     "busy processes" if model.background > 0.05 else "") + f": compute x{slow:.2f}")
    return {p: probed[p] * slow for p in PHASE_KEYS}, notes


def _gpu_size_check(w: Work, model: MachineModel) -> None:
    """Raise NotPredicted for a run whose FLOPs per step are more than twice (or under half) those of a GPU
    calibration that fitted no per-layer-and-token cost: on a GPU the speed per FLOP depends on size (an H100
    ran smoke's forward at 28 GFLOP/s, waiting on kernel launches; ddp-vs-fsdp's model, 2,091x the FLOPs per
    step, took 2.5x smoke's step time), so one size's speed does not carry over. CPUs are left to the FLOP
    scaling (benchmarks/RESULTS.md)."""
    if not model.device.startswith("cuda") or "per_layer_token_s" in model.coefficients.get("forward", {}):
        return
    if not model.fwd_flops:
        return
    lo, hi = model.fwd_flops[0], model.fwd_flops[-1]
    if lo / 2 <= w.fwd_flops <= hi * 2:
        return
    more = w.fwd_flops > hi
    ratio = w.fwd_flops / hi if more else lo / w.fwd_flops
    per_flop = model.coefficients.get("forward", {}).get("per_flop_s")
    speed = f"its forward ran at {1 / per_flop / 1e9:.3g} GFLOP/s; " if per_flop else ""
    raise NotPredicted(f"one model size calibrated on a GPU ({model.device_name or model.device}): {speed}a GPU's "
                       "speed per FLOP changes with size (small models wait on kernel launches), so it does not carry "
                       f"over to this run's {ratio:.0f}x {'more' if more else 'fewer'} FLOPs per step; calibrate on "
                       "two model sizes (--calibrate twice) or measure each run with --probe")


def _predict_work(w: Work, model: MachineModel | None, device: DeviceSpec | None,
                  probed: dict[str, float] | None = None) -> dict[str, Any]:
    notes: list[str] = []
    bound = None  # "upper": tokens/s is an upper bound (framework overhead not calibrated, none counted)
    if device is None and probed is not None:
        assert model is not None
        comp, notes = _probed_compute(w, model, probed)
        reference = dict(comp)
        comm, overlap, rest = _comm_fn(model.collectives), model.backend != "gloo", model.rest_s
    elif device is not None:
        comp, notes = _what_if_compute(w, model, device)
        reference = dict(comp)
        comm, overlap, rest = _device_comm(device), True, 0.0
        if w.world_size > 1:
            _, _, link = device.link(w.dp)
            notes.append(f"collectives over {link}")
    else:
        assert model is not None
        if _compute_bytes(w.precision) not in model.compute_bytes:
            raise NotPredicted(f"precision {w.precision!r} computes in "
                               f"{'fp32' if _compute_bytes(w.precision) == 4 else 'bf16/fp16'}; the calibration computed "
                               f"only in {', '.join('fp32' if b == 4 else 'bf16/fp16' for b in model.compute_bytes)}: "
                               "this machine's speed in that dtype is unmeasured")
        if w.family == TENSOR_PARALLEL and TENSOR_PARALLEL not in model.families:
            raise NotPredicted("the calibration has no tensor-parallel run: this machine's speed on matmuls split "
                               f"{w.tp} ways and on the per-layer activation all-reduces that block them is unmeasured")
        _gpu_size_check(w, model)
        slow = slowdown(w, model.backend, model.cores, model.background)
        reference = {p: v * slow for p, v in reference_compute(w, model.coefficients).items()}
        extra, why = _overhead(w, model)
        notes += [why] if why else []
        bound = "upper" if w.strategy not in model.overhead and w.family not in model.family_overhead and not (
            w.family == PIPELINE and REPLICATED in model.family_overhead) else None
        # Overhead below the reference's (a strategy faster per FLOP) is kept, down to a quarter of it.
        comp = {p: max(0.25 * reference[p], reference[p] + extra[p] * w.param_tensors * slow) for p in PHASE_KEYS}
        comm, overlap, rest = _comm_fn(model.collectives), model.backend != "gloo", model.rest_s
        if slow > 1:
            notes.append(f"{w.world_size} ranks share {model.cores} cores" + (f" with {model.background:.1f} other "
                         "busy processes" if model.background > 0.05 else "") + f": compute x{slow:.2f}")
        derived = sorted({k for k in w.by_type if model.collectives.get(k) and model.collectives[k].source != "measured"})
        if derived and w.world_size > 1:
            notes.append("timed from another type's fit: " + ", ".join(
                f"{k} ({model.collectives[k].source})" for k in derived))
    gloo_probed = device is None and probed is not None and model is not None and model.backend == "gloo"
    exact = None  # gloo, probed, the collective job run: its figures price the blocking calls of exact bytes
    if gloo_probed and model.in_step:  # type: ignore[union-attr]
        exact = in_step.comm_fn(model.in_step, comm, model.collectives)  # type: ignore[union-attr]
        if w.world_size > 1 and (w.tp > 1 or w.traits.norm_allreduce):
            notes.append(in_step.NOTE)
    if w.pipeline is not None:
        return _pipeline_row(w, comp, reference, comm, rest, bound, notes)
    timing = simulate(w, comp["forward"], comp["backward"], comp["optimizer"], comm, overlap, exact)
    step, exposed = timing.step_s + rest, timing.exposed_comm_s
    latency = None  # gloo, probed: the part of the exposed communication that is the calls' latency, not their bytes
    if gloo_probed:
        assert model is not None
        latency = simulate(w, comp["forward"], comp["backward"], comp["optimizer"],
                           _comm_fn(model.collectives, latency_only=True), overlap,
                           (lambda kind, nbytes, n: 0.0) if exact else None).exposed_comm_s
        if model.comm_cost and (latency > 0 or not exact):  # every call priced by the job: no factor to speak of
            extra = comm_cost.extra_s(model, w.world_size, exposed, latency)
            step, exposed = step + extra, exposed + extra
            notes.append(comm_cost.note(model, w.world_size, extra))
    compute = min(sum(reference.values()), sum(comp.values()))
    rate = (w.samples_per_step or w.tokens_per_step) / step if step > 0 else None
    return {"tokens_per_s": None if w.samples_per_step else rate, "samples_per_s": rate if w.samples_per_step else None,
            "unit": "samples/s" if w.samples_per_step else "tokens/s", "step_time_s": step,
            "compute_s": compute, "exposed_comm_s": exposed,
            "rest_s": max(0.0, step - compute - exposed), "comm_s": timing.comm_s, "comm_latency_s": latency,
            "phases_s": timing.phase_s, "bound": bound, "notes": notes}


def _pipeline_row(w: Work, comp: dict[str, float], reference: dict[str, float], comm: Any, rest: float,
                  bound: str | None, notes: list[str]) -> dict[str, Any]:
    """A pipeline run's figures: its schedule's grid played out with each stage's compute (predict/pipeline.py)."""
    f = w.pipeline
    assert f is not None
    try:
        comm(pipeline.P2P_KIND, 1.0, 2)
        p2p = comm
    except NotPredicted:  # no broadcast in the calibration: its all-reduce fit prices a transfer of the same bytes
        notes.append(f"point-to-point transfers priced by the all-reduce fit (the calibration timed no {pipeline.P2P_KIND})")
        p2p = lambda kind, nbytes, n: comm("all_reduce" if kind == pipeline.P2P_KIND else kind, nbytes, n)  # noqa: E731
    try:
        order = pipeline.grid(f["schedule"], f["pp"], f["m"], f["v"])
    except pipeline.GridError as err:
        raise NotPredicted(str(err)) from err
    grad_bytes = memory_model.PRECISION_BYTES.get(w.precision, (4, 4, 4))[1]
    got = pipeline.step(f, comp["forward"], comp["backward"], comp["optimizer"], p2p, w.dp, grad_bytes, order)
    notes.append(f"{f['schedule']} grid at pp {f['pp']}, {f['m']} micro-batches" + (f", {f['v']} stages a rank" if f["v"] > 1 else "")
                 + f": predicted bubble {got['bubble']:.1%} (stage compute by FLOP share; point-to-point transfers "
                 "wait in the critical path)")
    step = got["step_s"] + rest
    rate = w.tokens_per_step / step if step > 0 else None
    compute = got["busy_s"]  # the slowest rank's own stages' forward and backward
    return {"tokens_per_s": rate, "samples_per_s": None, "unit": "tokens/s", "step_time_s": step,
            "compute_s": compute, "exposed_comm_s": got["comm_s"], "rest_s": max(0.0, step - compute - got["comm_s"]),
            "comm_s": got["comm_s"], "comm_latency_s": None, "phases_s": got["phase_s"], "bound": bound,
            "bubble": got["bubble"], "notes": notes}


def read_grids_for(pairs: Iterable[tuple[Comparison, RunSpec]]) -> None:
    """Read the action grids that the pipeline runs among ``pairs`` (comparison, run) need, all in one torch
    subprocess, before ``predict_run`` predicts them one by one (``pipeline.read_grids``). A run whose work cannot
    be counted is skipped here: ``predict_run`` says why."""
    keys = set()
    for c, run in pairs:
        try:
            f = work_of(c, run).pipeline
        except (KeyError, ValueError, NotPredicted):
            continue
        if f is not None:
            keys.add((f["schedule"], f["pp"], f["m"], f["v"]))
    pipeline.read_grids(keys)


def predict_run(c: Comparison, run: RunSpec, model: MachineModel | None, device: DeviceSpec | None = None,
                probed: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run's prediction: ``name strategy world_size family`` and ``tokens_per_s step_time_s compute_s
    exposed_comm_s rest_s comm_s`` (seconds per optimizer step), ``peak_mem_bytes`` (memory model, per rank),
    ``bound`` ("upper" when tokens/s is an upper bound: no framework overhead calibrated for the strategy or
    its family), ``notes``; ``why`` (and None figures) when it cannot be predicted. Needs ``model`` unless
    ``device``. ``probed``: this run's compute probe (``predict_probe``), used in place of the calibration's
    compute and overhead; a probe that failed (``{"error"}``) leaves the run unpredicted with its reason."""
    row: dict[str, Any] = {"name": run.name, "strategy": run.strategy, "world_size": None, "family": None,
                           **dict.fromkeys(FIGURES), "peak_mem_bytes": None, "bound": None, "notes": [], "why": None}
    try:
        mem = memory_model.predict_run(c, run)
        row["peak_mem_bytes"] = mem["total_bytes"]
    except (KeyError, ValueError):
        mem = None
    try:
        w = work_of(c, run)
        row["world_size"], row["family"] = w.world_size, w.family
        if model is None and device is None:
            raise NotPredicted("no calibration")
        if probed is not None and device is None:
            if "error" in probed:
                raise NotPredicted(f"compute probe: {probed['error']}")
        row.update(_predict_work(w, model, device, probed if device is None else None))
    except NotPredicted as err:
        row["why"] = str(err)
    except (KeyError, ValueError) as err:
        row["why"] = f"its work cannot be counted: {err}"
    if mem is None:
        row["notes"].append("peak memory: the memory model cannot read this run")
    return row


def assumptions(model: MachineModel | None, device: DeviceSpec | None = None) -> list[str]:
    """The sentences every prediction from ``model`` (and ``device``) rests on."""
    out = []
    if device is not None:
        out.append(f"WHAT-IF on {device.name} GPUs, not measured on this machine: compute from FLOPs at a fraction "
                   "of the datasheet peak, the optimizer at HBM bandwidth, collectives at the table's NVLink "
                   "(inside 8 GPUs) or InfiniBand bus bandwidth, NCCL overlap per schedule; framework overhead "
                   "and host-side costs are not modelled (predict/devices.py lists the sources)")
    if model is not None:
        fwd = model.coefficients.get("forward", {})
        if device is None and fwd.get("per_flop_s"):
            out.append(f"compute calibrated at {1 / fwd['per_flop_s'] / 1e9:.3g} GFLOP/s per rank in forward "
                       f"({model.backend} on {model.device_name or model.device or '?'}, {model.cores} cores"
                       + ("; a core of its own" if model.backend == "gloo" else "")
                       + "), same per-FLOP speed at other model sizes unless two sizes were calibrated")
        out.append("a step's collectives move exactly the communication theory's bytes (comm_theory), placed and "
                   "overlapped as each strategy's schedule does (predict/schedule.py)")
        if device is None:
            out.append("framework overhead (each strategy's compute beyond DDP's, per parameter tensor and phase) "
                       "measured on the calibration's runs of: " + (", ".join(sorted(model.overhead)) or "none"))
            out.append("peak memory is the memory model's (model states, gathered units, activations), not process RSS")
        out += model.notes if device is None else [n for n in model.notes if not about_this_machine(n)]
    return out


def predict_comparison(c: Comparison, model: MachineModel | None, device: DeviceSpec | None = None,
                       probes: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """``{"preset", "what_if", "device", "runs": [predict_run rows], "assumptions", "calibration", "fit_error"}``;
    ``probes``: {run name: its compute probe} (``predict_probe.probe_runs``)."""
    probes = probes or {}
    read_grids_for((c, run) for run in c.runs)
    return {
        "preset": c.name,
        "what_if": device is not None,
        "device": device.name if device else (model.device_name or model.device if model else None),
        "runs": [predict_run(c, run, model, device, probes.get(run.name)) for run in c.runs],
        "assumptions": assumptions(model, device) + ([
            "compute and framework overhead per run measured by a one-rank probe at the predicted world size "
            "(predict/probe.py), not carried over from the calibration"] if probes and device is None else [])
            + ([comm_cost.assumption(model)] if probes and device is None and model and model.comm_cost else [])
            + ([in_step.NOTE] if probes and device is None and model and model.backend == "gloo" and model.in_step
               else []),
        "families": {k: v for k, v in FAMILY_TEXT.items()},
        "calibration": model.to_dict() if model else None,
        "fit_error": model.fit_error if model else None,
    }
