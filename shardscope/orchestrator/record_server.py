"""Node 0's record server: other nodes' ranks send their records here when no filesystem is shared.

Each record line is appended to ``<out>/<run>/metrics/rank<R>.jsonl`` in node 0's output directory, in sequence
order, exactly once (protocol: ``shardscope/core/record_wire.py``); heartbeats of other nodes' orchestrators become
``nodes/node<N>.json``; the session, verdicts and reports read those files.

Who gets in. The server listens only on the address it is given: the endpoint's host, or ``bind`` when the caller
passes one (the endpoint's host is how other nodes reach node 0; when it resolves here only to a loopback address,
as a Debian host name does to 127.0.1.1, the server refuses to start rather than listen where no other node can
reach it, unless the host is literally loopback: nodes on one machine). Every connection first answers a fresh
challenge with an HMAC of the comparison's secret (``record_secret.prove``); then only this comparison's run names
(``runs``) and the ranks other nodes hold in them (``world size // nnodes`` and up: node 0's own ranks write their
files themselves), or heartbeats of nodes ``1..nnodes-1``. A received name is only looked up: every path is built
from node 0's own run list. One connection per (run, rank) at a time: a second hello is refused "busy" (the sender
retries) until the first is gone, rather than replacing it, so a duplicate or stale sender can never cut into a live
stream, and a dead connection frees its place within the idle timeout (the live sender pings, a dead one cannot).

Bounds. A line is at most ``MAX_LINE_BYTES`` (``HELLO_MAX_BYTES`` before admission); a longer one closes the
connection and nothing of it is written. Connections not yet admitted have a pool of their own (``max_pending``, 32;
``max_pending_per_source`` from one address, 8) and ``handshake_timeout_s`` (5 s) to be admitted, so a flood without
the secret never takes an admitted sender's or a heartbeat's place; when the pool is full a newcomer takes a pending
one's place (``record_pending``: who goes, and why a real sender on a flooder's own address still gets in), and
hellos are read before more connections are accepted, ``ACCEPT_BATCH`` at a time. Admitted ones are at most
``max_connections`` (default 4 x the ranks of all runs + nnodes, at least 64, at most half the descriptor limit). A
connection is closed when it completes no message for ``idle_timeout_s`` (30 s); answers a peer does not read are
capped. Refusals (evictions too) are counted by reason (``refused``) and, for connections never admitted, by source
address (``refused_from``); ``heard`` is when each other node last got a message through (a beat, a record, a ping),
what its liveness is judged on.

One thread, ``selectors``: the work per message is tiny, so one loop keeps up; a flood of connections costs a
descriptor and a small buffer each, never a thread; timeouts are a sweep over deadlines. ``secret=None`` /
``runs=None`` / ``nnodes=None`` mean a caller not wired to them yet: no MAC is asked, any run name of the preset
grammar (one path component) and any rank or node number below a fixed cap is taken; bounds and timeouts hold all
the same.
"""

from __future__ import annotations

import collections
import os
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from shardscope.config import dump_json
from shardscope.core.events import KINDS, decode_line
from shardscope.core.liveness import beat_problem
from shardscope.presets.schema import NAME_RE
from shardscope.core.record_secret import MIN_SECRET_BYTES, proven
from shardscope.core.record_wire import HELLO_MAX_BYTES, MAX_LINE_BYTES, Lines, LineTooLong, encode
from shardscope.core.rundir import RunDir
from shardscope.orchestrator.record_listen import default_max_connections, listen
from shardscope.orchestrator.record_pending import PendingPool
from shardscope.orchestrator.record_stats import StatsWriter

IDLE_TIMEOUT_S = 30.0  # no complete message for this long: the connection is closed (senders ping at a third)
HANDSHAKE_TIMEOUT_S = 5.0  # from accept to an admitted hello or beat
MAX_PENDING, MAX_PENDING_PER_SOURCE = 32, 8  # connections not admitted yet: in all, from one address
ACCEPT_BATCH = 4  # connections accepted per turn of the loop, after the hellos that arrived are read
OUT_MAX_BYTES = 64 << 10  # answers queued for a peer that does not read them
RECV_BYTES = 64 << 10
UNWIRED_MAX_RANK, UNWIRED_MAX_NODE = 1 << 16, 1 << 12  # caps while the caller passes no runs / nnodes
_READ, _RW = selectors.EVENT_READ, selectors.EVENT_READ | selectors.EVENT_WRITE


