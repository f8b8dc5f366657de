"""Node 0's record server: the pool of connections accepted but not admitted yet, and who leaves it when it is full.

A connection waits here from accept to its admitted hello or beat (at most the server's ``handshake_timeout_s``):
``max_pending`` in all, ``max_per_source`` from one address. A full pool does not turn the newcomer away: then
whoever holds the places (someone without the secret on a real node's own address, re-opening idle sockets the
moment they close) would keep that node's senders and heartbeats out for good. The newcomer takes the place of a
pending connection instead: one of its own address's when that address is at its cap, else one of the address
holding the most places (its own when tied); refused only when nothing can make room (a cap of 0, or one address
holding the whole pool, which needs ``max_per_source`` >= ``max_pending``: never with the defaults).

Which one goes. First one that no real sender looks like, the oldest of them: it sent part of a line and stopped (a
real hello is one small write and arrives whole) or has waited ``stale_s`` (a real sender answers the challenge
within a round trip). Otherwise one at random (``secrets``), not the oldest: oldest-first gives every connection a
life of exactly ``max_per_source`` arrivals from its address, so someone opening that many within one round trip
would evict every real hello before it lands; at random a real sender survives ``k`` such arrivals with probability
``(1 - 1/places) ** k``, never zero, and it retries (a heartbeat every second, senders with backoff). The server
reads hellos before it accepts more connections and accepts a few per turn, so arrivals within a round trip stay
few. Partial hellos are closed by the handshake timeout in any case: bytes never extend it.
"""

from __future__ import annotations

import secrets
from typing import Any

STALE_S = 1.0  # waited this long without an admitted hello: no real sender (it answers within a round trip)
SOURCE_FULL = "too many unauthenticated from one address"
POOL_FULL = "unauthenticated pool full"


def evicted(reason: str) -> str:
    """The refusal reason counted for a pending connection that made room for a newcomer (``refused``)."""
    return f"evicted ({reason})"


class PendingPool:
    """Connections not admitted yet, by source address, oldest first; ``room`` picks who makes way. A connection's
    ``source`` attribute is its address while it is in the pool and None once it left (admitted or closed)."""

    def __init__(self, max_pending: int, max_per_source: int, stale_s: float = STALE_S) -> None:
        self.max_pending, self.max_per_source, self.stale_s = max_pending, max_per_source, stale_s
        self._by_source: dict[str, dict[Any, list[Any]]] = {}  # source -> conn -> [accepted at, sent part of a line]
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def count(self, source: str) -> int:
        """Connections from ``source`` in the pool now."""
        return len(self._by_source.get(source, ()))

    def add(self, conn: Any, source: str, now: float) -> None:
        """Put ``conn``, accepted from ``source`` at ``now`` (``time.monotonic``), in the pool."""
        self._by_source.setdefault(source, {})[conn] = [now, False]
        self._size += 1
        conn.source = source

    def release(self, conn: Any) -> None:
        """Take ``conn`` out (admitted, or closed before); one not in the pool (``source`` None) is left as it is."""
        conns = self._by_source.get(conn.source) if conn.source is not None else None
        if conns is not None and conns.pop(conn, None) is not None:
            self._size -= 1
            if not conns:
                del self._by_source[conn.source]
        conn.source = None

    def sent_part(self, conn: Any) -> None:
        """``conn`` sent bytes and is still not admitted: part of a line, which no real sender leaves waiting."""
        entry = self._by_source.get(conn.source, {}).get(conn) if conn.source is not None else None
        if entry is not None:
            entry[1] = True

    def room(self, source: str, now: float) -> tuple[str, Any]:
        """Make room for a newcomer from ``source``: ``("", None)`` when there is room; ``(reason, victim)`` when
        ``victim`` must be closed first (``reason``: ``evicted(...)``, to be counted); ``(reason, None)`` when the
        newcomer is refused (nothing can make room)."""
        if self.count(source) >= self.max_per_source:
            return self._pick(self._by_source.get(source, {}), now, SOURCE_FULL)
        if self._size < self.max_pending:
            return "", None
        if self.count(source) == self._size:  # one address holds it all (max_per_source >= max_pending), or none
            return POOL_FULL, None
        most = max(len(conns) for conns in self._by_source.values())
        if self.count(source) == most:
            return self._pick(self._by_source[source], now, POOL_FULL)
        return self._pick({c: e for conns in self._by_source.values() if len(conns) == most
                           for c, e in conns.items()}, now, POOL_FULL)

    def _pick(self, conns: dict[Any, list[Any]], now: float, full: str) -> tuple[str, Any]:
        if not conns:
            return full, None
        suspects = [(entry[0], i, conn) for i, (conn, entry) in enumerate(conns.items())
                    if entry[1] or now - entry[0] >= self.stale_s]
        if suspects:
            return evicted(full), min(suspects, key=lambda s: (s[0], s[1]))[2]
        return evicted(full), list(conns)[secrets.randbelow(len(conns))]
