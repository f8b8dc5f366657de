"""Parameter shapes of the comparison's models, tensor by tensor, as the engines build them.

Pure Python (no torch): the memory model, the communication theory and FLOPs per token start from
these shapes, so sharding can be computed per tensor the way the strategies shard. shardscope's own models (the
built-in transformer, a Hugging Face architecture from ``hf_archs``, the ViT) are computed here from the preset's
keys; the user's (a Hugging Face config or directory, a module) come from the model check's description of the
real module (``ModelSpec.described``: each tensor with its unit and its split under the model's own
tensor-parallel plan). ``memory_model`` re-exports them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import re

from shardscope.config import ModelSpec
from shardscope.core import model_facts
from shardscope.core.hf_archs import ARCHS

# Tensor-parallel split of each parameter: "col" splits dim 0 (and the bias), "row" splits dim 1
# (bias replicated), absent = replicated. Megatron-style plan for attention and MLP projections.
TP_SPLIT = {
    "q_proj": "col", "k_proj": "col", "v_proj": "col", "o_proj": "row",
    "fc_in": "col", "fc_out": "row", "gate_proj": "col", "up_proj": "col", "down_proj": "row",
}


_LAYER = re.compile(r"layers\.\d+\.")


@dataclass(frozen=True)
class Param:
    """One parameter tensor: its name, shape, and (for a described model) its tensor-parallel split and unit."""

    name: str
    shape: tuple[int, ...]
    split: str | None = None  # the model's own plan: "col", "row" or "" (replicated); None: by module name
    block: str | None = None  # "layers.<i>." for the i-th block, "root" otherwise; None: from the name
    stage_unit: str = ""  # a described model: its pipeline unit ("embeddings", "layers.<i>", "head"); "": from the name
    tied: bool = False  # a tied embedding: the last pipeline stage holds it too (its gradient summed with the first's)

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def tp_split(self) -> str:
        """'col', 'row' or '' (replicated) under tensor parallelism."""
        if self.split is not None:
            return self.split
        parts = self.name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        split = TP_SPLIT.get(module, "")
        if split == "row" and parts[-1] == "bias":
            return ""
        return split

    @property
    def unit(self) -> str:
        """The sharding unit it belongs to: ``layers.<i>.`` (one per block) or ``root``."""
        if self.block is not None:
            return self.block
        match = _LAYER.search(self.name)
        return match.group(0) if match else "root"


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
    """Shapes of a Qwen2-style causal LM from ``hf_archs`` with ``m.hf_layers`` decoder layers (0: all)
    (q/k/v with bias, o and the SwiGLU MLP without, RMSNorm weights, tied output embedding)."""
    a = ARCHS[m.hf_arch]
    h, inter, vocab = a["hidden_size"], a["intermediate_size"], a["vocab_size"]
    heads, kv = a["num_attention_heads"], a["num_key_value_heads"]
    hd = h // heads
    out = [Param("model.embed_tokens.weight", (vocab, h))]
    for i in range(model_facts.hf_layers(m)):
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


def described_params(m: ModelSpec) -> list[Param]:
    """Shapes of a user's model as the model check found them on the real module (shared tensors once)."""
    rows = model_facts.description(m)["params"]
    described = model_facts.pipeline_facts(m) is not None and bool(model_facts.description(m).get("pipeline"))
    stage_units = model_facts.pipeline_units(m, [str(row[0]) for row in rows]) if described else [""] * len(rows)
    tied = set(model_facts.pipeline_tied(m))
    return [Param(str(name), tuple(int(x) for x in shape), str(split), str(unit), stage_unit, str(name) in tied)
            for (name, shape, unit, split), stage_unit in zip(rows, stage_units)]


PARAM_SHAPES = {"transformer": transformer_params, "hf": hf_params, "vit": vit_params}


def model_params(m: ModelSpec) -> list[Param]:
    """Parameter tensors of the model a ``ModelSpec`` describes; raises ValueError for an unknown kind or a user's
    model without its description."""
    if model_facts.is_described(m):
        return described_params(m)
    fn = PARAM_SHAPES.get(m.kind)
    if fn is None:
        raise ValueError(f"model.kind = {m.kind!r}: allowed: {', '.join(PARAM_SHAPES)}")
    return fn(m)


def param_count(m: ModelSpec) -> int:
    """Total parameter elements of the model (shared tensors once)."""
    return sum(p.numel for p in model_params(m))


def embedding_count(m: ModelSpec) -> int:
    """Parameter elements in embedding tables (left out of FLOPs per token)."""
    if model_facts.is_described(m):
        tables = set(model_facts.description(m).get("embeddings") or ())
        return sum(p.numel for p in model_params(m) if p.name in tables)
    return sum(p.numel for p in model_params(m) if "emb" in p.name)


def flops_per_token(m: ModelSpec) -> float | None:
    """Training FLOPs per token, as torchtitan counts: 6 (N - N_emb) + 12 L H d_head T; None for images. A user's
    model: what ``FlopCounterMode`` counted over one training step of the real module (forward, loss, backward)
    per token, the output layer included."""
    if model_facts.is_described(m):
        d = model_facts.description(m)
        per_sample, tokens = d.get("train_flops_per_sample"), model_facts.tokens_per_sample(m)
        return float(per_sample) / tokens if per_sample and tokens and d.get("inputs") == "tokens" else None
    if m.kind == "vit":
        return None
    layers, t = model_facts.layers(m), m.seq_len
    heads = model_facts.heads(m)[0]
    hd = model_facts.hidden_size(m) // heads
    return 6.0 * (param_count(m) - embedding_count(m)) + 12.0 * layers * heads * hd * t
