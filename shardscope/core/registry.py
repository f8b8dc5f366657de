"""The registry of strategies: the one place where strategy names live.

Importing this module must not import torch: ``config.py`` validates presets against it
and the app must open without torch. Each entry names the module and function that applies
the strategy inside a rank (imported lazily by the worker), declares its typed options and
what it needs (GPU, DeepSpeed, a minimum world size, a tensor-parallel degree).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardscope.core.hybrid import HybridSharding, split_data_parallel

__all__ = ["HybridSharding", "split_data_parallel", "StrategyInfo", "OptionSpec", "Suspect", "STRATEGIES", "LOOP_OPTIONS",
           "register", "get", "names", "option_defaults"]


@dataclass(frozen=True)
class OptionSpec:
    """One typed option of a strategy."""

    type: type
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None
    minimum: int | None = None
    # True for an option that changes the framework's own behaviour (a fix shardscope applies): it
    # defaults off, so a run measures the framework as it ships, and reports show both figures when on.
    framework_fix: bool = False

    def describe(self) -> str:
        """Return what values are allowed, for error messages."""
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.type is bool:
            return "true or false"
        if self.minimum is not None:
            return f"an integer >= {self.minimum}"
        return f"a {self.type.__name__}"


@dataclass(frozen=True)
class Suspect:
    """A setting that can move a run's loss away from the baseline's, and how ``shardscope why`` moves it back.

    A variant sets ``option`` (a strategy option, or a loop option of ``LOOP_OPTIONS``) to ``towards``: a value, or
    ``"baseline:<slot>"``, the baseline's dtype in that slot of its precision policy (param, compute, reduce,
    master) as an option value. A baseline with the same option gives its own value instead."""

    setting: str  # what the report names as the cause ("reduce dtype")
    option: str
    towards: Any
    quirk: str  # why it moves the loss, in one line


@dataclass(frozen=True)
class StrategyInfo:
    """What the registry knows of one strategy."""

    name: str
    entry: str  # "module:function" applied inside each rank
    description: str
    options: dict[str, OptionSpec] = field(default_factory=dict)
    gpu_only: bool = False
    needs_deepspeed: bool = False
    min_world_size: int = 1
    tp_option: str | None = None  # name of the option holding the tensor-parallel degree
    # Pipeline parallelism (engines/pipeline.py): the option holding the pipeline degree (ranks per pipeline), and
    # which torch.distributed.pipelining schedule runs the micro-batches ("" = not a pipeline strategy).
    pp_option: str | None = None
    schedule: str = ""
    models: tuple[str, ...] = ("transformer", "hf", "vit", "module")
    # What it needs of a user's model beyond its kind, each a ``<need>_refusal`` the model check fills in
    # (engines/describe.py): "tp_plan" (a tensor-parallel plan it can apply), "autotp" (an architecture whose AutoTP
    # parity with DDP is checked). A run whose model lacks one is left out before the start, with the reason.
    model_needs: tuple[str, ...] = ()
    shards: str = "none"  # which model states it shards, for the memory model: none|optim|grads|all
    # "flat": each unit's elements split evenly; "flat-views": so, and the optimizer sees the original tensors'
    # slices of it (FSDP1 use_orig_params: no padding, no state for a tensor without a slice on the rank);
    # "per-parameter": each tensor's dim 0
    shard_layout: str = "flat"
    extra_checks: tuple[str, ...] = ()  # names of layout checks in config.LAYOUT_CHECKS
    # Where it moves other bytes than the textbook formula (profiling/comm_theory.py): "root-kept"
    # (the root unit stays gathered from forward to backward), "grads-all-reduced" (ZeRO-1/2 buckets),
    # "live-params-kept" (ZeRO-3 keeps up to stage3_max_live_parameters gathered into backward),
    # "buffers-broadcast" (DDP broadcasts module buffers every forward), "reduces-per-micro-batch",
    # "fp32-grad-comm" (DeepSpeed reduces gradients in fp32 under bf16 parameters: communication_data_type),
    # "one-rank-collectives" (at world size 1 it still hands its tensors to collectives, on a group of one),
    # "no-shard-at-one-rank" (at world size 1 it switches to NO_SHARD: FSDP1), "no-gather-at-one-rank" (at world
    # size 1 it gathers no parameters but still reduces gradients: DeepSpeed ZeRO), "vocab-split-head" (under tensor
    # parallelism an untied output layer is split by vocabulary: its logits all-gathered, its input's gradient
    # all-reduced: DeepSpeed AutoTP in training).
    comm_quirks: tuple[str, ...] = ()
    # Its apply runs on a fake process group with fake tensors, so ``estimate --traced`` can run
    # one rank at any world size (engines/traced_estimate.py). DDP (C++ reducer), FSDP1 (flat
    # parameter hooks) and DTensor TP (device-mesh slicing) do not, in torch 2.13.
    traceable: bool = False

    # Settings of this strategy ``shardscope why`` re-runs changed towards the baseline (besides LOOP_SUSPECTS and
    # the run's precision, activation checkpointing and compile).
    suspects: tuple[Suspect, ...] = ()
    # How why's module probe reads full gradients (engines/module_probe.py): "tensors" (each .grad is whole, or a
    # DTensor made whole, right after backward), "summon" (FSDP1's summon_full_params(with_grads=True)),
    # "deepspeed" (gathered right after DeepSpeed's reduction, inside its step), "" (not probed: flat shards)
    probe_grads: str = ""

    # Hybrid sharding (HSDP): states sharded within groups of the data-parallel ranks, replicated across the
    # groups, each gradient shard all-reduced across the replicas after its reduce-scatter (None: never).
    hybrid: HybridSharding | None = None

    def option(self, key: str) -> OptionSpec | None:
        """The spec of option ``key``: one of this strategy's, or a loop option every strategy takes; None if unknown."""
        return self.options.get(key) or LOOP_OPTIONS.get(key)

    def option_names(self) -> list[str]:
        """Every option a run of this strategy may set: its own, then the loop's."""
        return [*self.options, *LOOP_OPTIONS]

    def tp_degree(self, options: dict[str, Any]) -> int:
        """Return the tensor-parallel degree these options ask for (1 without tensor parallelism)."""
        if self.tp_option is None:
            return 1
        return int(options.get(self.tp_option, self.options[self.tp_option].default))

    def pp_degree(self, options: dict[str, Any]) -> int:
        """Return the pipeline degree (ranks each pipeline spans) these options ask for (1 without pipelining)."""
        if self.pp_option is None:
            return 1
        return int(options.get(self.pp_option, self.options[self.pp_option].default))

    def model_parallel(self, options: dict[str, Any]) -> int:
        """Ranks one model replica spans (tensor parallel x pipeline): the world size over this is dp."""
        return self.tp_degree(options) * self.pp_degree(options)


