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
    except (OSError, ValueError, KeyError, TypeError, RecursionError, OverflowError):
        return "unknown"
    if host != socket.gethostname():
        return "unknown"
    return "alive" if process_alive(pid, created) else "lost"


BEAT_KEYS = {"node": int, "host": str, "pid": int, "t": float, "done": bool}  # what a node's heartbeat carries


def make_beat(node: int, done: bool) -> dict:
    """This node's heartbeat: its number, host, pid, the time and whether it finished (``BEAT_KEYS``)."""
    import os
    import time

    return {"node": node, "host": socket.gethostname()[:255], "pid": os.getpid(), "t": time.time(), "done": done}


def beat_problem(beat: object, node: int) -> str:
    """Why ``beat`` is not a heartbeat of ``node`` ("" when it is): a JSON object with exactly ``BEAT_KEYS``, each
    of its type (``t`` a finite time, an integer taken), ``node`` its sender's, ``host`` at most 255 characters and
    ``pid`` a positive 32-bit number. Node 0's record server checks every beat before writing it, and node 0 reads
    a beat file only through here, so a beat of another shape is refused, never a crash of the verdict."""
    import math

    if not isinstance(beat, dict) or set(beat) != set(BEAT_KEYS):
        return f"a heartbeat is a JSON object with the keys {', '.join(BEAT_KEYS)}"
    for key, want in BEAT_KEYS.items():
        value = beat[key]
        ok = (type(value) in (int, float) and math.isfinite(value)) if want is float else type(value) is want
        if not ok:
            return f"heartbeat {key}: not a {want.__name__}"
    if beat["node"] != node:
        return f"heartbeat node {beat['node']} sent as node {node}"
    if len(beat["host"]) > 255 or not 0 < beat["pid"] < 1 << 32:
        return "heartbeat host or pid out of range"
    return ""
