"""Issue 19: node 0's record server trusts only its own comparison.

Each test is one attack a probe found, on real sockets on 127.0.0.1 (ports from the system, never fixed).
After each: nothing was written outside the output directory, and a real sender of this comparison still
gets every record written exactly once, in order. Every wait is bounded in count and time; nothing here
asserts how long something took.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from shardscope.orchestrator import record_server
from shardscope.orchestrator.record_listen import BindError
from shardscope.orchestrator.record_server import RecordServer
from shardscope.core.record_secret import prove
from shardscope.core.record_wire import RecordSender, Unreachable, encode, send_beat
from shardscope.core.rundir import RunDir

SECRET = b"s" * 32
RUNS = {"ddp": 4, "fsdp": 4}  # two nodes: node 1 holds ranks 2 and 3 of each run
WAIT_S = 30.0


@pytest.fixture
def out(tmp_path):
    path = tmp_path / "out"
    path.mkdir()
    return path


@pytest.fixture
def make(out):
    servers = []

    def _make(**kw):
        kw = {"secret": SECRET, "runs": RUNS, "nnodes": 2, **kw}
        srv = RecordServer(str(out), "127.0.0.1:0", **kw)
        srv.start()
        servers.append(srv)
        return srv

    yield _make
    for srv in servers:
        srv.stop()


def _wait_for(predicate, timeout_s=WAIT_S):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


class Client:
    """A raw client of node 0's record server, reading its answers line by line."""

    def __init__(self, srv):
        self.sock = socket.create_connection(srv.address, timeout=WAIT_S)
        self._file = self.sock.makefile("rb")

    def answer(self):
        """The next message from node 0, or None once it closed the connection."""
        try:
            line = self._file.readline()
        except (ConnectionResetError, BrokenPipeError):
            return None
        return json.loads(line) if line else None

    def send(self, data):
        self.sock.sendall(data)

    def closed(self):
        """True once node 0 closed the connection (what it still sends is read and dropped); a server that
        never closes it fails this by the socket's timeout."""
        try:
            while self._file.read1(65536):
                pass
        except (ConnectionResetError, BrokenPipeError):
            pass
        return True

    def close(self):
        self._file.close()
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _connect(srv):
    """A raw client: connected, the challenge read. Returns (client, nonce)."""
    client = Client(srv)
    first = client.answer()
    assert first is not None and "challenge" in first, first
    return client, first["challenge"]


def _ask(srv, identity, secret=SECRET):
    """Send ``identity`` (a hello or beat) with a MAC of ``secret``; return node 0's answer."""
    client, nonce = _connect(srv)
    with client:
        mac = {"mac": prove(secret, nonce, identity)} if secret is not None else {}
        client.send(encode({**identity, **mac}))
        return client.answer()


def rec(run, rank, **fields):
    """One record line of ``run``'s rank ``rank`` as a rank writes it (node 0 writes nothing else)."""
    return json.dumps({"v": 1, "kind": "step", "run": run, "rank": rank, "t": 1.0, **fields})


def _admitted(srv, run="ddp", rank=2, session="s1"):
    client, nonce = _connect(srv)
    hello = {"hello": {"run": run, "rank": rank, "session": session}}
    client.send(encode({**hello, "mac": prove(SECRET, nonce, hello)}))
    assert client.answer() == {"ack": srv.last_seq(run, rank)}
    return client


def _files(root):
    """Files under ``root`` but the server's own counts (nodes/record_server.json, checked where it matters)."""
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                  if f != "record_server.json")


def _after(tmp_path, out, srv, rank=3, n=40):
    """Nothing outside ``out``; a real sender's records all arrive once, in order."""
    assert all(p.startswith("out" + os.sep) for p in _files(tmp_path)), _files(tmp_path)
    assert _files(out) == sorted(p for p in _files(out) if p.startswith(("ddp", "fsdp", "nodes")))
    sender = RecordSender(f"{srv.address[0]}:{srv.address[1]}", "ddp", rank, secret=SECRET)
    for i in range(n):
        sender.send(rec("ddp", rank, step=i))
    assert sender.close(timeout_s=WAIT_S)
    with open(RunDir(str(out)).run("ddp").rank_file(rank), encoding="utf-8") as fh:
        assert [json.loads(line)["step"] for line in fh] == list(range(n))


