"""Run a helper command with a deadline, in a process group of its own, leaving nothing behind.

Used by ``predict``'s measurements (the collective calibration's torchrun job, each run's compute probe):
they start processes of their own (torchrun's ranks), so a deadline must kill the whole group, not only
the command it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Mapping, Sequence


def run_bounded(cmd: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None,
                merge_stderr: bool = False) -> subprocess.CompletedProcess[str] | None:
    """Run ``cmd`` in a new session and return its CompletedProcess (text output; stderr into stdout with
    ``merge_stderr``), or None if it ran past ``timeout_s``, after killing its whole process group."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True,
                            env=dict(env) if env is not None else None, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr or "")
