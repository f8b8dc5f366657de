"""A run's description (``profiling/run_description``, issue 48): built once and read by the memory model, the
communication theory and ``predict``'s work with the figures they computed on their own; FSDP2's ``unit_blocks``
regroups the units there, and every consumer follows."""

from __future__ import annotations

import pytest

from shardscope import config
from shardscope.analysis.predict.work import work_of
from shardscope.config import ModelSpec, RunSpec
from shardscope.profiling import comm_theory, memory_model
from shardscope.profiling.run_description import describe_model, describe_run

MODEL = ModelSpec(vocab_size=128, d_model=32, n_layers=4, n_heads=4, d_ff=64, seq_len=16)


def _comparison(*runs: RunSpec) -> config.Comparison:
    c = config.Comparison(name="d", model=MODEL, runs=list(runs), world_size=2, global_batch=8,
                          profile=config.ProfileSpec(enabled=False))
    return config.validate(c)


def test_one_description_gives_every_consumer_the_same_figures():
    c = _comparison(RunSpec("ddp", "ddp"), RunSpec("fsdp2", "fsdp2"), RunSpec("zero2", "deepspeed-zero2"))
    model = describe_model(c.model)
    assert model.param_count == memory_model.param_count(c.model)
    for run in c.runs:
        d = describe_run(c, run, model=model)
        assert memory_model.predict_run(c, run, described=d) == memory_model.predict_run(c, run)
        spec = config.run_spec_payload(c, run, out_dir=".", device="cpu")
        assert comm_theory.comm_of(d) == comm_theory.expected_comm(spec)
        assert sum(d.unit_numels.values()) == d.local_elements == model.param_count


def test_unit_blocks_groups_the_units_and_every_consumer_follows():
    """Two blocks a unit on a 4-block model: units root, layers.0., layers.2.; the same elements and bytes moved;
    the gathered unit twice a block's; predict's work has the same FLOPs in fewer units."""
    one, two = RunSpec("fsdp2", "fsdp2"), RunSpec("fsdp2-u2", "fsdp2", options={"unit_blocks": 2})
    c = _comparison(one, two)
    d1, d2 = describe_run(c, one), describe_run(c, two)
    assert list(d1.units) == ["root", "layers.0.", "layers.1.", "layers.2.", "layers.3."]
    assert list(d2.units) == ["root", "layers.0.", "layers.2."]
    assert d2.unit_numels["layers.0."] == d1.unit_numels["layers.0."] + d1.unit_numels["layers.1."]
    assert comm_theory.comm_of(d2)["by_type"] == comm_theory.comm_of(d1)["by_type"]
    m1, m2 = memory_model.predict_run(c, one), memory_model.predict_run(c, two)
    block = d1.unit_numels["layers.0."] * 4  # fp32
    assert m2["gathered_unit_bytes"] - m1["gathered_unit_bytes"] == block
    assert m2["model_state_bytes"] == m1["model_state_bytes"]
    w1, w2 = work_of(c, one), work_of(c, two)
    assert [u for u, _, _ in w2.units] == ["root", "layers.0.", "layers.2."]
    share = dict((u, s) for u, s, _ in w1.units)
    assert dict((u, s) for u, s, _ in w2.units)["layers.0."] == pytest.approx(share["layers.0."] + share["layers.1."])


def test_unit_blocks_is_refused_below_one():
    with pytest.raises(config.ConfigError, match="unit_blocks"):
        _comparison(RunSpec("fsdp2", "fsdp2", options={"unit_blocks": 0}))
