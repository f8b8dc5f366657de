"""Fast checks of the fault helpers: torchrun's root cause, disk errors named, the rank watchdog."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time

import pytest

from shardscope.core import outspace
from shardscope.engines.watchdog import OrchestratorWatch
from shardscope.core.liveness import process_alive
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


FORKED_CONSOLE = """[shardscope agent] rank exit: rank 1 pid 222 code -9
[shardscope agent] rank exit: rank 0 pid 111 code 1
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 111)
"""


def test_forked_ranks_exits_said_by_their_agent_count():
    """Forked ranks: torchrun's table names one failure (rank 0's broken collective, observed first); the agent's
    lines give every rank's end in order, so the killed rank is found and the other's code is kept."""
    assert verdict.killed_ranks(FORKED_CONSOLE) == [(1, 9, 222)]
    assert verdict.exit_codes(FORKED_CONSOLE) == {0: 1, 1: -9}
    assert verdict.from_exit(FORKED_CONSOLE.replace("code -9", "code 3"), [1], {1: 2}).error.startswith(
        "rank 1 exited with code 3 at step 3")
    # a rank the agent did not see end (torchrun reaped it first): its code is unknown, not 0
    unseen = FORKED_CONSOLE.replace("[shardscope agent] rank exit: rank 1 pid 222 code -9\n", "")
    assert verdict.from_exit(unseen, [1], {1: 2}).error.startswith("rank 1 exited with an unknown code at step 3")
    torchrun_only = "failed (exitcode: 1) local_rank: 0 (pid: 111) of fn: run_script_path (start_method: fork)\n" + \
        unseen.replace("[shardscope agent] rank exit: rank 0 pid 111 code 1\n", "")
    assert "an unknown code" in verdict.from_exit(torchrun_only, [1], {1: 2}).error
    assert "code 0" in verdict.from_exit(torchrun_only.replace(verdict.FORKED_MARK, ""), [1], {1: 2}).error


def _reap_as_torchrun_does(pid: int, watch) -> int:
    """Reap ``pid`` as torchrun does (``waitpid`` by the parent), once the watch has seen it end: which of the two
    runs first is the scheduler's choice on a loaded machine (the verdict's fallback covers a rank it missed)."""
    deadline = time.monotonic() + 120
    while pid not in watch.ended() and time.monotonic() < deadline:
        time.sleep(0.02)
    return os.waitpid(pid, 0)[1]


def test_an_agent_learns_how_each_forked_rank_ended_without_reaping_it():
    """ExitWatch: children named as ranks, ended by a signal, a code and success; the parent (torchrun, here this
    test) still reaps each one itself and sees the same status."""
    import signal

    from shardscope.core import rank_process
    from shardscope.engines.agent_exits import ExitWatch

    watch = ExitWatch(poll_s=0.02).start()
    pids = []
    go_read, go_write = os.pipe()
    for rank, how in enumerate(("kill", "exit3", "ok")):
        pid = os.fork()
        if pid == 0:  # the child: name itself, wait until told to go (once it is watched), end as told
            os.close(go_write)
            rank_process.name_this_process(rank)
            os.read(go_read, 1)
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3 if how == "exit3" else 0)
        pids.append(pid)
    os.close(go_read)
    deadline = time.monotonic() + 120  # a loaded machine may run the watcher late: no timing is asserted
    while watch.watched() != set(pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    os.write(go_write, b"go!")  # one byte each
    os.close(go_write)
    statuses = [_reap_as_torchrun_does(pid, watch) for pid in pids]
    assert os.WIFSIGNALED(statuses[0]) and os.WEXITSTATUS(statuses[1]) == 3 and statuses[2] == 0
    lines = watch.lines()
    assert sorted(lines) == sorted([rank_process.exit_line(0, pids[0], -9), rank_process.exit_line(1, pids[1], 3),
                                    rank_process.exit_line(2, pids[2], 0)])
    assert sorted(rank_process.exit_rows("\n".join(lines))) == [(0, -9, pids[0]), (1, 3, pids[1]), (2, 0, pids[2])]


def test_a_rank_torchrun_reaps_before_any_waiter_saw_it_keeps_its_exit_code():
    """The race a loaded machine runs: torchrun reaps a rank before the watch's threads saw it end. With the poll
    off, only the ``os.waitpid`` tap sees the rank (named, then reaped by the blocking wait that multiprocessing
    makes once the rank's sentinel is ready); its code is kept, another child's is not, and the tap is removed."""
    from shardscope.core import rank_process
    from shardscope.engines import agent_exits
    from shardscope.engines.agent_exits import ExitWatch

    real = os.waitpid
    watch = ExitWatch().start(poll=False)
    try:
        go_read, go_write = os.pipe()
        pids = []
        for name in (5, None):  # a rank, and a child that is not one
            pid = os.fork()
            if pid == 0:
                os.close(go_write)
                if name is not None:
                    rank_process.name_this_process(name)
                os.read(go_read, 1)
                os._exit(7 if name is not None else 4)
            pids.append(pid)
        os.close(go_read)
        deadline = time.monotonic() + 120  # the child names itself when the scheduler lets it: no timing asserted
        while agent_exits._rank_of(pids[0]) != 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.write(go_write, b"go")
        os.close(go_write)
        statuses = [os.waitpid(pid, 0)[1] for pid in pids]  # the tap, as torchrun's multiprocessing calls it
        assert [os.waitstatus_to_exitcode(s) for s in statuses] == [7, 4]
        assert watch.watched() == set()  # no waiter thread ever ran: the tap alone saw it
        assert watch.lines() == [rank_process.exit_line(5, pids[0], 7)]
        assert os.waitpid is real
    finally:
        os.waitpid = real


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


def test_watchdog_counts_the_launching_threads_exit_as_the_orchestrators_loss():
    """torchrun's parent-death signal follows the launching thread, which may go before the process does."""
    from shardscope.orchestrator import lifeline

    release, named = threading.Event(), []

    def launcher() -> None:
        named.append(lifeline.identity())
        release.wait()

    thread = threading.Thread(target=launcher)
    thread.start()
    while not named:
        time.sleep(0.01)
    pid, created, tid = named[0].split(":")
    assert int(pid) == os.getpid() and int(tid) == thread.native_id != threading.get_native_id()
    watch = OrchestratorWatch(named[0])
    assert watch.tid == thread.native_id and not watch.lost()
    release.set()
    thread.join()  # Python's join returns before the kernel has finished the thread: wait for that
    deadline = time.monotonic() + 10
    while not watch.lost() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watch.lost()  # the process lives on, the thread that started torchrun does not
    assert not OrchestratorWatch(f"{pid}:{created}").lost()  # an identity without a thread: the process alone


def test_a_taken_rendezvous_port_is_read_from_torchruns_console():
    console = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
               "address. port: 41001, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use\n")
    one = verdict.from_rendezvous(console, nnodes=1)
    assert one.error == "rendezvous port 41001 already in use on this node" and one.cause == verdict.RENDEZVOUS
    assert "port + the run's index" in verdict.from_rendezvous(console, nnodes=2).error
    assert verdict.from_rendezvous("RuntimeError: injected fault at step 3 on rank 1", nnodes=2) is None


