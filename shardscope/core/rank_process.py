"""Which rank a process is, read from outside it. Torch-free; the caller hands in a psutil process.

A rank that is a new interpreter has torchrun's ``RANK`` in its initial environment (``/proc/<pid>/environ``).
A rank forked from its agent (``launch.start_method = fork``, ``engines/rank.py``) never executed anything: its
initial environment is the agent's, without ``RANK`` (torchrun sets it in the forked process's ``os.environ``,
which ``/proc`` does not show). Such a rank names itself ``ssrank<R>`` (``/proc/self/comm``: what ``ps`` and
``top`` show) as the first thing it does, and the orchestrator (``RunProcess.refresh_descendants``) and the device
sampler (``profiling/nvml.py``) read that name.
"""

from __future__ import annotations

import os
import re
from typing import Any

NAME_PREFIX = "ssrank"


def name_this_process(rank: int) -> None:
    """Name this process ``ssrank<rank>`` (Linux; elsewhere nothing is named and its rank is not known outside)."""
    try:  # system calls only: a codec import here, right after the fork, is what a fork makes unsafe
        fd = os.open("/proc/self/comm", os.O_WRONLY)
        try:
            os.write(fd, f"{NAME_PREFIX}{rank}".encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def rank_of(proc: Any) -> int | None:
    """The global rank of ``proc`` (a ``psutil.Process``): ``RANK`` in its environment, else its ``ssrank<R>``
    name; None for a process that is neither (torchrun's agent, a helper). psutil's errors propagate."""
    value = proc.environ().get("RANK")
    if value is None:
        return rank_from_name(proc.name())
    return int(value) if value.isdigit() else None


def rank_from_name(name: str) -> int | None:
    """R of a process named ``ssrank<R>``; None for any other name."""
    digits = name[len(NAME_PREFIX):] if name.startswith(NAME_PREFIX) else ""
    return int(digits) if digits.isdigit() else None


# How a forked rank ended, as its agent saw it (``engines/agent_exits.py``); torchrun's own failure table lists only
# the first rank its multiprocessing start observed failing, so a rank killed first but observed second is missing.
EXIT_PREFIX = "[shardscope agent] rank exit:"
_EXIT_ROW = re.compile(re.escape(EXIT_PREFIX) + r" rank (\d+) pid (\d+) code (-?\d+)$", re.MULTILINE)


def exit_line(rank: int, pid: int, code: int) -> str:
    """The console line for a rank that ended with ``code`` (negative: killed by that signal, as torchrun says)."""
    return f"{EXIT_PREFIX} rank {rank} pid {pid} code {code}"


def exit_rows(console: str) -> list[tuple[int, int, int]]:
    """(rank, exit code, pid) of every rank exit line in ``console``, in the order the ranks ended."""
    return [(int(r), int(c), int(p)) for r, p, c in _EXIT_ROW.findall(console)]
