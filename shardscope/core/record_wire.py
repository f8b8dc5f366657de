"""Records over TCP, for nodes that share no filesystem with node 0 (Kubernetes, cloud clusters).

A rank on another node writes its own record file and also sends every line to node 0's orchestrator
(``orchestrator/record_server.py``), which appends it to ``<out>/<run>/metrics/rank<R>.jsonl`` there; other
nodes' heartbeats become ``nodes/node<N>.json``. Records arrive in order per rank, none lost or doubled
across dropped connections: each has a sequence number, node 0 acknowledges the last one it wrote, the rank
resends from there after reconnecting and node 0 skips sequence numbers it already wrote.

Protocol: one JSON object per line, both ways; a line is at most ``MAX_LINE_BYTES`` (``HELLO_MAX_BYTES``
until the peer is admitted).
    node 0 -> peer   {"challenge": NONCE, "idle_s": S}         (first, on every connection)
    rank -> node 0   {"hello": {"run": NAME, "rank": R, "session": S}, "mac": M}   node 0 -> rank  {"ack": LAST_SEQ}
                     (-1: none; sequence numbers are the session's: a restarted rank, a new sender, starts at 0)
    rank -> node 0   {"seq": N, "line": RECORD_LINE}           node 0 -> rank   {"ack": LAST_SEQ}
    rank -> node 0   {"ping": 1}                               (when idle for S/3 s; node 0 closes after S s)
    node -> node 0   {"beat": HEARTBEAT, "node": N, "mac": M}  node 0 -> node  {"ok": true}  (one per connection)
    node 0 -> peer   {"refused": REASON}                       (then closes; "busy" = retry later)

Admission: ``M = HMAC-SHA256(secret, CONTEXT | NONCE | canonical JSON of the hello or beat)`` (``prove``), the
comparison's secret (``record_secret``) held by node 0 and every sender,
never sent and never printed. The fresh nonce makes a recorded answer useless on another connection; the
identity inside the MAC makes it useless for another run, rank, node or heartbeat. What follows an admitted
hello is not authenticated line by line and nothing is encrypted: someone who can inject into or read an
established TCP stream on the cluster network is outside what this guards (that needs TLS).

Stdlib ``socket``/``hmac``: ZeroMQ with CURVE or gRPC with TLS would add a dependency and key handling of
its own for a few hundred lines a minute. Torch-free (rank side and orchestrator both use it).
"""

from __future__ import annotations

import collections
import json
import re
import secrets
import select
import socket
import threading
import time
from typing import Any

from shardscope.core.record_secret import prove

ENV = "SHARDSCOPE_RECORDS_ADDR"  # host:port of node 0's record server, in the environment of other nodes' ranks
MAX_LINE_BYTES = 1 << 20  # one protocol line (a record, JSON-quoted inside its seq message)
HELLO_MAX_BYTES = 64 << 10  # one line before the peer is admitted (and every line node 0 sends)


def parse_endpoint(text: str, *, any_port: bool = False) -> tuple[str, int]:
    """Return (host, port) of ``host:port``; raises ValueError naming what is wrong (port 0 only with
    ``any_port``: a server asking the system for a free port)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 if any_port else 1) <= int(port) < 65536:
        raise ValueError(f"{text!r}: expected host:port with a port in 1..65535")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not _HOST.fullmatch(bare):
        raise ValueError(f"{text!r}: {host!r} is not a host name or address (letters, digits, '.', '-', ':' in [...])")
    return bare, int(port)


# A DNS name or IPv4 address (letters, digits, '.', '-', '_'), or an IPv6 address (hex digits and ':', written
# in brackets before the port): nothing a shell, a URL or torchrun would read as more than a host.
_HOST = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,252})|[0-9A-Fa-f:.]{2,45}")


def encode(message: dict[str, Any]) -> bytes:
    """One protocol message as a line of bytes."""
    return (json.dumps(message, separators=(",", ":")) + "\n").encode()


class LineTooLong(ValueError):
    """A peer sent more than the line cap without a newline."""


class Lines:
    """Splits received bytes into decoded JSON messages (partial lines wait for the rest).

    Linear in the bytes fed: only new data is searched for a newline and consumed lines are cut once per
    ``feed``. A line (or a pending partial one) over ``max_line`` bytes raises ``LineTooLong``.
    """

    def __init__(self, max_line: int = MAX_LINE_BYTES) -> None:
        self.max_line = max_line
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Return the complete messages in ``data`` plus what was pending; raises ValueError on garbage (a line
        that is not a JSON object) and ``LineTooLong`` past the cap."""
        buf = self._buf
        start = len(buf)
        buf += data
        out, pos = [], 0
        end = buf.find(b"\n", start)
        while end != -1:
            if end - pos > self.max_line:
                raise LineTooLong(f"a line over {self.max_line} bytes")
            line = bytes(buf[pos:end])
            pos = end + 1
            if line.strip():
                out.append(_decode(line))
            end = buf.find(b"\n", pos)
        del buf[:pos]
        if len(buf) > self.max_line:
            raise LineTooLong(f"a line over {self.max_line} bytes")
        return out


