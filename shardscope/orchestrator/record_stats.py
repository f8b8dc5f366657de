"""What node 0's record server refused and took, kept in ``nodes/record_server.json`` for the report and the
verdicts: refusals by reason, connections never admitted by source address, record lines written, duplicates
skipped, heartbeats. Written when it changed, at most once a second, and once more when the server stops."""

from __future__ import annotations

import os
import time
from typing import Any

from shardscope.config import dump_json


class StatsWriter:
    """Writes a record server's counts to ``path`` when they changed (throttled to ``every_s``)."""

    def __init__(self, path: str, every_s: float = 1.0) -> None:
        self.path, self.every_s = path, every_s
        self._seen: Any = None
        self._due = 0.0

    def maybe_write(self, server: Any, force: bool = False) -> None:
        """Write ``server``'s counts if they changed since the last write and the throttle allows (or ``force``);
        a disk that refuses is left to the records' own writes to report."""
        stats = {"refused": dict(server.refused), "refused_from": dict(server.refused_from),
                 "written": server.written, "duplicates": server.duplicates, "beats": server.beats}
        now = time.monotonic()
        if stats == self._seen or (now < self._due and not force):
            return
        self._seen, self._due = stats, now + self.every_s
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            dump_json(self.path, stats)
        except OSError:
            pass
