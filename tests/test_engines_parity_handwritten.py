"""End to end: the hand-written FSDP vs DDP in fp32 (within 1e-5). bf16 parameters: test_engines_bf16.py.

Variants: parameters kept gathered between forward and backward; and reshard after forward (the
default) with activation checkpointing, where recomputation must see the re-gathered parameters.
"""

from __future__ import annotations

import pytest

from _launch import assert_matches, launch_all, tiny_comparison
from shardscope.config import RunSpec

pytestmark = pytest.mark.slow
TOL = 1e-5
VARIANTS = ["hw-keep", "hw-ac"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = [
        RunSpec("ddp", "ddp"),
        RunSpec("hw-keep", "fsdp-handwritten", options={"reshard_after_forward": False}),
        RunSpec("hw-ac", "fsdp-handwritten", activation_checkpointing=True),
    ]
    # Two micro-batches per step: the hand-written FSDP reduce-scatters after each and accumulates
    # into its shard gradients, while DDP skips the first all-reduce (no_sync).
    comparison = tiny_comparison(runs, steps=6, parity=True, global_batch=8, grad_accum=2)
    return launch_all(tmp_path_factory.mktemp("handwritten"), comparison)


@pytest.mark.parametrize("name", VARIANTS)
def test_handwritten_matches_ddp(results, name):
    print(name, assert_matches(results["ddp"], results[name], TOL, layers=True))


def test_handwritten_model_state_is_the_local_shards(results):
    ddp = results["ddp"].of_kind("memory")[0]
    hw = results["hw-ac"].of_kind("memory")[0]
    print("handwritten model_state_bytes / ddp =", hw["model_state_bytes"] / ddp["model_state_bytes"])
    assert 0.45 * ddp["model_state_bytes"] <= hw["model_state_bytes"] <= 0.55 * ddp["model_state_bytes"]
    shard_numel = results["hw-ac"].of_kind("start")[0]["notes"]["shard_numel"]
    assert hw["param_bytes"] == hw["grad_bytes"] == 4 * shard_numel
