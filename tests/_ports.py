"""Ports for multi-node tests: a block below the kernel's ephemeral range.

A multi-node comparison rendezvouses run i on ``port + i``. ``free_port()`` hands out a port from the
ephemeral range, where ``port + 1`` may be any process's outgoing connection a moment later (CI saw a
run fail with no record on either node that way); ports below that range are only ever taken by a bind.
"""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Iterator


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="utf-8") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_block(n: int) -> int:
    """Return a port P with P .. P + n - 1 all free on 127.0.0.1, below the ephemeral range."""
    high = _ephemeral_low() - n
    for _ in range(200):
        base = random.randrange(20000, high)
        if all(_bindable(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no block of {n} free ports below {high + n}")


@contextlib.contextmanager
def unlistened_port() -> Iterator[int]:
    """A port on 127.0.0.1 bound, while the block lasts, by a socket that never listens: a connection to it is
    refused, and no other process can take it meanwhile (a port merely free a moment ago could be)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])