def test_a_short_disk_names_each_part_in_a_unit_that_shows_it(tmp_path):
    """A part of a few KiB reads "49.7 KiB", not "0.0 MiB" (a figure must not read as nothing)."""
    needed = outspace.SpaceEstimate(traces=1 << 60, records=50_900, weights=548_000, reports=0)
    line = outspace.shortfall(str(tmp_path / "out"), needed)
    assert line is not None and line.startswith(f"--out {tmp_path / 'out'}: ")
    assert "records 49.7 KiB" in line and "initial weights 535.2 KiB" in line and "traces 1024.0 PiB" not in line
    assert " 0.0 " not in line


def test_atomic_write_that_fails_leaves_the_old_file_and_no_partial(tmp_path):
    """write_atomic: a writer that fails part-way (a full disk) leaves the previous content whole and no
    partial file beside it."""
    from shardscope.config import write_atomic

    path = tmp_path / "summary.json"
    path.write_text("old")

    def half(fh):
        fh.write("new, half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        write_atomic(path, half)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_rank_waits_for_the_previous_runs_torchrun_to_be_gone():
    """``wait_for_previous_run``: while the named process lives the rank does not start; once it is gone
    (reaped or a zombie) the wait returns the time waited. Nothing named, or a pid already gone: no wait."""
    from shardscope.engines.watchdog import wait_for_previous_run
    import psutil

    assert wait_for_previous_run("") == 0.0
    assert wait_for_previous_run("999999999:1.0,garbage") == 0.0
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        named = f"{sleeper.pid}:{psutil.Process(sleeper.pid).create_time():.3f}"
        result = []
        waiter = threading.Thread(target=lambda: result.append(wait_for_previous_run(named)), daemon=True)
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and not result  # the previous run is still there: no first step yet
    finally:
        sleeper.kill()
    waiter.join(timeout=60)
    sleeper.wait()
    assert not waiter.is_alive() and result and result[0] > 0


def test_disk_hint_names_the_largest_part(tmp_path):
    """The pre-launch space check's advice follows the part of the estimate that is large: records for a
    huge step count (profiling off would not help), traces for a huge profiler window."""
    est = outspace.SpaceEstimate(traces=1 << 20, records=1 << 60, weights=0, reports=0)
    line = outspace.shortfall(str(tmp_path / "out"), est)
    assert line is not None and "run fewer steps (the records are the largest part" in line
    est = outspace.SpaceEstimate(traces=1 << 60, records=1 << 20, weights=0, reports=0)
    assert "set profile.enabled=false (the traces are the largest part)" in outspace.shortfall(str(tmp_path), est)
