"""Nothing of a comparison outlives its orchestrator, however the orchestrator dies.

Two guards, because torchrun starts every rank in a session of its own (so ranks do not die
with torchrun's process group):

- **torchrun** gets a parent-death signal (Linux ``prctl(PR_SET_PDEATHSIG, SIGTERM)``, set in the
  child between fork and exec). The kernel sends it when the *thread* that forked the child exits,
  so jobs must be started from a thread that lives as long as they do (the session thread does).
  torchrun forwards SIGTERM to its ranks.
- **every rank** watches the orchestrator's pid and launching thread (``engines/watchdog.py``), named
  in its environment as ``events.ORCHESTRATOR_ENV`` = ``"<pid>:<create_time>:<tid>"``, and stops itself when it is gone
  (including a SIGKILL of torchrun and orchestrator together). On several nodes each node's
  orchestrator names itself to its own ranks, so each node guards its own.

The orchestrator also leaves its identity in ``<out>/orchestrator.json`` so that a report rebuilt
from files can tell a run that is still going from one whose orchestrator was lost.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import socket
import sys
import threading
from typing import Any, Callable

import psutil

from shardscope.config import dump_json
from shardscope.core.events import ORCHESTRATOR_ENV
from shardscope.core.rundir import RunDir

_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    # glibc's soname first: find_library("c") runs `ldconfig -p` in a subprocess, at every command's start
    for name in ("libc.so.6", None):
        try:
            return ctypes.CDLL(name or ctypes.util.find_library("c"), use_errno=True).prctl
        except (OSError, AttributeError, TypeError):
            continue
    return None


_PRCTL = _load_prctl()  # resolved here, in the parent: the child between fork and exec only calls it


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """Return a ``preexec_fn`` that makes the child receive ``sig`` when its parent thread dies.

    None where the platform has no ``prctl`` (the rank watchdogs still guard the ranks). The
    returned function also ends the child at once if the parent is already gone by then.
    """
    if _PRCTL is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        _PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), int(sig))

    return preexec


def identity() -> str:
    """Return this process and thread for ranks to watch: ``"<pid>:<create_time>:<tid>"``.

    ``tid`` is the calling thread's native id: call it from the thread that starts torchrun, whose
    exit sends torchrun its parent-death signal (``engines/watchdog.py`` says why ranks check it).
    """
    pid = os.getpid()
    return f"{pid}:{psutil.Process(pid).create_time():.3f}:{threading.get_native_id()}"


def rank_env() -> dict[str, str]:
    """Return the environment additions that tell ranks which orchestrator to watch."""
    return {ORCHESTRATOR_ENV: identity()}


def write_identity(out_dir: str) -> None:
    """Record this orchestrator (host, pid, start time) in ``<out>/orchestrator.json``."""
    pid = os.getpid()
    dump_json(RunDir(out_dir).identity,
              {"host": socket.gethostname(), "pid": pid, "create_time": psutil.Process(pid).create_time()})