def _decode(line: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(line)
    except RecursionError:
        raise ValueError("a message nested too deeply") from None
    if not isinstance(msg, dict):
        raise ValueError("a message that is not a JSON object")
    return msg


class Unreachable(ConnectionError):
    """Node 0's record server could not be reached for the whole timeout."""


class Refused(Unreachable):
    """Node 0's record server answered and refused this sender (wrong secret, unknown run or rank, ...)."""

    def __init__(self, endpoint: str, reason: str) -> None:
        super().__init__(f"records: node 0 at {endpoint} refused this sender: {reason}")
        self.reason = reason


def _next_message(sock: socket.socket, lines: Lines, pending: list[dict[str, Any]]) -> dict[str, Any]:
    while not pending:
        data = sock.recv(4096)
        if not data:
            raise ConnectionError("closed during the handshake")
        pending.extend(lines.feed(data))
    return pending.pop(0)


def _handshake(sock: socket.socket, endpoint: str, secret: bytes | None,
               identity: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Answer node 0's challenge with ``identity``; return (challenge, answer); raises Refused when refused."""
    lines, pending = Lines(HELLO_MAX_BYTES), []
    challenge = _next_message(sock, lines, pending)
    nonce = challenge.get("challenge")
    if not isinstance(nonce, str):
        raise ValueError("no challenge from node 0")
    identity = json.loads(json.dumps(identity))  # exactly what node 0 will decode
    message = dict(identity, mac=prove(secret, nonce, identity)) if secret is not None else identity
    sock.sendall(encode(message))
    answer = _next_message(sock, lines, pending)
    if "refused" in answer:
        raise Refused(endpoint, str(answer["refused"])[:200])
    return challenge, answer


class RecordSender:
    """Sends one rank's record lines to node 0, in order, resending from the last acknowledged one.

    ``send`` never blocks on the network (a background thread does the talking). ``close`` waits until
    every record is acknowledged (or ``timeout_s``). When node 0 stays unreachable for
    ``connect_timeout_s``, ``error`` says so and ``send`` raises ``Unreachable`` with that line; a refusal
    (``Refused``: wrong secret, a run or rank node 0 does not know) is final at once, except "busy" (another
    connection of this rank is still open there), which is retried. ``secret``: the comparison's secret;
    None only while the caller is not wired to one (node 0 then admits it only if it has none either).
    """

    def __init__(self, endpoint: str, run: str, rank: int, *, connect_timeout_s: float = 30.0,
                 secret: bytes | None = None) -> None:
        self.endpoint = endpoint
        self.host, self.port = parse_endpoint(endpoint)
        self.run, self.rank = run, rank
        self.connect_timeout_s = connect_timeout_s
        self._secret = secret
        self.error = ""
        self.reconnects = 0
        self._pending: collections.deque[tuple[int, str]] = collections.deque()
        self._next_seq, self._acked, self._ping_every = 0, -1, 10.0
        self.session = secrets.token_hex(8)  # its sequence numbers are this sender's own on node 0
        self._refusal = ""  # node 0's reason, when it refused this sender
        self._cv = threading.Condition()
        self._closing = self._drop = self._connected_once = False
        self._thread = threading.Thread(target=self._pump, name="shardscope-records", daemon=True)
        self._thread.start()

    def send(self, line: str) -> None:
        """Queue one record line (with or without its newline); raises Unreachable once node 0 is given up and
        ValueError for a line over the wire's cap (``MAX_LINE_BYTES``), which node 0 would refuse."""
        line = line.rstrip("\n")
        if 6 * len(line) + 64 > MAX_LINE_BYTES:  # JSON quoting grows a character to 6 bytes at most
            size = len(encode({"seq": self._next_seq, "line": line})) - 1
            if size > MAX_LINE_BYTES:
                raise ValueError(f"a record of {size} bytes: over the {MAX_LINE_BYTES}-byte cap of records over TCP")
        with self._cv:
            if self.error:
                raise self._failure()
            self._pending.append((self._next_seq, line))
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
                raise self._failure() if self.error else Unreachable(f"records: node 0 at {self.endpoint} did not "
                                                                     "answer")

    def _failure(self) -> Unreachable:
        return Refused(self.endpoint, self._refusal) if self._refusal else Unreachable(self.error)

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
        """Connect and handshake, retrying until connected or ``connect_timeout_s`` without an answer."""
        give_up = time.monotonic() + self.connect_timeout_s
        delay = 0.1
        while True:
            sock = None
            try:
                sock = socket.create_connection((self.host, self.port), timeout=10)
                challenge, answer = _handshake(sock, self.endpoint, self._secret,
                                               {"hello": {"run": self.run, "rank": self.rank, "session": self.session}})
                idle_s = challenge.get("idle_s")
                if isinstance(idle_s, (int, float)) and idle_s > 0:
                    self._ping_every = max(0.05, float(idle_s) / 3)
                self._ack(int(answer["ack"]))
                sock.settimeout(None)
                with self._cv:
                    self._connected_once = True
                    self._cv.notify_all()
                return sock
            except (OSError, ValueError, KeyError, TypeError) as err:
                if sock is not None:
                    sock.close()
                busy = isinstance(err, Refused) and err.reason == "busy"
                if isinstance(err, Refused) and not busy:
                    raise
                with self._cv:
                    if self._closing:  # closing with records undelivered: give up now, say so
                        raise Unreachable(f"records: node 0 at {self.endpoint} lost while closing ({err})") from err
                if busy:  # node 0 answered: it closes this rank's stale connection within its idle time
                    give_up = time.monotonic() + self.connect_timeout_s
                elif time.monotonic() >= give_up:
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
        lines = Lines(HELLO_MAX_BYTES)
        last_out = time.monotonic()
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
                    sent, lines = self._acked, Lines(HELLO_MAX_BYTES)  # resend everything not acknowledged
                    last_out = time.monotonic()
                with self._cv:
                    batch = [(s, line) for s, line in self._pending if s > sent]
                    if not batch and not self._closing:
                        self._cv.wait(0.05)
                if batch:
                    sock.sendall(b"".join(encode({"seq": s, "line": line}) for s, line in batch))
                    sent, last_out = batch[-1][0], time.monotonic()
                elif time.monotonic() - last_out >= self._ping_every:  # keep node 0 from closing an idle link
                    sock.sendall(encode({"ping": 1}))
                    last_out = time.monotonic()
                ready, _, _ = select.select([sock], [], [], 0.02 if sent > self._acked else 0)
                if ready:
                    data = sock.recv(65536)
                    if not data:
                        raise ConnectionError("node 0 closed the connection")
                    for msg in lines.feed(data):
                        self._ack(int(msg["ack"]))
            except Unreachable as err:
                with self._cv:
                    self.error, self._refusal = str(err), err.reason if isinstance(err, Refused) else ""
                    self._cv.notify_all()
                break
            except (OSError, ValueError, KeyError, TypeError):
                if sock is not None:
                    sock.close()
                sock = None
                self.reconnects += 1
        if sock is not None:
            sock.close()


def send_beat(endpoint: str, node: int, beat: dict[str, Any], timeout_s: float = 2.0, *,
              secret: bytes | None = None) -> None:
    """Send one heartbeat of node ``node`` to node 0's record server and wait for its answer; raises OSError
    when it cannot (``Refused``, an OSError too, when node 0 refuses it). ``secret`` as for RecordSender."""
    host, port = parse_endpoint(endpoint)
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        try:
            _handshake(sock, endpoint, secret, {"beat": beat, "node": node})
        except (ValueError, KeyError) as err:
            raise ConnectionError(f"records: node 0 at {endpoint} answered garbage ({err})") from err