# Options of the shared training loop that any run may set (not filled in by default: a run that sets none
# records none); engines/worker.py hands them to the loop, never to the strategy.
LOOP_OPTIONS: dict[str, OptionSpec] = {
    "grad_accum": OptionSpec(int, 0, "micro-batches per optimizer step on each rank for this run (0: the comparison's "
                             "grad_accum); the global batch stays the same, so the micro-batch is global_batch / "
                             "(dp x grad_accum): memory and speed change, the mathematics does not (the mean loss)",
                             minimum=0),
    "grad_accum_loss": OptionSpec(str, "mean", "how micro-batch losses combine under gradient accumulation: mean "
                                  "(each scaled by 1/grad_accum: the gradient of the mean loss) or sum (unscaled: "
                                  "grad_accum times the gradient, as a loop that never divides)", choices=("mean", "sum")),
}
LOOP_SUSPECTS = (
    Suspect("gradient-accumulation semantics", "grad_accum_loss", "mean", "summed micro-batch losses make gradients "
            "grad_accum times larger: clipping and Adam's epsilon then act on other values"),
)

_BOOL_RESHARD = OptionSpec(bool, True, "free gathered parameters after forward (re-gather in backward)")

STRATEGIES: dict[str, StrategyInfo] = {}


def register(info: StrategyInfo) -> StrategyInfo:
    """Add a strategy to the registry and return it; raises ValueError on a duplicate name."""
    if info.name in STRATEGIES:
        raise ValueError(f"strategy {info.name!r} registered twice")
    STRATEGIES[info.name] = info
    return info


