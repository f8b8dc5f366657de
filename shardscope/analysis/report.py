"""Reports of a comparison from its run directory alone: summary.json, report.md, plots, merged trace.

``write_reports(out_dir)`` is the one entry point: the orchestrator calls it when a comparison ends and
``shardscope report DIR`` calls it again later. It reads ``comparison.json``, replays every ``<run>/metrics/rank*.jsonl``
through the fold the live views use, analyses the traces, writes everything. Never torch; trace analysis is JSON.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from shardscope.config import Comparison, dump_json, write_atomic
from shardscope.profiling.state import RunState
from shardscope.core.outspace import describe, disk_error
from shardscope.core.rundir import MERGED_TRACE, PLOTS, REPORT, SUMMARY, TRACES, RunDir, RunFiles, read_json_or_none
from shardscope.analysis import (divergence, explain_report, fold, noise, pipeline_plot, plots, recommend, straggler_report,
                                 summary)
from shardscope.analysis.markdown import render_markdown  # noqa: F401  (report.render_markdown for callers)
from shardscope.analysis.predict import report as predict_report
from shardscope.profiling import framework_fixes, memory_model, traces
from shardscope.core.numbers import median_rate


# --- sections ----------------------------------------------------------------------------------


def _dp_rank(state: RunState, rank: int) -> int:
    start = state.start.get(rank) or state.start.get(0) or {}
    tp = int(start.get("tp") or 1)
    return rank // max(1, tp)


def memory_section(c: Comparison, states: dict[str, RunState]) -> dict[str, Any]:
    """Predicted (memory model) vs measured (exact ``memory`` records) bytes per rank, per run.

    For each run: ``predicted`` (rank 0), ``measured`` (rank 0's latest memory record with its
    peak), ``per_rank`` (predicted vs measured model-state bytes and the error, every rank), and
    ``model_state_error`` (worst relative error over ranks). ``measured_peak_kind`` says what the
    measured peak is: the CUDA allocator's peak or the process's peak RSS on CPU.
    """
    out: dict[str, Any] = {"runs": {}, "measured_peak_kind": "", "activation_basis": memory_model.activation_basis(c)}
    for run in c.runs:
        st = states.get(run.name)
        if st is None:
            continue
        try:
            notes = (st.start.get(0) or {}).get("notes") or {}
            d = memory_model.describe_run(c, run, st.world_size or None, notes)  # with the rank's own facts
            layout, params = d.layout, list(d.params)
            predicted = memory_model.predict_run(c, run, st.world_size or None)
        except (KeyError, ValueError) as err:
            out["runs"][run.name] = {"error": str(err)}
            continue
        per_rank, errors = {}, []
        for rank, rec in sorted(st.memory.items()):
            # the ("dp", "pp") mesh of a pipeline: consecutive ranks form one pipeline
            pred = memory_model.model_state_bytes(params, layout, _dp_rank(st, rank), pp_rank=rank % layout.pp)
            meas = {k: rec.get(k) for k in ("param_bytes", "grad_bytes", "optim_bytes", "model_state_bytes")}
            row: dict[str, Any] = {"predicted": pred, "measured": meas}
            if isinstance(meas["model_state_bytes"], (int, float)) and meas["model_state_bytes"]:
                row["error"] = pred["model_state_bytes"] / meas["model_state_bytes"] - 1
                errors.append(abs(row["error"]))
            per_rank[str(rank)] = row
        measured = None
        rec0 = st.memory.get(0)
        if rec0:
            measured = {k: rec0.get(k) for k in ("param_bytes", "grad_bytes", "optim_bytes", "model_state_bytes")}
            measured["peak_bytes"] = st.peak_mem_bytes
            measured["when"] = rec0.get("when")
            if "mem_alloc_bytes" in rec0:
                out["measured_peak_kind"] = "CUDA allocator"
                measured["reserved_bytes"] = rec0.get("mem_reserved_bytes")
            elif "rss_bytes" in rec0:
                out["measured_peak_kind"] = out["measured_peak_kind"] or "process RSS"
        out["runs"][run.name] = {
            "predicted": predicted,
            "measured": measured,
            "per_rank": per_rank,
            "model_state_error": max(errors) if errors else None,
            "as_shipped": framework_fixes.as_shipped(c, run, st.world_size or None),
        }
    return out


def communication_section(c: Comparison, states: dict[str, RunState], out_dir: str) -> dict[str, Any]:
    """Per-run trace analysis (``traces.analyse_run``) plus MFU where the device's peak is known."""
    out: dict[str, Any] = {"runs": {}}
    fpt = None
    try:
        fpt = memory_model.describe_model(c.model).counted_flops_per_token
    except (KeyError, ValueError):
        pass
    for run in c.runs:
        run_dir = RunDir(out_dir).run(run.name).path
        analysis = traces.analyse_run(run_dir)
        st = states.get(run.name)
        if not analysis:  # nothing was measured: say why instead of showing zeros
            analysis = {"not_measured": comm_not_measured_reason(c, st, run_dir)}
        if st is not None:
            start = st.start.get(0) or {}
            device = analysis.get("device") or str(start.get("device_name") or start.get("device", ""))
            rate = median_rate(st.throughput) if st.unit == "tokens/s" else None
            value = traces.mfu(fpt, rate, st.world_size, device) if fpt and rate else None
            analysis["mfu"] = value
            analysis["mfu_note"] = "" if value is not None else f"no MFU: peak FLOP/s unknown for device {device or '?'}"
        if analysis:
            out["runs"][run.name] = analysis
    out["flops_per_token"] = fpt
    return out


