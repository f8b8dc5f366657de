"""How fast the app ingests records, how late they reach the screen, how often charts redraw,
and how long ``shardscope`` takes to its first frame.

Synthetic 8 runs x 4 ranks: 8 writer processes append ``events`` step records to
``<tmp>/<run>/metrics/rank<R>.jsonl`` as fast as they can (flushed per line, as ranks do). A
source thread follows the files with the orchestrator's ``MetricsTailer`` every 0.1 s (as a
``Session`` does) and hands each poll's records to the app in one batch; the app runs headless
(``App.run_test``) at 160x48 with the dashboard showing.

Prints: records/s ingested (and that none were dropped), p50/p95/max write-to-display delay
(record ``t`` to the redraw that showed it), redraws/s per chart, and time to first frame.
Targets: >= 20,000 records/s, p95 <= 250 ms, <= 10 redraws/s per chart, first frame <= 1 s.

    python benchmarks/tui_ingest.py [--records-per-rank 2500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from shardscope.core import events
from shardscope.config import RunSpec, cpu_host, dump_json, load_preset
from shardscope.profiling import state as st
from shardscope.orchestrator.tail import MetricsTailer

RUNS, RANKS = 8, 4
POLL_S = 0.1


def write_run(run_dir: str, run: str, per_rank: int, go: "mp.Event", rate: float | None) -> None:
    """Append ``per_rank`` step records to each rank file of one run, round-robin over ranks.

    ``rate`` (records/s for this run) paces the writes; None writes as fast as possible.
    """
    writers = [events.RecordWriter(os.path.join(run_dir, "metrics", f"rank{r}.jsonl"), run, r) for r in range(RANKS)]
    go.wait()
    t0 = time.time()
    for step in range(per_rank):
        if rate is not None:
            ahead = t0 + step * RANKS / rate - time.time()
            if ahead > 0:
                time.sleep(ahead)
        for rank, writer in enumerate(writers):
            writer.write(events.STEP, step=step, local_loss=4.0 / (1 + step * 1e-3) + 0.01 * rank, grad_norm=1.0,
                         lr=3e-4, step_time_s=0.01, tokens=2048, tokens_per_s=2e5 + step, mem_peak_bytes=2**30)
    for writer in writers:
        writer.close()


class TailSource:
    """Follows the runs' metric files like a Session does and posts one batch per poll."""

    def __init__(self, out_dir: str, names: list[str], steps: int) -> None:
        self.out_dir, self.names, self.steps = out_dir, names, steps
        self.finished = False
        self._callbacks = []
        self._stop = threading.Event()

    def subscribe(self, callback) -> None:
        self._callbacks.append(callback)

    def start(self) -> None:
        defined = [st.RunDefined(n, "ddp", RANKS, self.steps, "fp32", {}, os.path.join(self.out_dir, n))
                   for n in self.names]
        for cb in self._callbacks:
            cb(defined + [st.StatusChanged(n, st.RUNNING) for n in self.names])
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        tailers = {n: MetricsTailer(os.path.join(self.out_dir, n, "metrics")) for n in self.names}
        while not self._stop.is_set():
            t0 = time.monotonic()
            batch = []
            for name, tailer in tailers.items():
                records = tailer.poll()
                if records:
                    batch.append(st.RecordsArrived(name, tuple(records), tailer.invalid_lines))
            if batch:
                for cb in self._callbacks:
                    cb(batch)
            self._stop.wait(max(0.0, POLL_S - (time.monotonic() - t0)))

    def stop_run(self, name: str) -> None: ...
    def restart_run(self, name: str) -> None: ...

    def stop_all(self) -> None:
        self._stop.set()
        self.finished = True

    def wait(self, timeout: float | None = None) -> int | None:
        return 0


