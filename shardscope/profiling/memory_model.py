"""Memory model: predicted per-rank bytes of parameters, gradients, optimizer state and activations.

Pure Python (no torch), so ``shardscope estimate`` and the report work anywhere. The model
starts from the *parameter shapes* of the comparison's model (the built-in transformer, a
Hugging Face architecture from ``hf_archs``, the ViT), so sharding is computed tensor by tensor
the way the strategies shard (FSDP2 chunks dim 0 of each parameter over the data-parallel ranks;
ZeRO partitions one flat buffer), not from a rounded total. Which states a strategy shards comes
from the registry (``StrategyInfo.shards``: none | optim | grads | all), its tensor-parallel
degree from ``StrategyInfo.tp_degree``: no strategy name appears here.

The optimizer is AdamW (two fp32 moments per element plus a 4-byte step counter per parameter
tensor, as ``torch.optim.AdamW`` keeps it). Low-precision parameters with an fp32 master copy
are modelled for strategies that declare ``needs_deepspeed`` (DeepSpeed keeps bf16/fp16 params
and fp32 masters in the optimizer); FSDP keeps its sharded parameters in fp32 and gathers them in
the compute dtype. Activations follow Korthikanti et al. 2022 (REFERENCE.md), scaled to the
compute dtype, with full recomputation when activation checkpointing is on.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from shardscope.config import Comparison, ModelSpec, RunSpec, resolved_options, resolved_precision, resolved_world_size
from shardscope import registry
from shardscope.hf_archs import ARCHS

# Tensor-parallel split of each parameter: "col" splits dim 0 (and the bias), "row" splits dim 1
# (bias replicated), absent = replicated. Megatron-style plan for attention and MLP projections.
TP_SPLIT = {
    "q_proj": "col", "k_proj": "col", "v_proj": "col", "o_proj": "row",
    "fc_in": "col", "fc_out": "row", "gate_proj": "col", "up_proj": "col", "down_proj": "row",
}
PRECISION_BYTES = {  # precision policy -> (param held, grad, compute) bytes for strategies keeping fp32 params
    "fp32": (4, 4, 4),
    "bf16-autocast": (4, 4, 2),
    "bf16-params": (4, 4, 2),
    "fp16": (4, 4, 2),
}
_LAYER = re.compile(r"layers\.\d+\.")
ADAM_MOMENT_BYTES = 8  # exp_avg + exp_avg_sq in fp32
STEP_COUNTER_BYTES = 4  # torch AdamW keeps a float32 scalar "step" per parameter tensor
MASTER_BYTES = 4


@dataclass(frozen=True)
class Param:
    """One parameter tensor: its name, shape and tensor-parallel split."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def tp_split(self) -> str:
        """'col', 'row' or '' (replicated) under tensor parallelism."""
        parts = self.name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        split = TP_SPLIT.get(module, "")
        if split == "row" and parts[-1] == "bias":
            return ""
        return split


# --- parameter shapes per model kind ----------------------------------------------------------


def transformer_params(m: ModelSpec) -> list[Param]:
    """Shapes of the built-in decoder-only transformer (engines/model.py): untied embeddings,
    learned positions, pre-norm LayerNorm blocks with biased q/k/v/o and a GELU MLP."""
    d, f = m.d_model, m.d_ff
    out = [Param("tok_emb.weight", (m.vocab_size, d)), Param("pos_emb.weight", (m.seq_len, d))]
    for i in range(m.n_layers):
        p = f"layers.{i}."
        out += [Param(p + "ln1.weight", (d,)), Param(p + "ln1.bias", (d,))]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out += [Param(f"{p}attn.{proj}.weight", (d, d)), Param(f"{p}attn.{proj}.bias", (d,))]
        out += [Param(p + "ln2.weight", (d,)), Param(p + "ln2.bias", (d,))]
        out += [Param(p + "mlp.fc_in.weight", (f, d)), Param(p + "mlp.fc_in.bias", (f,)),
                Param(p + "mlp.fc_out.weight", (d, f)), Param(p + "mlp.fc_out.bias", (d,))]
    out += [Param("norm.weight", (d,)), Param("norm.bias", (d,)), Param("lm_head.weight", (m.vocab_size, d))]
    return out


