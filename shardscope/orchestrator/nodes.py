"""Which node owns which file of a run directory shared by several nodes.

Node 0 owns the verdict: ``<run>/status.json``, ``<run>/console.log``, ``devices.jsonl``, the summary and
the reports. Every other node writes files of its own beside them (``<run>/console.node<N>.log``,
``devices.node<N>.jsonl``), so no node overwrites or interleaves another's; rank record files are already
one per global rank.
"""

from __future__ import annotations

import socket


def owns_verdict(node_rank: int) -> bool:
    """True for the node that writes status.json, comparison.json, the summary and the reports (node 0)."""
    return node_rank == 0


def console_name(node_rank: int) -> str:
    """Return the file name of this node's torchrun console log inside a run directory."""
    return "console.log" if owns_verdict(node_rank) else f"console.node{node_rank}.log"


def devices_name(node_rank: int) -> str:
    """Return the file name of this node's device samples inside the comparison directory."""
    return "devices.jsonl" if owns_verdict(node_rank) else f"devices.node{node_rank}.jsonl"


def node_label(node_rank: int, nnodes: int) -> str:
    """Return ``"node N (host)"`` on several nodes, ``""`` on one (labels stay as they were)."""
    return f"node {node_rank} ({socket.gethostname()})" if nnodes > 1 else ""
