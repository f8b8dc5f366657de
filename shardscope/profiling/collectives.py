"""Collectives in a trace: what was launched (type, bytes, dtype, group) and when it ran.

Every form in which torch (2.13 to 2.15) and DeepSpeed (which calls ``torch.distributed``)
record a collective:

- ``c10d::<op>`` operators on the launching thread, sized from ``Input Dims`` / ``Input type``
  by the op's schema: single tensors (``_allgather_base_``, ``_reduce_scatter_base_``,
  ``alltoall_base_``), tensor lists (``allreduce_``, ``broadcast_``, ``allgather_``,
  ``reduce_scatter_``) and coalesced lists (``allgather_into_tensor_coalesced_``,
  ``reduce_scatter_tensor_coalesced_``, ``allreduce_coalesced_``, ``allgather_coalesced_``).
  The profiler records a ``Tensor[][]`` argument as ``[]``: a list all-gather is then sized from
  its input times the group size, which is known when every process group of the trace
  (``distributedInfo.pg_config``) has the same size, else the size is unknown.
- ``record_param_comms`` (NCCL, and where torch emits it): ``Collective name``, ``In/Out msg
  nelems``, ``dtype``, ``Group size``. It describes the ``c10d::`` op it is nested in, and wins.
- ``_c10d_functional::<op>`` (DTensor): counted only when no ``c10d::`` op runs inside it; an op
  recorded twice, nested (under a Python dispatch mode), is counted once.
- Execution: ``gloo:<op>`` annotations on gloo's threads (gloo runs a reduce-scatter as an
  all-reduce) or ``nccl*`` GPU kernels, paired with launches in time order: they time the
  collective and give the dtype a tensor-list launch does not say.

Sizes follow nccl-tests: all-reduce, broadcast and reduce count the buffer, all-gather the
gathered output, reduce-scatter and all-to-all the full input. A size that cannot be derived is
``None`` with the reason in ``unknown``: never 0, never a group size.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

COMM_EVENT_NAME = re.compile(
    rb'"name":\s*"(c10d::[^"]*|record_param_comms|gloo:[^"]*|nccl[^"]*|_c10d_functional::[^"]*)"')

# base op name (no namespace, no leading/trailing "_") -> (type, sizing rule); see _size
_OPS = {
    "allreduce": ("all_reduce", "list0"), "allreduce_coalesced": ("all_reduce", "list0"),
    "all_reduce": ("all_reduce", "arg0"), "all_reduce_coalesced": ("all_reduce", "list0"),
    "allgather": ("all_gather", "gather_list"), "allgather_coalesced": ("all_gather", "gather_list"),
    "allgather_base": ("all_gather", "arg0"), "allgather_into_tensor_coalesced": ("all_gather", "list0"),
    "all_gather_into_tensor": ("all_gather", "functional_gather"),
    "all_gather_into_tensor_out": ("all_gather", "functional_gather"),
    "all_gather_into_tensor_coalesced": ("all_gather", "functional_gather"),
    "reduce_scatter": ("reduce_scatter", "list1"), "reduce_scatter_base": ("reduce_scatter", "arg1"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "list1"),
    "reduce_scatter_tensor": ("reduce_scatter", "arg0"),
    "broadcast": ("broadcast", "list0"), "reduce": ("reduce", "list0"),
    "alltoall": ("all_to_all", "list1"), "alltoall_base": ("all_to_all", "arg1"),
    "all_to_all_single": ("all_to_all", "arg0"),
    "gather": ("gather", "list1"), "scatter": ("scatter", "list0"), "send": ("send", "list0"),
    "recv": ("recv", "list0"), "recv_any_source": ("recv", "list0"), "barrier": ("barrier", "none"),
}
# record_param_comms "Collective name" -> type
_RPC_TYPES = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "all_reduce": "all_reduce",
    "allgather": "all_gather", "_allgather_base": "all_gather", "allgather_base": "all_gather",
    "all_gather": "all_gather", "allgather_into_tensor_coalesced": "all_gather", "allgather_coalesced": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter", "reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "broadcast": "broadcast", "reduce": "reduce", "all_to_all": "all_to_all", "alltoall": "all_to_all",
    "alltoall_base": "all_to_all", "all_to_allv": "all_to_all", "gather": "gather", "scatter": "scatter",
    "send": "send", "recv": "recv", "barrier": "barrier",
}
# Execution events: gloo annotation suffix or NCCL kernel name fragment -> type.
_EXEC_TYPES = (
    ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"), ("allgather", "all_gather"),
    ("all_gather", "all_gather"), ("reducescatter", "reduce_scatter"), ("reduce_scatter", "reduce_scatter"),
    ("broadcast", "broadcast"), ("alltoall", "all_to_all"), ("all_to_all", "all_to_all"),
    ("sendrecv", "send"), ("send", "send"), ("recv", "recv"), ("reduce", "reduce"), ("gather", "gather"),
    ("scatter", "scatter"), ("barrier", "barrier"),
)
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd", "wait")
_DTYPE_BYTES = {
    "float": 4, "float32": 4, "double": 8, "float64": 8, "c10::bfloat16": 2, "bfloat16": 2, "c10::half": 2,
    "half": 2, "float16": 2, "long int": 8, "long": 8, "int64": 8, "int": 4, "int32": 4, "short int": 2,
    "short": 2, "int16": 2, "signed char": 1, "unsigned char": 1, "char": 1, "byte": 1, "uint8": 1, "int8": 1,
    "bool": 1, "c10::float8_e4m3fn": 1, "c10::float8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
BUS_FACTORS = {  # busbw = algbw * factor(n), nccl-tests doc/PERFORMANCE.md
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


@dataclass
class Collective:
    """One collective as seen on one rank: what was launched, and when it ran.

    ``size_bytes`` is None when the trace does not say it; ``unknown`` then says why.
    """

    type: str
    op: str  # the event's name, e.g. "c10d::allgather_"
    size_bytes: int | None
    group_size: int
    dtype: str
    launch_ts: float  # microseconds, trace clock
    start_us: float  # execution start (the launch itself when no execution event was paired)
    dur_us: float
    timed_by: str  # "gloo-thread" | "gpu-kernel" | "launch"
    step: int | None = None  # index of the profiled step it falls in (0-based), None outside
    numel: int | None = None  # elements sized, waiting for a dtype from the execution event
    unknown: str = ""
    instrument: bool = False  # launched by shardscope's own measuring (parity norms): left out


def dtype_bytes(name: str) -> int | None:
    """Bytes per element for a dtype as torch's profiler spells it ("float", "c10::BFloat16", "BFloat16")."""
    return _DTYPE_BYTES.get(str(name).strip().lower())


