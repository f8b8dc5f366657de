"""Replay a run directory's files as the same updates a live ``Session`` publishes.

Used by ``shardscope open DIR`` (the app on a finished or interrupted comparison), by
``shardscope report DIR`` (rebuilding run states from files alone) and by tests, which can
replay a recorded directory instead of launching torchrun.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

from shardscope.orchestrator.completion import Completion
from shardscope.profiling import state
from shardscope.analysis.fold import load_comparison, replay_updates
from shardscope.profiling.state import Update


class ReplaySource(Completion):
    """A run directory as a source with the ``Session`` API; control calls only post a notice.

    ``speed`` None publishes everything at once; otherwise updates are paced by their record
    timestamps divided by ``speed`` (records are split into small batches so charts animate).
    """

    def __init__(self, out_dir: str, *, speed: float | None = None) -> None:
        self.out_dir = os.path.abspath(out_dir)
        self.comparison = load_comparison(self.out_dir)
        self.run_names = [r.name for r in self.comparison.runs]
        self.speed = speed
        self.exit_code: int | None = None
        self._subscribers: list[Callable[[list[Update]], None]] = []
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def subscribe(self, callback: Callable[[list[Update]], None]) -> None:
        """Receive batches of updates (on the replay thread)."""
        self._subscribers.append(callback)

    def _publish(self, batch: list[Update]) -> None:
        for callback in self._subscribers:
            callback(batch)

    def start(self) -> None:
        """Start publishing the directory's updates on a background thread."""
        self._thread = threading.Thread(target=self._main, name="shardscope-replay", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        updates = replay_updates(self.out_dir)
        if self.speed is None:
            self._publish(updates)
        else:
            for batch, delay in _paced(updates, self.speed):
                time.sleep(delay)
                self._publish(batch)
        finished = [u for u in updates if isinstance(u, state.ComparisonFinished)]
        self.exit_code = finished[0].exit_code if finished else 1
        self._done.set()

    def _notice(self, what: str) -> None:
        self._publish([state.Notice(f"{what}: not possible while replaying {self.out_dir}", "warning")])

    def stop_run(self, name: str) -> None:
        """Replays cannot stop runs; posts a notice."""
        self._notice(f"stop {name}")

    def restart_run(self, name: str) -> None:
        """Replays cannot restart runs; posts a notice."""
        self._notice(f"restart {name}")

    def stop_all(self) -> None:
        """Nothing to stop in a replay."""


def _paced(updates: list[Update], speed: float, chunk: int = 8) -> list[tuple[list[Update], float]]:
    """Split updates into batches with delays following record timestamps / ``speed`` (≤ 0.5 s each)."""
    out: list[tuple[list[Update], float]] = []
    last_t: float | None = None
    for update in updates:
        if isinstance(update, state.RecordsArrived):
            recs = list(update.records)
            for i in range(0, len(recs), chunk):
                part = recs[i:i + chunk]
                t = float(part[0].get("t", 0.0))
                delay = 0.0 if last_t is None else min(0.5, max(0.0, (t - last_t) / speed))
                last_t = t
                out.append(([state.RecordsArrived(update.run, tuple(part), update.invalid_lines)], delay))
        else:
            out.append(([update], 0.0))
    return out
