"""Unit tests of the engines' pure logic: data determinism, model shapes, precision policies,
lr schedule, fault specs, layer keys, memory accounting, initial weights. No process group."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from shardscope.config import Comparison, DataSpec, ModelSpec
from shardscope.engines import data, memory_accounting, norms, precision
from shardscope.engines.faults import Fault
from shardscope.engines.init_weights import ensure_init, load_init, write_init
from shardscope.engines.model import Transformer, build_model, count_parameters
from shardscope.engines.optim import LossScaler, clip_by_global_norm, lr_at

TINY = ModelSpec(vocab_size=128, d_model=32, n_layers=2, n_heads=4, d_ff=64, seq_len=16)


def comparison(**kw) -> Comparison:
    return Comparison(name="t", model=kw.pop("model", TINY), global_batch=kw.pop("global_batch", 8), **kw)


@pytest.mark.parametrize("kind", ["synthetic", "text"])
def test_global_batch_is_identical_from_1_2_4_dp_ranks(kind: str, tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    model = ModelSpec(**{**TINY.__dict__, "vocab_size": 256})
    c = comparison(model=model, data=DataSpec(kind=kind, path=str(text)), grad_accum=2)
    reference = None
    for dp in (1, 2, 4):
        parts = []
        for rank in range(dp):
            micro, _ = data.build_batches(c, dp, rank)
            parts.extend(micro(3))
        inputs = torch.cat([x for x, _ in parts])
        targets = torch.cat([y for _, y in parts])
        assert inputs.shape == (8, 16) and len(parts) == 2 * dp
        if reference is None:
            reference = (inputs, targets)
        assert torch.equal(inputs, reference[0]) and torch.equal(targets, reference[1])
    assert torch.equal(reference[0][:, 1:], reference[1][:, :-1])  # next-token targets


def test_batches_depend_only_on_seed_and_step() -> None:
    a = data.make_source(comparison()).global_batch
    b = data.make_source(comparison()).global_batch
    assert torch.equal(a(5)[0], b(5)[0])
    assert not torch.equal(a(5)[0], a(6)[0])
    other = data.make_source(comparison(seed=7)).global_batch
    assert not torch.equal(a(5)[0], other(5)[0])


def test_synthetic_stream_is_learnable() -> None:
    """The chain's true next-token entropy is far below log(vocab): loss can fall well below it."""
    vocab = 32000
    probs = torch.tensor(data._BRANCH_PROBS)
    branch_entropy = -(probs * probs.log()).sum().item()
    noise = data._NOISE
    mixing = -(noise * math.log(noise) + (1 - noise) * math.log(1 - noise))
    # Upper bound on H(next | previous): entropy of a two-component mixture <= weighted sum + mixing entropy.
    entropy_bound = (1 - noise) * branch_entropy + noise * math.log(vocab) + mixing
    assert entropy_bound < 0.25 * math.log(vocab)
    table = data.markov_table(vocab, 1)
    tokens = data.markov_batch(table, 1, 0, 4, 64)
    follows = (table[tokens[:, :-1]] == tokens[:, 1:, None]).any(-1).float().mean()
    assert follows > 0.9  # most transitions are one of the few likely successors


def test_rank_slice_rejects_indivisible_batch() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        data.rank_slice((torch.zeros(6, 4), torch.zeros(6, 4)), 4, 0, 1)


def test_model_forward_shapes_and_layers() -> None:
    model = build_model(TINY, seed=1)
    assert isinstance(model, Transformer) and len(model.layers) == 2
    logits = model(torch.randint(128, (3, 16)))
    assert logits.shape == (3, 16, 128)
    assert count_parameters(model) == sum(p.numel() for p in model.parameters())


def test_model_init_is_deterministic_and_causal() -> None:
    a, b = build_model(TINY, seed=3), build_model(TINY, seed=3)
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), na
    assert not torch.equal(a.tok_emb.weight, build_model(TINY, seed=4).tok_emb.weight)
    tokens = torch.randint(128, (1, 16))
    changed = tokens.clone()
    changed[0, -1] = (tokens[0, -1] + 1) % 128
    with torch.no_grad():  # changing the last token must not change earlier positions' logits
        assert torch.allclose(a(tokens)[0, :-1], a(changed)[0, :-1])


def test_classic_defaults_parameter_count() -> None:
    spec = ModelSpec()
    per_block = 4 * (768 * 768 + 768) + 2 * 768 * 3072 + 3072 + 768 + 4 * 768
    expected = 32000 * 768 * 2 + 256 * 768 + 6 * per_block + 2 * 768
    model = Transformer(spec.vocab_size, spec.d_model, spec.n_layers, spec.n_heads, spec.d_ff, spec.seq_len)
    assert count_parameters(model) == expected


