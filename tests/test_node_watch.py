"""NodeWatch.judge: after a run fails with only peers' errors, node 0 tells a live node from a lost one."""

from __future__ import annotations

import time

from shardscope.config import LaunchSpec
from shardscope.orchestrator.nodes import NodeWatch, silent_verdict


def test_judge_tells_a_beating_node_from_a_silent_one(tmp_path):
    beating = NodeWatch(str(tmp_path / "a"), node_rank=1, nnodes=2, timeout_s=10)
    beating.start()
    judge = NodeWatch(str(tmp_path / "a"), node_rank=0, nnodes=2, timeout_s=10)
    assert judge.judge() == []  # it beat again since the failure
    beating.stop()  # done: never lost
    assert judge.judge() == []

    silent = NodeWatch(str(tmp_path / "b"), node_rank=1, nnodes=2, timeout_s=3)
    t0 = time.monotonic()  # before the beat: a stall after it cannot shorten the wait measured below
    silent._write(done=False)  # one beat, then silence (its orchestrator was killed)
    judge = NodeWatch(str(tmp_path / "b"), node_rank=0, nnodes=2, timeout_s=3)
    assert judge.judge() == [1]
    assert time.monotonic() - t0 > 2.0  # decided by the heartbeat timeout, not at once


def test_one_node_judges_nothing(tmp_path):
    assert NodeWatch(str(tmp_path), node_rank=0, nnodes=1, timeout_s=3).judge() == []


def test_silent_node_is_blamed_only_while_this_nodes_ranks_reported():
    """Ranks 0-1 on node 0, 2-3 on node 1. Node 1 silent while node 0's ranks reported: node 1 lost. Nobody
    reported (the run never started training, a rendezvous that failed): no node is blamed, the console is."""
    launch = LaunchSpec(nnodes=2, node_rank=0)
    assert silent_verdict({0, 1}, 4, launch).startswith("node 1 lost (every rank there ended")
    assert silent_verdict({1}, 4, launch).startswith("node 1 lost")
    assert silent_verdict(set(), 4, launch) == ""
    assert silent_verdict({0, 2}, 4, launch) == ""
    assert silent_verdict({2}, 4, LaunchSpec(nnodes=2, node_rank=1)).startswith("node 0 lost")  # seen from node 1
    assert silent_verdict(set(), 4, LaunchSpec()) == ""  # one node
