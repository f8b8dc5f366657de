"""Per-rank step timing in the report: the summary section, its markdown and a plot.

Reads what the fold gathered in each run's ``StragglerWatch`` (``profiling/stragglers.py``), and each
run's trace analysis (``traces.analyse_run``: every rank's compute per profiled step), which judges
stragglers where the live signal cannot (GPU runs; ``from_traces``).
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from shardscope.profiling.state import RunState
from shardscope.profiling import stragglers
from shardscope.profiling.stragglers import BUSY, CPU_WAIT, PHASE_KEYS

NOT_MEASURED = "not measured: the ranks' step records carry no step timing (records from before it)"
# engines/step_clock.py: CUDA events time the stream, whose phases include the waits for collectives.
NOT_JUDGED = ("stragglers not judged live: busy and idle are not measured on CUDA (the phases are stream times "
              "from CUDA events and include the waits for collectives, so a rank's own work cannot be told from "
              "its waiting); the traces' compute kernels judge them once the profiler window is written")
STREAM = ("time_data_s", "time_forward_s", "time_backward_s", "time_optimizer_s")


def section(states: dict[str, RunState], comm_runs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return ``{run: {threshold, window, flagged: [...], per_rank: {rank: {host, device, busy_s,
    time_*_s}}, trace: {...}}}``; a run without timing has ``per_rank`` None and a ``reason``.

    ``comm_runs``: the communication section's runs (``traces.analyse_run``); where a run's traces give
    each rank's compute time, ``trace`` judges stragglers from it too (``from_traces``).
    """
    out: dict[str, Any] = {}
    for name, st in states.items():
        watch = st.stragglers
        entry: dict[str, Any] = {"threshold": watch.threshold, "window": watch.window, "flagged": []}
        traced = from_traces(name, st, (comm_runs or {}).get(name) or {}, watch.threshold)
        if traced:
            entry["trace"] = traced
        if not watch.timing:
            entry.update(per_rank=None, reason=NOT_MEASURED)
            out[name] = entry
            continue
        entry["per_rank"] = {str(rank): {"host": (st.start.get(rank) or {}).get("host"),
                                         "device": (st.start.get(rank) or {}).get("device"), **figures}
                             for rank, figures in watch.per_rank().items()}
        if all(r.get(BUSY) is None for r in entry["per_rank"].values()):
            entry["reason"] = NOT_JUDGED
        for s in watch.flagged.values():
            start = st.start.get(s.rank) or {}
            entry["flagged"].append({"rank": s.rank, "host": start.get("host"), "device": start.get("device"),
                                     "from_step": s.from_step, "ratio": s.ratio, "steps": s.steps,
                                     "line": stragglers.describe(name, s, start, watch.threshold)})
        out[name] = entry
    return out


CPU_TRACES = ("not judged from CPU traces: an operator's wall time there includes time the rank was "
              "descheduled; the live busy time (CPU time) judges CPU runs")


def from_traces(name: str, st: RunState, analysis: dict[str, Any], threshold: float) -> dict[str, Any] | None:
    """Each rank's compute time per profiled step in its trace (GPU: its non-NCCL kernels; CPU: its
    operators minus its waits in collectives): ``{steps, source, compute_s: {rank: s}, flagged: [{rank,
    host, device, ratio, line}], note}``; None with fewer than two ranks' figures. Judged on GPU traces
    (kernel time is the device's own work, whatever the host did): the live signal cannot judge there."""
    compute = {int(r): v for r, v in (analysis.get("per_rank_compute_s") or {}).items()}
    if len(compute) < 2:
        return None
    steps, source = analysis.get("steps_profiled"), analysis.get("compute_source", "cpu-operators")
    out: dict[str, Any] = {"steps": steps, "source": source, "flagged": [], "note": "",
                           "compute_s": {str(r): v for r, v in sorted(compute.items())}}
    if source != "gpu-kernels":
        out["note"] = CPU_TRACES
        return out
    for rank, value in sorted(compute.items()):
        peers = statistics.median(v for r, v in compute.items() if r != rank)
        ratio = value / peers if peers > 0 else (float("inf") if value > 0 else 1.0)
        if ratio > threshold:
            start = st.start.get(rank) or {}
            where = ", ".join(str(x) for x in (start.get("host"), start.get("device"), start.get("device_name")) if x)
            out["flagged"].append({"rank": rank, "host": start.get("host"), "device": start.get("device"),
                                   "ratio": ratio, "line": f"straggler (traces, {steps} profiled steps): {name} rank "
                                   f"{rank}" + (f" ({where})" if where else "")
                                   + f": compute {ratio:.2f}x its peers' median (threshold {threshold:g}x)"})
    return out


