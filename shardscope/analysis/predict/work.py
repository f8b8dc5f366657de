"""What one optimizer step of a run asks of a machine, for ``shardscope predict``: FLOPs, optimizer
elements, units and the bytes each collective moves, and how the strategy schedules them.

Everything here follows from the run's description (``profiling/run_description.describe_run``, built once in
``work_of``: the model's tensors, units and FLOPs, the strategy's layout) and the registry's schedule traits (no
measurement, no torch):

- FLOPs per token from the description (``flops_per_token`` (torchtitan's count; plus the output matmul of a
  tied embedding, which that count leaves out with the embedding's parameters); an image model's per patch
  (``vit_flops_per_patch``), its throughput in samples/s: a third in forward, two
  thirds in backward (activation checkpointing adds one more forward inside backward); tensor
  parallelism divides a rank's FLOPs by its degree. Tokens per rank: the global batch over the
  data-parallel ranks (tensor-parallel peers take the same tokens).
- Units (one per block, plus the root: embeddings, final norm, head) and each unit's share of the FLOPs,
  so the schedule can place per-unit communication between per-unit compute.
- Bytes per collective type from ``comm_theory.expected_comm``: the schedule moves exactly the theory's
  bytes, placed where the strategy moves them.
- ``Traits``: how a strategy schedules its collectives, derived from its registry entry and options
  (what it shards, its quirks, whether it declares a bucket size or a prefetch option): no strategy
  name appears here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from shardscope.core import model_facts, registry
from shardscope.config import Comparison, RunSpec
from shardscope.profiling import comm_theory, memory_model
from shardscope.profiling.run_description import RunDescription, describe_model, describe_run, tied_head_flops
from shardscope.analysis.predict import pipeline

_BLOCK = re.compile(r"layers\.(\d+)\.")
REPLICATED, PARTITIONED, FULLY_SHARDED, TENSOR_PARALLEL = "replicated", "partitioned", "fully-sharded", "tensor-parallel"
PIPELINE = "pipeline"
FAMILY_TEXT = {
    REPLICATED: "full replica per rank, gradients all-reduced",
    PARTITIONED: "optimizer states (and gradients) partitioned, parameters replicated",
    FULLY_SHARDED: "parameters, gradients and optimizer states sharded, gathered per unit",
    TENSOR_PARALLEL: "layers split across ranks (tensor parallel)",
    PIPELINE: "the model cut into stages across ranks, micro-batches streamed through them (pipeline)",
}
# torch DDP's reducer: the first bucket is capped at 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES), then bucket_cap_mb.
DDP_FIRST_BUCKET_BYTES = 1 << 20
NORM_ALLREDUCE_BYTES = 8  # a sharded strategy's global gradient norm: one scalar all-reduced per step


class NotPredicted(ValueError):
    """A run the machine model cannot predict; the message says why."""


@dataclass(frozen=True)
class Traits:
    """How a strategy schedules its collectives (derived from the registry; see ``traits_of``)."""

    bucketed: bool  # DDP's reducer: gradient buckets all-reduced asynchronously as backward fills them
    bucket_bytes: int
    regather: bool  # re-gathers parameters in backward (reshard after forward)
    root_kept: bool  # the root unit stays gathered from forward to backward
    prefetch: bool  # on GPUs: the next unit's all-gather issued while this unit computes
    async_reduce: bool  # on GPUs: reduce-scatters on their own stream, waited for at the end of backward
    reduces_per_micro: bool
    norm_allreduce: bool  # the global gradient norm needs an all-reduce (sharded states or tensor parallel)
    # DeepSpeed ZeRO-3 (stage3_prefetch_bucket_size, reduce_bucket_size = bucket_mb): units gathered together in
    # one coalesced call up to this many elements, gradients reduce-scattered a bucket at a time; 0: per unit
    gather_bucket: int = 0
    reduce_bucket: int = 0
    kept_through_no_sync: bool = False  # units not resharded after forward stay gathered across micro-batches (FSDP1)
    hybrid: bool = False  # gradient shards all-reduced across the replicas, even one (FSDP1's HYBRID_SHARD)


@dataclass
class Work:
    """One optimizer step of one run, per rank."""

    run: str
    strategy: str
    family: str
    shards: str  # none | optim | grads | all (memory_model.shards_for)
    world_size: int
    dp: int
    tp: int
    shard_group: int  # ranks a sharded state is split over (dp unless hybrid sharding)
    precision: str
    accum: int
    activation_checkpointing: bool
    tokens_per_step: int  # global tokens (an image model's patches) per optimizer step
    tokens_per_rank: float
    layers: int
    fwd_flops: float  # per rank per step
    bwd_flops: float  # per rank per step, without activation recomputation (that is one more forward)
    layer_tokens: float  # tokens per rank x layers: the per-layer-and-token feature of the compute fit
    optim_elements: int
    optim_tensors: int
    param_tensors: int  # the model's parameter tensors: what per-tensor framework overhead (hooks, dispatch) scales with
    units: list[tuple[str, float, int]]  # (unit, share of FLOPs, parameter elements) in forward order, root first
    emb_elements: int  # the root's embedding elements (their gradients are ready last in backward)
    by_type: dict[str, float]  # bytes per collective type per step (comm_theory)
    tp_layer_bytes: tuple[float, float]  # one micro-batch's tensor-parallel activation all-reduce bytes per layer:
    # (forward, backward); their sum over layers and micro-batches is part of by_type["all_reduce"]
    traits: Traits
    notes: list[str] = field(default_factory=list)
    # the calls those bytes are split over, per layer and micro-batch: two in forward (attention and MLP outputs),
    # one per column-parallel linear in backward (a real AutoTP step on 2 layers: 17 all-reduces, RESULTS.md)
    tp_layer_calls: tuple[int, int] = (1, 1)
    # an image model's samples per optimizer step (its throughput is samples/s; its "tokens" are patches); 0: a
    # language model, whose throughput is tokens/s
    samples_per_step: int = 0
    # a pipeline run's schedule, degrees, stage FLOP shares and per-rank parameters (predict/pipeline.facts); its
    # fwd_flops/bwd_flops/optim_elements are then the whole model's for one pipeline's tokens
    pipeline: dict[str, Any] | None = None


def family_of(shards: str, tp: int) -> str:
    """The schedule family a layout belongs to: replicated, partitioned, fully-sharded or tensor-parallel."""
    if tp > 1:
        return TENSOR_PARALLEL
    return {"none": REPLICATED, "optim": PARTITIONED, "grads": PARTITIONED}.get(shards, FULLY_SHARDED)


def traits_of(info: registry.StrategyInfo, options: dict[str, Any], shards: str, tp: int,
              local_elements: int = 0) -> Traits:
    """Schedule traits from a registry entry and resolved options (``local_elements``: the model's parameter
    elements on one tensor-parallel rank).

    - A strategy declaring ``bucket_cap_mb`` without sharding has torch's reducer (DDP): async buckets.
    - Prefetching (GPUs only): a ``backward_prefetch`` option says so where it exists (FSDP1); per-parameter
      sharding (FSDP2) prefetches one unit in backward and runs ahead in forward; DeepSpeed ZeRO-3 prefetches
      its all-gathers; a flat-sharding strategy declaring neither (the hand-written FSDP) blocks on every
      collective. DeepSpeed runs with ``overlap_comm`` off (engines/deepspeed_config.py): its reductions block.
    - DeepSpeed ZeRO-3 gathers and reduces in buckets of ``bucket_mb`` (its prefetch, live-parameter and reduce
      bucket sizes, deepspeed_config.py); a model within the live limit stays gathered from forward to backward
      (``live-params-kept``, as comm_theory counts its bytes). Counted in a real parity step (2 micro-batches,
      tests/test_layout_matrix.py): 2 all-gathers and 2 reduce-scatters, where a call per unit made 12 and 6.
    """
    quirks = set(info.comm_quirks)
    bucket_elements = int(options.get("bucket_mb", 25)) * 2**20 // 4 if "bucket_mb" in info.options else 0
    kept = "live-params-kept" in quirks and shards == "all" and 0 < local_elements <= bucket_elements
    deepspeed_sharded = info.needs_deepspeed and shards == "all"
    if "backward_prefetch" in info.options:
        prefetch = str(options.get("backward_prefetch", "pre")) != "none"
    else:
        prefetch = info.shard_layout == "per-parameter" or info.needs_deepspeed
    bucket = "bucket_cap_mb" in info.options and shards == "none"
    return Traits(
        bucketed=bucket,
        bucket_bytes=int(options.get("bucket_cap_mb", 25)) << 20 if bucket else 0,
        regather=memory_model.reshards_after_forward(options) and not kept,
        root_kept="root-kept" in quirks or info.shard_layout == "per-parameter",
        prefetch=shards == "all" and prefetch,
        async_reduce=shards == "all" and prefetch and not info.needs_deepspeed,
        reduces_per_micro="reduces-per-micro-batch" in quirks,
        norm_allreduce=shards != "none" or tp > 1,
        gather_bucket=bucket_elements if deepspeed_sharded else 0,
        reduce_bucket=bucket_elements if deepspeed_sharded else 0,
        kept_through_no_sync="kept-through-no-sync" in quirks,
    )


def unit_shares(d: RunDescription) -> list[tuple[str, float, int]]:
    """(unit, share of the step's FLOPs, parameter elements on a tensor-parallel rank), root first then the
    blocks in order. A block's FLOPs per token: 6 x its parameters + 12 x hidden x sequence of attention; the
    root's: 6 x its non-embedding parameters (final norm and head). A unit of several blocks (``unit_blocks``) has
    the attention of each."""
    tp, numel, m, k = d.layout.tp, d.unit_numels, d.model, d.layout.unit_blocks
    attn = 12.0 * m.hidden * m.tokens_per_sample

    def blocks_in(unit: str) -> int:
        first = int(_BLOCK.search(unit).group(1))  # type: ignore[union-attr]
        return max(1, min(k, m.layers - first)) if k > 1 else 1

    flops = {u: 6.0 * n * tp + (attn * blocks_in(u) if u != "root" else 0.0) for u, n in numel.items()}
    flops["root"] = 6.0 * max(0, numel.get("root", 0) * tp - m.embedding_elements) + tied_head_flops(m.spec)
    total = sum(flops.values()) or 1.0
    blocks = sorted((u for u in numel if u != "root"), key=lambda u: int(_BLOCK.search(u).group(1)))  # type: ignore[union-attr]
    order = ["root", *blocks] if "root" in numel else blocks
    return [(u, flops[u] / total, numel[u]) for u in order]


def tokens_per_sample(m: Any) -> int:
    """Tokens a sample carries through the blocks: its sequence, or an image's patches (a ViT has no class token)."""
    return model_facts.tokens_per_sample(m)


def vit_flops_per_patch(m: Any) -> float:
    """Training FLOPs per patch of the ViT classifier (``run_description.vit_flops_per_patch``, as the model's
    description counts it)."""
    return float(describe_model(m).flops_per_token or 0.0)


def tp_layer_bytes(d: RunDescription, compute_bytes: int) -> tuple[float, float]:
    """(forward, backward) all-reduce bytes of tensor-parallel activations per layer and micro-batch, as
    ``comm_theory`` counts them: two in forward, one per column-parallel linear in backward."""
    layout, c = d.layout, d.comparison
    if layout.tp <= 1:
        return (0.0, 0.0)
    micro = max(1, c.global_batch // (layout.dp * max(1, layout.accum or c.grad_accum)))  # the run's accumulation
    one = float(micro * c.model.seq_len * d.model.hidden * compute_bytes)
    return (2 * one, comm_theory.column_linears(list(d.params)) * one)


def work_of(c: Comparison, run: RunSpec, world_size: int | None = None) -> Work:
    """The work of one optimizer step of ``run`` per rank at ``world_size`` (default: the run's own).

    Raises NotPredicted when the model has no FLOP count (a kind no count covers), KeyError/ValueError for a
    run the memory model or the communication theory cannot read.
    """
    d = describe_run(c, run, world_size)  # the model and its layout, once: everything below reads it
    fpt = d.model.flops_per_token
    if fpt is None:
        raise NotPredicted(f"model.kind = {c.model.kind!r} has no FLOPs-per-token count (memory_model.flops_per_token): "
                           "compute cannot be scaled from the calibration")
    info, layout, options, params = d.info, d.layout, d.options, list(d.params)
    ws = layout.world_size
    theory = comm_theory.comm_of(d)
    full = d.local_elements
    shard_group = int(getattr(layout, "shard_size", layout.dp) or layout.dp)
    optim_elements = full if layout.shards == "none" else math.ceil(full / max(1, shard_group))
    tokens_per_step = c.global_batch * d.model.tokens_per_sample
    tokens_per_rank = tokens_per_step / layout.dp
    ac = bool(run.activation_checkpointing)
    layers = d.model.layers
    compute_bytes = memory_model.PRECISION_BYTES.get(layout.precision, (4, 4, 4))[2]
    piped = pipeline.facts(d) if info.schedule else None
    return Work(
        run=run.name, strategy=run.strategy, shards=layout.shards, pipeline=piped,
        family=PIPELINE if piped else family_of(layout.shards, layout.tp),
        samples_per_step=c.global_batch if d.model.inputs == "images" else 0,
        world_size=ws,
        dp=layout.dp, tp=layout.tp, shard_group=shard_group, precision=layout.precision, accum=max(1, layout.accum),
        activation_checkpointing=ac, tokens_per_step=tokens_per_step, tokens_per_rank=tokens_per_rank, layers=layers,
        fwd_flops=fpt / 3 * tokens_per_rank / layout.tp,
        bwd_flops=fpt * 2 / 3 * tokens_per_rank / layout.tp,
        layer_tokens=tokens_per_rank * layers,
        optim_elements=optim_elements, optim_tensors=1 if info.needs_deepspeed else len(params),
        param_tensors=len(params),
        units=unit_shares(d), emb_elements=d.model.embedding_elements,
        by_type={k: float(v) for k, v in theory["by_type"].items()},
        tp_layer_bytes=tp_layer_bytes(d, compute_bytes),
        tp_layer_calls=(2, max(1, comm_theory.column_linears(params))) if layout.tp > 1 else (1, 1),
        traits=replace(traits_of(info, options, layout.shards, layout.tp, full), hybrid=layout.hybrid),
    )
