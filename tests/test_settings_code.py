"""The settings a run writes for users to paste (``engines/settings_code``, issue 47) are code that does what the run
did: pasted into a bare script over a fresh copy of the same model, they build the same wrapper and optimizer, and
one step from the same weights and tokens gives the same next loss as the strategy's own ``apply`` (2 gloo ranks,
fp32, the tiny transformer). Plus the pure rendering of values."""

from __future__ import annotations

import enum
import os

import pytest
import torch

from shardscope.engines import settings_code
from shardscope.engines.settings_code import Name, call, literal

# (strategy, options as the registry resolves them): the library calls the pasted code must reproduce
CASES = [("ddp", {"bucket_cap_mb": 25, "static_graph": False}),
         ("fsdp1", {"sharding_strategy": "SHARD_GRAD_OP", "backward_prefetch": "pre", "limit_all_gathers": True,
                    "use_orig_params": True, "hybrid_shard_size": 0}),
         ("fsdp2", {"reshard_after_forward": False, "param_dtype": "auto", "reduce_dtype": "auto", "replicate": 1}),
         ("fsdp2", {"reshard_after_forward": True, "param_dtype": "auto", "reduce_dtype": "bf16", "replicate": 1,
                    "unit_blocks": 2})]


def test_values_are_written_as_source():
    class Mode(enum.Enum):
        FULL = 1

    assert literal(torch.bfloat16) == "torch.bfloat16" and literal(Mode.FULL) == "Mode.FULL"
    assert literal(Name("mesh")) == "mesh" and literal((2,)) == "(2,)" and literal({"a": [1, True]}) == "{'a': [1, True]}"
    assert literal(torch.nn.Linear) == "Linear"
    from torch.distributed.fsdp import MixedPrecisionPolicy

    assert literal(MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)) == "MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)"
    assert call("f", Name("x"), k=1) == "f(x, k=1)"
    long = call("g", **{f"key{i}": "v" * 10 for i in range(8)})
    assert long.startswith("g(\n    key0='vvvvvvvvvv',\n") and long.endswith("\n)")
    assert settings_code.ds_config({"bf16": {"enabled": True}}) == "ds_config = {'bf16': {'enabled': True}}"


def _rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from shardscope.config import ModelSpec
    from shardscope.core import registry
    from shardscope.engines.api import RankContext, TrainSettings
    from shardscope.engines.model import build_model, resolve
    from shardscope.engines.precision import policy_for
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    ctx = RankContext(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"), backend="gloo",
                      dp_size=2, dp_rank=rank, mesh=mesh, dp_group=mesh.get_group("dp"))
    settings = TrainSettings(lr=1e-2, weight_decay=0.1, grad_clip=0.0, grad_accum=1, micro_batch_size=2, steps=2,
                             warmup_steps=0, precision=policy_for("fp32"), activation_checkpointing=True,
                             compile=False)
    spec = ModelSpec(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, seq_len=16)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(rank))
    results = []
    for strategy, options in CASES:
        def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
            for _ in range(2):
                loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            return float(loss)

        own = build_model(spec, 7)
        blocks = settings_code.blocks_of_model(own)
        prep = resolve(registry.get(strategy).entry)(own, ctx, settings, dict(options))
        text = settings_code.script(prep.code, settings, strategy=strategy, blocks=blocks, loop_autocast=None,
                                    device="cpu", dp=2)
        pasted: dict = {"model": build_model(spec, 7), "local_rank": rank}
        exec(compile(text, f"<{strategy} settings>", "exec"), pasted)  # the user's paste, as written
        results.append(f"{strategy} {type(prep.model).__name__} {type(pasted['model']).__name__} "
                       f"{step(prep.model, prep.optimizer)!r} {step(pasted['model'], pasted['optimizer'])!r}")
    if rank == 0:
        with open(out, "w", encoding="utf-8") as fh:
            fh.write("\n".join(results))
    dist.destroy_process_group()


@pytest.mark.timeout(600)
def test_pasted_settings_train_as_the_run_did(tmp_path):
    """DDP, FSDP1 (SHARD_GRAD_OP), FSDP2 kept gathered and FSDP2 with two blocks a unit and bf16 reductions, with
    activation checkpointing: the pasted code's model is
    the same wrapper, and two steps of it land on the same loss as the strategy's own (to fp32 rounding)."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "losses.txt")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(str(tmp_path / "store"), out), nprocs=2, join=True)
    with open(out, encoding="utf-8") as fh:
        rows = [line.split() for line in fh.read().splitlines()]
    assert [r[0] for r in rows] == [s for s, _ in CASES]
    for strategy, own_type, pasted_type, own, pasted in rows:
        assert own_type == pasted_type, (strategy, own_type, pasted_type)
        assert float(pasted) == pytest.approx(float(own), rel=1e-5, abs=1e-6), strategy
