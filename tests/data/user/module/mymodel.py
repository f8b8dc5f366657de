"""A user's own model, as a user would write it: a small GPT with its blocks in ``self.blocks`` (not ``layers``),
tied input and output embeddings (``tied = false`` in ``[model.args]`` unties them), a tensor-parallel plan of its
own, and what runs before and after its blocks as methods of their own (for pipeline stages).

``build(model, seed)`` is the entry shardscope calls (``model.entry = "./module/mymodel.py:build"``): ``model`` is the
preset's ``[model]`` table, the user's own keys under ``args``.
"""

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.query, self.key, self.value = (nn.Linear(width, width, bias=False) for _ in range(3))
        self.out = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.query, self.key, self.value))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(width), nn.RMSNorm(width)
        self.attention = Attention(width, heads)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    # fsdp2-tp applies it: heads split column-wise, outputs row-wise
    tp_plan = {"blocks.*.attention.query": "colwise", "blocks.*.attention.key": "colwise",
               "blocks.*.attention.value": "colwise", "blocks.*.attention.out": "rowwise",
               "blocks.*.up": "colwise", "blocks.*.down": "rowwise"}

    def __init__(self, vocab: int, width: int, depth: int, heads: int, seq_len: int, tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(seq_len, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)

    # What runs before the first block and after the last: pipeline schedules run them on the first and last stages
    def pre_blocks(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens) + self.position[: tokens.shape[1]]

    def post_blocks(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.pre_blocks(tokens)
        for block in self.blocks:
            x = block(x)
        return self.post_blocks(x)


def build(model: dict, seed: int) -> nn.Module:
    args = model["args"]
    return TinyGPT(args.get("vocab", 512), args.get("width", 64), args.get("depth", 2), args.get("heads", 4),
                   model["seq_len"], tied=args.get("tied", True))


def no_module(model: dict, seed: int):
    return {"not": "a module"}


def raises(model: dict, seed: int):
    raise RuntimeError("out of ideas")
