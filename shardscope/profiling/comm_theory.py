"""Communication theory: bytes of each collective type per optimizer step, in the dtype it moves.

Sizes as nccl-tests counts them (the full buffer: an all-gather's gathered output, a
reduce-scatter's full input). The textbook figures, then what each strategy does differently
(the registry's ``comm_quirks``), each with the one-line reason the report shows:

- nothing sharded (DDP, FSDP1 NO_SHARD): one all-reduce of every gradient; DDP also broadcasts
  the module's buffers before every forward;
- ZeRO-1/2: an all-gather of the updated parameters, and the gradients reduced; DeepSpeed
  (0.19) all-reduces its gradient buckets rather than reduce-scattering them;
- full sharding: an all-gather of every unit in forward, again in backward unless
  reshard-after-forward is off (FSDP1 and the hand-written FSDP keep the root unit gathered from
  forward to backward), and a reduce-scatter of the gradients (the hand-written FSDP after every
  micro-batch); with several micro-batches, every micro-batch gathers again (parameters are resharded
  after each backward) except where FSDP1 keeps SHARD_GRAD_OP's units gathered through ``no_sync``;
- hybrid sharding (FSDP1 HYBRID_SHARD, FSDP2 on a 2-D mesh; the registry's ``hybrid``): the
  gathers and reduce-scatters run within a shard group, and each unit's reduce-scattered gradient
  shard is then all-reduced across the replicas (1/S of the gradients, S the shard group's size;
  FSDP1 runs that all-reduce even with one replica, over a group of one rank);
- flat buffers are padded to a multiple of the ranks they are split over (FSDP1, ZeRO), FSDP2 pads
  each tensor's dim 0;
- DeepSpeed under bf16 parameters reduces gradients in fp32 (``communication_data_type``, which
  engines/deepspeed_zero.py sets);
- tensor parallel: two all-reduces of the activations per layer in forward and two in backward.

Gathers move the compute dtype when parameters are held or cast low (``bf16-params``, fp16),
reductions the gradient dtype (or the ``reduce_dtype`` option).
"""

from __future__ import annotations

import math
from typing import Any

from shardscope.config import Comparison, RunSpec
from shardscope.core import model_facts
from shardscope.profiling import pipeline_model
from shardscope.profiling.memory_model import ARCHS, PRECISION_BYTES, flat_offsets
from shardscope.profiling.run_description import (
    dim0_shard_numel,
    FLAT_VIEW_ALIGN,
    RunDescription,
    describe_run,
    reshards_after_forward,
    tp_local,
    unit_numels,
    unit_sizes,
)

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
LOW_PARAM_POLICIES = ("bf16-params", "fp16")  # gathered parameters in the compute dtype


_PER_MICRO = ("gradients are reduced after every micro-batch, as backward produces them: sharded gradients "
              "keep no full buffer to accumulate into between micro-batches")


