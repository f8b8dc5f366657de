"""Cost of the profiler window, and the size of the traces it leaves, measured in one run.

Runs a preset through the real command line (default: ``smoke``, with the profiler on as the
preset has it), then for each run of the comparison, from rank 0's step records:

- step-time cost: average throughput over all steps (tokens / summed step time) against the
  same run with its profiled steps replaced by the mean unprofiled step time;
- wall-clock cost: the same, on record timestamps (this includes exporting the trace files,
  which happens after the window's last step);
- trace bytes: the run's Chrome traces, and on disk with the TensorBoard files (the Chrome file is
  a hard link to the TensorBoard one where the filesystem allows, so each inode counts once).

Target: the window costs at most 5% of the run's average throughput; a 4-rank run's traces stay
under 50 MB. Noise: on a shared CPU a single step can vary by tens of percent; read the figures
with the unprofiled steps' spread, which is printed too.

    python benchmarks/profiler_overhead.py [--preset smoke] [--set KEY=VALUE ...] [--keep DIR]
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def costs(run_dir: str) -> dict:
    """Overhead figures of one run directory from rank 0's step records."""
    from shardscope.core.events import read_records
    from shardscope.profiling import traces

    records, _ = read_records(os.path.join(run_dir, "metrics", "rank0.jsonl"))
    steps = [r for r in records if r.get("kind") == "step"]
    profiled = [r for r in steps if r.get("profiled")]
    plain = [r for r in steps[1:] if not r.get("profiled")]  # step 0 is warm-up everywhere
    if not steps or not plain:
        return {}
    mean_plain = statistics.fmean(r["step_time_s"] for r in plain)
    n = len(steps) - 1
    with_window = sum(r["step_time_s"] for r in steps[1:])
    without = mean_plain * n
    walls = [b["t"] - a["t"] for a, b in zip(steps, steps[1:])]
    wall_with = sum(walls)
    wall_plain = [w for w, r in zip(walls, steps[1:]) if not r.get("profiled")]
    # The export runs after the window's last step, so it lands in the next interval too.
    wall_without = statistics.median(wall_plain) * len(walls)
    # Time between profiled steps' records beyond their own step time: starting, stopping, exporting.
    outside = sum(w - r["step_time_s"] for w, r in zip(walls, steps[1:]) if r.get("profiled"))
    chrome = traces.rank_trace_paths(run_dir)
    every = glob.glob(os.path.join(run_dir, "traces", "**", "*.json"), recursive=True)
    return {
        "steps": len(steps), "profiled_steps": len(profiled),
        "step_time_cost": 1 - without / with_window,
        "wall_cost": 1 - wall_without / wall_with,
        "profiled_step_slowdown": (statistics.fmean(r["step_time_s"] for r in profiled) / mean_plain) if profiled else None,
        "outside_steps_s": outside,
        "run_wall_s": wall_with,
        "plain_step_cv": statistics.pstdev(r["step_time_s"] for r in plain) / mean_plain,
        "trace_mb": sum(map(os.path.getsize, chrome)) / 1e6,
        "trace_mb_with_tb": _disk_bytes(every) / 1e6,
        "ranks": len(chrome),
    }


def _disk_bytes(paths: list[str]) -> int:
    """Bytes on disk of ``paths``, each inode once (hard links share their bytes)."""
    seen: dict[tuple[int, int], int] = {}
    for path in paths:
        st = os.stat(path)
        seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def main() -> int:
    """Run the benchmark; exit 1 when a run's window costs more than 5% (step time)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smoke")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--keep", default="")
    parser.add_argument("--existing", default="", help="analyse this run directory instead of running")
    args = parser.parse_args()
    if args.existing:
        out = Path(args.existing)
    else:
        out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="ss-profbench-")) / "run"
        cmd = [sys.executable, "-m", "shardscope.cli", "run", "-p", args.preset, "--headless", "--out", str(out),
               "--device", "cpu"] + [x for kv in args.overrides for x in ("--set", kv)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    worst = 0.0
    for run_dir in sorted(p for p in glob.glob(str(out / "*")) if os.path.isdir(os.path.join(p, "metrics"))):
        c = costs(run_dir)
        if not c:
            continue
        worst = max(worst, c["step_time_cost"])
        print(f"{os.path.basename(run_dir)}: {c['steps']} steps, {c['profiled_steps']} profiled; window cost "
              f"{c['step_time_cost']:.1%} of average throughput (step time), {c['wall_cost']:.1%} (wall clock, "
              f"with export: {c['outside_steps_s']:.2f} s of {c['run_wall_s']:.2f} s); profiled steps {c['profiled_step_slowdown']:.2f}x; unprofiled step CV "
              f"{c['plain_step_cv']:.0%}; traces {c['ranks']} ranks {c['trace_mb']:.1f} MB "
              f"({c['trace_mb_with_tb']:.1f} MB on disk with the TensorBoard files, hard links counted once)")
    print(f"run directory: {out}")
    return 0 if worst <= 0.05 else 1


if __name__ == "__main__":
    raise SystemExit(main())
