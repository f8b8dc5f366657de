"""A pipeline-parallel run's step, predicted: its schedule's action grid played out with each stage's own compute.

The whole model's forward and backward for one pipeline's tokens are this machine's calibrated compute (as for any
run); each stage takes its share of those FLOPs (``stage_shares``: the stage split the ranks build,
``core/pipeline_layout``), divided over the micro-batches. The schedule's action grid is the one the ranks run:
GPipe's and 1F1B's written out (``pipeline_layout.single_stage_order``), the interleaved schedules' read from
torch's own schedule object in a subprocess (``engines/pipeline_grid``; this module stays torch-free). A forward
lasts its stage's share of the forward over m, a backward its share of the backward, an input or a weight pass (zero
bubble) half of that; an action that receives a boundary tensor waits for one point-to-point transfer
(priced as a two-rank broadcast of those bytes, the calibration's nearest call: gloo's send and recv block as it
does). ``pipeline_layout.simulate`` plays the grid; its makespan is the schedule's span, whose idle share is the
predicted bubble, the mean over ranks of 1 − busy / span as the run's measured one is (stage imbalance included:
the embeddings' stage computes almost nothing, the head's more).

After the schedule: the gradient norm's all-reduce across the stages, with several pipelines one all-reduce of the
rank's stage gradients across them (flat, as ``engines/pipeline`` does), and the optimizer over the rank's own
parameters. The step is the slowest rank's.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any, Callable, Iterable

from shardscope.core import pipeline_layout
from shardscope.core.bounded import run_bounded
from shardscope.profiling import pipeline_model

GRID_TIMEOUT_S = 120.0
P2P_KIND = "broadcast"  # a point-to-point transfer priced as a two-rank broadcast of the same bytes


class GridError(ValueError):
    """The schedule's action grid could not be read."""


def stage_shares(d: Any, n_stages: int) -> list[float]:
    """Each stage's share of the model's training FLOPs (``d``: the run's description): a block's 6 x its parameters
    + 12 x hidden x sequence of attention per token, the head's 6 x its parameters, the embeddings' none (a lookup)."""
    units, ranges = pipeline_model.stage_units(list(d.params), n_stages)
    attn = 12.0 * d.model.hidden * d.model.tokens_per_sample

    def flops(unit: pipeline_layout.Unit) -> float:
        if unit.name == "embeddings":
            return 0.0
        return 6.0 * unit.numel + (attn if unit.name.startswith("layers.") else 0.0)

    per_stage = [sum(flops(units[i]) for i in range(a, b)) for a, b in ranges]
    total = sum(per_stage) or 1.0
    return [f / total for f in per_stage]


def facts(d: Any) -> dict[str, Any]:
    """What the step model needs of a pipeline run (``d``: its description, ``profiling/run_description``): schedule,
    pp, v, m, each stage's FLOP share, each pipeline rank's parameter elements, and the bytes of one boundary
    transfer."""
    layout, params = d.layout, list(d.params)
    n_stages = layout.pp * layout.v
    batch = d.comparison.global_batch // max(1, layout.dp)
    chunk = batch // max(1, layout.microbatches)
    boundary = chunk * d.model.tokens_per_sample * d.model.hidden * pipeline_model.ACTIVATION_BYTES
    held = [pipeline_model.rank_params(params, layout.pp, layout.v, r) for r in range(layout.pp)]
    return {"schedule": layout.schedule, "pp": layout.pp, "v": layout.v, "m": layout.microbatches,
            "shares": stage_shares(d, n_stages), "boundary_bytes": boundary,
            "rank_elements": [sum(p.numel for p in rank) for rank in held],
            "rank_tensors": [len(rank) for rank in held], "sharded": layout.shards == "all"}


_READ: dict[tuple[str, int, int, int], str] = {}  # grids read together ahead (``read_grids``): key -> JSON line


def _from_torch(schedule: str, v: int) -> bool:
    return not (v == 1 and schedule in ("gpipe", "1f1b"))


def read_grids(keys: Iterable[tuple[str, int, int, int]]) -> None:
    """Read the action grids of ``keys`` (schedule, pp, m, v) that come from torch and are not read yet, in one
    subprocess: each grid alone started torch anew, 3.9 s apiece, and ``tune --device H100 -n 8`` over
    ``ddp-vs-fsdp`` spent 31 of its 34 s starting eight of them (2-core VM, 2026-11-29). Nothing is raised here: a
    grid not read is read alone by ``grid``, which says why it cannot be."""
    todo = sorted({k for k in keys if _from_torch(k[0], k[3]) and k not in _READ})
    if len(todo) < 2:
        return
    argv = [str(x) for key in todo for x in key]
    done = run_bounded([sys.executable, "-m", "shardscope.engines.pipeline_grid", *argv], GRID_TIMEOUT_S * len(todo),
                       {**os.environ, "OMP_NUM_THREADS": "1"})
    lines = done.stdout.strip().splitlines() if done is not None and not done.returncode else []
    if len(lines) == len(todo):
        _READ.update(zip(todo, lines))


