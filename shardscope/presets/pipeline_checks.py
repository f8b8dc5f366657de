"""What a pipeline-parallel run needs of its comparison, checked before the start (a LAYOUT_CHECKS entry).

Each refusal is one line naming the setting, its value and what is allowed; a run that passes builds its stages in
every rank without a surprise (engines/pipeline.py). Must not import torch."""

from __future__ import annotations

from typing import Any

from shardscope.core import pipeline_layout, registry
from shardscope.presets.schema import Comparison, RunSpec, resolved_options, resolved_precision

PRECISIONS = ("fp32", "bf16-autocast")


def check_pipeline(c: Comparison, run: RunSpec, tp: int, dp: int) -> str:
    """"" when the run's pipeline can be built, else the reason it cannot."""
    info = registry.get(run.strategy)
    options: dict[str, Any] = resolved_options(run)
    pp, m, v = info.pp_degree(options), int(options["microbatches"]), int(options["stages_per_rank"])
    precision = resolved_precision(c, run)
    if precision not in PRECISIONS:
        return (f"precision = {precision!r}: pipeline schedules run {' or '.join(PRECISIONS)} here (fp16's loss scale "
                "and bf16 parameters across stage boundaries are not built)")
    if run.activation_checkpointing or run.compile:
        what = "activation_checkpointing" if run.activation_checkpointing else "compile"
        return f"{what} = true: not built for pipeline stages"
    per_rank = c.global_batch // max(1, dp)
    if per_rank % m:
        return (f"options.microbatches = {m}: must divide each pipeline's batch, global_batch {c.global_batch} / "
                f"dp {dp} = {per_rank}")
    if info.schedule in ("interleaved-1f1b", "zero-bubble") and m % pp:
        return (f"options.microbatches = {m}: the looped schedules ({run.strategy}) need a multiple of pp = {pp} "
                "(torch.distributed.pipelining runs micro-batches in rounds of pp)")
    units = c.model.n_layers + 2  # embeddings, the blocks, the head (core/pipeline_layout.py)
    if units < pp * v:
        return (f"options.pp = {pp} x stages_per_rank = {v}: {pp * v} stages, but the model has {units} units "
                f"(embeddings, {c.model.n_layers} blocks, head)")
    if info.schedule not in pipeline_layout.FORMULAS:
        return f"schedule {info.schedule!r} is not built"
    return ""
