"""Synthetic images for the ViT: the global batch at step s is a pure function of (seed, s).

Each class owns a fixed random pattern (drawn once from the seed, smoothed so it has spatial
structure a patch embedding can pick up); a sample is its class's pattern plus Gaussian noise
and a random brightness. The label is learnable from the image, so the loss falls, but the noise
keeps it from being trivial.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from shardscope.engines.data import Batch, BatchSource, step_seed

NOISE_STD = 0.8  # per-pixel noise relative to the unit-variance class patterns


def class_patterns(num_classes: int, channels: int, size: int, seed: int) -> torch.Tensor:
    """Return ``[num_classes, channels, size, size]`` unit-variance patterns fixed by ``seed``."""
    gen = torch.Generator().manual_seed(step_seed(seed, 0, stream=2))
    raw = torch.randn(num_classes, channels, size, size, generator=gen)
    smooth = F.avg_pool2d(raw, kernel_size=3, stride=1, padding=1)  # spatially correlated
    return (smooth - smooth.mean(dim=(1, 2, 3), keepdim=True)) / smooth.std(dim=(1, 2, 3), keepdim=True)


def image_batch(patterns: torch.Tensor, seed: int, step: int, batch: int) -> Batch:
    """Return (images ``[batch, C, H, W]`` fp32, labels ``[batch]`` int64) for ``step``."""
    gen = torch.Generator().manual_seed(step_seed(seed, step, stream=3))
    labels = torch.randint(patterns.shape[0], (batch,), generator=gen)
    brightness = 0.5 + torch.rand(batch, 1, 1, 1, generator=gen)
    noise = torch.randn((batch, *patterns.shape[1:]), generator=gen) * NOISE_STD
    return patterns[labels] * brightness + noise, labels


def image_source(comparison: Any) -> BatchSource:
    """Return the synthetic image source for ``comparison`` (``tokens_per_sample = 0``: the loop
    reports samples/s)."""
    m, seed, n = comparison.model, comparison.seed, comparison.global_batch
    patterns = class_patterns(m.num_classes, m.channels, m.image_size, seed)
    return BatchSource(lambda step: image_batch(patterns, seed, step, n), tokens_per_sample=0)
