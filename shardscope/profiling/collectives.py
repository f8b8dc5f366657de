"""Collectives in a Chrome trace: which op launched one, of what type, moving how many bytes.

Plain Python (no torch). Every form torch (2.13 to 2.15) and DeepSpeed leave in a trace:

- ``c10d::<op>_`` dispatcher ops on the launching thread, with ``Input Dims`` / ``Input type``.
  torch records the op twice, nested (the dispatcher call and the backend's), so only the
  outermost collective op on a thread is a launch. Buffers as the schema names them:
  ``allreduce_``/``broadcast_``/``reduce_`` (``Tensor[] tensors``), ``_allgather_base_`` and
  ``_reduce_scatter_base_`` (output, input), ``allgather_`` (``Tensor[][]`` outputs, which the
  profiler does not record, and ``Tensor[]`` inputs), ``reduce_scatter_`` (``Tensor[]`` outputs,
  ``Tensor[][]`` inputs), the ``*_coalesced_`` forms (``Tensor[]`` outputs and inputs),
  ``alltoall_base_`` (output, input).
- ``_c10d_functional::<op>`` (DTensor, FSDP2 with tensor parallel): ``input`` plus
  ``group_size`` as a concrete input; it wraps its own c10d call, so it is the outermost.
- ``record_param_comms`` (NCCL; gloo in newer torch) nested inside a launch: ``In msg nelems``,
  ``Out msg nelems``, ``dtype``. Preferred where present. Its ``Group size`` is a group size,
  never a message size.

A tensor-list op's element type comes from the execution event paired with it (``gloo:<op>``
or an NCCL kernel). A tensor-list all-gather or reduce-scatter records one rank's part, so its size
needs its group's size, taken in this order: the op's own arguments (output/input ratio, a
functional op's ``group_size``, ``record_param_comms``' ``Group size``), the trace's ``pg_config``
when every group of the rank has one size, else the gloo thread that executed it: gloo runs each
process group's collectives on that group's own threads, so a thread that also ran collectives of a
known group size (a flat reduce-scatter, say) belongs to a group of that size. A size that cannot be
derived is left ``None`` ("unknown", with the op's name), never 0; so is a group size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

INSTRUMENTATION = "shardscope::instrumentation"  # engines/comm_count.py: shardscope's own collectives

# Collective type from the launch op name (c10d ops, functional ops, record_param_comms "Collective name").
LAUNCH_TYPES = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "allreduce_sparse": "all_reduce",
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "allgather": "all_gather", "_allgather_base": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
    "allgather_coalesced": "all_gather", "all_gather": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "broadcast": "broadcast", "reduce": "reduce", "alltoall": "all_to_all", "alltoall_base": "all_to_all",
    "all_to_all": "all_to_all", "all_to_all_single": "all_to_all", "gather": "gather", "scatter": "scatter",
    "send": "send", "recv": "recv", "recv_any_source": "recv",
}
LAUNCH_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "record_param_comms")
_DTYPE_BYTES = {
    "float": 4, "float32": 4, "double": 8, "float64": 8, "c10::bfloat16": 2, "bfloat16": 2, "c10::half": 2,
    "half": 2, "float16": 2, "long int": 8, "long": 8, "int64": 8, "int": 4, "int32": 4, "short int": 2,
    "short": 2, "int16": 2, "signed char": 1, "unsigned char": 1, "char": 1, "byte": 1, "uint8": 1, "int8": 1,
    "bool": 1, "c10::float8_e4m3fn": 1, "c10::float8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


@dataclass
class Collective:
    """One collective as seen on one rank: what was launched, and when it ran."""

    type: str
    size_bytes: int | None  # nccl-tests size; None: not derivable from the trace ("unknown")
    group_size: int | None  # None: not derivable from the trace
    dtype: str
    launch_ts: float  # microseconds, trace clock
    start_us: float  # execution start (the launch itself when no execution event was paired)
    dur_us: float
    timed_by: str  # "gloo-thread" | "gpu-kernel" | "launch"
    step: int | None = None  # index of the profiled step it falls in (0-based), None outside
    op: str = ""  # the launching op's name
    numel: int | None = None  # elements, when known but the dtype is not (yet)
    instrumentation: bool = False  # run by shardscope itself (parity-mode norms), not by the strategy
    part_numel: int | None = None  # a tensor-list all-gather/reduce-scatter: one rank's part (x group = numel)
    group_source: str = ""  # where group_size came from: "op" (its arguments), "pg_config", "thread", "" unknown
    exec_tid: Any = None  # the thread (gloo) or stream (GPU) its paired execution ran on


def dtype_bytes(name: str) -> int | None:
    """Bytes per element for a dtype as torch's profiler spells it ("float", "c10::BFloat16", "BFloat16")."""
    return _DTYPE_BYTES.get(str(name).strip().lower())