def traced_ranks(st: RunState, analysis: dict[str, Any] | None) -> tuple[int, ...]:
    """The ranks of ``st``'s run flagged from its traces' compute (GPU traces), for the live views."""
    traced = from_traces(st.name, st, analysis or {}, st.stragglers.threshold)
    return tuple(f["rank"] for f in traced["flagged"]) if traced else ()


def _sentence(text: str) -> str:
    """``text`` as a sentence of the report: a capital first letter and a full stop."""
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def _ms(v: Any) -> str:
    return "-" if v is None else f"{1000 * v:.1f}"


def rows(entry: dict[str, Any]) -> list[list[str]]:
    """Table rows (rank, host, device, busy ms, phase ms...) of one run's section entry."""
    flagged = {f["rank"] for f in entry.get("flagged", [])}
    return [[rank + (" ⚠" if int(rank) in flagged else ""), str(r.get("host") or "-"), str(r.get("device") or "-"),
             *(_ms(r.get(k)) for k in (BUSY, *PHASE_KEYS, CPU_WAIT))]
            for rank, r in (entry.get("per_rank") or {}).items()]


HEADER = ["rank", "host", "device", "busy ms", "data ms", "forward ms", "backward ms", "optimizer ms", "idle ms",
          "core wait ms"]
CONTENDED = 0.10  # a run whose ranks waited for a core this share of the time they wanted one is said to have


def core_wait_share(entry: dict[str, Any]) -> float | None:
    """The share of the time a run's ranks wanted a core that they waited for one (medians, over ranks):
    wait / (busy + wait); None where the records carry no run-queue wait."""
    ranks = [r for r in (entry.get("per_rank") or {}).values() if r.get(CPU_WAIT) is not None and r.get(BUSY)]
    if not ranks:
        return None
    wait = sum(r[CPU_WAIT] for r in ranks)
    return wait / (wait + sum(r[BUSY] for r in ranks))


def contention_line(name: str, entry: dict[str, Any]) -> str | None:
    """A sentence when a run's ranks waited for a core ``CONTENDED`` or more of the time they wanted one."""
    share = core_wait_share(entry)
    if share is None or share < CONTENDED:
        return None
    return (f"the ranks of {name} waited for a core {share:.0%} of the time they were ready to run (other processes or "
            "its own ranks shared the cores): its wall-clock figures (step time, tokens/s) are slowed by that, its "
            "busy times are not")


