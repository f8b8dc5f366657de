"""How close is shardscope's start-up to the floor of any torchrun job? Both measured in one run, alternating.

The floor: ``torchrun --standalone --nproc-per-node N`` of a script that imports torch, joins a gloo
process group and does one all-reduce; its time is launch -> the all-reduce done on every rank. The DDP
floor: the same script constructing ``DistributedDataParallel`` around a Linear first (torch's DDP and
FSDP constructors import ``torch._dynamo``, which any job using them pays), printed beside it.

shardscope: ``shardscope run --preset smoke --headless --set steps=S`` (two runs, DDP then FSDP2). From
the rank files it reads

- **first step**: launch of the command -> the first run's training begins (the latest rank's ``start``
  record, written right before step 0);
- **between runs**: end of run k (its last step record on any rank) -> run k+1's training begins;

each as a ratio to the floor measured beside it, and where the time went: the command line, the
first torchrun started, each rank's process start, imports, process group, model (built and
initial weights), strategy, batches (from the ``startup`` marks of the start record). ``agent`` is the
start of the run's torchrun agent: with ``launch.prestart`` (the default) the next run's agent starts ahead,
beside the first run's launch, so between runs its stage is negative (it was there before the last run ended).
With ``launch.start_method`` fork (the default but for DeepSpeed on CUDA) the agent imports torch, ``torch._dynamo`` and the worker
before torchrun forks the ranks from it: ``process`` is then the fork, after the agent's imports, and the
ranks' own imports take nothing.

    python benchmarks/startup.py [--rounds 5] [--steps 10] [--world-size 2] [--preset smoke] [--device cuda]
                                 [--no-bytecode-cache] [--variants default,exec,fork,cold]

``--variants`` (default ``default,exec``) names the launches measured each round, in an order that turns:
``default`` (the shipped settings), ``exec`` (``launch.start_method=exec``: each rank a new interpreter, the
next run's agent still started ahead, the 2026-11-26 default; the default on CUDA), ``fork`` (ranks forked on any
device: on CUDA, to measure it against ``exec``), ``cold`` (``exec`` and ``launch.prestart=false``: torchrun as
it comes). The last two lines are the first variant's.

Both sides run with Python's bytecode cache on, as on a user's machine, even where the environment sets
``PYTHONDONTWRITEBYTECODE`` (this VM's does: then every process compiles shardscope's modules from source,
~80 in the command line before it launches torchrun and ~40 in each rank; torch's were compiled by pip).
``--no-bytecode-cache`` keeps the environment's setting, to see what it costs.

Targets on a quiet machine: first step <= 1.2x the floor, between runs <= 1.0x the floor. The last
lines are ``startup first_step_ratio: R`` and ``startup between_runs_ratio: R`` (medians over rounds).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

FLOOR_SCRIPT = """
import os, sys, time
import torch
import torch.distributed as dist
cuda = sys.argv[3] == "cuda"
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if cuda else "gloo")
if sys.argv[2] == "ddp":  # the second reference: what constructing DDP costs in any job (torch imports dynamo)
    torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8).to("cuda" if cuda else "cpu"))
t = torch.ones(1, device="cuda" if cuda else "cpu")
dist.all_reduce(t)
if cuda:
    torch.cuda.synchronize()
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}"), "w") as fh:
    fh.write(repr(time.time()))
dist.destroy_process_group()
os._exit(0)  # gloo's threads can abort interpreter teardown (see engines/worker.exit_now)
"""

ENV = dict(os.environ)  # what both sides run with (main() may allow the bytecode cache)
STAGES = ("agent", "process", "entry", "imported", "process_group", "model", "strategy", "batches")


def floor_once(world_size: int, work: str, kind: str = "bare", device: str = "cpu") -> float:
    """Launch the bare torchrun job once (``kind`` "ddp": it also wraps a Linear in DDP; ``device`` "cuda": NCCL
    and a CUDA tensor, else gloo); return launch -> every rank's all-reduce done (s)."""
    script = os.path.join(work, "floor.py")
    with open(script, "w", encoding="utf-8") as fh:
        fh.write(FLOOR_SCRIPT)
    marks = tempfile.mkdtemp(dir=work)
    env = {**ENV, "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world_size), script, marks, kind, device], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"floor job ({kind}) exited {proc.returncode}: {proc.stderr[-3000:]}")
    done = [float(open(p, encoding="utf-8").read()) for p in glob.glob(os.path.join(marks, "rank*"))]
    if len(done) != world_size:
        raise RuntimeError(f"floor job: {len(done)} of {world_size} ranks reported")
    return max(done) - t0


def records(out: str, run: str) -> dict[int, list[dict]]:
    """Every rank's records of ``run`` in ``out``."""
    got = {}
    for path in sorted(glob.glob(os.path.join(out, run, "metrics", "rank*.jsonl"))):
        rank = int(os.path.basename(path)[4:].split(".")[0])
        with open(path, encoding="utf-8") as fh:
            got[rank] = [json.loads(line) for line in fh if line.strip()]
    return got


VARIANTS = {  # name -> the --set overrides of that launch
    "default": (),
    "exec": ("launch.start_method='exec'",),
    "fork": ("launch.start_method='fork'",),
    "cold": ("launch.start_method='exec'", "launch.prestart=false"),
}


def shardscope_once(args: argparse.Namespace, work: str, variant: str = "default") -> dict:
    """Run the comparison once; return its timeline (s from launch) and the per-stage breakdown."""
    out = tempfile.mkdtemp(dir=work)
    os.rmdir(out)
    cmd = [sys.executable, "-m", "shardscope.cli", "run", "--preset", args.preset, "--headless", "--out", out,
           "--set", f"steps={args.steps}", "--set", f"world_size={args.world_size}",
           "--set", f"launch.device={args.device}"]
    for override in VARIANTS[variant]:
        cmd += ["--set", override]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    total = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"shardscope exited {proc.returncode}: {proc.stderr[-2000:]}")
    with open(os.path.join(out, "comparison.json"), encoding="utf-8") as fh:
        runs = [r["name"] for r in json.load(fh)["runs"]]
    timeline = []
    for name in runs:
        recs = records(out, name)
        starts = [next(r for r in rs if r["kind"] == "start") for rs in recs.values()]
        steps = [r for rs in recs.values() for r in rs if r["kind"] == "step"]
        stages = {}
        for stage in STAGES:
            values = [s["startup"].get(stage) for s in starts if (s.get("startup") or {}).get(stage)]
            stages[stage] = max(values) - t0 if values else None
        timeline.append({"run": name, "begin": max(s["t"] for s in starts) - t0, "end": max(r["t"] for r in steps) - t0,
                         "stages": stages})
    return {"total": total, "runs": timeline}


