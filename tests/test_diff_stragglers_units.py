"""Unit tests of the pure parts: loss comparison (NaN is a difference), noise band, straggler watch."""

from __future__ import annotations

import math

from shardscope.profiling import diff
from shardscope.profiling.stragglers import StragglerWatch


def test_loss_diff_counts_nan_and_inf_as_differences():
    old = [(0, 5.0), (1, 4.0), (2, 3.0), (3, float("inf"))]
    new = [(0, 5.0), (1, float("nan")), (2, 3.5), (3, float("inf")), (4, 1.0)]
    d = diff.loss_diff(old, new, tol=1e-3)
    assert d["steps_compared"] == 4
    assert d["nonfinite_steps"] == [1]  # the same infinity on both sides is not a difference
    assert d["first_beyond"]["step"] == 1 and math.isinf(d["first_beyond"]["abs_diff"])
    assert d["max_abs_diff"] == 0.5 and d["mean_abs_diff"] == 0.25  # over the finite steps 0 and 2


def test_loss_diff_within_tolerance_and_no_common_step():
    assert diff.loss_diff([(0, 1.0)], [(0, 1.0 + 1e-6)], tol=1e-5)["first_beyond"] is None
    assert diff.loss_diff([(0, 1.0)], [(1, 1.0)], tol=1e-5)["max_abs_diff"] is None


def test_relative_spread_is_half_iqr_over_median():
    assert diff.relative_spread([1.0, 2.0, 3.0]) is None  # too few steps to say
    rates = [90.0, 95.0, 100.0, 105.0, 110.0]
    q1, _, q3 = __import__("statistics").quantiles(rates, n=4)
    assert diff.relative_spread(rates) == (q3 - q1) / 2 / 100.0


def test_parse_map_rejects_malformed():
    assert diff.parse_map(["a=b"]) == [("a", "b")]
    for bad in ("a", "=b", "a="):
        try:
            diff.parse_map([bad])
        except diff.DiffInputError as err:
            assert "OLD_RUN=NEW_RUN" in str(err)
        else:
            raise AssertionError(bad)


def _feed(watch, busy_by_rank, steps, order=None):
    world = len(busy_by_rank)
    for step in steps:
        for rank in order or range(world):
            watch.add(rank, step, {"busy_s": busy_by_rank[rank](step), "time_forward_s": 0.01}, world)


def test_watch_flags_the_slow_rank_after_the_window():
    watch = StragglerWatch(threshold=1.5, window=3)
    busy = [lambda s: 0.01, lambda s: 0.01, lambda s: 0.05 if s >= 4 else 0.01, lambda s: 0.011]
    _feed(watch, busy, range(6))
    assert watch.flagged == {}  # steps 4 and 5: a streak of 2 < window
    _feed(watch, busy, range(6, 9), order=[3, 2, 1, 0])  # arrival order across ranks does not matter
    assert list(watch.flagged) == [2]
    s = watch.flagged[2]
    assert s.from_step == 4 and s.steps == 5 and abs(s.ratio - 0.05 / 0.01) < 1e-9
    assert watch.per_rank()[2]["busy_s"] == 0.05 and watch.per_rank()[0]["time_forward_s"] == 0.01


def test_watch_no_flag_for_noise_below_threshold_or_broken_streaks():
    watch = StragglerWatch(threshold=1.5, window=3)
    busy = [lambda s: 0.01, lambda s: 0.03 if s % 3 == 0 else 0.012]  # spikes never 3 steps in a row
    _feed(watch, busy, range(30))
    assert watch.flagged == {}


def test_watch_ignores_step_zero_and_records_without_busy_time():
    watch = StragglerWatch(threshold=1.5, window=1)
    _feed(watch, [lambda s: 0.01, lambda s: 1.0], [0])
    assert watch.flagged == {}
    watch.add(0, 1, {"time_forward_s": 0.1}, 2)  # a GPU record: no busy time, nothing to judge
    assert 1 not in watch.timing.get(0, {})
    watch.configure({"threshold": 2.0, "window": 4})
    assert (watch.threshold, watch.window) == (2.0, 4)
    watch.configure({"threshold": -1, "window": "x"})
    assert (watch.threshold, watch.window) == (2.0, 4)
