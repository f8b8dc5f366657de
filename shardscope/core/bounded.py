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


# Every child interpreter shardscope starts (the model check, probes, agents, torchrun and its ranks) leaves the
# working directory and the script's folder off sys.path (Python 3.11's PYTHONSAFEPATH, inherited by the ranks):
# a typing_extensions.py in the folder shardscope runs from is never imported. A user's module is found through the
# folder its entry names (engines/user_module.load_entry), not through the working directory.
SAFE_PATH = {"PYTHONSAFEPATH": "1"}
PARENT_ENV = "SHARDSCOPE_PARENT_PID"  # run_bounded's child: the process whose end ends it (hold_lifeline)
_PR_SET_PDEATHSIG = 1


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (this process's environment when None) with the safe import path for a child interpreter."""
    return {**(os.environ if env is None else env), **SAFE_PATH}


def hold_lifeline() -> None:
    """Called first by a helper ``run_bounded`` started (the model check, a probe): end with SIGTERM when the
    process that started it ends, as the ranks do (Linux's PR_SET_PDEATHSIG, set by the child itself after exec,
    so the parent needs no preexec_fn); end at once if that process is already gone. A no-op elsewhere."""
    parent = int(os.environ.get(PARENT_ENV, "0") or 0)
    if not parent:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl here: the parent's deadline still bounds the child
        return
    if os.getppid() != parent:
        os._exit(1)


def run_bounded(cmd: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None,
                merge_stderr: bool = False) -> subprocess.CompletedProcess[str] | None:
    """Run ``cmd`` in a new session and return its CompletedProcess (text output; stderr into stdout with
    ``merge_stderr``), or None if it ran past ``timeout_s``, after killing its whole process group."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True,
                            env={**child_env(env), PARENT_ENV: str(os.getpid())}, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr or "")