def hf_params(m: ModelSpec) -> list[Param]:
    """Shapes of a Qwen2-style causal LM from ``hf_archs`` with ``m.hf_layers`` decoder layers
    (q/k/v with bias, o and the SwiGLU MLP without, RMSNorm weights, tied output embedding)."""
    a = ARCHS[m.hf_arch]
    h, inter, vocab = a["hidden_size"], a["intermediate_size"], a["vocab_size"]
    heads, kv = a["num_attention_heads"], a["num_key_value_heads"]
    hd = h // heads
    out = [Param("model.embed_tokens.weight", (vocab, h))]
    for i in range(m.hf_layers):
        p = f"model.layers.{i}."
        out += [Param(p + "self_attn.q_proj.weight", (heads * hd, h)), Param(p + "self_attn.q_proj.bias", (heads * hd,)),
                Param(p + "self_attn.k_proj.weight", (kv * hd, h)), Param(p + "self_attn.k_proj.bias", (kv * hd,)),
                Param(p + "self_attn.v_proj.weight", (kv * hd, h)), Param(p + "self_attn.v_proj.bias", (kv * hd,)),
                Param(p + "self_attn.o_proj.weight", (h, heads * hd)),
                Param(p + "mlp.gate_proj.weight", (inter, h)), Param(p + "mlp.up_proj.weight", (inter, h)),
                Param(p + "mlp.down_proj.weight", (h, inter)),
                Param(p + "input_layernorm.weight", (h,)), Param(p + "post_attention_layernorm.weight", (h,))]
    out.append(Param("model.norm.weight", (h,)))
    if not a.get("tie_word_embeddings", False):
        out.append(Param("lm_head.weight", (vocab, h)))
    return out