async def ingest(per_rank: int, rate: float | None = None) -> dict[str, float]:
    """Run the ingest measurement (``rate``: total records/s, None = flat out); return its figures."""
    from shardscope.tui.app import build_app

    total = RUNS * RANKS * per_rank
    with tempfile.TemporaryDirectory() as out:
        names = [f"run{i}" for i in range(RUNS)]
        comparison = load_preset("smoke")
        comparison.runs = [RunSpec(name=n, strategy="ddp", world_size=RANKS) for n in names]
        dump_json(os.path.join(out, "comparison.json"), comparison.to_dict())
        source = TailSource(out, names, per_rank)
        app = build_app(replay_dir=out, source_factory=lambda c, o: source, host=cpu_host())
        app.latencies = []
        app.board.track_latency = True
        go = mp.get_context("fork").Event()
        procs = [mp.get_context("fork").Process(target=write_run, args=(os.path.join(out, n), n, per_rank, go, rate and rate / RUNS))
                 for n in names]
        for p in procs:
            p.start()
        async with app.run_test(size=(160, 48)) as pilot:
            await pilot.pause(0.5)
            charts = list(app.screen.query("StepChart"))
            before = [c.redraws for c in charts]
            t_start = time.time()
            cpu_start = time.process_time()
            go.set()
            t_ingested = None
            while time.time() - t_start < 300:
                await pilot.pause(0.02)
                if t_ingested is None and app.board.records >= total:
                    t_ingested = time.time()
                if t_ingested is not None and not app.board.pending_t:
                    break
            await pilot.pause(0.3)
            elapsed = time.time() - t_start
            cpu_share = (time.process_time() - cpu_start) / elapsed
            redraws = [c.redraws - b for c, b in zip(charts, before)]
            source.stop_all()
            steps_seen = sum(s.steps_completed for s in app.board.states.values())
        for p in procs:
            p.join()
    lat = sorted(app.latencies)
    ingest_s = (t_ingested or time.time()) - t_start
    return {
        "records": total, "ingested": app.board.records, "ingest_s": ingest_s, "records_per_s": app.board.records / ingest_s,
        "p50_ms": 1000 * lat[len(lat) // 2] if lat else float("nan"),
        "p95_ms": 1000 * lat[int(len(lat) * 0.95)] if lat else float("nan"),
        "max_ms": 1000 * lat[-1] if lat else float("nan"),
        "max_redraws_per_s": max(redraws) / elapsed, "elapsed_s": elapsed,
        "steps_ok": steps_seen == RUNS * per_rank, "app_cpu_cores": cpu_share,
        "records_per_cpu_s": app.board.records / max(1e-9, cpu_share * elapsed),
    }


FIRST_FRAME = """
import time, sys
from shardscope.tui.app import build_app
async def first_frame(pilot):
    await pilot.pause()
    print(time.time(), flush=True)
    pilot.app.exit()
build_app().run(headless=True, size=(160, 48), auto_pilot=first_frame)
"""


def first_frame_s(repeats: int = 5) -> tuple[list[float], list[float]]:
    """Return (wall seconds, CPU seconds) from starting a Python process that opens the app to its first frame."""
    import resource

    walls, cpus = [], []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.time()
        res = subprocess.run([sys.executable, "-c", FIRST_FRAME], capture_output=True, text=True, check=True)
        walls.append(float(res.stdout.strip().splitlines()[-1]) - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return walls, cpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records-per-rank", type=int, default=2500)
    parser.add_argument("--paced-rate", type=float, default=20000.0, help="records/s of the paced phase")
    args = parser.parse_args()
    print(f"{RUNS} runs x {RANKS} ranks, {args.records_per_rank} records per rank; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    for label, rate in (("flat out", None), (f"paced at {args.paced_rate:,.0f}/s", args.paced_rate)):
        r = asyncio.run(ingest(args.records_per_rank, rate))
        print(f"[{label}] ingest: {r['ingested']}/{r['records']} records "
              f"({'none dropped' if r['ingested'] == r['records'] else 'DROPPED'}"
              f"{', steps consistent' if r['steps_ok'] else ', STEP COUNT MISMATCH'}) in {r['ingest_s']:.2f} s "
              f"= {r['records_per_s']:,.0f} records/s (target >= 20,000)")
        print(f"[{label}] write-to-display delay: p50 {r['p50_ms']:.0f} ms, p95 {r['p95_ms']:.0f} ms (target <= 250), "
              f"max {r['max_ms']:.0f} ms")
        print(f"[{label}] chart redraws: at most {r['max_redraws_per_s']:.1f}/s per chart over {r['elapsed_s']:.1f} s "
              f"(target <= 10)")
        print(f"[{label}] the app process (UI and tailer threads) used {r['app_cpu_cores']:.2f} CPU cores on average: "
              f"{r['records_per_cpu_s']:,.0f} records per CPU-second (what one free core would sustain)")
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
    ff, cpu = first_frame_s()
    print(f"first frame of `shardscope` (new process to presets screen): median {statistics.median(ff):.2f} s, "
          f"max {max(ff):.2f} s over {len(ff)} starts (target <= 1 s); CPU time median {statistics.median(cpu):.2f} s "
          "(includes the exit)")


if __name__ == "__main__":
    main()
