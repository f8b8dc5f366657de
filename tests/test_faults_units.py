"""Fast checks of the fault helpers: torchrun's root cause, disk errors named, the rank watchdog."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

from shardscope import outspace
from shardscope.engines.watchdog import OrchestratorWatch
from shardscope.liveness import process_alive
from shardscope.orchestrator import verdict

CONSOLE = """Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 111)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 222)  (SIGKILL)
"""


def test_only_torchruns_root_cause_counts_as_killed():
    assert verdict.killed_ranks(CONSOLE) == [(1, 9, 222)]
    assert verdict.killed_ranks(CONSOLE.replace("-9 (pid: 222)", "1 (pid: 222)")) == []
    # Under load torchrun may observe the killed rank's peer first: a SIGKILL among the other failures counts.
    swapped = CONSOLE.replace("-15 (pid: 111)", "-9 (pid: 111)").replace("-9 (pid: 222)", "1 (pid: 222)")
    assert verdict.killed_ranks(swapped) == [(0, 9, 111)]


def test_disk_error_named_through_causes():
    inner = OSError(errno.ENOSPC, "No space left on device", "/x/rank0.jsonl")
    try:
        try:
            raise inner
        except OSError as err:
            raise RuntimeError("Trace is already saved") from err
    except RuntimeError as outer:
        found = outspace.disk_error(outer)
    assert found is inner and outspace.describe(found) == "no space left on device writing /x/rank0.jsonl"
    assert outspace.disk_error(OSError(errno.ENOENT, "nope")) is None


def test_watchdog_tells_a_live_process_from_a_gone_one():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    import psutil

    created = psutil.Process(child.pid).create_time()
    watch = OrchestratorWatch(f"{child.pid}:{created:.3f}")
    assert watch.enabled and not watch.lost()
    assert not process_alive(child.pid, created + 5)  # same pid, another start time: a reused pid
    child.kill()
    child.wait()
    assert watch.lost()
    assert not OrchestratorWatch("").enabled and os.getpid()
