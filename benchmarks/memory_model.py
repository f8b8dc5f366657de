"""Memory model vs exact accounting: real CPU runs of every strategy at world sizes 1, 2, 4.

Runs a tiny transformer preset through the real command line (torchrun, gloo, 2 steps, no
profiler) at each world size, replays the run directories, and compares the memory model's
per-rank model-state bytes with the exact ``memory`` records (every rank). Target: within 3% for
every strategy. Prints a table and writes ``--json`` if asked.

    python benchmarks/memory_model.py [--world-sizes 1,2,4] [--json out.json] [--keep DIR | --existing DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PRESET = """
name = "memory-model-bench"
description = "memory model benchmark"
steps = 2
global_batch = 4
warmup_steps = 1
precision = "fp32"
world_size = 2
stall_timeout_s = 300

[model]
kind = "transformer"
vocab_size = 250
d_model = 36
n_layers = 2
n_heads = 4
d_ff = 100
seq_len = 30

[profile]
enabled = false
"""

RUNS = [  # (name, strategy, options)
    ("ddp", "ddp", {}),
    ("fsdp1", "fsdp1", {}),
    ("fsdp1-grad-op", "fsdp1", {"sharding_strategy": "SHARD_GRAD_OP"}),
    ("fsdp2", "fsdp2", {}),
    ("fsdp-handwritten", "fsdp-handwritten", {}),
    ("zero1", "deepspeed-zero1", {}),
    ("zero2", "deepspeed-zero2", {}),
    ("zero3", "deepspeed-zero3", {}),
    ("fsdp2-tp", "fsdp2-tp", {"tp": 2}),
]


def preset_text(world_size: int) -> str:
    """The preset with every run that can be laid out at ``world_size``."""
    out = [PRESET.replace("world_size = 2", f"world_size = {world_size}")]
    for name, strategy, options in RUNS:
        if options.get("tp", 1) > world_size or world_size % options.get("tp", 1):
            continue
        opts = ", ".join(f"{k} = {json.dumps(v)}" for k, v in options.items())
        out.append(f'[[runs]]\nname = "{name}"\nstrategy = "{strategy}"\n' + (f"options = {{ {opts} }}\n" if opts else ""))
    return "\n".join(out)


def run_world_size(world_size: int, work: Path) -> Path:
    """Run the preset at ``world_size``; return its run directory."""
    preset = work / f"bench-ws{world_size}.toml"
    preset.write_text(preset_text(world_size))
    out = work / f"ws{world_size}"
    cmd = [sys.executable, "-m", "shardscope.cli", "run", "-p", str(preset), "--headless", "--out", str(out),
           "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"shardscope run failed at world size {world_size}:\n{proc.stderr[-3000:]}")
    return out


def compare(out: Path) -> list[dict]:
    """Rows of predicted vs measured model-state bytes per run (worst rank)."""
    from shardscope.analysis import fold
    from shardscope.analysis.report import memory_section

    comparison = fold.load_comparison(str(out))
    states = fold.replay_states(str(out))
    section = memory_section(comparison, states)
    rows = []
    for run in comparison.runs:
        st = states[run.name]
        entry = section["runs"].get(run.name, {})
        per_rank = entry.get("per_rank", {})
        worst = max(per_rank.values(), key=lambda r: abs(r.get("error", 0.0)), default=None)
        rows.append({
            "world_size": st.world_size, "run": run.name, "strategy": run.strategy, "status": st.status,
            "shards": (entry.get("predicted") or {}).get("shards"),
            "predicted": worst and worst["predicted"]["model_state_bytes"],
            "measured": worst and worst["measured"]["model_state_bytes"],
            "error": entry.get("model_state_error"),
            "parts": worst,
            "failure": st.error[:200] if st.status != "ok" else "",
        })
    return rows


def main() -> int:
    """Run the benchmark; exit 1 when a run that completed is off by more than 3%."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--json", default="")
    parser.add_argument("--keep", default="", help="keep run directories here")
    parser.add_argument("--existing", default="", help="compare the ws<N> run directories already in this folder")
    args = parser.parse_args()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="ss-memmodel-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for ws in (int(x) for x in args.world_sizes.split(",")):
        began = time.time()
        rows += compare(Path(args.existing) / f"ws{ws}" if args.existing else run_world_size(ws, work))
        print(f"world size {ws}: {time.time() - began:.0f} s", file=sys.stderr)
    print(f"{'ws':>2} {'run':<17} {'shards':<6} {'status':<7} {'predicted B':>12} {'measured B':>12} {'worst |err|':>12}")
    bad = 0
    for r in rows:
        err = "-" if r["error"] is None else f"{r['error']:.2%}"
        print(f"{r['world_size']:>2} {r['run']:<17} {r['shards'] or '-':<6} {r['status']:<7} {r['predicted'] or 0:>12,} "
              f"{r['measured'] or 0:>12,} {err:>12} {r['failure']}")
        bad += r["error"] is not None and abs(r["error"]) > 0.03
    ok = [r for r in rows if r["error"] is not None]
    print(f"{len(ok)} run/world-size pairs measured, {bad} beyond 3%; worst "
          f"{max((abs(r['error']) for r in ok), default=0):.2%}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
