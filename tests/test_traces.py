"""Trace analysis: synthetic traces in torch's exporter layout, and real gloo traces from torchrun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shardscope.profiling import traces

REPO = Path(__file__).resolve().parents[1]
MAIN, GLOO = 100, 101


def _x(name, ts, dur, *, cat="cpu_op", tid=MAIN, args=None):
    event = {"ph": "X", "cat": cat, "name": name, "pid": MAIN, "tid": tid, "ts": ts, "dur": dur}
    if args is not None:
        event["args"] = args
    return event


def write_trace(path: Path, events: list[dict], *, rank: int = 0, world: int = 2, indent: int | None = 2,
                groups: list[list[int]] | None = None) -> Path:
    """Write a trace the way torch's exporter lays it out (metadata first, fixed key order); ``groups``: the
    ranks of each process group this rank belongs to (``pg_config``)."""
    info = {"backend": "gloo", "rank": rank, "world_size": world}
    if groups is not None:
        info["pg_config"] = [{"pg_name": str(i), "pg_size": len(g), "ranks": g} for i, g in enumerate(groups)]
    doc = {"schemaVersion": 1, "deviceProperties": [], "distributedInfo": info,
           "traceEvents": [{"ph": "M", "name": "thread_name", "pid": MAIN, "tid": GLOO,
                            "args": {"name": "thread 101 (pt_gloo_runloop)"}}] + events}
    path.write_text(json.dumps(doc, indent=indent))
    return path


def ddp_like_events(step_us: float = 1000.0, steps: int = 2) -> list[dict]:
    """Two steps: compute 0-600, an all-reduce of 1000 floats launched at 500 running 550-850."""
    out = []
    for i in range(steps):
        t = i * step_us
        out.append(_x(f"ProfilerStep#{i + 1}", t, step_us - 1, cat="user_annotation"))
        out.append(_x("aten::mm", t + 10, 590))
        out.append(_x("c10d::allreduce_", t + 500, 20, args={"Input Dims": [[[1000]], [], [], [], [], []],
                                                             "Input type": ["TensorList", "", "", "", "Scalar", "Scalar"]}))
        out.append(_x("gloo:all_reduce", t + 550, 300, cat="user_annotation", tid=GLOO,
                      args={"Input Dims": [[1000]], "Input type": ["float"]}))
    return out


def test_collectives_counted_sized_and_timed_per_step(tmp_path):
    path = write_trace(tmp_path / "rank0.trace.json", ddp_like_events())
    out = traces.analyse_rank(traces.load_rank_trace(str(path)))
    ar = out["collectives"]["all_reduce"]
    assert out["steps_profiled"] == 2
    assert ar["count_per_step"] == 1 and ar["bytes_per_step"] == 4000  # dtype learnt from the gloo execution
    assert ar["time_per_step_s"] == pytest.approx(300e-6)
    assert ar["timed_by"] == "gloo-thread"
    assert ar["algbw_GBps"] == pytest.approx(4000 / 300e-6 / 1e9)
    assert ar["busbw_GBps"] == pytest.approx(ar["algbw_GBps"] * 2 * (2 - 1) / 2)
    # compute covers 10-600 minus the launch 500-520; comm 550-850 overlaps compute for 50 us
    assert out["per_step"]["comm_time_s"] == pytest.approx(300e-6)
    assert out["per_step"]["exposed_comm_s"] == pytest.approx(250e-6)
    assert out["per_step"]["compute_time_s"] == pytest.approx(570e-6)


def test_all_gather_and_reduce_scatter_sizes_follow_nccl_tests(tmp_path):
    events = [_x("ProfilerStep#0", 0, 1000, cat="user_annotation"),
              _x("c10d::_allgather_base_", 10, 5, args={"Input Dims": [[800], [200], [], [], []],
                                                        "Input type": ["c10::BFloat16", "c10::BFloat16", "", "Scalar", "Scalar"]}),
              _x("gloo:all_gather", 20, 100, cat="user_annotation", tid=GLOO),
              _x("c10d::_reduce_scatter_base_", 300, 5, args={"Input Dims": [[200], [800], [], [], [], []],
                                                              "Input type": ["float", "float", "", "", "Scalar", "Scalar"]}),
              _x("gloo:all_reduce", 310, 100, cat="user_annotation", tid=GLOO)]  # gloo reduce-scatters by all-reduce
    path = write_trace(tmp_path / "rank1.trace.json", events, rank=1, world=4)
    out = traces.analyse_rank(traces.load_rank_trace(str(path)))
    ag, rs = out["collectives"]["all_gather"], out["collectives"]["reduce_scatter"]
    assert (ag["bytes_per_step"], ag["group_size"], ag["dtype"]) == (1600, 4, "c10::BFloat16")
    assert ag["busbw_GBps"] == pytest.approx(ag["algbw_GBps"] * 3 / 4)
    assert (rs["bytes_per_step"], rs["group_size"]) == (3200, 4)
    assert rs["time_per_step_s"] == pytest.approx(100e-6) and "all_reduce" not in out["collectives"]


def test_record_param_comms_preferred_and_gpu_kernels_time_it(tmp_path):
    events = [_x("ProfilerStep#3", 0, 1000, cat="user_annotation"),
              _x("c10d::allreduce_", 10, 30),
              _x("record_param_comms", 12, 20, args={"Collective name": "allreduce", "dtype": "BFloat16",
                                                     "In msg nelems": 500, "Out msg nelems": 500, "Group size": 8}),
              _x("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 50, 200, cat="kernel", tid=7),
              _x("ampere_sgemm_128x64_tn", 100, 300, cat="kernel", tid=8)]
    path = write_trace(tmp_path / "rank0.trace.json", events, world=8)
    out = traces.analyse_rank(traces.load_rank_trace(str(path)))
    ar = out["collectives"]["all_reduce"]
    assert ar["count_per_step"] == 1 and ar["bytes_per_step"] == 1000 and ar["group_size"] == 8
    assert ar["timed_by"] == "gpu-kernel" and ar["time_per_step_s"] == pytest.approx(200e-6)
    assert out["per_step"]["compute_time_s"] == pytest.approx(300e-6)
    assert out["per_step"]["exposed_comm_s"] == pytest.approx(50e-6)  # 50-100 before the gemm starts


def test_a_cuda_trace_marks_each_step_twice_and_counts_it_once(tmp_path):
    """On CUDA torch marks each profiled step on the host and again on the GPU's timeline (gpu_user_annotation,
    another pid); counting both halved every per-step figure of an H100 run (observed/theory 0.5)."""
    events = []
    for i, t in enumerate((0, 1000)):
        events += [_x(f"ProfilerStep#{i + 3}", t, 999, cat="user_annotation"),
                   _x(f"ProfilerStep#{i + 3}", t + 20, 990, cat="gpu_user_annotation", tid=7),
                   _x("c10d::allreduce_", t + 10, 30),
                   _x("record_param_comms", t + 12, 20, args={"Collective name": "allreduce", "dtype": "Float",
                                                              "In msg nelems": 500, "Group size": 1}),
                   _x("ampere_sgemm_128x64_tn", t + 100, 300, cat="kernel", tid=8)]
    path = write_trace(tmp_path / "rank0.trace.json", events, world=1)
    out = traces.analyse_rank(traces.load_rank_trace(str(path)))
    assert out["steps_profiled"] == 2
    assert out["collectives"]["all_reduce"]["bytes_per_step"] == 2000 and out["comm_bytes_per_step"] == 2000
    assert out["per_step"]["compute_time_s"] == pytest.approx(300e-6)


def test_trace_without_step_markers_uses_the_window(tmp_path):
    events = [e for e in ddp_like_events() if not e["name"].startswith("ProfilerStep")]
    path = write_trace(tmp_path / "rank0.trace.json", events)
    out = traces.analyse_rank(traces.load_rank_trace(str(path), window_steps=2))
    assert out["step_markers"] is False and out["steps_profiled"] == 2
    assert out["collectives"]["all_reduce"]["count_per_step"] == 1


def test_other_layouts_fall_back_to_json(tmp_path):
    events = [dict(reversed(list(e.items()))) for e in ddp_like_events()]  # keys in another order, compact
    path = write_trace(tmp_path / "rank0.trace.json", events, indent=None)
    out = traces.analyse_rank(traces.load_rank_trace(str(path)))
    assert out["collectives"]["all_reduce"]["bytes_per_step"] == 4000


# A rank in groups of sizes 4, 2 and 2 (FSDP1 HYBRID_SHARD at 4 ranks: the world, its replicate group, its
# shard group). gloo runs each group's collectives on that group's own threads.
HYBRID_GROUPS = [[0, 1, 2, 3], [0, 2], [0, 1]]
SHARD_T, REPLICA_T, OTHER_T = 201, 202, 203


def _list_op(name, ts, dims, async_op="False"):
    """A c10d tensor-list launch as torch 2.13 records it (Tensor[][] outputs not recorded)."""
    n = len(dims)
    return _x(name, ts, 5, args={"Input Dims": dims, "Input type": ["TensorList" if d and isinstance(d[0], list) else ""
                                                                     for d in dims],
                                 "Concrete Inputs": [""] * (n - 2) + [async_op, "-1"]})


def _exec(kind, ts, dur, tid, dims):
    return _x(f"gloo:{kind}", ts, dur, cat="user_annotation", tid=tid, args={"Input Dims": dims, "Input type": ["float"]})


def hybrid_step_events() -> list[dict]:
    """One HYBRID_SHARD step on rank 0: a tensor-list all-gather (its group size only on its thread), a flat
    reduce-scatter (group 2 from its shapes), the gradient shard's all-reduce across replicas (its own thread,
    no size there), and the norm's scalar all-reduce whose execution runs before the replica all-reduce's."""
    return [_x("ProfilerStep#2", 0, 2000, cat="user_annotation"),
            _list_op("c10d::allgather_", 10, [[], [[100]], [], [], []]), _exec("all_gather", 20, 50, SHARD_T, [[100]]),
            _x("c10d::_reduce_scatter_base_", 300, 5, args={"Input Dims": [[100], [200], [], [], [], []],
                                                            "Input type": ["float", "float", "", "", "Scalar", "Scalar"]}),
            _exec("all_reduce", 310, 60, SHARD_T, [[200]]),
            _list_op("c10d::allreduce_", 400, [[[100]], [], [], [], [], []]),
            _list_op("c10d::allreduce_", 450, [[[]], [], [], [], [], []]),
            _exec("all_reduce", 460, 5, SHARD_T, [[]]),  # the scalar, done before the replicas' all-reduce
            _exec("all_reduce", 470, 100, REPLICA_T, [[100]])]


def test_groups_of_different_sizes_size_every_collective(tmp_path):
    path = write_trace(tmp_path / "rank0.trace.json", hybrid_step_events(), world=4, groups=HYBRID_GROUPS)
    out = traces.analyse_rank(traces.load_rank_trace(str(path)))
    ag, rs, ar = (out["collectives"][k] for k in ("all_gather", "reduce_scatter", "all_reduce"))
    assert (ag["bytes_per_step"], ag["group_size"]) == (800, 2)  # 100 floats x its thread's group of 2
    assert ag["busbw_GBps"] == pytest.approx(ag["algbw_GBps"] / 2)
    assert (rs["bytes_per_step"], rs["group_size"]) == (800, 2)
    assert ar["count_per_step"] == 2 and ar["bytes_per_step"] == 404  # paired by size: each on its own thread
    assert ar["time_per_step_s"] == pytest.approx(105e-6)
    # the replica all-reduce's thread ran nothing else: its group is unknown, and so is busbw; never 1, never 0
    assert ar["group_size"] is None and ar["group_sizes"] == [2] and ar["busbw_GBps"] is None
    assert ar["algbw_GBps"] == pytest.approx(404 / 105e-6 / 1e9)
    assert "c10d::allreduce_ (1x)" in ar["not_measured"]["group_size"] and "busbw_GBps" in ar["not_measured"]
    assert out["comm_bytes_per_step"] == 2004 and not out["unknown_sizes"]


def test_a_size_that_cannot_be_derived_is_null_with_its_reason(tmp_path):
    events = [_x("ProfilerStep#2", 0, 1000, cat="user_annotation"),
              _list_op("c10d::allgather_", 10, [[], [[100]], [], [], []]), _exec("all_gather", 20, 50, OTHER_T, [[100]]),
              _list_op("c10d::allreduce_", 400, [[[100]], [], [], [], [], []]),
              _exec("all_reduce", 410, 50, REPLICA_T, [[100]])]
    rank_traces = [write_trace(tmp_path / f"rank{r}.trace.json", events, rank=r, world=4, groups=HYBRID_GROUPS)
                   for r in (0, 1)]
    out = traces.analyse_traces([str(p) for p in rank_traces])
    ag = out["collectives"]["all_gather"]
    assert ag["count_per_step"] == 1 and ag["bytes_per_step"] is None and ag["mean_bytes"] is None
    assert ag["algbw_GBps"] is None and ag["busbw_GBps"] is None and ag["group_size"] is None
    assert "size unknown for c10d::allgather_" in ag["not_measured"]["bytes_per_step"]
    assert out["collectives"]["all_reduce"]["bytes_per_step"] == 400  # an all-reduce's size needs no group
    assert out["comm_bytes_per_step"] is None and out["unknown_sizes"] == {"c10d::allgather_": 2}


def test_peak_flops_and_mfu():
    assert traces.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert traces.peak_flops("NVIDIA H100 NVL") == 835e12
    assert traces.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert traces.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert traces.peak_flops("cpu") is None and traces.mfu(1e9, 1e3, 2, "cpu") is None
    assert traces.mfu(6e9, 10_000, 8, "NVIDIA H200") == pytest.approx(6e9 * 1e4 / (8 * 989e12))


def test_merged_trace_one_process_per_run_one_thread_per_rank(tmp_path):
    runs = {}
    for run, offset in (("ddp", 0.0), ("fsdp2", 5e6)):
        paths = []
        for rank in (0, 1):
            events = [dict(e, ts=e["ts"] + offset) for e in ddp_like_events()]
            paths.append(str(write_trace(tmp_path / f"{run}{rank}.trace.json", events, rank=rank)))
        runs[run] = paths
    merged = json.loads(Path(traces.write_merged_trace(runs, str(tmp_path / "merged.json"))).read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in merged if e["name"] == "process_name"}
    assert sorted(procs.values()) == ["ddp", "fsdp2"]
    threads = {(e["pid"], e["args"]["name"]) for e in merged if e["name"] == "thread_name"}
    assert {name for _, name in threads} >= {"rank 0", "rank 1"}
    steps = [e for e in merged if e.get("cat") == "step"]
    assert {e["ts"] for e in steps if e["name"].startswith("step 0")} == {0.0}  # every run/rank aligned


def _torchrun_job(out: Path, strategy: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", str(REPO / "tests" / "profiling_trace_job.py"), str(out),
           strategy, "4", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        console, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every rank share its session
        proc.communicate()
        raise
    assert proc.returncode == 0, console[-4000:]
    return json.loads((out / "params.json").read_text())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_real_gloo_traces_match_theory(tmp_path):
    """DDP all-reduces exactly the gradient bytes per step; FSDP2 all-gathers them twice (forward
    and backward) and reduce-scatters them once."""
    ddp = _torchrun_job(tmp_path / "ddp", "ddp")
    out = traces.analyse_traces(traces.rank_trace_paths(str(tmp_path / "ddp")))
    assert out["ranks"] == 2 and out["steps_profiled"] == 2 and out["backend"] == "gloo"
    ar = out["collectives"]["all_reduce"]
    assert ar["bytes_per_step"] == ddp["param_bytes"]  # one bucket here; more buckets sum to the same
    assert ar["group_size"] == 2 and ar["timed_by"] == "gloo-thread" and ar["busbw_GBps"] > 0
    assert 0 < out["per_step"]["exposed_comm_s"] <= out["per_step"]["comm_time_s"] < out["per_step"]["step_time_s"]

    fsdp = _torchrun_job(tmp_path / "fsdp2", "fsdp2")
    out = traces.analyse_traces(traces.rank_trace_paths(str(tmp_path / "fsdp2")))
    ag, rs = out["collectives"]["all_gather"], out["collectives"]["reduce_scatter"]
    assert ag["count_per_step"] == 12 and rs["count_per_step"] == 6  # 6 units: forward + backward gathers
    assert ag["bytes_per_step"] == 2 * fsdp["param_bytes"]
    assert rs["bytes_per_step"] == fsdp["param_bytes"]
    assert "all_reduce" not in out["collectives"]

    merged = traces.write_merged_trace({"ddp": traces.rank_trace_paths(str(tmp_path / "ddp")),
                                        "fsdp2": traces.rank_trace_paths(str(tmp_path / "fsdp2"))},
                                       str(tmp_path / "merged.json"))
    doc = json.loads(Path(merged).read_text())
    assert {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"} == {"ddp", "fsdp2"}


def test_gpu_traces_name_the_rank_whose_kernels_take_longer(tmp_path):
    """GPU traces (kernel events): each rank's compute is its non-NCCL kernel time, so rank 0's long NCCL kernel
    (it waits there for rank 1, whose gemm takes 3x longer) is not compute; the report's trace judgement names
    rank 1. CPU traces give the figures but no judgement (operator wall time includes descheduling)."""
    from shardscope.analysis import straggler_report
    from shardscope.profiling.state import RunState

    nccl = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    paths = []
    for rank, gemm in ((0, 300), (1, 900)):
        events = [_x("ProfilerStep#3", 0, 2000, cat="user_annotation"),
                  _x("ampere_sgemm_128x64_tn", 100, gemm, cat="kernel", tid=8),
                  _x(nccl, 100 + gemm, 1000 - gemm + 100, cat="kernel", tid=7)]  # both end at 1100
        paths.append(str(write_trace(tmp_path / f"rank{rank}.trace.json", events, rank=rank)))
    out = traces.analyse_traces(paths)
    assert out["compute_source"] == "gpu-kernels"
    assert out["per_rank_compute_s"] == {"0": pytest.approx(300e-6), "1": pytest.approx(900e-6)}
    judged = straggler_report.from_traces("ddp", RunState("ddp", "ddp", 2, 4), out, 1.5)
    assert [(f["rank"], round(f["ratio"], 3)) for f in judged["flagged"]] == [(1, 3.0)] and judged["note"] == ""

    cpu = traces.analyse_traces([str(write_trace(tmp_path / f"cpu{r}.trace.json", ddp_like_events(), rank=r))
                                 for r in (0, 1)])
    assert cpu["compute_source"] == "cpu-operators" and len(cpu["per_rank_compute_s"]) == 2
    judged = straggler_report.from_traces("ddp", RunState("ddp", "ddp", 2, 4), cpu, 1.5)
    assert judged["flagged"] == [] and judged["note"] == straggler_report.CPU_TRACES
