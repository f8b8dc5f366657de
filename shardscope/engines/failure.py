"""Name why a rank failed: out of memory, a full or unwritable disk, or the exception itself.

The ``error`` record's ``message`` is what every view shows; ``cause`` lets the orchestrator act
on it (a disk fault stops the comparison: the next run would fail the same way).
"""

from __future__ import annotations

from shardscope.core import outspace

OOM, DISK, ERROR = "oom", "disk", "error"
_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """True for torch's OutOfMemoryError (CUDA or CPU), MemoryError, or an allocator's failure message."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in _OOM_TEXT)


def describe(exc: BaseException, rank: int, step: int) -> tuple[str, str]:
    """Return (one-line message, cause) for an exception that ended rank ``rank`` during step ``step``."""
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    if is_out_of_memory(exc):
        detail = f": {first_line}" if first_line else ""
        return f"out of memory on rank {rank} at step {step} ({type(exc).__name__}{detail})", OOM
    disk = outspace.disk_error(exc)
    if disk is not None:
        return f"{outspace.describe(disk)} (rank {rank}, step {step})", DISK
    return (f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__), ERROR
