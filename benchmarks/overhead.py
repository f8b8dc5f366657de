"""How much does shardscope's instrumentation cost? Instrumented loop vs a bare loop, in one run.

For each strategy asked (DDP and FSDP2 by default), launches one torchrun job (gloo on CPU, world
size 2). Inside it, every rank builds the same model, strategy and batches as a shardscope run, then
alternates single steps: a bare step that records nothing (forward, backward, clip, optimizer step)
and a step of shardscope's loop (``engines.loop.Trainer.step``: a step record with the local loss,
memory figures and the CPU timing split, grad-norm read-back), changing which goes first from one
triple to the next. Interleaving step by step makes both sides see the same machine: on a shared 2-core VM the
load drifts by 10-30% over seconds, which blocks of steps cannot cancel to 1%.

A third arm, a second bare loop (``bare again``), runs in the same rotation: bare against bare again is a
comparison whose true ratio is 1, so what it prints is the benchmark's own resolution in that sitting (2026-11-27:
in a 900-triple run, bare against bare again printed 1.0095 with a pair-bootstrap interval of 1.000-1.019, which
excluded 1). The three arms take the six orders in turn. Intervals are a moving-block bootstrap over runs of
``BLOCK`` consecutive triples: the machine's load drifts over seconds, so neighbouring steps are not independent,
and a bootstrap over single pairs made the interval too narrow.

Each step is timed on rank 0 from the end of the previous step to the end of this one, where "end"
is a barrier every rank leaves together: whatever any rank spends on a step (its record, a late
start) lands in that step's time, not in its neighbour's. The barrier's own cost is in both sides
(it is measured apart and printed). The ratio is total bare time over total instrumented time
(instrumented tokens/s over bare tokens/s) after ``--warmup`` triples, with a 95% block-bootstrap interval.

    python benchmarks/overhead.py [--world-size 2] [--strategies ddp,fsdp2] [--pairs 600] [--save PREFIX]

Per strategy the last two lines are ``control_ratio <strategy>: C`` (bare against bare again) and
``overhead_ratio <strategy>: R`` (target >= 0.99).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ARMS = ("bare", "instrumented", "bare again")
BLOCK = 25  # triples per bootstrap block: about 4 s of steps, longer than the load's drift between neighbours

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

    overrides = [f"world_size={args.world_size}", f"steps={3 * (args.pairs + args.warmup) + 2 * args.profile_steps}", "profile.enabled=false",
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
        argv[argv.index("-m", 3):] = [__file__, "--inner", spec_path, "--pairs", str(args.pairs),
                                      "--warmup", str(args.warmup), "--profile-steps", str(args.profile_steps)]
        env = {**os.environ, **launcher.worker_env("cpu"), "PYTHONPATH": REPO}
        proc = subprocess.run(argv, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-4000:], proc.stderr[-4000:], file=sys.stderr)
            return proc.returncode
        result = json.loads(open(os.path.join(out, "result.json")).read())
    if args.save:
        with open(f"{args.save}.{strategy}.json", "w") as fh:
            json.dump(result, fh, indent=1)
    print(f"machine: {os.cpu_count()} CPU cores, gloo, world size {args.world_size}, strategy {strategy}, "
          f"model d_model={args.d_model} layers={args.layers} seq={args.seq} global_batch={args.batch}")
    print(f"triples: {args.pairs} of bare + instrumented + bare-again steps, interleaved, the six orders in turn, "
          f"after {args.warmup} warm-up triples; intervals: moving-block bootstrap, blocks of {BLOCK} triples")
    print(f"bare tokens/s:         {result['bare']:,.0f}")
    print(f"instrumented tokens/s: {result['instrumented']:,.0f}")
    lo, hi = result["ci95"]
    print(f"barrier per step:      {1000 * result['barrier_s']:.2f} ms (in both sides; "
          f"{100 * result['barrier_s'] / result['bare_step_s']:.1f}% of a bare step)")
    print(f"paired step ratios:    median {result['pair_median']:.3f}")
    clo, chi = result["control_ci95"]
    print(f"control, bare against bare again (true ratio 1: the benchmark's resolution here): "
          f"{result['control']:.4f}, 95% interval {clo:.4f}-{chi:.4f}")
    print(f"ratio (total time):    {result['ratio']:.4f}, 95% interval {lo:.4f}-{hi:.4f}")
    added = result.get("added")
    if added:
        print(f"what the instrumented step adds (cProfile, {added['steps']} steps of each; an upper bound): "
              f"{1000 * added['per_step_s']:.3f} ms per step = {100 * added['per_step_s'] / result['bare_step_s']:.2f}% "
              "of a bare step")
        for fn_name, per_step in added["top"]:
            print(f"  {1000 * per_step:7.3f} ms  {fn_name}")
    print(f"control_ratio {strategy}: {result['control']:.3f}")
    print(f"overhead_ratio {strategy}: {result['ratio']:.3f}")
    return 0


def inner(spec_path: str, pairs: int, warmup: int, profile_steps: int = 0) -> None:
    """Inside torchrun: interleave bare and instrumented steps; rank 0 writes result.json."""
    import torch

    from shardscope.core import events
    from shardscope.config import Comparison
    from shardscope.core import registry
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

    def bare_step(step: int) -> None:
        prep.set_lr(settings.lr)
        prep.zero_grad()
        for inputs, targets in micro_batches(step):
            loss = loop.loss_fn(prep.model(inputs), targets) / settings.grad_accum
            prep.backward(loss)
        prep.clip_and_step(settings.grad_clip)

    writer = events.RecordWriter(os.path.join(spec["run_dir"], "metrics", f"rank{ctx.rank}.jsonl"), "bench", ctx.rank)
    cfg = loop.LoopConfig(global_batch=comparison.global_batch, tokens_per_sample=source.tokens_per_sample,
                          min_lr_ratio=comparison.min_lr_ratio)
    trainer = loop.Trainer(prep, ctx, settings, cfg, micro_batches, writer)
    barrier = torch.distributed.barrier
    times: dict[str, list[float]] = {name: [] for name in ARMS}
    orders = list(itertools.permutations(ARMS))
    barrier()
    last = time.perf_counter()
    for triple in range(warmup + pairs):
        order = orders[triple % len(orders)]
        for position, name in enumerate(order):
            step = len(ARMS) * triple + position
            if name == "instrumented":
                trainer.step(step)
            else:
                bare_step(step)
            barrier()  # every rank's work on this step ends before the clock reads
            now = time.perf_counter()
            if triple >= warmup:
                times[name].append(now - last)
            last = now
    added = _profile_added(bare_step, trainer.step, len(ARMS) * (warmup + pairs), profile_steps) if profile_steps else None
    trainer.finish()
    barrier()
    t0 = time.perf_counter()
    for _ in range(200):
        barrier()
    barrier_s = (time.perf_counter() - t0) / 200
    writer.close()
    if ctx.rank == 0:
        bare, instr, again = times["bare"], times["instrumented"], times["bare again"]
        ratio = sum(bare) / sum(instr)
        result = {"bare": tokens * len(bare) / sum(bare), "instrumented": tokens * len(instr) / sum(instr),
                  "ratio": ratio, "ci95": _bootstrap(bare, instr), "barrier_s": barrier_s,
                  "control": sum(bare) / sum(again), "control_ci95": _bootstrap(bare, again),
                  "bare_step_s": statistics.median(bare),
                  "pair_median": statistics.median(b / i for b, i in zip(bare, instr)), "steps_s": times,
                  "added": added}
        with open(os.path.join(spec["out_dir"], "result.json"), "w") as fh:
            json.dump(result, fh)
    torch.distributed.destroy_process_group()


def _profile_added(bare, instrumented, first_step: int, n: int) -> dict:
    """Both loops side by side under cProfile, ``n`` steps each: the calls the instrumented step makes beyond the
    bare one (a function only it calls, or the share of calls beyond the bare step's), as own time per step.
    cProfile slows Python calls, so these are upper bounds on what the instrumentation costs in Python."""
    import cProfile
    import pstats

    own = {}
    for name, fn in (("bare", bare), ("instrumented", instrumented)):
        prof = cProfile.Profile()
        prof.enable()
        for s in range(n):
            fn(first_step + s)
        prof.disable()
        own[name] = {f"{os.path.basename(k[0])}:{k[1]}({k[2]})": (v[1], v[2]) for k, v in pstats.Stats(prof).stats.items()}
    extra = {}
    for fn_name, (calls, own_s) in own["instrumented"].items():
        bare_calls = own["bare"].get(fn_name, (0, 0.0))[0]
        if calls > bare_calls:
            extra[fn_name] = own_s * (calls - bare_calls) / calls / n
    top = sorted(extra.items(), key=lambda kv: -kv[1])
    return {"steps": n, "per_step_s": sum(extra.values()), "top": top[:10]}


def _bootstrap(bare: list[float], instr: list[float], rounds: int = 2000) -> tuple[float, float]:
    """95% interval of sum(bare)/sum(instr), a moving-block bootstrap over triples: blocks of ``BLOCK`` consecutive
    triples drawn with replacement (seeded: the same data gives the same interval)."""
    import random

    rng = random.Random(0)
    n = len(bare)
    block = min(BLOCK, n)
    starts = n - block + 1
    ratios = []
    for _ in range(rounds):
        idx = [i for _ in range(-(-n // block)) for first in (rng.randrange(starts),) for i in range(first, first + block)]
        ratios.append(sum(bare[i] for i in idx) / sum(instr[i] for i in idx))
    ratios.sort()
    return ratios[int(0.025 * rounds)], ratios[int(0.975 * rounds) - 1]


def main() -> int:
    """Parse arguments; run the outer launcher or the inner rank body."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--strategies", default="ddp,fsdp2", help="comma-separated registry names")
    parser.add_argument("--pairs", type=int, default=600,
                        help="timed triples of steps (bare, instrumented, bare again; the name is kept from two arms)")
    parser.add_argument("--warmup", type=int, default=10, help="triples run first and not timed")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--profile-steps", type=int, default=100,
                        help="then profile this many steps of each loop (cProfile) and list what the instrumented adds")
    parser.add_argument("--save", default="", help="also write every step's time to SAVE.<strategy>.json")
    args = parser.parse_args()
    if args.inner:
        from shardscope.engines import stack_room
        from shardscope.engines.worker import exit_now  # skip finalization: see its docstring

        # Both loops with room on CPython's frame stack, as a rank's loop runs (engines/stack_room.py).
        stack_room.call(inner, args.inner, args.pairs, args.warmup, args.profile_steps)
        exit_now(0)
    return outer(args)


if __name__ == "__main__":
    sys.exit(main())
