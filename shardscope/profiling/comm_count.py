"""Ground truth for communication: the bytes each rank hands to each collective, counted in the rank.

``CollectiveCounter`` is a ``TorchDispatchMode``: while active it sees every ``c10d::`` collective
op (whoever calls it: ``torch.distributed``'s functions, DDP's C++ reducer, DeepSpeed's comm
layer) and every functional collective (``_c10d_functional::``, used by DTensor tensor parallel)
with the real tensors, before they run. It sizes each one the way nccl-tests (and the trace
analysis) does: all-reduce and broadcast the buffer, all-gather the gathered output,
reduce-scatter the full input, in the dtype of the tensors handed over.

It is independent of the profiler: it never reads a trace. The tests compare the trace analysis
and the theory with these counts. It is opt-in (``profile.count_collectives``) because a Python
dispatch mode slows every operator of the steps it covers.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

# op name (namespace::name without overload) -> (collective type, how to size it)
# sizing: "all" sums every tensor of argument 0; "out" sums argument 0 (outputs), "in" argument 1
# (inputs); "in0" argument 0 as input; "gather" argument 0 times the group size in argument 1.
_C10D = {
    "allreduce_": ("all_reduce", "all"), "allreduce_coalesced_": ("all_reduce", "all"),
    "allgather_": ("all_gather", "out"), "_allgather_base_": ("all_gather", "out"),
    "allgather_coalesced_": ("all_gather", "out"), "allgather_into_tensor_coalesced_": ("all_gather", "out"),
    "reduce_scatter_": ("reduce_scatter", "in"), "_reduce_scatter_base_": ("reduce_scatter", "in"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "in"),
    "broadcast_": ("broadcast", "all"), "reduce_": ("reduce", "all"),
    "alltoall_": ("all_to_all", "in"), "alltoall_base_": ("all_to_all", "in"),
    "gather_": ("gather", "in"), "scatter_": ("scatter", "out"), "send": ("send", "all"), "recv_": ("recv", "all"),
    "barrier": ("barrier", None),
}
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", "in0"), "all_reduce_": ("all_reduce", "in0"),
    "all_reduce_coalesced": ("all_reduce", "in0"), "all_reduce_coalesced_": ("all_reduce", "in0"),
    "all_gather_into_tensor": ("all_gather", "gather"), "all_gather_into_tensor_out": ("all_gather", "gather"),
    "all_gather_into_tensor_coalesced": ("all_gather", "gather"),
    "reduce_scatter_tensor": ("reduce_scatter", "in0"), "reduce_scatter_tensor_coalesced": ("reduce_scatter", "in0"),
    "all_to_all_single": ("all_to_all", "in0"), "broadcast": ("broadcast", "in0"), "broadcast_": ("broadcast", "in0"),
}


INSTRUMENT_SPAN = "shardscope::instrument"  # the trace analysis leaves collectives inside it out
_ACTIVE: list["CollectiveCounter"] = []


@contextlib.contextmanager
def instrument() -> Iterator[None]:
    """Mark shardscope's own measuring (parity mode's per-layer norms, which gather full tensors):
    a profiler span the trace analysis leaves out, and a pause of every active counter, so that
    the figures describe the strategy's communication, not the instrument's."""
    for counter in _ACTIVE:
        counter.paused += 1
    try:
        with torch.profiler.record_function(INSTRUMENT_SPAN):
            yield
    finally:
        for counter in _ACTIVE:
            counter.paused -= 1


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in ``value`` (a tensor, or nested lists/tuples of them); 0 for anything else."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def collective_size(namespace: str, name: str, args: tuple) -> tuple[str, int] | None:
    """Return (collective type, bytes) for a c10d or functional collective op call, None for another op."""
    table = _C10D if namespace == "c10d" else _FUNCTIONAL if namespace in ("_c10d_functional", "c10d_functional") else None
    if table is None or name not in table:
        return None
    kind, how = table[name]
    if how is None:
        return kind, 0
    if how == "gather":
        return kind, tensor_bytes(args[0]) * int(args[1])
    return kind, tensor_bytes(args[1] if how == "in" else args[0])


def _handles_dispatch(cls: type) -> bool:
    """True for a tensor subclass with a dispatch of its own (DTensor), not Parameter nor FakeTensor."""
    return cls.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__ and not issubclass(cls, FakeTensor)


class CollectiveCounter(TorchDispatchMode):
    """Counts, per collective type, the calls and bytes handed to collectives while it is active.

    Use as ``with CollectiveCounter() as counter: ...`` (or ``start()``/``stop()`` across steps);
    ``by_type`` maps a type (``all_reduce``, ``all_gather``, ...) to ``{"count", "bytes"}``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.by_type: dict[str, dict[str, int]] = {}
        self._active = False
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105 - the mode's hook
        kwargs = kwargs or {}
        namespace = getattr(func, "namespace", "")
        if namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            sized = collective_size(namespace, func._schema.name.split("::", 1)[-1], tuple(args))
            if sized is not None:
                if not self.paused:
                    row = self.by_type.setdefault(sized[0], {"count": 0, "bytes": 0})
                    row["count"] += 1
                    row["bytes"] += sized[1]
                # Run it without the mode: the c10d op a functional collective issues is the same collective.
                return func(*args, **kwargs)
        if any(_handles_dispatch(t) for t in types):
            # Let a tensor subclass (DTensor) handle the op with this mode still active: the
            # collectives it issues for it (a Partial placement reduced for a norm) then count.
            return NotImplemented
        return func(*args, **kwargs)

    def start(self) -> None:
        """Begin counting (enter the mode); a second call does nothing."""
        if not self._active:
            self.__enter__()
            self._active = True
            _ACTIVE.append(self)

    def stop(self) -> None:
        """Stop counting (leave the mode); a second call does nothing."""
        if self._active:
            self._active = False
            _ACTIVE.remove(self)
            self.__exit__(None, None, None)
