"""End to end: gradient accumulation. Two micro-batches of b sequences per rank must train exactly
like one batch of 2b (within 1e-5), with DDP, FSDP2 and FSDP1 NO_SHARD (each skips gradient sync
on the first micro-batch through its own ``no_sync``)."""

from __future__ import annotations

import pytest

from _launch import assert_matches, launch_all, tiny_comparison
from shardscope.config import RunSpec

pytestmark = pytest.mark.slow
TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    one = tiny_comparison([RunSpec("ddp", "ddp")], steps=6, global_batch=8, grad_accum=1)
    runs = [RunSpec("ddp", "ddp"), RunSpec("fsdp2", "fsdp2"),
            RunSpec("fsdp1-no-shard", "fsdp1", options={"sharding_strategy": "NO_SHARD"})]
    two = tiny_comparison(runs, steps=6, global_batch=8, grad_accum=2)
    found = {"one-batch": launch_all(tmp_path_factory.mktemp("accum1"), one)["ddp"]}
    found.update(launch_all(tmp_path_factory.mktemp("accum2"), two))
    return found


@pytest.mark.parametrize("name", ["ddp", "fsdp2", "fsdp1-no-shard"])
def test_two_micro_batches_equal_one_batch(results, name):
    base, accum = results["one-batch"], results[name]
    assert accum.of_kind("start")[0]["grad_accum"] == 2 and accum.of_kind("start")[0]["micro_batch_size"] == 2
    # A mean of micro-batch means rounds differently from one mean: step 0 within TOL, not bit-equal.
    print(name, assert_matches(base, accum, TOL, exact_first=False))
    assert all(s["tokens"] == 8 * 16 for s in accum.steps())
