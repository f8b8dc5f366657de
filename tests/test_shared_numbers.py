"""One sum, one function: the median throughput, the loss difference at common steps, the byte
formatter and the clip coefficient are computed once (``shardscope/core/numbers.py``,
``engines/global_grad.py``) and every view agrees on the same records."""

from __future__ import annotations

import math

import pytest

from shardscope.core import numbers
from shardscope.config import load_preset
from shardscope.analysis import diff, divergence, summary
from shardscope.profiling import state as st
from shardscope.tui.board import Board
from shardscope.tui.screens.report import live_summary
from shardscope.tui.widgets.charts import loss_diff

# Step 0 pays set-up costs (slow); an even count of later steps, so the median is a mean of two.
RATES = [(0, 5.0), (1, 40.0), (2, 10.0), (3, 30.0), (4, 20.0)]


def _steps(run: str, losses: list[float], rates: list[tuple[int, float]]) -> tuple[dict, ...]:
    return tuple({"v": 1, "kind": "step", "run": run, "rank": 0, "t": 100.0 + s, "step": s, "loss": loss,
                  "tokens": 64, "tokens_per_s": rate} for (s, rate), loss in zip(rates, losses))


def _board(losses: dict[str, list[float]]) -> Board:
    board = Board()
    for name, values in losses.items():
        board.ingest([st.RunDefined(name, "ddp", 2, len(values), "fp32", {}, f"/x/{name}"),
                      st.RecordsArrived(name, _steps(name, values, RATES))])
    return board


def test_median_rate_leaves_out_step_0_and_averages_the_middle_pair():
    assert numbers.median_rate(RATES) == 25.0  # (20 + 30) / 2 over steps 1-4
    assert numbers.median_rate([(0, 7.0)]) == 7.0  # only step 0 timed: it is all there is
    assert numbers.median_rate([]) is None


def test_live_table_and_final_summary_show_the_same_median():
    """The app's report screen used to keep step 0 and take the upper middle (30 here): it must
    show the summary's figure while runs are live."""
    board = _board({"a": [4.0, 3.0, 2.5, 2.0, 1.5]})
    state = board.states["a"]
    final = summary.run_entry(load_preset("smoke"), state, state)["median_tokens_per_s"]
    live = live_summary(board)["runs"][0]["median_tokens_per_s"]
    assert live == final == 25.0
    assert diff.speed_diff(state, state)["old"] == 25.0


