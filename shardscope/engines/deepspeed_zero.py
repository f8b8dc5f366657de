"""DeepSpeed ZeRO stages 1, 2 and 3 behind the shared loop.

What each stage shards across the data-parallel ranks (Ψ parameters, N ranks):

- **ZeRO-1** shards the *optimizer states*: the fp32 master copy and both Adam moments live
  as one 1/N partition per rank. Parameters and gradients stay whole on every rank.
- **ZeRO-2** shards the optimizer states *and the gradients*: gradients are reduce-scattered
  into this rank's partition during backward; the full gradient never persists.
- **ZeRO-3** shards optimizer states, gradients *and the parameters*: each parameter is a 1/N
  partition, all-gathered for forward and backward of its module and freed afterwards.

The DeepSpeed config is generated from shardscope's settings (micro-batch, gradient
accumulation, clipping, precision, AdamW's betas/eps/weight decay), never hand-written, so a
ZeRO run trains exactly what the DDP baseline trains. The optimizer is the shared
``torch.optim.AdamW`` recipe (DeepSpeed calls it a "client optimizer"): DeepSpeed's FusedAdam and
CPU-Adam need a compiled extension, and the torch optimizer is what every other strategy uses.

On CPU, DeepSpeed runs on its CPU accelerator (``DS_ACCELERATOR=cpu``) over the gloo process
group the worker already created. On GPU it uses NCCL.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch
from torch import nn

from shardscope.engines import norms
from shardscope.engines.comm_count import instrumentation
from shardscope.engines.api import Prepared, RankContext, TrainSettings
from shardscope.engines.optim import make_optimizer
from shardscope.engines.parallelize import checkpoint_blocks


def import_deepspeed(device: torch.device) -> Any:
    """Import and return ``deepspeed`` with the accelerator matching ``device``.

    DeepSpeed picks its accelerator once, at import; on a machine with a GPU but a CPU run
    (or the reverse) its auto-detection would pick the wrong one, so it is set explicitly.
    Raises ImportError (with the pip command) when DeepSpeed is not installed.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
    try:
        import deepspeed
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(f"this strategy needs DeepSpeed (pip install deepspeed): {err}") from err
    return deepspeed