def test_init_weights_round_trip(tmp_path: Path) -> None:
    c = comparison(seed=11)
    path = str(tmp_path / "init.safetensors")
    n = write_init(c, path)
    model = build_model(TINY, seed=999)  # different init, then overwritten by the file
    load_init(model, path)
    ref = build_model(TINY, seed=11)
    assert n == count_parameters(ref)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), name


def test_init_weights_bytes_depend_only_on_the_weights(tmp_path: Path) -> None:
    """Two writes of the same comparison's weights, one in another interpreter, are the same bytes (safetensors
    writes its metadata map in a random order; one key keeps it fixed), so two identical comparisons carry the
    same init_sha256 and ``diff`` does not list it."""
    import json
    import subprocess
    import sys

    c = comparison(seed=11)
    write_init(c, str(tmp_path / "a.safetensors"))
    write_init(c, str(tmp_path / "b.safetensors"))
    (tmp_path / "comparison.json").write_text(json.dumps(c.to_dict()))
    subprocess.run([sys.executable, "-m", "shardscope.engines.init_weights", str(tmp_path / "comparison.json"),
                    str(tmp_path / "c.safetensors")], check=True, capture_output=True)
    a = (tmp_path / "a.safetensors").read_bytes()
    assert a == (tmp_path / "b.safetensors").read_bytes() == (tmp_path / "c.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.safetensors", "c.safetensors",
                                                          "comparison.json"]  # no partial file left


def test_content_hash_is_of_the_values_only():
    """Same values, same hash (whatever file they came from); one changed element, another hash."""
    from shardscope.engines.init_weights import content_sha256

    a, b = build_model(TINY, seed=11), build_model(TINY, seed=11)
    assert content_sha256(a) == content_sha256(b)
    with torch.no_grad():
        next(b.parameters()).view(-1)[0] += 1.0
    assert content_sha256(a) != content_sha256(b)


def test_ensure_init_writes_once_then_every_rank_loads(tmp_path: Path) -> None:
    """The first run's writer rank saves the freshly built model; the barrier comes before any load; a later
    run (file present) writes nothing and loads it."""
    c = comparison(seed=11)
    path = str(tmp_path / "init.safetensors")
    calls = []
    writer = build_model(TINY, seed=11)
    ensure_init(writer, c, path, write=True, barrier=lambda: calls.append(os.path.exists(path)))
    assert calls == [True]
    before = os.stat(path).st_mtime_ns
    other = build_model(TINY, seed=5)  # a later run's rank: whatever it built, it loads the file
    ensure_init(other, c, path, write=True, barrier=lambda: calls.append("second"))
    assert os.stat(path).st_mtime_ns == before and calls == [True, "second"]
    for (name, p), (_, q) in zip(other.named_parameters(), writer.named_parameters()):
        assert torch.equal(p, q), name


def test_precision_policies() -> None:
    fp32 = precision.policy_for("fp32")
    assert fp32.param_dtype == fp32.compute_dtype == torch.float32 and not fp32.autocast
    bf16 = precision.policy_for("bf16-params")
    assert bf16.param_dtype == torch.bfloat16 and bf16.reduce_dtype == bf16.master_dtype == torch.float32
    assert precision.policy_for("fp16").loss_scaling
    assert precision.policy_for("bf16-autocast").describe()["compute"] == "bfloat16"
    assert precision.loop_autocast_dtype(fp32, False) is None
    assert precision.loop_autocast_dtype(bf16, False) == torch.bfloat16  # DDP: autocast fallback
    assert precision.loop_autocast_dtype(bf16, True) is None  # FSDP mixed precision handles it
    assert precision.option_dtype("auto", torch.float16) == torch.float16
    assert precision.option_dtype("bf16", torch.float32) == torch.bfloat16
    with pytest.raises(ValueError, match="allowed"):
        precision.policy_for("int8")


