"""Memory model: predicted per-rank bytes of parameters, gradients, optimizer state and activations.

Pure Python (no torch), so ``shardscope estimate`` and the report work anywhere. The model
starts from the *parameter shapes* of the comparison's model (``param_shapes``: the built-in
transformer, a Hugging Face architecture from ``hf_archs``, the ViT), so sharding is computed tensor by tensor
the way the strategies shard (FSDP2 chunks dim 0 of each parameter over the data-parallel ranks;
ZeRO partitions one flat buffer), not from a rounded total. Which states a strategy shards comes
from the registry (``StrategyInfo.shards``: none | optim | grads | all), its tensor-parallel
degree from ``StrategyInfo.tp_degree``: no strategy name appears here.

The optimizer is AdamW (two fp32 moments per element plus a 4-byte step counter per parameter
tensor, as ``torch.optim.AdamW`` keeps it). Low-precision parameters with an fp32 master copy
are modelled for strategies that declare ``needs_deepspeed`` (DeepSpeed keeps bf16/fp16 params
and fp32 masters in the optimizer); FSDP keeps its sharded parameters in fp32 and gathers them in
the compute dtype. Activations follow Korthikanti et al. 2022 (docs/REFERENCE.md), scaled to the
compute dtype, with full recomputation when activation checkpointing is on.
"""

from __future__ import annotations

import math
from typing import Any

from shardscope.config import Comparison, RunSpec
from shardscope.core import model_facts
from shardscope.profiling import pipeline_model
from shardscope.core.hf_archs import ARCHS  # noqa: F401  (memory_model.ARCHS: callers read the table through here)
from shardscope.profiling.run_description import (  # noqa: F401  (the layout's helpers, read through here too)
    FLAT_VIEW_ALIGN,
    LAYOUT_BY_OPTION,
    SHARDS_BY_OPTION,
    Layout,
    RunDescription,
    describe_model,
    describe_run,
    dim0_shard_numel,
    layout_for,
    params_for,
    reshards_after_forward,
    shards_for,
    tp_local,
    unit_numels,
    unit_sizes,
)
# The shapes live in param_shapes; callers read them through this module too.
from shardscope.profiling.param_shapes import (  # noqa: F401
    PARAM_SHAPES,
    TP_SPLIT,
    Param,
    embedding_count,
    flops_per_token,
    hf_params,
    model_params,
    param_count,
    transformer_params,
    vit_params,
)

PRECISION_BYTES = {  # precision policy -> (param held, grad, compute) bytes for strategies keeping fp32 params
    "fp32": (4, 4, 4),
    "bf16-autocast": (4, 4, 2),
    "bf16-params": (4, 4, 2),
    "fp16": (4, 4, 2),
}
ADAM_MOMENT_BYTES = 8  # exp_avg + exp_avg_sq in fp32
STEP_COUNTER_BYTES = 4  # torch AdamW keeps a float32 scalar "step" per parameter tensor
MASTER_BYTES = 4


# --- sharding: decided in run_description, read through here too --------------------------------

