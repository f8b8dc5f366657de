"""The global batch follows the world size when the user changes only the world size; an explicit
global_batch is kept and validated as before. Pure config: no torch, no launch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardscope import config
from shardscope.config import ConfigError
from shardscope.profiling import estimate


def _micro(c: config.Comparison, run: config.RunSpec) -> int:
    """Sequences per micro-batch on each data-parallel rank: global_batch / (dp x grad_accum), dp = world / (tp x pp)."""
    dp = config.resolved_world_size(c, run) // config.registry.get(run.strategy).model_parallel(config.resolved_options(run))
    assert c.global_batch % (dp * c.grad_accum) == 0
    return c.global_batch // (dp * c.grad_accum)


@pytest.mark.parametrize("preset", [n for n, _ in config.list_presets()])
@pytest.mark.parametrize("ws", [4, 8, 64])
def test_world_size_alone_keeps_every_following_runs_micro_batch(preset, ws):
    base = config.load_preset(preset)
    c = config.load_preset(preset, [f"world_size={ws}"])
    assert c.global_batch == base.global_batch * ws // base.world_size
    for run, base_run in zip(c.runs, base.runs):
        if not run.world_size:  # runs that follow the comparison's world size
            assert _micro(c, run) == _micro(base, base_run), run.name
    if ws == base.world_size:  # the preset's own world size (pipeline: 4): nothing to follow
        assert c.adjustments == []
    else:
        assert len(c.adjustments) == 1 and f"-> {c.global_batch}" in c.adjustments[0]


def test_explicit_global_batch_is_kept_and_validated():
    with pytest.raises(ConfigError, match=r"--set global_batch=8: must be divisible by dp \(64\)"):
        config.load_preset("ddp-vs-fsdp", ["world_size=64", "global_batch=8"])
    c = config.load_preset("ddp-vs-fsdp", ["world_size=4", "global_batch=8"])
    assert c.global_batch == 8 and c.adjustments == []


def test_nothing_changes_without_a_new_world_size():
    for overrides in ([], ["steps=3"], ["world_size=2"]):
        c = config.load_preset("smoke", overrides)
        assert c.global_batch == 8 and c.adjustments == []


def test_runs_with_their_own_world_size_are_named():
    c = config.load_preset("tp-verification", ["world_size=8"])
    assert "autotp" in c.adjustments[0] and "fsdp2-tp" in c.adjustments[0]


def test_estimate_at_64_predicts_the_presets_micro_batch():
    c = config.load_preset("ddp-vs-fsdp", ["world_size=64"])
    rows = estimate.estimate_table(c, 64)
    assert {r["micro_batch"] for r in rows} == {4} and not any(r["note"] for r in rows)


@pytest.mark.parametrize("args", [
    ["estimate", "--preset", "ddp-vs-fsdp", "--world-size", "64"],
    ["slurm", "--preset", "ddp-vs-fsdp", "--nodes", "2", "--gpus-per-node", "8"],
    ["run", "--preset", "smoke", "--dry-run", "--set", "world_size=4"],
])
def test_cli_says_the_global_batch_followed(args):
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "shardscope: note: global_batch 8 -> " in proc.stdout + proc.stderr


def test_estimate_says_it_uses_the_full_sizes():
    """A preset with [cpu_overrides] is estimated at its full sizes, and the command says so; smoke has none."""
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "estimate", "--preset", "ddp-vs-fsdp",
                           "--world-size", "8"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "sizes: ddp-vs-fsdp's full sizes (its [cpu_overrides] shrink only runs" in proc.stdout
    assert "91,877,376 parameters" in proc.stdout  # 768 wide, 6 layers, 32k vocab: not the shrunk model
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "estimate", "--preset", "smoke",
                           "--world-size", "8"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "full sizes" not in proc.stdout, proc.stdout
