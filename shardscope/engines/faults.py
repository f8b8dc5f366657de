"""Fault injection for tests and demos: ``run.fault = "rank=1,step=3,kind=raise|exit|hang"``.

At the start of the given step, on the given rank: ``raise`` raises RuntimeError (the worker
writes an error record), ``exit`` calls ``os._exit(3)`` (no records, like a crash), ``hang``
sleeps forever (like a deadlock; the orchestrator's stall timeout must kill it). ``slow``
(``kind=slow,ms=50``) makes the rank busy for ``ms`` more milliseconds in every step from the given
one on, like a slower device: it spins rather than sleeps, because a slow device computes (a rank
that only slept would look like one waiting in a collective).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from shardscope.config import parse_fault


@dataclass(frozen=True)
class Fault:
    """One injected fault."""

    rank: int
    step: int
    kind: str  # raise | exit | hang | slow
    ms: int = 100  # kind "slow": extra busy milliseconds per step

    @staticmethod
    def parse(text: str) -> "Fault | None":
        """Return the fault described by ``text``, or None for an empty spec; raises ValueError."""
        if not text.strip():
            return None
        spec = parse_fault(text)
        return Fault(spec["rank"], spec["step"], spec["kind"], spec.get("ms", 100))

    def maybe_fire(self, rank: int, step: int) -> None:
        """Fire the fault if (rank, step) match; raises RuntimeError for kind "raise"."""
        if self.kind == "slow":
            if rank == self.rank and step >= self.step:
                busy_until = time.perf_counter() + self.ms / 1000
                while time.perf_counter() < busy_until:
                    pass
            return
        if rank != self.rank or step != self.step:
            return
        if self.kind == "raise":
            raise RuntimeError(f"injected fault at step {step} on rank {rank}")
        if self.kind == "exit":
            os._exit(3)
        while True:  # "hang": never returns; only a signal ends it
            time.sleep(3600)
