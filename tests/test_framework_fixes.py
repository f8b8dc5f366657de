"""Frameworks are measured as they ship: fixes shardscope applies are options that default off, and
when one is on the report states the memory model's figure with it and without it. No launch
here; the real runs behind both figures are in test_deepspeed_zero.py (0.625x and 0.5x DDP)."""

from __future__ import annotations

import pytest

from shardscope import config
from shardscope.config import RunSpec
from shardscope.core import registry
from shardscope.profiling import framework_fixes, memory_model
from shardscope.analysis import markdown, report


def _comparison(*runs: RunSpec) -> config.Comparison:
    c = config.Comparison(name="t", runs=list(runs), world_size=2, global_batch=8,
                          model=config.ModelSpec(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=256,
                                                 seq_len=32))
    c = config.validate(c)
    return c


def test_every_framework_fix_defaults_off():
    fixes = [(name, key) for name in registry.names() for key, spec in registry.get(name).options.items()
             if spec.framework_fix]
    assert ("deepspeed-zero3", "reuse_fp32_partitions") in fixes
    for name, key in fixes:
        assert registry.get(name).options[key].default is False, (name, key)
    assert framework_fixes.fixes_on(RunSpec("z3", "deepspeed-zero3")) == []


def test_zero3_fp32_as_shipped_keeps_a_master_copy_and_the_fix_does_not():
    """Per parameter at dp 2, fp32: as shipped (4 + 4 + 4·3)/2 = 10 bytes; with the fix (4 + 4 + 4·2)/2 = 8."""
    c = _comparison(RunSpec("z3", "deepspeed-zero3"), RunSpec("fix", "deepspeed-zero3",
                                                              options={"reuse_fp32_partitions": True}))
    shipped, fixed = (memory_model.predict_run(c, r) for r in c.runs)
    n = shipped["param_count"]
    assert shipped["optim_bytes"] - fixed["optim_bytes"] == pytest.approx(4 * n / 2, rel=0.01)
    assert framework_fixes.as_shipped(c, c.runs[0]) is None
    both = framework_fixes.as_shipped(c, c.runs[1])
    assert both["fixes"] == ["reuse_fp32_partitions"]
    assert both["predicted"]["model_state_bytes"] == shipped["model_state_bytes"]


def test_report_states_both_figures_when_the_fix_is_on():
    c = _comparison(RunSpec("z3", "deepspeed-zero3"), RunSpec("fix", "deepspeed-zero3",
                                                              options={"reuse_fp32_partitions": True}))
    section = {"runs": {}}
    for run in c.runs:
        predicted = memory_model.predict_run(c, run)
        section["runs"][run.name] = {"predicted": predicted, "measured": None, "per_rank": {},
                                     "model_state_error": None,
                                     "as_shipped": framework_fixes.as_shipped(c, run)}
    text = markdown._memory_md(section)
    lines = [ln for ln in text.splitlines() if "reuse_fp32_partitions" in ln]
    assert len(lines) == 1 and lines[0].startswith("- fix:")
    with_fix = memory_model.predict_run(c, c.runs[1])["model_state_bytes"]
    without = memory_model.predict_run(c, c.runs[0])["model_state_bytes"]
    assert f"({with_fix / without:.3f}x)" in lines[0] and with_fix < without