register(
    StrategyInfo(
        name="ddp",
        entry="shardscope.engines.ddp:apply",
        description="DistributedDataParallel: full replica per rank, gradients all-reduced in buckets",
        options={
            "bucket_cap_mb": OptionSpec(int, 25, "gradient bucket size in MiB", minimum=1),
            "static_graph": OptionSpec(bool, False, "tell DDP the graph does not change between steps"),
        },
        shards="none",
        comm_quirks=("buffers-broadcast", "one-rank-collectives"),
        probe_grads="tensors",
    )
)

register(
    StrategyInfo(
        name="fsdp2",
        entry="shardscope.engines.fsdp2:apply",
        description="FSDP2 (fully_shard): per-parameter DTensor sharding, one unit per transformer block",
        options={
            "reshard_after_forward": _BOOL_RESHARD,
            "param_dtype": OptionSpec(str, "auto", "dtype of gathered parameters", choices=("auto", "fp32", "bf16", "fp16")),
            "reduce_dtype": OptionSpec(str, "auto", "dtype of gradient reduce-scatter", choices=("auto", "fp32", "bf16", "fp16")),
            "replicate": OptionSpec(int, 1, "HSDP: replicas of the sharded model (torchtitan's "
                                    "data_parallel_replicate_degree); parameters sharded over dp / replicate ranks, "
                                    "gradients all-reduced across the replicas; must divide dp (1 = no HSDP)",
                                    minimum=1),
            "unit_blocks": OptionSpec(int, 1, "consecutive blocks per FSDP unit (fully_shard of a list of blocks): "
                                      "one all-gather and one reduce-scatter per group, fewer and larger calls, more "
                                      "parameters gathered at once (1 = one unit per block)", minimum=1),
        },
        shards="all",
        shard_layout="per-parameter",  # fully_shard chunks each tensor on dim 0
        comm_quirks=("root-kept",),
        hybrid=HybridSharding("HSDP", "replicate", "replicas"),
        traceable=True,
        suspects=(Suspect("parameter dtype", "param_dtype", "baseline:param", "FSDP2's MixedPrecisionPolicy "
                          "all-gathers parameters in param_dtype: forward and backward compute in it"),
                  Suspect("reduce dtype", "reduce_dtype", "baseline:reduce", "FSDP2 reduce-scatters gradients in "
                          "reduce_dtype: a bf16 reduction rounds every gradient sum")),
        probe_grads="tensors",
    )
)

register(
    StrategyInfo(
        name="fsdp1",
        entry="shardscope.engines.fsdp1:apply",
        description="FSDP1 (FullyShardedDataParallel): one flat-parameter unit per transformer block",
        options={
            "sharding_strategy": OptionSpec(
                str, "FULL_SHARD", "what is sharded: FULL_SHARD (all), SHARD_GRAD_OP (grads+optimizer), "
                "HYBRID_SHARD (full shard in a node, replicate across nodes), NO_SHARD (like DDP)",
                choices=("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"),
            ),
            "backward_prefetch": OptionSpec(str, "pre", "when to prefetch the next unit's all-gather in backward",
                                            choices=("pre", "post", "none")),
            "limit_all_gathers": OptionSpec(bool, True, "rate-limit all-gathers so at most two units are gathered"),
            "use_orig_params": OptionSpec(bool, True, "expose the original parameters (needed for per-layer norms)"),
            "hybrid_shard_size": OptionSpec(int, 0, "HYBRID_SHARD: ranks each parameter is sharded over "
                                            "(0 = the ranks of one node); must divide dp", minimum=0),
        },
        shards="all",
        shard_layout="flat-views",  # with use_orig_params (the default; profiling/memory_model.py LAYOUT_BY_OPTION)
        # kept-through-no-sync: under no_sync, units it does not reshard after forward (SHARD_GRAD_OP) stay gathered
        # until the step's last micro-batch (torch's _should_free_in_backward); FSDP2 and the hand-written FSDP
        # reshard after every backward, so they gather again in every micro-batch
        comm_quirks=("root-kept", "kept-through-no-sync", "one-rank-collectives", "no-shard-at-one-rank"),
        hybrid=HybridSharding("HYBRID_SHARD", "hybrid_shard_size", "shard", ("sharding_strategy", ("HYBRID_SHARD",))),
        probe_grads="summon",  # use_orig_params (the default); without it the probe says the gradients were not read
    )
)

