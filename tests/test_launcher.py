"""Stopping a job leaves no process behind, even ranks that started sessions of their own."""

from __future__ import annotations

import sys
import time

import psutil

from shardscope.orchestrator import launcher

# A stand-in for torchrun (pure logic of process handling, no torch): a parent that starts two
# children in new sessions, as torch elastic does, and ignores SIGTERM like a hung rank would.
PARENT = r"""
import signal, subprocess, sys, time
child = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
for _ in range(2):
    subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("started", flush=True)
time.sleep(600)
"""


def _alive(pids):
    """The pids still running (a zombie or a vanished process is not)."""
    out = []
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def test_stop_kills_whole_tree(tmp_path):
    plan = launcher.LaunchPlan("t", (sys.executable, "-c", PARENT), {}, str(tmp_path / "console.log"), str(tmp_path))
    proc = launcher.start(plan)
    deadline = time.time() + 20
    while time.time() < deadline and len(psutil.Process(proc.pid).children(recursive=True)) < 2:
        time.sleep(0.1)
    proc.refresh_descendants()
    pids = [proc.pid, *proc.seen]
    assert len(pids) == 3
    t0 = time.time()
    proc.stop(grace_s=1.0)
    assert time.time() - t0 < 60  # a bound for a hang: SIGTERM, 1 s grace, SIGKILL, reap
    deadline = time.time() + 60  # a killed process needs CPU time to finish exiting
    while (alive := _alive(pids)) and time.time() < deadline:
        time.sleep(0.1)
    assert alive == []
    assert "started" in (tmp_path / "console.log").read_text()


def test_torchrun_argv():
    argv = launcher.torchrun_argv("/x/spec.json", nproc_per_node=4, nnodes=2, node_rank=1, rdzv_endpoint="h:29500")
    s = " ".join(argv)
    assert "--nproc-per-node 4" in s and "--nnodes 2" in s and "--node-rank 1" in s and "--rdzv-endpoint h:29500" in s
    assert s.endswith("-m shardscope.engines.worker /x/spec.json")


RANKS = r"""
import os, subprocess, sys, time
child = "import time; time.sleep(600)"
for rank in range(2):
    subprocess.Popen([sys.executable, "-c", child], env={**os.environ, "RANK": str(rank)})
time.sleep(600)
"""


def test_rank_processes_are_scanned_until_all_are_seen_then_at_most_every_interval(tmp_path):
    """A scan walks every process on the machine: the orchestrator's poll makes one while a rank is missing, and then
    only when the last is ``every_s`` old; each scan's answer is the ranks' real pids."""
    plan = launcher.LaunchPlan("t", (sys.executable, "-c", RANKS), {}, str(tmp_path / "console.log"), str(tmp_path))
    proc = launcher.start(plan)
    scans = []
    real = proc.refresh_descendants

    def counted():
        scans.append(time.monotonic())
        return real()

    proc.refresh_descendants = counted
    try:
        deadline = time.time() + 30
        while len(ranks := proc.rank_processes(2, every_s=3600.0)) < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert sorted(ranks.values()) == [0, 1]
        assert {p.pid for p in psutil.Process(proc.pid).children()} == set(ranks)
        n = len(scans)
        for _ in range(5):  # every rank known, the last scan fresh: no walk of the process table
            assert proc.rank_processes(2, every_s=3600.0) == ranks
        assert len(scans) == n
        assert proc.rank_processes(3, every_s=3600.0) == ranks and len(scans) == n + 1  # one missing: scanned
        assert proc.rank_processes(2, every_s=0.0) == ranks and len(scans) == n + 2  # the interval passed: scanned
    finally:
        proc.kill()


SPAWNING_RANKS = r"""
import os, subprocess, sys, time
trigger = sys.argv[1]
child = (
    "import os, subprocess, sys, time\n"
    "while not os.path.exists(sys.argv[1]): time.sleep(0.02)\n"
    "late = subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
    " time.sleep(600)'], start_new_session=True)\n"
    "open(sys.argv[1] + '.' + os.environ['RANK'], 'w').write(str(late.pid))\n"
    "time.sleep(600)\n"
)
for rank in range(2):
    subprocess.Popen([sys.executable, "-c", child, trigger], env={**os.environ, "RANK": str(rank)})
time.sleep(600)
"""


def test_a_process_a_rank_starts_between_scans_is_remembered_and_killed_with_the_job(tmp_path):
    """Between the machine-wide scans each poll walks torchrun's own subtree: a process a rank starts after the last
    scan is remembered at the next poll, without a scan, and ``kill`` (torchrun gone, so nothing left under it to
    find) still ends it."""
    trigger = tmp_path / "go"
    plan = launcher.LaunchPlan("t", (sys.executable, "-c", SPAWNING_RANKS, str(trigger)), {},
                               str(tmp_path / "console.log"), str(tmp_path))
    proc = launcher.start(plan)
    late = []
    try:
        deadline = time.time() + 30
        while len(proc.rank_processes(2, every_s=3600.0)) < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert len(proc.rank_processes(2, every_s=3600.0)) == 2
        scans = []
        real = proc.refresh_descendants
        proc.refresh_descendants = lambda: scans.append(1) or real()
        trigger.write_text("")
        deadline = time.time() + 30
        while len(late) < 2 and time.time() < deadline:
            late = [int(p.read_text()) for p in tmp_path.glob("go.*") if p.read_text()]
            time.sleep(0.05)
        assert len(late) == 2
        proc.rank_processes(2, every_s=3600.0)
        assert scans == [] and set(late) <= set(proc.seen)
        proc.popen.kill()  # torchrun gone: the late processes are orphans, found by no walk from it
        proc.popen.wait(timeout=30)
        proc.kill()
        deadline = time.time() + 60  # a killed process needs CPU time to finish exiting
        while (alive := _alive(late)) and time.time() < deadline:
            time.sleep(0.1)
        assert alive == []
    finally:
        proc.kill()
        for pid in late:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
