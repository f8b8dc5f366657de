"""In-rank ground truth for communication: the bytes each rank hands to each collective.

Opt-in (``profile.count_collectives = true``): during the profiled window a
``TorchDispatchMode`` sees every ``c10d::*`` collective op and every functional collective
(``_c10d_functional::*``, which DTensor and FSDP2+TP use) that the rank runs. Every path into
a collective ends in one of these dispatcher ops: ``torch.distributed.all_reduce`` and friends,
DDP's C++ reducer, DeepSpeed's ``deepspeed.comm``, FSDP1/FSDP2's flat-buffer collectives and
DTensor's redistributions. Wrapping the Python functions would miss the C++ callers.

The count is independent of the profiler: it reads the tensors handed in, not the trace.
Sizes follow nccl-tests, as the trace analysis does (``size_bytes``): all-reduce and broadcast
count the buffer, all-gather the gathered output, reduce-scatter the full input.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# op name (without namespace and trailing "_") -> collective type
_TYPES = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allgather": "all_gather", "_allgather_base": "all_gather", "allgather_coalesced": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast": "broadcast", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
    "send": "send", "recv": "recv",  # pipeline stages' point to point (c10d::send, c10d::recv_)
}
_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
_PLAIN = torch.Tensor.__torch_dispatch__  # a type with its own is a subclass such as DTensor


def _tensor_bytes(value: Any) -> int:
    """Bytes of a tensor or a (nested) list of tensors."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _first_dtype(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return str(value.dtype).replace("torch.", "")
    if isinstance(value, (list, tuple)):
        return next((d for d in (_first_dtype(v) for v in value) if d), "")
    return ""


def collective_of(func: Any) -> str | None:
    """The collective type a dispatcher op performs (``"all_gather"``...), None for any other op."""
    ns = getattr(func, "namespace", "")
    if ns not in _NAMESPACES:
        return None
    name = func._schema.name.split("::", 1)[-1]
    return _TYPES.get(name.rstrip("_")) or _TYPES.get(name)


