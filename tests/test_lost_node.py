"""A lost node: two orchestrators on this machine share a run directory as nodes 0 and 1 of each run; node 1
(its whole process tree, or only its ranks) is killed mid-run. Node 0 gives the verdict "node 1 lost"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil

from shardscope.orchestrator.launcher import free_port

sys.path.insert(0, os.path.dirname(__file__))
from test_cli_e2e import leftover_processes  # noqa: E402

CLI = [sys.executable, "-m", "shardscope.cli"]


def start_nodes(out):
    """Start node 1 then node 0 (one rank each, ddp then fsdp2, long enough to be killed mid-run)."""
    common = ["run", "--preset", "smoke", "--headless", "--out", str(out), "--nnodes", "2",
              "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--set", "steps=100000", "--set", "world_size=2",
              "--set", "profile.enabled=false", "--set", "launch.node_timeout_s=4"]
    nodes = {n: subprocess.Popen([*CLI, *common, "--node-rank", str(n)], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for n in (1, 0)}
    rank1 = out / "ddp" / "metrics" / "rank1.jsonl"
    deadline = time.monotonic() + 180
    while not (rank1.exists() and b'"kind":"step"' in rank1.read_bytes()):
        assert time.monotonic() < deadline and all(p.poll() is None for p in nodes.values())
        time.sleep(0.3)
    return nodes


def kill(procs):
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass


def verdicts(out):
    runs = json.loads((out / "summary.json").read_text())["runs"]
    return {r["name"]: (r["status"], r.get("error") or "") for r in runs}


def wait_for_step(path, node0):
    deadline = time.monotonic() + 180
    while not (path.exists() and b'"kind":"step"' in path.read_bytes()):
        assert time.monotonic() < deadline and node0.poll() is None, node0.stdout.read()[-3000:]
        time.sleep(0.3)


def test_lost_ranks_fail_one_run_and_a_lost_orchestrator_fails_the_rest(tmp_path):
    """During ddp node 1's rank is SIGKILLed: ddp fails "node 1 lost" (no record from any rank there) and
    node 1 goes on. During fsdp2 node 1's orchestrator is SIGKILLed (its torchrun lives on): once its
    heartbeat is 4 s old node 0 fails fsdp2 "node 1 lost", stops its own ranks, and writes the summary;
    nothing is left running."""
    out = tmp_path / "lost"
    nodes = start_nodes(out)
    kill([p for p in psutil.Process(nodes[1].pid).children(recursive=True)
          if "shardscope.engines.worker" in " ".join(p.cmdline())])
    wait_for_step(out / "fsdp2" / "metrics" / "rank1.jsonl", nodes[0])
    kill([psutil.Process(nodes[1].pid)])
    output, _ = nodes[0].communicate(timeout=180)
    nodes[1].wait(10)
    assert nodes[0].returncode == 1, output[-3000:]
    got = verdicts(out)
    assert got["ddp"][0] == "failed" and got["ddp"][1].startswith("node 1 lost (every rank"), got
    assert got["fsdp2"][0] == "failed" and got["fsdp2"][1].startswith("node 1 lost (its orchestrator"), got
    deadline = time.monotonic() + 60  # node 1's orphaned torchrun ends when node 0's rank goes away
    while leftover_processes(str(out)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert leftover_processes(str(out)) == []
