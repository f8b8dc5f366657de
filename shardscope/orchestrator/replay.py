"""Replay a run directory's files as the same updates a live ``Session`` publishes.

Used by ``shardscope open DIR`` (the app on a finished or interrupted comparison), by
``shardscope report DIR`` (rebuilding run states from files alone) and by tests, which can
replay a recorded directory instead of launching torchrun.
"""

from __future__ import annotations

import glob
import json
import os
import threading
import time
from typing import Any, Callable

from shardscope.config import Comparison
from shardscope.events import ORCHESTRATOR_LOST, read_records
from shardscope.orchestrator import lifeline, state
from shardscope.orchestrator.completion import Completion
from shardscope.orchestrator.root_cause import root_cause
from shardscope.orchestrator.state import RunState, Update
from shardscope.orchestrator.tail import tail_text


def load_comparison(out_dir: str) -> Comparison:
    """Return the Comparison saved in ``<out_dir>/comparison.json``; raises FileNotFoundError or ValueError."""
    path = os.path.join(out_dir, "comparison.json")
    with open(path, encoding="utf-8") as fh:
        return Comparison.from_dict(json.load(fh))


def used_out_dir_error(out_dir: str) -> str:
    """Return one line refusing ``out_dir`` when it already holds a comparison ("" when it is free):
    a new comparison there would reuse its shared initial weights and mix its files."""
    if os.path.exists(os.path.join(out_dir, "comparison.json")):
        return f"{out_dir}: already holds a comparison; choose a new directory (or open it with `shardscope open`)"
    return ""


def _status_from_files(run_dir: str, records: list[dict[str, Any]], summary: dict[str, Any] | None, name: str) -> state.StatusChanged:
    verdict = _read_json(os.path.join(run_dir, "status.json"))  # what the orchestrator decided
    if isinstance(verdict, dict) and verdict.get("status") in state.FINISHED:
        return state.StatusChanged(name, verdict["status"], verdict.get("error", ""), verdict.get("traceback", ""))
    if summary:
        for entry in summary.get("runs", []):
            if entry.get("name") == name:
                return state.StatusChanged(name, entry.get("status", state.STOPPED), entry.get("error", ""),
                                           entry.get("traceback_tail", ""))
    errors = [r for r in records if r.get("kind") == "error"]
    ends = [r for r in records if r.get("kind") == "end"]
    lost = any(e.get("reason") == ORCHESTRATOR_LOST for e in ends)
    ranks = {r.get("rank") for r in records}
    ended = {e.get("rank") for e in ends}
    if lost or (not ranks <= ended or not records) and lifeline.orchestrator_state(os.path.dirname(run_dir)) == "lost":
        # No verdict, no summary, no end (or an end saying so): whoever decided this run is gone.
        return state.StatusChanged(name, state.STOPPED, ORCHESTRATOR_LOST if records else
                                   f"{ORCHESTRATOR_LOST} before it started", tail_text(os.path.join(run_dir, "console.log"), 20))
    if errors:
        return state.StatusChanged(name, state.FAILED, *root_cause(errors))
    if ends and ranks <= ended and any(e.get("status") == state.DIVERGED for e in ends):
        step = min(e.get("first_nonfinite_step", 0) for e in ends if e.get("status") == state.DIVERGED)
        return state.StatusChanged(name, state.DIVERGED, f"non-finite loss or grad norm at step {step}")
    if ends and ranks <= ended and all(e.get("status") == "ok" for e in ends):
        return state.StatusChanged(name, state.OK)
    if not records:
        return state.StatusChanged(name, state.STOPPED, "no records: the run never started")
    return state.StatusChanged(name, state.STOPPED, "interrupted: no end record",
                               tail_text(os.path.join(run_dir, "console.log"), 20))


