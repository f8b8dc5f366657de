"""Records over TCP (issues 12 and 19): in order, none lost or duplicated across dropped connections; a clear
error when node 0 cannot be reached or refuses; the comparison's secret from its file or the environment.
Real sockets on localhost, the real server writing real files."""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
import threading
import time

import pytest

from shardscope.core import record_secret, record_wire
from shardscope.orchestrator.record_server import RecordServer
from shardscope.core.record_wire import (
    Lines,
    LineTooLong,
    RecordSender,
    Refused,
    Unreachable,
    encode,
    parse_endpoint,
    prove,
    send_beat,
)
from shardscope.core.rundir import RunDir

sys.path.insert(0, os.path.dirname(__file__))
from _ports import unlistened_port  # noqa: E402

SECRET = bytes(range(32))
RUNS = {"ddp": 4, "r": 4, "t": 4}  # with 2 nodes, node 1 holds ranks 2 and 3 of each run


def rec(run, rank, **fields):
    """One record line of ``run``'s rank ``rank`` as a rank writes it (node 0 writes nothing else)."""
    return json.dumps({"v": 1, "kind": "step", "run": run, "rank": rank, "t": 1.0, **fields})


def _lines(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def _server(tmp_path, **kw):
    kw = {"secret": SECRET, "runs": RUNS, "nnodes": 2, **kw}
    srv = RecordServer(str(tmp_path), "127.0.0.1:0", **kw)
    srv.start()
    return srv


@pytest.fixture
def server(tmp_path):
    srv = _server(tmp_path)
    yield srv
    srv.stop()


def _endpoint(srv):
    host, port = srv.address
    return f"{host}:{port}"


def _wait_for(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_records_arrive_in_order_exactly_once_across_dropped_connections(server, tmp_path):
    senders = [RecordSender(_endpoint(server), "ddp", rank, secret=SECRET) for rank in (2, 3)]
    for s in senders:
        s.wait_connected()
    for i in range(400):
        for s in senders:
            s.send(rec("ddp", s.rank, step=i))
        if i in (50, 51, 180, 333):  # the link drops mid-stream, also twice in a row
            senders[0].drop_connection()
        if i % 100 == 0:
            time.sleep(0.05)
    assert all(s.close(timeout_s=60) for s in senders)
    assert senders[0].reconnects >= 3
    for s in senders:
        got = _lines(RunDir(str(tmp_path)).run("ddp").rank_file(s.rank))
        assert [r["step"] for r in got] == list(range(400)), s.rank  # none lost, none twice, in order
    assert server.written == 800


def test_a_resend_after_a_lost_ack_is_not_written_twice(server, tmp_path):
    """A connection that drops after node 0 wrote records but before the rank saw the ack: the rank resends
    them; node 0 skips what it already has."""
    host, port = server.address
    hello = {"hello": {"run": "r", "rank": 2, "session": "s1"}}
    with socket.create_connection((host, port), timeout=20) as sock:
        nonce = json.loads(sock.recv(4096))["challenge"]
        sock.sendall(encode(dict(hello, mac=prove(SECRET, nonce, hello))))
        assert json.loads(sock.recv(4096)) == {"ack": -1}
        sock.sendall(b"".join(encode({"seq": i, "line": rec("r", 2, i=i)}) for i in range(3)))
        _wait_for(lambda: server.last_seq("r", 2) == 2)  # written; the acks are never read
    with socket.create_connection((host, port), timeout=20) as sock:  # the same sender, reconnected
        nonce = json.loads(sock.recv(4096))["challenge"]
        sock.sendall(encode(dict(hello, mac=prove(SECRET, nonce, hello))))
        assert json.loads(sock.recv(4096)) == {"ack": 2}
        sock.sendall(b"".join(encode({"seq": i, "line": rec("r", 2, i=i)}) for i in range(5)))  # from 0 again
        _wait_for(lambda: server.last_seq("r", 2) == 4)
    assert [r["i"] for r in _lines(RunDir(str(tmp_path)).run("r").rank_file(2))] == [0, 1, 2, 3, 4]


def test_unreachable_node0_is_one_clear_error():
    with unlistened_port() as port:  # nobody listens
        sender = RecordSender(f"127.0.0.1:{port}", "ddp", 1, connect_timeout_s=1.0, secret=SECRET)
        with pytest.raises(Unreachable, match=rf"node 0's orchestrator at 127.0.0.1:{port} unreachable for 1 s"):
            sender.wait_connected()
        with pytest.raises(Unreachable):
            sender.send("{}")
        assert "unreachable" in sender.error
        sender.close(timeout_s=1)


def test_heartbeats_become_node_files(server, tmp_path):
    send_beat(_endpoint(server), 1, {"node": 1, "host": "n1", "pid": 7, "t": 123.0, "done": False}, secret=SECRET)
    path = RunDir(str(tmp_path)).heartbeat(1)
    _wait_for(lambda: os.path.exists(path))  # node 0 answers after writing it; no wait is needed in fact
    with open(path, encoding="utf-8") as fh:
        assert json.load(fh)["t"] == 123.0


def test_parse_endpoint():
    assert parse_endpoint("node0:29600") == ("node0", 29600)
    assert parse_endpoint("[::1]:5") == ("::1", 5)
    assert parse_endpoint("h:0", any_port=True) == ("h", 0)
    for bad in ("node0", "node0:", ":1", "h:0", "h:70000", "h:x"):
        with pytest.raises(ValueError):
            parse_endpoint(bad)


def test_senders_in_threads_do_not_interleave_lines(server, tmp_path):
    sender = RecordSender(_endpoint(server), "t", 2, secret=SECRET)
    big = "x" * 20000  # records larger than one recv
    threads = [threading.Thread(target=lambda k=k: [sender.send(rec("t", 2, k=k, j=j, pad=big))
                                                    for j in range(20)]) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sender.close(timeout_s=60)
    got = _lines(RunDir(str(tmp_path)).run("t").rank_file(2))
    assert len(got) == 60 and all(len(r["pad"]) == 20000 for r in got)


def test_close_gives_up_cleanly_when_node0_is_gone(tmp_path):
    srv = _server(tmp_path)
    sender = RecordSender(_endpoint(srv), "ddp", 2, connect_timeout_s=1.0, secret=SECRET)
    sender.wait_connected()
    srv.stop()  # node 0 goes away; what is sent now cannot be acknowledged
    sender.drop_connection()
    for i in range(3):
        try:
            sender.send(json.dumps({"i": i}))
        except Unreachable:
            break
    assert sender.close(timeout_s=2) is False
    assert not sender._thread.is_alive()  # the sender thread ended: no spinning, no hang at the rank's exit


def test_an_idle_sender_keeps_its_connection(tmp_path):
    """The server closes connections idle for idle_timeout_s; a live sender pings, so it is not cut."""
    srv = _server(tmp_path, idle_timeout_s=3.0)  # pings every third of it: a thread stalled 2 s is still in time
    try:
        sender = RecordSender(_endpoint(srv), "ddp", 2, secret=SECRET)
        sender.send(rec("ddp", 2, i=0))
        _wait_for(lambda: srv.last_seq("ddp", 2) == 0)
        time.sleep(7)  # over two idle timeouts with nothing to send
        sender.send(rec("ddp", 2, i=1))
        assert sender.close(timeout_s=30)
        assert sender.reconnects == 0 and srv.refused["timed out"] == 0
        assert [r["i"] for r in _lines(RunDir(str(tmp_path)).run("ddp").rank_file(2))] == [0, 1]
    finally:
        srv.stop()


def test_a_wrong_or_missing_secret_is_refused_at_once(server, tmp_path):
    for secret in (b"w" * 32, None):
        sender = RecordSender(_endpoint(server), "ddp", 2, connect_timeout_s=600, secret=secret)
        with pytest.raises(Refused, match="refused this sender: not authenticated"):
            sender.wait_connected(timeout_s=60)  # refused: no waiting out the 600 s of connect_timeout_s
        with pytest.raises(Unreachable, match="not authenticated"):
            sender.send("{}")
        sender.close(timeout_s=1)
        with pytest.raises(OSError, match="not authenticated"):
            send_beat(_endpoint(server), 1, {"t": 1.0}, timeout_s=20, secret=secret)
    assert not os.path.exists(RunDir(str(tmp_path)).heartbeat(1))
    assert not os.path.exists(RunDir(str(tmp_path)).run("ddp").rank_file(2))


def test_unwired_callers_still_work(tmp_path):
    """No secret, no run list on either side (callers not wired yet): records still flow; names stay safe."""
    srv = RecordServer(str(tmp_path), "127.0.0.1:0")
    srv.start()
    try:
        sender = RecordSender(_endpoint(srv), "ddp", 1)
        sender.send(rec("ddp", 1, i=0))
        assert sender.close(timeout_s=30)
        assert [r["i"] for r in _lines(RunDir(str(tmp_path)).run("ddp").rank_file(1))] == [0]
        bad = RecordSender(_endpoint(srv), "../x", 1, connect_timeout_s=600)
        with pytest.raises(Refused, match="unknown run"):
            bad.wait_connected(timeout_s=60)
        bad.close(timeout_s=1)
    finally:
        srv.stop()


def test_a_record_over_the_cap_is_refused_by_the_sender(server):
    sender = RecordSender(_endpoint(server), "ddp", 3, secret=SECRET)
    with pytest.raises(ValueError, match="cap"):
        sender.send(json.dumps({"pad": "x" * record_wire.MAX_LINE_BYTES}))
    sender.send(json.dumps({"pad": '"' * 1000}))  # quoting grows it, still under the cap
    assert sender.close(timeout_s=30)


def test_lines_are_linear_and_capped():
    lines = Lines(max_line=1 << 20)
    chunk = b"x" * (64 << 10)
    fed = 0
    with pytest.raises(LineTooLong):
        for _ in range(50 << 20 // len(chunk)):  # 50 MB without a newline
            lines.feed(chunk)
            fed += len(chunk)
            assert len(lines._buf) <= 1 << 20  # never more than the cap pending
    assert fed <= 1 << 20
    lines = Lines()
    got = lines.feed(b'{"a":1}\n{"b"') + lines.feed(b':2}\n\n{"c":3}') + lines.feed(b"\n")
    assert got == [{"a": 1}, {"b": 2}, {"c": 3}]
    for garbage in (b"[1]\n", b"nope\n", b"[" * 100000 + b"\n"):
        with pytest.raises(ValueError):
            Lines(max_line=1 << 20).feed(garbage)


def test_secret_files_and_environment(tmp_path):
    secret = record_secret.new_secret()
    assert len(secret) == 32 and secret != record_secret.new_secret()
    path = tmp_path / "records.secret"
    record_secret.write_secret(path, secret)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert record_secret.read_secret(path) == secret
    with pytest.raises(FileExistsError):
        record_secret.write_secret(path, secret)  # never overwritten
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    with pytest.raises(OSError):
        record_secret.write_secret(tmp_path / "link", secret)  # never through a symlink
    assert not (tmp_path / "elsewhere").exists()
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="chmod 600") as err:
        record_secret.read_secret(path)
    assert secret.hex() not in str(err.value)
    os.chmod(path, 0o600)
    env = {record_secret.SECRET_ENV: record_secret.secret_text(secret)}
    assert record_secret.secret_from_env(env) == secret
    assert record_secret.secret_from_env({record_secret.SECRET_FILE_ENV: str(path)}) == secret
    assert record_secret.secret_from_env({}) is None
    for bad in ("zz" * 32, "ab" * 8 + "c"):  # not hex; too short
        with pytest.raises(ValueError, match=record_secret.SECRET_ENV) as err:
            record_secret.secret_from_env({record_secret.SECRET_ENV: bad})
        assert bad not in str(err.value)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        RecordServer(str(tmp_path), "127.0.0.1:0", secret=b"short")  # node 0 takes no weak secret
    nonce = "00" * 16
    mac = prove(secret, nonce, {"hello": {"run": "ddp", "rank": 2}})
    assert record_secret.proven(secret, nonce, {"hello": {"run": "ddp", "rank": 2}}, mac)
    assert not record_secret.proven(secret, nonce, {"hello": {"run": "ddp", "rank": 3}}, mac)
    assert not record_secret.proven(secret, "11" * 16, {"hello": {"run": "ddp", "rank": 2}}, mac)
    assert not record_secret.proven(secret, nonce, {"hello": {"run": "ddp", "rank": 2}}, "é" * 64)


def test_the_key_binds_the_comparison():
    """The same secret file proves only this comparison: a node of another one (another rendezvous id, an older
    SLURM job, other settings) answers with another key; every run of one comparison (the A/A control, with its own
    steps) and every node (its own node rank) answer with the same."""
    from shardscope import config
    from shardscope.core.record_secret import comparison_key

    secret = b"s" * 32
    c = config.load_preset("smoke", ["launch.nnodes=2", "launch.records_endpoint='10.0.0.1:29400'"])
    key = comparison_key(secret, c.to_dict())
    node1 = config.load_preset("smoke", ["launch.nnodes=2", "launch.records_endpoint='10.0.0.1:29400'",
                                         "launch.node_rank=1"])
    assert comparison_key(secret, node1.to_dict()) == key
    spec = config.run_spec_payload(config.with_control(c), config.with_control(c).runs[-1], out_dir="o", device="cpu")
    assert comparison_key(secret, spec["comparison"]) == key  # the control run's spec (10 steps, no profiler)
    older = config.load_preset("smoke", ["launch.nnodes=2", "launch.records_endpoint='10.0.0.1:29400'",
                                         "launch.rdzv_id='slurm-41'"])
    assert comparison_key(secret, older.to_dict()) != key
    assert comparison_key(b"t" * 32, c.to_dict()) != key and comparison_key(None, c.to_dict()) is None
