"""Trace analysis speed and trace sizes.

1. Speed: builds ~100 MB of traces (4 rank files, like a 4-rank run) from real torch.profiler
   traces by repeating their profiled steps with shifted timestamps (each repeat is a real step's
   events; only ts and step numbers change), in torch's exporter layout, then times
   ``traces.analyse_traces`` on them (best of --repeats) and, for reference, ``json.load`` of the
   same files. Target: under 2 s for 100 MB.
2. Size: with ``--run-dir`` pointing at a real run (``<run>/traces/rank*.trace.json``), reports the
   run's trace bytes. Target: a 4-rank run's traces under 50 MB with the default profiler window.

    python benchmarks/trace_analysis.py --source RUN_DIR [--mb 100] [--run-dir RUN_DIR]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shardscope.profiling import traces  # noqa: E402


def scaled_trace(source: str, target_bytes: int, out_path: str) -> int:
    """Write a trace of about ``target_bytes`` made of repeats of ``source``'s events; return its size."""
    with open(source, encoding="utf-8") as fh:
        doc = json.load(fh)
    events = doc["traceEvents"]
    timed = [e for e in events if "ts" in e and e.get("ph") == "X"]
    span = max(e["ts"] + e.get("dur", 0) for e in timed) - min(e["ts"] for e in timed) + 10.0
    one = len(json.dumps(events, indent=2))
    repeats = max(1, round(target_bytes / one))
    out_events = [e for e in events if e.get("ph") != "X"]
    for k in range(repeats):
        for e in timed:
            e2 = dict(e)
            e2["ts"] = e["ts"] + k * span
            if e2["name"].startswith("ProfilerStep#"):
                e2["name"] = f"ProfilerStep#{int(e2['name'][13:]) + 100 * k}"
            out_events.append(e2)
    doc = dict(doc, traceEvents=out_events)
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
    return os.path.getsize(out_path)


def main() -> int:
    """Run the benchmark; exit 1 when analysing is slower than 2 s per 100 MB."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True, help="a run directory (or trace file) with real traces")
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--run-dir", action="append", default=[], help="report this run's trace sizes")
    args = parser.parse_args()
    sources = [args.source] if os.path.isfile(args.source) else traces.rank_trace_paths(args.source)
    if not sources:
        raise SystemExit(f"{args.source}: no traces/rank*.trace.json")
    work = tempfile.mkdtemp(prefix="ss-tracebench-")
    paths, total = [], 0
    for rank in range(args.ranks):
        path = os.path.join(work, f"rank{rank}.trace.json")
        total += scaled_trace(sources[rank % len(sources)], int(args.mb * 1e6 / args.ranks), path)
        paths.append(path)
    best = float("inf")
    for _ in range(args.repeats):
        began = time.perf_counter()
        out = traces.analyse_traces(paths)
        best = min(best, time.perf_counter() - began)
    began = time.perf_counter()
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            json.load(fh)
    json_s = time.perf_counter() - began
    per_100mb = best / (total / 1e8)
    print(f"analysed {total / 1e6:.1f} MB in {len(paths)} files: {best:.2f} s (best of {args.repeats}) = "
          f"{per_100mb:.2f} s per 100 MB; json.load alone: {json_s:.2f} s ({json_s / best:.1f}x slower)")
    print(f"  {out['steps_profiled']} steps, collectives: " + ", ".join(
        f"{k} {v['count_per_step']:.0f}/step" for k, v in out["collectives"].items()))
    merged_began = time.perf_counter()
    traces.write_merged_trace({"bench": paths}, os.path.join(work, "merged.json"))
    print(f"  merged trace of the same: {time.perf_counter() - merged_began:.2f} s, "
          f"{os.path.getsize(os.path.join(work, 'merged.json')) / 1e6:.1f} MB")
    for run_dir in args.run_dir:
        files = glob.glob(os.path.join(run_dir, "traces", "**", "*.json"), recursive=True)
        chrome = traces.rank_trace_paths(run_dir)
        print(f"{run_dir}: {len(chrome)} rank traces, {sum(map(os.path.getsize, chrome)) / 1e6:.1f} MB chrome; "
              f"{sum(map(os.path.getsize, files)) / 1e6:.1f} MB with the TensorBoard copies")
    for path in paths:
        os.remove(path)
    return 0 if per_100mb < 2.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
