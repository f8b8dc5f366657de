"""The run's loss is the mean of its ranks' local losses, folded without a collective in the ranks."""

from __future__ import annotations

import math

from shardscope.profiling.loss_fold import LossMean
from shardscope.profiling.state import RunDefined, RunState


def _step(rank, step, **fields):
    return {"kind": "step", "rank": rank, "step": step, "grad_norm": 1.0, "lr": 1e-3, "step_time_s": 0.1, **fields}


def _state(world=2):
    st = RunState(name="r")
    st.apply(RunDefined(run="r", strategy="ddp", world_size=world, steps_total=10, precision="fp32",
                        options={}, run_dir=""))
    return st


def test_a_step_completes_when_every_rank_reported_it():
    m = LossMean()
    assert m.add(0, 0, {"local_loss": 2.0}, 2) is None
    assert m.waiting == 1
    assert m.add(1, 0, {"local_loss": 4.0}, 2) == 3.0
    assert m.waiting == 0


def test_ranks_out_of_step_and_a_global_loss_record():
    m = LossMean()
    assert m.add(1, 0, {"local_loss": 1.0}, 2) is None
    assert m.add(1, 1, {"local_loss": 3.0}, 2) is None  # rank 1 runs ahead
    assert m.add(0, 0, {"local_loss": 2.0}, 2) == 1.5
    assert m.add(0, 1, {"local_loss": 5.0}, 2) == 4.0
    # A step whose loss every rank reduced: rank 0's global value is taken, the others' are ignored.
    assert m.add(1, 2, {"local_loss": 9.0, "loss": 7.0}, 2) is None
    assert m.add(0, 2, {"local_loss": 5.0, "loss": 7.0}, 2) == 7.0
    assert m.waiting == 0


def test_a_non_finite_local_loss_makes_the_mean_non_finite():
    m = LossMean()
    m.add(0, 0, {"local_loss": 2.0}, 2)
    assert math.isinf(m.add(1, 0, {"local_loss": math.inf}, 2))
    m.add(0, 1, {"local_loss": math.nan}, 2)
    assert math.isnan(m.add(1, 1, {"local_loss": 1.0}, 2))


def test_fold_shows_the_mean_and_marks_divergence_at_the_right_step():
    st = _state(world=4)
    for rank, loss in enumerate((1.0, 2.0, 3.0, 6.0)):
        st.apply_record(_step(rank, 0, local_loss=loss))
    assert st.losses == [(0, 3.0)] and st.loss == 3.0
    # Rank 0 reports step 1 first: progress moves on, the loss waits for the other ranks.
    st.apply_record(_step(0, 1, local_loss=1.0))
    assert st.steps_completed == 2 and st.losses == [(0, 3.0)]
    for rank in (1, 2):
        st.apply_record(_step(rank, 1, local_loss=1.0))
    st.apply_record(_step(3, 1, local_loss=math.inf))
    assert st.first_nonfinite_step == 1 and st.nonfinite_what == "loss"
    assert math.isinf(st.losses[-1][1])


def test_fold_names_loss_and_norm_together_and_keeps_the_earliest_step():
    st = _state()
    st.apply_record(_step(0, 0, local_loss=2.0))
    st.apply_record(_step(0, 1, local_loss=2.0, grad_norm=math.nan))  # the norm is known from rank 0 at once
    assert st.first_nonfinite_step == 1 and st.nonfinite_what == "grad_norm"
    st.apply_record(_step(1, 0, local_loss=math.nan))  # step 0's mean completes later and is earlier
    assert st.first_nonfinite_step == 0 and st.nonfinite_what == "loss"
    st.apply_record(_step(1, 1, local_loss=math.nan))
    assert st.first_nonfinite_step == 0  # step 1 is later: the first stays
    assert [s for s, _ in st.losses] == [0, 1]


def test_a_step_a_rank_never_reported_has_no_loss():
    st = _state()
    st.apply_record(_step(0, 0, local_loss=2.0))
    st.apply_record(_step(1, 0, local_loss=2.0))
    st.apply_record(_step(0, 1, local_loss=1.0))  # rank 1 died before step 1
    assert st.losses == [(0, 2.0)] and st.steps_completed == 2


def test_fp16_skipped_step_uses_the_reduced_loss_and_is_no_divergence():
    st = _state()
    for rank in (0, 1):
        st.apply_record(_step(rank, 0, local_loss=3.0 + rank, loss=3.5, grad_norm=math.inf, skipped=True))
    assert st.losses == [(0, 3.5)] and st.first_nonfinite_step is None