def precision_config(settings: TrainSettings) -> dict[str, Any]:
    """Return the DeepSpeed config keys that implement ``settings.precision``.

    - ``fp32``: nothing (fp32 params, grads, master weights and reduction).
    - ``bf16-params``: DeepSpeed's ``bf16`` mode: bf16 parameters and gradients, fp32 master
      weights in the optimizer, gradients reduced in fp32 (``bf16.bf16_master_weights_and_grads``
      off, ``communication_data_type`` fp32) as the policy's reduce dtype asks.
    - ``bf16-autocast``: fp32 parameters, forward under ``torch.autocast(bfloat16)``
      (DeepSpeed's ``torch_autocast`` section).
    - ``fp16``: fp16 parameters with dynamic loss scaling (``loss_scale = 0``) and fp32 master
      weights.
    Raises ValueError for an unknown policy name.
    """
    name = settings.precision.name
    if name == "fp32":
        return {}
    if name == "bf16-params":
        return {"bf16": {"enabled": True}, "communication_data_type": "fp32"}
    if name == "bf16-autocast":
        return {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    if name == "fp16":
        return {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                         "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}}
    raise ValueError(f"precision {name!r}: DeepSpeed strategies support fp32, bf16-params, bf16-autocast, fp16")


def build_config(
    settings: TrainSettings,
    ctx: RankContext,
    *,
    stage: int,
    bucket_mb: int = 25,
    tensor_parallel: int = 1,
) -> dict[str, Any]:
    """Return the DeepSpeed config dict for these settings and ZeRO ``stage`` (0-3).

    DeepSpeed derives ``train_batch_size`` (micro-batch x grad_accum x its data-parallel size, the
    comparison's global batch); stating it would fail under AutoTP, whose config check counts
    every rank as data-parallel before the TP groups exist. Gradient accumulation is left to the caller
    (``managed_gradient_accumulation = false``): the shared loop decides when a step ends.
    ``bucket_mb`` sizes the reduce and all-gather buckets (DeepSpeed's defaults, 5e8 elements,
    would allocate gigabytes of buffers for a tiny model). ``tensor_parallel`` > 1 turns on
    AutoTP with that degree.
    """
    elements = max(1, bucket_mb * 2**20 // 4)
    zero: dict[str, Any] = {
        "stage": stage,
        "reduce_bucket_size": elements,
        "allgather_bucket_size": elements,
        "contiguous_gradients": True,
        # Unmanaged accumulation only allows overlapped communication in stage 2; overlap
        # changes nothing numerically, so keep it off everywhere for comparable runs.
        "overlap_comm": False,
    }
    if stage == 3:
        zero.update({
            "stage3_prefetch_bucket_size": elements,
            "stage3_param_persistence_threshold": 0,  # shard every parameter, even small ones
            "stage3_max_live_parameters": elements,
        })
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": settings.micro_batch_size,
        "gradient_accumulation_steps": settings.grad_accum,
        "managed_gradient_accumulation": False,
        "gradient_clipping": float(settings.grad_clip),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,  # the loop reports; keep DeepSpeed's own log quiet
        "wall_clock_breakdown": False,
    }
    config.update(precision_config(settings))
    if tensor_parallel > 1:
        # Full-vocabulary logits: the shared loop computes the loss from them. (DeepSpeed would
        # otherwise split a tied LM head by vocabulary and expect its own distributed loss.)
        config["tensor_parallel"] = {"autotp_size": tensor_parallel, "vocab_parallel_lm_head": False}
    return config


def apply(model: nn.Module, ctx: RankContext, settings: TrainSettings, options: dict[str, Any]) -> Prepared:
    """Wrap ``model`` in a DeepSpeed engine at ZeRO ``options["stage"]`` and return what the loop drives.

    Options: ``stage`` (1, 2 or 3), ``bucket_mb`` (reduce/all-gather bucket size).
    Raises ValueError for an unsupported stage or precision.
    """
    stage = int(options.get("stage", 1))
    if stage not in (1, 2, 3):
        raise ValueError(f"options.stage = {stage!r}: allowed: 1, 2, 3")
    config = build_config(settings, ctx, stage=stage, bucket_mb=int(options.get("bucket_mb", 25)))
    notes: dict[str, Any] = {"zero_stage": stage}
    if stage == 3 and settings.precision.name in ("fp32", "bf16-autocast"):
        reuse = bool(options.get("reuse_fp32_partitions", False))
        reuse_fp32_partitions_in_zero3(reuse)
        notes["fp32_master"] = ("the fp32 parameter partitions, stepped in place" if reuse
                                else "a separate fp32 copy of the parameter partitions (DeepSpeed 0.19 default)")
    return prepare_engine(model, ctx, settings, config, notes=notes)


def reuse_fp32_partitions_in_zero3(enabled: bool) -> None:
    """Make ZeRO-3 use fp32 parameter partitions as its fp32 master partitions (``enabled``), or not.

    DeepSpeed means to: ``DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions`` skips the copy
    when a partition already has the master dtype and device ("we don't need another copy of the
    weights"). But it compares ``tensor.device == self.device`` where ``self.device`` is the
    accelerator's device *name* (a str), and a ``torch.device`` never equals a str, so fp32 runs keep
    a second fp32 copy (0.625x DDP's model state at 2 ranks instead of 0.5x). Here the method runs
    with ``self.device`` as a ``torch.device``, so the comparison means what it says. Only that
    method is affected; it is restored to DeepSpeed's own when ``enabled`` is False.
    """
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    original = getattr(Stage3._create_fp32_partitions, "__wrapped__", Stage3._create_fp32_partitions)
    if not enabled:
        Stage3._create_fp32_partitions = original
        return

    @functools.wraps(original)
    def create_fp32_partitions(self: Any) -> Any:
        name = self.device
        self.device = torch.device(name) if isinstance(name, str) else name
        try:
            return original(self)
        finally:
            self.device = name

    Stage3._create_fp32_partitions = create_fp32_partitions


def apply_stage1(model: nn.Module, ctx: RankContext, settings: TrainSettings, options: dict[str, Any]) -> Prepared:
    """ZeRO-1: optimizer states (fp32 master + moments) sharded; see ``apply``."""
    return apply(model, ctx, settings, {**options, "stage": 1})


def apply_stage2(model: nn.Module, ctx: RankContext, settings: TrainSettings, options: dict[str, Any]) -> Prepared:
    """ZeRO-2: optimizer states and gradients sharded; see ``apply``."""
    return apply(model, ctx, settings, {**options, "stage": 2})


def apply_stage3(model: nn.Module, ctx: RankContext, settings: TrainSettings, options: dict[str, Any]) -> Prepared:
    """ZeRO-3: optimizer states, gradients and parameters sharded; see ``apply``."""
    return apply(model, ctx, settings, {**options, "stage": 3})


def prepare_engine(
    model: nn.Module,
    ctx: RankContext,
    settings: TrainSettings,
    config: dict[str, Any],
    *,
    notes: dict[str, Any] | None = None,
    grad_norm: Callable[[nn.Module], torch.Tensor] | None = None,
) -> Prepared:
    """Build a DeepSpeed engine from ``config`` and return the loop's view of it.

    Shared by ZeRO and AutoTP. ``backward`` is ``engine.backward`` (without DeepSpeed's own
    1/grad_accum scaling: the loop already scaled the loss); ``clip_and_step`` is
    ``engine.step()`` and returns the global gradient norm DeepSpeed computed before clipping.

    ``grad_norm(module)``, for engines whose optimizer is the bare torch one (ZeRO stage 0 in
    fp32), where DeepSpeed clips but keeps no norm: clipping then moves into a pre-step hook of
    the optimizer, which runs after DeepSpeed's gradient all-reduce, computes the norm with
    ``grad_norm`` and clips with torch's formula. DeepSpeed's own clipping is turned off.
    """
    if grad_norm is not None:
        clip = float(config["gradient_clipping"])
        config = {**config, "gradient_clipping": 0.0}
    deepspeed = import_deepspeed(ctx.device)
    # The worker created the process group; DeepSpeed adopts it instead of making its own.
    deepspeed.init_distributed(dist_backend=ctx.backend, auto_mpi_discovery=False)
    if settings.activation_checkpointing:
        # torch's non-reentrant checkpoint per block, as for every other strategy (DeepSpeed's own
        # checkpointing API needs model code changes); ZeRO-3's hooks re-gather on recompute.
        checkpoint_blocks(model)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        # The shared AdamW recipe (optim.make_optimizer) as a DeepSpeed "client optimizer".
        optimizer=lambda params: make_optimizer(params, settings),
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config,
    )
    if settings.compile:
        # DeepSpeed's supported path: the engine compiles the whole module (its ZeRO hooks are
        # excluded from tracing), rather than parallelize.compile_blocks per block.
        engine.compile()
    states = _StateCounter(engine)

    def backward(loss: torch.Tensor) -> None:
        engine.backward(loss, scale_wrt_gas=False)

    def clip_and_step(max_norm: float) -> float | None:
        configured = clip if grad_norm is not None else float(config["gradient_clipping"])
        if abs(max_norm - configured) > 1e-12:
            raise ValueError(f"clip_and_step({max_norm}) but DeepSpeed was configured with "
                             f"gradient_clipping = {configured}")
        states.snapshot_grads()  # gradients exist only between backward and step
        if grad_norm is None:
            engine.step()
            norm = engine.get_global_grad_norm()
            # None: ZeRO-1/2 with gradient-norm computation off. Not measured, not NaN (NaN = diverged).
            return None if norm is None else float(norm.item() if torch.is_tensor(norm) else norm)
        seen: list[float] = []

        def clip_before_step(*_: Any) -> None:
            seen.append(float(grad_norm(engine.module)))
            coef = min(1.0, max_norm / (seen[0] + 1e-6)) if max_norm > 0 else 1.0
            if coef < 1.0:
                for p in engine.module.parameters():
                    if p.grad is not None:
                        p.grad.mul_(coef)

        hook = engine.optimizer.register_step_pre_hook(clip_before_step)
        try:
            engine.step()
        finally:
            hook.remove()
        return seen[0]

    def set_lr(lr: float) -> None:
        for group in engine.optimizer.param_groups:
            group["lr"] = lr

    tp_size = int(config.get("tensor_parallel", {}).get("autotp_size", 1))
    facts = {"deepspeed_config": {k: v for k, v in config.items() if k != "steps_per_print"}}
    facts.update(notes or {})
    return Prepared(
        model=engine,
        optimizer=engine.optimizer,
        clip_and_step=clip_and_step,
        model_state_bytes=states.bytes,
        backward=backward,
        zero_grad=lambda: engine.zero_grad(),
        set_lr=set_lr,
        # no_sync stays a no-op: with unmanaged accumulation stages 0/1 reduce only in step(),
        # and stages 2/3 must reduce-scatter every micro-batch into their gradient partitions.
        handles_precision=True,
        step_applied=engine.was_step_applied,  # False after DeepSpeed's fp16 scaler skipped an overflow
        layer_norms=_layer_norms_at_reduction(engine, tp_size),
        notes=facts,
    )


def _layer_norms_at_reduction(engine: Any, tp_size: int) -> Callable[[], dict[str, dict[str, float]]]:
    """Return a ``Prepared.layer_norms`` for a DeepSpeed engine.

    In unmanaged accumulation DeepSpeed reduces gradients inside ``engine.step()`` (stages 0/1:
    ``engine.allreduce_gradients``; stages 2/3: ``optimizer.finalize_gradient_accumulation_boundary``)
    and clips right after, with no hook in between. Before step, ZeRO-1 holds each rank's own
    unreduced gradients and ZeRO-2 has not built its partitions yet, so the norms must be read
    inside step: those two methods are wrapped on this engine instance to compute the norms right
    after the reduction (before clipping, as for every other strategy). ``layer_norms()`` (called
    by the loop between backward and step) arms the capture and returns the dict that step fills.
    """
    captured: dict[str, dict[str, float]] = {}
    armed = [False]
    fp16 = bool(engine.fp16_enabled())

    def after(reduce: Callable[..., Any]) -> Callable[..., Any]:
        def reduce_then_capture(*args: Any, **kwargs: Any) -> Any:
            out = reduce(*args, **kwargs)
            if armed[0]:
                armed[0] = False
                with instrumentation():  # shardscope's own collectives, not the strategy's
                    found = deepspeed_layer_norms(engine.module, tp_size)
                if fp16:  # ZeRO's fp16 gradients are still loss-scaled here (unscaled with clipping)
                    inv = 1.0 / float(getattr(engine.optimizer, "loss_scale", 1.0))
                    found["grad"] = {k: v * inv for k, v in found["grad"].items()}
                captured.update(found)
            return out
        return reduce_then_capture

    engine.allreduce_gradients = after(engine.allreduce_gradients)
    finalize = getattr(engine.optimizer, "finalize_gradient_accumulation_boundary", None)
    if finalize is not None:
        engine.optimizer.finalize_gradient_accumulation_boundary = after(finalize)

    def layer_norms() -> dict[str, dict[str, float]]:
        captured.clear()
        armed[0] = True
        return captured

    return layer_norms


def deepspeed_layer_norms(module: nn.Module, tp_size: int = 1) -> dict[str, dict[str, float]]:
    """Return per-layer ``{"grad": ..., "param": ...}`` norms of a DeepSpeed engine's module, on
    full tensors: DeepSpeed's ``safe_get_full_grad`` / ``safe_get_full_fp32_param`` gather ZeRO
    partitions (collectives: every rank calls this in the same order, after backward and before
    step). Parameters are the fp32 masters, as FSDP's sharded parameters are.

    Under AutoTP (``tp_size`` > 1) a tensor-parallel shard's square sum is added over the TP group;
    a replicated tensor is scaled by 1/sqrt(tp_size) first so that adding its tp identical copies
    counts it once.
    """
    from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_grad

    grads: list[tuple[str, torch.Tensor | None]] = []
    params: list[tuple[str, torch.Tensor]] = []
    for name, p in module.named_parameters():
        g, w = safe_get_full_grad(p), safe_get_full_fp32_param(p)
        w = p if w is None else w  # no ZeRO wrapper (AutoTP stage 0 in fp32): the parameter is the master
        g = torch.zeros(0, device=w.device) if g is None else g  # keep the key on every rank
        if tp_size > 1 and not (getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False)):
            g, w = g / tp_size**0.5, w / tp_size**0.5
        grads.append((name, g))
        params.append((name, w))
    group = groups.get_tensor_model_parallel_group() if tp_size > 1 else None
    return {"grad": norms.layer_norms(grads, shard_group=group, sharded=tp_size > 1),
            "param": norms.layer_norms(params, shard_group=group, sharded=tp_size > 1)}


