"""Records over TCP, for nodes that share no filesystem with node 0 (Kubernetes, cloud clusters).

A rank on another node still writes its own record file (its own orchestrator tails it), and also sends
every record line to node 0's orchestrator (``orchestrator/record_server.py``), which appends it to
``<out>/<run>/metrics/rank<R>.jsonl`` there, so node 0 judges and reports as on a shared filesystem.
Heartbeats of those nodes' orchestrators travel the same way (node 0 writes ``nodes/node<N>.json``).

The same guarantees as the files: records arrive in order per rank, none lost and none duplicated when a
connection drops and comes back. Each record has a sequence number; node 0 acknowledges the last one it
wrote; the rank keeps every unacknowledged record and, after reconnecting, resends from the last
acknowledged one (node 0 skips sequence numbers it already wrote).

Protocol: one JSON object per line, both ways.
    rank -> node 0   {"hello": {"run": NAME, "rank": R}}      node 0 -> rank   {"ack": LAST_SEQ}  (-1: none)
    rank -> node 0   {"seq": N, "line": RECORD_LINE}           node 0 -> rank   {"ack": LAST_SEQ}
    node -> node 0   {"beat": HEARTBEAT, "node": N}            (no answer; one short connection per beat)

Hand-written on ``socket``: a library broker (ZeroMQ, gRPC) would add a dependency and a service for a
few hundred lines a minute; the resend-from-ack rule is the whole protocol. Torch-free (rank side and
orchestrator both use it).
"""

from __future__ import annotations

import collections
import json
import select
import socket
import threading
import time
from typing import Any

ENV = "SHARDSCOPE_RECORDS_ADDR"  # host:port of node 0's record server, in the environment of other nodes' ranks


def parse_endpoint(text: str) -> tuple[str, int]:
    """Return (host, port) of ``host:port``; raises ValueError naming what is wrong."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r}: expected host:port with a port in 1..65535")
    return host.strip("[]"), int(port)


def encode(message: dict[str, Any]) -> bytes:
    """One protocol message as a line of bytes."""
    return (json.dumps(message, separators=(",", ":")) + "\n").encode()


class Lines:
    """Splits received bytes into decoded JSON messages (partial lines wait for the rest)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Return the complete messages in ``data`` plus what was pending; raises ValueError on garbage."""
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]


class Unreachable(ConnectionError):
    """Node 0's record server could not be reached for the whole timeout."""