register(
    StrategyInfo(
        name="fsdp-handwritten",
        entry="shardscope.engines.handwritten_fsdp:apply",
        description="A hand-written FSDP, written to be read: per-block flat shards, explicit all-gather and "
                    "reduce-scatter",
        options={
            "reshard_after_forward": _BOOL_RESHARD,
        },
        shards="all",
        comm_quirks=("root-kept", "reduces-per-micro-batch", "one-rank-collectives"),
    )
)


# DeepSpeed ZeRO: one name per stage, because each shards a different set of model states
# (which the memory model reads from ``shards``). All three share one module and config builder.
_DS_BUCKET = OptionSpec(int, 25, "reduce / all-gather bucket size in MiB", minimum=1)
_DS_CLIP = OptionSpec(float, -1.0, "DeepSpeed's own gradient clipping (its config's gradient_clipping), applied "
                      "inside its optimizer step in place of the comparison's grad_clip: -1 = the comparison's, 0 = none")
_DS_OPTIMIZER = OptionSpec(str, "zero", "zero: DeepSpeed's ZeRO optimizer steps flat fp32 partitions; torch: DeepSpeed "
                           "at ZeRO stage 0, the torch AdamW client stepping whole tensors (nothing sharded)",
                           choices=("zero", "torch"))
_DS_SUSPECTS = (
    Suspect("clipping", "gradient_clipping", -1.0, "DeepSpeed clips inside its own optimizer step, at its config's "
            "gradient_clipping, whatever the training loop asked"),
    Suspect("optimizer implementation", "optimizer", "torch", "the ZeRO optimizer steps flat fp32 partitions and "
            "clips them with DeepSpeed's own formula, not torch AdamW over whole tensors clipped with torch's"),
)
_DS_REUSE = OptionSpec(bool, False, "fp32 runs: true makes the fp32 parameter partitions the master weights, "
                       "stepped in place (DeepSpeed's intended path, which 0.19 misses); false (default) keeps "
                       "DeepSpeed's extra fp32 copy, as it ships", framework_fix=True)
for _stage, _shards, _what in ((1, "optim", "optimizer states (fp32 master + Adam moments) sharded"),
                               (2, "grads", "optimizer states and gradients sharded"),
                               (3, "all", "optimizer states, gradients and parameters sharded")):
    register(
        StrategyInfo(
            name=f"deepspeed-zero{_stage}",
            entry=f"shardscope.engines.deepspeed_zero:apply_stage{_stage}",
            description=f"DeepSpeed ZeRO-{_stage}: {_what}; torch AdamW as the client optimizer",
            options={"bucket_mb": _DS_BUCKET, "gradient_clipping": _DS_CLIP, "optimizer": _DS_OPTIMIZER,
                     **({"reuse_fp32_partitions": _DS_REUSE} if _stage == 3 else {})},
            needs_deepspeed=True,
            suspects=_DS_SUSPECTS,
            probe_grads="deepspeed",
            shards=_shards,
            comm_quirks=((("live-params-kept",) if _stage == 3 else ("grads-all-reduced",)) + ("fp32-grad-comm",)
                         + (("reduces-per-micro-batch",) if _stage >= 2 else ())
                         + ("one-rank-collectives", "no-gather-at-one-rank")),
        )
    )

register(
    StrategyInfo(
        name="deepspeed-autotp",
        entry="shardscope.engines.autotp:apply",
        description="DeepSpeed AutoTP on a Hugging Face model: linears split tp ways automatically, "
                    "ZeRO 0-2 over dp = world / tp",
        options={
            "tp": OptionSpec(int, 2, "tensor-parallel degree (DeepSpeed autotp_size)", minimum=2),
            "stage": OptionSpec(int, 1, "ZeRO stage over the data-parallel group: 0, 1 or 2", minimum=0),
            "bucket_mb": _DS_BUCKET,
        },
        needs_deepspeed=True,
        min_world_size=2,
        tp_option="tp",
        models=("hf",),
        model_needs=("autotp",),
        shards="optim",  # at the default stage 1
        extra_checks=("heads_divisible_by_tp", "autotp_zero_stage"),
        comm_quirks=("grads-all-reduced", "fp32-grad-comm", "vocab-split-head"),
    )
)

