"""End to end: DDP vs FSDP2 (reshard after forward on and off) under real torchrun, gloo, 2 CPU ranks.

Checks fp32 parity (loss and global grad norm within 1e-5 of DDP every step, step 0 identical),
per-layer norms in parity mode, FSDP2's local model-state bytes (<= 0.55x DDP at world size 2),
and the profiler window's trace files and records.
"""

from __future__ import annotations

import json

import pytest

from _launch import assert_matches, grad_norms, launch_all, max_abs_diff, tiny_comparison
from shardscope.analysis.fold import replay_states
from shardscope.config import ProfileSpec, RunSpec

pytestmark = pytest.mark.slow
TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = [
        RunSpec("ddp", "ddp"),
        RunSpec("fsdp2", "fsdp2", options={"reshard_after_forward": True}),
        RunSpec("fsdp2-keep", "fsdp2", options={"reshard_after_forward": False}),
        RunSpec("ddp1", "ddp", world_size=1),  # one rank, the whole global batch: the independent loss
    ]
    comparison = tiny_comparison(runs, steps=8, parity=True, profile=ProfileSpec(enabled=True, start_step=3, steps=2))
    return launch_all(tmp_path_factory.mktemp("fsdp2"), comparison)


@pytest.mark.parametrize("name", ["fsdp2", "fsdp2-keep"])
def test_fsdp2_matches_ddp(results, name):
    other = results[name]
    print(other.run_dir.name, assert_matches(results["ddp"], other, TOL, layers=True))
    assert other.losses()[-1] < other.losses()[0]  # it trains


def test_run_loss_is_the_mean_of_the_ranks_local_losses(results):
    """No collective for the loss: each rank records its own; the fold's mean is the global loss, checked
    against one rank training on the whole global batch (same samples, same weights)."""
    single = results["ddp1"].losses()
    for name in ("ddp", "fsdp2", "fsdp2-keep"):
        result = results[name]
        assert result.local_losses(0) != result.local_losses(1)  # different samples: different local losses
        assert grad_norms(result, 0) == grad_norms(result, 1)  # the norm is global on every rank
        assert "loss" not in result.steps(0)[0]  # no reduced loss on a normal step
        assert max_abs_diff(result.losses(), single) <= TOL, name
        states = replay_states(result.run_dir.parent)  # what every view shows: the fold of the records
        assert [loss for _, loss in states[name].losses] == result.losses()


def test_fsdp2_holds_about_half_the_model_state(results):
    ddp = results["ddp"].of_kind("memory")[0]
    for name in ("fsdp2", "fsdp2-keep"):
        mem = results[name].of_kind("memory")[0]
        assert mem["when"] == "after_first_step"
        assert mem["model_state_bytes"] == mem["param_bytes"] + mem["grad_bytes"] + mem["optim_bytes"]
        print(name, "model_state_bytes / ddp =", mem["model_state_bytes"] / ddp["model_state_bytes"])
        assert mem["model_state_bytes"] <= 0.55 * ddp["model_state_bytes"]
    # DDP in fp32 with AdamW: 4 (param) + 4 (grad) + 8 (moments) bytes per parameter, plus step counters.
    params = results["ddp"].of_kind("start")[0]["params"]
    assert ddp["param_bytes"] == ddp["grad_bytes"] == 4 * params
    assert 8 * params <= ddp["optim_bytes"] <= 8 * params + 4 * 64


def test_records_and_profiler_window(results):
    result = results["fsdp2"]
    start = result.of_kind("start")[0]
    assert start["world_size"] == 2 and start["backend"] == "gloo" and start["precision"]["policy"] == "fp32"
    steps = result.steps()
    assert [s["step"] for s in steps] == list(range(8))
    # Window = steps 3 and 4, plus the profiler's warm-up step 2: all kept out of throughput.
    assert [s.get("profiled", False) for s in steps] == [False] * 2 + [True] * 3 + [False] * 3
    assert all(s["tokens"] == 4 * 16 and s["tokens_per_s"] > 0 and s["mem_peak_bytes"] > 0 for s in steps)
    for rank in (0, 1):
        traces = result.of_kind("trace", rank)
        assert {t["format"] for t in traces} == {"chrome", "tensorboard"}
        for trace in traces:
            assert trace["steps"] == [3, 4]
            events = json.loads((result.run_dir / trace["path"]).read_text())["traceEvents"]
            markers = sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))
            assert markers == ["ProfilerStep#3", "ProfilerStep#4"]
    assert (result.run_dir / "traces" / "rank1.trace.json").is_file()
    end = result.of_kind("end")[0]
    assert end["status"] == "ok" and end["steps_completed"] == 8
