"""Node 0's record server: other nodes' ranks send their records here when no filesystem is shared.

Each record line is appended to ``<out>/<run>/metrics/rank<R>.jsonl`` in node 0's output directory, in
sequence order, exactly once (see ``shardscope/record_wire.py`` for the protocol and its guarantees);
heartbeats of other nodes' orchestrators become ``nodes/node<N>.json``. Everything downstream (the
session's tailers, the verdict, the report) reads those files as on a shared filesystem.
"""

from __future__ import annotations

import os
import socketserver
import threading
from typing import Any

from shardscope.config import dump_json
from shardscope.record_wire import Lines, encode, parse_endpoint
from shardscope.rundir import RunDir


class RecordServer:
    """A threaded TCP server writing received records into ``out_dir``; ``start``/``stop``."""

    def __init__(self, out_dir: str, endpoint: str) -> None:
        self.out = RunDir(out_dir)
        host, port = parse_endpoint(endpoint)
        self.written = 0  # record lines appended (duplicates skipped are not counted)
        self.duplicates = 0  # resent lines already written (after a dropped connection)
        self._last: dict[tuple[str, int], int] = {}
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._guard = threading.Lock()
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                server._serve(self.request)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        socketserver.ThreadingTCPServer.daemon_threads = True
        # Every interface on the endpoint's port: the endpoint's host name is how *other* nodes reach this one
        # (on many hosts it resolves locally to 127.0.1.1, which they could not reach).
        del host
        self._server = socketserver.ThreadingTCPServer(("", port), Handler)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) the server listens on."""
        return self._server.server_address[:2]

    def start(self) -> None:
        """Serve on a background thread."""
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="shardscope-record-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()

    def last_seq(self, run: str, rank: int) -> int:
        """The last sequence number written for (run, rank); -1 for none."""
        with self._guard:
            return self._last.get((run, rank), -1)

    def _lock(self, key: tuple[str, int]) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def _serve(self, sock: Any) -> None:
        lines = Lines()
        key: tuple[str, int] | None = None
        fh = None
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    return
                acked = None
                for msg in lines.feed(data):
                    if "beat" in msg:
                        path = self.out.heartbeat(int(msg["node"]))
                        os.makedirs(os.path.dirname(path), exist_ok=True)
                        dump_json(path, msg["beat"])
                    elif "hello" in msg:
                        key = (str(msg["hello"]["run"]), int(msg["hello"]["rank"]))
                        path = self.out.run(key[0]).rank_file(key[1])
                        os.makedirs(os.path.dirname(path), exist_ok=True)
                        fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in finally
                        acked = self.last_seq(*key)
                    elif key is not None and fh is not None:
                        acked = self._append(key, fh, int(msg["seq"]), str(msg["line"]))
                if acked is not None:
                    sock.sendall(encode({"ack": acked}))
        except (OSError, ValueError, KeyError, TypeError):
            return  # a dropped or garbled connection: the rank reconnects and resends from its last ack
        finally:
            if fh is not None:
                fh.close()

    def _append(self, key: tuple[str, int], fh: Any, seq: int, line: str) -> int:
        """Append ``line`` if ``seq`` is the next one for ``key``; return the last sequence number written."""
        with self._lock(key):
            last = self.last_seq(*key)
            if seq == last + 1:
                fh.write(line + "\n")
                fh.flush()
                with self._guard:
                    self._last[key] = seq
                    self.written += 1
                return seq
            if seq <= last:
                with self._guard:
                    self.duplicates += 1
                return last
            raise ValueError(f"record {seq} after {last}: a gap")  # cannot happen with the sender; drop the link
