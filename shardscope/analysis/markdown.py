"""report.md: the text of a comparison's report, rendered from its summary (``render_markdown``): the answer first
(``answer``), then the tables of throughput and loss, memory, communication, parity, traces, stragglers, the
explainers, the prediction and the recommendation. Pure text from summary.json; ``report.write_reports`` writes it.
"""

from __future__ import annotations

import os
from typing import Any

from shardscope.analysis import answer, explain_report, noise, recommend, straggler_report, summary
from shardscope.analysis.predict import report as predict_report
from shardscope.analysis.summary import throughput_unit
from shardscope.analysis.tune import choose as tune_choose
from shardscope.analysis.why import verdict as why
from shardscope.core.numbers import fmt_bytes, fmt_sig, not_measured
from shardscope.core.rundir import CHROME_SUFFIX, TB, TRACES
from shardscope.core.text import clean
from shardscope.profiling import framework_fixes, memory_model


def _num(v: Any, fmt: str = "{:,.0f}") -> str:
    text = "-" if v is None else fmt.format(v)  # a figure that is not zero is never printed as one ("0.000")
    return fmt_sig(v) if v and not text.strip("0.,-") else text


def _table(header: list[str], rows: list[list[str]]) -> str:
    def row(cells: list[str]) -> str:  # a literal "|" in a cell ("max |Δ|") would split it: escape it
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    lines = [row(header), "|" + "|".join("---" for _ in header) + "|"] + [row(r) for r in rows]
    return "\n".join(lines) + "\n"


def _own_accum(s: dict[str, Any]) -> str:
    """" (<run> <n>, ...)" for the runs with their own ``options.grad_accum``, else ""."""
    own = [f"{r['name']} {r['options']['grad_accum']}" for r in s["runs"]
           if isinstance(r.get("options"), dict) and r["options"].get("grad_accum")]
    return f" (a run's own: {', '.join(own)})" if own else ""


def render_markdown(s: dict[str, Any]) -> str:
    """Return report.md's text for a summary dict built by ``write_reports``."""
    out = [f"# shardscope report: {s['preset']}\n", f"{s.get('description', '')}\n" if s.get("description") else "",
           f"Run directory `{s['out_dir']}`, written {s['created']}. Baseline: **{s['baseline']}**. "
           f"Shared: {s['shared']['steps']} steps, global batch {s['shared']['global_batch']}, grad accumulation "
           f"{s['shared']['grad_accum']}{_own_accum(s)}, precision {s['shared']['precision']}, seed {s['shared']['seed']}.\n",
           f"Model: {s['shared']['model_label']}. Data: {s['shared']['data_label']}.\n" if "data_label" in s["shared"] else "",
           answer.markdown(s) if s.get("recommendation") else ""]
    out.append("## Throughput and loss\n")
    rows = []
    unit = throughput_unit(s["runs"])
    for r in s["runs"]:
        rate = r.get("median_tokens_per_s") or r.get("median_samples_per_s")
        rows.append([r["name"] + (" (A/A control)" if r.get("control_of") else ""), r["strategy"], str(r["world_size"]), r["status"], str(r["steps_completed"]),
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
    out.append(_pipeline_md(s))
    out.append(_parity_md(s.get("parity", {})))
    out.append(straggler_report.markdown(s.get("stragglers", {}), _table))
    out.append(_traces_md(s))
    if s.get("plots"):
        out.append("## Plots\n")
        out += [f"![{name}]({path})\n" for name, path in s["plots"].items()]
    out += [explain_report.markdown(s.get("explain") or {}, s.get("out_dir") or "DIR"), predict_report.markdown(s.get("prediction") or {}, noise.line(s.get("noise") or {}) if s.get("noise") else "")]
    out += [recommend.markdown(s.get("recommendation") or {}), why.report_section(s.get("out_dir") or ""),
            tune_choose.report_section(s.get("out_dir") or "")]
    out.append(_record_server_md(s.get("record_server") or {}))
    return "\n".join(x for x in out if x)


def _pipeline_md(s: dict[str, Any]) -> str:
    """The pipeline runs' schedules and bubbles, measured per rank beside theory; "" without a pipeline run."""
    runs = [r for r in s["runs"] if isinstance(r.get("pipeline"), dict)]
    if not runs:
        return ""
    rows, formulas = [], {}
    pct = (lambda v: "not measured" if not isinstance(v, (int, float)) else f"{v:.1%}")  # noqa: E731
    for r in runs:
        p = r["pipeline"]
        rows.append([r["name"], str(p.get("schedule")), f"{p.get('pp')} × {p.get('stages_per_rank')}",
                     str(p.get("microbatches")), pct(p.get("bubble_measured")), pct(p.get("bubble_theory")),
                     " ".join(pct(v) for v in (p.get("bubble_by_rank") or {}).values())])
        formulas[str(p.get("schedule"))] = str(p.get("bubble_formula"))
    return ("## Pipeline: the bubble\n\n" + _table(["run", "schedule", "pp × v (stages per rank)", "m (micro-batches)",
                                                     "bubble measured", "theory", "per rank"], rows)
            + "\nMeasured: the share of each rank's schedule span outside its stages' compute (waiting for an input "
            "or a gradient, and the point-to-point transfers themselves), the median over steps after the first, "
            "outside the profiler's window; the run's figure is the mean over ranks. Theory: "
            + "; ".join(f"{k}: {v}" for k, v in formulas.items())
            + " (p ranks per pipeline, m micro-batches, v stages per rank). On a CPU whose ranks wait for a core, "
            "the waits count as bubble too.\n")


def _record_server_md(rs: dict[str, Any]) -> str:
    """Node 0's record server (records over TCP): what it took, and what it refused by reason and source."""
    if not rs:
        return ""
    out = [f"## Record server\n\nNode 0 wrote {rs.get('written', 0):,} record lines and {rs.get('beats', 0):,} "
           f"heartbeats from other nodes ({rs.get('duplicates', 0):,} resent lines skipped)."]
    refused = sorted((rs.get("refused") or {}).items(), key=lambda kv: -kv[1])
    if refused:
        out.append("Refused: " + "; ".join(f"{n:,} {clean(reason)}" for reason, n in refused) + ".")
    sources = sorted((rs.get("refused_from") or {}).items(), key=lambda kv: -kv[1])
    if sources:
        out.append("Connections that never proved the secret, by source: "
                   + ", ".join(f"{clean(src)} {n:,}" for src, n in sources[:10]) + ".")
    return "\n".join(out) + "\n"


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