class RecordSender:
    """Sends one rank's record lines to node 0, in order, resending from the last acknowledged one.

    ``send`` never blocks on the network (a background thread does the talking). ``close`` waits until
    every record is acknowledged (or ``timeout_s``). When node 0 stays unreachable for
    ``connect_timeout_s``, ``error`` says so and ``send`` raises ``Unreachable`` with that line.
    """

    def __init__(self, endpoint: str, run: str, rank: int, *, connect_timeout_s: float = 30.0) -> None:
        self.endpoint = endpoint
        self.host, self.port = parse_endpoint(endpoint)
        self.run, self.rank = run, rank
        self.connect_timeout_s = connect_timeout_s
        self.error = ""
        self.reconnects = 0
        self._pending: collections.deque[tuple[int, str]] = collections.deque()
        self._next_seq = 0
        self._acked = -1
        self._cv = threading.Condition()
        self._closing = False
        self._drop = False
        self._connected_once = False
        self._thread = threading.Thread(target=self._pump, name="shardscope-records", daemon=True)
        self._thread.start()

    def send(self, line: str) -> None:
        """Queue one record line (with or without its newline); raises Unreachable once node 0 is given up."""
        with self._cv:
            if self.error:
                raise Unreachable(self.error)
            self._pending.append((self._next_seq, line.rstrip("\n")))
            self._next_seq += 1
            self._cv.notify_all()

    def wait_connected(self, timeout_s: float | None = None) -> None:
        """Block until the first handshake succeeded; raises Unreachable when it cannot."""
        deadline = time.monotonic() + (self.connect_timeout_s + 1 if timeout_s is None else timeout_s)
        with self._cv:
            while not self._connected_once and not self.error:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cv.wait(remaining)
            if not self._connected_once:
                raise Unreachable(self.error or f"records: node 0 at {self.endpoint} did not answer")

    def drop_connection(self) -> None:
        """Fault injection (``kind=netdrop``): close the current connection; the sender reconnects and resends."""
        with self._cv:
            self._drop = True
            self._cv.notify_all()

    def close(self, timeout_s: float = 30.0) -> bool:
        """Wait until every record is acknowledged, then stop; True when all were delivered."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._acked < self._next_seq - 1 and not self.error and time.monotonic() < deadline:
                self._cv.wait(0.1)
            delivered = self._acked >= self._next_seq - 1
            self._closing = True
            self._cv.notify_all()
        self._thread.join(5)
        return delivered

    # ---- the background thread -------------------------------------------------------------------

    def _connect(self) -> socket.socket:
        """Connect and handshake, retrying until connected or ``connect_timeout_s`` without success."""
        give_up = time.monotonic() + self.connect_timeout_s
        delay = 0.1
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=10)
                sock.sendall(encode({"hello": {"run": self.run, "rank": self.rank}}))
                lines, got = Lines(), []
                while not got:
                    data = sock.recv(4096)
                    if not data:
                        raise ConnectionError("closed during the handshake")
                    got = lines.feed(data)
                self._ack(int(got[-1]["ack"]))
                sock.settimeout(None)
                with self._cv:
                    self._connected_once = True
                    self._cv.notify_all()
                return sock
            except (OSError, ValueError, KeyError) as err:
                with self._cv:
                    if self._closing:  # closing with records undelivered: give up now, say so
                        raise Unreachable(f"records: node 0 at {self.endpoint} lost while closing ({err})") from err
                if time.monotonic() >= give_up:
                    raise Unreachable(f"records: node 0's orchestrator at {self.endpoint} unreachable for "
                                      f"{self.connect_timeout_s:g} s ({err})") from err
                time.sleep(delay)
                delay = min(1.0, delay * 2)

    def _ack(self, seq: int) -> None:
        with self._cv:
            self._acked = max(self._acked, seq)
            while self._pending and self._pending[0][0] <= self._acked:
                self._pending.popleft()
            self._cv.notify_all()

    def _pump(self) -> None:
        sock: socket.socket | None = None
        sent = -1
        lines = Lines()
        while True:
            with self._cv:
                if self._closing and (self._acked >= self._next_seq - 1 or self.error):
                    break
                if self._drop and sock is not None:
                    self._drop = False
                    sock.close()
                    sock = None
                    self.reconnects += 1
            try:
                if sock is None:
                    sock = self._connect()
                    sent, lines = self._acked, Lines()  # resend everything not acknowledged
                with self._cv:
                    batch = [(s, line) for s, line in self._pending if s > sent]
                    if not batch and not self._closing:
                        self._cv.wait(0.05)
                if batch:
                    sock.sendall(b"".join(encode({"seq": s, "line": line}) for s, line in batch))
                    sent = batch[-1][0]
                ready, _, _ = select.select([sock], [], [], 0.02 if sent > self._acked else 0)
                if ready:
                    data = sock.recv(65536)
                    if not data:
                        raise ConnectionError("node 0 closed the connection")
                    for msg in lines.feed(data):
                        self._ack(int(msg["ack"]))
            except Unreachable as err:
                with self._cv:
                    self.error = str(err)
                    self._cv.notify_all()
                break
            except (OSError, ValueError, KeyError):
                if sock is not None:
                    sock.close()
                sock = None
                self.reconnects += 1
        if sock is not None:
            sock.close()


def send_beat(endpoint: str, node: int, beat: dict[str, Any], timeout_s: float = 2.0) -> None:
    """Send one heartbeat of node ``node`` to node 0's record server; raises OSError when it cannot."""
    host, port = parse_endpoint(endpoint)
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(encode({"beat": beat, "node": node}))
