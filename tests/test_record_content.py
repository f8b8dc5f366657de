"""Issue 43, item 3: what an admitted sender (one holding the secret: a buggy or compromised node) sends is checked
too. On real sockets on 127.0.0.1 (ports from the system): a record line that is not one of its rank's records
(a string time, nesting past the decoder, another rank's record, no kind) is counted and skipped, never written,
never a crash of node 0; a malformed heartbeat is refused; a second sender session that claims sequence 0 first
never makes the real sender lose a record. And every reader of a rank file gets the same bounded, typed lines."""

from __future__ import annotations

import json
import os

from shardscope.core.events import read_records
from shardscope.core.record_wire import RecordSender, encode, send_beat
from shardscope.core.rundir import RunDir

from test_record_server_attacks import RUNS, SECRET, WAIT_S, _admitted, _wait_for, make, out, rec  # noqa: F401

BAD = ['{"v":1,"kind":"step","run":"ddp","rank":2,"t":"soon"}',  # a string where a time belongs
       "[" * 100000 + "]" * 100000,  # nested past any decoder
       rec("ddp", 3, step=0),  # another rank's record
       rec("fsdp", 2, step=0),  # another run's
       '{"v":1,"run":"ddp","rank":2,"t":1.0}',  # no kind
       '{"v":1,"kind":"step","run":"ddp","rank":2,"t":1.0,"n":' + "9" * 500 + "}"]  # a 500-digit integer


def test_bad_lines_from_an_admitted_sender_are_counted_and_never_written(tmp_path, out, make):
    srv = make()
    with _admitted(srv, "ddp", 2) as client:
        for seq, line in enumerate([rec("ddp", 2, step=0), *BAD, rec("ddp", 2, step=1)]):
            client.send(encode({"seq": seq, "line": line}))
            assert client.answer() == {"ack": seq}  # taken (and skipped): the sender is not stuck on it
    with open(RunDir(str(out)).run("ddp").rank_file(2), encoding="utf-8") as fh:
        assert [json.loads(line)["step"] for line in fh] == [0, 1]
    assert srv.refused["a record line that is not one of this rank's records"] == len(BAD)
    sender = RecordSender(f"127.0.0.1:{srv.address[1]}", "ddp", 3, secret=SECRET)  # node 0 still serves
    sender.send(rec("ddp", 3, step=0))
    assert sender.close(timeout_s=WAIT_S)


def test_a_malformed_heartbeat_is_refused_and_writes_nothing(out, make):
    srv = make()
    endpoint = f"127.0.0.1:{srv.address[1]}"
    good = {"node": 1, "host": "n1", "pid": 42, "t": 1.5, "done": False}
    for bad in ({**good, "t": "soon"}, {**good, "t": float("inf")}, {**good, "node": 2}, {**good, "extra": 1},
                {**good, "pid": -1}, {**good, "host": "h" * 300}, {**good, "done": "no"}):
        try:
            send_beat(endpoint, 1, bad, timeout_s=WAIT_S, secret=SECRET)
        except OSError as err:
            assert "malformed heartbeat" in str(err)
    assert not os.path.exists(RunDir(str(out)).heartbeat(1))
    assert srv.refused["a malformed heartbeat"] == 7
    send_beat(endpoint, 1, good, timeout_s=WAIT_S, secret=SECRET)
    with open(RunDir(str(out)).heartbeat(1), encoding="utf-8") as fh:
        assert json.load(fh) == good


def test_a_second_session_claiming_sequence_zero_first_costs_the_real_sender_nothing(out, make):
    srv = make()
    with _admitted(srv, "ddp", 2, session="evil") as client:  # first in, claims 0 and 1
        for seq in (0, 1):
            client.send(encode({"seq": seq, "line": rec("ddp", 2, step=100 + seq)}))
            assert client.answer() == {"ack": seq}
    _wait_for(lambda: srv.connections == 0)
    real = RecordSender(f"127.0.0.1:{srv.address[1]}", "ddp", 2, secret=SECRET)
    for i in range(5):
        real.send(rec("ddp", 2, step=i))
    assert real.close(timeout_s=WAIT_S)
    with open(RunDir(str(out)).run("ddp").rank_file(2), encoding="utf-8") as fh:
        steps = [json.loads(line)["step"] for line in fh]
    assert steps == [100, 101, 0, 1, 2, 3, 4]  # every record of the real sender, in order, once