class _Conn:
    __slots__ = ("admitted", "closing", "deadline", "events", "fh", "key", "lines", "nonce", "out", "session", "sock",
                 "source")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock: socket.socket | None = sock
        self.lines = Lines(HELLO_MAX_BYTES)
        self.out = bytearray()
        self.nonce = secrets.token_hex(16)
        self.deadline = deadline
        self.key: tuple[str, int] | None = None
        self.session = ""
        self.source: str | None = None  # its address while not admitted (it holds a place in the pending pool)
        self.fh: Any = None
        self.admitted = self.closing = False
        self.events = _READ


class RecordServer:
    """A single-threaded TCP server writing received records into ``out_dir``; ``start``/``stop``. ``runs``: run
    name -> world size; ``nnodes``: nodes; ``secret``: the comparison's key; ``bind``: an address to listen on
    instead of the endpoint's host (``"0.0.0.0"``: every interface); the port is the endpoint's (0: any)."""

    def __init__(self, out_dir: str, endpoint: str, *, secret: bytes | None = None,
                 runs: Mapping[str, int] | None = None, nnodes: int | None = None, bind: str | None = None,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 max_connections: int | None = None, max_line_bytes: int = MAX_LINE_BYTES,
                 max_pending: int = MAX_PENDING, max_pending_per_source: int = MAX_PENDING_PER_SOURCE) -> None:
        if secret is not None and len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"records server: a secret needs at least {MIN_SECRET_BYTES} bytes")
        self.out = RunDir(out_dir)
        self._secret = secret
        self.nnodes = nnodes
        self.idle_timeout_s, self.handshake_timeout_s = idle_timeout_s, handshake_timeout_s
        self.max_line_bytes = max_line_bytes
        per_node = max(1, nnodes or 1)
        # name -> (node 0's own string for it, the ranks other nodes hold)
        self._runs = None if runs is None else {
            str(name): (str(name), range(int(ws) // per_node if per_node > 1 else 0, int(ws)))
            for name, ws in runs.items()}
        self.max_connections = max_connections or default_max_connections(runs, nnodes)
        self.written = 0  # record lines appended (duplicates skipped are not counted)
        self.duplicates = 0  # resent lines already written (after a dropped connection)
        self.beats = 0
        self.refused: collections.Counter[str] = collections.Counter()  # connections closed, by reason
        self.refused_from: collections.Counter[str] = collections.Counter()  # never admitted, by source address
        self.heard: dict[int, float] = {}  # node -> time.time() of its last message that got through
        self.max_pending, self.max_pending_per_source = max_pending, max_pending_per_source
        self._pending = PendingPool(max_pending, max_pending_per_source)  # connections not admitted yet
        self._per_node = per_node
        self._stats = StatsWriter(self.out.record_server_stats())
        self._last: dict[tuple[str, int], int] = {}
        self._live: dict[tuple[str, int], _Conn] = {}
        self._conns: set[_Conn] = set()
        self._listener = listen(endpoint, bind, nnodes)
        self._address = self._listener.getsockname()[:2]
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._listener, _READ, "accept")
        self._sel.register(self._wake_r, _READ, "wake")
        self._stopping = False
        self._closed = False
        self._next_sweep = 0.0
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) the server listens on."""
        return self._address

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._conns)

    def start(self) -> None:
        """Serve on a background thread (one thread, whatever the number of connections)."""
        self._thread = threading.Thread(target=self._loop, name="shardscope-record-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving, close every connection, file and the listening socket."""
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(10)
        if self._thread is None or not self._thread.is_alive():
            self._close_all()

    def last_seq(self, run: str, rank: int) -> int:
        """The last sequence number written for (run, rank) by its latest sender session; -1 for none."""
        return max((v for (r, k, _), v in self._last.items() if (r, k) == (run, rank)), default=-1)

    def _loop(self) -> None:
        try:
            while not self._stopping:
                ready = self._sel.select(timeout=0.2)  # hellos first: a real sender is in before more arrive
                for key, events in sorted(ready, key=lambda ke: ke[0].data == "accept"):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        self._wake_r.recv(64)
                    else:
                        self._io(key.data, events)
                now = time.monotonic()
                if now >= self._next_sweep:
                    self._next_sweep = now + 0.1
                    for conn in [c for c in self._conns if now > c.deadline]:
                        self._close(conn, "timed out")
                    self._stats.maybe_write(self)
        finally:
            self._close_all()
            self._stats.maybe_write(self, force=True)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, peer = self._listener.accept()
            except OSError:  # none waiting (or out of descriptors: open ones drain by their timeouts)
                return
            source, now = str(peer[0]) if isinstance(peer, tuple) else "?", time.monotonic()
            reason, victim = self._pending.room(source, now)
            if victim is not None:  # a pending one makes way (counted by reason and source, as a refusal)
                self._close(victim, reason)
            elif reason:
                self.refused[reason] += 1
                self.refused_from[source] += 1
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Conn(sock, now + self.handshake_timeout_s)
            self._pending.add(conn, source, now)
            self._conns.add(conn)
            self._sel.register(sock, _READ, conn)
            self._send(conn, {"challenge": conn.nonce, "idle_s": self.idle_timeout_s})

    def _io(self, conn: _Conn, events: int) -> None:
        try:
            if events & selectors.EVENT_WRITE:
                self._flush(conn)
            if not events & selectors.EVENT_READ or conn.sock is None:
                return
            data = conn.sock.recv(RECV_BYTES)
            if not data:
                self._close(conn, None)
                return
            if conn.closing:  # refused: what it still sends is not read
                return
            acked = None
            for msg in conn.lines.feed(data):
                acked = self._message(conn, msg, acked)
                if conn.closing or conn.sock is None:
                    return
            if acked is not None:
                self._send(conn, {"ack": acked})
            elif conn.source is not None:  # still not admitted: what it sent is part of a line
                self._pending.sent_part(conn)
        except (BlockingIOError, InterruptedError):
            return
        except LineTooLong:
            self._close(conn, "line too long")  # nothing of it was written
        except Exception:  # noqa: BLE001 - garbage of any shape ends this connection, never the server
            self._close(conn, "garbled")

    def _message(self, conn: _Conn, msg: dict[str, Any], acked: int | None) -> int | None:
        if not conn.admitted:
            return self._admit(conn, msg)
        conn.deadline = time.monotonic() + self.idle_timeout_s
        self._hear(conn)
        if "seq" in msg:
            seq, line = msg["seq"], msg["line"]
            if type(seq) is not int or not isinstance(line, str) or "\n" in line or "\r" in line:
                raise ValueError("a malformed record")
            return self._append(conn, seq, line)
        if "ping" in msg:
            return acked
        raise ValueError("an unknown message")

    def _admit(self, conn: _Conn, msg: dict[str, Any]) -> int | None:
        if "hello" in msg:
            identity = {"hello": msg["hello"]}
        elif "beat" in msg:
            identity = {"beat": msg["beat"], "node": msg.get("node")}
        else:
            return self._refuse(conn, "expected hello or beat")
        if self._secret is not None and not proven(self._secret, conn.nonce, identity, msg.get("mac")):
            return self._refuse(conn, "not authenticated (wrong or missing secret)")
        if "beat" in identity:
            return self._beat(conn, identity["node"], identity["beat"])
        if len(self._live) >= self.max_connections:
            return self._refuse(conn, "too many connections")
        hello = identity["hello"]
        run, rank, session = ((hello.get("run"), hello.get("rank"), hello.get("session")) if isinstance(hello, dict)
                              else (None, None, None))
        if self._runs is None:  # not wired to the run list yet: one safe path component
            name = run if isinstance(run, str) and len(run) <= 200 and NAME_RE.fullmatch(run) else None
            ranks = range(UNWIRED_MAX_RANK)
        else:
            name, ranks = self._runs.get(run, (None, range(0))) if isinstance(run, str) else (None, range(0))
        if name is None:
            return self._refuse(conn, "unknown run")
        if type(rank) is not int or rank not in ranks:
            return self._refuse(conn, "rank out of range")
        if not (isinstance(session, str) and 0 < len(session) <= 64 and session.isalnum() and session.isascii()):
            return self._refuse(conn, "no session")
        key = (name, rank)
        if key in self._live:
            return self._refuse(conn, "busy")
        files = self.out.run(name)
        os.makedirs(files.metrics, exist_ok=True)
        conn.fh = open(files.rank_file(rank), "a", encoding="utf-8")  # noqa: SIM115 - closed in _close
        conn.key, conn.session, conn.admitted = key, session, True
        self._pending.release(conn)
        self._hear(conn)
        self._live[key] = conn
        conn.lines.max_line = self.max_line_bytes
        conn.deadline = time.monotonic() + self.idle_timeout_s
        return self._last.get((*key, session), -1)

    def _beat(self, conn: _Conn, node: Any, beat: Any) -> None:
        top = UNWIRED_MAX_NODE if self.nnodes is None else self.nnodes
        if type(node) is not int or not 1 <= node < top:
            return self._refuse(conn, "node out of range")
        if beat_problem(beat, node):
            return self._refuse(conn, "a malformed heartbeat")
        path = self.out.heartbeat(node)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        dump_json(path, beat)
        self.beats += 1
        self._pending.release(conn)
        self.heard[node] = time.time()
        conn.closing = True  # one beat per connection: answered, then closed
        self._send(conn, {"ok": True})
        return None

    def _refuse(self, conn: _Conn, reason: str) -> None:
        self.refused[reason] += 1
        if conn.source is not None and reason.startswith(("expected", "not auth")):  # it never proved the secret
            self.refused_from[conn.source] += 1
        conn.closing = True
        self._send(conn, {"refused": reason})

    def _append(self, conn: _Conn, seq: int, line: str) -> int:
        """Append ``line`` if ``seq`` is the next one of the connection's session (each sender numbers its own
        records: another session's never displace them) and the line is a record of the connection's run and rank
        (``events.decode_line``: bounded, typed); a line that is not is counted and skipped, never written.
        Return the last sequence number the session has had."""
        assert conn.key is not None and conn.fh is not None
        own = (*conn.key, conn.session)
        last = self._last.get(own, -1)
        if seq == last + 1:
            record = decode_line(line)
            if record is None or record.get("kind") not in KINDS or (record.get("run"), record.get("rank")) != conn.key:
                self.refused["a record line that is not one of this rank's records"] += 1
            else:
                conn.fh.write(line + "\n")
                conn.fh.flush()
                self.written += 1
            self._last[own] = seq
            return seq
        if seq <= last:
            self.duplicates += 1
            return last
        raise ValueError(f"record {seq} after {last}: a gap")  # cannot happen with the sender; drop the link

    def _send(self, conn: _Conn, msg: dict[str, Any]) -> None:
        conn.out += encode(msg)
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        if conn.sock is None:
            return
        try:
            if conn.out:
                del conn.out[:conn.sock.send(conn.out)]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._close(conn, None)
            return
        if not conn.out and conn.closing:
            self._close(conn, None)
            return
        if len(conn.out) > OUT_MAX_BYTES:
            self._close(conn, "answers not read")
            return
        events = _RW if conn.out else _READ
        if events != conn.events:
            conn.events = events
            self._sel.modify(conn.sock, events, conn)

    def _hear(self, conn: _Conn) -> None:
        """The node of an admitted sender got a message through (its rank's run spans the nodes evenly)."""
        if conn.key is not None and self._runs is not None:
            self.heard[conn.key[1] // max(1, self._runs[conn.key[0]][1].stop // self._per_node)] = time.time()

    def _close(self, conn: _Conn, reason: str | None) -> None:
        if reason is not None:
            self.refused[reason] += 1
        if conn.source is not None:  # never admitted
            if reason is not None:
                self.refused_from[conn.source] += 1
            self._pending.release(conn)
        if conn.sock is not None:
            try:
                self._sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
            conn.sock.close()
            conn.sock = None
        if conn.fh is not None:
            conn.fh.close()
            conn.fh = None
        if conn.key is not None and self._live.get(conn.key) is conn:
            del self._live[conn.key]
        self._conns.discard(conn)

    def _close_all(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in list(self._conns):
            self._close(conn, None)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        self._sel.close()
