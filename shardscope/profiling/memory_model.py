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
import dataclasses
from dataclasses import dataclass
from typing import Any

from shardscope.config import (Comparison, RunSpec, resolved_grad_accum, resolved_options, resolved_precision,
                               resolved_world_size)
from shardscope.core import registry
from shardscope.core import model_facts
from shardscope.profiling import pipeline_model
from shardscope.core.hf_archs import ARCHS  # noqa: F401  (memory_model.ARCHS: callers read the table through here)
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


# --- sharding ---------------------------------------------------------------------------------


def tp_local(p: Param, tp: int) -> tuple[int, ...]:
    """Shape of ``p`` on one tensor-parallel rank."""
    if tp <= 1 or not p.tp_split:
        return p.shape
    dim = 0 if p.tp_split == "col" or len(p.shape) == 1 else 1
    shape = list(p.shape)
    shape[dim] = math.ceil(shape[dim] / tp)
    return tuple(shape)


def dim0_shard_numel(shape: tuple[int, ...], dp: int, rank: int) -> int:
    """Elements rank ``rank`` of ``dp`` holds when dim 0 is chunked like ``torch.chunk`` (FSDP2)."""
    if not shape:
        return 1 if rank == 0 else 0
    chunk = math.ceil(shape[0] / dp)
    rows = max(0, min(chunk, shape[0] - rank * chunk))
    return rows * math.prod(shape[1:])


@dataclass(frozen=True)
class Layout:
    """How one run places model states: data- and tensor-parallel degrees and what is sharded."""

    world_size: int
    tp: int
    dp: int
    shards: str  # none | optim | grads | all
    precision: str
    low_precision_params: bool  # params/grads held in the compute dtype, fp32 masters in the optimizer
    activation_checkpointing: bool
    master_copy: bool = False  # the optimizer keeps its own fp32 copy of its partition (ZeRO-1/2, 16-bit params)
    flat_optimizer: bool = False  # the optimizer sees flat partitions (one step counter), not the model's tensors
    shard_layout: str = "flat"  # "flat": each unit's elements split evenly (ZeRO-3, hand-written FSDP); "flat-views":
    # so, seen as the tensors' slices (FSDP1 use_orig_params); "per-parameter": dim 0 of every tensor chunked
    # (FSDP2's DTensors), so ranks can hold different amounts
    grads_of_overlapping_tensors: bool = False  # ZeRO-2: whole gradients of every tensor its partition touches
    shard_group: int = 0  # hybrid sharding: ranks each sharded state is split over (0 = all dp ranks)
    hybrid: bool = False  # hybrid sharding: gradient shards all-reduced across the dp / shard_size replicas
    head_split: str = ""  # an untied output layer's weight split by vocabulary under tp (registry "vocab-split-head")
    pp: int = 1  # pipeline: ranks per pipeline, stages per rank (v), micro-batches (m), schedule (profiling/pipeline_model)
    v: int = 1
    microbatches: int = 1
    schedule: str = ""
    accum: int = 1  # micro-batches per optimizer step on each rank (the run's grad_accum)

    @property
    def shard_size(self) -> int:
        """Ranks each sharded model state is split over: the shard group under hybrid sharding, else dp."""
        return self.shard_group or self.dp


# Options that change what a strategy shards, by option name and value (the registry's ``shards``
# is the default): FSDP1's sharding strategy, a ZeRO stage chosen by option. FSDP1's SHARD_GRAD_OP
# holds sharded parameters at rest too; it only keeps them gathered from forward to backward.
# LAYOUT_BY_OPTION: FSDP1 without use_orig_params hands its flat shards themselves to the optimizer.
# A pipeline's stages sharded with FSDP2 across the pipelines (``dp_shard = "fsdp2"``) hold per-parameter DTensors.
LAYOUT_BY_OPTION: dict[str, dict[Any, str]] = {"use_orig_params": {False: "flat"}, "dp_shard": {"fsdp2": "per-parameter"}}
SHARDS_BY_OPTION: dict[str, dict[Any, str]] = {
    "sharding_strategy": {"FULL_SHARD": "all", "HYBRID_SHARD": "all", "SHARD_GRAD_OP": "all", "NO_SHARD": "none"},
    "stage": {0: "none", 1: "optim", 2: "grads", 3: "all"},
    "dp_shard": {"replicate": "none", "fsdp2": "all"},
}


