"""A rank never outlives its orchestrator: a thread that watches the orchestrator's pid.

torchrun starts ranks in sessions of their own, so a SIGKILLed orchestrator (and torchrun killed
with it) would leave them training. The orchestrator names itself in the rank's environment
(``events.ORCHESTRATOR_ENV`` = ``"<pid>:<create_time>:<tid>"``); this thread checks twice a second that
the process is still there (same pid, same start time, not a zombie) and, on Linux, so is the thread
that launched torchrun (``<tid>``). The thread matters for the reason a rank records: torchrun's
parent-death SIGTERM is sent when that *thread* exits, and a SIGKILLed process's main thread can
still be tearing down its memory (neither gone nor a zombie yet) when torchrun's SIGTERM reaches the
rank; by then the launching thread is already gone from ``/proc/<pid>/task``. When it is gone it sends
SIGTERM to its own rank (the worker writes ``end`` stopped, reason "orchestrator lost") and, if the
rank has not left ``hard_exit_s`` later (blocked in a collective, say), ends it with ``os._exit``.
Records already written stay: they are flushed per line.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from shardscope.core.events import ORCHESTRATOR_ENV, PREVIOUS_RUN_ENV, WARM_AGENT_ENV
from shardscope.core.liveness import process_alive


def _thread_alive(pid: int, tid: int) -> bool:
    """True while thread ``tid`` of process ``pid`` exists (always True where there is no ``/proc``)."""
    if not os.path.isdir(f"/proc/{pid}/task"):
        return not os.path.isdir("/proc/self/task")  # no procfs here: nothing to tell; procfs: pid gone
    return os.path.isdir(f"/proc/{pid}/task/{tid}")


class OrchestratorWatch:
    """Watches the orchestrator named in the environment; ``lost`` tells whether it disappeared."""

    def __init__(self, env: str | None = None) -> None:
        text = os.environ.get(ORCHESTRATOR_ENV, "") if env is None else env
        pid, _, rest = text.partition(":")
        created, _, tid = rest.partition(":")
        self.pid = int(pid) if pid.isdigit() else None
        self.create_time = float(created) if self.pid is not None and created else 0.0
        self.tid = int(tid) if self.pid is not None and tid.isdigit() else None
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
        if not process_alive(self.pid, self.create_time):  # type: ignore[arg-type]
            return False
        return self.tid is None or _thread_alive(self.pid, self.tid)  # type: ignore[arg-type]

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


def wait_for_previous_run(env: str | None = None, poll_s: float = 0.01) -> float:
    """Block until every process named in ``PREVIOUS_RUN_ENV`` (the previous run's torchrun, launched
    beside this one while it tore down) is gone; return the seconds waited (0.0 when none was alive).

    A rank calls it after its start-up and before its first step, so a run's measured steps never share
    the machine with the previous run. The wait is bounded by the orchestrator, which stops a previous
    run that hangs on its way out (its stall timeout) and reaps it."""
    text = os.environ.get(PREVIOUS_RUN_ENV, "") if env is None else env
    named = []
    for item in filter(None, text.split(",")):
        pid, _, created = item.partition(":")
        try:
            named.append((int(pid), float(created)))
        except ValueError:
            continue
    start, waited = time.monotonic(), 0.0
    while any(process_alive(pid, created) for pid, created in named):
        time.sleep(poll_s)
        waited = time.monotonic() - start
    return waited


def wait_for_warm_agent(env: str | None = None, poll_s: float = 0.01) -> float | None:
    """Block until the next run's torchrun agent named in ``WARM_AGENT_ENV`` (started beside this run's
    start-up, ``engines/agent.py``) has finished its imports (created its ready file) or is gone; return when
    it was ready (epoch seconds, the file's content), None when no agent is named, it is gone, or the file
    does not hold a time. A rank calls it before its first step: the measured steps never share the machine
    with that agent's imports, only with its sleep."""
    text = os.environ.get(WARM_AGENT_ENV, "") if env is None else env
    pid, _, rest = text.partition(":")
    created, _, ready = rest.partition(":")
    try:
        named = (int(pid), float(created))
    except ValueError:
        return None
    while ready and not os.path.exists(ready) and process_alive(*named):
        time.sleep(poll_s)
    try:
        with open(ready, encoding="utf-8") as fh:
            return float(fh.read(64))
    except (OSError, ValueError):
        return None
