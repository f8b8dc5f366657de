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
from shardscope.core.rundir import CHROME_SUFFIX, MERGED_TRACE, PLOTS, REPORT, SUMMARY, TB, TRACES, RunDir, RunFiles
from shardscope.analysis import divergence, explain_report, fold, noise, plots, recommend, straggler_report, summary
from shardscope.analysis.predict import report as predict_report
from shardscope.analysis.why import verdict as why
from shardscope.profiling import framework_fixes, memory_model, traces
from shardscope.core.numbers import fmt_bytes, fmt_sig, median_rate, not_measured
from shardscope.analysis.summary import throughput_unit


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
            layout = memory_model.layout_for(c, run, st.world_size or None, notes)
            predicted = memory_model.predict_run(c, run, st.world_size or None)
            params = memory_model.model_params(c.model)
        except (KeyError, ValueError) as err:
            out["runs"][run.name] = {"error": str(err)}
            continue
        per_rank, errors = {}, []
        for rank, rec in sorted(st.memory.items()):
            pred = memory_model.model_state_bytes(params, layout, _dp_rank(st, rank))
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
        fpt = memory_model.flops_per_token(c.model)
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
                       ("recommendation", lambda: recommend.section(c, states, data)), ("prediction", lambda: predict_report.section(c, states, out_dir))):
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


# --- report.md -----------------------------------------------------------------------------------


def _num(v: Any, fmt: str = "{:,.0f}") -> str:
    text = "-" if v is None else fmt.format(v)  # a figure that is not zero is never printed as one ("0.000")
    return fmt_sig(v) if v and not text.strip("0.,-") else text


def _table(header: list[str], rows: list[list[str]]) -> str:
    def row(cells: list[str]) -> str:  # a literal "|" in a cell ("max |Δ|") would split it: escape it
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    lines = [row(header), "|" + "|".join("---" for _ in header) + "|"] + [row(r) for r in rows]
    return "\n".join(lines) + "\n"


def render_markdown(s: dict[str, Any]) -> str:
    """Return report.md's text for a summary dict built by ``write_reports``."""
    out = [f"# shardscope report: {s['preset']}\n", f"{s.get('description', '')}\n" if s.get("description") else "",
           f"Run directory `{s['out_dir']}`, written {s['created']}. Baseline: **{s['baseline']}**. "
           f"Shared: {s['shared']['steps']} steps, global batch {s['shared']['global_batch']}, grad accumulation "
           f"{s['shared']['grad_accum']}, precision {s['shared']['precision']}, seed {s['shared']['seed']}.\n",
           f"Model: {s['shared']['model_label']}. Data: {s['shared']['data_label']}.\n" if "data_label" in s["shared"] else ""]
    out.append("## Throughput and loss\n")
    rows = []
    unit = throughput_unit(s["runs"])
    for r in s["runs"]:
        rate = r.get("median_tokens_per_s") or r.get("median_samples_per_s")
        rows.append([r["name"], r["strategy"], str(r["world_size"]), r["status"], str(r["steps_completed"]),
                     _num(r["final_loss"], "{:.4f}"), _num(rate), _num(r["speedup"], "×{:.2f}"),
                     fmt_bytes(r["peak_mem_bytes"]), _num(r["mem_ratio"], "×{:.2f}"),
                     _num(r["loss_max_abs_diff"], "{:.2e}")])
    out.append(_table(["run", "strategy", "ranks", "status", "steps", "final loss", f"median {unit}", "speedup",
                       *summary.memory_headers(s["runs"]), "max |Δloss|"], rows))
    out.append("Throughput is the median over steps, leaving out step 0 and the profiled steps. ")
    for r in s["runs"]:
        if r.get("fairness_flags"):
            out.append(f"\n- **{r['name']} is not like-for-like**: {'; '.join(r['fairness_flags'])}")
        if r.get("error"):
            out.append(f"\n- **{r['name']} {r['status']}**: {r['error']}")
    out.append("\n")
    out.append(_loss_md(s))
    out.append(_memory_md(s.get("memory", {})))
    out.append(_comm_md(s.get("communication", {})))
    out.append(_parity_md(s.get("parity", {})))
    out.append(straggler_report.markdown(s.get("stragglers", {}), _table))
    out.append(_traces_md(s))
    if s.get("plots"):
        out.append("## Plots\n")
        out += [f"![{name}]({path})\n" for name, path in s["plots"].items()]
    out += [explain_report.markdown(s.get("explain") or {}, s.get("out_dir") or "DIR"), predict_report.markdown(s.get("prediction") or {})]
    out += [recommend.markdown(s.get("recommendation") or {}), why.report_section(s.get("out_dir") or "")]
    return "\n".join(x for x in out if x)