def reshards_after_forward(options: dict[str, Any]) -> bool:
    """False when gathered parameters stay gathered from forward to backward (no re-gather)."""
    return bool(options.get("reshard_after_forward", True)) and options.get("sharding_strategy") != "SHARD_GRAD_OP"


def shards_for(info: registry.StrategyInfo, options: dict[str, Any]) -> str:
    """What the strategy shards with these options: ``SHARDS_BY_OPTION`` where an option says, else the registry's."""
    for key, table in SHARDS_BY_OPTION.items():
        if key in info.options and options.get(key) in table:
            return table[options[key]]
    return info.shards


def layout_for(c: Comparison, run: RunSpec, world_size: int | None = None,
               notes: dict[str, Any] | None = None) -> Layout:
    """Return the run's layout at ``world_size`` (default: the run's own). ``notes`` (a run's ``start``
    record's strategy facts) may say ``shard_layout``, else the registry's. Raises ValueError when the
    run's hybrid sharding does not divide its data-parallel ranks."""
    info = registry.get(run.strategy)
    ws = world_size or resolved_world_size(c, run)
    options = resolved_options(run)
    tp = info.tp_degree(options)
    precision = resolved_precision(c, run)
    low = info.needs_deepspeed and precision in ("bf16-params", "fp16")
    shards = shards_for(info, options)
    # Measured (benchmarks/memory_model.py): DeepSpeed ZeRO-1/2 keep a separate fp32 partition for
    # the optimizer even in fp32 training; so does ZeRO-3 as it ships, unless shardscope's
    # ``reuse_fp32_partitions`` fix is on (then it steps its partitions in place).
    copy = shards in ("optim", "grads") or not options.get("reuse_fp32_partitions", False)
    master = low or (info.needs_deepspeed and copy)
    by_option = next((t[options[k]] for k, t in LAYOUT_BY_OPTION.items() if k in info.options and options.get(k) in t), "")
    shard_layout = str((notes or {}).get("shard_layout") or by_option or info.shard_layout or "flat")
    pp = info.pp_degree(options)
    dp = max(1, ws // (tp * pp))  # hybrid sharding (the registry's ``hybrid``): sharded over a group, replicated across
    groups = info.hybrid.groups(options, dp, max(1, ws // c.launch.nnodes)) if info.hybrid else None
    head = model_facts.untied_head(c.model) if tp > 1 and "vocab-split-head" in info.comm_quirks else ""
    return Layout(ws, tp, dp, shards, precision, low, run.activation_checkpointing, master, info.needs_deepspeed,
                  shard_layout, info.needs_deepspeed and shards == "grads", groups[1] if groups else 0, bool(groups),
                  head, pp, int(options.get("stages_per_rank") or 1), int(options.get("microbatches") or 1),
                  info.schedule, resolved_grad_accum(c, run))


def params_for(m: Any, layout: Layout) -> list[Param]:
    """The model's parameter tensors as the run's strategy splits them under tensor parallelism: the model's own
    plan, and an untied output layer split by vocabulary where the layout says so (``Layout.head_split``)."""
    params = model_params(m)
    if not layout.head_split:
        return params
    return [dataclasses.replace(p, split="col") if p.name == layout.head_split else p for p in params]


def unit_sizes(params: list[Param], tp: int = 1) -> dict[str, list[int]]:
    """Elements of each tensor of each sharding unit, in order: one unit per block (``layers.<i>.``), the
    rest in a "root" unit."""
    units: dict[str, list[int]] = {}
    for p in params:
        units.setdefault(p.unit, []).append(math.prod(tp_local(p, tp)))
    return units


def unit_numels(params: list[Param], tp: int = 1) -> dict[str, int]:
    """Elements per sharding unit (``unit_sizes`` summed)."""
    return {k: sum(sizes) for k, sizes in unit_sizes(params, tp).items()}


FLAT_VIEW_ALIGN = 4  # FSDP1 use_orig_params: each tensor starts 16 bytes into the fp32 flat buffer


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


def activation_bytes(c: Comparison, layout: Layout) -> dict[str, int]:
    """Predicted activation memory per rank for one micro-batch: ``layers`` (all blocks) and ``logits``.

    Korthikanti et al.: s·b·h·(34 + 5·a·s/h) bytes per layer in 16-bit without recomputation; the
    attention-score term is left out because the models use fused scaled-dot-product attention;
    tensor parallelism divides the 24 sharded units of the 34 by tp; fp32 compute doubles it;
    full recomputation keeps 2·s·b·h per layer. Logits and their gradient: 2 x b·s·V x 4 bytes.
    """
    m = c.model
    micro = max(1, c.global_batch // max(1, layout.dp * layout.accum))
    if layout.pp > 1:  # one chunk: a micro-batch of the pipeline's schedule
        micro = max(1, c.global_batch // max(1, layout.dp * layout.microbatches))
    if model_facts.is_described(m):
        return described_activation_bytes(c, layout, micro)
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
        held = pipeline_model.activation_bytes(c, layout, per_layer * scale, int(logits))
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


def predict_run(c: Comparison, run: RunSpec, world_size: int | None = None) -> dict[str, Any]:
    """Predicted per-rank memory of one run: model states (rank 0), activations and their total.

    Returns a dict with the layout, ``param_count``, ``param_bytes``, ``grad_bytes``,
    ``optim_bytes``, ``model_state_bytes``, ``activation_bytes`` and ``total_bytes``. Raises
    KeyError for an unknown strategy and ValueError for an unknown model kind.
    """
    layout = layout_for(c, run, world_size)
    params = params_for(c.model, layout)
    states = model_state_bytes(params, layout)
    acts = activation_bytes(c, layout)
    # While in use FSDP/ZeRO-3 gathers one unit (a block) in full: count the largest one, plus the root
    # where the strategy keeps it gathered from forward to backward.
    gathered = 0
    if layout.shards == "all" and layout.shard_size > 1:
        blocks = unit_numels(params, layout.tp)
        compute_bytes = PRECISION_BYTES.get(layout.precision, (4, 4, 4))[2]
        # Without reshard-after-forward every unit stays gathered from its forward to its backward.
        keep = not reshards_after_forward(resolved_options(run))
        root = blocks.pop("root", 0) if "root-kept" in registry.get(run.strategy).comm_quirks else 0
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
        "param_count": sum(p.numel for p in params),
        **states,
        "gathered_unit_bytes": gathered,
        "activation_bytes": activation_total,
        "micro_batch": acts["micro_batch"],
        "total_bytes": states["model_state_bytes"] + gathered + activation_total,
    }


def predict_comparison(c: Comparison, world_size: int | None = None) -> list[dict[str, Any]]:
    """``predict_run`` for every run of the comparison (at ``world_size`` if given)."""
    return [predict_run(c, run, world_size) for run in c.runs]


def layout_label(pred: dict[str, Any]) -> str:
    """A ``predict_run`` result's layout for tables: ``dp×tp``, and for hybrid sharding how the
    data-parallel ranks split (``4×1 (2-way shard × 2 replicas)``), so that a hybrid run does not read
    as sharded over all of them."""
    label = f"{pred['dp']}×{pred['tp']}" + (f"×{pred['pp']} pp" if (pred.get("pp") or 1) > 1 else "")
    replicas = pred.get("replicas") or 1
    if replicas > 1:
        label += f" ({pred.get('shard_group')}-way shard × {replicas} replicas)"
    return label