def one_round(args: argparse.Namespace, work: str, index: int, variants: list[str]) -> list:
    """The floor, the DDP floor and shardscope (once per launch variant), in an order that turns by round."""
    jobs = [lambda: floor_once(args.world_size, work, device=args.device),
            lambda: floor_once(args.world_size, work, "ddp", args.device)]
    jobs += [lambda p=p: shardscope_once(args, work, p) for p in variants]
    out: list = [None] * len(jobs)
    for k in range(len(jobs)):
        j = (k + index) % len(jobs)
        out[j] = jobs[j]()
    return out


def fmt_stages(run: dict, since: float) -> str:
    """The stages of one run as 'name +dt' from ``since`` (s)."""
    parts, last = [], since
    for stage in STAGES:
        t = run["stages"].get(stage)
        if t is None:
            continue
        parts.append(f"{stage} {t - last:+.2f}")
        last = t
    parts.append(f"start {run['begin'] - last:+.2f}")
    return ", ".join(parts)


def main() -> int:
    """Alternate rounds, print each round and the medians; return 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--preset", default="smoke")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: the floor joins NCCL and reduces a CUDA tensor; the comparison runs on the GPUs")
    parser.add_argument("--no-bytecode-cache", action="store_true",
                        help="keep the environment's PYTHONDONTWRITEBYTECODE (default: cache bytecode, as users do)")
    parser.add_argument("--variants", default="default,exec",
                        help=f"comma-separated launches measured each round, of {', '.join(VARIANTS)} (see above)")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if not variants or any(v not in VARIANTS for v in variants):
        parser.error(f"--variants {args.variants!r}: each must be one of {', '.join(VARIANTS)}")
    if not args.no_bytecode_cache:
        ENV.pop("PYTHONDONTWRITEBYTECODE", None)
    print(f"bytecode cache: {'off (PYTHONDONTWRITEBYTECODE)' if ENV.get('PYTHONDONTWRITEBYTECODE') else 'on'}")
    print(f"load average before: {os.getloadavg()[0]:.2f}; device {args.device}, world size {args.world_size}")
    floors, ddp_floors = [], []
    got: dict[str, dict[str, list[float]]] = {p: {"first": [], "between": [], "ddp_first": [], "ddp_between": []}
                                               for p in variants}
    with tempfile.TemporaryDirectory() as work:
        floor_once(args.world_size, work, device=args.device)  # warm the page cache for both sides
        if not ENV.get("PYTHONDONTWRITEBYTECODE"):  # and the bytecode a user's first run would have left
            subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(REPO, "shardscope")], env=ENV,
                           check=True)
        for i in range(args.rounds):
            floor, ddp_floor, *comparisons = one_round(args, work, i, variants)
            floors.append(floor)
            ddp_floors.append(ddp_floor)
            print(f"round {i + 1}: floor {floor:.2f} s, DDP floor {ddp_floor:.2f} s")
            for variant, ss in zip(variants, comparisons):
                runs, figures = ss["runs"], got[variant]
                first = runs[0]["begin"]
                gaps = [b["begin"] - a["end"] for a, b in zip(runs, runs[1:])]
                figures["first"].append(first / floor)
                figures["ddp_first"].append(first / ddp_floor)
                figures["between"].extend(g / floor for g in gaps)
                figures["ddp_between"].extend(g / ddp_floor for g in gaps)
                print(f"  {variant}: first step {first:.2f} s ({first / floor:.2f}x, "
                      f"{first / ddp_floor:.2f}x DDP) | between runs "
                      f"{', '.join(f'{g:.2f} s ({g / floor:.2f}x, {g / ddp_floor:.2f}x DDP)' for g in gaps)} | "
                      f"whole comparison {ss['total']:.2f} s")
                print(f"    {runs[0]['run']}: launch -> {fmt_stages(runs[0], 0.0)}")
                for a, b in zip(runs, runs[1:]):
                    print(f"    {b['run']}: end of {a['run']} -> {fmt_stages(b, a['end'])}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(f"floor median {statistics.median(floors):.2f} s, DDP floor median {statistics.median(ddp_floors):.2f} s "
          f"over {len(floors)} rounds")
    for variant in variants:
        figures = got[variant]
        print(f"{variant}: first step {statistics.median(figures['first']):.2f}x floor "
              f"({statistics.median(figures['ddp_first']):.2f}x DDP floor), between runs "
              f"{statistics.median(figures['between']):.2f}x ({statistics.median(figures['ddp_between']):.2f}x)")
    shipped = got[variants[0]]
    print(f"startup first_step_ratio: {statistics.median(shipped['first']):.2f} (target <= 1.2)")
    print(f"startup between_runs_ratio: {statistics.median(shipped['between']):.2f} (target <= 1.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