# Attributes of DeepSpeed's ZeRO optimizers that hold gradient partitions or reduction buffers
# (stage_1_and_2.py and stage3.py); read by name because DeepSpeed exposes no accounting API.
_GRAD_ATTRS = ("averaged_gradients", "all_grad_tensors", "grads_in_partition", "grad_partitions_flat_buffer",
               "ipg_buffer")

# ...and the fp32 master partitions (ZeRO-1/2, ZeRO-3, the stage-0 bf16 optimizer). ZeRO-3 swaps
# them into the inner optimizer's param groups only while it steps, so they are read here.
_MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition")


class _StateCounter:
    """Counts this rank's model-state bytes from the engine's real tensors.

    - ``param_bytes``: the module's parameters as stored on this rank (the ZeRO-3 partition
      ``ds_tensor`` rather than the freed full tensor; ZeRO-1/2's flat buffers once).
    - ``optim_bytes``: the inner AdamW's state (both moments, step) plus the fp32 master
      partitions it updates, when they are separate tensors from the parameters.
    - ``grad_bytes``: measured just before each ``step()``, the only moment gradients are
      complete: ``.grad`` of parameters and masters plus the ZeRO gradient partitions and buffers.

    Tensors are counted by their underlying storage, once each, so views into DeepSpeed's flat
    buffers are not counted twice.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.grad_bytes = 0

    def _param_storages(self) -> dict[int, int]:
        seen: dict[int, int] = {}
        for p in self.engine.module.parameters():
            _add(seen, getattr(p, "ds_tensor", None))
            _add(seen, p.data)
        return seen

    def snapshot_grads(self) -> None:
        """Record the bytes of every gradient tensor alive now (called before ``step``)."""
        params = self._param_storages()
        seen: dict[int, int] = {}
        for p in self.engine.module.parameters():
            _add(seen, p.grad, skip=params)
        opt = self.engine.optimizer
        for p in _inner_params(opt):
            _add(seen, p.grad, skip=params)
        for name in _GRAD_ATTRS:
            for t in _tensors(getattr(opt, name, None)):
                _add(seen, t, skip=params)
        self.grad_bytes = sum(seen.values())

    def bytes(self) -> dict[str, int]:
        """Return ``param_bytes``, ``grad_bytes`` (from the last step) and ``optim_bytes``."""
        params = self._param_storages()
        optim: dict[int, int] = {}
        opt = self.engine.optimizer
        for p in _inner_params(opt) + [t for name in _MASTER_ATTRS for t in _tensors(getattr(opt, name, None))]:
            _add(optim, p.data, skip=params)
        inner = getattr(opt, "optimizer", opt)
        for state in inner.state.values():
            for t in _tensors(state):
                _add(optim, t, skip=params)
        return {"param_bytes": sum(params.values()), "grad_bytes": self.grad_bytes,
                "optim_bytes": sum(optim.values())}


def _inner_params(opt: Any) -> list[torch.Tensor]:
    inner = getattr(opt, "optimizer", opt)
    return [p for group in inner.param_groups for p in group["params"]]


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Return every tensor inside ``obj`` (a tensor, or lists/tuples/dicts of them)."""
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return []


def _add(seen: dict[int, int], t: torch.Tensor | None, skip: dict[int, int] | None = None) -> None:
    if t is None or not torch.is_tensor(t) or t.numel() == 0:
        return
    storage = t.untyped_storage()
    key = storage.data_ptr()
    if key == 0 or (skip is not None and key in skip):
        return
    seen[key] = storage.nbytes()