def flat_offsets(sizes: list[int], align: int = 1) -> list[tuple[int, int]]:
    """(start, end) of each tensor in a flat buffer holding ``sizes`` in order, each starting at a multiple
    of ``align`` elements (FSDP1 pads between them so, with ``use_orig_params``)."""
    out, start = [], 0
    for size in sizes:
        start = -(-start // align) * align
        out.append((start, start + size))
        start += size
    return out


def flat_views(sizes: list[int], parts: int, rank: int, align: int = 1) -> tuple[int, int]:
    """(elements, tensors) of the tensors' slices in ``rank``'s 1/``parts`` chunk of the flat buffer of
    ``sizes`` (``flat_offsets``, padded to a multiple of ``parts``): what FSDP1 with ``use_orig_params``
    exposes, so the optimizer holds state for exactly those tensors and elements, padding left out."""
    offsets = flat_offsets(sizes, align)
    chunk = -(-(offsets[-1][1] if offsets else 0) // parts)
    lo, hi = rank * chunk, (rank + 1) * chunk
    held = [min(hi, end) - max(lo, start) for start, end in offsets if start < hi and end > lo]
    return sum(held), len(held)


def overlapping_tensor_numel(sizes: list[int], dp: int, rank: int, align: int = 2) -> int:
    """Elements of the gradients DeepSpeed ZeRO-2 holds on ``rank``: the whole gradient of every
    tensor that overlaps the rank's partition of the flat buffer, not just the partition's slice.

    DeepSpeed 0.19 (stage_1_and_2.py, ``get_all_grad_tensors`` / ``get_flat_partition``) gathers
    full ``.grad`` tensors of ``params_in_partition`` into one buffer and takes the partition as
    views of it. The flat buffer is the tensors in order, padded to a multiple of ``align * dp``
    (``nccl_start_alignment_factor`` = 2) and cut into ``dp`` equal partitions. Measured exact
    on every rank at dp 2 and 4 (benchmarks/memory_model.py).
    """
    total = sum(sizes)
    part = math.ceil(total / (align * dp)) * align
    lo, hi = rank * part, (rank + 1) * part
    held, start = 0, 0
    for size in sizes:
        if start < hi and start + size > lo:
            held += size
        start += size
    return held


def model_state_bytes(params: list[Param], layout: Layout, rank: int = 0, pp_rank: int = 0) -> dict[str, int]:
    """Predicted ``param_bytes``, ``grad_bytes``, ``optim_bytes`` and ``model_state_bytes`` on ``rank``.

    ``rank`` is the data-parallel rank (it matters only where dim-0 chunks are uneven). States are
    split over ``layout.shard_size`` ranks: the shard group under hybrid sharding (replicas hold the same).
    Under pipeline parallelism, of the parameters the stages of pipeline rank ``pp_rank`` hold.
    """
    if layout.pp > 1:
        params = pipeline_model.rank_params(params, layout.pp, layout.v, pp_rank)
    p_bytes, g_bytes, compute_bytes = PRECISION_BYTES.get(layout.precision, (4, 4, 4))
    if layout.low_precision_params:
        p_bytes = g_bytes = compute_bytes
    dp = layout.shard_size
    r = rank % dp  # the ("replicate", "shard") mesh: consecutive ranks form a shard group
    full = sum(math.prod(tp_local(p, layout.tp)) for p in params)
    viewed = len(params)  # tensors the optimizer keeps a step counter for
    if layout.shard_layout == "per-parameter":
        shard = sum(dim0_shard_numel(tp_local(p, layout.tp), dp, r) for p in params)
    elif layout.shard_layout == "flat-views":  # the tensors' slices of each unit's flat shard
        views = [flat_views(sizes, dp, r, FLAT_VIEW_ALIGN) for sizes in unit_sizes(params, layout.tp).values()]
        shard = sum(v[0] for v in views)
        viewed = sum(v[1] for v in views) if layout.shards == "all" else viewed
    else:  # every rank holds ceil(unit / dp) of each unit (padding included): one flat tensor per unit
        units = unit_numels(params, layout.tp)
        shard = sum(math.ceil(n / dp) for n in units.values())
        viewed = len(units) if layout.shards == "all" else viewed
    flat_shard = math.ceil(full / dp)
    sharded_p = layout.shards == "all"
    sharded_g = layout.shards in ("grads", "all")
    sharded_o = layout.shards in ("optim", "grads", "all")
    param_numel = shard if sharded_p else full
    grad_numel = (shard if sharded_p else flat_shard) if sharded_g else full
    if layout.grads_of_overlapping_tensors and dp > 1:
        grad_numel = overlapping_tensor_numel([math.prod(tp_local(p, layout.tp)) for p in params], dp, r)
    optim_numel = (shard if sharded_p else flat_shard) if sharded_o else full
    # One step counter per tensor the optimizer sees: the model's tensors (those with a slice on this rank,
    # for flat views), each unit's flat shard, or one flat partition (DeepSpeed).
    counters = 1 if layout.flat_optimizer else viewed
    optim = optim_numel * ADAM_MOMENT_BYTES + counters * STEP_COUNTER_BYTES
    if layout.master_copy:
        optim += optim_numel * MASTER_BYTES
    out = {"param_bytes": param_numel * p_bytes, "grad_bytes": grad_numel * g_bytes, "optim_bytes": optim}
    out["model_state_bytes"] = sum(out.values())
    return out


def activation_bytes(c: Comparison, layout: Layout, params: tuple[Param, ...] | None = None) -> dict[str, int]:
    """Predicted activation memory per rank for one micro-batch: ``layers`` (all blocks) and ``logits``.

    Korthikanti et al.: s·b·h·(34 + 5·a·s/h) bytes per layer in 16-bit without recomputation; the
    attention-score term is left out because the models use fused scaled-dot-product attention;
    tensor parallelism divides the 24 sharded units of the 34 by tp; fp32 compute doubles it;
    full recomputation keeps 2·s·b·h per layer. Logits and their gradient: 2 x b·s·V x 4 bytes. ``params``: the
    model's tensors from the run's description (a pipeline's stages hold its blocks; read here when not given).
    """
    m = c.model
    micro = max(1, c.global_batch // max(1, layout.dp * layout.accum))
    if layout.pp > 1:  # one chunk: a micro-batch of the pipeline's schedule
        micro = max(1, c.global_batch // max(1, layout.dp * layout.microbatches))
    if model_facts.is_described(m):
        out = described_activation_bytes(c, layout, micro)
        if layout.pp > 1:  # each schedule's rule: the blocks of this rank's stages, times the chunks it holds
            per_block = out["layers"] / max(1, model_facts.layers(m))
            held = pipeline_model.activation_bytes(list(params or describe_model(m).params), layout, per_block,
                                                   out["logits"])
            out = {**out, "layers": held["layers"], "logits": held["logits"]}
        return out
    scale = PRECISION_BYTES.get(layout.precision, (4, 4, 4))[2] / 2
    s, h, layers = model_facts.tokens_per_sample(m), model_facts.hidden_size(m), model_facts.layers(m)
    vocab, ffn_ratio = model_facts.vocab_size(m), model_facts.ffn_size(m) / (4 * h)
    sbh = s * micro * h
    if layout.activation_checkpointing:
        per_layer = 2 * sbh
    else:
        # 10 units replicated (norm inputs, residuals), 24 split by tp; the MLP's share (19 of 24) scales with d_ff/4h.
        per_layer = sbh * (10 + (5 + 19 * ffn_ratio) / layout.tp)
    logits = 2 * micro * s * vocab * 4 // max(1, layout.tp if vocab else 1) if vocab else 0
    if layout.pp > 1:  # rank 0's blocks, times the chunks its schedule holds
        held = pipeline_model.activation_bytes(list(params or describe_model(m).params), layout, per_layer * scale,
                                               int(logits))
        return {"layers": held["layers"], "logits": held["logits"], "micro_batch": micro}
    return {"layers": int(per_layer * scale * layers), "logits": int(logits), "micro_batch": micro}


def described_activation_bytes(c: Comparison, layout: Layout, micro: int) -> dict[str, int]:
    """Activation memory of a user's model, from what the model check measured on the real module: the bytes
    autograd saved for backward in one fp32 step at batch 1 (with per-block recomputation: each block's input and
    what is saved outside the blocks), times the micro-batch, scaled to the compute dtype; under tensor parallelism
    the blocks' sharded share (Korthikanti's 24 of 34 units, the MLP's part by its width) divided by tp. The
    logits' output of the loss is counted apart, as logits and their gradient in fp32."""
    d = model_facts.description(c.model)
    scale = PRECISION_BYTES.get(layout.precision, (4, 4, 4))[2] / 4
    logits = int(d.get("logits_bytes_per_sample") or 0)
    saved = int(d.get("checkpointed_bytes_per_sample" if layout.activation_checkpointing else "saved_bytes_per_sample")
                or 0)
    layers = max(0, saved - logits) * micro * scale
    h, ffn = model_facts.hidden_size(c.model), model_facts.ffn_size(c.model)
    if layout.tp > 1 and not layout.activation_checkpointing:
        ratio = ffn / (4 * h) if h and ffn else 1.0
        layers *= (10 + (5 + 19 * ratio) / layout.tp) / (10 + 5 + 19 * ratio)
    return {"layers": int(layers), "logits": 2 * logits * micro, "micro_batch": micro}


def activation_basis(c: Comparison) -> str:
    """Where the activation figures come from, in words, for the report and ``estimate``."""
    if model_facts.is_described(c.model):
        return ("activations as the model check measured them: the bytes autograd saved in one step of the real "
                "module (fake tensors, batch 1), times the micro-batch")
    return "activations per Korthikanti et al.'s formula (fused attention)"


def predict_run(c: Comparison, run: RunSpec, world_size: int | None = None,
                described: RunDescription | None = None) -> dict[str, Any]:
    """Predicted per-rank memory of one run: model states (rank 0), activations and their total.

    Returns a dict with the layout, ``param_count``, ``param_bytes``, ``grad_bytes``,
    ``optim_bytes``, ``model_state_bytes``, ``activation_bytes`` and ``total_bytes``. ``described``: the run's
    description when the caller has it (else built here). Raises KeyError for an unknown strategy and
    ValueError for an unknown model kind.
    """
    d = described or describe_run(c, run, world_size)
    layout, params = d.layout, list(d.params)
    states = model_state_bytes(params, layout)
    acts = activation_bytes(c, layout, d.params)
    # While in use FSDP/ZeRO-3 gathers one unit (a block) in full: count the largest one, plus the root
    # where the strategy keeps it gathered from forward to backward.
    gathered = 0
    if layout.shards == "all" and layout.shard_size > 1:
        blocks = d.unit_numels
        compute_bytes = PRECISION_BYTES.get(layout.precision, (4, 4, 4))[2]
        # Without reshard-after-forward every unit stays gathered from its forward to its backward.
        keep = not reshards_after_forward(d.options)
        root = blocks.pop("root", 0) if "root-kept" in d.quirks else 0
        gathered = (sum(blocks.values()) + root if keep else root + max(blocks.values(), default=0)) * compute_bytes
    activation_total = acts["layers"] + acts["logits"]
    return {
        "run": run.name,
        "strategy": run.strategy,
        "world_size": layout.world_size,
        "dp": layout.dp,
        "tp": layout.tp,
        **({"pp": layout.pp} if layout.pp > 1 else {}),
        "shards": layout.shards,
        "shard_group": layout.shard_size,  # ranks each sharded state is split over (dp unless hybrid)
        "replicas": layout.dp // layout.shard_size if layout.hybrid else 1,
        "precision": layout.precision,
        "activation_checkpointing": layout.activation_checkpointing,
        "param_count": d.model.param_count,
        **states,
        "gathered_unit_bytes": gathered,
        "activation_bytes": activation_total,
        "micro_batch": acts["micro_batch"],
        "total_bytes": states["model_state_bytes"] + gathered + activation_total,
    }


def predict_comparison(c: Comparison, world_size: int | None = None) -> list[dict[str, Any]]:
    """``predict_run`` for every run of the comparison (at ``world_size`` if given)."""
    model = describe_model(c.model)  # the model once, every run's layout over it
    return [predict_run(c, run, world_size, describe_run(c, run, world_size, model=model)) for run in c.runs]


def layout_label(pred: dict[str, Any]) -> str:
    """A ``predict_run`` result's layout for tables: ``dp×tp``, and for hybrid sharding how the
    data-parallel ranks split (``4×1 (2-way shard × 2 replicas)``), so that a hybrid run does not read
    as sharded over all of them."""
    label = f"{pred['dp']}×{pred['tp']}" + (f"×{pred['pp']} pp" if (pred.get("pp") or 1) > 1 else "")
    replicas = pred.get("replicas") or 1
    if replicas > 1:
        label += f" ({pred.get('shard_group')}-way shard × {replicas} replicas)"
    return label