def _numel(dims: Any) -> int | None:
    """Elements in an ``Input Dims`` entry (a tensor's shape, or a list of shapes); None when absent."""
    if not isinstance(dims, list):
        return None
    if not dims:  # a 0-dim tensor (a scalar all-reduced for a norm, a loss)
        return 1
    if all(isinstance(d, int) for d in dims):
        return math.prod(dims)
    parts = [_numel(d) for d in dims]
    return None if any(p is None for p in parts) else sum(parts)  # type: ignore[misc]


def _list_numel(dims: Any) -> int | None:
    """Elements of a tensor-list argument; None when the profiler left it empty (``Tensor[][]``)."""
    if not isinstance(dims, list) or not dims:
        return None
    return _numel(dims)


def _base(name: str) -> str:
    return name.split("::", 1)[-1].strip("_").lower()


def _size(rule: str, args: dict[str, Any], group: int | None) -> tuple[int | None, str]:
    """Elements a launch moves by its sizing rule, or (None, why)."""
    dims = args.get("Input Dims") or []
    arg = (lambda i: dims[i] if len(dims) > i else None)  # noqa: E731
    if rule == "none":
        return 0, ""
    if rule in ("arg0", "arg1"):
        n = _numel(arg(int(rule[-1])))
    elif rule in ("list0", "list1"):
        n = _list_numel(arg(int(rule[-1])))
    elif rule == "gather_list":
        n = _list_numel(arg(0))  # outputs, when the profiler kept them
        if n is None:
            inputs = _list_numel(arg(1))
            if inputs is None or group is None:
                return None, "output shapes not recorded and the group size is ambiguous"
            n = inputs * group
    else:  # functional all-gather: input x group_size (a recorded scalar argument)
        concrete = args.get("Concrete Inputs") or []
        inputs = _numel(arg(0))
        size = concrete[1] if len(concrete) > 1 else ""
        if inputs is None or not str(size).isdigit():
            return None, "group size not recorded"
        n = inputs * int(size)
    return (n, "") if n is not None else (None, "shapes not recorded (profile.record_shapes = false?)")


