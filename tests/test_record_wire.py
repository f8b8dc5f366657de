"""Records over TCP (issue 12): in order, none lost or duplicated across dropped connections; a clear error
when node 0 cannot be reached. Real sockets on localhost, the real server writing real files."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from shardscope.orchestrator.launcher import free_port
from shardscope.orchestrator.record_server import RecordServer
from shardscope.record_wire import RecordSender, Unreachable, parse_endpoint, send_beat
from shardscope.rundir import RunDir


def _lines(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture
def server(tmp_path):
    srv = RecordServer(str(tmp_path), f"127.0.0.1:{free_port()}")
    srv.start()
    yield srv
    srv.stop()


def _endpoint(srv):
    host, port = srv.address
    return f"{host}:{port}"


def test_records_arrive_in_order_exactly_once_across_dropped_connections(server, tmp_path):
    senders = [RecordSender(_endpoint(server), "ddp", rank) for rank in (1, 3)]
    for s in senders:
        s.wait_connected()
    for i in range(400):
        for s in senders:
            s.send(json.dumps({"kind": "step", "rank": s.rank, "step": i}))
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
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b'{"hello":{"run":"r","rank":0}}\n' + b"".join(
            json.dumps({"seq": i, "line": json.dumps({"i": i})}).encode() + b"\n" for i in range(3)))
        time.sleep(0.3)  # written; the acks are never read
    sender = RecordSender(f"{host}:{port}", "r", 0)
    for i in range(5):  # a sender that starts from 0 again (it never saw an ack)
        sender.send(json.dumps({"i": i}))
    assert sender.close(timeout_s=30)
    assert [r["i"] for r in _lines(RunDir(str(tmp_path)).run("r").rank_file(0))] == [0, 1, 2, 3, 4]


def test_unreachable_node0_is_one_clear_error():
    port = free_port()  # nobody listens
    sender = RecordSender(f"127.0.0.1:{port}", "ddp", 1, connect_timeout_s=1.0)
    with pytest.raises(Unreachable, match=rf"node 0's orchestrator at 127.0.0.1:{port} unreachable for 1 s"):
        sender.wait_connected()
    with pytest.raises(Unreachable):
        sender.send("{}")
    assert "unreachable" in sender.error
    sender.close(timeout_s=1)


def test_heartbeats_become_node_files(server, tmp_path):
    send_beat(_endpoint(server), 1, {"node": 1, "t": 123.0, "done": False})
    path = RunDir(str(tmp_path)).heartbeat(1)
    deadline = time.monotonic() + 10
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert json.load(open(path, encoding="utf-8"))["t"] == 123.0


def test_parse_endpoint():
    assert parse_endpoint("node0:29600") == ("node0", 29600)
    for bad in ("node0", "node0:", ":1", "h:0", "h:70000", "h:x"):
        with pytest.raises(ValueError):
            parse_endpoint(bad)


def test_senders_in_threads_do_not_interleave_lines(server, tmp_path):
    sender = RecordSender(_endpoint(server), "t", 2)
    big = "x" * 20000  # records larger than one recv
    threads = [threading.Thread(target=lambda k=k: [sender.send(json.dumps({"k": k, "j": j, "pad": big}))
                                                    for j in range(20)]) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sender.close(timeout_s=60)
    got = _lines(RunDir(str(tmp_path)).run("t").rank_file(2))
    assert len(got) == 60 and all(len(r["pad"]) == 20000 for r in got)


def test_close_gives_up_cleanly_when_node0_is_gone(tmp_path):
    srv = RecordServer(str(tmp_path), f"127.0.0.1:{free_port()}")
    srv.start()
    sender = RecordSender(_endpoint(srv), "ddp", 1, connect_timeout_s=1.0)
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
