"""A run's loss per step, averaged from its ranks' local losses.

The loop adds no collective for the reported loss (``engines/loop.py``): every rank's ``step`` record
carries ``local_loss``, the mean over that rank's own micro-batches. Every data-parallel rank holds
the same number of samples, so the global mean loss is the mean of the ranks' local losses. Tensor-
parallel peers of one data-parallel rank compute the same loss, each such group has the same size,
so the mean over all ``world_size`` ranks is the mean over data-parallel ranks. A step's loss is
known once every rank has reported it; a step some rank never reported (it died) has no loss.

A record that carries ``loss`` holds the global loss already (a step whose verdict needed the loss
reduced, or a run directory written before ``local_loss`` existed): rank 0's is taken as it is.

Pure Python, no torch; O(ranks) per record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LossMean:
    """Gathers ranks' local losses per step and hands out each step's mean once it is complete."""

    _pending: dict[int, dict[int, float]] = field(default_factory=dict)  # step -> rank -> local loss

    def add(self, rank: int, step: int, record: dict[str, Any], world_size: int) -> float | None:
        """Fold one rank's step record; return the step's loss when this record completes it, else None."""
        if "loss" in record:  # global already: every rank carries it, rank 0's is the one taken
            self._pending.pop(step, None)
            return _number(record["loss"]) if rank == 0 else None
        local = _number(record.get("local_loss"))
        if local is None:
            return None
        seen = self._pending.setdefault(step, {})
        seen[rank] = local
        if len(seen) < max(world_size, 1):
            return None
        del self._pending[step]
        return sum(seen.values()) / len(seen)

    @property
    def waiting(self) -> int:
        """Steps some rank has reported and others not yet."""
        return len(self._pending)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