def test_loop_end_record_median_equals_the_summary_of_its_step_records(tmp_path):
    """The loop's end record and the summary (folded from the same rank file) agree."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from shardscope.core import events
    from shardscope.engines.api import Prepared, RankContext, TrainSettings
    from shardscope.engines.loop import LoopConfig, train
    from shardscope.engines.optim import optimizer_clip_and_step
    from shardscope.engines.precision import policy_for

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        prep = Prepared(model=model, optimizer=opt, model_state_bytes=lambda: {},
                        clip_and_step=optimizer_clip_and_step(list(model.parameters()), opt))
        ctx = RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo",
                          dp_size=1, dp_rank=0)
        settings = TrainSettings(lr=0.1, weight_decay=0.0, grad_clip=1.0, grad_accum=1, micro_batch_size=2,
                                 steps=6, warmup_steps=0, precision=policy_for("fp32"),
                                 activation_checkpointing=False, compile=False)
        data = torch.randint(0, 16, (2, 5))
        path = tmp_path / "rank0.jsonl"
        writer = events.RecordWriter(path, "r", 0)
        train(prep, ctx, settings, LoopConfig(global_batch=2, tokens_per_sample=4, min_lr_ratio=0.1),
              lambda step: [(data[:, :-1], data[:, 1:])], writer)
        writer.close()
    finally:
        dist.destroy_process_group()
    records, _ = events.read_records(path)
    end = next(r for r in records if r["kind"] == "end")
    states: dict[str, st.RunState] = {}
    st.fold([st.RunDefined("r", "ddp", 1, 6, "fp32", {}, str(tmp_path)), st.RecordsArrived("r", tuple(records))],
            states)
    rate = summary.run_entry(load_preset("smoke"), states["r"], states["r"])["median_tokens_per_s"]
    assert len(states["r"].throughput) == 6 and rate is not None
    assert end["median_tokens_per_s"] == pytest.approx(rate, rel=1e-9)


def test_loss_difference_at_common_steps_is_one_rule_everywhere():
    nan, inf = math.nan, math.inf
    run = [(0, 2.0), (1, 1.5), (2, nan), (3, inf), (5, 1.0)]
    base = [(0, 2.0), (1, 1.25), (2, 1.0), (3, inf), (4, 0.5)]
    assert [s for s, _, _ in numbers.common_steps(run, base)] == [0, 1, 2, 3]
    assert numbers.loss_differences(run, base) == [(0, 0.0), (1, 0.25), (2, inf), (3, inf)]
    board = _board({"a": [2.0, 1.5, 1.0, 1.0, 1.0], "b": [2.0, 1.25, nan, 1.0, 1.0]})
    a, b = board.states["a"], board.states["b"]
    max_diff, mean_diff, common = summary.loss_diffs(b, a)
    assert (max_diff, common) == (inf, 5) and mean_diff == inf  # a NaN is never "equal"
    assert summary.loss_stats(b, a)["loss_final_abs_diff"] == 0.0
    assert divergence.first_loss_divergence(a.losses, b.losses, 0.1) == {
        "step": 1, "loss": 1.25, "baseline_loss": 1.5, "abs_diff": 0.25}
    chart = loss_diff(b, a)  # signed for the chart, at the same steps
    assert [s for s, _ in chart] == [0, 1, 2, 3, 4] and chart[1] == (1, -0.25) and math.isnan(chart[2][1])
    assert diff.loss_diff(a.losses, b.losses, tol=0.1)["steps_compared"] == 5


def test_one_byte_formatter():
    assert numbers.fmt_bytes(None) == "-" and numbers.fmt_bytes(512) == "512 B"
    assert numbers.fmt_bytes(1536 * 2**20) == "1.5 GiB" and numbers.fmt_bytes(3 * 2**40) == "3.0 TiB"
    assert numbers.fmt_bytes(2**50) == "1024.0 TiB"
    assert numbers.fmt_bytes(1.5021 * 2**20, sig=4) == "1.502 MiB"
    assert numbers.fmt_bytes(None, missing="?") == "?"
    from shardscope.profiling import estimate, phases
    from shardscope.tui import format as tui_format
    import shardscope.cli.headless as headless

    assert estimate.fmt_bytes is headless.fmt_bytes is tui_format.human_bytes is numbers.fmt_bytes
    assert phases._bytes(1.5021 * 2**20) == "1.502 MiB" and phases._bytes(None) == "?"


def test_clip_coefficient_matches_torch():
    torch = pytest.importorskip("torch")
    from shardscope.engines.global_grad import clip_coefficient, full_value

    grads = [torch.tensor([3.0, 0.0]), torch.tensor([4.0])]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, max_norm=2.0)
    coef = clip_coefficient(2.0, torch.tensor(5.0))
    assert torch.equal(grads[0] * coef, params[0].grad) and torch.equal(grads[1] * coef, params[1].grad)
    assert clip_coefficient(2.0, 5.0) == pytest.approx(2.0 / (5.0 + 1e-6))
    assert clip_coefficient(10.0, 5.0) == 1.0 and float(clip_coefficient(10.0, torch.tensor(5.0))) == 1.0
    plain = torch.ones(2)
    assert full_value(plain) is plain  # a plain tensor is already whole


def test_the_live_median_kept_sorted_is_the_summarys_median_at_every_point():
    """``RunState.median`` merges only the rates appended since its last call into rates it keeps sorted; at every
    call it equals ``numbers.median_rate`` of all points (step 0 left out unless alone, repeated steps counted, an odd
    and an even count), also after the list is replaced by a shorter one."""
    import random

    from shardscope.core.numbers import median_rate

    rng = random.Random(7)
    state = st.RunState(name="r")
    assert state.median is None
    state.throughput.append((0, 5.0))
    assert state.median == 5.0  # step 0 alone
    for step in range(1, 300):
        for _ in range(rng.choice((0, 1, 1, 3))):  # some calls see no new point, some several (a restart repeats)
            state.throughput.append((rng.choice((step, step - 1)), rng.uniform(1e3, 2e3)))
        assert state.median == median_rate(state.throughput), step
    state.throughput = [(0, 9.0), (1, 4.0), (2, 6.0)]
    assert state.median == 5.0 == median_rate(state.throughput)
    state.throughput = [(s, float(s)) for s in range(1000)]
    assert state.median == 500.0 == median_rate(state.throughput)
