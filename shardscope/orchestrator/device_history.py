"""What the devices panel remembers: each device's (or rank process's) last reading and its peak,
kept after the run that used it ended, so a finished comparison still shows what was measured.
Pure Python; the app folds every ``DeviceSample`` into one ``DeviceHistory`` on the UI thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardscope.profiling.state import DeviceReading, DeviceSample


@dataclass
class Kept:
    """One device or rank process: its last reading, its peak memory, and whether the latest sample had it."""

    last: DeviceReading
    peak_used_bytes: int
    live: bool
    source: str


class DeviceHistory:
    """Last reading and peak per (run, label), over every sample seen."""

    def __init__(self) -> None:
        self.kept: dict[tuple[str, str], Kept] = {}
        self.source = ""

    def add(self, sample: DeviceSample) -> None:
        """Fold one sample: its readings become the last ones, peaks grow, absent entries stop being live."""
        if not sample.readings:
            return
        for k in self.kept.values():
            k.live = False
        self.source = sample.source
        for r in sample.readings:
            key = (r.run, r.label)
            old = self.kept.get(key)
            if r.kind == "process" and r.used_bytes == 0 and old is not None:
                continue  # a rank process that already exited reads 0 B: keep its last real reading
            peak = max(r.used_bytes, old.peak_used_bytes if old else 0)
            self.kept[key] = Kept(r, peak, True, sample.source)

    def rows(self) -> list[Kept]:
        """Return the kept entries: live ones first, then ended runs', each sorted by kind and label."""
        return sorted(self.kept.values(), key=lambda k: (not k.live, k.last.kind, k.last.run, k.last.label))
