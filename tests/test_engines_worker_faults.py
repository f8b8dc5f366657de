"""End to end: a rank that fails writes an ``error`` record (one-line message, full traceback) and an
``end`` record with status failed, and torchrun exits non-zero; a crashed rank (``os._exit``) leaves
the job failed without hanging the survivor; a hybrid layout that cannot work is refused at validation."""

from __future__ import annotations

import pytest

from _launch import launch, prepare, tiny_comparison
from shardscope.config import RunSpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = [RunSpec("raise", "ddp", fault="rank=1,step=2,kind=raise"),
            RunSpec("exit", "fsdp2", fault="rank=0,step=1,kind=exit")]
    comparison = tiny_comparison(runs, steps=5)
    out = prepare(tmp_path_factory.mktemp("faults"), comparison)
    return {r.name: launch(out, comparison, r.name) for r in runs}


def test_raised_fault_is_recorded(results):
    result = results["raise"]
    assert result.returncode != 0
    error = result.of_kind("error", rank=1)[0]
    assert error["message"] == "RuntimeError: injected fault at step 2 on rank 1"
    assert "faults.py" in error["traceback"] and error["traceback"].count("\n") > 2
    end = result.of_kind("end", rank=1)[0]
    assert end["status"] == "failed" and end["steps_completed"] == 2
    assert [s["step"] for s in result.steps(rank=1)] == [0, 1]


def test_crashed_rank_fails_the_job(results):
    result = results["exit"]
    assert result.returncode != 0
    assert not result.of_kind("end", rank=0)  # os._exit: no chance to write anything
    assert [s["step"] for s in result.steps(rank=0)] == [0]


def test_hybrid_with_one_rank_shards_is_refused_before_anything_starts():
    """FSDP1 would clamp a one-rank shard group to NO_SHARD and never all-reduce across replicas: the preset is
    refused in one line at validation (exit 2), not in every rank."""
    from shardscope.config import ConfigError

    with pytest.raises(ConfigError, match="options.hybrid_shard_size = 1: HYBRID_SHARD with a shard group of 1 rank"):
        tiny_comparison([RunSpec("hybrid-1", "fsdp1", options={"sharding_strategy": "HYBRID_SHARD",
                                                                "hybrid_shard_size": 1})], steps=5)
