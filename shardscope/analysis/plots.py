"""PNG plots of a comparison (matplotlib, Agg backend): loss, throughput, memory, communication.

Each function takes plain data (the summary dict and run states) and writes one file; it returns
the path, or None when there is nothing to plot. matplotlib is imported inside the functions so
importing this module stays cheap.
"""

from __future__ import annotations

import math
import os
from typing import Any

from shardscope.config import write_atomic
from shardscope.core.numbers import fmt_bytes
from shardscope.core.rundir import plot_file

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf")  # matplotlib's tab10
LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))


def run_style(i: int, baseline: bool = False) -> dict[str, Any]:
    """The colour and line style of the ``i``-th run: no two of the first 60 runs look alike (a colour repeats
    only with another line style); the baseline is drawn solid and thicker."""
    return {"color": COLORS[i % len(COLORS)], "linewidth": 2.4 if baseline else 1.5,
            "linestyle": "-" if baseline else LINESTYLES[(1 + i // len(COLORS)) % len(LINESTYLES)]}


def legend_outside(ax: Any, **kwargs: Any) -> None:
    """A legend to the right of the axes, never over the data."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8, **kwargs)


def no_data(ax: Any, why: str) -> None:
    """An empty panel says why it is empty instead of showing a bare axis."""
    ax.set_xticks([])
    ax.set_yticks([])
    ax.text(0.5, 0.5, f"no data: {why}", transform=ax.transAxes, ha="center", va="center", fontsize=9, color="#555")
PART_COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "gathered": "#8172b3",
               "activations": "#c44e52", "other": "#b0b0b0"}
MIB = 1024 ** 2


def step_axis(ax: Any) -> None:
    """Label ``ax``'s x axis "step", with whole-number ticks only (there is no step 2.5)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str) -> str:
    fig.tight_layout()
    try:  # atomically, never through a symlink (config.write_atomic); legends outside the axes kept in
        write_atomic(path, lambda fh: fig.savefig(fh, dpi=110, format="png", bbox_inches="tight"), binary=True)
    finally:
        _pyplot().close(fig)
    return path


def loss_plot(losses: dict[str, list[tuple[int, float]]], baseline: str, path: str) -> str | None:
    """Loss curves overlaid (top) and each run's loss minus the baseline's (bottom)."""
    if not any(losses.values()):
        return None
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    base = dict(losses.get(baseline, []))
    nonfinite: dict[int, list[str]] = {}  # first non-finite step -> runs
    for i, (name, points) in enumerate(losses.items()):
        if not points:
            continue
        steps, values = zip(*points)
        style = run_style(i, name == baseline)
        top.plot(steps, values, label=f"{name} (baseline)" if name == baseline else name, **style)
        bad = [s for s, v in points if not math.isfinite(v)]
        if bad:  # a line cannot show nan/inf: mark where it stops meaning anything
            nonfinite.setdefault(bad[0], []).append(name)
        if name != baseline and base:
            common = [(s, v - base[s]) for s, v in points if s in base]
            if common:
                xs, ds = zip(*common)
                bottom.plot(xs, ds, label=name, **style)
    for step, names in nonfinite.items():
        for ax in (top, bottom):
            ax.axvline(step, color="#c44e52", linestyle=":", linewidth=1.4)
        top.annotate(f"non-finite loss from step {step}: {', '.join(names)}", (step, 0.5),
                     xycoords=("data", "axes fraction"), rotation=90, va="center", ha="right", fontsize=8,
                     color="#c44e52")
    top.set_ylabel("loss")
    top.set_title("Training loss")
    top.grid(alpha=0.3)
    legend_outside(top)
    bottom.set_ylabel(f"loss − {baseline}")
    step_axis(bottom)
    if bottom.get_legend_handles_labels()[0]:
        bottom.axhline(0.0, color="black", linewidth=0.8)
        bottom.grid(alpha=0.3)
        bottom.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        legend_outside(bottom)
    else:
        no_data(bottom, f"no other run has a loss at a step {baseline} has" if base else f"{baseline} has no loss")
    return _save(fig, path)


def throughput_plot(runs: list[dict[str, Any]], path: str) -> str | None:
    """Bars of each run's median throughput, labelled with the speedup versus the baseline."""
    rows = [r for r in runs if (r.get("median_tokens_per_s") or r.get("median_samples_per_s"))]
    if not rows:
        return None
    plt = _pyplot()
    unit = "tokens/s" if rows[0].get("median_tokens_per_s") else "samples/s"
    values = [r.get("median_tokens_per_s") or r.get("median_samples_per_s") for r in rows]
    fig, ax = plt.subplots(figsize=(max(5.5, 1.6 * len(rows) + 2), 4))
    bars = ax.bar([r["name"] for r in rows], values, color=[COLORS[i % len(COLORS)] for i in range(len(rows))])
    for bar, r in zip(bars, rows):
        label = f"{bar.get_height():,.0f}"
        if r.get("speedup"):
            label += f"\n×{r['speedup']:.2f}"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=9)
    ax.set_ylabel(f"median {unit} (profiled steps excluded)")
    ax.set_title("Throughput")
    ax.set_ylim(0, max(values) * 1.25)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def memory_plot(memory: dict[str, Any], path: str) -> str | None:
    """Stacked bars per run: predicted (params, grads, optimizer, gathered unit, activations) beside
    measured (exact params, grads, optimizer; with a CUDA allocator peak, the rest of it as "other").

    On CPU the measured peak is process RSS (mostly the Python runtime and libraries), which would
    dwarf the model states, so it gets its own panel instead of an "other" segment.
    """
    runs = [(name, m) for name, m in memory.get("runs", {}).items() if m.get("predicted")]
    if not runs:
        return None
    plt = _pyplot()
    rss = memory.get("measured_peak_kind") in ("process RSS", "")  # no allocator peak: model states only
    ncols = 2 if rss else 1
    fig, axes = plt.subplots(1, ncols, figsize=(max(6.5, 2.4 * len(runs) + 2.5) + (3.5 if rss else 0), 4.8),
                             gridspec_kw={"width_ratios": [3, 1.3]} if rss else None, squeeze=False)
    ax = axes[0][0]
    width, labels, ticks = 0.38, set(), []
    for i, (name, m) in enumerate(runs):
        pred, meas = m["predicted"], m.get("measured") or {}
        pred_parts = [("params", pred["param_bytes"]), ("grads", pred["grad_bytes"]), ("optimizer", pred["optim_bytes"])]
        if not rss:  # beside an allocator peak, the whole predicted peak; beside model states, model states only
            pred_parts += [("gathered", pred.get("gathered_unit_bytes", 0)), ("activations", pred.get("activation_bytes", 0))]
        meas_parts = []
        if meas:
            meas_parts = [("params", meas.get("param_bytes") or 0), ("grads", meas.get("grad_bytes") or 0),
                          ("optimizer", meas.get("optim_bytes") or 0)]
            if not rss:
                meas_parts.append(("other", max(0, (meas.get("peak_bytes") or 0) - sum(v for _, v in meas_parts))))
        for offset, parts, tag in ((-width / 2, pred_parts, "predicted"), (width / 2, meas_parts, "measured")):
            bottom = 0.0
            for part, value in parts:
                mib = (value or 0) / MIB
                ax.bar(i + offset, mib, width, bottom=bottom, color=PART_COLORS[part],
                       label=part if part not in labels else None, edgecolor="white", linewidth=0.5)
                labels.add(part)
                bottom += mib
            if parts:
                ax.annotate(tag, (i + offset, bottom), ha="center", va="bottom", fontsize=8)
            elif tag == "measured":  # a run that never measured (failed early): a note, not a 0 bar
                ax.text(i + offset, 0, "not\nmeasured", ha="center", va="bottom", fontsize=8, color="#c44e52")
        ticks.append(name)
    ax.set_xticks(range(len(runs)), ticks)
    ax.set_xlim(-0.6, len(runs) - 0.4)  # room for both bars of every run, drawn or not
    ax.set_ylabel("MiB per rank (rank 0)")
    ax.set_title("Model states per rank: predicted vs measured (exact byte counts)" if rss else
                 "Peak memory per rank: predicted vs the allocator's\n(measured other = allocator peak − model states)",
                 fontsize=11)
    legend_outside(ax)
    ax.grid(axis="y", alpha=0.3)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.1)
    if rss:
        side = axes[0][1]
        peaks = [(m.get("measured") or {}).get("peak_bytes") for _, m in runs]
        side.bar(range(len(ticks)), [0.0 if p is None else p / MIB for p in peaks], color=PART_COLORS["other"])
        side.set_xticks(range(len(ticks)), ticks)
        for j, peak in enumerate(peaks):
            side.text(j, 0 if peak is None else peak / MIB, "not\nmeasured" if peak is None else f"{peak / MIB:,.0f}",
                      ha="center", va="bottom", fontsize=8, color="#c44e52" if peak is None else "black")
        side.set_title("Peak process RSS, MiB\n(runtime, libraries, activations;\nnot comparable across strategies)",
                       fontsize=9)
        side.set_ylim(0, max([p / MIB for p in peaks if p] + [1]) * 1.15)
        side.grid(axis="y", alpha=0.3)
        side.tick_params(axis="x", labelrotation=20)
    return _save(fig, path)


def comm_plot(communication: dict[str, Any], path: str) -> str | None:
    """Communication time per step by collective type for each run, with the exposed part marked."""
    runs = [(name, c) for name, c in communication.get("runs", {}).items() if c.get("collectives")]
    if not runs:
        return None
    plt = _pyplot()
    kinds = sorted({k for _, c in runs for k in c["collectives"]})
    fig, ax = plt.subplots(figsize=(max(6.5, 2.2 * len(runs) + 3), 4.5))
    width = 0.8 / (len(kinds) + 1)
    for j, kind in enumerate(kinds):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(runs))]
        # A run without this collective type gets no bar (NaN), not a 0 ms bar.
        ms = [(c["collectives"][kind].get("time_per_step_s") if kind in c["collectives"] else None) for _, c in runs]
        ms = [math.nan if v is None else v * 1e3 for v in ms]
        bars = ax.bar(xs, ms, width, label=kind.replace("_", "-"), color=COLORS[j % len(COLORS)])
        for bar, (_, c) in zip(bars, runs):
            row = c["collectives"].get(kind)
            if row and row.get("count_per_step"):
                label = f"{row['count_per_step']:.0f}×\n{fmt_bytes(row['bytes_per_step'])}"
                ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                            fontsize=7)
    xs = [i - 0.4 + width * (len(kinds) + 0.5) for i in range(len(runs))]
    exposed = [(c.get("per_step") or {}).get("exposed_comm_s") for _, c in runs]
    bars = ax.bar(xs, [math.nan if v is None else v * 1e3 for v in exposed], width,
                  label="exposed (not overlapped), all types", color="white", edgecolor="black", hatch="//")
    for bar, value in zip(bars, exposed):
        if value is None:  # not measured: say so where the bar would be, never draw 0
            ax.annotate("exposed:\nnot measured", (bar.get_x() + bar.get_width() / 2, 0), ha="center",
                        va="bottom", fontsize=7)
    ax.set_xticks(range(len(runs)), [name for name, _ in runs])
    ax.set_ylabel("ms per step (mean over ranks)")
    ax.set_title("Communication per step by collective (labels: count and bytes per step)")
    legend_outside(ax)
    ax.grid(axis="y", alpha=0.3)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.18)
    return _save(fig, path)


def write_plots(summary: dict[str, Any], losses: dict[str, list[tuple[int, float]]], plots_dir: str) -> dict[str, str]:
    """Write every plot that has data under ``plots_dir``; return {name: path}."""
    os.makedirs(plots_dir, exist_ok=True)
    out = {}
    for name, fn, args in (
        ("loss", loss_plot, (losses, summary.get("baseline", ""))),
        ("throughput", throughput_plot, (summary.get("runs", []),)),
        ("memory", memory_plot, (summary.get("memory", {}),)),
        ("communication", comm_plot, (summary.get("communication", {}),)),
    ):
        path = fn(*args, plot_file(plots_dir, name))  # type: ignore[operator]
        if path:
            out[name] = path
    return out
