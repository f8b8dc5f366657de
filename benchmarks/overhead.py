"""How much does shardscope's instrumentation cost? Instrumented loop vs a bare loop, in one run.

For each strategy asked (DDP and FSDP2 by default), launches one torchrun job (gloo on CPU, world
size 2). Inside it, every rank builds the same model, strategy and batches as a shardscope run, then alternates blocks of
steps: a bare loop that records nothing (forward, backward, clip, optimizer step) and shardscope's
instrumented loop (``engines.loop.train``: records per step, global loss all-reduce, memory
figures, grad-norm read-back). Both are timed from outside over whole blocks, warm-up block
discarded, so the figures are measured the same way in the same process at the same time.

    python benchmarks/overhead.py [--world-size 2] [--strategies ddp,fsdp2] [--blocks 31] [--steps 4]

Per strategy the last line is ``overhead_ratio <strategy>: R`` (instrumented tokens/s over bare
tokens/s; target >= 0.99).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def outer(args: argparse.Namespace) -> int:
    """Run ``one_strategy`` for each strategy asked; return the first non-zero exit code, else 0."""
    print(f"load average before: {os.getloadavg()[0]:.2f} (other processes share these cores)")
    codes = [one_strategy(args, name.strip()) for name in args.strategies.split(",") if name.strip()]
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return next((c for c in codes if c), 0)


def one_strategy(args: argparse.Namespace, strategy: str) -> int:
    """Write a spec and init weights, launch torchrun on this file, print rank 0's result."""
    from shardscope import config
    from shardscope.orchestrator import launcher

    overrides = [f"world_size={args.world_size}", f"steps={args.steps}", "profile.enabled=false",
                 f"model.d_model={args.d_model}", f"model.n_layers={args.layers}", f"model.seq_len={args.seq}",
                 f"global_batch={args.batch}", "model.vocab_size=1024", "model.n_heads=4", f"model.d_ff={4 * args.d_model}",
                 f"runs.ddp.strategy='{strategy}'"]
    comparison = config.load_preset("smoke", overrides)
    run = comparison.run("ddp")
    with tempfile.TemporaryDirectory() as out:
        config.dump_json(os.path.join(out, "comparison.json"), comparison.to_dict())
        subprocess.run([sys.executable, "-m", "shardscope.engines.init_weights", os.path.join(out, "comparison.json"),
                        os.path.join(out, "init.safetensors")], check=True)
        os.makedirs(os.path.join(out, run.name, "metrics"))
        spec_path = os.path.join(out, run.name, "spec.json")
        config.dump_json(spec_path, config.run_spec_payload(comparison, run, out_dir=out, device="cpu"))
        argv = list(launcher.torchrun_argv(spec_path, nproc_per_node=args.world_size))
        argv[argv.index("-m", 3):] = [__file__, "--inner", spec_path, "--blocks", str(args.blocks)]
        env = {**os.environ, **launcher.worker_env("cpu"), "PYTHONPATH": REPO}
        proc = subprocess.run(argv, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-4000:], proc.stderr[-4000:], file=sys.stderr)
            return proc.returncode
        result = json.loads(open(os.path.join(out, "result.json")).read())
    print(f"machine: {os.cpu_count()} CPU cores, gloo, world size {args.world_size}, strategy {strategy}, "
          f"model d_model={args.d_model} layers={args.layers} seq={args.seq} global_batch={args.batch}")
    print(f"blocks: {args.blocks} x {args.steps} steps each way, alternating order, first block discarded")
    print(f"bare tokens/s:         {result['bare']:,.0f}")
    print(f"instrumented tokens/s: {result['instrumented']:,.0f}")
    lo, hi = result["pair_ratio_iqr"]
    print(f"ratio of medians:      {result['instrumented'] / result['bare']:.3f}")
    print(f"paired block ratios:   median {result['pair_ratio']:.3f}, interquartile {lo:.3f}-{hi:.3f}")
    print(f"overhead_ratio {strategy}: {result['pair_ratio']:.3f}")
    return 0


def inner(spec_path: str, blocks: int) -> None:
    """Inside torchrun: alternate bare and instrumented blocks; rank 0 writes result.json."""
    import torch

    from shardscope import events
    from shardscope.config import Comparison
    from shardscope import registry
    from shardscope.engines import loop, worker
    from shardscope.engines.data import build_batches
    from shardscope.engines.init_weights import load_init
    from shardscope.engines.model import build_model, resolve

    spec = json.loads(open(spec_path).read())
    ctx = worker.init_distributed(spec)
    comparison = Comparison.from_dict({**spec["comparison"], "runs": []})
    settings = worker.train_settings(comparison, spec["run"], ctx.dp_size)
    model = build_model(comparison.model, comparison.seed)
    load_init(model, spec["init_path"])
    prep = resolve(registry.get(spec["run"]["strategy"]).entry)(model.to(ctx.device), ctx, settings,
                                                                 dict(spec["run"]["options"]))
    micro_batches, source = build_batches(comparison, ctx.dp_size, ctx.dp_rank)
    tokens = comparison.global_batch * source.tokens_per_sample
    steps = comparison.steps

    def bare_block() -> float:
        torch.distributed.barrier()
        t0 = time.perf_counter()
        for step in range(steps):
            prep.set_lr(settings.lr)
            prep.zero_grad()
            for inputs, targets in micro_batches(step):
                loss = loop.loss_fn(prep.model(inputs), targets) / settings.grad_accum
                prep.backward(loss)
            prep.clip_and_step(settings.grad_clip)
        torch.distributed.barrier()
        return time.perf_counter() - t0

    writer = events.RecordWriter(os.path.join(spec["run_dir"], "metrics", f"rank{ctx.rank}.jsonl"), "bench", ctx.rank)

    def instrumented_block() -> float:
        cfg = loop.LoopConfig(global_batch=comparison.global_batch, tokens_per_sample=source.tokens_per_sample,
                              min_lr_ratio=comparison.min_lr_ratio)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        loop.train(prep, ctx, settings, cfg, micro_batches, writer)
        torch.distributed.barrier()
        return time.perf_counter() - t0

    times = {"bare": [], "instrumented": []}
    for block in range(blocks):
        order = [("bare", bare_block), ("instrumented", instrumented_block)]
        if block % 2:
            order.reverse()  # alternate which goes first, so drift in machine load cancels out
        for name, fn in order:
            elapsed = fn()
            if block > 0:
                times[name].append(elapsed)
    writer.close()
    if ctx.rank == 0:
        # The median block resists load spikes from other processes better than the mean.
        result = {name: tokens * steps / statistics.median(ts) for name, ts in times.items()}
        # Each bare block and the instrumented block beside it ran under the same machine load: the
        # median of their ratios cancels slow drift that the medians of each side alone keep.
        pairs = [b / i for b, i in zip(times["bare"], times["instrumented"])]
        result["pair_ratio"] = statistics.median(pairs)
        result["pair_ratio_iqr"] = _iqr(pairs)
        result["blocks_s"] = times
        with open(os.path.join(spec["out_dir"], "result.json"), "w") as fh:
            json.dump(result, fh)
    torch.distributed.destroy_process_group()


def _iqr(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def main() -> int:
    """Parse arguments; run the outer launcher or the inner rank body."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--strategies", default="ddp,fsdp2", help="comma-separated registry names")
    parser.add_argument("--blocks", type=int, default=31)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    if args.inner:
        from shardscope.engines.worker import exit_now  # skip finalization: see its docstring

        inner(args.inner, args.blocks)
        exit_now(0)
    return outer(args)


if __name__ == "__main__":
    sys.exit(main())
