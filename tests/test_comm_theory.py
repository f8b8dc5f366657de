"""Communication theory on hand-counted cases (no torch): per collective type, in the dtype it moves."""

from __future__ import annotations

import math

from shardscope import config
from shardscope.config import ModelSpec, RunSpec
from shardscope.profiling import comm_theory

# Odd sizes on purpose: vocab 251, seq 31 and width 33 rows do not split evenly over 2 ranks.
ODD = ModelSpec(vocab_size=251, d_model=33, n_layers=2, n_heads=3, d_ff=100, seq_len=31)
D, F, V, S = 33, 100, 251, 31
BLOCK = 2 * D + 4 * (D * D + D) + 2 * D + F * D + F + D * F + D  # ln1, q/k/v/o, ln2, fc_in, fc_out
ROOT = V * D + S * D + 2 * D + V * D  # tok_emb, pos_emb, final norm, untied lm_head
TOTAL = ROOT + 2 * BLOCK


def _theory(run: RunSpec, tmp_path, precision: str = "fp32", ws: int = 2, model: ModelSpec = ODD,
            accum: int = 1) -> dict:
    c = config.Comparison(name="t", model=model, runs=[run], world_size=ws, global_batch=8, precision=precision,
                          grad_accum=accum, profile=config.ProfileSpec(enabled=False))
    c = config.validate(c)
    return comm_theory.expected_comm(config.run_spec_payload(c, c.runs[0], out_dir=str(tmp_path), device="cpu"))


def test_ddp_all_reduces_every_gradient_and_broadcasts_buffers(tmp_path):
    assert _theory(RunSpec("ddp", "ddp"), tmp_path)["by_type"] == {"all_reduce": 4 * TOTAL}  # no buffers
    hf = _theory(RunSpec("ddp", "ddp"), tmp_path, model=ModelSpec(kind="hf", hf_arch="qwen2-tiny", hf_layers=1,
                                                                 vocab_size=128, seq_len=16))
    assert hf["by_type"]["broadcast"] == 64  # rotary inv_freq + original_inv_freq, 8 fp32 each (measured)
    assert any("broadcast" in r for r in hf["reasons"])


# FSDP1 with use_orig_params (its default here) starts every tensor of a flat unit at a multiple of 4 fp32
# elements (16 bytes): odd-sized tensors leave gaps. Counted on the real FlatParameters (torch 2.13):
ALIGNED_ROOT = ROOT + 3 + 3 + 2  # after tok_emb (8283), pos_emb (1023) and the final norm's bias (33)
ALIGNED_BLOCK = BLOCK + 3 * 12  # after every tensor but the last: 33, 33*33 and 100 are all 1 mod 4


def test_fsdp1_regathers_blocks_not_the_root_and_pads_flat_units(tmp_path):
    assert (ALIGNED_ROOT, ALIGNED_BLOCK) == (17663, 11389)
    root, block = ALIGNED_ROOT + 1, ALIGNED_BLOCK + 1  # both odd: each flat unit gets one padding element
    full = _theory(RunSpec("f", "fsdp1"), tmp_path)
    assert full["by_type"]["all_gather"] == 4 * (root + 2 * block + 2 * block)
    assert full["by_type"]["reduce_scatter"] == 4 * (root + 2 * block)
    assert any("root" in r for r in full["reasons"])
    flat = _theory(RunSpec("f", "fsdp1", options={"use_orig_params": False}), tmp_path)["by_type"]
    assert flat["reduce_scatter"] == 4 * (ROOT + 1 + 2 * (BLOCK + 1))  # no alignment without use_orig_params
    sgo = _theory(RunSpec("s", "fsdp1", options={"sharding_strategy": "SHARD_GRAD_OP"}), tmp_path)["by_type"]
    assert sgo["all_gather"] == 4 * (root + 2 * block)
    no = _theory(RunSpec("n", "fsdp1", options={"sharding_strategy": "NO_SHARD"}), tmp_path)["by_type"]
    assert no == {"all_reduce": 4 * (ALIGNED_ROOT + 2 * ALIGNED_BLOCK)}  # the flat buffers, unsharded


