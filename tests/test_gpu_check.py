"""benchmarks/gpu_check.py on CPU: its pure parts (what runs, NCCL kernel count, NVML peaks, the row
read from a run directory, the table) and that it runs with the app's packages absent. It was not
run on a GPU here; these tests do not need one.

tests/data/torch215-ddp-run/ is the ddp run of a real `shardscope run --preset smoke` (torch
2.15.0+cu132 on CPU, gloo, profiled steps 2-3): metrics, spec and gzipped Chrome traces of 2 ranks.
"""

from __future__ import annotations

import gzip
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from shardscope import config
from shardscope.core import events
from shardscope.core import registry
from shardscope.profiling.state import DeviceReading, DeviceSample

ROOT = Path(__file__).resolve().parent.parent
RUN = Path(__file__).parent / "data" / "torch215-ddp-run"
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

APP_PACKAGES = ("textual", "rich", "click", "deepspeed", "matplotlib")


def test_every_torch_strategy_runs_and_the_rest_say_why():
    chosen, skipped = gpu_check.torch_strategies(1)
    assert set(chosen) | set(skipped) == set(registry.names())
    for name in registry.names():
        info = registry.get(name)
        if info.needs_deepspeed:
            assert skipped[name] == "DeepSpeed, not torch"
        elif info.tp_option:
            assert "tp = 2" in skipped[name]  # tensor parallel needs 2 ranks
        elif info.pp_option:
            assert "pp = 2" in skipped[name]  # a pipeline needs 2 ranks
        else:
            assert name in chosen
    assert {"ddp", "fsdp1", "fsdp2", "fsdp-handwritten"} <= set(chosen)
    assert "fsdp2-tp" in gpu_check.torch_strategies(2)[0] and "pp-zero-bubble" in gpu_check.torch_strategies(2)[0]
    c = gpu_check.build_comparison(chosen, world_size=1, steps=8, precision="bf16-autocast")
    assert [r.name for r in c.runs] == chosen and c.profile.enabled and c.profile.start_step + c.profile.steps < 8


def _trace(path: Path, names_cats: list[tuple[str, str]]) -> None:
    doc = {"traceEvents": [{"ph": "X", "name": n, "cat": cat, "ts": i, "dur": 1, "pid": 0, "tid": 0}
                           for i, (n, cat) in enumerate(names_cats)]}
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as fh:
        json.dump(doc, fh)


@pytest.mark.parametrize("name", ["t.json", "t.json.gz"])
def test_nccl_kernels_are_gpu_kernels_named_nccl(tmp_path, name):
    _trace(tmp_path / name, [("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel"),
                             ("ncclKernel_AllGather_RING_LL_Sum_int8_t", "kernel"),
                             ("ampere_sgemm_128x64_tn", "kernel"),
                             ("nccl:all_reduce", "cpu_op"), ("record_param_comms", "cpu_op")])
    assert gpu_check.nccl_kernels(str(tmp_path / name)) == 2


def test_real_gloo_traces_hold_no_nccl_kernels():
    paths = sorted(RUN.glob("traces/rank*.trace.json.gz"))
    assert len(paths) == 2 and [gpu_check.nccl_kernels(str(p)) for p in paths] == [0, 0]


def test_nvml_peaks_map_readings_to_run_and_rank():
    peaks = gpu_check.NvmlPeaks()
    gib = 1 << 30
    for used, proc in ((3 * gib, gib), (5 * gib, 2 * gib), (4 * gib, gib)):
        peaks.add(DeviceSample((DeviceReading("GPU0 NVIDIA H100", "gpu", used, 80 * gib, run="ddp", ranks=(0,)),
                                DeviceReading("ddp rank 0 (GPU process memory, GPU0)", "process", proc, run="ddp",
                                              ranks=(0,))), "nvml"), "ddp")
    peaks.add(DeviceSample((DeviceReading("ddp rank 0 (process RSS)", "process", 9 * gib, run="ddp", ranks=(0,)),),
                           "process-rss"), "ddp")  # RSS is not an NVML reading
    assert peaks.describe("ddp") == "rank 0 2.0 GiB; GPU0 used 5.0 GiB"
    assert peaks.describe("fsdp2") == ""


