"""A vision transformer classifier (ViT) for samples/s comparisons on synthetic images.

``forward(images [b, C, H, W]) -> logits [b, num_classes]``. Non-overlapping patches are
flattened and projected to ``d_model``, a learned position embedding is added, pre-norm blocks
(bidirectional attention, GELU MLP) run over the patch sequence, and the mean-pooled output is
classified. Blocks sit at ``model.layers`` with the same q/k/v/o and fc_in/fc_out names as the
built-in transformer, so sharding, checkpointing and the tensor-parallel plan treat them alike.
Uses ``ModelSpec``'s d_model, n_layers, n_heads, d_ff, image_size, patch_size, channels, num_classes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardscope.engines.images import image_source  # noqa: F401 - data.DATA_SOURCES["images"] names it here
from shardscope.engines.model import Block, CausalSelfAttention


class SelfAttention(CausalSelfAttention):
    """Bidirectional multi-head attention (the built-in attention without the causal mask); heads
    counted from the projection width at run time, so a column-wise tensor-parallel split of
    q/k/v runs with local heads unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism the projections are local shards (n_heads / tp heads)
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class EncoderBlock(Block):
    """The built-in transformer's pre-norm block with bidirectional attention."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__(d_model, n_heads, d_ff)
        self.attn = SelfAttention(d_model, n_heads)


class ViT(nn.Module):
    """Vision transformer classifier over ``patch_size`` x ``patch_size`` patches."""

    def __init__(self, image_size: int, patch_size: int, channels: int, num_classes: int,
                 d_model: int, n_layers: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        if image_size % patch_size or d_model % n_heads:
            raise ValueError(f"patch_size {patch_size} must divide image_size {image_size} and "
                             f"n_heads {n_heads} must divide d_model {d_model}")
        self.patch_size = patch_size
        n_patches = (image_size // patch_size) ** 2
        self.patch_proj = nn.Linear(channels * patch_size * patch_size, d_model)
        self.pos_emb = nn.Parameter(torch.zeros(n_patches, d_model))
        self.layers = nn.ModuleList(EncoderBlock(d_model, n_heads, d_ff) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def patches(self, images: torch.Tensor) -> torch.Tensor:
        """Return ``[b, n_patches, C * p * p]``: non-overlapping patches, row-major."""
        p = self.patch_size
        b, c, h, w = images.shape
        x = images.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // p) * (w // p), c * p * p)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_proj(self.patches(images)) + self.pos_emb
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))

    def init_weights(self, seed: int) -> None:
        """Deterministic init from ``seed``: N(0, 0.02) linears and position embedding, residual
        projections scaled by 1/sqrt(2 * n_layers), zero biases, unit LayerNorm gains."""
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * len(self.layers))
        with torch.no_grad():
            nn.init.normal_(self.pos_emb, 0.0, 0.02, generator=gen)
            for name, module in self.named_modules():
                if isinstance(module, nn.Linear):
                    std = residual_std if name.endswith(("o_proj", "fc_out")) else 0.02
                    nn.init.normal_(module.weight, 0.0, std, generator=gen)
                    nn.init.zeros_(module.bias)
                elif isinstance(module, nn.LayerNorm):
                    nn.init.ones_(module.weight)
                    nn.init.zeros_(module.bias)


def build_model(spec: Any, seed: int) -> ViT:
    """Return the ViT for a ``ModelSpec`` (kind "vit"), initialised from ``seed`` (fp32, CPU)."""
    model = ViT(spec.image_size, spec.patch_size, spec.channels, spec.num_classes,
                spec.d_model, spec.n_layers, spec.n_heads, spec.d_ff)
    model.init_weights(seed)
    return model
