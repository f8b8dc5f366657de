"""Reading torch.profiler's Chrome traces: steps, collective events, threads, compute intervals.

Reads the Chrome JSON traces torch.profiler exports (``<run>/traces/rank<R>.trace.json``, or
``.json.gz``) with plain Python: no torch, so the orchestrator and ``shardscope report`` can use it.
What each collective event means is ``collectives``' business; this module finds the events,
pairs launches with their executions and bounds the profiled steps.

What torch emits (checked on torch 2.13):

- ``ProfilerStep#N`` user annotations on the main thread bound each profiled step.
- The API-level collective is a ``cpu_op`` on the launching thread (``c10d::allreduce_``,
  ``c10d::_allgather_base_``...), with NCCL also a ``record_param_comms`` op (see ``collectives``).
- The collective's execution: ``gloo:<op>`` annotations on gloo's runloop threads (gloo runs a
  reduce-scatter as an all-reduce, so the launch names the type), or ``nccl*`` GPU kernels.
  Launches and executions are paired in time order (by size where both record it: launches on
  several process groups interleave); the execution gives the time and, for gloo, the thread that
  tells a tensor-list op's group; the launch gives type and size.

Parsing is a regular expression over the exporter's fixed key order (``ph, cat, name, pid, tid,
ts, dur``), about ten times faster than ``json.loads``; a file the expression does not fit is
parsed with ``json`` instead. Only collective events have their ``args`` decoded.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from shardscope.profiling.collectives import (
    INSTRUMENTATION,
    Collective,
    dtype_bytes,
    group_hint,
    groups_from_threads,
    numel,
)
from shardscope.profiling.collectives import launches as collective_launches
from shardscope.profiling.intervals import subtract, union
from shardscope.core.rundir import RunFiles

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
    compute_source: str = "cpu-operators"  # or "gpu-kernels": what ``compute`` was read from


def _read_bytes(path: str) -> bytes:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as fh:  # type: ignore[operator]
        return fh.read()


def scalar(raw: bytes) -> Any:
    """A raw JSON scalar text (a pid or tid) as an int where it is one, else as text."""
    text = raw.strip(b'"').decode()
    try:
        return int(text)
    except ValueError:
        return text


def unescape(raw: bytes) -> str:
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


def _exec_numel(c: Collective) -> int | None:
    """Elements the execution event of launch ``c`` records (its input), where the launch says."""
    if c.type == "all_gather":
        return c.part_numel or (c.numel // c.group_size if c.numel and c.group_size else None)
    return c.numel


def _pair(launches: list[Collective], execs: list[tuple[str, float, float, str, str, Any, int | None]]) -> None:
    """Give each launch the time of its execution: in time order, the next unclaimed compatible one, one
    recording the launch's input size where both say (launches on several process groups interleave)."""
    compatible = {"reduce_scatter": ("reduce_scatter", "all_reduce"), "all_gather": ("all_gather",)}
    used = [False] * len(execs)
    first_free = 0
    for c in sorted(launches, key=lambda c: c.launch_ts):
        kinds = compatible.get(c.type, (c.type,))
        want = _exec_numel(c)
        while first_free < len(execs) and used[first_free]:
            first_free += 1
        window = [i for i in range(first_free, min(len(execs), first_free + 64))
                  if not used[i] and execs[i][0] in kinds and execs[i][1] >= c.launch_ts - 1.0]
        same = [i for i in window if want is not None and execs[i][6] == want]
        for i in (same or window)[:1]:
            kind, start, dur, timed_by, dtype, tid, _ = execs[i]
            used[i] = True
            c.start_us, c.dur_us, c.timed_by, c.exec_tid = start, dur, timed_by, tid
            if not c.dtype and dtype:  # tensor-list launches do not say their dtype
                c.dtype = dtype


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
    rank = int(info.get("rank", rank_from_path(path)))
    device_name = str(devices[0].get("name", "")) if devices and isinstance(devices[0], dict) else ""

    # On CUDA each step is marked twice: on the host (user_annotation) and on the GPU's timeline
    # (gpu_user_annotation); counting both halved every per-step figure of an H100 run (bytes 0.5x the theory).
    steps = sorted((int(name[13:]), float(ts), float(ts) + float(dur))
                   for cat, name, pid, tid, ts, dur in events
                   if name.startswith(b"ProfilerStep#") and name[13:].isdigit() and cat != b"gpu_user_annotation")
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
            args = e.get("args") or {}
            dtype = next((t for t in args.get("Input type", []) if dtype_bytes(t)), "")
            dims = args.get("Input Dims") or []
            timed_by = "gloo-thread" if name.startswith("gloo:") else "gpu-kernel"
            execs.append((kind, float(e["ts"]), float(e.get("dur", 0.0)), timed_by, dtype, e.get("tid"),
                          numel(dims[0]) if dims else None))
    execs.sort(key=lambda x: x[1])
    _pair(launches, execs)
    groups_from_threads(launches)
    for c in launches:
        c.step = _step_index(steps, c.launch_ts)

    compute: list[tuple[float, float]] = []
    on_gpu = any(e[0] == b"kernel" for e in events)
    if on_gpu:
        compute = [(float(ts), float(ts) + float(dur)) for cat, name, pid, tid, ts, dur in events
                   if cat == b"kernel" and b"nccl" not in name.lower()]
    else:
        # The training thread's operators, minus the time it spends waiting on collectives: a wait
        # sits inside its caller (DTensor "Redistribute", DDP's reducer), which is not compute then.
        main = main_thread(events)
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
        compute = subtract(union(ops), union(waits))
    return RankTrace(path, rank, world, str(info.get("backend", "")), device_name, steps, launches,
                     compute, events, threads, marked, len(steps) if marked else max(1, window_steps or 1),
                     "gpu-kernels" if on_gpu else "cpu-operators")


def rank_from_path(path: str) -> int:
    """The rank in a trace file's name (``rank3.trace.json`` -> 3), 0 when it has none."""
    m = re.search(r"rank(\d+)", os.path.basename(path))
    return int(m.group(1)) if m else 0


def main_thread(events: list[tuple]) -> bytes | None:
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



def rank_trace_paths(run_dir: str) -> list[str]:
    """Chrome traces of a run directory, ``traces/rank<R>.trace.json[.gz]``, in rank order."""
    return sorted(RunFiles(run_dir).chrome_traces(), key=rank_from_path)

