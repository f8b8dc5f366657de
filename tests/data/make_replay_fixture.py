"""Write tests/data/replay-smoke: a small recorded comparison (3 runs, 2 ranks, one failure).

Records follow ``shardscope.events``; times are fixed so the app's views are deterministic.
Run it again (``python tests/data/make_replay_fixture.py``) only to change the fixture.
"""

from __future__ import annotations

import math
import os
import shutil

from shardscope import events
from shardscope.config import RunSpec, dump_json, load_preset

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "replay-smoke")
T0 = 1_700_000_000.0
STEPS = 30
RUNS = {  # name: (strategy, options, tokens/s, loss drift per step, fails at step)
    "ddp": ("ddp", {}, 5200.0, 0.0, None),
    "fsdp2": ("fsdp2", {}, 4700.0, 2e-6, None),
    "fsdp2-fault": ("fsdp2", {"reshard_after_forward": False}, 4500.0, 5e-6, 12),
}
TRACEBACK = """Traceback (most recent call last):
  File "shardscope/engines/worker.py", line 88, in main
    loop.run()
  File "shardscope/engines/loop.py", line 141, in run
    self._maybe_fault(step)
  File "shardscope/engines/loop.py", line 203, in _maybe_fault
    raise RuntimeError(f"injected fault at step {step} on rank {self.rank}")
RuntimeError: injected fault at step 12 on rank 1"""


def rec(kind: str, run: str, rank: int, t: float, **fields) -> str:
    r = events.make_record(kind, run, rank, **fields)
    r["t"] = round(t, 3)
    return events.encode(r)


def write_run(name: str, strategy: str, options: dict, rate: float, drift: float, fail_at: int | None, t: float) -> dict:
    run_dir = os.path.join(OUT, name)
    os.makedirs(os.path.join(run_dir, "metrics"))
    os.makedirs(os.path.join(run_dir, "traces"))
    dump_json(os.path.join(run_dir, "spec.json"), {"run": {"name": name, "strategy": strategy, "world_size": 2,
                                                            "precision": "fp32", "options": options}})
    console = [f"[shardscope] torchrun --nproc-per-node 2 -m shardscope.engines.worker {name}/spec.json"]
    losses = []
    for rank in (0, 1):
        lines = [rec("start", name, rank, t, world_size=2, device="cpu", backend="gloo", precision={"policy": "fp32"})]
        step_t = t + 1.0
        last = STEPS - 1 if fail_at is None else fail_at - 1
        for step in range(last + 1):
            step_t += 0.35
            loss = 5.5 * math.exp(-step / 10) + 0.6 + 0.05 * math.sin(step) + drift * step
            jitter = rate * (1 + 0.03 * math.sin(step * 1.7 + rank))
            lines.append(rec("step", name, rank, step_t, step=step, loss=round(loss, 7), grad_norm=1.0 / (1 + step),
                             lr=3e-3, step_time_s=0.35, tokens=512, tokens_per_s=round(jitter, 1),
                             mem_peak_bytes=(180 + 20 * rank) * 2**20 + step * 4096, rss_bytes=(420 + rank) * 2**20))
            if rank == 0:
                losses.append(loss)
            if step == 5:
                lines.append(rec("memory", name, rank, step_t, param_bytes=2_000_000, grad_bytes=2_000_000,
                                 optim_bytes=4_000_000, model_state_bytes=8_000_000,
                                 mem_peak_bytes=(190 + 20 * rank) * 2**20, rss_bytes=(430 + rank) * 2**20))
            if step == 11 and fail_at is None:
                coll = ({"all_reduce": {"count": 8, "time_s": 0.0211, "bytes": 3_334_144}} if strategy == "ddp" else
                        {"all_gather": {"count": 12, "time_s": 0.0254, "bytes": 3_334_144},
                         "reduce_scatter": {"count": 6, "time_s": 0.0132, "bytes": 1_667_072}})
                lines.append(rec("comm", name, rank, step_t, steps=[10, 11], collectives=coll))
                lines.append(rec("trace", name, rank, step_t, path=f"traces/rank{rank}.json", format="chrome",
                                 steps=[10, 11]))
        if fail_at is not None and rank == 1:
            lines.append(rec("error", name, rank, step_t + 0.1, message=f"RuntimeError: injected fault at step {fail_at} on rank 1",
                             traceback=TRACEBACK))
            lines.append(rec("end", name, rank, step_t + 0.1, status="failed", steps_completed=fail_at))
        elif fail_at is None:
            lines.append(rec("end", name, rank, step_t + 0.2, status="ok", steps_completed=STEPS))
        with open(os.path.join(run_dir, "metrics", f"rank{rank}.jsonl"), "w", encoding="utf-8") as fh:
            fh.writelines(lines)
        if fail_at is None:
            with open(os.path.join(run_dir, "traces", f"rank{rank}.json"), "w", encoding="utf-8") as fh:
                fh.write('{"traceEvents": []}\n')
    for step in range(0, len(losses), 10):
        console.append(f"[rank0] step {step:3d} loss {losses[step]:.4f}")
    if fail_at is not None:
        console += ["[rank1] " + line for line in TRACEBACK.splitlines()]
        console.append("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: shardscope.engines.worker FAILED")
    else:
        console.append("[rank0] done")
    with open(os.path.join(run_dir, "console.log"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(console) + "\n")
    return {"losses": losses, "end_t": step_t + 0.2}


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    comparison = load_preset("smoke")
    comparison.runs.append(RunSpec(name="fsdp2-fault", strategy="fsdp2", options={"reshard_after_forward": False},
                                   fault="rank=1,step=12,kind=raise"))
    comparison.source = "smoke"
    dump_json(os.path.join(OUT, "comparison.json"), comparison.to_dict())
    t = T0
    results = {}
    for name, (strategy, options, rate, drift, fail_at) in RUNS.items():
        results[name] = write_run(name, strategy, options, rate, drift, fail_at, t)
        t = results[name]["end_t"] + 2.0
    base = results["ddp"]["losses"]
    runs = []
    for name, (strategy, _, rate, _, fail_at) in RUNS.items():
        losses = results[name]["losses"]
        diffs = [abs(a - b) for a, b in zip(losses, base)]
        runs.append({"name": name, "strategy": strategy, "world_size": 2, "status": "failed" if fail_at else "ok",
                     "steps_completed": len(losses), "final_loss": round(losses[-1], 6),
                     "median_tokens_per_s": rate, "peak_mem_bytes": 200 * 2**20 + 29 * 4096,
                     "loss_max_abs_diff": max(diffs), "loss_mean_abs_diff": sum(diffs) / len(diffs),
                     "speedup": round(rate / 5200.0, 3), "mem_ratio": 1.0})
    dump_json(os.path.join(OUT, "summary.json"), {"preset": "smoke", "baseline": "ddp", "runs": runs})
    with open(os.path.join(OUT, "report.md"), "w", encoding="utf-8") as fh:
        fh.write("# smoke\n\nRecorded fixture for the app's tests.\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
