"""summary.json's ``explain`` section and report.md's "Each run explained": per run, the memory formula
evaluated (predicted beside measured), the step's communication phase by phase (theory beside the profiled
step) and a text picture of the profiled step. ``shardscope explain STRATEGY DIR`` and the app read the
same entries, so their numbers are summary.json's. Pure Python, no torch.
"""

from __future__ import annotations

from typing import Any

from shardscope import config
from shardscope.config import Comparison
from shardscope.profiling import comm_theory, phases, traces
from shardscope.analysis import explain
from shardscope.core.rundir import RunDir


def section(c: Comparison, data: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """Return {run name: ``explain.run_entry``} for every run of ``c``; ``data`` is the summary so far
    (its ``memory`` and ``communication`` sections). A run whose figures cannot be computed gets
    ``{"error": reason}``."""
    out: dict[str, Any] = {}
    mem_runs = (data.get("memory") or {}).get("runs") or {}
    comm_runs = (data.get("communication") or {}).get("runs") or {}
    for run in c.runs:
        try:
            comm = comm_runs.get(run.name) or {}
            theory = comm.get("theory") or comm_theory.expected_comm(
                config.run_spec_payload(c, run, out_dir=out_dir, device="cpu"))
            paths = traces.rank_trace_paths(RunDir(out_dir).run(run.name).path)
            steps = phases.run_phases(c, run, theory, paths[0] if paths else None)
            memory = mem_runs.get(run.name) or {}
            out[run.name] = explain.run_entry(c, run, {} if "error" in memory else memory, comm, steps)
        except (KeyError, ValueError, OSError) as err:
            out[run.name] = {"error": str(err)}
    return out


def markdown(section_: dict[str, Any], out_dir: str = "DIR") -> str:
    """report.md's "Each run explained" section (empty without entries)."""
    if not section_:
        return ""
    out = ["## Each run explained\n"]
    for name, entry in section_.items():
        out.append(f"### {name} ({entry.get('strategy', '?')})\n")
        if "error" in entry:
            out.append(f"Not explained: {entry['error']}\n")
            continue
        out.append(f"- {entry['memory']}")
        out += entry["sequence"]
        if entry.get("timeline"):
            out.append("\n```text\n" + entry["timeline"] + "\n```")
        out.append(f"\nThe whole explainer: `shardscope explain {entry['strategy']} {out_dir} --run {name}`\n")
    return "\n".join(out) + "\n"