@functools.lru_cache(maxsize=32)
def _grid_text(schedule: str, pp: int, m: int, v: int) -> str:
    if (schedule, pp, m, v) in _READ:
        return _READ[(schedule, pp, m, v)]
    done = run_bounded([sys.executable, "-m", "shardscope.engines.pipeline_grid", schedule, str(pp), str(m), str(v)],
                       GRID_TIMEOUT_S, {**os.environ, "OMP_NUM_THREADS": "1"})
    if done is None:
        raise GridError(f"reading {schedule}'s action grid from torch ran past {GRID_TIMEOUT_S:.0f} s")
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise GridError(f"reading {schedule}'s action grid from torch failed (exit {done.returncode}): {last[:200]}")
    return lines[-1]


def grid(schedule: str, pp: int, m: int, v: int) -> dict[int, list[tuple[str, int, int]]]:
    """The schedule's action grid ``{rank: [(kind, stage, microbatch)]}``: written out for one stage per rank, read
    from torch for the interleaved schedules. Raises GridError when torch's cannot be read."""
    if not _from_torch(schedule, v):
        return pipeline_layout.single_stage_order(schedule, pp, m)
    try:
        raw = json.loads(_grid_text(schedule, pp, m, v))
        return {int(r): [(str(k), int(s), int(i)) for k, s, i in acts] for r, acts in raw.items()}
    except (TypeError, ValueError) as err:
        if isinstance(err, GridError):
            raise
        raise GridError(f"{schedule}'s action grid could not be read: {err}") from err


def step(f: dict[str, Any], fwd_s: float, bwd_s: float, opt_s: float, comm: Callable[[str, float, int], float],
         dp: int, grad_bytes: int, order: dict[int, list[tuple[str, int, int]]]) -> dict[str, Any]:
    """One step of the pipeline run described by ``f`` (``facts``): ``fwd_s``/``bwd_s`` the whole model's compute for
    one pipeline's tokens, ``opt_s`` the optimizer over the whole model's parameters, ``comm(kind, bytes, ranks)``
    one collective's seconds. Returns ``step_s``, ``span_s`` (the schedule), ``busy_s`` (the slowest rank's),
    ``bubble`` (the mean over ranks of 1 − busy / span), ``comm_s`` (point to point and the all-reduces after the schedule), ``after_s`` and ``phase_s``."""
    m, n_stages = f["m"], f["pp"] * f["v"]
    p2p = comm(P2P_KIND, float(f["boundary_bytes"]), 2)
    split = {"F": fwd_s, "B": bwd_s, "I": bwd_s / 2, "W": bwd_s / 2}

    def cost(kind: str, stage: int) -> float:
        own = split[kind] * f["shares"][stage] / m
        receives = (kind == "F" and stage > 0) or (kind in ("B", "I") and stage < n_stages - 1)
        return own + (p2p if receives else 0.0)

    timed = pipeline_layout.simulate(order, n_stages, cost)
    span = max((acts[-1][4] for acts in timed.values() if acts), default=0.0)
    busy = {r: sum(split[k] * f["shares"][s] / m for k, s, *_ in acts) for r, acts in timed.items()}
    transfers = {r: sum(end - start for *_, start, end in acts) - busy[r] for r, acts in timed.items()}
    total = sum(f["rank_elements"]) or 1
    sharded = f.get("sharded") and dp > 1

    def reduce(r: int) -> float:
        """The collectives after rank r's schedule: the norm's, and the stage gradients' across the pipelines."""
        elements = float(f["rank_elements"][r])
        out = comm("all_reduce", 4.0, f["pp"])
        if sharded:  # FSDP2 on the stages: each unit gathered once and reduce-scattered once, the norms all-reduced
            out += (comm("all_gather", elements * 4, dp) + comm("reduce_scatter", elements * grad_bytes, dp)
                    + comm("all_reduce", 4.0 * f["rank_tensors"][r], dp))
        elif dp > 1:
            out += comm("all_reduce", elements * grad_bytes, dp)
        return out

    own = {r: opt_s * f["rank_elements"][r] / total / (dp if sharded else 1) for r in timed}
    after = {r: reduce(r) + own[r] for r in timed}
    slowest = max(timed, key=lambda r: after[r])
    reduce_s = after[slowest] - own[slowest]
    fwd = sum(split["F"] * f["shares"][s] / m for k, s, *_ in timed[slowest] if k == "F")
    return {"step_s": span + after[slowest], "span_s": span, "busy_s": busy[slowest],
            "bubble": sum(1.0 - b / span for b in busy.values()) / len(busy) if span else 0.0,
            "comm_s": transfers[slowest] + reduce_s, "after_s": after[slowest],
            "phase_s": {"forward": fwd, "backward": span - fwd, "optimizer": after[slowest]}}