def numel(dims: Any) -> int:
    """Elements in a (possibly nested, for tensor lists) ``Input Dims`` entry; a 0-dim tensor is 1."""
    if not isinstance(dims, list):
        return 0
    if not dims:
        return 1
    if all(isinstance(d, int) for d in dims):
        return math.prod(dims)
    return sum(numel(d) for d in dims)


def launch_type(name: str, args: dict[str, Any]) -> str | None:
    """The collective type an op launches, None for any other op (waits, barriers, wrappers)."""
    if name == "record_param_comms":
        base = str(args.get("Collective name", ""))
    elif name.startswith(LAUNCH_PREFIXES):
        base = name.split("::", 1)[1]
    else:
        return None
    base = base.lower()
    return LAUNCH_TYPES.get(base) or LAUNCH_TYPES.get(base.rstrip("_")) or LAUNCH_TYPES.get(base.strip("_"))


def _concrete_int(args: dict[str, Any], index: int) -> int | None:
    values = args.get("Concrete Inputs") or []
    try:
        return int(values[index])
    except (IndexError, TypeError, ValueError):
        return None


def _from_rpc(kind: str, rpcs: list[dict[str, Any]]) -> tuple[int | None, str]:
    """(numel, dtype) from nested ``record_param_comms`` args; coalesced wrappers left out when parts exist."""
    parts = [a for a in rpcs if "coalesced" not in str(a.get("Collective name", "")).lower()] or rpcs
    total, dtype = 0, ""
    for a in parts:
        n_in, n_out = int(a.get("In msg nelems", 0) or 0), int(a.get("Out msg nelems", 0) or 0)
        total += n_out if kind == "all_gather" else (n_in or n_out)
        dtype = dtype or str(a.get("dtype", ""))
    return (total or None), dtype


def _from_args(name: str, kind: str, args: dict[str, Any]) -> tuple[int | None, str, int | None, int | None]:
    """(numel, dtype, group size, one rank's part) of a c10d or functional launch from its recorded inputs.

    The group size is the op's own (an output/input ratio, a functional op's ``group_size``), else None;
    a tensor-list all-gather or reduce-scatter gives only one rank's part (numel None until its group is known).
    """
    dims, types = args.get("Input Dims", []) or [], args.get("Input type", []) or []
    dtype = next((t for t in types if dtype_bytes(t)), "")
    op = name.split("::", 1)[1].rstrip("_")
    first = numel(dims[0]) if dims else 0
    second = numel(dims[1]) if len(dims) > 1 and dims[1] != [] else 0
    if name.startswith(("_c10d_functional::", "c10d_functional::")):
        if kind == "all_gather":
            group = _concrete_int(args, 1)
            return (first * group if group else None), dtype, group, first or None
        if kind == "reduce_scatter":
            return first or None, dtype, _concrete_int(args, 2), None
        return first or None, dtype, None, None
    if op in ("_allgather_base", "_reduce_scatter_base", "alltoall_base", "allgather_into_tensor_coalesced",
              "reduce_scatter_tensor_coalesced", "alltoall"):
        out_n, in_n = first, second
        group = max(out_n, in_n) // max(1, min(out_n, in_n)) if kind != "all_to_all" and out_n and in_n else 0
        return (out_n if kind == "all_gather" else in_n) or None, dtype, group or None, None
    if op in ("allgather", "allgather_coalesced"):  # Tensor[][] outputs are not recorded
        return None, dtype, None, second or None
    if op == "reduce_scatter":  # Tensor[] outputs recorded, Tensor[][] inputs not
        return None, dtype, None, first or None
    return first or None, dtype, None, None  # in place: tensors


