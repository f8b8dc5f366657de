"""core.bounded.run_bounded: output back when the command ends, its whole process group killed when it does not."""

from __future__ import annotations

import sys
import time
import uuid

import psutil

from shardscope.core.bounded import run_bounded


def test_output_comes_back_with_the_exit_code() -> None:
    done = run_bounded([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                       timeout_s=300)
    assert done is not None and done.returncode == 3
    assert done.stdout.strip() == "out" and done.stderr.strip() == "err"
    merged = run_bounded([sys.executable, "-c", "import sys; print('err', file=sys.stderr)"], 300, merge_stderr=True)
    assert merged is not None and merged.stdout.strip() == "err"


def test_a_command_past_its_deadline_leaves_no_process_behind() -> None:
    marker = f"shardscope-bounded-{uuid.uuid4().hex}"
    # The command starts a grandchild (as torchrun starts ranks) and both sleep far past the deadline.
    code = ("import subprocess, sys, time; "
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)', '{marker}']); time.sleep(3600)")
    assert run_bounded([sys.executable, "-c", code, marker], timeout_s=2) is None
    found = [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    # SIGKILL went to the whole group; an exit may still be in the kernel's hands: allow it a generous while.
    deadline = time.monotonic() + 60
    while _running(found) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(found), _running(found)


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    left = []
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.NoSuchProcess:
            pass
    return left
