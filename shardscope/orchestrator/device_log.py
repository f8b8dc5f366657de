"""Device sampling for a session: NVML (or process RSS) samples, published live and appended to
``<out>/devices.jsonl``. A full disk stops the file, never the samples. Samples are published from
the sampler's own thread, not the session's: subscribers must be thread-safe (the app posts a
message, the headless view takes a lock)."""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

from shardscope.profiling import state


class DeviceLog:
    """Runs a ``profiling.nvml.DeviceSampler`` and keeps its samples in ``devices.jsonl``."""

    def __init__(self, path: str, node_label: str = "") -> None:
        self.path = path
        self.node_label = node_label  # several nodes: "node N (host)" before each reading's label
        self._sampler = None
        self._log = None

    def start(self, publish: Callable[[state.DeviceSample], None],
              pids_by_run: Callable[[], dict[str, dict[int, int]]]) -> str:
        """Start sampling; return "" or why sampling is unavailable (runs go on without it)."""
        try:
            from shardscope.profiling.nvml import DeviceSampler
        except ImportError:
            return ""
        sampler = DeviceSampler()
        log = open(self.path, "a", encoding="utf-8", buffering=1)

        def on_sample(sample: state.DeviceSample) -> None:
            if self.node_label:  # several nodes: say whose device or process this is
                sample = dataclasses.replace(sample, readings=tuple(
                    dataclasses.replace(r, label=f"{self.node_label} {r.label}") for r in sample.readings))
            if sample.readings and not log.closed:
                try:
                    log.write(json.dumps(dataclasses.asdict(sample), separators=(",", ":")) + "\n")
                except OSError:  # a full disk: samples still reach the views, no longer the file
                    log.close()
            publish(sample)

        try:
            sampler.start(on_sample, pids_by_run)
        except Exception as err:  # sampling is optional
            log.close()
            return f"device sampling unavailable: {err!r}"
        self._sampler, self._log = sampler, log
        return ""

    def close(self) -> None:
        """Stop sampling and close the file."""
        if self._sampler is not None:
            self._sampler.close()
            try:
                self._log.close()  # type: ignore[union-attr]
            except OSError:
                pass
