"""Each rank's compute per profiled step from its trace (its operators, or on a GPU its non-NCCL kernels,
minus its waits in collectives): on a GPU the straggler signal. A real 2-rank DDP comparison (gloo, CPU):
`slow` (rank 1 does 60 ms of matrix products per step from step 1) and `ddp` (no fault), both profiled over
steps 3-4."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_diff_stragglers_e2e import MODEL  # noqa: E402

from _pilot import wait_for  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # a module fixture of several runs counts against its first test
CLI = [sys.executable, "-m", "shardscope.cli"]

PRESET = """
description = "stragglers from traces"
steps = 6
global_batch = 8
lr = 3e-3
warmup_steps = 1
world_size = 2
stall_timeout_s = 120
straggler_window = 3
""" + MODEL + """
[profile]
enabled = true
start_step = 3
steps = 2
[[runs]]
name = "ddp"
strategy = "ddp"
[[runs]]
name = "slow"
strategy = "ddp"
fault = "rank=1,step=1,kind=slow,ms=60"
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("traced")
    (tmp / "p.toml").write_text(PRESET)
    out = tmp / "out"
    proc = subprocess.run([*CLI, "run", "--preset", str(tmp / "p.toml"), "--headless", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


def _fault_products(path):
    """(count, seconds) of the ``slow`` fault's matrix products (aten::mm of two 256x256 inputs; the test
    model has no such product) in one rank's trace."""
    events = json.loads(path.read_text())["traceEvents"]
    mm = [e for e in events if e.get("ph") == "X" and e.get("name") == "aten::mm"
          and e.get("args", {}).get("Input Dims", [])[:2] == [[256, 256], [256, 256]]]
    return len(mm), sum(e["dur"] for e in mm) / 1e6


def test_each_ranks_trace_compute_holds_the_slow_ranks_extra_work(run):
    """The fault adds 60 ms of matrix products per step to rank 1 alone (an independent count): they are in
    rank 1's trace alone, and its trace compute holds them. CPU traces are not judged (a descheduled operator's wall time
    would read as compute: the live busy time judges CPU runs) and the report says so."""
    out, proc = run
    summary = json.loads((out / "summary.json").read_text())
    slow = summary["stragglers"]["slow"]["trace"]
    ddp = summary["stragglers"]["ddp"]["trace"]
    assert slow["steps"] == 2 and slow["source"] == "cpu-operators" and slow["flagged"] == [], slow
    # 60 ms of CPU time in operators: a floor for their wall time (descheduling only adds), on rank 1 alone.
    assert slow["compute_s"]["1"] >= 0.060, slow
    # Rank 1's extra work, counted in the trace files themselves (not a timing): the fault's 256x256 products
    # are there on rank 1 of `slow` alone, and rank 1's compute per step holds at least their time. No bound
    # between ranks' or runs' wall times: a loaded machine stretches any of them without limit.
    fault = {(name, rank): _fault_products(out / name / "traces" / f"rank{rank}.trace.json")
             for name in ("ddp", "slow") for rank in (0, 1)}
    assert {key: count for key, (count, _) in fault.items() if count}.keys() == {("slow", 1)}, fault
    count, seconds = fault[("slow", 1)]
    assert count >= 2 and slow["compute_s"]["1"] >= seconds / slow["steps"] * 0.999, (fault, slow)
    report = (out / "report.md").read_text()
    assert "From the traces (2 profiled steps), compute per step" in report and "Not judged from CPU traces" in report


def test_app_card_names_a_straggler_found_in_gpu_traces(run):
    """The app replaying the comparison analyses each run's traces (CPU: figures, no trace flag). A GPU trace
    analysis arriving for `ddp` (rank 1's kernels 3x its peer's) puts the straggler on the run's card, marked
    "(trace)"; `slow`'s card keeps its live flag only."""
    import asyncio

    from shardscope.config import cpu_host
    from shardscope.tui.app import build_app
    from shardscope.tui.messages import CommAnalysed
    from shardscope.tui.widgets.run_card import RunCard

    out, _ = run

    async def go():
        app = build_app(replay_dir=str(out), host=cpu_host())
        async with app.run_test(size=(160, 48)) as pilot:
            # Every analysis the replay asked for has landed (a run's traces are analysed as they arrive and
            # again when it ends: one still running would replace the analysis posted below).
            await wait_for(pilot, lambda: app.board.finished is not None and {"ddp", "slow"} <= set(app.board.analyses)
                           and len(app.screen.query(RunCard)) == 3  # ddp, slow and the A/A control (ddp again)
                           and all(w.is_finished for w in app.workers if w.group == "comm")
                           and app.board.analysis_applied == app.board.analysis_seq)
            cards = {card.run: card for card in app.screen.query(RunCard)}
            before = {name: str(card.border_subtitle) for name, card in cards.items()}
            app.post_message(CommAnalysed("ddp", {"steps_profiled": 2, "compute_source": "gpu-kernels",
                                                  "per_rank_compute_s": {"0": 0.004, "1": 0.012}}))
            await wait_for(pilot, lambda: "(trace)" in str(cards["ddp"].border_subtitle))
            return before, {name: str(card.border_subtitle) for name, card in cards.items()}

    before, after = asyncio.run(go())
    # CPU traces are not judged (the live busy flag of this short run may name a rank on a busy machine)
    assert "(trace)" not in before["ddp"] and "(trace)" not in before["slow"], before
    assert "straggler rank 1" in after["ddp"] and "rank 1 vm cpu (trace)" in after["ddp"], after
