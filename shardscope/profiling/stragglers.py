"""Straggler detection: the rank whose own work per step stays above its peers'.

Every rank's ``step`` record carries ``busy_s`` (CPU time the rank used in the step; see
``engines/step_clock.py``) and its wall-clock split ``time_<phase>_s``. Wall-clock step times are
equal on every rank (peers wait for the slowest in the collectives), so the comparison uses each
rank's own work. (A CUDA run's records carry only the stream-time split: shown, not judged; see
``engines/step_clock.py``.) A step is judged once every rank has reported it: a rank whose
``busy_s`` is more than ``threshold`` times the median of its peers' for ``window`` steps in a row
is flagged (and stays flagged, with the step the streak began and its median ratio). Step 0
(set-up costs) is left out.

``StragglerWatch`` folds records incrementally (O(ranks) per completed step), so the live views
can ask it on every redraw. Pure Python, no torch.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

DEFAULT_THRESHOLD = 1.5
DEFAULT_WINDOW = 5
BUSY = "busy_s"
# idle_s (wall minus busy: waiting in collectives or descheduled) is not a phase but is shown beside them.
PHASE_KEYS = ("time_data_s", "time_forward_s", "time_backward_s", "time_optimizer_s", "idle_s")
CPU_WAIT = "cpu_wait_s"  # waiting for a core (run queue): the machine's other load, not the rank's work
TIMING_KEYS = (BUSY, *PHASE_KEYS, CPU_WAIT)
FORWARD = "time_forward_s"


@dataclass
class Straggler:
    """A flagged rank: since ``from_step`` its busy time has been ``ratio`` x its peers' median."""

    rank: int
    from_step: int
    ratio: float
    steps: int  # length of the streak so far


@dataclass
class StragglerWatch:
    """Per-rank step timings of one run and the ranks flagged so far."""

    threshold: float = DEFAULT_THRESHOLD
    window: int = DEFAULT_WINDOW
    timing: dict[int, dict[int, dict[str, float]]] = field(default_factory=dict)  # rank -> step -> figures
    flagged: dict[int, Straggler] = field(default_factory=dict)
    _pending: dict[int, set[int]] = field(default_factory=dict, repr=False)  # step -> ranks reported
    _streak: dict[int, list[float]] = field(default_factory=dict, repr=False)  # rank -> ratios in the streak
    _streak_start: dict[int, int] = field(default_factory=dict, repr=False)

    def configure(self, settings: Any) -> None:
        """Take ``{"threshold", "window"}`` from a start record (missing or bad values keep the defaults)."""
        if isinstance(settings, dict):
            if isinstance(settings.get("threshold"), (int, float)) and settings["threshold"] > 0:
                self.threshold = float(settings["threshold"])
            if isinstance(settings.get("window"), int) and settings["window"] >= 1:
                self.window = settings["window"]

    def add(self, rank: int, step: int, record: dict[str, Any], world_size: int) -> None:
        """Fold one rank's step record; judge the step once all ``world_size`` ranks have reported it."""
        if BUSY not in record and FORWARD not in record:  # no timing (old records): the common fast path
            return
        # a run directory's records are input: only finite numbers are timing (a string or a bool is left out)
        figures = {k: float(v) for k in TIMING_KEYS if isinstance(v := record.get(k), (int, float))
                   and not isinstance(v, bool) and math.isfinite(v)}
        self.timing.setdefault(rank, {})[step] = figures
        if BUSY not in figures:  # CUDA: a phase split by stream events, no own-work signal to judge by
            return
        seen = self._pending.setdefault(step, set())
        seen.add(rank)
        if len(seen) >= world_size >= 2:
            del self._pending[step]
            if step > 0:
                self._judge(step, sorted(seen))

    def _judge(self, step: int, ranks: list[int]) -> None:
        busy = {r: self.timing[r][step][BUSY] for r in ranks}
        for r in ranks:
            peers = statistics.median(v for p, v in busy.items() if p != r)
            ratio = busy[r] / peers if peers > 0 else float("inf")
            if ratio <= self.threshold:
                self._streak.pop(r, None)
                continue
            streak = self._streak.setdefault(r, [])
            if not streak:
                self._streak_start[r] = step
            streak.append(ratio)
            if len(streak) >= self.window and (r not in self.flagged or self.flagged[r].from_step == self._streak_start[r]):
                self.flagged[r] = Straggler(r, self._streak_start[r], statistics.median(streak), len(streak))

    def per_rank(self, skip_first: int = 1) -> dict[int, dict[str, float | None]]:
        """Median of each timing figure per rank over the steps after ``skip_first``."""
        out: dict[int, dict[str, float | None]] = {}
        for rank in sorted(self.timing):
            steps = [v for s, v in self.timing[rank].items() if s >= skip_first] or list(self.timing[rank].values())
            out[rank] = {k: statistics.median(vals) if (vals := [v[k] for v in steps if k in v]) else None
                         for k in (BUSY, *PHASE_KEYS, CPU_WAIT)}
        return out


def describe(run: str, s: Straggler, start: dict[str, Any] | None, threshold: float) -> str:
    """One line naming the run, rank, host and device of a straggler."""
    start = start or {}
    where = ", ".join(str(x) for x in (start.get("host"), start.get("device"), start.get("device_name")) if x)
    return (f"straggler: {run} rank {s.rank}" + (f" ({where})" if where else "")
            + f": busy {s.ratio:.2f}x its peers' median for {s.steps} steps from step {s.from_step}"
            + f" (threshold {threshold:g}x)")
