"""Where is this rank? Answered when the orchestrator finds the run stalled, before it stops it.

A thread of the rank looks twice a second for the run's ``stall-request`` file (``RunFiles.stall_request``),
which the orchestrator makes when no record arrived for ``stall_timeout_s``. It then writes one ``stall``
record: the last collectives the rank entered, from torch's flight recorder (``events.FLIGHT_RECORDER_ENV``, set
for every rank by the launcher; gloo and NCCL record there since torch 2.8), each with its sequence number
in its process group, kind, sizes, when it was entered and whether it completed; and every thread's Python
stack (``faulthandler``, which reads the stacks even while the main thread is blocked in a collective with
the GIL released). The orchestrator turns the ranks' records into the verdict ("rank 1 never entered
all_reduce #58 ...", ``orchestrator/stall_verdict.py``).

A thread, not a signal: Python runs signal handlers on the main thread only, which a hung collective holds.
"""

from __future__ import annotations

import faulthandler
import json
import os
import tempfile
import threading
from typing import Any, Callable

LAST = 8  # flight-recorder entries per process group kept in the record


def flight_recorder() -> list[dict[str, Any]]:
    """The flight recorder's last entries per process group, as small dicts ([] where torch has none)."""
    import torch._C._distributed_c10d as c10d

    entries: list[dict[str, Any]] = []
    # gloo's recorder, and NCCL's own (a CUDA build records NCCL collectives there, with CUDA events)
    for dump in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
        fn = getattr(c10d, dump, None)
        if fn is None:
            continue
        try:
            entries += json.loads(fn(includeCollectives=True)).get("entries") or []
        except Exception:  # noqa: BLE001 - a diagnosis must never fail the rank
            continue
    by_group: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        pg = [str(x) for x in (e.get("process_group") or ["?"])]
        group = pg[-1] if pg[-1] not in ("", "undefined") else f"pg {pg[0]}"  # new_group()s have no name
        op = str(e.get("profiling_name", "?")).split(":")[-1]
        by_group.setdefault(group, []).append({
            "group": group, "seq": int(e.get("collective_seq_id") or 0), "op": op,
            "sizes": e.get("input_sizes") or [], "entered_t": float(e.get("time_created_ns") or 0) / 1e9,
            "done": bool(e.get("retired")) or e.get("state") == "completed", "p2p": bool(e.get("is_p2p"))})
    return [e for group in by_group.values() for e in sorted(group, key=lambda x: x["seq"])[-LAST:]]


def stacks() -> str:
    """Every thread's Python stack, as faulthandler writes it (works while the main thread is blocked)."""
    with tempfile.TemporaryFile(mode="w+") as fh:
        faulthandler.dump_traceback(fh, all_threads=True)
        fh.seek(0)
        return fh.read()


class StallDump:
    """Writes one ``stall`` record through ``write`` when ``request_path`` appears (checked every ``interval_s``)."""

    def __init__(self, request_path: str, write: Callable[..., Any], step: Callable[[], int],
                 interval_s: float = 0.5) -> None:
        self.request_path, self.write, self.step, self.interval_s = request_path, write, step, interval_s
        self._stop = threading.Event()

    def start(self) -> None:
        """Start watching on a daemon thread."""
        threading.Thread(target=self._watch, name="shardscope-stall-dump", daemon=True).start()

    def stop(self) -> None:
        """Stop watching."""
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            if os.path.exists(self.request_path):
                self.dump()
                return

    def dump(self) -> None:
        """Write the ``stall`` record now (a full disk is not this thread's to report)."""
        try:
            self.write(step=self.step(), collectives=flight_recorder(), stack=stacks())
        except OSError:
            pass
