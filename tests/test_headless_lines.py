"""Lines the headless command prints: a parity verdict per run, what a dry run would write."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardscope.cli.headless_run import check_parity


def test_check_parity_says_a_verdict_for_every_run(capsys):
    summary = {"baseline": "ddp", "loss_tolerance": 1e-5, "runs": [
        {"name": "ddp", "status": "ok", "loss_max_abs_diff": 0.0},
        {"name": "fsdp2", "status": "ok", "loss_max_abs_diff": 3e-7},
        {"name": "zero2", "status": "ok", "loss_max_abs_diff": 2e-3},
        {"name": "bf16", "status": "ok", "loss_max_abs_diff": 1e-2, "fairness_flags": ["precision bf16-params"]},
        {"name": "broken", "status": "failed", "loss_max_abs_diff": None}]}
    assert check_parity(summary) == 1
    out, err = capsys.readouterr()
    assert "parity: ddp is the baseline" in out
    assert "parity: fsdp2 ok: max |Δloss| 3.000e-07 <= loss_tolerance 1e-05" in out
    assert "parity: zero2 FAILED: max |Δloss| 2.000e-03 > loss_tolerance 1e-05" in err
    assert "parity: bf16 skipped (not like-for-like: precision bf16-params)" in out
    assert "parity: broken not checked: it ended failed" in out
    summary["runs"] = summary["runs"][:2]
    assert check_parity(summary) == 0


def test_dry_run_says_it_writes_nothing(tmp_path):
    out = tmp_path / "never"
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "run", "--preset", "smoke", "--dry-run", "--out",
                           str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert proc.stdout.startswith("# dry run: nothing is written or launched. preset smoke")
    assert f"a real run would write {out}" in proc.stdout and "# run ddp: would write its spec and launch" in proc.stdout
    assert not out.exists()
    # Each run's settings as it will run them: the comparison's world size and precision, the strategy's defaults.
    settings = json.loads(proc.stdout[proc.stdout.index("{"):proc.stdout.index("\n# run ")])
    for run in settings["runs"]:
        assert run["world_size"] == settings["world_size"] == 2 and run["precision"] == settings["precision"], run
    fsdp2 = next(r for r in settings["runs"] if r["strategy"] == "fsdp2")
    assert "reshard_after_forward" in fsdp2["options"], fsdp2


def _has_gpu() -> bool:
    from shardscope.orchestrator.devices import resolve_device

    return resolve_device("auto") == "cuda"


@pytest.mark.skipif(_has_gpu(), reason="a GPU machine uses the presets' full sizes")
def test_explain_uses_the_sizes_a_run_here_would_use():
    """Without a GPU a preset shrinks through its [cpu_overrides]; explain says so and describes that model."""
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "explain", "fsdp1", "--preset", "ddp-vs-fsdp"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("sizes as a run of ddp-vs-fsdp on this machine uses them (no GPU: the preset's "
                                  "[cpu_overrides] applied)")


@pytest.mark.skipif(_has_gpu(), reason="a GPU machine uses the presets' full sizes")
def test_presets_lists_what_a_run_here_uses():
    """Without a GPU each preset's [cpu_overrides] apply: the model and data column shows what a run here uses."""
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "presets"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    assert "model; data (here, no GPU: its [cpu_overrides] applied)" in proc.stdout, proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.startswith("│ ddp-vs-fsdp"))
    assert "transformer 2×256" in row and "synthetic tokens" in row, row
    assert "qwen2-tiny, 2 layers" in next(line for line in proc.stdout.splitlines() if line.startswith("│ parity"))
