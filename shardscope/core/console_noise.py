"""Known library noise in a run's console, kept out of the console pane, errors and reports.

Each pattern matches one whole line that a library prints on every run and that says nothing
about the run: kineto (torch.profiler's backend) probing for a GPU on a CPU-only machine with a
CUDA build of torch, and kineto's tracepoints around each profiler window. Everything else,
real errors included, passes. ``console.log`` on disk keeps every byte; only what is shown is
filtered. Patterns are anchored on kineto's log format (``LEVEL:date time pid:tid file.cpp:line]``)
so that a user's or a traceback's line with the same words is never dropped.
"""

from __future__ import annotations

import re

_KINETO = r"(?:ERROR|WARNING|INFO|USDT):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \d+:\d+ "
NOISE = (
    # CPU machine, CUDA build of torch: kineto's device probe (cudaErrorInsufficientDriver = 35).
    re.compile(_KINETO + r"DeviceProperties\.cpp:\d+\] gpuGetDeviceCount failed with code \d+\s*$"),
    # kineto's USDT tracepoints at the start and stop of every profiler window.
    re.compile(_KINETO + r"SyncActivityProfilerHandler\.cpp:\d+\] profiler_(?:start|stop)\s*$"),
)
_HEADS = ("ERROR:", "WARNING:", "INFO:", "USDT:")


def is_noise(line: str) -> bool:
    """True when ``line`` (without its newline) is known library noise."""
    return any(p.match(line) for p in NOISE)


def clean(text: str) -> str:
    """``text`` without its noise lines (line endings of the other lines kept)."""
    return "".join(line for line in text.splitlines(keepends=True) if not is_noise(line.rstrip("\r\n")))


def could_become_noise(partial: str) -> bool:
    """True when an unterminated line might still turn out to be noise once its newline arrives."""
    return any(partial.startswith(h) or h.startswith(partial) for h in _HEADS)


class ConsoleFilter:
    """Filters console text that arrives in arbitrary chunks: whole lines are judged as they
    complete; an unterminated last piece is passed on at once unless it may still become a noise
    line, in which case it waits for the next chunk (or for a ``feed("")``, i.e. a poll that found
    nothing new, after which it is passed on as it is)."""

    def __init__(self) -> None:
        self._pending = ""

    def feed(self, text: str) -> str:
        """Return the shown part of ``text`` (plus any piece held back from the last call)."""
        if not text:
            held, self._pending = self._pending, ""
            return "" if is_noise(held) else held
        text = self._pending + text
        body, newline, tail = text.rpartition("\n")
        shown = clean(body + newline)
        if tail and could_become_noise(tail):
            self._pending = tail
        else:
            self._pending, shown = "", shown + tail
        return shown
