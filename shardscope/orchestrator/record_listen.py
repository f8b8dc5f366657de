"""Where node 0's record server listens: the endpoint's host (or the address the user gives, ``BIND_SETTING``) and
its port; a host that resolves here only to loopback is refused when other nodes must reach it. Stdlib ``socket``.
"""

from __future__ import annotations

from collections.abc import Mapping

import ipaddress
import socket

from shardscope.core.record_wire import parse_endpoint

MIN_CONNECTIONS = 64
BIND_SETTING = "launch.records_bind"  # named in the errors: where a user gives the address to listen on


class BindError(OSError):
    """The record server cannot listen where it was told (one line saying why and what to set)."""


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def listen(endpoint: str, bind: str | None, nnodes: int | None) -> socket.socket:
    """A listening, non-blocking socket on the endpoint's host (or ``bind``) and the endpoint's port."""
    host, port = parse_endpoint(endpoint, any_port=True)
    where = host if bind is None else bind.strip("[]")
    try:
        infos = socket.getaddrinfo(where or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as err:
        raise BindError(f"records server: cannot resolve {where!r} ({err}); give the address to listen on "
                        f"({BIND_SETTING})") from None
    addrs = sorted({str(info[4][0]) for info in infos})
    if bind is None and (nnodes is None or nnodes > 1) and not (_is_loopback(host) or host == "localhost") \
            and all(_is_loopback(a) for a in addrs):
        raise BindError(f"records server: {host} resolves on this node only to {', '.join(addrs)} (loopback), where "
                        f"other nodes cannot reach it; give the address to listen on ({BIND_SETTING}: this "
                        "node's cluster address, or 0.0.0.0 for every interface)")
    error: OSError | None = None
    for family, kind, proto, _, addr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(128)
            sock.setblocking(False)
            return sock
        except OSError as err:
            sock.close()
            error = err
    raise BindError(f"records server: cannot listen on {where}:{port} ({error}); if {host} is how other nodes reach "
                    f"this one but no address of it (NAT, a proxy), give the address to listen on ({BIND_SETTING})")


def default_max_connections(runs: Mapping[str, int] | None, nnodes: int | None) -> int:
    """4 x the ranks of all runs + nnodes, at least MIN_CONNECTIONS (256 when not told the runs), at most half
    this process's descriptor limit."""
    wanted = max(MIN_CONNECTIONS, 4 * sum(int(ws) for ws in runs.values()) + (nnodes or 0)) if runs else 256
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return min(wanted, max(16, soft // 2)) if soft > 0 else wanted
    except (ImportError, OSError, ValueError):
        return wanted
