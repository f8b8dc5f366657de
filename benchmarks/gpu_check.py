"""On a machine with a GPU, one command: every torch strategy for a few profiled steps on NCCL.

    python benchmarks/gpu_check.py [--world-size 1] [--steps 8] [--precision bf16-autocast] [--out DIR]
    python benchmarks/gpu_check.py --plan      # what it would run; needs no GPU

Each strategy that torch itself provides (DeepSpeed's are left out) runs as a real torchrun job
(``shardscope.engines.worker``, NCCL) at ``--world-size`` ranks (default 1) on the classic
transformer, with the profiler window on. Then one markdown table: median tokens/s (step 0 and
profiled steps left out), MFU (known devices only), CUDA allocated / reserved / peak of rank 0
against the predicted peak (the analytic memory model; the traced estimate where the strategy is
traceable), NVML readings mapped to run and rank (the peak GPU memory of each rank's process and of
each GPU while the run was live), whether NCCL kernels appear in the traces, and observed/theory
communication bytes. A figure that could not be measured says why.

Needs only torch (and the light packages the ranks use: safetensors, psutil; nvidia-ml-py for NVML
readings): the app's packages (textual, rich, click, deepspeed, matplotlib) are never imported.
Without a GPU it exits 1 with a message.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from typing import Any, Iterable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from shardscope import config
from shardscope.core import events  # noqa: E402  (torch-free)
from shardscope.core import registry  # noqa: E402
from shardscope.core.numbers import fmt_bytes, median_rate  # noqa: E402  (torch-free; rich only inside functions)

NOT = "not measured"


# --- what runs ---------------------------------------------------------------------------------


def torch_strategies(world_size: int) -> tuple[list[str], dict[str, str]]:
    """(strategies to run, {strategy left out: why}) at ``world_size`` ranks on the built-in transformer."""
    chosen, skipped = [], {}
    for name in registry.names():
        info = registry.get(name)
        options = config.resolved_options(config.RunSpec(name, name))
        tp, mp = info.tp_degree(options), info.model_parallel(options)
        what = f"tp = {tp}" if tp > 1 else f"pp = {mp}"
        if info.needs_deepspeed:
            skipped[name] = "DeepSpeed, not torch"
        elif "transformer" not in info.models:
            skipped[name] = f"runs only {', '.join(info.models)} models"
        elif world_size < max(info.min_world_size, mp) or world_size % mp:
            skipped[name] = f"needs a world size that is a multiple of {what} and >= {max(info.min_world_size, mp)}"
        else:
            chosen.append(name)
    return chosen, skipped


def build_comparison(strategies: list[str], *, world_size: int, steps: int, precision: str) -> config.Comparison:
    """The comparison gpu_check runs: the classic transformer, one run per strategy, profiled from step 3."""
    c = config.Comparison(
        name="gpu-check", steps=steps, global_batch=8 * world_size, world_size=world_size, precision=precision,
        warmup_steps=2, profile=config.ProfileSpec(enabled=True, start_step=3, steps=2),
        launch=config.LaunchSpec(device="cuda"), runs=[config.RunSpec(s, s) for s in strategies])
    c = config.validate(c, host=config.HostInfo("cuda", world_size, f"{world_size} GPU(s)", has_deepspeed=False))
    return c


def gpu_missing() -> str:
    """"" when torch sees a CUDA GPU, else one line saying why this check cannot run here."""
    try:
        import torch
    except ImportError as err:
        return f"torch is not importable ({err})"
    if not torch.cuda.is_available():
        return (f"no CUDA GPU: torch {torch.__version__} reports torch.cuda.is_available() = False; this check runs "
                "strategies on NCCL and reads CUDA memory, so it needs a GPU (--plan shows what it would run)")
    return ""


# --- reading what a run left --------------------------------------------------------------------


def nccl_kernels(trace_path: str) -> int:
    """Number of GPU kernel events whose name contains "nccl" in one Chrome trace (.json or .json.gz)."""
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt", encoding="utf-8") as fh:
        doc = json.load(fh)
    trace_events = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
    return sum(1 for e in trace_events if isinstance(e, dict) and e.get("cat") == "kernel"
               and "nccl" in str(e.get("name", "")).lower())


class NvmlPeaks:
    """Peak NVML readings per run: each rank process's GPU memory and each GPU's used memory."""

    def __init__(self) -> None:
        self.process: dict[tuple[str, int], int] = {}  # (run, rank) -> peak bytes
        self.device: dict[tuple[str, str], int] = {}  # (run, GPU label) -> peak used bytes

    def add(self, sample: Any, live_run: str) -> None:
        """Fold one ``DeviceSample`` taken while ``live_run`` was the only run alive."""
        if sample.source != "nvml":
            return
        for r in sample.readings:
            if r.kind == "process" and r.run:
                for rank in r.ranks:
                    self.process[(r.run, rank)] = max(self.process.get((r.run, rank), 0), r.used_bytes)
            elif r.kind == "gpu":
                key = (live_run, r.label)
                self.device[key] = max(self.device.get(key, 0), r.used_bytes)

    def describe(self, run: str) -> str:
        """"rank 0 1.2 GiB; GPU0 ... 3.4 GiB" for ``run``, or "" when nothing was read for it."""
        parts = [f"rank {rank} {fmt_bytes(b)}" for (r, rank), b in sorted(self.process.items()) if r == run]
        parts += [f"{label.split(' ')[0]} used {fmt_bytes(b)}"
                  for (r, label), b in sorted(self.device.items()) if r == run]
        return "; ".join(parts)


def run_row(c: config.Comparison, run: config.RunSpec, run_dir: str, *, nvml: str,
            traced: dict[str, Any]) -> dict[str, Any]:
    """One table row for a finished run, from its rank 0 records, traces and the predictions."""
    from shardscope.profiling.state import RecordsArrived, RunState
    from shardscope.profiling import memory_model, traces

    path = os.path.join(run_dir, "metrics", "rank0.jsonl")
    records = events.read_records(path)[0] if os.path.isfile(path) else []
    st = RunState(run.name, run.strategy, c.world_size, c.steps)
    st.apply(RecordsArrived(run.name, tuple(records), 0))
    ends = [r for r in records if r.get("kind") == "end"]
    errors = [r for r in records if r.get("kind") == "error"]
    start = next((r for r in records if r.get("kind") == "start"), {})
    memory = [r for r in records if r.get("kind") == "memory"]
    row: dict[str, Any] = {"run": run.name, "status": ends[-1].get("status") if ends else "no end record",
                           "error": str(errors[0].get("message", ""))[:120] if errors else ""}
    row["tokens_per_s"] = median_rate(st.throughput)
    row["mfu"] = (traces.mfu(memory_model.flops_per_token(c.model), row["tokens_per_s"], c.world_size,
                             str(start.get("device_name", ""))) if row["tokens_per_s"] else None)
    last = memory[-1] if memory else {}
    for key in ("mem_alloc_bytes", "mem_reserved_bytes", "mem_peak_bytes"):
        row[key] = last.get(key)
    row["predicted_peak_bytes"] = memory_model.predict_run(c, run)["total_bytes"]
    row["traced_peak_bytes"] = traced.get("peak_bytes")
    row["traced_note"] = traced.get("error", "")
    row["nvml"] = nvml
    chrome = traces.rank_trace_paths(run_dir)
    row["nccl_kernels"] = sum(nccl_kernels(p) for p in chrome) if chrome else None
    analysis = traces.analyse_run(run_dir)
    theory = analysis.get("theory") or {}
    row["split"] = step_split(records)
    row["observed_bytes"] = analysis.get("comm_bytes_per_step")
    row["theory_bytes"] = theory.get("bytes_per_step")
    row["bytes_ratio"] = theory.get("ratio")
    return row


SPLIT = ("time_data_s", "time_forward_s", "time_backward_s", "time_optimizer_s")
TIMED = SPLIT[1:]  # the phases inside step_time_s: the batch is made before the timed step begins (engines/loop.py)


def step_split(records: list[dict[str, Any]]) -> dict[str, float] | None:
    """Median phase times (s) over unprofiled steps after step 0, and ``cover``: the median of (forward +
    backward + optimizer) / (the step's wall time, taken after its sync): on CUDA the phases are stream times
    from CUDA events, so ``cover`` checks them against the host's own clock (near 1, never above it by more
    than timer noise). The data phase (the batch made on the host, and on CUDA the stream's wait for it) comes
    before the timed step, so it is shown but not in ``cover``: an H100 run summed all four to 1.12-1.24x the
    step time. None when the records carry no split."""
    steps = [r for r in records if r.get("kind") == "step" and r.get("step", 0) > 0 and not r.get("profiled")
             and all(isinstance(r.get(k), (int, float)) for k in SPLIT) and r.get("step_time_s")]
    if not steps:
        return None
    out = {k: statistics.median(r[k] for r in steps) for k in SPLIT}
    out["cover"] = statistics.median(sum(r[k] for k in TIMED) / r["step_time_s"] for r in steps)
    return out


# --- the table -------------------------------------------------------------------------------------


def _or_not(value: Any, fmt: str, why: str) -> str:
    return fmt.format(value) if value is not None else f"{NOT} ({why})"


def render_table(rows: Iterable[dict[str, Any]]) -> str:
    """The markdown table of ``run_row`` rows."""
    header = ["run", "status", "tokens/s", "MFU", "CUDA alloc / reserved / peak (rank 0)",
              "predicted peak: analytic / traced",
              "NVML peaks (run's ranks, GPUs)", "NCCL kernels in traces", "comm bytes/step observed / theory",
              "step split ms: data / fwd / bwd / opt ((fwd + bwd + opt) / step time)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cuda = " / ".join(fmt_bytes(r[k]) if r.get(k) is not None else NOT
                          for k in ("mem_alloc_bytes", "mem_reserved_bytes", "mem_peak_bytes"))
        traced = fmt_bytes(r["traced_peak_bytes"]) if r.get("traced_peak_bytes") is not None else \
            f"{NOT} ({r.get('traced_note') or 'no trace'})"
        if r.get("nccl_kernels") is None:
            nccl = f"{NOT} (no traces)"
        else:
            nccl = f"yes ({r['nccl_kernels']})" if r["nccl_kernels"] else "no"
        if r.get("observed_bytes") is None:
            comm = f"{NOT} (no traces)"
        else:
            ratio = f" = {r['bytes_ratio']:.3f}" if r.get("bytes_ratio") is not None else ""
            theory = fmt_bytes(r["theory_bytes"]) if r.get("theory_bytes") is not None else "unknown"
            comm = f"{fmt_bytes(r['observed_bytes'])} / {theory}{ratio}"
        split = r.get("split")
        split_cell = (" / ".join(f"{1000 * split[k]:.1f}" for k in SPLIT) + f" ({split['cover']:.2f}x)" if split
                      else f"{NOT} (no step split in the records)")
        status = r["status"] + (f": {r['error']}" if r.get("error") else "")
        cells = [r["run"], status, _or_not(r.get("tokens_per_s"), "{:,.0f}", "no steps"),
                 _or_not(r.get("mfu"), "{:.1%}", "peak FLOP/s unknown for this device"), cuda,
                 f"{fmt_bytes(r['predicted_peak_bytes'])} / {traced}",
                 r.get("nvml") or f"{NOT} (no NVML reading)", nccl, comm, split_cell]
        lines.append("| " + " | ".join(str(x).replace("|", "\\|") for x in cells) + " |")
    return "\n".join(lines) + "\n"


# --- running -------------------------------------------------------------------------------------


def _launch(c: config.Comparison, run: config.RunSpec, out: str, peaks: NvmlPeaks, sampler: Any) -> int:
    from shardscope.orchestrator import launcher

    spec_path = os.path.join(out, run.name, "spec.json")
    os.makedirs(os.path.join(out, run.name, "metrics"), exist_ok=True)
    config.dump_json(spec_path, config.run_spec_payload(c, run, out_dir=out, device="cuda"))
    argv = launcher.torchrun_argv(spec_path, nproc_per_node=c.world_size, rdzv_id=f"gpu-check-{run.name}")
    env = {**os.environ, **launcher.worker_env("cuda")}
    with open(os.path.join(out, run.name, "console.log"), "ab") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        done = threading.Event()

        def poll() -> None:
            while not done.wait(0.5):
                peaks.add(sampler.sample({run.name: {rank: proc.pid for rank in range(c.world_size)}}), run.name)

        thread = threading.Thread(target=poll, daemon=True)
        if sampler is not None:
            thread.start()
        code = proc.wait()
        done.set()
    return code


def main(argv: list[str] | None = None) -> int:
    """Run every torch strategy on this machine's GPU(s) and print the table; return the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--precision", default="bf16-autocast", choices=config.PRECISIONS)
    p.add_argument("--out", default="")
    p.add_argument("--plan", action="store_true", help="print what would run and exit (no GPU needed)")
    args = p.parse_args(argv)
    chosen, skipped = torch_strategies(args.world_size)
    try:
        c = build_comparison(chosen, world_size=args.world_size, steps=args.steps, precision=args.precision)
    except config.ConfigError as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2
    left_out = "; ".join(f"{k} ({v})" for k, v in skipped.items())
    if args.plan:
        print(f"world size {args.world_size}, {args.steps} steps, {args.precision}; runs: {', '.join(chosen)}")
        print(f"left out: {left_out}")
        return 0
    missing = gpu_missing()
    if missing:
        print(f"gpu_check: {missing}", file=sys.stderr)
        return 1
    import torch

    from shardscope.profiling import estimate

    # Subprocesses (init weights, traced estimates, torchrun ranks) import this checkout's shardscope.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH", "")]))
    out = args.out or tempfile.mkdtemp(prefix="shardscope-gpu-check-")
    os.makedirs(out, exist_ok=True)
    config.dump_json(os.path.join(out, "comparison.json"), c.to_dict())
    subprocess.run([sys.executable, "-m", "shardscope.engines.init_weights", os.path.join(out, "comparison.json"),
                    os.path.join(out, "init.safetensors")], check=True)
    try:
        from shardscope.profiling.nvml import DeviceSampler

        sampler = DeviceSampler()
        nvml_why = "" if sampler.has_nvml else sampler.unavailable_reason or "NVML unavailable"
    except ImportError as err:
        sampler, nvml_why = None, f"nvidia-ml-py absent ({err})"
    peaks = NvmlPeaks()
    traced = estimate.traced_estimates(c, c.world_size)
    rows = []
    for run in c.runs:
        code = _launch(c, run, out, peaks, sampler if not nvml_why else None)
        row = run_row(c, run, os.path.join(out, run.name), nvml=peaks.describe(run.name) or
                      f"{NOT} ({nvml_why or 'no reading'})", traced=traced.get(run.name, {}))
        if code and row["status"] == "ok":
            row["status"] = f"torchrun exit {code}"
        rows.append(row)
    print(f"## gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, world size {c.world_size}, "
          f"{c.precision}, {datetime.date.today().isoformat()}\n")
    print(render_table(rows))
    print(f"Left out: {left_out}. Run directory: {out}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
