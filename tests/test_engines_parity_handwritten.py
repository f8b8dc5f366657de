"""End to end: the hand-written FSDP vs DDP in fp32 (within 1e-5). bf16 parameters: test_engines_bf16.py.

Variants: reshard after forward (the default), parameters kept gathered between forward and
backward, and activation checkpointing (recomputation must see re-gathered parameters).
"""

from __future__ import annotations

import pytest

from _launch import grad_norms, launch_all, max_abs_diff, tiny_comparison
from shardscope.config import RunSpec

pytestmark = pytest.mark.slow
TOL = 1e-5
VARIANTS = ["hw", "hw-keep-ac"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = [
        RunSpec("ddp", "ddp"),
        RunSpec("hw", "fsdp-handwritten"),
        RunSpec("hw-keep-ac", "fsdp-handwritten", options={"reshard_after_forward": False},
                activation_checkpointing=True),
    ]
    return launch_all(tmp_path_factory.mktemp("handwritten"), tiny_comparison(runs, steps=6, parity=True))


@pytest.mark.parametrize("name", VARIANTS)
def test_handwritten_matches_ddp(results, name):
    ddp, other = results["ddp"], results[name]
    assert other.losses()[0] == ddp.losses()[0]
    assert max_abs_diff(other.losses(), ddp.losses()) <= TOL
    assert max_abs_diff(grad_norms(other), grad_norms(ddp)) <= TOL
    for a, b in zip(ddp.of_kind("layers"), other.of_kind("layers")):
        assert a["grad_norms"].keys() == b["grad_norms"].keys()
        for layer, value in a["grad_norms"].items():
            assert abs(value - b["grad_norms"][layer]) <= TOL, (name, a["step"], layer)
            assert abs(a["param_norms"][layer] - b["param_norms"][layer]) <= TOL, (name, a["step"], layer)


def test_handwritten_model_state_is_the_local_shards(results):
    ddp = results["ddp"].of_kind("memory")[0]
    hw = results["hw"].of_kind("memory")[0]
    assert 0.45 * ddp["model_state_bytes"] <= hw["model_state_bytes"] <= 0.55 * ddp["model_state_bytes"]
    shard_numel = results["hw"].of_kind("start")[0]["notes"]["shard_numel"]
    assert hw["param_bytes"] == hw["grad_bytes"] == 4 * shard_numel