register(
    StrategyInfo(
        name="fsdp2-tp",
        entry="shardscope.engines.fsdp2_tp:apply",
        description="FSDP2 over dp x DTensor tensor parallel over tp on a 2-D mesh: q/k/v and MLP up "
                    "column-wise, output and down projections row-wise",
        options={
            "tp": OptionSpec(int, 2, "tensor-parallel degree (the mesh's tp dimension)", minimum=2),
            "reshard_after_forward": _BOOL_RESHARD,
        },
        min_world_size=2,
        tp_option="tp",
        model_needs=("tp_plan",),
        shards="all",
        shard_layout="per-parameter",  # fully_shard over dp after TP: each local tensor chunked on dim 0
        comm_quirks=("root-kept",),  # engines/fsdp2.py shard_model: the root keeps torch's default
        probe_grads="tensors",
        extra_checks=("heads_divisible_by_tp", "vit_heads_divisible_by_tp"),
    )
)

# Pipeline parallelism on torch.distributed.pipelining (engines/pipeline.py): one name per schedule, because
# each holds activations and idles differently (the bubble), which the memory model and the report read.
_PP_OPTIONS = {
    "pp": OptionSpec(int, 2, "pipeline degree: ranks one pipeline spans; data-parallel replicas = world / pp "
                     "(gradients averaged across them after each step's schedule)", minimum=2),
    "microbatches": OptionSpec(int, 4, "micro-batches each data-parallel rank's batch is split into per step "
                               "(the pipeline's m)", minimum=1),
    "dp_shard": OptionSpec(str, "replicate", "across the pipelines: replicate each stage (gradients averaged by one "
                           "all-reduce after the schedule) or fsdp2 (fully_shard each stage over the data-parallel "
                           "ranks: states sharded, gradients reduce-scattered)", choices=("replicate", "fsdp2")),
}
for _name, _schedule, _v, _what in (
        ("pp-gpipe", "gpipe", 1, "GPipe: every micro-batch forward, then every one backward (holds all m "
                                 "micro-batches' activations)"),
        ("pp-1f1b", "1f1b", 1, "1F1B: one forward, one backward in turn after a warm-up (holds at most p "
                               "micro-batches' activations)"),
        ("pp-interleaved", "interleaved-1f1b", 2, "interleaved 1F1B: v stages per rank, looped, a bubble v "
                                                  "times smaller"),
        ("pp-zero-bubble", "zero-bubble", 2, "interleaved zero bubble: backward split into input- and "
                                             "weight-gradient passes, the weight passes fill the bubble")):
    register(
        StrategyInfo(
            name=_name,
            entry="shardscope.engines.pipeline:apply_" + _name[3:].replace("-", "_"),
            description=f"Pipeline parallel, {_what}; torch.distributed.pipelining",
            options={**_PP_OPTIONS,
                     "stages_per_rank": OptionSpec(int, _v, "model stages each rank holds (v); 1 for GPipe and 1F1B",
                                                   minimum=_v, choices=None if _v > 1 else (1,))},
            min_world_size=2,
            pp_option="pp",
            schedule=_schedule,
            # Hugging Face: the Llama-layout families; a module: one with pre_blocks and post_blocks
            # (presets/pipeline_checks.py)
            models=("transformer", "hf", "module"),
            shards="none",
            extra_checks=("pipeline_split",),
            comm_quirks=("pipeline-p2p",),
        )
    )


def get(name: str) -> StrategyInfo:
    """Return the strategy named ``name``; raises KeyError naming the allowed strategies."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r}; allowed: {', '.join(sorted(STRATEGIES))}") from None


def option_defaults(name: str) -> dict[str, Any]:
    """The default of each option of the strategy named ``name``; raises KeyError as ``get`` does."""
    return {k: spec.default for k, spec in get(name).options.items()}


def names() -> list[str]:
    """Return all registered strategy names, sorted."""
    return sorted(STRATEGIES)
