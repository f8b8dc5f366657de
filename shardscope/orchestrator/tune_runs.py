"""The comparisons of a ``shardscope tune`` search run without a terminal (the app's tune screen): each is a
``Session`` like any other, driven to its end on the caller's thread; ``stop()`` (any thread) stops the one under
way and every later one, and a deadline (the budget) stops what still runs when it passes.

``analysis/tune/search`` calls ``run`` as its runner; each run's status changes go to ``on_status(run, status,
error)`` as they happen.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from shardscope import config
from shardscope.profiling import state


class TuneRunner:
    """Runs a search's comparisons one after the other, silently; stoppable from any thread."""

    def __init__(self, device: str, on_status: Callable[[str, str, str], None] = lambda run, status, error: None,
                 poll_s: float = 0.25) -> None:
        self.device, self.on_status, self.poll_s = device, on_status, poll_s
        self._stopped = threading.Event()
        self._session: Any = None

    @property
    def stopped(self) -> bool:
        """Whether ``stop()`` was called."""
        return self._stopped.is_set()

    def stop(self) -> None:
        """Stop the comparison under way (its runs end ``stopped``) and start no other."""
        self._stopped.set()
        session = self._session
        if session is not None:
            session.stop_all()

    def run(self, comparison: config.Comparison, out: str, deadline: float | None = None) -> int:
        """Run ``comparison`` into ``out`` to its end (every run stopped at ``deadline``, a ``time.monotonic()``
        instant, if one still runs then); return its exit code."""
        from shardscope.orchestrator.session import Session

        session = Session(comparison, out, device=self.device)
        session.subscribe(self._updates)
        self._session = session
        if self._stopped.is_set():
            session.stop_all()
        session.start()
        stopping = False
        try:
            while (code := session.wait(self.poll_s)) is None:
                if not stopping and deadline is not None and time.monotonic() >= deadline:
                    stopping = True
                    session.stop_all()
            return code
        finally:
            self._session = None

    def _updates(self, updates: list[state.Update]) -> None:
        for u in updates:
            if isinstance(u, state.StatusChanged):
                self.on_status(u.run, u.status, u.error or "")
