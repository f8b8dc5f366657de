"""Each run's own compute, measured: ``shardscope predict --probe`` (parent side, torch-free).

For every run of the comparison at the world size being predicted, ``engines.compute_probe`` trains a
few steps as rank 0 of a fake process group (a subprocess each; see that module): the model at its real
size, the strategy's own sharding and hooks, collectives that return at once. Its per-phase times are
this machine's compute and framework overhead for that run on one rank, with no communication; ``predict``
uses them in place of the calibration's per-FLOP compute and per-tensor overhead, which carry over badly
across model sizes, model code and strategies (benchmarks/RESULTS.md), and adds communication from the
collective fit on the strategy's schedule.

The probe's phases are wall-clock times; a probe that did not get its core the whole time (another
process ran) is scaled down to its CPU time (``busy_s / step_time_s``), so that what ``predict`` gets is a
core of its own, as the calibration's compute is.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from typing import Any

from shardscope import config
from shardscope.presets import trust
from shardscope.config import Comparison
from shardscope.core import registry
from shardscope.core.bounded import run_bounded

STEPS = 6  # the first is a warm-up: medians over five
PHASES = {"forward": "time_forward_s", "backward": "time_backward_s", "optimizer": "time_optimizer_s"}


def core_phases(result: dict[str, Any]) -> dict[str, float]:
    """The probe's phase seconds on a core of its own: wall-clock phases scaled by the share of the step it
    ran (``busy_s / step_time_s``, at most 1). Raises ValueError when a phase is missing."""
    missing = [k for k in (*PHASES.values(), "step_time_s") if not isinstance(result.get(k), (int, float))]
    if missing:
        raise ValueError(f"the probe recorded no {', '.join(missing)}")
    step, busy = float(result["step_time_s"]), result.get("busy_s")
    share = min(1.0, float(busy) / step) if isinstance(busy, (int, float)) and busy > 0 and step > 0 else 1.0
    return {p: float(result[k]) * share for p, k in PHASES.items()}


def probe_runs(c: Comparison, world_size: int | None = None, timeout_s: float = 600.0,
               progress: Any = None, device: str = "cpu") -> dict[str, dict[str, Any]]:
    """Probe every run of ``c`` (at ``world_size`` when given); return {run name: {"forward", "backward",
    "optimizer"} seconds on a core of its own} or {run name: {"error": text}} for a probe that failed. A
    tensor-parallel run is probed on its 2-D mesh; ``predict`` adds its per-layer activation all-reduces.
    ``progress(text)`` is called before each probe; ``device``: the calibration's ("cuda": the probe runs on
    the first GPU, as the calibration's ranks ran on theirs). Nothing is left running past ``timeout_s``."""
    trust.require_trusted(c)  # a probe builds the model: code from a run directory only when the user names it
    device = "cuda" if device.startswith("cuda") else "cpu"  # a start record names "cuda:0"
    out: dict[str, dict[str, Any]] = {}
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}  # as the launcher's ranks
    with tempfile.TemporaryDirectory(prefix="shardscope-probe-") as tmp:
        for run in c.runs:
            if run.control_of:  # the A/A control is its baseline again
                continue
            if registry.get(run.strategy).schedule:  # a pipeline's ranks wait on each other: its compute is scaled
                continue  # from the calibration over its stages (predict/pipeline.py), not probed on one rank
            at_size = dataclasses.replace(run, world_size=world_size) if world_size else run
            payload = config.run_spec_payload(c, at_size, out_dir=tmp, device=device)
            spec = os.path.join(tmp, f"{run.name}.json")
            config.dump_json(spec, payload)
            if progress is not None:
                progress(f"probing {run.name} ({run.strategy}) at {payload['run']['world_size']} ranks on {device} ...")
            out[run.name] = _one(spec, env, timeout_s)
    return out


def _one(spec: str, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    done = run_bounded([sys.executable, "-m", "shardscope.engines.compute_probe", spec, str(STEPS)], timeout_s, env)
    if done is None:
        return {"error": f"the probe ran past {timeout_s:.0f} s and was stopped"}
    proc, stdout, stderr = done, done.stdout, done.stderr
    lines = stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        last = (stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"the probe failed (exit {proc.returncode}): {last[:200]}"}
    try:
        return {**core_phases(json.loads(lines[-1])), "raw": json.loads(lines[-1])}
    except ValueError as err:
        return {"error": str(err)}
