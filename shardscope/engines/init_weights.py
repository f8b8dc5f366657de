"""The comparison's shared initial weights: written once by the first run's ranks, loaded by every run.

``ensure_init`` is what a rank calls; ``python -m shardscope.engines.init_weights <out>/comparison.json
<out>/init.safetensors`` writes them outside a run (the benchmarks, tests).

Builds the model from the comparison's model spec and seed, in fp32 on CPU, and saves its state
dict with safetensors. ``safetensors.torch.save_model`` drops duplicate names of shared (tied)
tensors and ``load_model`` restores them, so tied embeddings survive the round trip.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from typing import Callable

import torch
from safetensors.torch import load_model, save_model

from shardscope.config import Comparison
from shardscope.engines.model import build_model
from shardscope.core.rundir import COMPARISON, INIT_WEIGHTS, PARTIAL_SUFFIX


def save_init(model: torch.nn.Module, comparison: Comparison, path: str) -> None:
    """Save ``model``'s weights to ``path`` atomically (a partial file of this process, renamed over it).

    The bytes depend only on the weights: safetensors writes its metadata map in a random order, so the
    metadata is one key (a JSON string with sorted keys) and two writers of the same model (two nodes on a
    shared filesystem, two concurrent runs) write the same file, with the same hash."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}{PARTIAL_SUFFIX}"
    meta = json.dumps({"model_kind": comparison.model.kind, "seed": comparison.seed}, sort_keys=True)
    try:
        save_model(model, tmp, metadata={"shardscope": meta})
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    except BaseException:  # a full disk: leave no half-written file behind
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_init(comparison: Comparison, path: str) -> int:
    """Build the model for ``comparison`` and save its weights to ``path``; return the parameter count."""
    model = build_model(comparison.model, comparison.seed)
    save_init(model, comparison, path)
    return sum(p.numel() for p in model.parameters())


def ensure_init(model: torch.nn.Module, comparison: Comparison, path: str, *, write: bool,
                barrier: Callable[[], None]) -> None:
    """Make ``model`` hold the comparison's shared initial weights, writing them first where none exist.

    ``model`` was just built from the comparison's seed, so it already holds them: a rank with ``write``
    (local rank 0 of each node) saves it when ``path`` is missing (the first run of a comparison), every rank
    waits at ``barrier`` and then loads the file, so all runs start from the same bytes, whose hash the
    start record carries. No interpreter is started only to write the weights."""
    if write and not os.path.exists(path):
        save_init(model, comparison, path)
    barrier()
    load_init(model, path)


def content_sha256(model: torch.nn.Module) -> str:
    """SHA-256 of the weights themselves: every tensor's name, dtype, shape and bytes, in name order (no file
    metadata, no layout): two runs that start from the same values carry the same hash."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


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
