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


TP_PLAN_ATTR = "_shardscope_tp_plan"  # a model's own plan, noted on the instance by its builder
STYLES = {"colwise": COLWISE, "rowwise": ROWWISE}  # the styles of a model's own plan that shardscope applies


def declared_plan(model: nn.Module) -> dict[str, str] | None:
    """The plan a model declares itself, module paths from its root: a user's module's ``tp_plan`` attribute (noted
    as ``TP_PLAN_ATTR``) or a Hugging Face model's own (``_tp_plan``: its config's ``base_model_tp_plan`` under the
    base model's prefix); None when it declares none."""
    plan = getattr(model, TP_PLAN_ATTR, None)
    if plan is None:
        plan = getattr(model, "_tp_plan", None)
    return {str(k): str(v) for k, v in plan.items()} if plan else None


def usable_plan(plan: dict[str, str] | None, module_names: list[str], linear_names: set[str]) -> tuple[dict[str, str], str]:
    """(the plan's entries inside the blocks, "" or why shardscope cannot apply it).

    Entries outside the blocks (embeddings, the output layer) are left out: those stay replicated, which is
    always correct. Inside the blocks every style must be plain ``colwise`` or ``rowwise`` and every pattern must
    name linears of the model."""
    if not plan:
        return {}, "the model declares no tensor-parallel plan"
    inside = {p: s for p, s in plan.items() if "*" in p}
    if not inside:
        return {}, "the model's tensor-parallel plan splits nothing inside its blocks"
    for pattern, style in inside.items():
        if style not in STYLES:
            return {}, (f"its tensor-parallel plan splits {pattern} as {style!r}; shardscope applies 'colwise' and "
                        "'rowwise' only")
        matched = [n for n in module_names if _matches(pattern, n)]
        if not matched:
            return {}, f"its tensor-parallel plan names {pattern}, which matches no module of the model"
        if not all(n in linear_names for n in matched):
            return {}, f"its tensor-parallel plan splits {pattern}, which is not an nn.Linear"
    return inside, ""


def plan_of(model: nn.Module) -> dict[str, str]:
    """The plan to apply to ``model``: its own (``declared_plan``), else the built-in table whose patterns all match
    (``TP_PLANS``). Raises ValueError naming why no plan applies."""
    if getattr(model, TP_PLAN_ATTR, None) is not None:
        names = [n for n, _ in model.named_modules()]
        linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        plan, why = usable_plan(declared_plan(model), names, linears)
        if why:
            raise ValueError(f"{type(model).__name__}: {why}")
        return plan
    return TP_PLANS[kind_of(model)]


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


def styled(plan: dict[str, str]) -> dict[str, Any]:
    """``{pattern: ParallelStyle}`` for ``parallelize_module`` from a plan of style names."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {COLWISE: ColwiseParallel, ROWWISE: RowwiseParallel}
    return {pattern: styles[STYLES.get(style, style)]() for pattern, style in plan.items()}