def markdown(sec: dict[str, Any], table: Any) -> str:
    """Return the report.md section; ``table(header, rows)`` renders a markdown table."""
    if not sec:
        return ""
    out = ["## Per-rank step timing and stragglers\n",
           "Medians over steps after step 0. *busy* is the CPU time the rank used in the step (a rank waiting in a "
           "collective uses none); the phases are wall clock, so a rank waiting for a straggler shows it in the "
           "phase where it waits, and *idle* (wall minus busy) is the time it spent waiting in collectives (or "
           "descheduled), and *core wait* the part of it the rank was ready to run but found no free core "
           "(Linux's run-queue wait: the machine's other load). A rank is flagged when its busy time stays above "
           "its peers' median by the threshold for the window of steps.\n"]
    for name, entry in sec.items():
        out.append(f"**{name}** (threshold {entry['threshold']:g}x, window {entry['window']} steps)\n")
        if entry.get("per_rank") is None:
            out.append(f"{entry.get('reason', NOT_MEASURED)}\n")
            out += trace_lines(entry)
            continue
        out.append(table(HEADER, rows(entry)))
        verdict = _sentence(entry.get("reason") or "No straggler.")
        out += [f"- **{f['line']}**\n" for f in entry["flagged"]] or [f"{verdict}\n"]
        contended = contention_line(name, entry)
        out += [f"- {_sentence(contended)}\n"] if contended else []
        out += trace_lines(entry)
    return "\n".join(out)


def trace_lines(entry: dict[str, Any]) -> list[str]:
    """The markdown lines of a run's trace judgement ([] without one)."""
    traced = entry.get("trace")
    if not traced:
        return []
    flagged = {f["rank"] for f in traced["flagged"]}
    ranks = ", ".join(f"rank {r} {_ms(v)} ms" + (" ⚠" if int(r) in flagged else "")
                      for r, v in traced["compute_s"].items())
    out = [f"From the traces ({traced['steps']} profiled steps), compute per step (each rank's own work, its waits "
           f"in collectives left out): {ranks}.\n"]
    if traced.get("note"):
        return out + [f"{_sentence(traced['note'])}\n"]
    return out + ([f"- **{f['line']}**\n" for f in traced["flagged"]] or ["No straggler in the traces.\n"])


def plot(states: dict[str, RunState], path: str) -> str | None:
    """Busy time per step of every rank, one panel per run with timing; returns the path or None."""
    runs = [(n, st) for n, st in states.items() if st.stragglers.timing]
    if not runs:
        return None
    from shardscope.analysis.plots import _pyplot, _save, legend_outside, run_style, step_axis

    plt = _pyplot()
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.6 * len(runs)), squeeze=False)
    for ax, (name, st) in zip(axes[:, 0], runs):
        busy = all(BUSY in figures for steps in st.stragglers.timing.values() for figures in steps.values())
        first: list[float] = []  # each rank's first step (its start-up: allocations, first collectives)
        later: list[float] = []
        for i, (rank, steps) in enumerate(sorted(st.stragglers.timing.items())):
            xs = sorted(steps)
            flagged = rank in st.stragglers.flagged
            ys = [1000 * (steps[s][BUSY] if busy else sum(steps[s].get(k, 0.0) for k in STREAM)) for s in xs]
            ax.plot(xs, ys, label=f"rank {rank}" + (" (straggler)" if flagged else ""),
                    **{**run_style(i), "linewidth": 2.0 if flagged else 1.2})
            first, later = first + ys[:1], later + ys[1:]
        if later and max(first) > 2 * max(later):  # the first step alone would set the scale and flatten the rest
            ax.set_ylim(0, 1.15 * max(later))
            ax.text(0.01, 0.97, f"step {min(min(s) for s in st.stragglers.timing.values() if s)}: up to "
                    f"{max(first):,.0f} ms (start-up), off the scale", transform=ax.transAxes, va="top", fontsize=8)
        window = sorted(st.profiled_steps)
        if window:  # the profiler's steps and the one after (its trace export) run slower on every rank
            ax.axvspan(window[0] - 0.5, window[-1] + 1.5, color="#999", alpha=0.15,
                       label="profiled steps + trace export")
        what = "busy time per step" if busy else "stream time per step (CUDA events, waits included)"
        ax.set_title(f"{name}: {what}")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        legend_outside(ax)
    for ax in axes[:, 0]:
        step_axis(ax)
    for ax in axes[:-1, 0]:  # one "step" label, under the last panel
        ax.set_xlabel("")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    return _save(fig, path)