def _pad(n: int, multiple: int) -> int:
    return -(-n // max(1, multiple)) * max(1, multiple)


def buffer_bytes(comp: Comparison) -> int:
    """Bytes of the model's buffers, which DDP broadcasts: a user's model's as the model check found them; a
    built-in Hugging Face architecture's rotary embedding ``inv_freq`` and ``original_inv_freq`` (head_dim / 2 fp32
    each, transformers 5); the built-in transformer and the ViT have none."""
    m = comp.model
    if model_facts.is_described(m):
        return int(model_facts.description(m).get("buffer_bytes") or 0)
    if m.kind != "hf":
        return 0
    a = ARCHS[m.hf_arch]
    head_dim = a.get("head_dim") or a["hidden_size"] // a["num_attention_heads"]
    return 2 * (head_dim // 2) * 4


def expected_comm(spec: dict[str, Any]) -> dict[str, Any]:
    """Theoretical bytes per optimizer step for a run, from its ``spec.json`` payload.

    Returns ``bytes_per_step``, ``by_type`` (bytes per collective type), ``basis`` (a sentence)
    and ``reasons`` (one line per way this strategy departs from the textbook formula).
    Raises KeyError or ValueError for a spec it cannot read.
    """
    comp = Comparison.from_dict({**spec["comparison"], "runs": []})
    resolved = spec["run"]
    run = RunSpec(name=resolved["name"], strategy=resolved["strategy"], world_size=resolved.get("world_size", 0),
                  precision=resolved.get("precision", ""), options=resolved.get("options", {}),
                  activation_checkpointing=resolved.get("activation_checkpointing", False))
    return comm_of(describe_run(comp, run))


def comm_of(d: RunDescription) -> dict[str, Any]:
    """``expected_comm``'s figures from a run's description (``profiling/run_description``)."""
    comp, layout, params, quirks = d.comparison, d.layout, list(d.params), d.quirks
    local = d.local_elements
    _, g_bytes, compute_bytes = PRECISION_BYTES.get(layout.precision, (4, 4, 4))
    opts = d.options
    low = layout.low_precision_params or layout.precision in LOW_PARAM_POLICIES
    gather_bytes = _DTYPE_BYTES.get(str(opts.get("param_dtype", "auto")), compute_bytes if low else 4)
    reduce_bytes = _DTYPE_BYTES.get(str(opts.get("reduce_dtype", "auto")),
                                    compute_bytes if layout.low_precision_params else g_bytes)
    parts: dict[str, float] = {}
    basis, reasons = [], []
    if "fp32-grad-comm" in quirks and layout.precision == "bf16-params" and layout.dp > 1:
        reduce_bytes = 4
        reasons.append("under bf16 parameters DeepSpeed reduces gradients in fp32 (shardscope sets its "
                       "communication_data_type to fp32, so bf16 gradients are not summed in bf16)")
    accum = max(1, layout.accum)
    dp = layout.dp
    if layout.pp > 1:
        return _pipeline_comm(comp, layout, params, g_bytes)
    one_rank = dp == 1 and layout.tp == 1 and "one-rank-collectives" in quirks
    if one_rank:
        reasons.append("at one rank it still hands its tensors to collectives, on a group of one (no bytes cross "
                       "a link; counted as handed, as at any world size)")
    no_shard = layout.shards == "none" or (one_rank and "no-shard-at-one-rank" in quirks)
    if one_rank and layout.shards != "none" and no_shard:
        reasons.append("FSDP1 switches to NO_SHARD at world size 1: it all-reduces its flat buffers")
    gatherless = one_rank and "no-gather-at-one-rank" in quirks
    if gatherless:
        reasons.append("DeepSpeed gathers no parameters at one rank (each holds them whole); it still reduces "
                       "gradients on a group of one")
    if dp > 1 or one_rank:
        if no_shard:  # FSDP1's NO_SHARD all-reduces its flat buffers, alignment padding included
            flat = (sum(flat_offsets(sizes, FLAT_VIEW_ALIGN)[-1][1] for sizes in d.units.values())
                    if layout.shard_layout == "flat-views" else local)
            parts["all_reduce"] = flat * reduce_bytes
            basis.append("all-reduce of every gradient")
            if "buffers-broadcast" in quirks and buffer_bytes(comp):
                parts["broadcast"] = buffer_bytes(comp)
                reasons.append("DDP broadcasts the module's buffers from rank 0 before the first forward of "
                               "every step (broadcast_buffers; not in forwards after a no_sync micro-batch)")
        elif layout.shards in ("optim", "grads"):
            flat = _pad(local, 2 * dp)  # DeepSpeed aligns its flat partitions (nccl_start_alignment_factor 2)
            if not gatherless:
                parts["all_gather"] = flat * gather_bytes
            if "grads-all-reduced" in quirks:
                per_micro = accum if "reduces-per-micro-batch" in quirks else 1
                parts["all_reduce"] = local * reduce_bytes * per_micro
                basis.append("all-reduce of gradient buckets" + ("" if gatherless else " + all-gather of updated parameters"))
                reasons.append("DeepSpeed ZeRO-1/2 all-reduce each gradient bucket (each rank keeps its part), "
                               "not a reduce-scatter")
                if per_micro > 1:
                    reasons.append(_PER_MICRO)
            else:
                parts["reduce_scatter"] = local * reduce_bytes
                basis.append("reduce-scatter of gradients" + ("" if gatherless else " + all-gather of updated parameters"))
        else:
            units = _units(params, layout)
            regather = reshards_after_forward(opts)
            live = int(opts.get("bucket_mb", 25)) * 2**20 // 4  # deepspeed_zero: stage3_max_live_parameters
            # every micro-batch gathers again, unless the strategy keeps unresharded units through no_sync micro-batches
            kept_through = not regather and "kept-through-no-sync" in quirks
            gathers_per_step = 1 if kept_through else accum
            if not regather and not kept_through and accum > 1:
                reasons.append("parameters kept gathered from forward to backward are resharded after each "
                               "backward: every micro-batch gathers them again")
            if "live-params-kept" in quirks and local <= live:
                regather, gathers_per_step = False, accum  # kept within a micro-batch, gathered again in the next
                reasons.append("ZeRO-3 keeps up to stage3_max_live_parameters (bucket_mb) gathered: a model "
                               "under that limit is gathered once per step")
            backward = {k: v for k, v in units.items() if not ("root-kept" in quirks and k == "root")}
            fwd, bwd = sum(units.values()), sum(backward.values()) if regather else 0
            if not gatherless:
                parts["all_gather"] = (fwd + bwd) * gather_bytes * gathers_per_step
            per_micro = accum if "reduces-per-micro-batch" in quirks else 1
            parts["reduce_scatter"] = fwd * reduce_bytes * per_micro
            if per_micro > 1:
                reasons.append(_PER_MICRO)
            basis.append("reduce-scatter of gradients" if gatherless else "all-gather in forward"
                         + (" and backward" if regather else "") + " + reduce-scatter of gradients")
            if layout.hybrid:
                parts["all_reduce"] = parts["reduce_scatter"] // layout.shard_size
                replicas = dp // layout.shard_size
                basis.append(f"hybrid: sharded over {layout.shard_size} ranks + all-reduce of the gradient shards "
                             f"across {replicas} replica(s)")
                reasons.append(f"hybrid sharding: parameters are gathered and gradients reduce-scattered within "
                               f"shard groups of {layout.shard_size} ranks, then each rank all-reduces its gradient "
                               f"shard (1/{layout.shard_size} of the gradients) across the {replicas} replica(s)"
                               + (" (run even without another replica)" if replicas == 1 else ""))
            if regather and len(backward) < len(units):
                reasons.append("the root unit stays gathered from forward to backward: it is not re-gathered")
    if layout.tp > 1:
        micro = max(1, comp.global_batch // (dp * accum))
        h, layers, seq = d.model.hidden, d.model.layers, d.model.tokens_per_sample
        # Forward: after attention's and the MLP's row-parallel output. Backward: the input gradient of
        # every column-parallel linear (q, k, v, gate, up... each a separate module) is a partial sum.
        col = column_linears(params)
        per_layer = 2 + col
        parts["all_reduce"] = (parts.get("all_reduce", 0)
                               + per_layer * layers * micro * seq * h * compute_bytes * accum)
        basis.append(f"tensor parallel: 2 all-reduces of activations per layer in forward and {col} in backward "
                     "(one per column-parallel linear)")
        if layout.head_split:
            # DeepSpeed AutoTP (training): the head's local logits all-gathered along the vocabulary, shards padded
            # to the largest (GatherFromTensorParallelRegion), and its input's gradient all-reduced in backward.
            vocab = next(p.shape[0] for p in params if p.name == layout.head_split)
            parts["all_gather"] = (parts.get("all_gather", 0)
                                   + micro * seq * math.ceil(vocab / layout.tp) * layout.tp * compute_bytes * accum)
            parts["all_reduce"] += micro * seq * h * compute_bytes * accum
            basis.append("the output layer split by vocabulary: its logits all-gathered, its input's gradient "
                         "all-reduced")
            reasons.append(f"DeepSpeed AutoTP splits the untied output layer ({layout.head_split}) by vocabulary in "
                           "training: each micro-batch all-gathers the logits and all-reduces the gradient of the "
                           "layer's input")
    return {"bytes_per_step": sum(parts.values()), "by_type": parts, "basis": "; ".join(basis) or "no communication",
            "reasons": reasons, "dp": dp, "tp": layout.tp, "shards": layout.shards}


PIPELINE_PARAM_BYTES = 4  # pipeline stages hold fp32 parameters (fp32 or bf16 autocast: presets/pipeline_checks.py)
NORM_BYTES = 4  # one fp32 norm


def _pipeline_comm(comp: Comparison, layout: Any, params: list, grad_bytes: int) -> dict[str, Any]:
    """A pipeline's bytes per step, the mean over ranks (profiling/pipeline_model.py): each stage boundary's
    activations and gradients sent and received, the global gradient norm's all-reduce across the stages, and,
    with several pipelines, one all-reduce of each rank's stage gradients across them, or (FSDP2 on the stages) each
    unit's all-gather and reduce-scatter once a step."""
    p2p = pipeline_model.p2p_bytes(comp, layout, layout.dp)
    parts: dict[str, float] = {"send": p2p, "recv": p2p, "all_reduce": NORM_BYTES}
    n_stages = layout.pp * layout.v
    basis = [f"{n_stages - 1} stage boundaries x {layout.microbatches} micro-batches of activations forward and "
             "gradients back (point to point)", "the gradient norm's all-reduce across the stages (4 B)"]
    reasons = ["pipeline stages exchange activations point to point; the figure is the mean over ranks (the first "
               "and last ranks hold fewer boundaries)"]
    per_rank = [pipeline_model.rank_params(params, layout.pp, layout.v, r) for r in range(layout.pp)]
    if layout.dp > 1 and layout.shards == "all":  # FSDP2 on each stage across the pipelines (dp_shard = "fsdp2")
        gathered = sum(sum(_units(held, layout).values()) for held in per_rank) / layout.pp
        parts["all_gather"] = gathered * PIPELINE_PARAM_BYTES
        parts["reduce_scatter"] = gathered * grad_bytes
        parts["all_reduce"] += NORM_BYTES * sum(len(held) for held in per_rank) / layout.pp
        basis.append(f"FSDP2 on each stage over the {layout.dp} pipelines: each unit all-gathered once a step (kept "
                     "gathered across the micro-batches) and its gradients reduce-scattered once, at its stage's last "
                     "backward; the gradient norm's per-tensor norms all-reduced across them")
        reasons.append("the norm of sharded gradients (torch.nn.utils.get_total_norm over DTensors) all-reduces one "
                       "norm per tensor across the pipelines before the stages add their squares")
    elif layout.dp > 1:
        held = [sum(p.numel for p in rank) for rank in per_rank]
        parts["all_reduce"] += sum(held) * grad_bytes / layout.pp
        basis.append(f"one all-reduce of each rank's stage gradients across the {layout.dp} pipelines")
    tied = pipeline_model.tied_params(params)
    if tied:  # Megatron-LM's embedding all-reduce: the first and the last stage's ranks sum the tied gradient
        sharded = layout.dp > 1 and layout.shards == "all"
        numel = sum(sum(dim0_shard_numel(p.shape, layout.shard_size, r) for r in range(layout.shard_size))
                    / layout.shard_size if sharded else p.numel for p in tied)  # a shard: the mean over the pipelines
        parts["all_reduce"] += 2 * numel * grad_bytes / layout.pp
        if sharded:  # the last stage's rank leaves the tied weight out of the norm: one per-tensor norm fewer
            parts["all_reduce"] -= NORM_BYTES * len(tied) / layout.pp
        basis.append(f"the tied embedding's gradient ({', '.join(p.name for p in tied)}) all-reduced between the "
                     "first and the last stage")
    return {"bytes_per_step": sum(parts.values()), "by_type": parts, "basis": "; ".join(basis),
            "reasons": reasons, "dp": layout.dp, "tp": layout.tp, "shards": layout.shards}


def column_linears(params: list) -> int:
    """Column-parallel linears per block (each all-reduces its input's gradient in backward), in the first block."""
    return sum(1 for p in params if p.tp_split == "col" and len(p.shape) > 1 and p.unit == "layers.0.")


def _units(params: list, layout: Any) -> dict[str, int]:
    """Gathered elements per unit, padded as the strategy pads over the ranks it shards across: each tensor's
    dim 0 (FSDP2), else the flat unit."""
    if layout.shard_layout == "per-parameter":
        out: dict[str, int] = {}
        for p in params:
            shape = tp_local(p, layout.tp)
            key = p.unit
            rest = math.prod(shape[1:]) if len(shape) > 1 else 1
            out[key] = out.get(key, 0) + _pad(shape[0], layout.shard_size) * rest
        return out
    if layout.shard_layout == "flat-views":  # FSDP1 use_orig_params aligns each tensor in its flat buffer
        return {k: _pad(flat_offsets(sizes, FLAT_VIEW_ALIGN)[-1][1], layout.shard_size)
                for k, sizes in unit_sizes(params, layout.tp).items()}
    return {k: _pad(n, layout.shard_size) for k, n in unit_numels(params, layout.tp).items()}