def group_hint(info: dict[str, Any], rank: int) -> int | None:
    """The group size of a collective whose op does not say it: the one size every group of this rank has
    (the world size when the trace lists no groups), else None."""
    sizes = {int(g.get("pg_size", 0) or 0) for g in info.get("pg_config") or []
             if isinstance(g, dict) and rank in (g.get("ranks") or [rank])}
    sizes.discard(0)
    if not sizes:
        return int(info.get("world_size", 0) or 0) or None
    return sizes.pop() if len(sizes) == 1 else None


def launches(comm_events: list[dict[str, Any]], hint: int | None, annotations: list[tuple[Any, float, float]]
             ) -> list[Collective]:
    """The collectives launched in ``comm_events``: outermost launch ops per thread, sized.

    ``annotations``: (tid, start_us, end_us) of ``shardscope::instrumentation`` spans.
    """
    by_tid: dict[Any, list[dict[str, Any]]] = {}
    for e in comm_events:
        if str(e.get("name", "")).startswith(LAUNCH_PREFIXES):
            by_tid.setdefault(e.get("tid"), []).append(e)
    out: list[Collective] = []
    for tid, evs in by_tid.items():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        outer: list[tuple[dict[str, Any], str, list[dict[str, Any]]]] = []
        end = -math.inf
        for e in evs:
            name, args = str(e["name"]), e.get("args") or {}
            kind = launch_type(name, args)
            ts = float(e["ts"])
            if outer and ts < end:  # nested in the current launch
                if name == "record_param_comms":
                    outer[-1][2].append(args)
                continue
            if kind is None:
                continue
            outer.append((e, kind, [args] if name == "record_param_comms" else []))
            end = ts + float(e.get("dur", 0.0))
        for e, kind, rpcs in outer:
            name, args, ts = str(e["name"]), e.get("args") or {}, float(e["ts"])
            if rpcs:
                n, dtype = _from_rpc(kind, rpcs)
                own, part = int(rpcs[0].get("Group size", 0) or 0) or None, None
            else:
                n, dtype, own, part = _from_args(name, kind, args)
            c = Collective(kind, None, own or hint, dtype, ts, ts, float(e.get("dur", 0.0)), "launch", op=name, numel=n,
                           part_numel=part, group_source="op" if own else ("pg_config" if hint else ""))
            c.instrumentation = any(t == tid and s <= ts <= f for t, s, f in annotations)
            out.append(c)
    for c in out:
        resize(c)
    return out


def resize(c: Collective) -> None:
    """Fill ``numel`` of a tensor-list launch once its group size is known, and ``size_bytes`` once its
    element count and type are."""
    if c.numel is None and c.part_numel and c.group_size:
        c.numel = c.part_numel * c.group_size
    if c.size_bytes is None and c.numel is not None and dtype_bytes(c.dtype):
        c.size_bytes = c.numel * (dtype_bytes(c.dtype) or 0)


def groups_from_threads(collectives: list[Collective]) -> None:
    """Give a collective of unknown group size the size of the other collectives its gloo thread ran.

    gloo runs each process group's work on that group's own threads, so collectives executed on one
    thread share a group; a thread whose collectives of known size (from their own arguments) disagree,
    or that ran none, tells nothing. Sizes are filled in afterwards (``resize``)."""
    sizes: dict[Any, set[int]] = {}
    for c in collectives:
        if c.timed_by == "gloo-thread" and c.group_source == "op" and c.group_size:
            sizes.setdefault(c.exec_tid, set()).add(c.group_size)
    for c in collectives:
        known = sizes.get(c.exec_tid) if c.timed_by == "gloo-thread" else None
        if not c.group_source and known and len(known) == 1:
            c.group_size, c.group_source = next(iter(known)), "thread"
        resize(c)
