"""Trace analysis: collectives, bytes, bandwidth, compute vs communication, MFU, merged trace.

Reads the Chrome JSON traces torch.profiler exports (``<run>/traces/rank<R>.trace.json``, or
``.json.gz``) with plain Python: no torch, so the orchestrator and ``shardscope report`` can use it.

What torch emits, and so what this module reads (checked on torch 2.13):

- ``ProfilerStep#N`` user annotations on the main thread bound each profiled step.
- The API-level collective is a ``cpu_op`` on the launching thread: ``c10d::allreduce_``,
  ``c10d::_allgather_base_``, ``c10d::_reduce_scatter_base_``, ``c10d::broadcast_``... with
  ``Input Dims`` / ``Input type`` args. With NCCL a ``record_param_comms`` op also carries
  ``Collective name``, ``In msg nelems``, ``Out msg nelems``, ``dtype`` and ``Group size``;
  where present it is preferred. gloo (torch 2.13) emits no ``record_param_comms``.
- The collective's execution: ``gloo:<op>`` annotations on gloo's runloop threads (gloo runs a
  reduce-scatter as an all-reduce, so the launch names the type), or ``nccl*`` GPU kernels.
  Launches and executions are paired in time order; the execution gives the time, the launch
  gives type and size.

Sizes follow nccl-tests: all-reduce and broadcast count the buffer, all-gather the gathered
output, reduce-scatter the full input; algbw = size / time, busbw = algbw x 2(n-1)/n for
all-reduce, x (n-1)/n for all-gather, reduce-scatter and all-to-all, x 1 for broadcast/reduce.

Parsing is a regular expression over the exporter's fixed key order (``ph, cat, name, pid, tid,
ts, dur``), about ten times faster than ``json.loads``; a file the expression does not fit is
parsed with ``json`` instead. Only collective events have their ``args`` decoded.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from shardscope.profiling.collectives import (
    INSTRUMENTATION,
    Collective,
    dtype_bytes,
    fill_dtypes,
    group_hint,
)
from shardscope.profiling.collectives import launches as collective_launches

# --- reading -----------------------------------------------------------------------------------

_X_EVENT = re.compile(
    rb'"ph":\s*"X",\s*"cat":\s*"([^"]*)",\s*"name":\s*"((?:[^"\\]|\\.)*)",\s*"pid":\s*("?[^,"]*"?),'
    rb'\s*"tid":\s*("?[^,"]*"?),\s*"ts":\s*([-0-9.eE]+),\s*"dur":\s*([-0-9.eE]+)'
)
_COMM_NAME = re.compile(
    rb'"name":\s*"((?:_?c10d(?:_functional)?)::[^"]*|record_param_comms|gloo:[^"]*|nccl[^"]*|shardscope::[^"]*)"')
_STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")

# Execution events: gloo annotation suffix or NCCL kernel name fragment -> type.
_EXEC_TYPES = (
    ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"), ("allgather", "all_gather"),
    ("all_gather", "all_gather"), ("reducescatter", "reduce_scatter"), ("reduce_scatter", "reduce_scatter"),
    ("broadcast", "broadcast"), ("alltoall", "all_to_all"), ("all_to_all", "all_to_all"),
    ("sendrecv", "send"), ("send", "send"), ("recv", "recv"), ("reduce", "reduce"), ("gather", "gather"),
    ("scatter", "scatter"), ("barrier", "barrier"),
)
BUS_FACTORS = {  # busbw = algbw * factor(n), nccl-tests doc/PERFORMANCE.md
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


@dataclass
class RankTrace:
    """What one rank's trace holds, reduced to what the analysis needs."""

    path: str
    rank: int
    world_size: int
    backend: str
    device_name: str
    steps: list[tuple[int, float, float]]  # (ProfilerStep number, start_us, end_us), time order
    collectives: list[Collective]
    compute: list[tuple[float, float]]  # busy intervals (start_us, end_us) of compute
    events: list[tuple[bytes, ...]]  # every X event as its raw JSON texts (cat, name, pid, tid, ts, dur)
    thread_names: dict[bytes, str] = field(default_factory=dict)  # raw tid text -> thread name
    marked_steps: bool = True  # False: no ProfilerStep markers; ``steps`` is the whole window
    window_steps: int = 1  # optimizer steps the profiled window holds


def _read_bytes(path: str) -> bytes:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as fh:  # type: ignore[operator]
        return fh.read()


def _scalar(raw: bytes) -> Any:
    text = raw.strip(b'"').decode()
    try:
        return int(text)
    except ValueError:
        return text


