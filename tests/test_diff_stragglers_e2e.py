"""End to end: `shardscope diff`, `run --against` and straggler detection on real torchrun jobs (gloo, CPU).

One stored comparison (one DDP run) and three new ones: the same settings plus a run with a `slow`
rank (2 ranks) and one at 4 ranks; a different lr; a larger batch. Each diff must pass or fail with
the right line and exit code; the slow rank, and only it, must be named.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _pilot import wait_for  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # a module fixture of several runs counts against its first test
CLI = [sys.executable, "-m", "shardscope.cli"]

MODEL = """[model]
vocab_size = 128
d_model = 32
n_layers = 2
n_heads = 4
d_ff = 64
seq_len = 32"""
PRESET = """
description = "diff test"
steps = 10
global_batch = {batch}
lr = {lr}
warmup_steps = 2
world_size = 2
stall_timeout_s = 90
straggler_window = 4
# 5x, not the default 1.5x: a CI run under load flagged the unslowed DDP run's rank 0 at 1.76x (2026-11-26); the
# slowed ranks' 150 ms of extra CPU time a step is over 10x a step of this model (busy_s, test_step_split_...)
straggler_threshold = 5.0
{model}
[profile]
enabled = false
[[runs]]
name = "ddp"
strategy = "ddp"
"""
SLOW_RUNS = """
[[runs]]
name = "slow"
strategy = "ddp"
fault = "rank=1,step=2,kind=slow,ms=150"
[[runs]]
name = "slow4"
strategy = "ddp"
world_size = 4
fault = "rank=2,step=2,kind=slow,ms=150"
"""


def cli(*args, timeout=400):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def run_preset(tmp, name, *args, batch=8, lr=3e-3, extra=""):
    preset = tmp / f"{name}.toml"
    preset.write_text(PRESET.format(batch=batch, lr=lr, model=MODEL) + extra)
    out = tmp / name
    proc = cli("run", "--preset", str(preset), "--headless", "--out", str(out), *args)
    return out, proc


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("diff")
    old, proc = run_preset(tmp, "old")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # --against end to end: identical settings for "ddp" pass; the new-only runs are reported, not errors. Speed is
    # not gated here (--speed-tol 100): the two comparisons run minutes apart, and beside a second test suite on
    # 2 cores the same DDP run measured 0.35x of its first throughput (a CI run, 2026-11-26). Only the slowed run's
    # test gates on speed, where the fault's 150 ms of work a step dwarfs any load
    # (a CI run measured it 0.174x of the old run with a noise band the old rule put at ±93.9%: see test_recommend).
    new, against = run_preset(tmp, "new", "--against", str(old), "--speed-tol", "100", extra=SLOW_RUNS)
    lr, _ = run_preset(tmp, "lr", lr=4e-3)
    big, _ = run_preset(tmp, "big", batch=4096)  # activations well above the CUDA build's RSS noise
    return {"old": old, "new": new, "against": against, "lr": lr, "big": big}


def test_against_passes_and_reports_new_only_runs(dirs):
    proc = dirs["against"]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "slow: only in the new directory, not compared" in proc.stdout
    assert "passed (loss-tol" in proc.stdout


def test_slow_rank_named_and_no_false_flag(dirs):
    summary = json.loads((dirs["new"] / "summary.json").read_text())
    sec = summary["stragglers"]
    assert sec["ddp"]["flagged"] == [] and len(sec["ddp"]["per_rank"]) == 2
    assert [f["rank"] for f in sec["slow"]["flagged"]] == [1]
    assert [f["rank"] for f in sec["slow4"]["flagged"]] == [2]
    flag = sec["slow"]["flagged"][0]
    # flagged from the window that first holds slowed steps (the fault starts at step 2; a window may begin
    # one step earlier on a loaded machine)
    assert flag["from_step"] >= 1 and flag["ratio"] > 1.5 and flag["host"] and flag["device"] == "cpu"
    out = dirs["against"].stdout
    assert "straggler: slow rank 1" in out and "straggler: slow4 rank 2" in out and "straggler: ddp" not in out
    assert "straggler: slow rank 1" in (dirs["new"] / "report.md").read_text()
    assert (dirs["new"] / "plots" / "rank_timing.png").exists()


def test_diff_identical_settings_passes(dirs):
    proc = cli("diff", str(dirs["old"]), str(dirs["new"]), "--speed-tol", "100", "--json")
    assert proc.returncode == 0, proc.stdout[-3000:]
    result = json.loads(proc.stdout)
    (ddp,) = result["runs"]
    assert ddp["loss"]["max_abs_diff"] == 0.0 and ddp["loss"]["steps_compared"] == 10
    assert result["only_new"] == ["slow", "slow4"] and result["only_old"] == []
    assert ddp["communication"]["reason"].startswith("not measured")  # profiler off: no bytes, never 0
    assert (dirs["new"] / "diff" / "diff_loss_ddp.png").exists()


def test_diff_slow_run_fails_on_throughput(dirs):
    proc = cli("diff", str(dirs["old"]), str(dirs["new"]), "--map", "ddp=slow")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "diff: ddp→slow: throughput" in proc.stdout
    assert "loss differs" not in proc.stdout  # the same training, only slower


def test_diff_lr_fails_on_loss(dirs):
    proc = cli("diff", str(dirs["old"]), str(dirs["lr"]), "--speed-tol", "100")
    assert proc.returncode == 1
    assert "diff: ddp: loss differs beyond 0.0001 from step 1" in proc.stdout
    assert "lr" in proc.stdout and "0.004" in proc.stdout  # what differs: the setting, both values


def test_diff_bigger_batch_fails_on_memory(dirs):
    proc = cli("diff", str(dirs["old"]), str(dirs["big"]), "--speed-tol", "100", "--mem-tol", "0.05", "--json")
    result = json.loads(proc.stdout)
    assert proc.returncode == 1
    # named for what it is: the process's RSS on CPU, the allocator's peak on a GPU
    assert any(": process RSS " in line or ": allocator peak " in line for line in result["failures"]), result["failures"]
    assert any(d["key"] == "global_batch" for d in result["runs"][0]["differs"])


def test_diff_bad_input_exits_2(dirs, tmp_path):
    proc = cli("diff", str(dirs["old"]), str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no comparison.json" in proc.stderr
    proc = cli("diff", str(dirs["old"]), str(dirs["new"]), "--map", "ddp=nope")
    assert proc.returncode == 2 and "no run 'nope'" in proc.stderr


def test_app_rank_timing_panel_names_the_straggler(dirs):
    """The app, replaying the comparison: key t shows the selected run's per-rank timing with the slow rank."""
    import asyncio
    import os

    from rich.console import Console

    from shardscope.config import cpu_host
    from shardscope.tui.app import build_app
    from shardscope.tui.widgets.log_pane import LogPane
    from shardscope.tui.widgets.rank_timing import RankTiming, render

    def text(renderable) -> str:
        console = Console(width=70, record=True, file=open(os.devnull, "w"))
        console.print(renderable)
        return console.export_text()

    async def go():
        app = build_app(replay_dir=str(dirs["new"]), host=cpu_host())
        async with app.run_test(size=(160, 48)) as pilot:
            await wait_for(pilot, lambda: app.board.finished is not None and app.screen.query(RankTiming))
            app.screen.select("slow", app.board)
            await pilot.press("t")
            panel = app.screen.query_one(RankTiming)
            await wait_for(pilot, lambda: panel.display and panel.run == "slow")
            assert panel.display and not app.screen.query_one(LogPane).display
            assert panel.run == "slow" and "rank timing · slow" in str(panel.border_title)
            shown = text(render(app.board.states["slow"]))
            await pilot.press("t")  # back to the console
            await wait_for(pilot, lambda: not panel.display and app.screen.query_one(LogPane).display)
            return shown, text(render(app.board.states["ddp"]))

    slow, ddp = asyncio.run(go())
    rows = [line.split() for line in slow.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["0", "1"] and rows[1][1] == "⚠" and rows[0][1] != "⚠", slow
    assert "⚠ straggler: slow rank 1" in slow
    ddp_rows = [line.split() for line in ddp.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in ddp_rows] == ["0", "1"] and all(r[1] != "⚠" for r in ddp_rows), ddp
    assert "straggler:" not in ddp and "idle" in ddp


def test_step_split_against_the_fault_and_the_step_clock(dirs):
    """The per-rank split against independent counts: the `slow` fault does 150 ms of CPU work per step on rank 1 from
    step 2 (its busy time holds it, and rank 0 waits that long off the CPU: idle), and the phases inside the timed
    step add up to the step's own `step_time_s` (perf_counter around the whole step)."""
    import statistics

    from shardscope.core import events

    steps = {}
    for rank in (0, 1):
        records, _ = events.read_records(dirs["new"] / "slow" / "metrics" / f"rank{rank}.jsonl")
        steps[rank] = [r for r in records if r["kind"] == "step" and r["step"] >= 3]
    busy = {rank: statistics.median(r["busy_s"] for r in rs) for rank, rs in steps.items()}
    idle = {rank: statistics.median(r["idle_s"] for r in rs) for rank, rs in steps.items()}
    assert busy[1] >= 0.15 > busy[0], busy
    # Rank 0 waits off the CPU for rank 1's fault. No comparison with rank 1's idle time: a loaded machine
    # descheduling rank 1 inside its fault adds to it without limit.
    assert idle[0] >= 0.10, idle
    gaps = []
    for r in steps[0] + steps[1]:
        inside = r["time_forward_s"] + r["time_backward_s"] + r["time_optimizer_s"]
        assert inside <= r["step_time_s"] + 1e-6, r  # the phases lie inside the step's own clock
        gaps.append(r["step_time_s"] - inside)
    # and fill it but for the clock's own gaps (one preemption there widens a step's, not the median's)
    assert statistics.median(gaps) <= 0.05 * statistics.median(r["step_time_s"] for r in steps[1]) + 0.002, gaps
