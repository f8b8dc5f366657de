"""The start record's ``process`` stage: a rank's process start from the kernel, placed in epoch seconds."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

TICK = 0.011  # the kernel counts a process's start in clock ticks (10 ms at the usual 100 Hz), rounded down

CHILD = ("import time; t = time.time(); from shardscope.engines.worker import process_start_time; "
         "print(repr(process_start_time()), repr(t))")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/stat")
def test_process_start_lies_between_spawn_and_the_first_line() -> None:
    """Independent bounds: the parent's clock just before it spawned the child, and the child's first line.
    psutil's ``create_time`` failed this (it adds the ticks to a boot time in whole seconds: up to 1 s early)."""
    before = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    start, first_line = (float(x) for x in out.split())
    assert before - TICK <= start <= first_line, (before, start, first_line)