def _name(raw: bytes) -> str:
    """An event name as the JSON text had it (escapes resolved)."""
    return json.loads(b'"' + raw + b'"') if b"\\" in raw else raw.decode("utf-8", "replace")


def _decode_object_at(data: bytes, pos: int) -> dict[str, Any] | None:
    """Decode the JSON object enclosing ``pos`` (an event), or None."""
    start = data.rfind(b"{", 0, pos)
    if start < 0:
        return None
    size = 4096
    decoder = json.JSONDecoder()
    while True:
        chunk = data[start:start + size].decode("utf-8", "replace")
        try:
            obj, _ = decoder.raw_decode(chunk)
            return obj if isinstance(obj, dict) else None
        except ValueError:
            if start + size >= len(data):
                return None
            size *= 4


def _header_value(data: bytes, key: str) -> Any:
    """Decode a top-level value written before ``traceEvents`` (torch writes its metadata first)."""
    head_end = data.find(b'"traceEvents"')
    m = re.search(rb'"' + key.encode() + rb'":\s*', data[: head_end if head_end > 0 else 65536])
    if not m:
        return None
    try:
        value, _ = json.JSONDecoder().raw_decode(data[m.end(): m.end() + (1 << 20)].decode("utf-8", "replace"))
        return value
    except ValueError:
        return None


def _scan(data: bytes) -> tuple[list[tuple], list[dict[str, Any]], dict[bytes, str], dict[str, Any]]:
    """Return (X events as raw-text tuples, full comm events, thread names, header) from a trace's bytes.

    Events stay as the bytes the expression matched (names, ids and numbers undecoded): most are
    only filtered, so converting each one would cost more than the match itself.
    """
    events = _X_EVENT.findall(data)
    header = {k: _header_value(data, k) for k in ("distributedInfo", "deviceProperties")}
    if not events and b'"traceEvents"' in data:  # another writer's layout: parse it whole
        return _scan_json(json.loads(data))
    comm = []
    for m in _COMM_NAME.finditer(data):
        obj = _decode_object_at(data, m.start())
        if obj is not None and obj.get("ph") == "X":
            comm.append(obj)
    threads = {}
    for m in re.finditer(rb'"name":\s*"thread_name",[^}]*?"tid":\s*("?[^,"]*"?),\s*"args":\s*\{\s*"name":\s*"([^"]*)"',
                         data):
        threads[m.group(1)] = m.group(2).decode()
    return events, comm, threads, header


