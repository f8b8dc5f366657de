"""Several nodes without a shared filesystem (issue 12): two orchestrators on this machine, each with its OWN
output directory, as nodes 0 and 1 of every run. Node 1's ranks send their records to node 0 over TCP
(``--records-endpoint``); one connection drops mid-run (fault ``netdrop``). Node 0's directory must hold
every record of node 1's ranks exactly once, in order, and judge and report as on a shared filesystem."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


sys.path.insert(0, __import__("os").path.dirname(__file__))
from _ports import port_block, unlistened_port  # noqa: E402
from test_cli_e2e import leftover_processes  # noqa: E402

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "shardscope.cli"]


def secret_env(tmp_path, name="secret"):
    """The environment of a node that holds the comparison's secret (a 0600 file made by the command)."""
    path = tmp_path / name
    subprocess.run([*CLI, "records-secret", str(path)], check=True, capture_output=True)
    return {**os.environ, "SHARDSCOPE_RECORDS_SECRET_FILE": str(path)}


def _records(path):
    with open(path, encoding="utf-8") as fh:
        return [line for line in fh.read().splitlines() if line.strip()]


def test_two_nodes_without_shared_files(tmp_path):
    """... while a flood without the secret (64 connections from 127.0.0.2, re-opened as soon as node 0 closes
    them) runs the whole time: every run still ends ok, and node 0's summary counts the refusals by source."""
    import threading

    from test_record_content import _flood

    rdzv = port_block(4)
    records = rdzv + 3  # the runs rendezvous on rdzv and rdzv + 1, the A/A control (ddp again) on rdzv + 2
    common = ["run", "--preset", "smoke", "--headless", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{rdzv}",
              "--records-endpoint", f"127.0.0.1:{records}", "--set", "steps=8", "--set", "world_size=2",
              "--set", "profile.enabled=false"]
    outs = {n: tmp_path / f"node{n}" for n in (0, 1)}
    env = secret_env(tmp_path)
    stop = threading.Event()
    flood = threading.Thread(target=_flood, args=(records, stop), daemon=True)
    flood.start()
    try:
        procs = {n: subprocess.Popen([*CLI, *common, "--out", str(outs[n]), "--node-rank", str(n),
                                      "--set", "runs.ddp.fault='rank=1,step=3,kind=netdrop'"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
                 for n in (1, 0)}
        logs = {n: p.communicate(timeout=400)[0] for n, p in procs.items()}
    finally:
        stop.set()
        flood.join(30)
    assert procs[0].returncode == 0, logs[0][-3000:] + logs[1][-3000:]
    assert procs[1].returncode == 0, logs[1][-3000:]
    summary = json.loads((outs[0] / "summary.json").read_text())
    assert [r["status"] for r in summary["runs"]] == ["ok"] * len(summary["runs"])
    refused = summary["record_server"]["refused_from"]
    assert refused.get("127.0.0.2", 0) > 0 and "127.0.0.1" not in refused, summary["record_server"]
    for run in summary["runs"]:
        name = run["name"]
        sent = _records(outs[1] / name / "metrics" / "rank1.jsonl")  # node 1's own copy
        got = _records(outs[0] / name / "metrics" / "rank1.jsonl")  # what reached node 0 over TCP
        assert got == sent and len(got) > 8, name  # every record, once, in order
        assert not (outs[1] / name / "metrics" / "rank0.jsonl").exists()  # node 1 holds only its own rank
        assert any('"kind":"end"' in line for line in got)
    assert (outs[0] / "nodes" / "node1.json").exists()  # heartbeats came over TCP too
    console1 = (outs[1] / "ddp" / "console.node1.log").read_text()
    assert "rank 1 dropped its record connection at step 3" in console1  # the drop did happen mid-run
    assert not (outs[0] / "ddp" / "console.node1.log").exists()  # nothing of node 1's files on node 0
    assert leftover_processes(str(tmp_path)) == []


def test_node0_unreachable_is_one_clear_line(tmp_path):
    """Node 1 alone: nobody listens on the records endpoint; every run fails with one line saying so, and no
    rank is started."""
    with unlistened_port() as port:
        proc = subprocess.run([*CLI, "run", "--preset", "smoke", "--headless", "--out", str(tmp_path / "n1"),
                               "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{port_block(2)}",
                               "--records-endpoint", f"127.0.0.1:{port}", "--set", "world_size=2",
                               "--set", "launch.node_timeout_s=2"], capture_output=True, text=True, timeout=300,
                              env=secret_env(tmp_path))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"node 0's orchestrator at 127.0.0.1:{port} unreachable for 2 s" in proc.stdout + proc.stderr
    assert not (tmp_path / "n1" / "ddp" / "metrics").exists()  # nothing was launched
    assert leftover_processes(str(tmp_path)) == []


def test_bad_records_endpoint_is_refused_in_one_line(tmp_path):
    proc = subprocess.run([*CLI, "run", "--preset", "smoke", "--dry-run", "--records-endpoint", "node0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--records-endpoint node0: " in proc.stderr and "host:port" in proc.stderr


def test_without_the_secret_nothing_starts_and_a_wrong_one_is_refused(tmp_path):
    """No secret: one line, exit 2, nothing written. Node 1 with another comparison's secret: node 0's record
    server refuses it at once (no wait for the timeout); node 1 starts nothing; node 0 fails its runs when
    node 1 never comes."""
    rdzv = port_block(3)
    common = ["run", "--preset", "smoke", "--headless", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{rdzv}",
              "--records-endpoint", f"127.0.0.1:{rdzv + 2}", "--set", "steps=4", "--set", "world_size=2",
              "--set", "profile.enabled=false", "--set", "launch.node_timeout_s=30"]
    bare = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSCOPE_RECORDS_SECRET")}
    none = subprocess.run([*CLI, *common, "--out", str(tmp_path / "none"), "--node-rank", "0"], capture_output=True,
                          text=True, timeout=300, env=bare)
    assert none.returncode == 2 and "records-secret FILE" in none.stderr and not (tmp_path / "none").exists()
    mine = secret_env(tmp_path, "mine")
    node0 = subprocess.Popen([*CLI, *common, "--out", str(tmp_path / "n0"), "--node-rank", "0",
                              "--set", "launch.node_timeout_s=15"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=mine)
    try:
        wrong = subprocess.run([*CLI, *common, "--out", str(tmp_path / "n1"), "--node-rank", "1"],
                               capture_output=True, text=True, timeout=300, env=secret_env(tmp_path, "theirs"))
        # the right secret, another comparison (another rendezvous id: an older job's leftover node): refused too
        other = subprocess.run([*CLI, *common, "--out", str(tmp_path / "n1b"), "--node-rank", "1",
                                "--set", "launch.rdzv_id='an-older-job'"], capture_output=True, text=True, timeout=300,
                               env=mine)
    finally:
        out0 = node0.communicate(timeout=300)[0]
    assert wrong.returncode == 1, wrong.stdout[-2000:] + wrong.stderr[-2000:]
    assert "refused this node" in wrong.stdout + wrong.stderr, wrong.stdout[-2000:]
    assert not (tmp_path / "n1" / "ddp" / "metrics").exists()
    assert other.returncode == 1 and "refused this node" in other.stdout + other.stderr, other.stdout[-2000:]
    assert not (tmp_path / "n1b" / "ddp" / "metrics").exists()
    assert node0.returncode == 1, out0[-2000:]
    assert not (tmp_path / "n0" / "ddp" / "metrics" / "rank1.jsonl").exists()
    assert leftover_processes(str(tmp_path)) == []
