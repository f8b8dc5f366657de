"""The root cause of a failed run: the first error in time across all ranks, the rest as consequences.

When one rank fails, its peers fail right after it inside a collective ("Connection closed by peer",
a gloo timeout, an NCCL abort). Those secondary errors are true but are not the cause; reading rank files
in order would report rank 0's secondary error for a fault on rank 1. The root cause is the earliest
error that does not look like a peer's disappearance (clocks of several nodes may differ by a little, so
the pattern decides before the timestamp); errors after it are listed as consequences.
"""

from __future__ import annotations

import re
from typing import Any

# Messages a rank writes when a *peer* went away: consequences, unless nothing else was recorded.
_SECONDARY = re.compile(
    r"connection (closed|reset) by peer|connection refused|broken pipe|socket (closed|timeout)|"
    r"gloo.*(timed out|timeout)|nccl.*(abort|remote process exited|timeout)|"
    r"ProcessGroup.*(abort|timed out)|DistNetworkError|DistBackendError|Stopped",
    re.IGNORECASE,
)


def is_secondary(message: str) -> bool:
    """True when ``message`` reads like a consequence of a peer failing, not a failure of its own."""
    return bool(_SECONDARY.search(message))


def rank_label(record: dict[str, Any]) -> str:
    """Return ``rank R`` or ``rank R (host)`` for an error record."""
    host = record.get("host")
    return f"rank {record.get('rank', '?')}" + (f" ({host})" if host else "")


def root_cause(errors: list[dict[str, Any]]) -> tuple[str, str]:
    """Return (message, traceback) of the root cause among ``error`` records of one run.

    The message is the root cause's own (as its rank wrote it); the traceback starts with the rank (and host)
    it came from, then that rank's traceback, then the other ranks' errors as consequences (rank, seconds
    after the root cause, message). Returns ("", "") for no errors.
    """
    if not errors:
        return "", ""
    ordered = sorted(errors, key=lambda r: float(r.get("t", 0.0)))
    primary = [r for r in ordered if not is_secondary(str(r.get("message", "")))]
    # A named cause (out of memory, a full disk) outranks an earlier generic error: it explains the rest.
    root = min(primary or ordered, key=lambda r: (r.get("cause") not in ("oom", "disk"), float(r.get("t", 0.0))))
    message = str(root.get("message", "error"))
    traceback = f"root cause on {rank_label(root)}:\n{root.get('traceback', '')}"
    others = [r for r in ordered if r is not root]
    if others:
        t0 = float(root.get("t", 0.0))
        lines = [f"  {rank_label(r)}, {float(r.get('t', t0)) - t0:+.2f} s: {r.get('message', 'error')}" for r in others]
        traceback += "\nconsequences on other ranks:\n" + "\n".join(lines)
    return message, traceback