def _loss_md(s: dict[str, Any]) -> str:
    """Loss statistics per run and |difference| from the baseline at common steps."""
    rows = [[r["name"], *(_num(r.get(k), "{:.4f}") for k in ("initial_loss", "final_loss", "min_loss", "mean_loss")),
             *(_num(r.get(k), "{:.2e}") for k in ("loss_max_abs_diff", "loss_mean_abs_diff", "loss_final_abs_diff"))]
            for r in s["runs"]]
    return ("## Loss statistics\n\n" + _table(["run", "initial", "final", "min", "mean", f"max |Δ| vs {s['baseline']}",
                                               "mean |Δ|", "final |Δ|"], rows)
            + "Differences are taken at the steps both runs completed.\n")


def _memory_md(m: dict[str, Any]) -> str:
    if not m.get("runs"):
        return ""
    rows = []
    for name, r in m["runs"].items():
        if "error" in r:
            rows.append([name, r["error"]] + [""] * 7)
            continue
        p, meas = r["predicted"], r.get("measured") or {}
        rows.append([name, f"{memory_model.layout_label(p)} ({p['shards']})",
                     f"{fmt_bytes(p['param_bytes'])} / {fmt_bytes(meas.get('param_bytes'))}",
                     f"{fmt_bytes(p['grad_bytes'])} / {fmt_bytes(meas.get('grad_bytes'))}",
                     f"{fmt_bytes(p['optim_bytes'])} / {fmt_bytes(meas.get('optim_bytes'))}",
                     f"{fmt_bytes(p['model_state_bytes'])} / {fmt_bytes(meas.get('model_state_bytes'))}",
                     _num(r.get("model_state_error"), "{:.2%}"),
                     fmt_bytes(p["activation_bytes"] + p["gathered_unit_bytes"]), fmt_bytes(meas.get("peak_bytes"))])
    kind = m.get("measured_peak_kind") or "measured"
    fixes = "".join(framework_fixes.note_md(name, r["predicted"], r.get("as_shipped"))
                    for name, r in m["runs"].items() if "error" not in r)
    return ("## Memory per rank: predicted / measured\n\n"
            + _table(["run", "dp×tp (shards)", "params", "grads", "optimizer", "model states", "worst error",
                      "pred. activations+gathered", f"peak ({kind})"], rows)
            + "\nModel states are measured exactly from the tensors each rank holds (rank 0 shown; the error is the "
              f"worst over ranks). Predicted {m.get('activation_basis') or 'activations per Korthikanti et al.'}; on "
              "CPU the measured peak is the process's peak RSS, which also holds the Python runtime and libraries.\n"
            + (f"\n{fixes}" if fixes else ""))


