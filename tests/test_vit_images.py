"""The ViT classifier and its synthetic images: determinism, learnability, and a real run in which
the loop reports samples/s (not tokens/s) and FSDP2 matches DDP."""

from __future__ import annotations

import pytest
import torch

from _launch import launch_all, max_abs_diff, tiny_comparison
from shardscope.config import Comparison, DataSpec, ModelSpec, RunSpec
from shardscope.engines.data import build_batches
from shardscope.engines.images import class_patterns, image_source
from shardscope.engines.model import build_model

VIT = ModelSpec(kind="vit", d_model=32, n_layers=2, n_heads=4, d_ff=64, image_size=16, patch_size=4, num_classes=10)


def _comparison(**kw) -> Comparison:
    return Comparison(name="v", model=VIT, data=DataSpec(kind="images"), global_batch=8, **kw)


def test_images_are_a_pure_function_of_seed_and_step():
    a, b = image_source(_comparison()), image_source(_comparison())
    x1, y1 = a.global_batch(3)
    x2, y2 = b.global_batch(3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (8, 3, 16, 16) and y1.dtype == torch.int64
    assert not torch.equal(a.global_batch(4)[0], x1)
    assert a.tokens_per_sample == 0  # the loop reports samples/s


def test_labels_are_learnable_from_the_images():
    patterns = class_patterns(10, 3, 16, seed=1234)
    x, y = image_source(_comparison(seed=1234)).global_batch(0)
    # Nearest class pattern (by correlation) recovers most labels: the signal beats the noise.
    scores = torch.einsum("nchw,kchw->nk", x, patterns)
    assert (scores.argmax(dim=1) == y).float().mean() >= 0.75


def test_data_parallel_ranks_split_the_same_global_batch():
    c = _comparison()
    halves = [build_batches(c, 2, r)[0](5) for r in (0, 1)]
    whole = image_source(c).global_batch(5)[0]
    assert torch.equal(torch.cat([halves[0][0][0], halves[1][0][0]]), whole)


def test_vit_returns_class_logits():
    model = build_model(VIT, seed=0)
    assert model(torch.randn(4, 3, 16, 16)).shape == (4, 10)
    assert len(model.layers) == 2


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = [RunSpec("ddp", "ddp"), RunSpec("fsdp2", "fsdp2")]
    comparison = tiny_comparison(runs, model=VIT, data=DataSpec(kind="images"), steps=8, global_batch=8, lr=3e-3)
    return launch_all(tmp_path_factory.mktemp("vit"), comparison)


@pytest.mark.slow
def test_vit_run_reports_samples_per_second_and_trains(results):
    steps = results["ddp"].steps()
    assert all("samples_per_s" in s and "tokens_per_s" not in s for s in steps)
    end = results["ddp"].of_kind("end")[-1]
    assert end["median_samples_per_s"] > 0 and end["median_tokens_per_s"] is None
    losses = results["ddp"].losses()
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_vit_fsdp2_matches_ddp(results):
    assert results["fsdp2"].losses()[0] == results["ddp"].losses()[0]
    assert max_abs_diff(results["fsdp2"].losses(), results["ddp"].losses()) <= 1e-5
