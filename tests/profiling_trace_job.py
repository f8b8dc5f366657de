"""A tiny torchrun job (gloo, CPU) that trains a small MLP stack with DDP or FSDP2 under torch.profiler.

Used by the trace-analysis tests and benchmarks to produce real Chrome traces:
``torchrun --nproc-per-node 2 tests/profiling_trace_job.py OUT_DIR ddp|fsdp2 [STEPS] [PROFILE_STEPS]``.
Writes ``OUT_DIR/traces/rank<R>.trace.json`` and ``OUT_DIR/params.json`` (parameter count and
bytes, for checking observed communication volume against theory).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn


def build_model() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(3):
        layers += [nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)]
    return nn.Sequential(*layers)


def main() -> None:
    out_dir, strategy = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    prof_steps = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model = build_model()
    n_params = sum(p.numel() for p in model.parameters())
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, bucket_cap_mb=1)
    elif strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for i in range(0, len(model), 3):  # one FSDP unit per Linear-GELU-Linear block
            fully_shard(model[i])
            fully_shard(model[i + 2])
        fully_shard(model)
    else:
        raise SystemExit(f"strategy must be ddp or fsdp2, got {strategy!r}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trace_dir = os.path.join(out_dir, "traces")
    os.makedirs(trace_dir, exist_ok=True)
    warmup = 1
    schedule = torch.profiler.schedule(wait=0, warmup=warmup, active=prof_steps, repeat=1)

    def on_ready(prof: torch.profiler.profile) -> None:
        prof.export_chrome_trace(os.path.join(trace_dir, f"rank{rank}.trace.json"))

    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    times = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                                on_trace_ready=on_ready, record_shapes=True) as prof:
        for step in range(steps):
            t0 = time.perf_counter()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            if step < warmup + prof_steps:
                prof.step()
    if rank == 0:
        with open(os.path.join(out_dir, "params.json"), "w") as fh:
            json.dump({"n_params": n_params, "param_bytes": n_params * 4, "world_size": world,
                       "strategy": strategy, "profiled_steps": prof_steps, "step_times_s": times}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    from shardscope.engines.worker import exit_now  # skip finalization: see its docstring

    main()
    exit_now(0)
