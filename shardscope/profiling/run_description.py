"""One description of a run's model and layout, built once and read by every consumer (issue 48).

``describe_model(m)``: the model's parameter tensors (``param_shapes``: each with its unit, its tensor-parallel
split under the model's own plan and, for a user's module, its pipeline unit), its blocks, embeddings and output
layer, its width, sequence and FLOPs per token (torchtitan's count; an image model's per patch; a tied output
layer's matmul, which that count leaves out with the embedding). For a user's model these come from the model
check's description of the real module on fake tensors (``ModelSpec.described``); for shardscope's own models
from the preset's keys.

``describe_run(c, run, world_size)``: that model under one run's strategy: the ``Layout`` (degrees, what is
sharded and how, precision, accumulation, pipeline), the tensors as the strategy splits them, their shapes on one
tensor-parallel rank and the sharding units' sizes. The memory model, the communication theory, ``predict``'s
work, ``estimate`` and ``explain`` read a ``RunDescription``; none of them asks the registry or the model's keys
again. Pure Python, no torch.

The sharding helpers below (``Layout``, ``layout_for``, ``tp_local``, ...) are where the layout is decided;
``memory_model`` re-exports them for its callers.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from shardscope.config import (Comparison, ModelSpec, RunSpec, resolved_grad_accum, resolved_options,
                               resolved_precision, resolved_world_size)
from shardscope.core import model_facts, registry
from shardscope.profiling.param_shapes import Param, embedding_count, flops_per_token, model_params


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
    unit_blocks: int = 1  # consecutive blocks per sharding unit (FSDP2's ``unit_blocks``)

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
                  info.schedule, resolved_grad_accum(c, run),
                  int(options.get("unit_blocks") or 1) if "unit_blocks" in info.options else 1)


def params_for(m: Any, layout: Layout) -> list[Param]:
    """The model's parameter tensors as the run's strategy splits them under tensor parallelism: the model's own
    plan, and an untied output layer split by vocabulary where the layout says so (``Layout.head_split``)."""
    return _split_head(tuple(model_params(m)), layout)


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


# --- the description ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelDescription:
    """The model, once: its tensors and the figures every consumer reads (see the module's docstring)."""

    spec: ModelSpec
    params: tuple[Param, ...]
    embedding_elements: int  # elements of the embedding tables (no FLOPs counted for them)
    flops_per_token: float | None  # training FLOPs per token (per patch for an image model), tied head included
    layers: int
    hidden: int
    tokens_per_sample: int  # a sample's sequence, or an image's patches
    inputs: str  # "tokens" | "images"
    vocab: int
    counted_flops_per_token: float | None = None  # torchtitan's count alone, as MFU uses it (None for images)

    @property
    def param_count(self) -> int:
        """Parameter elements (shared tensors once)."""
        return sum(p.numel for p in self.params)


def tied_head_flops(m: ModelSpec) -> float:
    """Training FLOPs per token of an output layer that shares the embedding's weight (tied built-in Hugging Face
    architectures): ``flops_per_token`` leaves the embedding's parameters out, and with them this matmul. A user's
    model's counted FLOPs include it already."""
    if m.kind != "hf" or model_facts.is_described(m) or not model_facts.tied_embeddings(m):
        return 0.0
    return 6.0 * model_facts.vocab_size(m) * model_facts.hidden_size(m)


def vit_flops_per_patch(m: ModelSpec, params: list[Param] | tuple[Param, ...], emb: int) -> float:
    """Training FLOPs per patch of the ViT classifier (param_shapes.vit_params), counted as torchtitan counts a
    token: 6 x the parameters every patch goes through (patch projection, blocks, final norm) + 12 x layers x
    d_model x patches of attention, plus the head's 6 x its parameters once per image, shared over its patches.
    The position embedding is an addition (no FLOPs counted, as token embeddings)."""
    head = sum(p.numel for p in params if p.name.startswith("head."))
    per_patch = sum(p.numel for p in params if not p.name.startswith("head.")) - emb
    t = model_facts.tokens_per_sample(m)
    return 6.0 * per_patch + 6.0 * head / t + 12.0 * m.n_layers * m.d_model * t


def describe_model(m: ModelSpec) -> ModelDescription:
    """The model's description (raises ValueError for an unknown kind or a user's model without its check)."""
    params = tuple(model_params(m))
    emb = embedding_count(m)
    counted = flops_per_token(m)
    if m.kind == "vit":
        fpt: float | None = vit_flops_per_patch(m, params, emb)
    else:
        fpt = None if counted is None else counted + tied_head_flops(m)
    return ModelDescription(m, params, emb, fpt, model_facts.layers(m), model_facts.hidden_size(m),
                            model_facts.tokens_per_sample(m), model_facts.inputs(m), model_facts.vocab_size(m),
                            counted)


@dataclass(frozen=True)
class RunDescription:
    """One run's model under its strategy at one world size (see the module's docstring)."""

    comparison: Comparison
    run: RunSpec
    info: registry.StrategyInfo
    options: dict[str, Any]  # the run's options resolved with their defaults
    layout: Layout
    model: ModelDescription
    params: tuple[Param, ...]  # as the strategy splits them under tensor parallelism (``params_for``)
    local_shapes: tuple[tuple[int, ...], ...]  # each tensor on one tensor-parallel rank
    units: dict[str, list[int]]  # each sharding unit's tensors' elements on one tensor-parallel rank, in order

    @property
    def local_elements(self) -> int:
        """Parameter elements on one tensor-parallel rank."""
        return sum(math.prod(s) for s in self.local_shapes)

    @property
    def unit_numels(self) -> dict[str, int]:
        """Elements per sharding unit on one tensor-parallel rank."""
        return {k: sum(v) for k, v in self.units.items()}

    @property
    def quirks(self) -> frozenset[str]:
        """How the strategy departs from the textbook (the registry's ``comm_quirks``)."""
        return frozenset(self.info.comm_quirks)


def describe_run(c: Comparison, run: RunSpec, world_size: int | None = None, notes: dict[str, Any] | None = None,
                 model: ModelDescription | None = None) -> RunDescription:
    """``run`` of ``c`` described at ``world_size`` (default: the run's own); ``notes``: a run's start record's
    strategy facts (``layout_for``); ``model``: the model's description when the caller already has it (one per
    comparison). Raises KeyError for an unknown strategy, ValueError for a model or layout it cannot read."""
    layout = layout_for(c, run, world_size, notes)
    described = model or describe_model(c.model)
    params = tuple(_grouped(_split_head(described.params, layout), layout.unit_blocks))
    return RunDescription(c, run, registry.get(run.strategy), resolved_options(run), layout, described, params,
                          tuple(tp_local(p, layout.tp) for p in params), unit_sizes(list(params), layout.tp))


_BLOCK_UNIT = re.compile(r"^(.*?)(\d+)\.$")


def _grouped(params: list[Param], k: int) -> list[Param]:
    """The tensors with each block's unit replaced by its group's (``unit_blocks`` = k consecutive blocks a unit:
    ``layers.0.`` and ``layers.1.`` both ``layers.0.`` for k = 2), as ``engines/fsdp2.block_groups`` groups them."""
    if k <= 1:
        return params
    out = []
    for p in params:
        found = _BLOCK_UNIT.match(p.unit) if p.unit != "root" else None
        if found:
            p = dataclasses.replace(p, block=f"{found.group(1)}{int(found.group(2)) // k * k}.")
        out.append(p)
    return out


def _split_head(params: tuple[Param, ...], layout: Layout) -> list[Param]:
    if not layout.head_split:
        return list(params)
    return [dataclasses.replace(p, split="col") if p.name == layout.head_split else p for p in params]
