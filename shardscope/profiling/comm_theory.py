"""Communication theory: the bytes of each collective type a run moves per optimizer step.

Pure Python (no torch). From the run's ``spec.json`` payload, the model's parameter shapes
(``memory_model``) and the strategy's ``registry.CommRecipe``: which collective reduces the
gradients, when parameters are gathered, how flat buffers are padded, in which dtype each moves.
Sizes as nccl-tests counts them, like the trace analysis: all-reduce and broadcast the buffer,
all-gather the gathered output, reduce-scatter the full input.

Where a strategy moves more or less than the textbook formula (FSDP1 and the hand-written FSDP
keep the root unit gathered into backward; ZeRO-3 keeps parameters it reuses soon; DDP broadcasts
buffers every forward; tensor parallel's backward all-reduces one input gradient per
column-parallel projection), the recipe says so and ``notes`` carries the one-line reason the
report shows. Scalars the loop itself reduces (the loss, 4 bytes) are included; gradient-norm
scalars of clipping are not (a few bytes: far inside the 2% the tests allow).
"""

from __future__ import annotations

import math
from typing import Any

from shardscope.config import Comparison, RunSpec
from shardscope.engines import registry
from shardscope.hf_archs import ARCHS
from shardscope.profiling.memory_model import TP_SPLIT, Param, layout_for, model_params, shards_for, tp_local

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_LOW = {"bf16-params": 2, "bf16-autocast": 2, "fp16": 2, "fp32": 4}  # compute dtype bytes per precision
LOSS_BYTES = 4  # the loop all-reduces its fp32 loss sum once per step


def _units(params: list[Param], tp: int, dp: int, padding: str) -> dict[str, int]:
    """Elements each sharding unit gathers (root first, then blocks), padded as the strategy pads."""
    units: dict[str, int] = {}
    for p in params:
        parts = p.name.split(".")
        key = next((".".join(parts[:i + 2]) for i, part in enumerate(parts) if part == "layers"), "root")
        shape = tp_local(p, tp)
        if padding == "dim0" and shape:
            n = math.ceil(shape[0] / dp) * dp * math.prod(shape[1:])
        else:
            n = math.prod(shape)
        units[key] = units.get(key, 0) + n
    if padding == "unit":
        units = {k: math.ceil(n / dp) * dp for k, n in units.items()}
    return units


def _tp_allreduces(params: list[Param]) -> tuple[int, int]:
    """Row-parallel (forward) and column-parallel (backward) projections in one block."""
    block = [p for p in params if ".0." in p.name and p.name.endswith("weight")]
    row = sum(1 for p in block if TP_SPLIT.get(p.name.split(".")[-2]) == "row")
    col = sum(1 for p in block if TP_SPLIT.get(p.name.split(".")[-2]) == "col")
    return row, col


def _buffer_bytes(comp: Comparison) -> int:
    """Bytes of the model's buffers (DDP broadcasts them): the Hugging Face rotary embedding's
    ``inv_freq`` and ``original_inv_freq`` (head_dim / 2 fp32 each); the other models have none."""
    m = comp.model
    if m.kind != "hf":
        return 0
    a = ARCHS[m.hf_arch]
    head_dim = a.get("head_dim") or a["hidden_size"] // a["num_attention_heads"]
    return 2 * (head_dim // 2) * 4


def expected_comm(spec: dict[str, Any]) -> dict[str, Any]:
    """Theoretical bytes per optimizer step for a run, from its ``spec.json`` payload.

    Returns ``bytes_per_step``, ``by_type`` {collective type: bytes}, ``basis`` (a sentence),
    ``notes`` (one line per way the strategy departs from the textbook formula), ``dp``, ``tp``
    and ``shards``. Raises KeyError for an unknown strategy.
    """
    comp = Comparison.from_dict({**spec["comparison"], "runs": []})
    resolved = spec["run"]
    run = RunSpec(name=resolved["name"], strategy=resolved["strategy"], world_size=resolved.get("world_size", 0),
                  precision=resolved.get("precision", ""), options=resolved.get("options", {}),
                  activation_checkpointing=resolved.get("activation_checkpointing", False))
    info = registry.get(run.strategy)
    recipe = info.comm
    opts = resolved.get("options", {})
    layout = layout_for(comp, run)
    params = model_params(comp.model)
    accum = max(1, comp.grad_accum)
    compute = _LOW.get(layout.precision, 4)
    low_params = layout.precision in ("bf16-params", "fp16") and recipe.low_precision_params
    gather = _DTYPE_BYTES.get(str(opts.get("param_dtype", "auto")), compute if low_params else 4)
    reduce = _DTYPE_BYTES.get(str(opts.get("reduce_dtype", "auto")),
                              compute if low_params and recipe.reduce_in_param_dtype else 4)
    parts: dict[str, float] = {"all_reduce": LOSS_BYTES}
    basis, notes = [], list(recipe.notes)
    add = (lambda kind, n: parts.__setitem__(kind, parts.get(kind, 0) + n))  # noqa: E731
    shards = shards_for(info, opts)
    if layout.dp > 1:
        units = _units(params, layout.tp, layout.dp, recipe.padding if shards != "none" else "none")
        total = sum(units.values())
        grads = "all_reduce" if shards == "none" else recipe.grads
        add(grads, total * reduce * (accum if recipe.reduce_per_micro_batch else 1))
        basis.append(("all-reduce" if grads == "all_reduce" else "reduce-scatter") + " of gradients")
        if shards != "none" and recipe.gathers == "after_step":
            add("all_gather", total * gather)
            basis.append("all-gather of updated parameters")
        elif shards != "none" and recipe.gathers == "per_unit":
            regather = bool(opts.get("reshard_after_forward", True)) and opts.get("sharding_strategy") != "SHARD_GRAD_OP"
            if recipe.regather == "reuse_distance":
                regather = total > int(opts.get("bucket_mb", 25)) * 2**20 // 4
                if not regather:
                    notes.append("ZeRO-3 keeps gathered parameters it reuses within stage3_max_reuse_distance while "
                                 "they fit stage3_max_live_parameters: backward re-gathers nothing")
            backward = sum(n for k, n in units.items() if k != "root" or recipe.root_regathers) if regather else 0
            add("all_gather", (total + backward) * gather * accum)
            basis.append("all-gather in forward" + (" and backward" if backward else ""))
        if recipe.broadcasts_buffers and _buffer_bytes(comp):
            add("broadcast", _buffer_bytes(comp) * accum)
            notes.append("DDP broadcasts module buffers from rank 0 before every forward (broadcast_buffers)")
    if layout.tp > 1:
        micro = max(1, comp.global_batch // (layout.dp * accum))
        m = comp.model
        h = ARCHS[m.hf_arch]["hidden_size"] if m.kind == "hf" else m.d_model
        layers = m.hf_layers if m.kind == "hf" else m.n_layers
        seq = m.seq_len if m.kind != "vit" else (m.image_size // m.patch_size) ** 2
        row, col = _tp_allreduces(params)
        add("all_reduce", (row + col) * layers * micro * seq * h * compute * accum)
        basis.append(f"tensor parallel: {row} activation all-reduces per layer in forward, {col} in backward")
        notes.append(f"tensor parallel backward all-reduces the input gradient of each of the {col} column-parallel "
                     "projections separately, not once per block as Megatron does")
    return {"bytes_per_step": sum(parts.values()), "by_type": parts, "basis": "; ".join(basis) or "no communication",
            "notes": notes, "dp": layout.dp, "tp": layout.tp, "shards": shards}
