"""Materialise the comparison's shared initial weights once, before any run.

``python -m shardscope.engines.init_weights <out>/comparison.json <out>/init.safetensors``

Builds the model from the comparison's model spec and seed, in fp32 on CPU, and saves its state
dict with safetensors. ``safetensors.torch.save_model`` drops duplicate names of shared (tied)
tensors and ``load_model`` restores them, so tied embeddings survive the round trip.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch
from safetensors.torch import load_model, save_model

from shardscope.config import Comparison
from shardscope.engines.model import build_model
from shardscope.rundir import COMPARISON, INIT_WEIGHTS, PARTIAL_SUFFIX


def write_init(comparison: Comparison, path: str) -> int:
    """Build the model for ``comparison`` and save its weights to ``path``; return the parameter count."""
    model = build_model(comparison.model, comparison.seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + PARTIAL_SUFFIX
    try:
        save_model(model, tmp, metadata={"seed": str(comparison.seed), "model_kind": comparison.model.kind})
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    except BaseException:  # a full disk: leave no half-written file behind
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return sum(p.numel() for p in model.parameters())


def load_init(model: torch.nn.Module, path: str) -> None:
    """Load the shared initial weights into ``model`` (strict); raises RuntimeError on a mismatch."""
    missing, unexpected = load_model(model, path, strict=True)
    if missing or unexpected:  # strict=True raises already; kept for older safetensors versions
        raise RuntimeError(f"{path}: missing {missing}, unexpected {unexpected}")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry; returns the exit code (2 on bad usage)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(f"usage: python -m shardscope.engines.init_weights <{COMPARISON}> <{INIT_WEIGHTS}>", file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8") as fh:
        comparison = Comparison.from_dict(json.load(fh))
    n = write_init(comparison, args[1])
    print(f"wrote {args[1]}: {n} parameters, seed {comparison.seed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
