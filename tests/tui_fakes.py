"""A stand-in for the orchestrator's ReplaySource, for the app's tests only.

Reads a recorded run directory and publishes the same kinds of updates a Session would:
RunDefined, StatusChanged, RecordsArrived, ConsoleText, DeviceSample, ComparisonFinished.
``fraction`` < 1 publishes only the first part of each run's records and leaves runs running.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import threading
import time
from typing import Callable

from shardscope.core import events
from shardscope.config import Comparison, resolved_options, resolved_precision, resolved_world_size
from shardscope.profiling import state as st

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "data", "replay-smoke")
REPO_ROOT = os.path.dirname(HERE)


class FakeReplaySource:
    """Publishes a run directory's records as updates; stop/restart calls are recorded."""

    def __init__(self, out_dir: str = FIXTURE, *, fraction: float = 1.0, threaded: bool = False,
                 batch: int = 40, delay_s: float = 0.0) -> None:
        self.out_dir = out_dir
        self.fraction = fraction
        self.threaded = threaded
        self.batch = batch
        self.delay_s = delay_s
        self.finished = False
        self.calls: list[tuple[str, str]] = []
        self._callbacks: list[Callable[[list[st.Update]], None]] = []
        with open(os.path.join(out_dir, "comparison.json"), encoding="utf-8") as fh:
            self.comparison = Comparison.from_dict(json.load(fh))
        self.run_names = [r.name for r in self.comparison.runs]

    def subscribe(self, callback: Callable[[list[st.Update]], None]) -> None:
        """Add a callback receiving batches of updates."""
        self._callbacks.append(callback)

    def _emit(self, updates: list[st.Update]) -> None:
        for cb in self._callbacks:
            cb(updates)

    def start(self) -> None:
        """Publish the recorded updates (now, or from a thread when ``threaded``)."""
        if self.threaded:
            threading.Thread(target=self._play, daemon=True).start()
        else:
            self._play()

    def _play(self) -> None:
        c = self.comparison
        self._emit([st.RunDefined(r.name, r.strategy, resolved_world_size(c, r), c.steps, resolved_precision(c, r),
                                  resolved_options(r), os.path.join(self.out_dir, r.name)) for r in c.runs])
        for run in c.runs:
            self._play_run(run.name)
        if self.fraction >= 1.0:
            self.finished = True
            self._emit([st.ComparisonFinished(self.out_dir, 1, os.path.join(self.out_dir, "summary.json"),
                                              os.path.join(self.out_dir, "report.md"))])

    def _play_run(self, name: str) -> None:
        run_dir = os.path.join(self.out_dir, name)
        records = []
        for rank in (0, 1):
            path = os.path.join(run_dir, "metrics", f"rank{rank}.jsonl")
            if os.path.exists(path):
                records += events.read_records(path)[0]
        records.sort(key=lambda r: r["t"])
        keep = records[: int(len(records) * self.fraction)] if self.fraction < 1.0 else records
        t0 = keep[0]["t"] if keep else 0.0
        self._emit([st.StatusChanged(name, st.STARTING, t=t0)])
        with open(os.path.join(run_dir, "console.log"), encoding="utf-8") as fh:
            console = fh.read().splitlines(keepends=True)
        n_console = len(console) if self.fraction >= 1.0 else 1
        self._emit([st.ConsoleText(name, "".join(console[:n_console]))])
        for i in range(0, len(keep), self.batch):
            chunk = tuple(keep[i:i + self.batch])
            rss = {r["rank"]: r.get("rss_bytes", 0) for r in chunk if "rss_bytes" in r}
            sample = st.DeviceSample(tuple(st.DeviceReading(f"{name} rank {k} (process RSS)", "process", v, run=name,
                                                            ranks=(k,)) for k, v in sorted(rss.items())),
                                     "process-rss", t=chunk[-1]["t"])
            self._emit([st.RecordsArrived(name, chunk), sample])
            if self.delay_s:
                time.sleep(self.delay_s)
        if self.fraction < 1.0:
            return
        errors = [r for r in records if r["kind"] == "error"]
        end_t = records[-1]["t"] if records else 0.0
        if errors:
            self._emit([st.StatusChanged(name, st.FAILED, error=errors[0]["message"],
                                         traceback=errors[0]["traceback"], t=end_t)])
        else:
            self._emit([st.StatusChanged(name, st.OK, t=end_t)])

    def stop_run(self, name: str) -> None:
        """Record the call and report the run stopped."""
        self.calls.append(("stop_run", name))
        self._emit([st.StatusChanged(name, st.STOPPED)])

    def restart_run(self, name: str) -> None:
        """Record the call and report the run queued again."""
        self.calls.append(("restart_run", name))
        self._emit([st.StatusChanged(name, st.QUEUED)])

    def stop_all(self) -> None:
        """Record the call; every run not finished becomes stopped."""
        self.calls.append(("stop_all", ""))
        self.finished = True
        self._emit([st.StatusChanged(n, st.STOPPED) for n in self.run_names])

    def wait(self, timeout: float | None = None) -> int | None:
        """Return 1 once finished (the fixture has a failed run), else None."""
        return 1 if self.finished else None


def fake_factory(**kwargs) -> Callable[[Comparison, str], FakeReplaySource]:
    """Return a source factory that ignores the comparison and replays the fixture."""
    def factory(comparison: Comparison, out_dir: str) -> FakeReplaySource:
        return FakeReplaySource(FIXTURE, **kwargs)
    return factory


def run_async(test):
    """Run an ``async def`` test with asyncio (no pytest async plugin needed)."""
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))
    return wrapper


async def click_until(pilot, selector: str, predicate: Callable[[], bool], attempts: int = 60) -> None:
    """Click ``selector`` until ``predicate()`` holds, waiting about a second after each click (a bound for a hang,
    not a timing). On a loaded machine a click sent while the screen is still laying out can reach another widget
    and be lost (a floor CI run waited 60 s on one lost click); the next click finds the widget where it now is."""
    for _ in range(attempts):
        await pilot.click(selector)
        for _ in range(20):
            if predicate():
                return
            await pilot.pause(0.05)
    raise AssertionError(f"clicking {selector} never made the condition hold")