def _comm_md(comm: dict[str, Any]) -> str:
    runs = comm.get("runs") or {}
    if not runs:
        return "## Communication\n\nNot measured: no run was analysed.\n"
    rows, steps, unmeasured = [], [], []  # unmeasured: figures the traces cannot give, with why (never 0)
    missing = {name: c["not_measured"] for name, c in runs.items() if c.get("not_measured")}
    runs = {name: c for name, c in runs.items() if name not in missing}
    gaps = "".join(f"- {name}: {not_measured(reason)}\n" for name, reason in missing.items())
    if not runs:
        return "## Communication\n\n" + gaps
    for name, c in runs.items():
        for kind, row in (c.get("collectives") or {}).items():
            size, group = row["bytes_per_step"], row.get("group_size") or "/".join(
                [*map(str, row.get("group_sizes") or []), *(["?"] if row.get("unknown_groups") else [])])
            rows.append([name, kind, _num(row["count_per_step"], "{:.1f}"), _num(size and size / 2**20, "{:,.3f}"),
                         _num(row["time_per_step_s"] * 1e3, "{:.3f}"), _num(row["algbw_GBps"], "{:.3f}"),
                         _num(row["busbw_GBps"], "{:.3f}"), str(group or "-"), row["dtype"] or "-", row["timed_by"]])
            unmeasured += [f"- {name} {kind} {key}: {not_measured(why)}\n" for key, why in row.get("not_measured", {}).items()]
        ps = c.get("per_step") or {}
        theory = c.get("theory") or {}
        ratio = theory.get("ratio")
        ms = {k: None if ps.get(k) is None else ps[k] * 1e3  # not measured stays "-", never 0
              for k in ("step_time_s", "compute_time_s", "comm_time_s", "exposed_comm_s")}
        observed = c.get("comm_bytes_per_step")
        steps.append([name, _num(ms["step_time_s"], "{:.2f}"), _num(ms["compute_time_s"], "{:.2f}"),
                      _num(ms["comm_time_s"], "{:.2f}"), _num(ms["exposed_comm_s"], "{:.2f}"),
                      _num(None if observed is None else observed / 2**20, "{:,.3f}"),
                      f"{theory['bytes_per_step'] / 2**20:,.3f}" if theory.get("bytes_per_step") else "-",
                      _num(ratio, "{:.3f}"), _num(c.get("mfu"), "{:.1%}")])
    text = ["## Communication\n\n", gaps + "\n" if gaps else "",
            _table(["run", "collective", "count/step", "MiB/step", "ms/step", "algbw GB/s", "busbw GB/s", "group",
                    "dtype", "timed by"], rows),
            "".join(["\n", *unmeasured]) if unmeasured else "",
            "\nSizes as nccl-tests counts them (all-gather: gathered output; reduce-scatter: full input); busbw = "
            "algbw × 2(n−1)/n for all-reduce, × (n−1)/n for all-gather and reduce-scatter.\n\n",
            _table(["run", "step ms", "compute ms", "comm ms", "exposed comm ms", "observed MiB/step",
                    "theory MiB/step", "observed/theory", "MFU"], steps),
            "\nPer profiled step, mean over ranks. Exposed communication is communication time not overlapped by "
            "compute (GPU kernels; on CPU, the training thread's operators). Theory: "]
    bases = {c.get("theory", {}).get("basis") for c in runs.values() if c.get("theory")}
    text.append("; ".join(sorted(b for b in bases if b)) or "-")
    notes = {c.get(key) for c in runs.values() for key in ("mfu_note", "note") if c.get(key)}
    if notes:
        text.append(". " + "; ".join(sorted(notes)))
    text.append(".\n")
    reasons = [(name, r) for name, c in runs.items() for r in (c.get("theory") or {}).get("reasons") or []]
    if reasons:  # where a strategy legitimately moves more or less than the textbook formula, say why
        text.append("\nWhere the theory departs from the textbook formula:\n\n")
        text.extend(f"- {name}: {reason}\n" for name, reason in reasons)
    return "".join(text)


def _parity_md(p: dict[str, Any]) -> str:
    runs = p.get("runs") or {}
    own = {n: b for n, b in (p.get("first_nonfinite_grad_layer") or {}).items() if n not in runs}
    if not runs and not own:
        return ""
    lines = [f"## Parity against {p['baseline']} (loss tolerance {p['tolerance']:g})\n"]
    lines += [f"- **{n}**: first non-finite gradient at step {b['step']} in {b['layer']} ({b['norm']})."
              for n, b in own.items()]
    for name, e in runs.items():
        lines.append(f"- **{name}**: {e['finding']}")
        for cause in e["likely_causes"][1:4]:
            lines.append(f"  - also: {cause}")
    return "\n".join(lines) + "\n"


def _traces_md(s: dict[str, Any]) -> str:
    t = s.get("traces") or {}
    if not t:
        return ""
    lines = ["## Traces\n"]
    for name, paths in t.items():
        chrome = [os.path.relpath(p, s["out_dir"]) for p in paths["chrome"]]
        line = f"- {name}: "
        if len(chrome) > 1:
            line += f"{len(chrome)} rank traces `{os.path.dirname(chrome[0])}/rank<R>{CHROME_SUFFIX}`"
        elif chrome:
            line += f"`{chrome[0]}`"
        if paths.get("tensorboard_dir"):
            line += f"; TensorBoard: `{os.path.relpath(paths['tensorboard_dir'], s['out_dir'])}/`"
        lines.append(line)
    if s.get("merged_trace"):
        lines.append(f"\nAll runs in one timeline (one process per run, one thread per rank, aligned at the first "
                     f"profiled step): `{os.path.relpath(s['merged_trace'], s['out_dir'])}`. Open it, or any rank's "
                     f"trace, at https://ui.perfetto.dev (Open trace file) or chrome://tracing.")
    lines.append(f"\nTensorBoard's profiler plugin (`pip install torch-tb-profiler`): `tensorboard --logdir "
                 f"{s['out_dir']}` lists every run's `{TRACES}/{TB}` folder as a run (or give one run's folder), then "
                 f"open the PYTORCH_PROFILER tab; each rank is a worker.")
    return "\n".join(lines) + "\n"