def comm_not_measured_reason(c: Comparison, st: RunState | None, run_dir: str) -> str:
    """Return why a run has no communication figures: profiling off, the run ended before the
    profiler window, or no trace files found."""
    if not c.profile.enabled:
        return "profiling off: profile.enabled = false"
    if st is not None and st.steps_completed <= c.profile.start_step + c.profile.steps:
        return f"the run ended before its profiler window (steps {c.profile.start_step}+{c.profile.steps}) closed"
    return f"no traces found under {os.path.join(RunFiles(run_dir).name, TRACES)}"


def traces_section(c: Comparison, out_dir: str) -> dict[str, Any]:
    """Paths of every run's traces: Chrome JSON per rank and the TensorBoard folder."""
    out = {}
    for run in c.runs:
        files = RunDir(out_dir).run(run.name)
        chrome = traces.rank_trace_paths(files.path)
        tb_files = [os.path.basename(f) for f in files.tb_files()]
        if chrome or tb_files:
            out[run.name] = {"chrome": chrome, "tensorboard_dir": files.tb if tb_files else None,
                             "tensorboard_files": tb_files}
    return out


# --- the entry point ---------------------------------------------------------------------------


class Reports(dict):
    """{label: path} of what ``write_reports`` wrote; ``failed``: what failed, in one line ("" = nothing)."""
    failed: str = ""


def write_reports(out_dir: str, comparison: Comparison | None = None,
                  states: dict[str, RunState] | None = None) -> Reports:
    """Write ``summary.json``, ``report.md``, ``plots/*.png`` and ``merged_trace.json`` for ``out_dir``.

    The one report writer: the session calls it when a comparison ends, ``shardscope report DIR`` from
    files alone. Everything is rebuilt from the directory's files (the same fold as live), so both give
    the same report. Should the full report fail (a bug, a full disk), the core summary is written from
    ``comparison`` and ``states`` (folded from files when not given), so a summary always exists; the
    result's ``failed`` then names what failed (the commands exit 1). Returns {"summary", "report", "plots",
    "merged_trace"} -> paths ("merged_trace" only when some run has traces; only "summary" after the
    fallback). Raises OSError or ValueError when ``comparison.json`` cannot be read and no comparison was given."""
    stage = ["reading the run directory"]
    try:
        return _full_reports(out_dir, stage)
    except Exception as err:  # noqa: BLE001 - any failure of the full report falls back to the core summary
        disk = disk_error(err)
        why = describe(disk) if disk is not None else repr(err)
        print(f"shardscope: full report failed ({stage[0]}), writing the core summary: {why}", file=sys.stderr)
    comparison = comparison or fold.load_comparison(out_dir)
    states = states if states is not None else fold.replay_states(out_dir)
    path = RunDir(out_dir).summary
    dump_json(path, summary.build_summary(comparison, states, out_dir))
    (done := Reports(summary=path)).failed = f"full report failed ({stage[0]}): {why}"
    return done