def test_row_from_a_real_run_directory_and_the_table_says_what_was_not_measured():
    spec = json.loads((RUN / "spec.json").read_text())
    c = config.Comparison.from_dict({**spec["comparison"], "runs": [{"name": "ddp", "strategy": "ddp"}]})
    row = gpu_check.run_row(c, c.runs[0], str(RUN), nvml="", traced={"error": "not traceable"})
    records = events.read_records(RUN / "metrics" / "rank0.jsonl")[0]
    rates = [r["tokens_per_s"] for r in records if r["kind"] == "step" and r["step"] > 0 and not r.get("profiled")]
    assert row["status"] == "ok" and row["tokens_per_s"] == statistics.median(rates)
    assert row["mfu"] is None  # a CPU: no peak FLOP/s
    assert row["mem_alloc_bytes"] is None and row["mem_reserved_bytes"] is None  # no CUDA allocator on CPU
    assert row["nccl_kernels"] == 0
    assert row["bytes_ratio"] == pytest.approx(1.0, abs=0.02)  # DDP all-reduces every gradient once
    table = gpu_check.render_table([row])
    line = table.splitlines()[2]
    assert line.startswith("| ddp | ok |") and "not measured (peak FLOP/s unknown" in line
    assert "not measured / not measured" in line and "not measured (not traceable)" in line
    assert "not measured (no NVML reading)" in line and "| no |" in line and " = 1.000 |" in line
    assert row["split"] is None and line.endswith("| not measured (no step split in the records) |")  # old records


def test_step_split_is_the_phases_median_and_their_cover_of_the_step():
    def step(n, phases, wall, **extra):
        return {"kind": "step", "step": n, "step_time_s": wall, **dict(zip(gpu_check.SPLIT, phases)), **extra}

    records = [step(0, (9, 9, 9, 9), 40.0),  # set-up step: left out
               step(1, (0.001, 0.010, 0.020, 0.004), 0.040),
               step(2, (0.002, 0.011, 0.021, 0.005), 0.041, profiled=True),  # profiled: left out
               step(3, (0.001, 0.012, 0.022, 0.005), 0.042),
               step(4, (0.003, 0.014, 0.024, 0.006), 0.050),
               {"kind": "step", "step": 5, "step_time_s": 0.04}]  # no split: left out
    split = gpu_check.step_split(records)
    assert split["time_forward_s"] == pytest.approx(0.012) and split["time_backward_s"] == pytest.approx(0.022)
    # the data phase is made before the timed step: not part of what the step time covers
    assert split["cover"] == pytest.approx(statistics.median([0.034 / 0.040, 0.039 / 0.042, 0.044 / 0.050]))
    line = gpu_check.render_table([{"run": "ddp", "status": "ok", "predicted_peak_bytes": 1, "split": split}])
    assert line.splitlines()[2].endswith("| 1.0 / 12.0 / 22.0 / 5.0 (0.88x) |")


def _run_without_app_packages(*args: str) -> subprocess.CompletedProcess:
    block = f"import sys; sys.modules.update(dict.fromkeys({APP_PACKAGES!r}))"
    code = (f"{block}; import runpy; sys.argv = ['gpu_check.py', *{list(args)!r}]; "
            f"runpy.run_path({str(ROOT / 'benchmarks' / 'gpu_check.py')!r}, run_name='__main__')")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_plan_runs_where_the_apps_packages_are_absent():
    proc = _run_without_app_packages("--plan")
    assert proc.returncode == 0, proc.stderr
    chosen, _ = gpu_check.torch_strategies(1)
    assert f"runs: {', '.join(chosen)}" in proc.stdout
    assert "deepspeed-zero3 (DeepSpeed, not torch)" in proc.stdout


def test_without_a_gpu_it_exits_1_with_a_clear_message():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = _run_without_app_packages()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("gpu_check: no CUDA GPU: torch ") and "needs a GPU" in proc.stderr
