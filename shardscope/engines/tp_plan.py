"""Tensor-parallel plans as tables (Megatron-style), keyed by model kind.

Each block's attention and MLP are split so that one block costs two all-reduces forward and
two backward:
- **colwise** (``ColwiseParallel``): the weight's output dimension is split. q/k/v projections
  (each rank computes ``n_heads / tp`` whole heads) and the MLP's up/gate (``fc_in``) projections.
  The input is replicated; the output stays sharded on the last dimension, as a local tensor.
- **rowwise** (``RowwiseParallel``): the weight's input dimension is split. The attention output
  projection and the MLP's down (``fc_out``) projection take the sharded activations and
  all-reduce their partial sums into a replicated output.

Embeddings, norms and the LM head stay replicated (the Hugging Face model ties its LM head to the
embedding, and splitting one side of a tie would break it). Attention needs no change: every
model here reads its local head count from the projection's output width (``-1`` in the view).

Keys are module paths with ``*`` for the block index, as ``parallelize_module`` accepts them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

COLWISE, ROWWISE = "colwise", "rowwise"

# engines/model.py's Block and engines/vit.py's EncoderBlock share these module names:
# attn: q/k/v/o_proj, mlp: fc_in/fc_out.
_BLOCK_PLAN = {
    "layers.*.attn.q_proj": COLWISE,
    "layers.*.attn.k_proj": COLWISE,
    "layers.*.attn.v_proj": COLWISE,
    "layers.*.attn.o_proj": ROWWISE,
    "layers.*.mlp.fc_in": COLWISE,
    "layers.*.mlp.fc_out": ROWWISE,
}

# model kind -> {module path pattern: style}
TP_PLANS: dict[str, dict[str, str]] = {
    "transformer": _BLOCK_PLAN,
    # transformers' Qwen2ForCausalLM (the same split as its own base_model_tp_plan)
    "hf": {
        "model.layers.*.self_attn.q_proj": COLWISE,
        "model.layers.*.self_attn.k_proj": COLWISE,
        "model.layers.*.self_attn.v_proj": COLWISE,
        "model.layers.*.self_attn.o_proj": ROWWISE,
        "model.layers.*.mlp.gate_proj": COLWISE,
        "model.layers.*.mlp.up_proj": COLWISE,
        "model.layers.*.mlp.down_proj": ROWWISE,
    },
    "vit": _BLOCK_PLAN,
}


def _matches(pattern: str, name: str) -> bool:
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(p == "*" or p == n for p, n in zip(parts, names))


def kind_of(model: nn.Module) -> str:
    """Return the model kind whose plan matches every one of its patterns in ``model``.

    Raises ValueError naming the kinds tried when no plan fits (a model without a plan cannot
    be tensor-parallel).
    """
    names = [n for n, _ in model.named_modules()]
    for kind, plan in TP_PLANS.items():
        if all(any(_matches(pattern, n) for n in names) for pattern in plan):
            return kind
    raise ValueError(f"{type(model).__name__}: no tensor-parallel plan fits; plans exist for {', '.join(TP_PLANS)}")


def module_plan(kind: str) -> dict[str, Any]:
    """Return ``{pattern: ParallelStyle}`` for ``parallelize_module``; raises KeyError for an unknown kind."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {COLWISE: ColwiseParallel, ROWWISE: RowwiseParallel}
    try:
        plan = TP_PLANS[kind]
    except KeyError:
        raise KeyError(f"no tensor-parallel plan for model kind {kind!r}; plans: {', '.join(TP_PLANS)}") from None
    return {pattern: styles[style]() for pattern, style in plan.items()}
