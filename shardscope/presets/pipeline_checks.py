"""What a pipeline-parallel run needs of its comparison, checked before the start (a LAYOUT_CHECKS entry).

Each refusal is one line naming the setting, its value and what is allowed; a run that passes builds its stages in
every rank without a surprise (engines/pipeline.py). Must not import torch."""

from __future__ import annotations

from typing import Any

from shardscope.core import model_facts, pipeline_layout, registry
from shardscope.presets.schema import Comparison, RunSpec, resolved_options, resolved_precision

PRECISIONS = ("fp32", "bf16-autocast")
# Hugging Face families whose base model is embed -> decoder layers (rotary positions, causal mask) -> norm -> head,
# which engines/pipeline_stages.HFStage rebuilds per stage (tests/test_pipeline_user_models.py: Mistral's layout at parity)
HF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


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
    if options.get("dp_shard") == "fsdp2" and dp < 2:
        return (f"options.dp_shard = 'fsdp2': one pipeline (world_size {pp * dp} / pp {pp}): no other pipeline to shard "
                "the stages across; give world_size a multiple of pp above it, or dp_shard = 'replicate'")
    per_rank = c.global_batch // max(1, dp)
    if per_rank % m:
        return (f"options.microbatches = {m}: must divide each pipeline's batch, global_batch {c.global_batch} / "
                f"dp {dp} = {per_rank}")
    if info.schedule in ("interleaved-1f1b", "zero-bubble") and m % pp:
        return (f"options.microbatches = {m}: the looped schedules ({run.strategy}) need a multiple of pp = {pp} "
                "(torch.distributed.pipelining runs micro-batches in rounds of pp)")
    if c.model.kind == "hf" and not model_facts.is_described(c.model):
        refusal = _hf_refusal(c)
        if refusal:
            return refusal
    facts = model_facts.pipeline_facts(c.model)
    if facts is not None and facts["refusal"]:
        named = f"model.entry = {c.model.entry!r}" if c.model.kind == "module" else f"model.path = {c.model.path!r}"
        return f"{named}: {facts['refusal']}"
    blocks = model_facts.layers(c.model)
    units = blocks + 2  # embeddings, the blocks, the head (core/pipeline_layout.py)
    if units < pp * v:
        return (f"options.pp = {pp} x stages_per_rank = {v}: {pp * v} stages, but the model has {units} units "
                f"(embeddings, {blocks} blocks, head)")
    if info.schedule not in pipeline_layout.FORMULAS:
        return f"schedule {info.schedule!r} is not built"
    return ""


def _hf_refusal(c: Comparison) -> str:
    """"" when a built-in Hugging Face architecture's stages can be rebuilt as ``HFStage`` does, else the reason they
    cannot (a described model's stages are its own: engines/hf_pipeline.py)."""
    m = c.model
    family = str(model_facts.hf_config_value(m, "model_type") or "?")
    if family not in HF_FAMILIES:
        return (f"model_type {family!r}: pipeline stages are built for the {', '.join(HF_FAMILIES)} layouts (embeddings, "
                "decoder layers with rotary positions, norm, head); others scale embeddings or mask differently")
    if model_facts.tied_embeddings(m):
        return ("tie_word_embeddings = true: the first and last stages would hold one shared weight on two ranks, "
                "whose two gradients are not summed across them here; untie it (tie_word_embeddings = false)")
    window = int(model_facts.hf_config_value(m, "sliding_window") or 0)
    if 0 < window < m.seq_len:
        return (f"sliding_window = {window} < seq_len = {m.seq_len}: stages mask causally over the whole sequence; "
                "a window shorter than it is not built")
    attention = model_facts.hf_config_value(m, "attention")
    if attention not in (None, "", "sdpa"):
        return f"attention {attention!r}: pipeline stages mask causally through SDPA only"
    return ""
