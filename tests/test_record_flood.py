"""Issue 43: someone without the secret on a real node's own address (another user on node 1; 127.0.0.1 here) holds
node 0's pending places by opening idle sockets, or sockets that trickle a hello byte by byte, and re-opening them
the moment they are closed. A newcomer takes a pending one's place (``orchestrator/record_pending.py``), so the
real node's sender and heartbeats still get in: every record arrives, a heartbeat gets through, the evictions are
counted by reason and source (``nodes/record_server.json``, report.md). Real sockets on 127.0.0.1, ports from the
system; every wait is bounded in count and time, nothing asserts how long something took."""

from __future__ import annotations

import json
import os
import socket
import threading

import pytest

from shardscope.analysis.markdown import _record_server_md
from shardscope.core.record_wire import RecordSender, send_beat
from shardscope.core.rundir import RunDir
from shardscope.orchestrator.record_pending import POOL_FULL, SOURCE_FULL, PendingPool, evicted

import test_record_server_attacks as attacks
from test_record_server_attacks import SECRET, WAIT_S, _wait_for, rec

out, make = attacks.out, attacks.make  # its fixtures: an output directory, a started RecordServer

HELLO = b'{"hello":{"run":"ddp","rank":2,"session":"x"},"mac":"' + b"0" * 64 + b'"}'  # never finished
BEAT_TRIES = 30  # what a 30 s node timeout allows at one beat a second


def _attack(port, stop, trickle):
    """Without the secret, from 127.0.0.1 (the real node's address): hold as many connections as node 0 lets in,
    open a new one every turn and re-open each as soon as node 0 closes it; ``trickle``: each held one sends the
    next byte of a hello every turn (never the newline)."""
    held = []  # [socket, bytes sent]
    while not stop.is_set():
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=2)
            sock.setblocking(False)  # a socket with a timeout would wait for data before each recv
            held.append([sock, 0])
        except OSError:
            pass
        alive = []
        for entry in held[-64:]:
            sock, sent = entry
            try:
                try:
                    if not sock.recv(65536):
                        raise ConnectionError("closed by node 0")
                except BlockingIOError:
                    pass  # still open, nothing new
                if trickle and sent < len(HELLO):
                    entry[1] += sock.send(HELLO[sent:sent + 1])
                alive.append(entry)
            except OSError:
                sock.close()
        for sock, _ in held[:-64]:
            sock.close()
        held = alive
    for sock, _ in held:
        sock.close()


@pytest.mark.parametrize("trickle", [False, True], ids=["idle", "trickling"])
def test_a_flood_on_the_real_nodes_own_address_cannot_lose_it(out, make, trickle):
    srv = make()
    endpoint = f"127.0.0.1:{srv.address[1]}"
    stop = threading.Event()
    attacker = threading.Thread(target=_attack, args=(srv.address[1], stop, trickle), daemon=True)
    attacker.start()
    beat = {"node": 1, "host": "n1", "pid": 7, "t": 5.0, "done": False}
    beats = 0
    try:
        _wait_for(lambda: srv.refused[evicted(SOURCE_FULL)] >= 50)  # the address's places are full and turning
        sender = RecordSender(endpoint, "ddp", 2, secret=SECRET)
        for i in range(40):
            sender.send(rec("ddp", 2, step=i))
        for _ in range(BEAT_TRIES):
            try:
                send_beat(endpoint, 1, beat, timeout_s=WAIT_S, secret=SECRET)
                beats += 1
            except OSError:  # evicted before its answer landed: the next beat tries again
                continue
            if beats == 3:
                break
        assert sender.close(timeout_s=WAIT_S)
        assert srv.refused[evicted(SOURCE_FULL)] >= 50 and attacker.is_alive()  # the flood lasted throughout
    finally:
        stop.set()
        attacker.join(30)
    with open(RunDir(str(out)).run("ddp").rank_file(2), encoding="utf-8") as fh:
        assert [json.loads(line)["step"] for line in fh] == list(range(40))  # every record, once, in order
    assert beats >= 1 and 1 in srv.heard  # node 1 got through: not judged lost
    with open(RunDir(str(out)).heartbeat(1), encoding="utf-8") as fh:
        assert json.load(fh) == beat
    assert srv.written == 40 and srv.refused_from["127.0.0.1"] >= 50
    path = RunDir(str(out)).record_server_stats()
    _wait_for(lambda: os.path.exists(path) and json.load(open(path))["refused"].get(evicted(SOURCE_FULL), 0) >= 50)
    with open(path, encoding="utf-8") as fh:
        said = _record_server_md(json.load(fh))
    assert " evicted (too many unauthenticated from one address)" in said and "127.0.0.1 " in said


class _C:
    source = None


def _pool(max_pending=6, per_source=3, stale_s=1.0):
    return PendingPool(max_pending, per_source, stale_s)


def test_an_address_at_its_cap_makes_room_from_its_own_places():
    pool = _pool()
    mine = [_C() for _ in range(3)]
    other = _C()
    for c in mine:
        pool.add(c, "a", 0.0)
    pool.add(other, "b", 0.0)
    for _ in range(50):  # all young and silent: one of its own, at random, never another address's
        reason, victim = pool.room("a", 0.5)
        assert reason == evicted(SOURCE_FULL) and victim in mine
    assert pool.room("b", 0.5) == ("", None) and len(pool) == 4 and pool.count("a") == 3


def test_a_partial_hello_or_a_stale_wait_goes_first_oldest_first():
    pool = _pool()
    young, trickler, old, older = _C(), _C(), _C(), _C()
    pool.add(older, "a", 0.0)
    pool.add(trickler, "a", 0.8)
    pool.add(young, "a", 0.9)
    pool.sent_part(trickler)
    assert pool.room("a", 0.95) == (evicted(SOURCE_FULL), trickler)  # the only suspect yet
    assert pool.room("a", 1.5) == (evicted(SOURCE_FULL), older)  # waited 1.5 s > stale_s: older than the trickler
    pool.release(older)
    pool.add(old, "a", 1.0)
    assert pool.room("a", 1.5) == (evicted(SOURCE_FULL), trickler)
    assert older.source is None and old.source == "a"


def test_a_full_pool_makes_room_from_the_address_holding_most():
    pool = _pool(per_source=4)
    big = [_C() for _ in range(3)]
    small = [_C() for _ in range(2)]
    third = _C()
    for c in big:
        pool.add(c, "big", 0.0)
    for c in small:
        pool.add(c, "small", 0.0)
    pool.add(third, "third", 0.0)
    for source in ("new", "small", "third", "big"):  # "big" holds most (below its cap): one of big's goes
        reason, victim = pool.room(source, 0.1)
        assert reason == evicted(POOL_FULL) and victim in big
    pool.release(big[0])
    pool.add(_C(), "third", 0.0)  # 2 places each
    for source in ("big", "small", "third"):
        reason, victim = pool.room(source, 0.1)
        assert reason == evicted(POOL_FULL) and victim.source == source  # tied for most: its own


def test_nothing_to_make_room_with_refuses_the_newcomer():
    alone = PendingPool(4, 10)  # one address may hold the whole pool (not the defaults): it is refused, as before
    for _ in range(4):
        alone.add(_C(), "a", 0.0)
    assert alone.room("a", 9.0) == (POOL_FULL, None)
    assert PendingPool(4, 0).room("a", 0.0) == (SOURCE_FULL, None)
    assert PendingPool(0, 4).room("a", 0.0) == (POOL_FULL, None)
