"""Follow a run's files as they grow: rank JSONL metric files and the console log.

Reads only appended bytes (a file offset per file). A torn last line waits for its newline
(``events.LineDecoder``); a line that is not a JSON object is counted and skipped.
"""

from __future__ import annotations

import os
from typing import Any

from shardscope.core.events import LineDecoder
from shardscope.core.console_noise import ConsoleFilter
from shardscope.core.rundir import rank_record_files, record_file_rank
from shardscope.core.text import clean

MAX_READ = 4 << 20  # bytes read from one file per poll, so one huge burst cannot stall the others


class FileFollower:
    """Reads the bytes appended to one file since the last call."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0

    def read_new(self, limit: int = MAX_READ) -> bytes:
        """Return up to ``limit`` bytes appended since the last call (b"" if none or missing)."""
        try:
            with open(self.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size < self.offset:  # truncated or replaced: start again
                    self.offset = 0
                if size == self.offset:
                    return b""
                fh.seek(self.offset)
                data = fh.read(min(limit, size - self.offset))
        except FileNotFoundError:
            return b""
        self.offset += len(data)
        return data


class MetricsTailer:
    """Follows every ``rank<R>.jsonl`` under a run's metrics directory, including files that appear later."""

    def __init__(self, metrics_dir: str) -> None:
        self.metrics_dir = metrics_dir
        self._files: dict[str, tuple[FileFollower, LineDecoder]] = {}

    @property
    def invalid_lines(self) -> int:
        """Lines skipped so far because they were not valid JSON records."""
        return sum(dec.invalid for _, dec in self._files.values())

    def poll(self) -> list[dict[str, Any]]:
        """Return the complete records appended since the last poll, rank file by rank file."""
        for path in rank_record_files(self.metrics_dir):
            if path not in self._files:
                self._files[path] = (FileFollower(path), LineDecoder())
        records: list[dict[str, Any]] = []
        for path in sorted(self._files, key=_rank_of):
            follower, decoder = self._files[path]
            data = follower.read_new()
            if data:
                records.extend(decoder.feed(data))
        return records


def _rank_of(path: str) -> int:
    rank = record_file_rank(path)
    return 1 << 30 if rank is None else rank


class ConsoleTailer:
    """Follows a console log, returning appended text (undecodable bytes replaced) without known
    library noise (``console_noise``)."""

    def __init__(self, path: str) -> None:
        self._follower = FileFollower(path)
        self._filter = ConsoleFilter()

    def poll(self) -> str:
        """Return the text appended since the last poll, noise lines left out."""
        # a rank's output is text from outside: no terminal control sequence reaches a view (core/text.py)
        return clean(self._filter.feed(self._follower.read_new(256 << 10).decode("utf-8", errors="replace")))