def vit_params(m: ModelSpec) -> list[Param]:
    """Shapes of the ViT classifier (engines/vit.py): a linear patch projection, learned position
    embeddings (one per patch, no class token), the transformer's pre-norm blocks, a final LayerNorm
    and a linear head over the mean-pooled patches."""
    d, f = m.d_model, m.d_ff
    n_patches = (m.image_size // m.patch_size) ** 2
    out = [Param("pos_emb", (n_patches, d)), Param("patch_proj.weight", (d, m.channels * m.patch_size ** 2)),
           Param("patch_proj.bias", (d,))]
    blocks = transformer_params(ModelSpec(vocab_size=1, d_model=d, n_layers=m.n_layers, n_heads=m.n_heads, d_ff=f,
                                          seq_len=1))
    out += [p for p in blocks if p.name.startswith("layers.")]
    out += [Param("norm.weight", (d,)), Param("norm.bias", (d,)), Param("head.weight", (m.num_classes, d)),
            Param("head.bias", (m.num_classes,))]
    return out


PARAM_SHAPES = {"transformer": transformer_params, "hf": hf_params, "vit": vit_params}


def model_params(m: ModelSpec) -> list[Param]:
    """Parameter tensors of the model a ``ModelSpec`` describes; raises ValueError for an unknown kind."""
    fn = PARAM_SHAPES.get(m.kind)
    if fn is None:
        raise ValueError(f"model.kind = {m.kind!r}: allowed: {', '.join(PARAM_SHAPES)}")
    return fn(m)


def param_count(m: ModelSpec) -> int:
    """Total parameter elements of the model (shared tensors once)."""
    return sum(p.numel for p in model_params(m))


def embedding_count(m: ModelSpec) -> int:
    """Parameter elements in embedding tables (left out of FLOPs per token)."""
    return sum(p.numel for p in model_params(m) if "emb" in p.name)


def flops_per_token(m: ModelSpec) -> float | None:
    """Training FLOPs per token, as torchtitan counts: 6 (N - N_emb) + 12 L H d_head T; None for images."""
    if m.kind == "vit":
        return None
    if m.kind == "hf":
        a = ARCHS[m.hf_arch]
        layers, heads, hd, t = m.hf_layers, a["num_attention_heads"], a["hidden_size"] // a["num_attention_heads"], m.seq_len
    else:
        layers, heads, hd, t = m.n_layers, m.n_heads, m.d_model // m.n_heads, m.seq_len
    return 6.0 * (param_count(m) - embedding_count(m)) + 12.0 * layers * heads * hd * t


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
    shard_layout: str = "flat"  # "flat": each unit's elements split evenly (FSDP1, ZeRO-3, hand-written FSDP);
    # "per-parameter": dim 0 of every tensor chunked (FSDP2's DTensors), so ranks can hold different amounts
    grads_of_overlapping_tensors: bool = False  # ZeRO-2: whole gradients of every tensor its partition touches


# Options that change what a strategy shards, by option name and value (the registry's ``shards``
# is the default): FSDP1's sharding strategy, a ZeRO stage chosen by option. FSDP1's SHARD_GRAD_OP
# holds sharded parameters at rest too; it only keeps them gathered from forward to backward.
SHARDS_BY_OPTION: dict[str, dict[Any, str]] = {
    "sharding_strategy": {"FULL_SHARD": "all", "HYBRID_SHARD": "all", "SHARD_GRAD_OP": "all", "NO_SHARD": "none"},
    "stage": {0: "none", 1: "optim", 2: "grads", 3: "all"},
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
    """Return the run's layout at ``world_size`` (default: the run's own).

    ``notes`` (the strategy facts of a run's ``start`` record) may say ``shard_layout``; else the
    registry entry's ``shard_layout`` attribute if it has one; else "flat".
    """
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
    shard_layout = str((notes or {}).get("shard_layout") or getattr(info, "shard_layout", "") or "flat")
    return Layout(ws, tp, max(1, ws // tp), shards, precision, low, run.activation_checkpointing, master,
                  info.needs_deepspeed, shard_layout, info.needs_deepspeed and shards == "grads")


def unit_numels(params: list[Param], tp: int = 1) -> dict[str, int]:
    """Elements per sharding unit: one per block (``layers.<i>.``), the rest in a "root" unit."""
    units: dict[str, int] = {}
    for p in params:
        match = _LAYER.search(p.name)
        key = match.group(0) if match else "root"
        units[key] = units.get(key, 0) + math.prod(tp_local(p, tp))
    return units


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


def model_state_bytes(params: list[Param], layout: Layout, rank: int = 0) -> dict[str, int]:
    """Predicted ``param_bytes``, ``grad_bytes``, ``optim_bytes`` and ``model_state_bytes`` on ``rank``.

    ``rank`` is the data-parallel rank (it matters only where dim-0 chunks are uneven).
    """
    p_bytes, g_bytes, compute_bytes = PRECISION_BYTES.get(layout.precision, (4, 4, 4))
    if layout.low_precision_params:
        p_bytes = g_bytes = compute_bytes
    dp, r = layout.dp, rank % max(1, layout.dp)
    full = sum(math.prod(tp_local(p, layout.tp)) for p in params)
    if layout.shard_layout == "per-parameter":
        shard = sum(dim0_shard_numel(tp_local(p, layout.tp), dp, r) for p in params)
    else:  # every rank holds ceil(unit / dp) of each unit (padding included)
        shard = sum(math.ceil(n / dp) for n in unit_numels(params, layout.tp).values())
    flat_shard = math.ceil(full / dp)
    sharded_p = layout.shards == "all"
    sharded_g = layout.shards in ("grads", "all")
    sharded_o = layout.shards in ("optim", "grads", "all")
    param_numel = shard if sharded_p else full
    grad_numel = (shard if sharded_p else flat_shard) if sharded_g else full
    if layout.grads_of_overlapping_tensors and dp > 1:
        grad_numel = overlapping_tensor_numel([math.prod(tp_local(p, layout.tp)) for p in params], dp, r)
    optim_numel = (shard if sharded_p else flat_shard) if sharded_o else full
    # One step counter per tensor the optimizer sees: the model's tensors, or one flat partition.
    counters = 1 if layout.flat_optimizer else len(params)
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
    micro = max(1, c.global_batch // max(1, layout.dp * c.grad_accum))
    scale = PRECISION_BYTES.get(layout.precision, (4, 4, 4))[2] / 2
    if m.kind == "hf":
        a = ARCHS[m.hf_arch]
        s, h, layers, vocab = m.seq_len, a["hidden_size"], m.hf_layers, a["vocab_size"]
        ffn_ratio = a["intermediate_size"] / (4 * h)
    elif m.kind == "vit":
        s, h, layers, vocab = (m.image_size // m.patch_size) ** 2, m.d_model, m.n_layers, 0
        ffn_ratio = m.d_ff / (4 * m.d_model)
    else:
        s, h, layers, vocab = m.seq_len, m.d_model, m.n_layers, m.vocab_size
        ffn_ratio = m.d_ff / (4 * m.d_model)
    sbh = s * micro * h
    if layout.activation_checkpointing:
        per_layer = 2 * sbh
    else:
        # 10 units replicated (norm inputs, residuals), 24 split by tp; the MLP's share (19 of 24) scales with d_ff/4h.
        per_layer = sbh * (10 + (5 + 19 * ffn_ratio) / layout.tp)
    logits = 2 * micro * s * vocab * 4 // max(1, layout.tp if vocab else 1) if vocab else 0
    return {"layers": int(per_layer * scale * layers), "logits": int(logits), "micro_batch": micro}


def predict_run(c: Comparison, run: RunSpec, world_size: int | None = None) -> dict[str, Any]:
    """Predicted per-rank memory of one run: model states (rank 0), activations and their total.

    Returns a dict with the layout, ``param_count``, ``param_bytes``, ``grad_bytes``,
    ``optim_bytes``, ``model_state_bytes``, ``activation_bytes`` and ``total_bytes``. Raises
    KeyError for an unknown strategy and ValueError for an unknown model kind.
    """
    layout = layout_for(c, run, world_size)
    params = model_params(c.model)
    states = model_state_bytes(params, layout)
    acts = activation_bytes(c, layout)
    # While in use FSDP/ZeRO-3 gathers one unit (a block) in full: count the largest one.
    gathered = 0
    if layout.shards == "all" and layout.dp > 1:
        blocks = unit_numels(params, layout.tp)
        compute_bytes = PRECISION_BYTES.get(layout.precision, (4, 4, 4))[2]
        # Without reshard-after-forward every unit stays gathered from its forward to its backward.
        keep = not reshards_after_forward(resolved_options(run))
        gathered = (sum(blocks.values()) if keep else max(blocks.values(), default=0)) * compute_bytes
    activation_total = acts["layers"] + acts["logits"]
    return {
        "run": run.name,
        "strategy": run.strategy,
        "world_size": layout.world_size,
        "dp": layout.dp,
        "tp": layout.tp,
        "shards": layout.shards,
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