def measure(func: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """In bytes, out bytes, group size and dtype of one collective call, from its schema's arguments.

    c10d ops name their buffers ``tensors`` (in place), ``input_tensor(s)`` and ``output_tensor(s)``;
    functional ops take ``input(s)`` and return new tensors, sized here from ``group_size``.
    """
    bound: dict[str, Any] = {}
    for i, arg in enumerate(func._schema.arguments):
        bound[arg.name] = args[i] if i < len(args) else kwargs.get(arg.name, arg.default_value)
    group = _group_size(bound)
    if "tensors" in bound:  # in-place: all_reduce, broadcast, reduce
        n_in = n_out = _tensor_bytes(bound["tensors"])
        dtype = _first_dtype(bound["tensors"])
    else:
        ins = [v for k, v in bound.items() if k.startswith("input")]
        outs = [v for k, v in bound.items() if k.startswith("output") and not k.endswith("split_sizes")]
        n_in, dtype = _tensor_bytes(ins), _first_dtype(ins)
        n_out = _tensor_bytes(outs)
        if not outs:  # functional: outputs are allocated by the op
            kind = collective_of(func)
            n_out = {"all_gather": n_in * group, "reduce_scatter": n_in // max(1, group)}.get(kind, n_in)
    return {"in_bytes": n_in, "out_bytes": n_out, "group_size": group, "dtype": dtype}


def _group_size(bound: dict[str, Any]) -> int:
    if isinstance(bound.get("group_size"), int):
        return bound["group_size"]
    pg = bound.get("process_group")
    if pg is not None:  # the dispatcher hands the group in boxed, as a ScriptObject
        from torch.distributed import ProcessGroup

        return int(ProcessGroup.unbox(pg).size() if isinstance(pg, torch.ScriptObject) else pg.size())
    name = bound.get("group_name")
    if isinstance(name, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return int(_resolve_process_group(name).size())
    return 0


def size_bytes(kind: str, in_bytes: int, out_bytes: int) -> int:
    """The nccl-tests size of a collective: the gathered output of an all-gather, else the input."""
    return out_bytes if kind == "all_gather" else in_bytes


INSTRUMENTATION = "shardscope::instrumentation"  # the profiler annotation around shardscope's own collectives
_active: list[CollectiveCounter] = []
_spent = [0.0, 0.0, 0]  # wall and CPU seconds inside instrumentation() since the process started; nesting depth


def instrumentation_spent() -> tuple[float, float]:
    """(wall, CPU) seconds this process has spent inside ``instrumentation()`` (outermost blocks only): the loop
    takes a step's share out of its measured time, so parity mode's norms do not count as the strategy's work."""
    return _spent[0], _spent[1]


@contextlib.contextmanager
def instrumentation() -> Iterator[None]:
    """Mark collectives shardscope itself runs (parity-mode layer norms) apart from the strategy's.

    The trace gets a ``shardscope::instrumentation`` annotation (the trace analysis sets what runs
    inside it apart), an active counter books them under ``instrumentation`` instead, and the time spent
    inside is added up (``instrumentation_spent``).
    """
    from torch.profiler import record_function

    for counter in _active:
        counter.instrumenting += 1
    _spent[2] += 1
    wall0, cpu0 = time.perf_counter(), time.process_time()
    try:
        with record_function(INSTRUMENTATION):
            yield
    finally:
        _spent[2] -= 1
        if _spent[2] == 0:
            _spent[0] += time.perf_counter() - wall0
            _spent[1] += time.process_time() - cpu0
        for counter in _active:
            counter.instrumenting -= 1


class CollectiveCounter(TorchDispatchMode):
    """Counts, per collective type, calls and bytes handed in while active (``with`` or enter/exit)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_type: dict[str, dict[str, Any]] = {}
        self.instrumentation: dict[str, dict[str, Any]] = {}
        self.instrumenting = 0

    def __enter__(self) -> CollectiveCounter:
        _active.append(self)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        if self in _active:
            _active.remove(self)
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(getattr(t, "__torch_dispatch__", _PLAIN) is not _PLAIN for t in types):
            return NotImplemented  # a subclass (DTensor) desugars into plain-tensor collectives first
        kind = collective_of(func)
        if kind is not None:
            m = measure(func, args, kwargs)
            book = self.instrumentation if self.instrumenting else self.by_type
            row = book.setdefault(kind, {"count": 0, "in_bytes": 0, "out_bytes": 0, "size_bytes": 0,
                                                 "group_size": m["group_size"], "dtypes": {}, "ops": {}})
            row["count"] += 1
            row["in_bytes"] += m["in_bytes"]
            row["out_bytes"] += m["out_bytes"]
            size = size_bytes(kind, m["in_bytes"], m["out_bytes"])
            row["size_bytes"] += size
            row["group_size"] = max(row["group_size"], m["group_size"])
            row["dtypes"][m["dtype"]] = row["dtypes"].get(m["dtype"], 0) + size
            op = str(func._schema.name)
            row["ops"][op] = row["ops"].get(op, 0) + 1
        return func(*args, **kwargs)


class CountWindow:
    """Runs a ``CollectiveCounter`` over steps [start, stop) and hands back one ``comm`` record payload."""

    def __init__(self, *, enabled: bool, start_step: int, steps: int, total_steps: int) -> None:
        self.start, self.stop = start_step, start_step + steps
        self.enabled = enabled and steps > 0 and self.stop <= total_steps
        self._counter: CollectiveCounter | None = None

    def begin_step(self, step: int) -> None:
        """Start counting before the window's first step."""
        if self.enabled and step == self.start and self._counter is None:
            self._counter = CollectiveCounter()
            self._counter.__enter__()

    def end_step(self, step: int) -> dict[str, Any] | None:
        """After the window's last step: stop counting and return the payload (per-step figures), else None."""
        if self._counter is None or step != self.stop - 1:
            return None
        counter = self.close()
        n = self.stop - self.start
        assert counter is not None

        def per_step(book: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
            return {kind: {**row, "count_per_step": row["count"] / n, "bytes_per_step": row["size_bytes"] / n}
                    for kind, row in sorted(book.items())}

        by_type = per_step(counter.by_type)
        return {"source": "in-rank dispatcher count", "steps": [self.start, self.stop - 1], "window_steps": n,
                "collectives": by_type, "bytes_per_step": sum(r["bytes_per_step"] for r in by_type.values()),
                "instrumentation": per_step(counter.instrumentation)}

    def close(self) -> CollectiveCounter | None:
        """Leave the counting mode if it is active (training ended inside the window); return the counter."""
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.__exit__(None, None, None)
        return counter
