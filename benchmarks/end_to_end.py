"""End to end: a shardscope run's median tokens/s against a bare torchrun loop over the same model and batch.

``overhead.py`` interleaves steps inside one job; this runs whole jobs, as a user does: ``shardscope run --headless``
of one strategy (no A/A control, no profiler) and a bare loop written here, independently of ``engines/loop.py``
(its own torchrun job: DDP or FSDP2 as torch documents them, torch's AdamW, the step timed with ``perf_counter``
from the step's start to the optimizer's end), alternating A B A B ... so both see the same machine. The bare loop
builds the same model from the same preset (shardscope's model builder, the built-in transformer) and feeds it
batches of the same shape prepared before the first step. Both take the median over steps after step 0.

    python benchmarks/end_to_end.py [--preset smoke] [--strategies ddp,fsdp2] [--repeats 5] [--steps 60]
                                    [--arms shardscope,bare]

Each repeat's line also gives rank 0's mean wait for a core per step (schedstat's run delay; shardscope's
``cpu_wait_s``): on a machine whose ranks fill its cores, work of any other process there (shardscope's
orchestrator, torchrun's agent) shows up as that wait, and as the peer's wait in the next collective.

A second shardscope arm runs its ranks as new interpreters (``launch.start_method = "exec"``) instead of forking
them from the preloaded agent. Two bare arms: the loop as a user writes it, and the same loop run with room on CPython's frame stack (3.11/3.12:
gh-142183, which shardscope's loop avoids, ``engines/stack_room.py``): against the second, the ratio is shardscope's
own cost. Per strategy the last lines are ``end_to_end_ratio <strategy> vs <arm>: R`` (shardscope / that arm, median
over repeats; the target is >= 0.985 on a quiet machine), after each repeat's rates, then
``end_to_end_busy_ratio <strategy> vs <arm>: R``: the same in tokens per busy CPU second of rank 0 (that arm's median
CPU time per step / shardscope's). On a shared machine the wall-clock ratio of whole jobs run one after another
swings with the other work (one repeat's ratio 0.41-2.80 at load 2.5-4.7, 2026-11-28); CPU time per step swings less
(0.62-1.34 then), and tells a rank that does more work from one that waits more.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

BARE = r'''
import json, os, statistics, sys, time
import torch, torch.distributed as dist
from torch import nn

spec = json.loads(sys.argv[1])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(spec["seed"])
from shardscope.config import ModelSpec
from shardscope.engines.model import build_transformer
model = build_transformer(ModelSpec(**spec["model"]), spec["seed"])
if spec["strategy"] == "ddp":
    model = nn.parallel.DistributedDataParallel(model)
else:
    from torch.distributed.fsdp import fully_shard
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.1)
micro = spec["global_batch"] // world
seq, vocab = spec["model"]["seq_len"], spec["model"]["vocab_size"]
gen = torch.Generator().manual_seed(rank)
batches = [torch.randint(vocab, (micro, seq + 1), generator=gen) for _ in range(spec["steps"])]
rates, busy, waits, phases = [], [], [], []
sched = os.open("/proc/thread-self/schedstat", os.O_RDONLY) if os.path.exists("/proc/thread-self/schedstat") else None


def run_delay():  # seconds this thread has waited for a core (as shardscope's cpu_wait_s), 0.0 where unknown
    return int(os.pread(sched, 128, 0).split()[1]) / 1e9 if sched is not None else 0.0


def one_step(step, tokens):
    t0, c0, w0 = time.perf_counter(), time.process_time(), run_delay()
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if step > 0:
        phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    dt, cpu, wait = time.perf_counter() - t0, time.process_time() - c0, run_delay() - w0
    if step > 0:
        rates.append(spec["global_batch"] * seq / dt)
        busy.append(cpu)
        waits.append(wait)


def loop():
    for step, tokens in enumerate(batches):
        one_step(step, tokens)


if spec["stack_room"]:  # CPython 3.11/3.12 (gh-142183): calls across a frame-stack chunk map and unmap it each time;
    # run the loop in a frame that declares 512 KiB of unused stack, so no step crosses a chunk (as shardscope does)
    import types
    def enter(fn):
        return fn()
    code = enter.__code__
    types.FunctionType(code.replace(co_stacksize=code.co_stacksize + (1 << 16)), globals())(loop)
else:
    loop()
if rank == 0:
    print("BARE_RATE", statistics.median(rates), statistics.median(busy), statistics.mean(waits),
          *(statistics.median(p[i] for p in phases) for i in range(3)), flush=True)
dist.destroy_process_group()
'''


def bare_rate(comparison, strategy: str, steps: int, stack_room: bool,
              retry: bool = True) -> tuple[float, float, float, tuple[float, ...]]:
    """The bare loop's median tokens/s, rank 0's median busy CPU s per step, its mean wait for a core per step
    (``/proc/thread-self/schedstat``'s run delay, as shardscope's ``cpu_wait_s``) and its median forward (with the
    loss), backward and optimizer (clip, step, zero_grad) times, one torchrun job (``stack_room``: its steps run with
    room on CPython's frame stack, as shardscope's loop does)."""
    import dataclasses

    spec = {"strategy": strategy, "seed": comparison.seed, "lr": comparison.lr, "steps": steps, "stack_room": stack_room,
            "global_batch": comparison.global_batch, "model": dataclasses.asdict(comparison.model)}
    spec["model"].pop("described", None)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(BARE)
    try:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                               str(comparison.world_size), "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
                               fh.name, json.dumps(spec)], capture_output=True, text=True, env=env, timeout=900)
    finally:
        os.remove(fh.name)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("BARE_RATE")]
    if proc.returncode or not lines:
        if retry:  # a bare loop aborted once on gloo (SIGABRT in a rank, 2026-11-28): said, run again, not hidden
            print(f"bare loop failed (exit {proc.returncode}), run again: "
                  f"{[line for line in proc.stderr.splitlines() if 'rror' in line][-1:]}", flush=True)
            return bare_rate(comparison, strategy, steps, stack_room, retry=False)
        raise RuntimeError(f"bare loop failed: {proc.stderr[-2000:]}")
    rate, busy, wait, *phases = (float(v) for v in lines[-1].split()[1:7])
    return rate, busy, wait, tuple(phases)


def shardscope_rate(preset: str, strategy: str, steps: int, out: str,
                    start_method: str = "auto") -> tuple[float, float, float, tuple[float, ...]]:
    """A shardscope run of one strategy (no control, no profiler): its summary's median tokens/s, and over rank 0's
    steps after step 0 the median ``busy_s`` (the process's CPU time over the step, ``engines/step_clock.py``), the
    mean ``cpu_wait_s`` and the median phase times. The preset's file with its runs replaced by that one run."""
    from shardscope import config

    text = config.preset_path(preset).read_text(encoding="utf-8")
    one = os.path.join(os.path.dirname(out), f"{strategy}.toml")
    with open(one, "w", encoding="utf-8") as fh:
        fh.write(text[:text.index("[[runs]]")] + f'[[runs]]\nname = "{strategy}"\nstrategy = "{strategy}"\n')
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "run", "--preset", one, "--headless", "--out",
                           out, "--set", f"steps={steps}", "--set", "profile.enabled=false", "--set", "control=false",
                           "--set", f"launch.start_method='{start_method}'"],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(f"shardscope run failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as fh:
        rate = float(json.load(fh)["runs"][0]["median_tokens_per_s"])
    with open(os.path.join(out, strategy, "metrics", "rank0.jsonl"), encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh if '"kind":"step"' in line]
    steps_after_0 = [r for r in records if r["step"] > 0]
    phases = tuple(statistics.median(r[f"time_{p}_s"] for r in steps_after_0)
                   for p in ("forward", "backward", "optimizer"))
    return (rate, statistics.median(r["busy_s"] for r in steps_after_0),
            statistics.mean(r.get("cpu_wait_s", 0.0) for r in steps_after_0), phases)


def main() -> int:
    """Alternate shardscope runs and bare loops per strategy; print each pair and the median ratio."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smoke")
    parser.add_argument("--strategies", default="ddp,fsdp2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--arms", default="shardscope,shardscope (exec),bare,bare with stack room",
                        help="the arms to run, comma-separated; shardscope (forked) is always one of them")
    args = parser.parse_args()
    from shardscope import config

    comparison = config.load_preset(args.preset, host=config.cpu_host())
    print(f"load average before: {os.getloadavg()[0]:.2f}; preset {args.preset}, {args.steps} steps, "
          f"{comparison.world_size} ranks, {args.repeats} repeats per strategy, A B alternating")
    for strategy in [s.strip() for s in args.strategies.split(",") if s.strip()]:
        known = ("shardscope", "shardscope (exec)", "bare", "bare with stack room")
        asked = [a.strip() for a in args.arms.split(",") if a.strip()]
        if any(a not in known for a in asked):
            parser.error(f"--arms: {asked}; allowed: {', '.join(known)}")
        arms = ("shardscope", *[a for a in known[1:] if a in asked])
        ratios: dict[str, list[float]] = {a: [] for a in arms[1:]}
        busy_ratios: dict[str, list[float]] = {a: [] for a in arms[1:]}
        with tempfile.TemporaryDirectory(prefix="shardscope-e2e-") as tmp:
            for k in range(args.repeats):
                order = arms[k % len(arms):] + arms[:k % len(arms)]  # each arm first in turn
                rates, busy, wait, phases = {}, {}, {}, {}
                for arm in order:
                    if arm.startswith("shardscope"):  # forked ranks (the default on CPU), or new interpreters
                        out = os.path.join(tmp, f"{k}{len(rates)}")
                        measured = shardscope_rate(args.preset, strategy, args.steps, out,
                                                   "exec" if "exec" in arm else "auto")
                    else:
                        measured = bare_rate(comparison, strategy, args.steps, "room" in arm)
                    rates[arm], busy[arm], wait[arm], phases[arm] = measured
                for arm in ratios:
                    ratios[arm].append(rates["shardscope"] / rates[arm])
                    busy_ratios[arm].append(busy[arm] / busy["shardscope"])
                print(f"{strategy} repeat {k} (load {os.getloadavg()[0]:.2f}): "
                      + ", ".join(f"{a} {rates[a]:,.0f}" for a in arms) + " tokens/s; busy CPU ms per step (rank 0): "
                      + ", ".join(f"{busy[a] * 1e3:.2f}" for a in arms)
                      + "; mean wait for a core, ms per step (rank 0): " + ", ".join(f"{wait[a] * 1e3:.2f}" for a in arms)
                      + "; forward/backward/optimizer ms (rank 0 medians): "
                      + ", ".join("/".join(f"{t * 1e3:.1f}" for t in phases[a]) for a in arms), flush=True)
        for arm, values in ratios.items():
            print(f"end_to_end_ratio {strategy} vs {arm}: {statistics.median(values):.3f} (min {min(values):.3f}, "
                  f"max {max(values):.3f})", flush=True)
        for arm, values in busy_ratios.items():  # tokens per busy CPU s: what another process's load distorts least
            print(f"end_to_end_busy_ratio {strategy} vs {arm}: {statistics.median(values):.3f} (min {min(values):.3f}, "
                  f"max {max(values):.3f})", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