def test_every_reader_gets_bounded_typed_lines(tmp_path):
    """A crafted rank file: the lines above, a 3 MiB line, a torn last line; read_records (every command's
    reader) returns the good records and counts the rest, without holding the long line whole."""
    path = tmp_path / "rank0.jsonl"
    lines = [rec("ddp", 0, step=0), *BAD, "x" * (3 << 20), rec("ddp", 0, step=1)]
    path.write_text("\n".join(lines) + "\n" + '{"kind":"st', encoding="utf-8")
    records, invalid = read_records(path)
    assert [(r["run"], r["rank"], r["step"]) for r in records] == [("ddp", 0, 0), ("ddp", 3, 0), ("fsdp", 2, 0),
                                                                    ("ddp", 0, 1)]  # records, if not this file's
    assert invalid == 5  # the string time, the nesting, no kind, the 500 digits, the 3 MiB line


def _flood(port, stop, source="127.0.0.2"):
    """Without the secret: hold as many connections as node 0 lets in, re-opened at once when it closes them."""
    import socket

    held = []
    while not stop.is_set():
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=2, source_address=(source, 0))
            held.append(sock)
        except OSError:
            pass
        held = [s for s in held if _open(s)][-64:]
    for s in held:
        s.close()


def _open(sock):
    import select

    readable, _, _ = select.select([sock], [], [], 0)
    if readable:
        try:
            if not sock.recv(65536, 0x40):  # MSG_DONTWAIT: closed by node 0
                sock.close()
                return False
        except (BlockingIOError, OSError):
            return True
    return True


def test_a_flood_without_the_secret_takes_no_place_of_a_real_node(out, make):
    """64 connections from 127.0.0.2 that re-open as soon as node 0 closes them (no secret) hold at most
    max_pending_per_source places (a newcomer evicts one of them); node 1 (127.0.0.1) still beats and sends every
    record, node 0 counts the evictions by source, keeps them in nodes/record_server.json, and the lost-node
    verdict would name them. The same flood on node 1's own address: tests/test_record_flood.py."""
    import threading

    from shardscope.orchestrator import nodes

    srv = make()
    stop = threading.Event()
    flood = threading.Thread(target=_flood, args=(srv.address[1], stop), daemon=True)
    flood.start()
    try:
        _wait_for(lambda: srv.refused_from["127.0.0.2"] >= 50)
        endpoint = f"127.0.0.1:{srv.address[1]}"
        sender = RecordSender(endpoint, "ddp", 2, secret=SECRET)
        for i in range(40):
            sender.send(rec("ddp", 2, step=i))
        send_beat(endpoint, 1, {"node": 1, "host": "n1", "pid": 7, "t": 5.0, "done": False}, timeout_s=WAIT_S,
                  secret=SECRET)
        assert sender.close(timeout_s=WAIT_S)
    finally:
        stop.set()
        flood.join(30)
    with open(RunDir(str(out)).run("ddp").rank_file(2), encoding="utf-8") as fh:
        assert [json.loads(line)["step"] for line in fh] == list(range(40))
    assert 1 in srv.heard and srv.refused_from.get("127.0.0.1", 0) == 0
    assert srv.refused["evicted (too many unauthenticated from one address)"] > 0
    _wait_for(lambda: os.path.exists(RunDir(str(out)).record_server_stats()))
    _wait_for(lambda: json.load(open(RunDir(str(out)).record_server_stats()))["refused_from"].get("127.0.0.2", 0) > 0)
    said = nodes.lost_message([1], 30, dict(srv.refused_from))
    assert f"refused {sum(srv.refused_from.values()):,} unauthenticated connections meanwhile" in said
    assert "from 127.0.0.2" in said
