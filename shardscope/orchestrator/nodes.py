"""Which node owns which file of a run directory shared by several nodes.

Node 0 owns the verdict: the runs' status and console files, the device samples, the summary and the
reports. Every other node writes files of its own beside them (``rundir.console_name(N)``,
``rundir.devices_name(N)``, its heartbeat ``RunDir.heartbeat(N)``), so no node overwrites or interleaves
another's; rank record files are already one per global rank. ``NodeWatch`` lets node 0 notice a lost node.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

from shardscope.config import LaunchSpec, dump_json
# Re-exported for orchestrator/session.py only, until it names its files through RunDir (issue 11, split).
from shardscope.core.liveness import beat_problem, make_beat
from shardscope.core.record_secret import comparison_key, secret_from_env
from shardscope.core.record_wire import send_beat
from shardscope.core.rundir import RunDir


def owns_verdict(node_rank: int) -> bool:
    """True for the node that writes status.json, comparison.json, the summary and the reports (node 0)."""
    return node_rank == 0


def node_label(node_rank: int, nnodes: int) -> str:
    """Return ``"node N (host)"`` on several nodes, ``""`` on one (labels stay as they were)."""
    return f"node {node_rank} ({socket.gethostname()})" if nnodes > 1 else ""


class NodeWatch:
    """Tells node 0 when another node is lost: its orchestrator stopped beating, or its ranks all vanished.

    Every node other than 0 rewrites ``<out>/nodes/node<N>.json`` once a second from a thread of its own
    (so a busy or blocked session loop does not look like a death) and marks it ``done`` when it finishes.
    Node 0 calls ``lost()``: nodes whose last beat (or, before the first one, the watch's start) is older
    than ``timeout_s``; the other nodes call ``leader_lost()`` for node 0 (which beats too on a shared
    filesystem), so that they stop starting runs when it is gone. On one node the watch does nothing. With ``records_endpoint`` (no shared
    filesystem) the beats go over TCP to node 0's record server, which writes the same files there.
    """

    def __init__(self, out_dir: str, node_rank: int, nnodes: int, timeout_s: float, records_endpoint: str = "",
                 comparison: dict | None = None) -> None:
        self.out_dir, self.node_rank, self.nnodes, self.timeout_s = out_dir, node_rank, nnodes, timeout_s
        self.records_endpoint = records_endpoint
        self.comparison = comparison or {}  # its beats over TCP prove this comparison (record_secret.comparison_key)
        self._started = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: set[int] = set()
        self._last_sent = time.time()  # the last beat node 0's record server took (records over TCP)
        self.heard: dict[int, float] = {}  # node 0 over TCP: when each node last got any message through (its
        # record server's ``heard``): a node whose ranks' records arrive is alive even when its beats do not

    def start(self) -> None:
        """Start beating (every node of a multi-node comparison; node 0 only on a shared filesystem, where the
        others read its beat; over TCP they know node 0 is gone when it stops taking theirs)."""
        if self.nnodes > 1 and not (owns_verdict(self.node_rank) and self.records_endpoint):
            self._last_sent = time.time()
            self._thread = threading.Thread(target=self._beat_forever, name="shardscope-heartbeat", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop beating and say this node finished (so node 0 does not take its silence for a loss)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            try:
                self._write(done=True)
            except OSError:  # node 0 gone or the disk full: node 0 judges from the silence
                pass

    def _beat_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self._write(done=False)
                self._last_sent = time.time()
            except OSError:  # a full or flaky disk, or node 0 gone: the silence is judged
                pass
            self._stop.wait(1.0)

    def _write(self, done: bool) -> None:
        beat = make_beat(self.node_rank, done)
        if self.records_endpoint:
            send_beat(self.records_endpoint, self.node_rank, beat,
                      secret=comparison_key(secret_from_env(), self.comparison))
            return
        path = RunDir(self.out_dir).heartbeat(self.node_rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        dump_json(path, beat)

    def lost(self) -> list[int]:
        """Node 0: the nodes lost so far (a lost node stays lost); [] elsewhere or on one node."""
        if self.nnodes == 1 or not owns_verdict(self.node_rank):
            return []
        now = time.time()
        for node, beat in self._beats().items():
            last = max(float(beat.get("t") or self._started), self.heard.get(node, 0.0))
            if not beat.get("done") and now - last > self.timeout_s:
                self._lost.add(node)
        return sorted(self._lost)

    def leader_lost(self) -> list[int]:
        """Nodes other than 0: ``[0]`` once node 0's orchestrator is gone (its beat older than ``timeout_s``
        on a shared filesystem; over TCP, its record server took no beat for that long), else []. A node 0
        that has not beaten yet is not judged (torchrun's rendezvous waits for it)."""
        if self.nnodes == 1 or owns_verdict(self.node_rank):
            return []
        now = time.time()
        if self.records_endpoint:
            gone = now - self._last_sent > self.timeout_s
        else:
            beat = self._beats([0]).get(0, {})
            gone = bool(beat.get("t")) and not beat.get("done") and now - float(beat["t"]) > self.timeout_s
        if gone:
            self._lost.add(0)
        return [0] if 0 in self._lost else []

    def _beats(self, nodes: list[int] | None = None) -> dict[int, dict]:
        beats = {}
        for node in (range(1, self.nnodes) if nodes is None else nodes):
            try:
                with open(RunDir(self.out_dir).heartbeat(node), encoding="utf-8") as fh:
                    beat = json.loads(fh.read(4096))
                beats[node] = beat if not beat_problem(beat, node) else {"t": None, "done": False}
            except (OSError, ValueError, RecursionError):
                beats[node] = {"t": None, "done": False}  # no beat yet (or none readable: judged as silence)
        return beats

    def judge(self) -> list[int]:
        """Node 0, when a run failed with only peers' errors: did another node die with it?

        Waits until every other node has beaten since this call (alive: returns []) or the heartbeat timeout
        calls the silent ones lost (returns them). A live node beats every second, so that wait is short.
        """
        if self.nnodes == 1 or not owns_verdict(self.node_rank):
            return []
        since = time.time()
        deadline = time.monotonic() + self.timeout_s + 1.5
        while not self.lost() and time.monotonic() < deadline:
            if all(b.get("done") or float(b.get("t") or 0.0) > since for b in self._beats().values()):
                break
            time.sleep(0.25)
        return self.lost()


def lost_message(lost: list[int], timeout_s: float, refused_from: dict[str, int] | None = None) -> str:
    """Return the verdict for runs that lost nodes: ``node 1 lost (no heartbeat for 30 s)``, and, when node 0's
    record server was refusing connections that never proved the secret meanwhile, how many and from where."""
    names = ", ".join(str(n) for n in lost)
    out = f"node{'s' if len(lost) > 1 else ''} {names} lost (its orchestrator sent no heartbeat for {timeout_s:g} s)"
    if refused_from:
        top = sorted(refused_from.items(), key=lambda kv: -kv[1])
        where = ", ".join(f"{n:,} from {src}" for src, n in top[:3]) + (" and more" if len(top) > 3 else "")
        out += (f"; the record server refused {sum(refused_from.values()):,} unauthenticated connections meanwhile "
                f"({where})")
    return out


def silent_nodes(reported: set[int], world_size: int, nnodes: int) -> list[int]:
    """Return the nodes none of whose ranks wrote an ``end`` or ``error`` record (they died, killed or crashed).

    Global ranks of node N are ``N * per_node .. N * per_node + per_node - 1`` (static rendezvous).
    """
    per_node = world_size // nnodes if nnodes else world_size
    return [n for n in range(nnodes) if per_node and not reported & set(range(n * per_node, (n + 1) * per_node))]


def silent_verdict(reported: set[int], world_size: int, launch: LaunchSpec) -> str:
    """Return ``node N lost (...)`` when another node's ranks all ended without a record, else "".

    Only while this node's own ranks reported: when none of them did either, the run failed before
    training (a rendezvous that could not start, say) and its console says why, not a lost node.
    """
    if launch.nnodes == 1:
        return ""
    silent = silent_nodes(reported, world_size, launch.nnodes)
    if launch.node_rank in silent:
        return ""
    if not silent:
        return ""
    names = ", ".join(str(n) for n in silent)
    return f"node{'s' if len(silent) > 1 else ''} {names} lost (every rank there ended without an end or error record)"
