"""The one fold of a run directory's files into run states, after the fact.

``replay_updates`` turns ``<out>``'s files into the same updates a live session publishes, and
``replay_states`` folds them with ``state.fold`` (the fold the live session and the app use), so a
report rebuilt from files (``shardscope report DIR``, ``diff``) and the app replaying a directory
(``orchestrator/replay.py``) see the same run states the live session saw. Torch-free.
"""

from __future__ import annotations

import dataclasses

import json
import os
import time
from typing import Any

from shardscope.core import liveness
from shardscope.config import MAX_NAME, NAME_RE, Comparison
from shardscope.core.events import ORCHESTRATOR_LOST, read_records
from shardscope.profiling import state
from shardscope.analysis.root_cause import root_cause
from shardscope.profiling.state import RunState, Update
from shardscope.core.numbers import read_json
from shardscope.core.rundir import RunDir, RunFiles, read_json_or_none, tail_text


def load_comparison(out_dir: str) -> Comparison:
    """Return the Comparison saved in ``<out_dir>/comparison.json``; raises FileNotFoundError or ValueError (a file
    that is not a comparison, or whose run names could name a path: each must be a name a preset could give)."""
    data = read_json(RunDir(out_dir).comparison)
    if not isinstance(data, dict) or not isinstance(data.get("runs", []), list):
        raise ValueError(f"{RunDir(out_dir).comparison}: not a comparison (a JSON object with a list of runs)")
    try:
        c = Comparison.from_dict(data)
    except TypeError as err:  # a field of the wrong shape: one line, never a traceback
        raise ValueError(f"{RunDir(out_dir).comparison}: not a comparison ({err})") from None
    for run in c.runs:
        if not isinstance(run.name, str) or not NAME_RE.match(run.name) or len(run.name) > MAX_NAME:
            raise ValueError(f"{RunDir(out_dir).comparison}: run name {str(run.name)[:40]!r} is not a run name "
                             "(letters, digits, '.', '_', '-'): refused, it would name a path")
    # whatever the file says: this model came from a run directory, and its code runs only if the user names it
    # again (presets/trust.py); the model check's import_root from the file never reaches sys.path
    from shardscope.presets import trust

    described = dict(c.model.described)
    if not trust.is_trusted(out_dir):
        described.pop("import_root", None)
    return dataclasses.replace(c, model=dataclasses.replace(c.model, from_run_dir=os.path.abspath(out_dir),
                                                            described=described))


def _status_from_files(files: RunFiles, records: list[dict[str, Any]], summary: dict[str, Any] | None,
                       name: str) -> state.StatusChanged:
    verdict = read_json_or_none(files.status)  # what the orchestrator decided
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
    if lost or (not ranks <= ended or not records) and liveness.orchestrator_state(os.path.dirname(files.path)) == "lost":
        # No verdict, no summary, no end (or an end saying so): whoever decided this run is gone.
        return state.StatusChanged(name, state.STOPPED, ORCHESTRATOR_LOST if records else
                                   f"{ORCHESTRATOR_LOST} before it started", tail_text(files.console(), 20))
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
                               tail_text(files.console(), 20))


def replay_updates(out_dir: str) -> list[Update]:
    """Return every update a live session would have published for ``out_dir``, in order."""
    comparison = load_comparison(out_dir)
    out = RunDir(out_dir)
    summary = read_json_or_none(out.summary)
    summary = summary if isinstance(summary, dict) else None
    updates: list[Update] = []
    for run in comparison.runs:
        files = out.run(run.name)
        spec = read_json_or_none(files.spec) or {}
        resolved = spec.get("run", {})
        updates.append(state.RunDefined(
            run=run.name, strategy=run.strategy,
            world_size=int(resolved.get("world_size") or run.world_size or comparison.world_size),
            steps_total=run.steps or comparison.steps,
            precision=resolved.get("precision") or run.precision or comparison.precision,
            options=resolved.get("options") or dict(run.options), run_dir=files.path,
        ))
        records: list[dict[str, Any]] = []
        invalid = 0
        for path in files.rank_files():
            recs, bad = read_records(path)
            records.extend(recs)
            invalid += bad
        records.sort(key=lambda r: (r.get("t", 0.0), r.get("rank", 0)))
        if records:
            updates.append(state.StatusChanged(run.name, state.STARTING, t=records[0].get("t", time.time())))
            updates.append(state.RecordsArrived(run.name, tuple(records), invalid))
        console = tail_text(files.console(), 400)
        if console:
            updates.append(state.ConsoleText(run.name, console + "\n"))
        final = _status_from_files(files, records, summary, run.name)
        end_t = records[-1].get("t", time.time()) if records else time.time()
        updates.append(state.StatusChanged(final.run, final.status, final.error, final.traceback, t=end_t))
    updates.extend(device_samples(out_dir))
    if summary is not None:
        code = 0 if summary.get("all_ok") else 1
        updates.append(state.ComparisonFinished(out_dir, code, out.summary, out.report if os.path.exists(out.report) else ""))
    return updates


def device_samples(out_dir: str) -> list[state.DeviceSample]:
    """Return every device sample recorded in ``<out_dir>/devices.jsonl`` (unreadable lines skipped)."""
    try:
        with open(RunDir(out_dir).devices(), encoding="utf-8") as fh:
            lines = fh.readlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            data = json.loads(line)
            readings = tuple(state.DeviceReading(**{**r, "ranks": tuple(r.get("ranks", ()))}) for r in data["readings"])
            out.append(state.DeviceSample(readings, str(data.get("source", "")), float(data.get("t", 0.0))))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError):
            continue  # a line of another shape (a damaged or crafted file): skipped
    return out


def replay_states(out_dir: str) -> dict[str, RunState]:
    """Return the run states folded from ``out_dir``'s files alone."""
    states: dict[str, RunState] = {}
    state.fold(replay_updates(out_dir), states)
    return states