def _scan_json(doc: Any) -> tuple[list[tuple], list[dict[str, Any]], dict[bytes, str], dict[str, Any]]:
    raw_events = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
    events, comm, threads = [], [], {}
    text = (lambda v: json.dumps(v).encode())
    for e in raw_events:
        if e.get("ph") == "X" and "dur" in e:
            name = str(e.get("name", ""))
            events.append((str(e.get("cat", "")).encode(), name.encode(), text(e.get("pid")), text(e.get("tid")),
                           repr(float(e["ts"])).encode(), repr(float(e["dur"])).encode()))
            if _COMM_NAME.match(b'"name": "' + name.encode() + b'"'):
                comm.append(e)
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[text(e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    header = {k: doc.get(k) for k in ("distributedInfo", "deviceProperties")} if isinstance(doc, dict) else {}
    return events, comm, threads, header


# --- one rank ------------------------------------------------------------------------------------


def _exec_type(name: str) -> str | None:
    low = name.lower()
    if low.startswith("gloo:"):
        low = low[5:]
    elif "nccl" not in low:
        return None
    for key, kind in _EXEC_TYPES:
        if key in low:
            return kind
    return None


def _pair(launches: list[Collective], execs: list[tuple[str, float, float, str, str]]) -> None:
    """Give each launch the time of its execution: the next unclaimed compatible one in time order."""
    compatible = {"reduce_scatter": ("reduce_scatter", "all_reduce"), "all_gather": ("all_gather",)}
    used = [False] * len(execs)
    first_free = 0
    for c in sorted(launches, key=lambda c: c.launch_ts):
        kinds = compatible.get(c.type, (c.type,))
        while first_free < len(execs) and used[first_free]:
            first_free += 1
        for i in range(first_free, min(len(execs), first_free + 64)):
            kind, start, dur, timed_by, dtype = execs[i]
            if not used[i] and kind in kinds and start >= c.launch_ts - 1.0:
                used[i] = True
                c.start_us, c.dur_us, c.timed_by = start, dur, timed_by
                if not c.dtype and dtype:  # tensor-list launches do not say their dtype
                    c.dtype = dtype
                break


def load_rank_trace(path: str, window_steps: int | None = None) -> RankTrace:
    """Read one rank's Chrome trace; return a RankTrace. Raises OSError or ValueError on an unreadable file.

    Steps are bounded by ``ProfilerStep#N`` markers. A trace without them (a profiler used without
    ``prof.step()``) is one window of ``window_steps`` steps (default 1), and per-step figures are
    the window's divided by that number.
    """
    data = _read_bytes(path)
    events, comm_events, threads, header = _scan(data)
    info = header.get("distributedInfo") or {}
    devices = header.get("deviceProperties") or []
    world = int(info.get("world_size", 1) or 1)
    rank = int(info.get("rank", _rank_from_path(path)))
    device_name = str(devices[0].get("name", "")) if devices and isinstance(devices[0], dict) else ""

    steps = sorted((int(name[13:]), float(ts), float(ts) + float(dur))
                   for cat, name, pid, tid, ts, dur in events if name.startswith(b"ProfilerStep#") and name[13:].isdigit())
    marked = bool(steps)
    if not marked and events:
        # The profiler's own span covers its whole window; without it, the events' extent.
        span = [e for e in events if e[0] == b"Trace"] or events
        steps = [(-1, min(float(e[4]) for e in span), max(float(e[4]) + float(e[5]) for e in span))]
    steps.sort(key=lambda s: s[1])

    notes = [(e.get("tid"), float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
             for e in comm_events if e.get("name") == INSTRUMENTATION]
    launches = collective_launches(comm_events, group_hint(info, rank), notes)
    execs = []
    for e in comm_events:
        name = str(e.get("name", ""))
        kind = _exec_type(name)
        if kind is not None:
            types = (e.get("args") or {}).get("Input type", [])
            dtype = next((t for t in types if dtype_bytes(t)), "")
            timed_by = "gloo-thread" if name.startswith("gloo:") else "gpu-kernel"
            execs.append((kind, float(e["ts"]), float(e.get("dur", 0.0)), timed_by, dtype))
    execs.sort(key=lambda x: x[1])
    _pair(launches, execs)
    fill_dtypes(launches)
    for c in launches:
        c.step = _step_index(steps, c.launch_ts)

    compute: list[tuple[float, float]] = []
    if b"kernel" in {e[0] for e in events}:
        compute = [(float(ts), float(ts) + float(dur)) for cat, name, pid, tid, ts, dur in events
                   if cat == b"kernel" and b"nccl" not in name.lower()]
    else:
        # The training thread's operators, minus the time it spends waiting on collectives: a wait
        # sits inside its caller (DTensor "Redistribute", DDP's reducer), which is not compute then.
        main = _main_thread(events)
        is_comm: dict[bytes, bool] = {}  # names repeat: classify each once
        ops, waits = [], []
        for cat, name, pid, tid, ts, dur in events:
            if tid != main:
                continue
            comm = is_comm.get(name)
            if comm is None:
                comm = is_comm[name] = _is_comm_op(name.decode("utf-8", "replace"))
            if comm:
                waits.append((float(ts), float(ts) + float(dur)))
            elif cat == b"cpu_op":
                ops.append((float(ts), float(ts) + float(dur)))
        compute = _subtract(_union(ops), _union(waits))
    return RankTrace(path, rank, world, str(info.get("backend", "")), device_name, steps, launches,
                     compute, events, threads, marked, len(steps) if marked else max(1, window_steps or 1))


def _rank_from_path(path: str) -> int:
    m = re.search(r"rank(\d+)", os.path.basename(path))
    return int(m.group(1)) if m else 0


def _main_thread(events: list[tuple]) -> bytes | None:
    """The thread that runs the training loop (raw tid text): the one holding ProfilerStep
    annotations, else the one with the most operators."""
    for cat, name, pid, tid, ts, dur in events:
        if name.startswith(b"ProfilerStep#"):
            return tid
    busy = Counter(e[3] for e in events if e[0] == b"cpu_op")
    return busy.most_common(1)[0][0] if busy else None


def _step_index(steps: list[tuple[int, float, float]], ts: float) -> int | None:
    for i, (_, start, end) in enumerate(steps):
        if start <= ts <= end:
            return i
    return None


def _is_comm_op(name: str) -> bool:
    """A launch of, or a wait for, a collective on the training thread."""
    low = name.lower()
    return "wait" in low or low.startswith(("c10d::", "_c10d_functional::", "c10d_functional::", "record_param_comms"))


def _subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted disjoint intervals ``a`` minus sorted disjoint intervals ``b``."""
    out = []
    j = 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the overlap of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def analyse_rank(trace: RankTrace) -> dict[str, Any]:
    """Return per-collective counts, bytes, times and bandwidths, and per-step compute/comm/exposed time.

    Figures are per profiled step (averaged over the steps the trace holds). Times in seconds,
    bytes in bytes, bandwidths in GB/s (1e9). Collectives outside the profiled steps are ignored.
    """
    n_steps = trace.window_steps
    inside = [c for c in trace.collectives if c.step is not None or not trace.steps]
    per_type: dict[str, dict[str, Any]] = {}
    unknown: Counter[str] = Counter()
    own_bytes = 0
    for c in inside:
        if c.instrumentation:  # shardscope's own (parity-mode norms): reported apart, not the strategy's
            own_bytes += c.size_bytes or 0
            continue
        t = per_type.setdefault(c.type, {"count": 0, "bytes": 0, "time_us": 0.0, "group_size": c.group_size,
                                         "dtype": c.dtype, "timed_by": c.timed_by, "unknown": Counter()})
        t["count"] += 1
        if c.size_bytes is None:
            t["unknown"][c.op] += 1
            unknown[c.op] += 1
        else:
            t["bytes"] += c.size_bytes
        t["time_us"] += c.dur_us
        t["group_size"] = max(t["group_size"], c.group_size)
        t["dtype"] = t["dtype"] or c.dtype
    collectives = {}
    for kind, t in sorted(per_type.items()):
        secs = t["time_us"] / 1e6
        algbw = t["bytes"] / secs / 1e9 if secs > 0 else None
        factor = BUS_FACTORS.get(kind)
        busbw = algbw * factor(t["group_size"]) if algbw is not None and factor else None
        collectives[kind] = {
            "count_per_step": t["count"] / n_steps,
            "bytes_per_step": t["bytes"] / n_steps,
            "time_per_step_s": secs / n_steps,
            "mean_time_s": secs / t["count"] if t["count"] else 0.0,
            "mean_bytes": t["bytes"] / t["count"] if t["count"] else 0.0,
            "algbw_GBps": algbw,
            "busbw_GBps": busbw,
            "group_size": t["group_size"],
            "dtype": t["dtype"],
            "timed_by": t["timed_by"],
            "unknown_sizes": dict(t["unknown"]),  # op name -> launches whose size the trace does not give
        }
    steps = []
    comm_all = _union((c.start_us, c.start_us + c.dur_us) for c in trace.collectives)
    compute_all = _union(trace.compute)
    per_window = 1 if trace.marked_steps else trace.window_steps
    for number, start, end in trace.steps:
        comm = _clip(comm_all, start, end)
        compute = _clip(compute_all, start, end)
        comm_us = _length(comm)
        steps.append({
            "profiler_step": number,
            "step_time_s": (end - start) / 1e6 / per_window,
            "compute_time_s": _length(compute) / 1e6 / per_window,
            "comm_time_s": comm_us / 1e6 / per_window,
            "exposed_comm_s": (comm_us - _intersection(comm, compute)) / 1e6 / per_window,
        })
    mean = (lambda key: statistics.fmean(s[key] for s in steps) if steps else None)
    return {
        "rank": trace.rank,
        "world_size": trace.world_size,
        "backend": trace.backend,
        "device": trace.device_name,
        "steps_profiled": trace.window_steps,
        "step_markers": trace.marked_steps,
        "collectives": collectives,
        "steps": steps,
        "per_step": {k: mean(k) for k in ("step_time_s", "compute_time_s", "comm_time_s", "exposed_comm_s")},
        "comm_bytes_per_step": sum(c["bytes_per_step"] for c in collectives.values()),
        "unknown_sizes": dict(unknown),
        "instrumentation_bytes_per_step": own_bytes / n_steps,
    }


# --- one run -------------------------------------------------------------------------------------


def rank_trace_paths(run_dir: str) -> list[str]:
    """Chrome traces of a run directory, ``traces/rank<R>.trace.json[.gz]``, in rank order."""
    paths = glob.glob(os.path.join(run_dir, "traces", "rank*.trace.json")) + glob.glob(
        os.path.join(run_dir, "traces", "rank*.trace.json.gz"))
    return sorted(paths, key=_rank_from_path)


def combine_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Average per-rank analyses into one run-level figure set (counts and bytes from the mean too)."""
    if not per_rank:
        return {}
    kinds = sorted({k for r in per_rank for k in r["collectives"]})
    collectives = {}
    for kind in kinds:
        rows = [r["collectives"][kind] for r in per_rank if kind in r["collectives"]]
        row: dict[str, Any] = {}
        for key in ("count_per_step", "bytes_per_step", "time_per_step_s", "mean_time_s", "mean_bytes"):
            row[key] = statistics.fmean(x[key] for x in rows)
        for key in ("algbw_GBps", "busbw_GBps"):
            vals = [x[key] for x in rows if x[key] is not None]
            row[key] = statistics.fmean(vals) if vals else None
        row["group_size"] = max(x["group_size"] for x in rows)
        row["dtype"] = rows[0]["dtype"]
        row["timed_by"] = rows[0]["timed_by"]
        row["unknown_sizes"] = dict(sum((Counter(x.get("unknown_sizes", {})) for x in rows), Counter()))
        collectives[kind] = row
    per_step = {}
    for key in ("step_time_s", "compute_time_s", "comm_time_s", "exposed_comm_s"):
        vals = [r["per_step"][key] for r in per_rank if r["per_step"].get(key) is not None]
        per_step[key] = statistics.fmean(vals) if vals else None
    return {
        "ranks": len(per_rank),
        "world_size": per_rank[0]["world_size"],
        "backend": per_rank[0]["backend"],
        "device": per_rank[0]["device"],
        "steps_profiled": min(r["steps_profiled"] for r in per_rank),
        "step_markers": all(r["step_markers"] for r in per_rank),
        "collectives": collectives,
        "per_step": per_step,
        "comm_bytes_per_step": sum(c["bytes_per_step"] for c in collectives.values()),
        "unknown_sizes": dict(sum((Counter(r.get("unknown_sizes", {})) for r in per_rank), Counter())),
        "instrumentation_bytes_per_step": statistics.fmean(r.get("instrumentation_bytes_per_step", 0.0)
                                                           for r in per_rank),
    }


def analyse_traces(paths: list[str], window_steps: int | None = None) -> dict[str, Any]:
    """Analyse the rank traces at ``paths`` and combine them; ``{}`` when there are none.

    ``window_steps``: steps in a trace without ProfilerStep markers (see ``load_rank_trace``).
    A trace that cannot be read is listed under ``unreadable`` with the reason, never fatal.
    """
    per_rank, unreadable = [], []
    for path in paths:
        try:
            per_rank.append(analyse_rank(load_rank_trace(path, window_steps)))
        except (OSError, ValueError, KeyError) as err:
            unreadable.append(f"{path}: {err}")
    out = combine_ranks(per_rank)
    if out or unreadable:
        out["traces"] = list(paths)
        out["unreadable"] = unreadable
    return out


def analyse_run(run_dir: str) -> dict[str, Any]:
    """Communication analysis of one run directory, for summary.json and the TUI's communication panel.

    Reads ``<run_dir>/traces/rank*.trace.json`` and, when present, ``<run_dir>/spec.json`` to compare
    the observed bytes per step with theory (``theory``: bytes, basis, ``ratio`` observed/theory)
    and to compute MFU where the device's peak is known. Returns ``{}`` when the run has no traces.
    """
    spec = None
    spec_path = os.path.join(run_dir, "spec.json")
    if os.path.isfile(spec_path):
        try:
            with open(spec_path, encoding="utf-8") as fh:
                spec = json.load(fh)
        except (OSError, ValueError):
            spec = None
    window = int(((spec or {}).get("comparison", {}).get("profile", {}) or {}).get("steps", 1) or 1)
    out = analyse_traces(rank_trace_paths(run_dir), window)
    if not out:
        return out
    if spec is not None:
        try:
            from shardscope.profiling import comm_theory

            theory = comm_theory.expected_comm(spec)
        except (OSError, ValueError, KeyError) as err:
            theory = {"error": str(err)}
        if theory.get("bytes_per_step") and out["comm_bytes_per_step"] and not out.get("unknown_sizes"):
            theory["ratio"] = out["comm_bytes_per_step"] / theory["bytes_per_step"]
        out["theory"] = theory
    if out.get("unknown_sizes"):  # a ratio over a partial sum would look measured: leave it out
        out["note"] = "collective sizes unknown for: " + ", ".join(
            f"{op} ({n}x)" for op, n in sorted(out["unknown_sizes"].items()))
    elif out.get("collectives") and not out["comm_bytes_per_step"]:
        # gloo's launch events carry sizes only in their recorded input shapes
        out["note"] = "collective sizes unknown: traces recorded without shapes (set profile.record_shapes = true)"
    return out


# --- MFU -----------------------------------------------------------------------------------------

PEAK_TFLOPS = (  # dense bf16/fp16, no sparsity (REFERENCE.md); first match wins
    ("H100 NVL", 835.0), ("H100 PCIE", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0), ("B200", 2250.0),
)


def peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of a device from its name (``"NVIDIA H100 80GB HBM3"``), None when unknown."""
    upper = (device_name or "").upper()
    for key, tflops in PEAK_TFLOPS:
        if all(part in upper for part in key.split()):
            return tflops * 1e12
    return None


def mfu(flops_per_token: float, tokens_per_s: float, n_devices: int, device_name: str) -> float | None:
    """Model FLOPs utilisation: flops_per_token x tokens/s / (devices x peak); None for an unknown device."""
    peak = peak_flops(device_name)
    if peak is None or not n_devices or not tokens_per_s:
        return None
    return flops_per_token * tokens_per_s / (n_devices * peak)


# --- merged trace --------------------------------------------------------------------------------


def write_merged_trace(runs: dict[str, list[str]], out_path: str) -> str:
    """Merge the rank traces of several runs into one Perfetto/Chrome trace; return ``out_path``.

    One process per run, one thread per rank (its training thread); gloo or GPU-stream threads of
    a rank follow it as ``rank R · <thread>``. Each rank's time is shifted so its first profiled
    step starts at 0, which lines the runs up step by step. Only the ``args`` of collectives are
    kept, so the file stays smaller than its inputs.
    """
    out: list[dict[str, Any]] = []
    for pid, (run, paths) in enumerate(runs.items(), start=1):
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": run}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for path in paths:
            try:
                trace = load_rank_trace(path)
            except (OSError, ValueError):
                continue
            out.extend(_merged_rank_events(trace, pid))
    with open(out_path, "w", encoding="utf-8") as fh:
        fh.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
        fh.write(",\n".join(json.dumps(e, separators=(",", ":")) for e in out))
        fh.write("\n]}\n")
    return out_path


def _merged_rank_events(trace: RankTrace, pid: int) -> list[dict[str, Any]]:
    main = _main_thread(trace.events)
    origin = trace.steps[0][1] if trace.steps else 0.0
    threads: dict[Any, int] = {}
    base = trace.rank * 100
    out: list[dict[str, Any]] = []

    def tid_for(src_pid: bytes, src_tid: bytes, cat: bytes) -> int:
        key = (src_pid, src_tid) if cat == b"kernel" else src_tid
        if key not in threads:
            tid = base if src_tid == main and cat != b"kernel" else base + 1 + len(threads)
            threads[key] = tid
            if tid == base:
                label = f"rank {trace.rank}"
            elif cat == b"kernel":
                label = f"rank {trace.rank} · GPU {_scalar(src_pid)} stream {_scalar(src_tid)}"
            else:
                label = f"rank {trace.rank} · {trace.thread_names.get(src_tid, f'thread {_scalar(src_tid)}')}"
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        return threads[key]

    tid_for(b"", main or b"0", b"cpu_op")
    for i, (number, start, end) in enumerate(trace.steps):
        out.append({"ph": "X", "cat": "step", "name": f"step {i} (ProfilerStep#{number})", "pid": pid,
                    "tid": base, "ts": round(start - origin, 3), "dur": round(end - start, 3)})
    comm_by_ts = {c.launch_ts: c for c in trace.collectives}
    for cat, raw_name, src_pid, src_tid, raw_ts, raw_dur in trace.events:
        if raw_name.startswith(b"ProfilerStep#") or cat == b"Trace":
            continue
        ts = float(raw_ts)
        name = _name(raw_name)
        ev: dict[str, Any] = {"ph": "X", "cat": cat.decode(), "name": name, "pid": pid,
                              "tid": tid_for(src_pid, src_tid, cat), "ts": round(ts - origin, 3),
                              "dur": round(float(raw_dur), 3)}
        c = comm_by_ts.get(ts)
        if c is not None and name.startswith(("c10d::", "record_param_comms")):
            ev["args"] = {"type": c.type, "bytes": c.size_bytes, "group_size": c.group_size, "dtype": c.dtype}
        out.append(ev)
    return out