def _dtype(args: dict[str, Any]) -> str:
    return next((t for t in args.get("Input type", []) or [] if dtype_bytes(t)), "")


def launch(e: dict[str, Any], world_size: int, group: int | None) -> Collective | None:
    """A launch event as a Collective (sized where the event says enough), None for other events.

    ``group``: the size of every process group of the trace when they all agree, else None.
    """
    name = str(e.get("name", ""))
    args = e.get("args", {}) or {}
    ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
    if name == "record_param_comms":
        kind = _RPC_TYPES.get(str(args.get("Collective name", "")).strip().lower())
        if kind is None:
            return None  # "coalesced" end markers and the like carry no data of their own
        dtype = str(args.get("dtype", ""))
        n_in, n_out = args.get("In msg nelems"), args.get("Out msg nelems")
        numel = n_out if kind == "all_gather" else n_in if kind in ("reduce_scatter", "all_to_all") else (n_in or n_out)
        g = int(args.get("Group size", 0) or 0) or world_size
        c = Collective(kind, name, None, g, dtype, ts, ts, dur, "launch", numel=int(numel) if numel is not None else None)
        c.unknown = "" if numel is not None else "record_param_comms without message sizes"
        return _finish(c)
    if not name.startswith(("c10d::", "_c10d_functional::")) or _base(name) in _NOT_COLLECTIVES:
        return None
    kind_rule = _OPS.get(_base(name))
    if kind_rule is None:
        return None
    kind, rule = kind_rule
    numel, why = _size(rule, args, group)
    g = world_size
    dims = args.get("Input Dims") or []
    if rule == "arg0" and kind == "all_gather" and len(dims) > 1:  # _allgather_base_(out, in): out / in
        g = max(1, (numel or 0) // max(1, _numel(dims[1]) or 1))
    elif rule == "arg1" and kind == "reduce_scatter":
        g = max(1, (numel or 0) // max(1, _numel(dims[0]) or 1))
    elif group is not None:
        g = group
    c = Collective(kind, name, None, g, _dtype(args), ts, ts, dur, "launch", numel=numel, unknown=why)
    return _finish(c)


def _finish(c: Collective) -> Collective:
    """Size the collective once its element count and dtype are both known."""
    if c.numel is not None and c.size_bytes is None:
        elem = dtype_bytes(c.dtype)
        if elem is not None:
            c.size_bytes, c.unknown = c.numel * elem, ""
        elif not c.unknown:
            c.unknown = "dtype not recorded"
    return c


def execution(e: dict[str, Any]) -> tuple[str, float, float, str, str] | None:
    """An execution event (gloo runloop annotation or NCCL kernel) as (type, start, dur, timed_by, dtype)."""
    name = str(e.get("name", ""))
    low = name.lower()
    if low.startswith("gloo:"):
        low, timed_by = low[5:], "gloo-thread"
    elif "nccl" in low:
        timed_by = "gpu-kernel"
    else:
        return None
    for key, kind in _EXEC_TYPES:
        if key in low:
            return kind, float(e["ts"]), float(e.get("dur", 0.0)), timed_by, _dtype(e.get("args") or {})
    return None


def drop_wrappers(launches: list[Collective], tids: list[Any]) -> list[Collective]:
    """Keep the innermost description of each collective: a ``c10d::`` op with a ``record_param_comms``
    inside it, a functional op with a ``c10d::`` op inside it, or an op with the same op inside it
    (a Python dispatch mode, like the in-rank counter, records each op once more around the kernel)
    is one collective."""
    order = sorted(range(len(launches)), key=lambda i: launches[i].launch_ts)
    keep = [True] * len(launches)
    for pos, i in enumerate(order):
        outer = launches[i]
        if outer.op == "record_param_comms":
            continue
        end = outer.launch_ts + outer.dur_us
        for j in order[pos + 1:]:
            inner = launches[j]
            if inner.launch_ts > end:
                break
            if tids[j] == tids[i] and (inner.op == outer.op or inner.op == "record_param_comms"
                                       or outer.op.startswith("_c10d_functional::")):
                keep[i] = False
                break
    return [c for c, k in zip(launches, keep) if k]


def pair(launches: list[Collective], execs: list[tuple[str, float, float, str, str]]) -> None:
    """Give each launch the time of its execution (the next unclaimed compatible one in time
    order) and, where the launch did not say it, the dtype."""
    compatible = {"reduce_scatter": ("reduce_scatter", "all_reduce"), "all_gather": ("all_gather",)}
    execs = sorted(execs, key=lambda x: x[1])
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
                if not dtype_bytes(c.dtype) and dtype:  # tensor-list launches do not say their dtype
                    c.dtype = dtype
                    c.unknown = "" if c.unknown == "dtype not recorded" else c.unknown
                break
        _finish(c)


def parse_collectives(comm_events: list[dict[str, Any]], world_size: int,
                      group_sizes: list[int]) -> list[Collective]:
    """Every collective of one rank's trace from its decoded collective events, sized and timed."""
    sizes = {g for g in group_sizes if g > 1}
    group = next(iter(sizes)) if len(sizes) == 1 else (world_size if not sizes else None)
    launches, tids, execs = [], [], []
    for e in comm_events:
        c = launch(e, world_size, group)
        if c is not None:
            launches.append(c)
            tids.append(e.get("tid"))
            continue
        x = execution(e)
        if x is not None:
            execs.append(x)
    launches = drop_wrappers(launches, tids)
    pair(launches, execs)
    return launches


def per_type(collectives: list[Collective], n_steps: int) -> dict[str, dict[str, Any]]:
    """Per collective type: count, bytes (None when any size is unknown; ``unknown_ops`` names the ops
    and why), time, algorithm and bus bandwidth, each per step over ``n_steps``."""
    rows: dict[str, dict[str, Any]] = {}
    for c in collectives:
        t = rows.setdefault(c.type, {"count": 0, "bytes": 0, "time_us": 0.0, "group_size": c.group_size,
                                     "dtype": c.dtype, "timed_by": c.timed_by, "unknown": {}})
        t["count"] += 1
        if c.size_bytes is None:
            key = f"{c.op}: {c.unknown or 'size unknown'}"
            t["unknown"][key] = t["unknown"].get(key, 0) + 1
        else:
            t["bytes"] += c.size_bytes
        t["time_us"] += c.dur_us
        t["group_size"] = max(t["group_size"], c.group_size)
        t["dtype"] = t["dtype"] or c.dtype
    out = {}
    for kind, t in sorted(rows.items()):
        secs = t["time_us"] / 1e6
        known = not t["unknown"]
        algbw = t["bytes"] / secs / 1e9 if secs > 0 and known else None
        factor = BUS_FACTORS.get(kind)
        out[kind] = {
            "count_per_step": t["count"] / n_steps,
            "bytes_per_step": t["bytes"] / n_steps if known else None,
            "known_bytes_per_step": t["bytes"] / n_steps,
            "unknown_ops": {k: v / n_steps for k, v in t["unknown"].items()},
            "time_per_step_s": secs / n_steps,
            "mean_time_s": secs / t["count"] if t["count"] else 0.0,
            "mean_bytes": t["bytes"] / t["count"] if t["count"] and known else None,
            "algbw_GBps": algbw,
            "busbw_GBps": algbw * factor(t["group_size"]) if algbw is not None and factor else None,
            "group_size": t["group_size"],
            "dtype": t["dtype"],
            "timed_by": t["timed_by"],
        }
    return out
