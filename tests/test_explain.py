"""Strategy explainers: one per registered strategy, filled with the memory model's and summary.json's numbers."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardscope import config
from shardscope.core import registry
from shardscope.profiling import comm_theory, memory_model
from shardscope.analysis import explain

HERE = Path(__file__).parent
SNAPSHOT = HERE / "data" / "explain-fsdp1-ddp-vs-fsdp.md"
SECTIONS = ("## What it shards", "## What it communicates", "## Memory per rank", "## When to use it", "## Options")


@pytest.mark.parametrize("name", registry.names())
def test_every_registered_strategy_has_an_explainer_naming_its_options(name):
    text = explain.load_text(name)
    for heading in SECTIONS:
        assert heading in text, f"{name}: explainer lacks {heading!r}"
    for option in registry.get(name).options:
        assert f"`{option}`" in text, f"{name}: explainer does not explain option {option!r}"
    for placeholder in ("$memory", "$comm", "$options"):
        assert placeholder in text


def test_a_strategy_without_an_explainer_fails(monkeypatch):
    info = registry.StrategyInfo(name="no-text", entry="shardscope.engines.optim:apply", description="test")
    monkeypatch.setitem(registry.STRATEGIES, "no-text", info)
    with pytest.raises(explain.ExplainError, match="has no explainer"):
        explain.load_text("no-text")


def test_an_unknown_placeholder_is_refused(tmp_path, monkeypatch):
    bad = tmp_path / "x.md"
    bad.write_text("$memory $nonsense")
    monkeypatch.setattr(explain, "explainer_path", lambda info: str(bad))
    with pytest.raises(explain.ExplainError, match="nonsense"):
        explain.load_text("ddp")


@pytest.mark.parametrize("name", registry.names())
def test_preset_figures_are_the_memory_models(name):
    c = config.load_preset("ddp-vs-fsdp")
    out = explain.explain_preset(c, name)
    run, _ = explain.pick_run(c, name)
    predicted = memory_model.predict_run(c, run)["model_state_bytes"]
    assert out["numbers"]["model_state_bytes_predicted"] == predicted
    assert f"{explain.in_unit([predicted])[0]} predicted" in out["text"]
    assert "$" not in out["text"]
    theory = comm_theory.expected_comm(config.run_spec_payload(c, run, out_dir=".", device="cpu"))
    assert out["numbers"]["comm_bytes_predicted"] == theory["bytes_per_step"]
    # The formula's terms, sharded as the layout says, add up to the memory model's figure (to the
    # per-tensor step counters and padding the model counts exactly).
    full, dp, shards = out["numbers"]["full"], out["numbers"]["dp"], out["numbers"]["shards"]
    sharded = {"none": (), "optim": ("optim_bytes",), "grads": ("grad_bytes", "optim_bytes"),
               "all": ("param_bytes", "grad_bytes", "optim_bytes")}[shards]
    formula = sum(full[k] / (dp if k in sharded else 1) for k in ("param_bytes", "grad_bytes", "optim_bytes"))
    if name != "deepspeed-zero2":  # ZeRO-2 holds whole gradients of the tensors its partition touches
        assert formula == pytest.approx(predicted, rel=2e-3)


def test_snapshot_of_fsdp1_on_ddp_vs_fsdp():
    text = explain.explain_preset(config.load_preset("ddp-vs-fsdp"), "fsdp1")["text"]
    if os.environ.get("SHARDSCOPE_UPDATE_SNAPSHOTS"):
        SNAPSHOT.write_text(text, encoding="utf-8")
    assert text == SNAPSHOT.read_text(encoding="utf-8")
    # The one line the issue names: the formula evaluated with the preset's numbers.
    assert "(350.5 + 350.5 + 701 MiB) / 2 = **701 MiB predicted**" in text


@pytest.fixture(scope="module")
def reported_dir(tmp_path_factory):
    """The recorded replay fixture with its reports written (summary.json with memory figures)."""
    out = tmp_path_factory.mktemp("explain") / "run"
    shutil.copytree(HERE / "data" / "replay-smoke", out)
    from shardscope.analysis.report import write_reports

    write_reports(str(out))
    return out


def test_numbers_of_a_run_directory_equal_its_summary(reported_dir):
    from shardscope.cli.explainview import explain_dir

    summary = json.loads((reported_dir / "summary.json").read_text())
    for name in ("ddp", "fsdp2"):
        out = explain_dir(str(reported_dir), None, name)
        mem = summary["memory"]["runs"][name]
        assert out["numbers"]["model_state_bytes_predicted"] == mem["predicted"]["model_state_bytes"]
        assert out["numbers"]["model_state_bytes_measured"] == mem["measured"]["model_state_bytes"]
        pred, meas = explain.in_unit([mem["predicted"]["model_state_bytes"], mem["measured"]["model_state_bytes"]],
                                     unit_on_all=True)
        assert f"**{pred} predicted**, **{meas} measured**" in out["text"]
        # The fixture's traces are not in the profiler's format: said, not zero.
        assert "not measured (no trace" in out["text"]


def test_measured_collectives_come_from_the_summary():
    c = config.load_preset("smoke")
    run = c.runs[1]
    comm = {"theory": {"bytes_per_step": 3 * 2**20, "by_type": {"all_gather": 2 * 2**20, "reduce_scatter": 2**20}},
            "collectives": {"all_gather": {"bytes_per_step": 2.5 * 2**20, "count_per_step": 6.0}}}
    out = explain.figures(c, run, "test", memory={}, comm=comm)
    lines = out["values"]["comm"]
    assert "all-gather per step: 2 MiB predicted, 2.5 MiB measured in 6 call(s)" in lines
    assert "reduce-scatter per step: 1 MiB predicted, none measured" in lines
    assert "not measured (summary.json has no memory record of this run" in out["values"]["memory"]


def test_cli_explain_prints_every_strategy_and_refuses_bad_input(reported_dir):
    for name in registry.names():
        proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "explain", name, "--preset", "ddp-vs-fsdp"],
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
        assert "Memory per rank" in proc.stdout and "predicted" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "explain", "fsdp2", str(reported_dir)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and "measured" in proc.stdout, proc.stderr
    bad = subprocess.run([sys.executable, "-m", "shardscope.cli", "explain", "fsdp3"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and re.search(r"allowed: .*fsdp2", bad.stderr) and "Traceback" not in bad.stderr