def test_no_secret_a_wrong_one_or_a_replayed_answer_is_refused(tmp_path, out, make):
    srv = make()
    hello = {"hello": {"run": "ddp", "rank": 2}}
    beat = {"beat": {"t": 1.0}, "node": 1}
    for identity in (hello, beat):
        assert _ask(srv, identity, secret=None) == {"refused": "not authenticated (wrong or missing secret)"}
        assert _ask(srv, identity, secret=b"w" * 32)["refused"].startswith("not authenticated")
    with Client(srv) as old:  # the old protocol: hello at once, no challenge read
        old.send(encode(hello) + encode({"seq": 0, "line": '{"forged":1}'}))
        assert "challenge" in old.answer() and old.answer()["refused"].startswith("not authenticated")
    client, nonce = _connect(srv)  # a valid answer, recorded, replayed on another connection
    answer = encode({**hello, "mac": prove(SECRET, nonce, hello)})
    client.close()
    with _connect(srv)[0] as replay:
        replay.send(answer)
        assert replay.answer()["refused"].startswith("not authenticated")
    for wrong in ({"hello": {"run": "ddp", "rank": 3}}, {"beat": {"t": 2.0}, "node": 1}):  # a MAC for another
        client, nonce = _connect(srv)
        with client:
            client.send(encode({**wrong, "mac": prove(SECRET, nonce, hello)}))
            assert client.answer()["refused"].startswith("not authenticated")
    with pytest.raises(OSError, match="not authenticated"):
        send_beat(f"127.0.0.1:{srv.address[1]}", 1, {"t": 1.0}, timeout_s=WAIT_S, secret=b"w" * 32)
    assert _files(out) == [] and srv.written == 0 and srv.beats == 0
    _after(tmp_path, out, srv)


@pytest.mark.parametrize("run", ["../../x", "ABS", "", "nope", "ddp/../../x", ".", "..", "DDP", "ddp ", "ddp\n",
                                 ["ddp"], None, 5, {"name": "ddp"}])
def test_names_not_of_this_comparison_are_refused(tmp_path, out, make, run):
    srv = make()
    if run == "ABS":
        run = str(tmp_path / "abs")
    assert _ask(srv, {"hello": {"run": run, "rank": 2}}) == {"refused": "unknown run"}
    assert not (tmp_path / "x").exists() and not (tmp_path / "abs").exists()
    assert _files(out) == []
    _after(tmp_path, out, srv)


@pytest.mark.parametrize("rank", [-1, 4, 100, 0, 1, True, "2", 2.0, None, 2 ** 70])
def test_ranks_outside_other_nodes_share_of_the_world_are_refused(tmp_path, out, make, rank):
    """Ranks 0 and 1 are node 0's own (they write their files themselves); 4 and up are outside the world."""
    srv = make()
    assert _ask(srv, {"hello": {"run": "fsdp", "rank": rank}}) == {"refused": "rank out of range"}
    assert _files(out) == []
    _after(tmp_path, out, srv)


@pytest.mark.parametrize("node", [0, 2, -5, 5, True, "1", None, 1.0])
def test_heartbeats_of_nodes_outside_the_comparison_are_refused(tmp_path, out, make, node):
    srv = make()
    assert _ask(srv, {"beat": {"t": 1.0}, "node": node}) == {"refused": "node out of range"}
    assert _files(out) == []
    beat = {"node": 1, "host": "n1", "pid": 7, "t": 2.0, "done": False}
    assert _ask(srv, {"beat": beat, "node": 1}) == {"ok": True}  # node 1 is of this comparison
    assert _files(out) == [os.path.relpath(RunDir(str(out)).heartbeat(1), out)]
    _after(tmp_path, out, srv)


def test_a_second_sender_for_a_live_rank_is_refused_until_the_first_is_gone(tmp_path, out, make):
    srv = make()
    endpoint = f"127.0.0.1:{srv.address[1]}"
    first = RecordSender(endpoint, "ddp", 3, secret=SECRET)
    first.wait_connected()
    assert _ask(srv, {"hello": {"run": "ddp", "rank": 3, "session": "other"}}) == {"refused": "busy"}
    second = RecordSender(endpoint, "ddp", 3, connect_timeout_s=1.0, secret=SECRET)
    with pytest.raises(Unreachable, match="did not answer"):
        second.wait_connected(timeout_s=3)  # retried while busy, never admitted
    second.send('{"forged": 1}')
    assert second.close(timeout_s=1) is False
    _wait_for(lambda: srv.refused["busy"] >= 2)
    for i in range(40):
        first.send(rec("ddp", 3, step=i))
    assert first.close(timeout_s=WAIT_S)
    with open(RunDir(str(out)).run("ddp").rank_file(3), encoding="utf-8") as fh:
        assert [json.loads(line)["step"] for line in fh] == list(range(40))  # the live stream, untouched
    _wait_for(lambda: srv.connections == 0)
    _after(tmp_path, out, srv, rank=2)


def test_a_line_past_the_cap_closes_the_connection_and_writes_nothing_of_it(tmp_path, out, make):
    srv = make()
    with _admitted(srv, "ddp", 2) as client:
        client.send(encode({"seq": 0, "line": rec("ddp", 2, kept=0)}))
        assert client.answer() == {"ack": 0}
        try:
            client.send(encode({"seq": 1, "line": "x" * (2 << 20)}))
        except (ConnectionResetError, BrokenPipeError):
            pass
        assert client.closed()
    assert srv.refused["line too long"] == 1
    with open(RunDir(str(out)).run("ddp").rank_file(2), encoding="utf-8") as fh:
        assert fh.read() == rec("ddp", 2, kept=0) + "\n"
    _after(tmp_path, out, srv)


