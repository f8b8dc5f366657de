"""Compute probe: one rank of a run at any world size, its compute and framework overhead timed, its
communication taken away.

``shardscope predict --probe`` runs this module once per run (a subprocess each, so the command line
stays torch-free). Rank 0 of a fake process group (``backend="fake"``: every collective returns at
once, as in ``traced_estimate``; at world size 1 a real group of one, ``probe_backend``) stands in for
the run: the model is built at its real size with real tensors, the registered strategy's own ``apply``
shards it for the predicted world size, and the training loop of every run (``loop.train``) runs a few
steps with the step clock on. What the step records then hold per phase is this rank's own work at that
world size (matmuls on its local batch, the strategy's hooks, flat-parameter views, DTensor dispatch, the
optimizer on its shard, parity mode's per-layer norms when the preset asks for them), with no wait and no
transfer in a collective: the part of a step that ``predict`` would otherwise carry over
from the calibration's model size and strategies, measured instead for the model and strategy being
predicted (operator profiling on one device, as vTrain and Lumos do). Communication is added back by
``predict``'s collective fit on the strategy's schedule.

A fake collective leaves its output as allocated: the gathered parameters and reduced gradients hold
whatever the allocator handed out, so the losses are not the run's (the probe reports none of them).
Denormals are flushed, so that such values cost what ordinary ones do; non-finite losses do not stop it.

    python -m shardscope.engines.compute_probe SPEC.json STEPS     # prints one JSON object
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from shardscope.config import Comparison
from shardscope.core import events, registry
from shardscope.core.rundir import RunDir
from shardscope.engines.data import build_batches
from shardscope.engines.loop import LoopConfig, train
from shardscope.engines.model import build_model, resolve
from shardscope.engines.traced_estimate import rank0_context, spec_main
from shardscope.engines.worker import train_settings

PHASE_FIELDS = ("time_forward_s", "time_backward_s", "time_optimizer_s", "busy_s", "step_time_s")
WARMUP = 1  # step 0 allocates and warms caches: left out of the medians as the calibration does


def _complete_ddp_buckets(model: torch.nn.Module) -> None:
    """DDP's reducer wants each bucket's all-reduce to yield a tensor; the fake group's yields none. A
    communication hook that hands the bucket back at once stands in for it (the all-reduce's time is
    ``predict``'s to add)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return

    def done(_, bucket):  # type: ignore[no-untyped-def]  (DDP reads the annotations: none, or GradBucket itself)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    model.register_comm_hook(None, done)


def _drop_tp_input_check(model: Any) -> None:
    """DeepSpeed's AutoTP engine checks on its first forward that its tensor-parallel group got equal inputs
    (a broadcast, then an all-reduce of the verdict); a fake group's broadcast carries nothing, so the check
    would fail. The probe removes it: the real run pays it once, at step 0, which no median counts."""
    handle = getattr(model, "first_dataloader_check", None)
    if handle is not None:
        handle.remove()
        model.first_dataloader_check = None


def probe_backend(world_size: int, device: str) -> str:
    """The probe's process group: at world size 1 a real group of one (gloo, or NCCL on CUDA), since the run's
    own collectives on a group of one (DDP's reducer copying every gradient into its buckets and all-reducing
    them, ZeRO's partitions) move nothing between ranks but do cost time, which ``predict``'s schedule does not
    place (seen on an H200: DDP's probe 17.4 ms a step on the fake group against 22.9 ms measured). At larger
    world sizes the fake group, whose collectives return at once (``predict`` adds their time back)."""
    if world_size != 1:
        return "fake"
    return "nccl" if device == "cuda" else "gloo"


def probe(spec: dict[str, Any], steps: int) -> dict[str, Any]:
    """Train ``steps`` steps of ``spec``'s run as rank 0 of a process group of its world size (``probe_backend``);
    return the median over steps ``WARMUP``.. of each phase's seconds, ``busy_s`` and ``step_time_s``, and
    ``{"steps", "world_size", "threads", "backend"}``."""
    if steps <= WARMUP:
        raise ValueError(f"steps = {steps}: the probe needs more than {WARMUP} (the first is a warm-up)")
    comparison = Comparison.from_dict({**spec["comparison"], "runs": [], "steps": steps})
    run = spec["run"]
    torch.set_flush_denormal(True)
    # DeepSpeed reads the launcher's variables even when the process group exists: rank 0 of the fake group.
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(run["world_size"]), "LOCAL_WORLD_SIZE": "1"})
    torch.manual_seed(comparison.seed)
    device = "cuda" if spec.get("device") == "cuda" else "cpu"
    world = int(run["world_size"])
    ctx = rank0_context(world, int(run["tp"]), device, probe_backend(world, device))
    settings = train_settings(comparison, run, ctx.dp_size)
    model = build_model(comparison.model, comparison.seed).to(ctx.device)  # as the worker does before apply
    prep = resolve(registry.get(run["strategy"]).entry)(
        model, ctx, settings, {k: v for k, v in run["options"].items() if k not in registry.LOOP_OPTIONS})
    if ctx.backend == "fake":
        _complete_ddp_buckets(prep.model)
    _drop_tp_input_check(prep.model)
    micro_batches, source = build_batches(comparison, ctx.dp_size, ctx.dp_rank)
    cfg = LoopConfig(global_batch=comparison.global_batch, tokens_per_sample=source.tokens_per_sample,
                     min_lr_ratio=comparison.min_lr_ratio, parity=comparison.parity, stop_on_nonfinite=False)
    with tempfile.TemporaryDirectory(prefix="shardscope-probe-") as tmp:
        path = RunDir(tmp).run(run["name"]).rank_file(0)  # a scratch run directory, laid out as a run's
        writer = events.RecordWriter(path, run["name"], 0)
        try:
            train(prep, ctx, settings, cfg, micro_batches, writer)
        finally:
            writer.close()
        records, _ = events.read_records(path)
    done = [r for r in records if r.get("kind") == events.STEP and int(r.get("step", 0)) >= WARMUP]
    out: dict[str, Any] = {"steps": len(done), "world_size": ctx.world_size, "threads": torch.get_num_threads(),
                           "backend": ctx.backend}
    for key in PHASE_FIELDS:
        values = [float(r[key]) for r in done if isinstance(r.get(key), (int, float))]
        out[key] = statistics.median(values) if values else None
    dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point: probe the spec in ``argv[0]`` for ``argv[1]`` steps and print the result as one JSON line."""
    return spec_main(argv, lambda spec, steps: probe(spec, int(steps)))


if __name__ == "__main__":
    from shardscope.core.bounded import hold_lifeline

    hold_lifeline()  # ends with the command that started it (core/bounded.run_bounded)
    sys.exit(main())
