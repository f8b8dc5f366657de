"""A rank never outlives its orchestrator: a thread that watches the orchestrator's pid.

torchrun starts ranks in sessions of their own, so a SIGKILLed orchestrator (and torchrun killed
with it) would leave them training. The orchestrator names itself in the rank's environment
(``events.ORCHESTRATOR_ENV`` = ``"<pid>:<create_time>"``); this thread checks twice a second that
the process is still there (same pid, same start time, not a zombie). When it is gone it sends
SIGTERM to its own rank (the worker writes ``end`` stopped, reason "orchestrator lost") and, if the
rank has not left ``hard_exit_s`` later (blocked in a collective, say), ends it with ``os._exit``.
Records already written stay: they are flushed per line.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from shardscope.events import ORCHESTRATOR_ENV
from shardscope.liveness import process_alive


class OrchestratorWatch:
    """Watches the orchestrator named in the environment; ``lost`` tells whether it disappeared."""

    def __init__(self, env: str | None = None) -> None:
        text = os.environ.get(ORCHESTRATOR_ENV, "") if env is None else env
        pid, _, created = text.partition(":")
        self.pid = int(pid) if pid.isdigit() else None
        self.create_time = float(created) if self.pid is not None and created else 0.0
        self._lost = False

    @property
    def enabled(self) -> bool:
        """True when an orchestrator was named (ranks launched by hand or by tests watch nothing)."""
        return self.pid is not None

    def lost(self) -> bool:
        """True once the orchestrator is gone (checked now if not known yet)."""
        if not self._lost and self.enabled:
            self._lost = not self._alive()
        return self._lost

    def _alive(self) -> bool:
        return process_alive(self.pid, self.create_time)  # type: ignore[arg-type]

    def start(self, *, interval_s: float = 0.5, hard_exit_s: float = 3.0, exit_code: int = 143) -> None:
        """Start the daemon thread: on loss, SIGTERM this process, then ``os._exit`` after ``hard_exit_s``."""
        if not self.enabled:
            return

        def watch() -> None:
            while not self.lost():
                time.sleep(interval_s)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(hard_exit_s)
            os._exit(exit_code)

        threading.Thread(target=watch, name="shardscope-orchestrator-watch", daemon=True).start()