def test_hybrid_shard_all_reduces_gradient_shards_across_replicas(tmp_path):
    """HYBRID_SHARD at 4 ranks in shard groups of 2 (FSDP1), and FSDP2 HSDP with 2 replicas: gathers and
    reduce-scatters padded to the shard group, plus an all-reduce of each rank's gradient shard."""
    root, block = ALIGNED_ROOT + 1, ALIGNED_BLOCK + 1
    opts = {"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 2}
    t = _theory(RunSpec("h", "fsdp1", world_size=4, options=opts), tmp_path, ws=4)
    assert t["by_type"] == {"all_gather": 4 * (root + 4 * block), "reduce_scatter": 4 * (root + 2 * block),
                            "all_reduce": 4 * (root + 2 * block) // 2}
    assert any("replica" in r for r in t["reasons"])
    one = _theory(RunSpec("h", "fsdp1", world_size=2, options={"sharding_strategy": "HYBRID_SHARD"}), tmp_path)
    assert one["by_type"]["all_reduce"] == 4 * (root + 2 * block) // 2  # one replica: FSDP1 all-reduces anyway
    hsdp = _theory(RunSpec("h", "fsdp2", world_size=4, options={"replicate": 2}), tmp_path, ws=4)["by_type"]
    plain = _theory(RunSpec("p", "fsdp2"), tmp_path)["by_type"]  # dim 0 padded to 2 as at 2 ranks
    assert hsdp == {**plain, "all_reduce": plain["reduce_scatter"] // 2}


def test_fsdp2_pads_dim0_and_gathers_in_bf16_under_bf16_params(tmp_path):
    # every tensor's dim 0 rounded up to even: 251 -> 252, 31 -> 32, 33 -> 34; 100 stays
    root = 252 * D * 2 + 32 * D + 2 * 34
    block = 2 * 34 + 4 * (34 * D + 34) + 2 * 34 + F * D + F + 34 * F + 34
    t = _theory(RunSpec("f", "fsdp2"), tmp_path, precision="bf16-params")["by_type"]
    assert t["all_gather"] == 2 * (root + 2 * block + 2 * block)  # bf16, forward and backward; the root kept
    assert any("root" in r for r in _theory(RunSpec("f", "fsdp2"), tmp_path)["reasons"])
    assert t["reduce_scatter"] == 4 * (root + 2 * block)  # fp32 reduction
    keep = _theory(RunSpec("k", "fsdp2", options={"reshard_after_forward": False}), tmp_path)["by_type"]
    assert keep["all_gather"] == 4 * (root + 2 * block)


def test_handwritten_reduce_scatters_every_micro_batch(tmp_path):
    t = _theory(RunSpec("h", "fsdp-handwritten"), tmp_path, accum=2)
    assert t["by_type"]["reduce_scatter"] == 2 * 4 * (ROOT + 1 + 2 * (BLOCK + 1))
    assert any("micro-batch" in r for r in t["reasons"])


def test_zero_stages(tmp_path):
    z1 = _theory(RunSpec("z", "deepspeed-zero1"), tmp_path)["by_type"]
    assert z1 == {"all_reduce": 4 * TOTAL, "all_gather": 4 * math.ceil(TOTAL / 4) * 4}  # flat buffer aligned to 2 x dp
    z3 = _theory(RunSpec("z", "deepspeed-zero3"), tmp_path, precision="bf16-params")
    flat = ROOT + 1 + 2 * (BLOCK + 1)
    # one gather (the model fits max_live), in bf16; gradients reduced in fp32 (communication_data_type)
    assert z3["by_type"] == {"all_gather": 2 * flat, "reduce_scatter": 4 * flat}
    assert any("max_live" in r for r in z3["reasons"]) and any("fp32" in r for r in z3["reasons"])


def test_tensor_parallel_activation_all_reduces(tmp_path):
    t = _theory(RunSpec("tp", "fsdp2-tp", world_size=4, options={"tp": 2}), tmp_path, ws=4,
                model=ModelSpec(vocab_size=V, d_model=36, n_layers=2, n_heads=4, d_ff=F, seq_len=S))
    micro, d = 8 // 2, 36  # global batch 8 over dp 2
    # forward: o_proj and fc_out (row-parallel); backward: q, k, v and fc_in (column-parallel)
    assert t["by_type"]["all_reduce"] == (2 + 4) * 2 * micro * S * d * 4


def test_kept_gathered_units_are_gathered_again_every_micro_batch_except_fsdp1s_through_no_sync(tmp_path):
    """Two micro-batches, parameters kept gathered from forward to backward: FSDP2 and the hand-written FSDP
    reshard after each backward, so each micro-batch gathers again (counted in a real step: 6 gathers of 3 units,
    tests/test_layout_matrix.py); FSDP1's SHARD_GRAD_OP keeps its units gathered through ``no_sync`` (3)."""
    keep = {"reshard_after_forward": False}
    for strategy in ("fsdp2", "fsdp-handwritten"):
        one = _theory(RunSpec("k", strategy, options=keep), tmp_path)
        two = _theory(RunSpec("k", strategy, options=keep), tmp_path, accum=2)
        assert two["by_type"]["all_gather"] == 2 * one["by_type"]["all_gather"], strategy
        assert any("every micro-batch gathers" in r for r in two["reasons"]), strategy
    sgo = {"sharding_strategy": "SHARD_GRAD_OP"}
    one = _theory(RunSpec("s", "fsdp1", options=sgo), tmp_path)["by_type"]
    assert _theory(RunSpec("s", "fsdp1", options=sgo), tmp_path, accum=2)["by_type"]["all_gather"] == one["all_gather"]


def test_one_rank_counts_what_each_strategy_still_hands_to_a_group_of_one(tmp_path):
    """At world size 1 DDP, FSDP1 (which switches to NO_SHARD there), the hand-written FSDP and DeepSpeed ZeRO (its
    gradient reductions, no gathers) still call collectives on a group of one; FSDP2 calls none. Seen first on an H100
    (gpu_check: 175.2 MiB handed against a theory of 0), then counted in a real step of each at one rank on CPU: trace
    = in-rank count = this theory within 1e-5 for all 11 layouts of tests/test_layout_matrix.py (2026-11-26)."""
    def one(strategy: str, **options) -> dict:
        return _theory(RunSpec("r", strategy, world_size=1, options=options), tmp_path, ws=1)["by_type"]

    assert one("ddp") == {"all_reduce": 4 * TOTAL}
    for sharding in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):  # the flat buffers, alignment as in NO_SHARD
        assert one("fsdp1", sharding_strategy=sharding) == {"all_reduce": 4 * (ALIGNED_ROOT + 2 * ALIGNED_BLOCK)}
    assert one("fsdp2") == {}
    # nothing to pad over one rank; the root stays gathered from forward to backward
    assert one("fsdp-handwritten") == {"all_gather": 4 * (ROOT + 4 * BLOCK), "reduce_scatter": 4 * TOTAL}
    assert one("deepspeed-zero1") == one("deepspeed-zero2") == {"all_reduce": 4 * TOTAL}
    assert one("deepspeed-zero3") == {"reduce_scatter": 4 * TOTAL}
    assert any("group of one" in r for r in _theory(RunSpec("r", "ddp", world_size=1), tmp_path, ws=1)["reasons"])
