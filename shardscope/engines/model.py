"""Models every rank can build, and the built-in decoder-only transformer.

``build_model(model_spec, seed)`` dispatches on ``model_spec.kind`` through ``MODEL_BUILDERS``, a
table of ``"module:function"`` entries imported lazily (so the Hugging Face model does not import
transformers unless asked). Hook point for other models: add an entry whose function takes
``(model_spec, seed)`` and returns an ``nn.Module`` whose ``forward(inputs)`` returns logits, and
which exposes its repeated blocks as an ``nn.ModuleList`` at ``model.layers`` (strategies wrap,
shard and checkpoint per block; see ``parallelize.blocks_of``).

The built-in transformer: decoder-only, pre-norm (LayerNorm), causal attention through
``F.scaled_dot_product_attention``, GELU MLP, learned positional embeddings, and *untied*
input/output embeddings (untied keeps every parameter owned by exactly one module, which keeps
sharding, tensor parallelism and per-layer norms simple). q, k and v are separate linears so a
tensor-parallel plan can split heads column-wise without re-ordering a fused projection.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention. Head count is derived from the projection width at run
    time, so a tensor-parallel plan that shards q/k/v column-wise works unchanged (local heads)."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.o_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        heads = q.shape[-1] // self.head_dim  # local heads under tensor parallelism
        q, k, v = (t.view(b, s, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, heads * self.head_dim))


class MLP(nn.Module):
    """Two-layer GELU feed-forward network."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(d_model, d_ff)
        self.fc_out = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    """Decoder-only language model: ``forward(tokens [b, s]) -> logits [b, s, vocab]``."""

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, d_ff: int, seq_len: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"n_heads = {n_heads} must divide d_model = {d_model}")
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.layers = nn.ModuleList(Block(d_model, n_heads, d_ff) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))

    def init_weights(self, seed: int) -> None:
        """Deterministic GPT-2 style init from ``seed``: N(0, 0.02), residual projections scaled
        by 1/sqrt(2 * n_layers), zero biases, unit LayerNorm gains."""
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * len(self.layers))
        for name, module in self.named_modules():  # named_modules order is fixed -> reproducible
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(("o_proj", "fc_out")) else 0.02
                with torch.no_grad():
                    nn.init.normal_(module.weight, 0.0, std, generator=gen)
                    if getattr(module, "bias", None) is not None:
                        module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)


def build_transformer(spec: Any, seed: int) -> Transformer:
    """Return the built-in transformer for a ``ModelSpec``, initialised from ``seed`` (fp32, CPU)."""
    model = Transformer(spec.vocab_size, spec.d_model, spec.n_layers, spec.n_heads, spec.d_ff, spec.seq_len)
    model.init_weights(seed)
    return model


# model.kind -> "module:function(model_spec, seed) -> nn.Module". Imported lazily.
MODEL_BUILDERS: dict[str, str] = {
    "transformer": "shardscope.engines.model:build_transformer",
    "hf": "shardscope.engines.hf_model:build_model",
    "vit": "shardscope.engines.vit:build_model",
    "module": "shardscope.engines.user_module:build_model",
}


def resolve(entry: str) -> Callable[..., Any]:
    """Return the object named by ``"module:attr"``; raises ImportError/AttributeError."""
    module, _, attr = entry.partition(":")
    return getattr(importlib.import_module(module), attr)


def build_model(spec: Any, seed: int) -> nn.Module:
    """Return the model for ``spec`` (a ``config.ModelSpec``), built in fp32 on CPU from ``seed``.

    Raises ValueError for an unknown ``spec.kind``.
    """
    entry = MODEL_BUILDERS.get(spec.kind)
    if entry is None:
        raise ValueError(f"model.kind = {spec.kind!r}: allowed: {', '.join(MODEL_BUILDERS)}")
    return resolve(entry)(spec, seed)


def count_parameters(model: nn.Module) -> int:
    """Return the number of distinct parameter elements (shared tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total