def record_server_section(out_dir: str) -> dict[str, Any]:
    """What node 0's record server refused and took (records over TCP; {} without one): its
    ``nodes/record_server.json``, counts kept only where they are counts."""
    raw = read_json_or_none(RunDir(out_dir).record_server_stats())
    if not isinstance(raw, dict):
        return {}

    def counts(value: Any) -> dict[str, int]:
        return {str(k)[:200]: v for k, v in (value.items() if isinstance(value, dict) else ())
                if type(v) is int and v >= 0}
    return {"refused": counts(raw.get("refused")), "refused_from": counts(raw.get("refused_from")),
            **{k: raw[k] for k in ("written", "duplicates", "beats") if type(raw.get(k)) is int}}


def _full_reports(out_dir: str, stage: list[str]) -> Reports:  # stage[0]: what it is doing, to name a failure
    c = fold.load_comparison(out_dir)
    states = fold.replay_states(out_dir)
    data = summary.build_summary(c, states, out_dir)
    for key, build in (("memory", lambda: memory_section(c, states)),
                       ("communication", lambda: communication_section(c, states, out_dir)),
                       ("parity", lambda: divergence.parity_section(c, states, {
                           name: divergence.read_layers(RunDir(out_dir).run(name).path) for name in states})),
                       ("traces", lambda: traces_section(c, out_dir)),
                       ("stragglers", lambda: straggler_report.section(states, data["communication"]["runs"])),
                       ("explain", lambda: explain_report.section(c, data, out_dir)),
                       ("noise", lambda: noise.section(c, states, data["stragglers"])),
                       ("recommendation", lambda: recommend.section(c, states, data)), ("prediction", lambda: predict_report.section(c, states, out_dir)),
                       ("record_server", lambda: record_server_section(out_dir))):
        stage[0] = f"the {key} section"
        data[key] = build()
    stage[0] = "writing the files"
    out = RunDir(out_dir)
    paths = Reports(summary=out.summary, report=out.report)
    dump_json(paths["summary"], data)  # the figures first: on a disk that fills, the summary is what must exist
    try:
        if data["traces"]:
            merged = traces.write_merged_trace({n: t["chrome"] for n, t in data["traces"].items() if t["chrome"]},
                                               out.merged_trace)
            data["merged_trace"] = merged
            paths["merged_trace"] = merged
        if os.path.islink(out.plots) and not out.contains(out.plots):
            print(f"shardscope: {out.plots} is a link out of {out_dir}: plots not written", file=sys.stderr)
        else:
            losses = {name: st.losses for name, st in states.items()}
            made = plots.write_plots(data, losses, out.plots)
            timing = straggler_report.plot(states, out.plot("rank_timing"))
            made.update({"rank_timing": timing} if timing else {})
            made.update(pipeline_plot.write_timelines(data, out.plots))
            data["plots"] = {k: os.path.relpath(v, out_dir) for k, v in made.items()}
            paths["plots"] = out.plots
        dump_json(paths["summary"], data)
        write_atomic(paths["report"], lambda fh: fh.write(render_markdown(data)))
    except OSError as err:
        disk = disk_error(err)
        if disk is None:
            raise
        # summary.json (written above) stays; what did not fit is named, nothing partial is left.
        print(f"shardscope: {describe(disk)}: {SUMMARY} is written; not all of {REPORT}, {PLOTS}/ and "
              f"{MERGED_TRACE} are", file=sys.stderr)
        written = Reports({k: v for k, v in paths.items() if os.path.exists(v)})
        written.failed = f"{describe(disk)}: not all of {REPORT}, {PLOTS}/ and {MERGED_TRACE} are written"
        return written
    return paths