def test_many_idle_connections_are_capped_and_need_no_threads(tmp_path, out, make):
    srv = make(max_pending=16, max_pending_per_source=1000, handshake_timeout_s=600)
    threads = threading.active_count()
    clients = [Client(srv) for _ in range(200)]
    try:
        answers = [c.answer() for c in clients]
        assert sum(1 for a in answers if a is not None and "challenge" in a) == 16
        assert answers.count(None) == 184  # beyond the unauthenticated pool: closed at once
        assert srv.connections == 16 and srv.refused["unauthenticated pool full"] == 184
        assert srv.refused_from["127.0.0.1"] == 184
        assert threading.active_count() <= threads  # one server thread, whatever the connections
    finally:
        for c in clients:
            c.close()
    _wait_for(lambda: srv.connections == 0)
    _after(tmp_path, out, srv)


def test_idle_and_half_sent_connections_are_closed_after_the_timeout(tmp_path, out, make):
    srv = make(idle_timeout_s=5.0, handshake_timeout_s=5.0)  # a handshake on a loaded machine fits in it
    silent, _ = _connect(srv)  # never says hello
    half = _admitted(srv, "ddp", 2)
    half.send(b'{"seq":0,"line":"{\\"half')  # a record cut in the middle, never finished
    idle = _admitted(srv, "fsdp", 2)  # admitted, then nothing at all
    for client in (silent, half, idle):
        with client:
            assert client.closed()
    assert srv.refused["timed out"] == 3
    with open(RunDir(str(out)).run("ddp").rank_file(2), encoding="utf-8") as fh:
        assert fh.read() == ""
    _after(tmp_path, out, srv)  # a live sender pings at a third of the idle time: it is never cut


@pytest.mark.parametrize("admitted", [True, False])
def test_50_megabytes_without_a_newline_are_refused_in_bounded_memory(tmp_path, out, make, admitted):
    srv = make()
    client = _admitted(srv, "ddp", 2) if admitted else _connect(srv)[0]
    chunk, sent, refused = b"x" * (1 << 20), 0, False
    with client:
        for _ in range(50):
            try:
                client.send(chunk)
            except TimeoutError:
                pytest.fail("node 0 stopped reading without closing the connection")
            except OSError:
                refused = True
                break
            sent += len(chunk)
        if not refused:  # all of it fit in the kernel's buffers before the close was seen: the close comes
            refused = client.closed()
    assert refused and sent < 50 << 20  # node 0 stopped reading after the cap, not after 50 MB
    _wait_for(lambda: srv.refused["line too long"] == 1 and srv.connections == 0)
    _after(tmp_path, out, srv)


def test_garbage_ends_its_connection_never_the_server(tmp_path, out, make):
    srv = make()
    pre = [b"[" * 60000 + b"\n", b"[1]\n", b"\xff\xfe\n", b'{"hello": 1}\n', b"{}\n"]
    for junk in pre:
        with _connect(srv)[0] as client:
            client.send(junk)
            assert client.closed()
    after = [encode({"seq": 0, "line": '{"a":1}\n{"forged":1}'}), encode({"seq": 5, "line": "{}"}),
             encode({"what": 1}), encode({"seq": "0", "line": "{}"}), encode({"hello": {"run": "ddp", "rank": 3}})]
    for junk in after:
        with _admitted(srv, "ddp", 2) as client:
            client.send(junk)
            assert client.closed()
    assert os.path.getsize(RunDir(str(out)).run("ddp").rank_file(2)) == 0
    _after(tmp_path, out, srv)


def test_the_server_listens_only_where_it_is_told(tmp_path, out, make, monkeypatch):
    srv = make()
    assert srv.address[0] == "127.0.0.1"
    other = _non_loopback_address()
    if other is not None:  # another interface of this machine: nobody listens there
        with pytest.raises(OSError):
            socket.create_connection((other, srv.address[1]), timeout=5).close()
    real = socket.getaddrinfo

    def resolve(host, *args, **kw):  # a Debian-style host name: resolves here to 127.0.1.1
        return real("127.0.1.1" if host == "node0.example" else host, *args, **kw)

    monkeypatch.setattr(record_server.socket, "getaddrinfo", resolve)
    with pytest.raises(BindError, match="launch.records_bind"):
        RecordServer(str(out), "node0.example:0", secret=SECRET, runs=RUNS, nnodes=2)
    bound = RecordServer(str(out), "node0.example:0", secret=SECRET, runs=RUNS, nnodes=2, bind="127.0.0.1")
    assert bound.address[0] == "127.0.0.1"
    bound.stop()
    taken = f"127.0.0.1:{srv.address[1]}"
    with pytest.raises(BindError, match="cannot listen on 127.0.0.1"):
        RecordServer(str(out), taken, secret=SECRET, runs=RUNS, nnodes=2)
    monkeypatch.undo()
    _after(tmp_path, out, srv)


def _non_loopback_address():
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))  # no packet is sent: picks the outgoing interface
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address
