"""End to end: bf16 parameters (``bf16-params``: bf16 gathered parameters and compute, fp32
gradient reduction and fp32 sharded master weights) in the hand-written FSDP, FSDP2 and FSDP1.

The three implement the same recipe, so their losses agree up to bf16 rounding order; all of them
stay close to the fp32 trajectory and train.
"""

from __future__ import annotations

import pytest

from _launch import launch_all, max_abs_diff, tiny_comparison
from shardscope.config import RunSpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = [RunSpec("hw", "fsdp-handwritten"), RunSpec("fsdp2", "fsdp2"), RunSpec("fsdp1", "fsdp1")]
    comparison = tiny_comparison(runs, steps=6, precision="bf16-params")
    return launch_all(tmp_path_factory.mktemp("bf16"), comparison)


def test_bf16_params_are_used(results):
    for result in results.values():
        start = result.of_kind("start")[0]
        assert start["precision"]["param"] == "bfloat16" and start["precision"]["master"] == "float32"
        assert start["notes"]["param_dtype"] == "torch.bfloat16"


@pytest.mark.parametrize("name", ["fsdp2", "fsdp1"])
def test_handwritten_bf16_tracks_torch_fsdp(results, name):
    hw, other = results["hw"].losses(), results[name].losses()
    print("bf16 handwritten vs", name, "max |dloss| =", max_abs_diff(hw, other))
    assert abs(hw[0] - other[0]) <= 1e-4  # same bf16 forward at step 0
    assert max_abs_diff(hw, other) <= 2e-3
    assert hw[-1] < hw[0]
