"""A forked rank waits, before any connection, until its agent has forked all of this node's ranks
(``engines/rank.wait_for_siblings``): a rank forked while one of the agent's store threads is inside glibc's
resolver inherits that lock held and hangs in its first name lookup (bare torchrun, gdb: RESULTS 2026-11-27)."""

from __future__ import annotations

import subprocess
import sys

from shardscope.engines import rank


def test_returns_once_the_agent_has_forked_them_all():
    forked = iter([1, 2, 2, 3, 3])
    assert rank.wait_for_siblings(3, children=lambda: next(forked), limit_s=30, poll_s=0)


def test_gives_up_at_its_limit_instead_of_hanging():
    assert not rank.wait_for_siblings(4, children=lambda: 2, limit_s=0.05, poll_s=0.01)


def test_forked_children_see_their_siblings_through_the_real_parent():
    """Three children forked 0.3 s apart: each returns True, and none before the last one exists (without the wait
    the first would return 0.6 s earlier)."""
    script = """
import os, time
from shardscope.engines import rank
r, w = os.pipe()
pids = []
for i in range(3):
    if i == 2:
        last_fork = time.time()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        ok = rank.wait_for_siblings(3, limit_s=30)
        os.write(w, f"{i} {ok} {time.time()}\\n".encode())
        os._exit(0)
    pids.append(pid)
    time.sleep(0.3)
os.close(w)
for pid in pids:
    os.waitpid(pid, 0)
print(last_fork)
print(os.read(r, 4096).decode())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    lines = done.stdout.split()
    last_fork, rows = float(lines[0]), [lines[i:i + 3] for i in range(1, len(lines), 3)]
    assert sorted(r[0] for r in rows) == ["0", "1", "2"]
    assert all(r[1] == "True" for r in rows)
    assert all(float(r[2]) >= last_fork for r in rows)


def test_a_forked_rank_leads_a_session_of_its_own_as_torchruns_own_ranks_do():
    """``own_session``: a child forked as the agent forks a rank leaves the agent's session (and so, with autogroup,
    its scheduling group) and leads its own, as a rank that torchrun starts with ``start_new_session=True``; called
    again, it says so without failing."""
    script = """
import os
from shardscope.engines import rank

def autogroup():
    # "?" where the kernel has no autogroup, or a container shows the file empty or unreadable.
    try:
        with open("/proc/self/autogroup") as f:
            words = f.read().split()
    except OSError:
        return "?"
    return words[0] if words else "?"

r, w = os.pipe()
pid = os.fork()
if pid == 0:
    first = rank.own_session()
    again = rank.own_session()
    group = autogroup()
    leads = f"{os.getsid(0) == os.getpid()} {os.getpgid(0) == os.getpid()}"
    os.write(w, f"{first} {again} {leads} {os.getsid(0)} {group}".encode())
    os._exit(0)
os.waitpid(pid, 0)
group = autogroup()
print(os.read(r, 4096).decode(), os.getsid(0), group)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    first, again, leader, group_leader, child_sid, child_group, parent_sid, parent_group = out.stdout.split()
    assert (first, again, leader, group_leader) == ("True", "True", "True", "True")
    assert child_sid != parent_sid
    assert child_group == "?" or child_group != parent_group
