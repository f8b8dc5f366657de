"""Is a process (or the orchestrator that wrote a directory) still alive? Torch-free, psutil only when asked.

Shared by the rank side (``engines/watchdog.py`` watches its orchestrator), the orchestrator
(``orchestrator/lifeline.py`` writes its identity) and the analysis (a report rebuilt from files tells a
run still going from one whose orchestrator was lost). psutil is imported inside the check, so reading
a finished directory never loads it.
"""

from __future__ import annotations

import json
import socket

from shardscope.core.rundir import RunDir


def process_alive(pid: int, create_time: float) -> bool:
    """True when ``pid`` runs and is the process started at ``create_time`` (not a reused pid, not a zombie)."""
    import psutil  # here, not at module level: see the module docstring

    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - create_time) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def orchestrator_state(out_dir: str) -> str:
    """Return ``"alive"``, ``"lost"`` or ``"unknown"`` for the orchestrator that wrote ``out_dir``.

    Unknown: no identity file (an older directory), or it was written on another host.
    """
    try:
        with open(RunDir(out_dir).identity, encoding="utf-8") as fh:
            info = json.load(fh)
        pid, created, host = int(info["pid"]), float(info["create_time"]), str(info["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown"
    if host != socket.gethostname():
        return "unknown"
    return "alive" if process_alive(pid, created) else "lost"
