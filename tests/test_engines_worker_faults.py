"""End to end: a rank that fails writes an ``error`` record (one-line message, full traceback) and an
``end`` record with status failed, and torchrun exits non-zero; a crashed rank (``os._exit``) leaves
the job failed without hanging the survivor; a layout a strategy refuses fails with its reason."""

from __future__ import annotations

import pytest

from _launch import launch, prepare, tiny_comparison
from shardscope.config import RunSpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = [RunSpec("raise", "ddp", fault="rank=1,step=2,kind=raise"),
            RunSpec("exit", "fsdp2", fault="rank=0,step=1,kind=exit"),
            RunSpec("hybrid-1", "fsdp1", options={"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 1})]
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


def test_hybrid_with_one_rank_shards_is_refused(results):
    """FSDP1 would clamp a one-rank shard group to NO_SHARD and never all-reduce across replicas."""
    failed = results["hybrid-1"]
    assert failed.returncode != 0
    # Every rank refuses the layout, but once the first one exits torchrun sends SIGTERM to its peer,
    # which may end as "stopped" before it reaches the refusal itself: at least one error, no other kind.
    errors = [e for rank in (0, 1) for e in failed.of_kind("error", rank)]
    assert errors, "no rank recorded the refusal"
    for error in errors:
        assert error["message"].startswith("ValueError: HYBRID_SHARD with a shard group of 1 rank")
        assert "Traceback" in error["traceback"]
    for rank in (0, 1):
        expected = "failed" if failed.of_kind("error", rank) else "stopped"
        assert failed.of_kind("end", rank)[0]["status"] == expected
