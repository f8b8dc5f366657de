"""``stack_room.call``: the training loop runs with room on CPython's frame stack, so a loop whose calls go back
and forth across the end of a data-stack chunk (CPython gh-142183) does not map and unmap a chunk each time.
Counted in page faults of this thread (an independent count: the kernel's), not in time."""

from __future__ import annotations

import resource
import sys

import pytest

from shardscope.engines import stack_room

REPS = 40


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _down(n: int) -> int:
    return _down(n - 1) if n else 0


def _worst_depth(max_depth: int = 700) -> tuple[int, int]:
    """(faults, depth): the most page faults taken by ``REPS`` calls that go ``depth`` frames deeper and back."""
    worst = (0, 0)
    for depth in range(max_depth):
        before = _faults()
        for _ in range(REPS):
            _down(depth)
        worst = max(worst, (_faults() - before, depth))
    return worst


def test_call_passes_arguments_and_results_and_raises_what_fn_raises():
    assert stack_room.call(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(KeyError, match="x"):
        stack_room.call({}.__getitem__, "x")


def test_no_chunk_is_mapped_again_and_again_inside_the_room():
    faults, depth = stack_room.call(_worst_depth)
    assert faults < REPS // 2, f"{faults} page faults for {REPS} calls {depth} frames deep inside the room"


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="3.13 and later cache a chunk (gh-142183's fix)")
def test_without_the_room_some_depth_maps_a_chunk_on_every_call():
    """What the room is for, on the interpreters it is for: one depth (where a chunk ends) faults on every call."""
    faults, depth = _worst_depth()
    assert faults >= REPS, f"no depth up to 700 crossed a chunk's end: {faults} faults at {depth}"
