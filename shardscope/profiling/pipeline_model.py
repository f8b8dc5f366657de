"""What a pipeline-parallel run holds and sends, predicted from the same stage split the ranks build.

Pure Python (no torch). The split is ``core/pipeline_layout``'s (contiguous units balanced by parameters, stage s on
pipeline rank s mod pp), so each rank's predicted model states are those of exactly the parameters its stages
hold. The pipeline rank of global rank r is r mod pp (the ranks' ("dp", "pp") mesh: consecutive ranks form one
pipeline).

Activations held at the peak, per schedule (each "chunk" is one micro-batch through one stage):
- GPipe runs every forward before any backward: all m chunks of each of its stages.
- 1F1B warms up with pp - rank forwards before its first backward: min(m, pp - rank) chunks.
- Interleaved 1F1B and interleaved zero bubble warm up with (v - 1)·pp + 2·(pp - 1 - rank) forwards (torch's
  warm-up count), one more in flight: min(v·m, that + 1) chunks, each the size of one of its stages.

Point-to-point bytes: each boundary between consecutive stages carries m activations forward and m gradients
back per step, ``chunk x seq x d_model`` fp32 each (the residual stream stays fp32 under autocast); the run's
figure is the mean over ranks, as the trace analysis averages them.
"""

from __future__ import annotations

import math
from typing import Any

from shardscope.core import model_facts, pipeline_layout
from shardscope.profiling.param_shapes import Param

ACTIVATION_BYTES = 4  # the stage boundary's tensor: fp32 residual stream (and its gradient)


def _unit_of_each(params: list[Param]) -> list[str]:
    """Each parameter's pipeline unit: a user's module's from its description (``Param.stage_unit``), else from its
    name."""
    if params and all(p.stage_unit for p in params):
        return [p.stage_unit for p in params]
    return pipeline_layout.unit_names([p.name for p in params])


def stage_units(params: list[Param], n_stages: int) -> tuple[list[pipeline_layout.Unit], list[tuple[int, int]]]:
    """The model's units and the split's ``[start, end)`` unit range of each stage."""
    units = pipeline_layout.units_of([(p.name, p.numel) for p in params], _unit_of_each(params))
    return units, pipeline_layout.split([u.numel for u in units], n_stages)


def rank_params(params: list[Param], pp: int, v: int, pp_rank: int) -> list[Param]:
    """The parameters the stages of ``pp_rank`` hold, in model order: a tied embedding on the first stage's rank and
    on the last's."""
    units, ranges = stage_units(params, pp * v)
    mine = pipeline_layout.stages_of(pp_rank, pp, v)
    names = {units[i].name for s in mine for i in range(*ranges[s])}
    last = pp * v - 1 in mine
    return [p for p, unit in zip(params, _unit_of_each(params)) if unit in names or (last and p.tied)]


def tied_params(params: list[Param]) -> list[Param]:
    """The tied embeddings: held by the first and the last stage, their gradients all-reduced between the two."""
    return [p for p in params if p.tied]


def held_chunks(schedule: str, pp: int, m: int, v: int, pp_rank: int) -> int:
    """Micro-batch chunks per stage-equivalent a rank holds at its peak (see the module's docstring)."""
    if schedule == "gpipe":
        return m * v
    if schedule == "1f1b":
        return min(m, pp - pp_rank)
    return min(v * m, (v - 1) * pp + 2 * (pp - 1 - pp_rank) + 1)


def activation_bytes(params_all: list[Param], layout: Any, per_layer_bytes: float, logits_bytes: int,
                     pp_rank: int = 0) -> dict[str, int]:
    """Activations ``pp_rank`` holds at its peak: its blocks' per-chunk activations (``per_layer_bytes`` for one
    chunk through one block) times the chunks it holds, and the logits where it holds the last stage
    (``params_all``: the model's tensors, as the run's description lists them)."""
    units, ranges = stage_units(params_all, layout.pp * layout.v)
    mine = pipeline_layout.stages_of(pp_rank, layout.pp, layout.v)
    blocks = sum(1 for s in mine for i in range(*ranges[s]) if units[i].name.startswith("layers."))
    held = held_chunks(layout.schedule, layout.pp, layout.microbatches, layout.v, pp_rank)
    per_stage_blocks = blocks / max(1, len(mine))
    last = layout.pp * layout.v - 1 in mine
    return {"layers": int(per_layer_bytes * per_stage_blocks * held), "logits": logits_bytes if last else 0,
            "held_chunks": held}


def p2p_bytes(c: Any, layout: Any, dp: int) -> int:
    """Mean bytes a rank sends per step (and, as much, receives): 2 x (stages - 1) x m chunks of the boundary
    tensor over the pipeline's pp ranks."""
    m = c.model
    batch = c.global_batch // max(1, dp)
    chunk = batch // max(1, layout.microbatches)
    boundary = chunk * model_facts.tokens_per_sample(m) * model_facts.hidden_size(m) * ACTIVATION_BYTES
    n_stages = layout.pp * layout.v
    total = 2 * (n_stages - 1) * layout.microbatches * boundary
    return total // layout.pp if total % layout.pp == 0 else math.ceil(total / layout.pp)