def replay_updates(out_dir: str) -> list[Update]:
    """Return every update a live session would have published for ``out_dir``, in order."""
    comparison = load_comparison(out_dir)
    summary_path = os.path.join(out_dir, "summary.json")
    summary = _read_json(summary_path)
    summary = summary if isinstance(summary, dict) else None
    updates: list[Update] = []
    for run in comparison.runs:
        run_dir = os.path.join(out_dir, run.name)
        spec = _read_json(os.path.join(run_dir, "spec.json")) or {}
        resolved = spec.get("run", {})
        updates.append(state.RunDefined(
            run=run.name, strategy=run.strategy,
            world_size=int(resolved.get("world_size") or run.world_size or comparison.world_size),
            steps_total=comparison.steps,
            precision=resolved.get("precision") or run.precision or comparison.precision,
            options=resolved.get("options") or dict(run.options), run_dir=run_dir,
        ))
        records: list[dict[str, Any]] = []
        invalid = 0
        for path in sorted(glob.glob(os.path.join(run_dir, "metrics", "rank*.jsonl"))):
            recs, bad = read_records(path)
            records.extend(recs)
            invalid += bad
        records.sort(key=lambda r: (r.get("t", 0.0), r.get("rank", 0)))
        if records:
            updates.append(state.StatusChanged(run.name, state.STARTING, t=records[0].get("t", time.time())))
            updates.append(state.RecordsArrived(run.name, tuple(records), invalid))
        console = tail_text(os.path.join(run_dir, "console.log"), 400)
        if console:
            updates.append(state.ConsoleText(run.name, console + "\n"))
        final = _status_from_files(run_dir, records, summary, run.name)
        end_t = records[-1].get("t", time.time()) if records else time.time()
        updates.append(state.StatusChanged(final.run, final.status, final.error, final.traceback, t=end_t))
    updates.extend(device_samples(out_dir))
    if summary is not None:
        code = 0 if summary.get("all_ok") else 1
        report = os.path.join(out_dir, "report.md")
        updates.append(state.ComparisonFinished(out_dir, code, summary_path, report if os.path.exists(report) else ""))
    return updates


def device_samples(out_dir: str) -> list[state.DeviceSample]:
    """Return every device sample recorded in ``<out_dir>/devices.jsonl`` (unreadable lines skipped)."""
    try:
        with open(os.path.join(out_dir, "devices.jsonl"), encoding="utf-8") as fh:
            lines = fh.readlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            data = json.loads(line)
            readings = tuple(state.DeviceReading(**{**r, "ranks": tuple(r.get("ranks", ()))}) for r in data["readings"])
            out.append(state.DeviceSample(readings, str(data.get("source", "")), float(data.get("t", 0.0))))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def replay_states(out_dir: str) -> dict[str, RunState]:
    """Return the run states folded from ``out_dir``'s files alone."""
    states: dict[str, RunState] = {}
    state.fold(replay_updates(out_dir), states)
    return states


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


class ReplaySource(Completion):
    """A run directory as a source with the ``Session`` API; control calls only post a notice.

    ``speed`` None publishes everything at once; otherwise updates are paced by their record
    timestamps divided by ``speed`` (records are split into small batches so charts animate).
    """

    def __init__(self, out_dir: str, *, speed: float | None = None) -> None:
        self.out_dir = os.path.abspath(out_dir)
        self.comparison = load_comparison(self.out_dir)
        self.run_names = [r.name for r in self.comparison.runs]
        self.speed = speed
        self.exit_code: int | None = None
        self._subscribers: list[Callable[[list[Update]], None]] = []
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def subscribe(self, callback: Callable[[list[Update]], None]) -> None:
        """Receive batches of updates (on the replay thread)."""
        self._subscribers.append(callback)

    def _publish(self, batch: list[Update]) -> None:
        for callback in self._subscribers:
            callback(batch)

    def start(self) -> None:
        """Start publishing the directory's updates on a background thread."""
        self._thread = threading.Thread(target=self._main, name="shardscope-replay", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        updates = replay_updates(self.out_dir)
        if self.speed is None:
            self._publish(updates)
        else:
            for batch, delay in _paced(updates, self.speed):
                time.sleep(delay)
                self._publish(batch)
        finished = [u for u in updates if isinstance(u, state.ComparisonFinished)]
        self.exit_code = finished[0].exit_code if finished else 1
        self._done.set()

    def _notice(self, what: str) -> None:
        self._publish([state.Notice(f"{what}: not possible while replaying {self.out_dir}", "warning")])

    def stop_run(self, name: str) -> None:
        """Replays cannot stop runs; posts a notice."""
        self._notice(f"stop {name}")

    def restart_run(self, name: str) -> None:
        """Replays cannot restart runs; posts a notice."""
        self._notice(f"restart {name}")

    def stop_all(self) -> None:
        """Nothing to stop in a replay."""


def _paced(updates: list[Update], speed: float, chunk: int = 8) -> list[tuple[list[Update], float]]:
    """Split updates into batches with delays following record timestamps / ``speed`` (≤ 0.5 s each)."""
    out: list[tuple[list[Update], float]] = []
    last_t: float | None = None
    for update in updates:
        if isinstance(update, state.RecordsArrived):
            recs = list(update.records)
            for i in range(0, len(recs), chunk):
                part = recs[i:i + chunk]
                t = float(part[0].get("t", 0.0))
                delay = 0.0 if last_t is None else min(0.5, max(0.0, (t - last_t) / speed))
                last_t = t
                out.append(([state.RecordsArrived(update.run, tuple(part), update.invalid_lines)], delay))
        else:
            out.append(([update], 0.0))
    return out