def test_lr_schedule_warmup_then_cosine() -> None:
    lrs = [lr_at(s, lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1) for s in range(14)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lr_at(0, lr=1.0, warmup_steps=0, total_steps=1, min_lr_ratio=0.1) == pytest.approx(0.1)


def test_fault_spec() -> None:
    assert Fault.parse("") is None
    fault = Fault.parse("rank=1,step=3,kind=raise")
    assert fault == Fault(1, 3, "raise")
    fault.maybe_fire(0, 3)  # other rank: nothing
    fault.maybe_fire(1, 2)  # other step: nothing
    with pytest.raises(RuntimeError, match="injected fault at step 3 on rank 1"):
        fault.maybe_fire(1, 3)
    with pytest.raises(ValueError, match="kind must be one of"):
        Fault.parse("kind=segfault")


def test_layer_keys_strip_wrappers() -> None:
    assert norms.layer_key("module.layers.3.attn.q_proj.weight") == "layers.3"
    assert norms.layer_key("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.ln1.bias") == "layers.0"
    assert norms.layer_key("tok_emb.weight") == "tok_emb"
    assert norms.layer_key("model.layers.2.mlp.up_proj.weight") == "layers.2"


def test_layer_norms_of_replicated_tensors() -> None:
    named = [("layers.0.a", torch.full((4,), 1.0)), ("layers.0.b", torch.full((5,), 2.0)), ("head.w", None)]
    assert norms.layer_norms(named) == {"layers.0": pytest.approx(math.sqrt(4 + 20))}


def test_memory_accounting_counts_each_storage_once() -> None:
    p = torch.nn.Parameter(torch.zeros(10))
    p.grad = torch.zeros(10)
    opt = torch.optim.AdamW([p])
    opt.step()
    tied = [p, p]  # tied weights: the same tensor twice
    got = memory_accounting.model_state_bytes(tied, opt)
    assert got["param_bytes"] == 40 and got["grad_bytes"] == 40
    assert got["optim_bytes"] == 40 + 40 + 4  # exp_avg, exp_avg_sq, step (fp32 scalar)
    base = torch.zeros(8)
    assert memory_accounting.tensor_bytes([base[:4], base[4:]]) == 32  # views at different offsets


def test_clip_by_global_norm_scales_the_parameters_grads() -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    norm = clip_by_global_norm([a, b], max_norm=1.0)
    assert float(norm) == pytest.approx(5.0)  # the norm before clipping
    assert torch.allclose(torch.cat([a.grad, b.grad]).norm(), torch.tensor(1.0), atol=1e-5)
    norm = clip_by_global_norm([a, b], max_norm=0.0)  # 0 = measure only
    assert float(norm) == pytest.approx(1.0, abs=1e-5)


def test_loss_scaler_skips_overflow_and_backs_off() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    assert float(scaler.scale_loss(torch.tensor(1.5))) == 12.0
    p.grad = torch.tensor([8.0, 16.0])
    assert scaler.unscale_and_check(opt)  # no process group: this rank's verdict only
    assert torch.equal(p.grad, torch.tensor([1.0, 2.0]))
    p.grad = torch.tensor([float("inf"), 1.0])
    assert not scaler.unscale_and_check(opt)
    scaler.update(False)
    assert scaler.scale == 4.0
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 8.0  # grows after growth_interval finite steps


def test_rss_reading_matches_psutil_and_follows_growth():
    """The step record's RSS (one pread of /proc/self/statm) against psutil's independent reading."""
    import psutil

    from shardscope.engines.loop import rss_bytes

    before = rss_bytes()
    assert abs(before - psutil.Process().memory_info().rss) <= 4 * 1024 * 1024
    block = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched
    grown = rss_bytes()
    assert abs(grown - psutil.Process().memory_info().rss) <= 4 * 1024 * 1024
    assert grown - before >= 48 * 1024 * 1024
    del block


def test_layer_norms_of_sharded_dtensors_take_one_all_reduce(tmp_path) -> None:
    """FSDP2's Shard(0) DTensors: every layer's squared sums in one all-reduce (not one per tensor), same norms."""
    import subprocess
    import sys

    script = f"""
import math, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Shard
from shardscope.engines import norms
dist.init_process_group("gloo", store=dist.FileStore({str(tmp_path / 'store')!r}, 1), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
plain = {{"layers.0.a": torch.full((4, 2), 1.0), "layers.0.b": torch.full((5,), 2.0), "head.w": torch.full((3,), 3.0)}}
named = [(n, distribute_tensor(t, mesh, [Shard(0)])) for n, t in plain.items()]
calls = []
real = dist.all_reduce
dist.all_reduce = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
got = norms.layer_norms(named)
assert len(calls) == 1, calls
want = {{"layers.0": math.sqrt(8 + 20), "head": math.sqrt(27)}}
assert got.keys() == want.keys() and all(math.isclose(got[k], want[k], rel_tol=1e-6) for k in want), got
dist.destroy_process_group()
print("ok", flush=True)
import os
os._exit(0)  # as a rank leaves (worker.exit_now): torch 2.13's static teardown once aborted after "ok" (2026-11-27 CI)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_batches_built_ahead_are_the_same_tokens(monkeypatch) -> None:
    """The ranks build their batches before step 0 (or a chunk of steps ahead past a size): the same tokens as built in
    the step, and the same as before this changed (the hashes of smoke's steps 0, 3 and 29 on each of 2 ranks)."""
    import hashlib

    from shardscope import config

    c = config.load_preset("smoke")
    pinned = {0: "6658d79a2eb056b3c761420be4101f63bba920e918b9e2f18f6fb3de66858bca",
              1: "cae426f81d036d8cbb889ddafc70ee14b3d1044b5ac191a142ac5885139435f6"}
    # All before step 0, or a chunk ahead on a thread; chunks as built (all of smoke's 30 steps at once), of 4 and 7
    # (the last one short), and of one step
    chunks = data.CHUNK_STEPS
    for budget, chunk in ((data.AHEAD_BYTES, chunks), (data.AHEAD_BYTES, 7), (1, chunks), (1, 4), (1, 7), (1, 1)):
        monkeypatch.setattr(data, "AHEAD_BYTES", budget)
        monkeypatch.setattr(data, "CHUNK_STEPS", chunk)
        for rank in (0, 1):
            micro, _ = data.build_batches(c, 2, rank, ahead=True)
            plain, _ = data.build_batches(c, 2, rank)
            h, seen = hashlib.sha256(), set()
            # a restart asks for steps again from 0, after steps of a later chunk
            for step in [*range(c.steps)] + [0, 13, 5, c.steps - 1, c.steps]:
                got, want = micro(step), plain(step)
                assert all(torch.equal(a, b) and torch.equal(x, y) for (a, x), (b, y) in zip(got, want)), step
                if step in (0, 3, 29) and step not in seen:
                    seen.add(step)
                    for x, y in got:
                        h.update(x.contiguous().numpy().tobytes())
                        h.update(y.contiguous().numpy().tobytes())
            assert h.hexdigest() == pinned[rank], (budget, chunk, rank)


def _chain_column_by_column(table: torch.Tensor, seed: int, step: int, batch: int, length: int) -> torch.Tensor:
    """The chain as its definition reads (and as ``markov_batch`` computed it before 2026-11-29): column by column,
    the same draws, each token the noise token where the draw is noisy, else the table's successor of the last."""
    gen = torch.Generator().manual_seed(data.step_seed(seed, step))
    choices = torch.multinomial(torch.tensor(data._BRANCH_PROBS), batch * length, replacement=True,
                                generator=gen).view(batch, length)
    noisy = torch.rand(batch, length, generator=gen) < data._NOISE
    noise = torch.randint(table.shape[0], (batch, length), generator=gen)
    tokens = torch.empty(batch, length, dtype=torch.long)
    tokens[:, 0] = noise[:, 0]
    for t in range(1, length):
        tokens[:, t] = torch.where(noisy[:, t], noise[:, t], table[tokens[:, t - 1], choices[:, t]])
    return tokens


def test_the_chain_walked_by_segments_is_the_chain_column_by_column() -> None:
    """``markov_batch`` fills every row's segments at once, one gather per offset from the last restart; the tokens
    are those of the column-by-column definition, at a long sequence (Llama's 2,048) and at the edges (one column,
    one row)."""
    for vocab, batch, length, steps in ((256, 8, 65, 10), (32000, 4, 2049, 2), (7, 1, 1, 3), (7, 3, 2, 3),
                                        (11, 5, 300, 5)):
        table = data.markov_table(vocab, 5)
        for step in range(steps):
            assert torch.equal(data.markov_batch(table, 9, step, batch, length),
                               _chain_column_by_column(table, 9, step, batch, length)), (vocab, batch, length, step)


def test_many_steps_walked_at_once_are_each_steps_own_chain() -> None:
    """``markov_batches`` walks the chain once for several steps: each step's tokens are ``markov_batch``'s, at
    smoke's shape, a long sequence, and the edges (one step, one row, one column)."""
    for vocab, batch, length, steps in ((256, 8, 65, range(0, 40)), (32000, 2, 2049, range(3, 6)),
                                        (7, 1, 1, range(2, 3)), (7, 3, 2, range(5)), (11, 5, 300, range(9, 16))):
        table = data.markov_table(vocab, 5)
        together = data.markov_batches(table, 9, steps, batch, length)
        assert together.shape == (len(steps), batch, length)
        for i, step in enumerate(steps):
            assert torch.equal(together[i], data.markov_batch(table, 9, step, batch, length)), (vocab, length, step)
