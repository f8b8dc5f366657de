"""Communication theory on hand-counted cases (no torch): per type, in the dtype each collective moves."""

from __future__ import annotations

import math

import pytest

from shardscope import config
from shardscope.config import ModelSpec, RunSpec
from shardscope.profiling import comm_theory

# Odd sizes on purpose: vocab 251 and seq 31 rows do not split evenly over 2 ranks.
ODD = ModelSpec(vocab_size=251, d_model=33, n_layers=2, n_heads=3, d_ff=100, seq_len=31)
D, F, V, S = 33, 100, 251, 31
BLOCK = 2 * D + 4 * (D * D + D) + 2 * D + F * D + F + D * F + D  # ln1, q/k/v/o, ln2, fc_in, fc_out
ROOT = V * D + S * D + 2 * D + V * D  # tok_emb, pos_emb, final norm, untied lm_head
TOTAL = ROOT + 2 * BLOCK


def _theory(run: RunSpec, tmp_path, precision: str = "fp32", ws: int = 2, model: ModelSpec = ODD) -> dict:
    c = config.Comparison(name="t", model=model, runs=[run], world_size=ws, global_batch=8, precision=precision,
                          profile=config.ProfileSpec(enabled=False))
    config.validate(c)
    return comm_theory.expected_comm(config.run_spec_payload(c, c.runs[0], out_dir=str(tmp_path), device="cpu"))


def _dim0_padded(shape: tuple[int, ...], dp: int = 2) -> int:
    return math.ceil(shape[0] / dp) * dp * math.prod(shape[1:])


def test_ddp_all_reduces_every_gradient_and_the_loss(tmp_path):
    t = _theory(RunSpec("ddp", "ddp"), tmp_path)
    assert t["by_type"] == {"all_reduce": 4 * TOTAL + 4}  # the built-in transformer has no buffers


def test_fsdp1_regathers_blocks_not_the_root_and_pads_flat_units(tmp_path):
    full = _theory(RunSpec("f", "fsdp1"), tmp_path)["by_type"]
    root, block = ROOT + 1, BLOCK + 1  # both odd: each flat unit gets one padding element
    assert ROOT % 2 == 1 and BLOCK % 2 == 1
    assert full["all_gather"] == 4 * (root + 2 * block + 2 * block)
    assert full["reduce_scatter"] == 4 * (root + 2 * block)
    sgo = _theory(RunSpec("s", "fsdp1", options={"sharding_strategy": "SHARD_GRAD_OP"}), tmp_path)["by_type"]
    assert sgo["all_gather"] == 4 * (root + 2 * block)
    no = _theory(RunSpec("n", "fsdp1", options={"sharding_strategy": "NO_SHARD"}), tmp_path)["by_type"]
    assert no == {"all_reduce": 4 * TOTAL + 4}  # nothing sharded: no padding


def test_fsdp2_pads_dim0_and_gathers_in_bf16_under_bf16_params(tmp_path):
    # every tensor's dim 0 rounded up to even: 251 -> 252, 31 -> 32, 33 -> 34; 100 stays
    root = _dim0_padded((V, D)) * 2 + _dim0_padded((S, D)) + 2 * 34
    block = 2 * 34 + 4 * (34 * D + 34) + 2 * 34 + F * D + F + 34 * F + 34
    t = _theory(RunSpec("f", "fsdp2"), tmp_path, precision="bf16-params")["by_type"]
    assert t["all_gather"] == 2 * 2 * (root + 2 * block)  # bf16, forward and backward, root included
    assert t["reduce_scatter"] == 4 * (root + 2 * block)  # fp32 reduction
    keep = _theory(RunSpec("k", "fsdp2", options={"reshard_after_forward": False}), tmp_path)["by_type"]
    assert keep["all_gather"] == 4 * (root + 2 * block)


def test_zero_stages(tmp_path):
    z1 = _theory(RunSpec("z", "deepspeed-zero1"), tmp_path)
    assert z1["by_type"] == {"all_reduce": 4 * TOTAL + 4, "all_gather": 4 * TOTAL}
    z3 = _theory(RunSpec("z", "deepspeed-zero3"), tmp_path, precision="bf16-params")
    assert z3["by_type"] == {"all_reduce": 4, "all_gather": 2 * TOTAL, "reduce_scatter": 2 * TOTAL}
    assert any("reuse" in n for n in z3["notes"])


def test_tensor_parallel_activation_all_reduces(tmp_path):
    t = _theory(RunSpec("tp", "fsdp2-tp", world_size=4, options={"tp": 2}), tmp_path, ws=4,
                model=ModelSpec(vocab_size=V, d_model=36, n_layers=2, n_heads=4, d_ff=F, seq_len=S))
    micro, D = 8 // 2, 36  # global batch 8 over dp 2
    # forward: o_proj and fc_out (row-parallel); backward: q, k, v and fc_in (column-parallel)
    assert t["by_type"]["all_reduce"] == 4 + (2 + 4) * 2 * micro * S * D * 4
    assert any("column-parallel" in n for n in t["notes"])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp1", "fsdp-handwritten", "deepspeed-zero2"])
def test_totals_add_up(strategy, tmp_path):
    t = _theory(RunSpec("r", strategy), tmp_path)
    assert t["bytes_per_step"] == sum(t["by_type"].values()) and t["basis"]
