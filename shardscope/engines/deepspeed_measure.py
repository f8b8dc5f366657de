"""What shardscope measures inside a DeepSpeed engine: per-layer norms right after the gradient
reduction, and this rank's model-state bytes counted from the engine's real tensors.

Shared by ZeRO (``deepspeed_zero``) and AutoTP (through ``deepspeed_zero.prepare_engine``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from shardscope.engines import norms
from shardscope.engines.comm_count import instrumentation


def tp_shard(p: torch.Tensor) -> bool:
    """Whether AutoTP split this parameter over the tensor-parallel group (DeepSpeed marks it
    ``tensor_model_parallel`` or ``model_parallel``); False for a tensor every tp rank holds whole."""
    return bool(getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False))


def layer_norms_at_reduction(engine: Any, tp_size: int) -> Callable[[], dict[str, dict[str, float]]]:
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

    def capture() -> None:
        with instrumentation():  # shardscope's own collectives, not the strategy's
            found = deepspeed_layer_norms(engine.module, tp_size)
        found["grad"] = {k: v * grad_unscale(engine) for k, v in found["grad"].items()}
        captured.update(found)

    arm = after_reduction(engine, capture)

    def layer_norms() -> dict[str, dict[str, float]]:
        captured.clear()
        arm()
        return captured

    return layer_norms


def grad_unscale(engine: Any) -> float:
    """The factor that turns the engine's reduced gradients into true ones: 1, or 1/loss scale under fp16 (ZeRO's
    fp16 gradients are still loss-scaled right after the reduction; it unscales them when it clips)."""
    if not engine.fp16_enabled():
        return 1.0
    return 1.0 / float(getattr(engine.optimizer, "loss_scale", 1.0))


def after_reduction(engine: Any, callback: Callable[[], None]) -> Callable[[], None]:
    """Wrap this engine's gradient reductions (stages 0/1: ``engine.allreduce_gradients``; stages 2/3:
    ``optimizer.finalize_gradient_accumulation_boundary``) so that ``callback()`` runs right after the next one,
    inside ``engine.step()`` and before clipping; return ``arm()``, which asks for that next call."""
    armed = [False]

    def after(reduce: Callable[..., Any]) -> Callable[..., Any]:
        def reduce_then_capture(*args: Any, **kwargs: Any) -> Any:
            out = reduce(*args, **kwargs)
            if armed[0]:
                armed[0] = False
                callback()
            return out
        return reduce_then_capture

    engine.allreduce_gradients = after(engine.allreduce_gradients)
    finalize = getattr(engine.optimizer, "finalize_gradient_accumulation_boundary", None)
    if finalize is not None:
        engine.optimizer.finalize_gradient_accumulation_boundary = after(finalize)
    return lambda: armed.__setitem__(0, True)


def deepspeed_layer_norms(module: nn.Module, tp_size: int = 1) -> dict[str, dict[str, float]]:
    """Return per-layer ``{"grad": ..., "param": ...}`` norms of a DeepSpeed engine's module, of the
    full tensors: from each rank's own ZeRO pieces (``_local_pieces``, one all-reduce per kind; under AutoTP
    over the whole world, ``_over_the_world``) where every parameter has them, else from DeepSpeed's
    ``safe_get_full_grad`` / ``safe_get_full_fp32_param``, which gather tensor by tensor (collectives either
    way: every rank calls this in the same order, after the reduction and before clipping). Parameters are
    the fp32 masters, as FSDP's sharded parameters are.

    Under AutoTP (``tp_size`` > 1) a tensor-parallel shard's square sum is added over the TP group;
    a replicated tensor is scaled by 1/sqrt(tp_size) first so that adding its tp identical copies
    counts it once.
    """
    from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_grad

    local = _local_pieces(module)
    if local is not None and tp_size > 1:
        local = _over_the_world(module, local, tp_size)
    if local is not None:  # every rank's own piece: two all-reduces a step, not a gather per tensor
        grads_, params_, group = local
        return {"grad": norms.layer_norms(grads_, shard_group=group, sharded=True),
                "param": norms.layer_norms(params_, shard_group=group, sharded=True)}
    grads: list[tuple[str, torch.Tensor | None]] = []
    params: list[tuple[str, torch.Tensor]] = []
    for name, p in module.named_parameters():
        g, w = safe_get_full_grad(p), safe_get_full_fp32_param(p)
        w = p if w is None else w  # no ZeRO wrapper (AutoTP stage 0 in fp32): the parameter is the master
        g = torch.zeros(0, device=w.device) if g is None else g  # keep the key on every rank
        if tp_size > 1 and not tp_shard(p):
            g, w = g / tp_size**0.5, w / tp_size**0.5
        grads.append((name, g))
        params.append((name, w))
    group = groups.get_tensor_model_parallel_group() if tp_size > 1 else None
    return {"grad": norms.layer_norms(grads, shard_group=group, sharded=tp_size > 1),
            "param": norms.layer_norms(params, shard_group=group, sharded=tp_size > 1)}


Pieces = tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]], Any]


def _over_the_world(module: nn.Module, local: Pieces, tp_size: int) -> Pieces | None:
    """AutoTP's pieces made disjoint over the whole world: each rank's data-parallel fragment of its own
    tensor-parallel shard, a replicated tensor's fragments scaled by 1/sqrt(tp_size) (its tp copies then add up
    to it once), summed over the default group; None (the per-tensor path) where data x tensor parallel is not
    the world."""
    import torch.distributed as dist

    grads, params, dp_group = local
    if dist.get_world_size(dp_group) * tp_size != dist.get_world_size():
        return None
    split = {name for name, p in module.named_parameters() if tp_shard(p)}
    scale = tp_size ** -0.5

    def scaled(pieces: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        return [(name, t if name in split else t * scale) for name, t in pieces]

    return scaled(grads), scaled(params), None


def _local_pieces(module: nn.Module) -> Pieces | None:
    """Each parameter's reduced fp32 gradient and fp32 master as this rank's own disjoint piece of them, with the
    data-parallel group whose pieces add up to the whole; None where a parameter is held otherwise (a full
    ``.grad``, no ZeRO wrapper) or the groups differ, for the per-tensor gathers of ``deepspeed_layer_norms``.

    The pieces are those DeepSpeed's own ``safe_get_full_grad`` / ``safe_get_full_fp32_param`` gather: ZeRO-3's
    partitions (``safe_get_local_grad`` / ``safe_get_local_fp32_param``), and ZeRO-1/2's and the bf16
    optimizer's fragments (``param._hp_mapping``; DeepSpeed's local API covers ZeRO-3 only, so the fragment is
    read as its ``get_full_hp_grad`` reads it, without the all-reduce). A gather per tensor cost ZeRO runs 104
    collectives in two steps of a two-layer model; the sums of squares of disjoint pieces need one all-reduce.
    """
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_grad

    grads: list[tuple[str, torch.Tensor]] = []
    params: list[tuple[str, torch.Tensor]] = []
    group = None
    for name, p in module.named_parameters():
        if hasattr(p, "ds_id"):  # ZeRO-3
            owner = p.ds_process_group
            g, w = (safe_get_local_grad(p), safe_get_local_fp32_param(p)) if p.requires_grad else (None, None)
        elif hasattr(p, "_hp_mapping") and hasattr(p, "_dp_group") and (
                getattr(p, "_hp_grad", None) is not None or p.grad is None):
            owner = p._dp_group
            g, w = _hp_pieces(p)
        else:
            return None
        if group is None:
            group = owner
        elif owner is not group:
            return None
        empty = torch.zeros(0, device=p.device)  # keeps the key on every rank: the vectors match in length
        grads.append((name, empty if g is None else g))
        params.append((name, empty if w is None else w))
    return (grads, params, group) if group is not None else None


def _hp_pieces(p: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """This rank's fragment of a ZeRO-1/2 (or bf16 optimizer) parameter's reduced gradient and fp32 master, as
    DeepSpeed's ``get_full_hp_grad`` / ``get_full_hp_param`` (``utils/tensor_fragment.py``) place it in the
    buffer they all-reduce; (None, None) where this rank holds no fragment of it."""
    mapping = p._hp_mapping
    if mapping is None:
        return None, None
    address = mapping.lp_fragment_address
    grad = mapping.get_lp_grad_fragment(p._index_in_param_group).float().flatten()
    if grad.numel() == p.numel():  # the bf16 optimizer keeps a whole accumulation buffer: only the owned fragment
        grad = grad.narrow(0, address.start, address.numel)
    return grad, mapping.get_hp_fragment().float()


# Attributes of DeepSpeed's ZeRO optimizers that hold gradient partitions or reduction buffers
# (stage_1_and_2.py and stage3.py); read by name because DeepSpeed exposes no accounting API.
_GRAD_ATTRS = ("averaged_gradients", "all_grad_tensors", "grads_in_partition", "grad_partitions_flat_buffer",
               "ipg_buffer")

# ...and the fp32 master partitions (ZeRO-1/2, ZeRO-3, the stage-0 bf16 optimizer). ZeRO-3 swaps
# them into the inner optimizer's param groups only while it steps, so they are read here.
_MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition")


class StateCounter:
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
