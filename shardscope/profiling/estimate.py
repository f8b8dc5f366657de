"""``shardscope estimate``: predicted per-rank memory of each run of a preset at a chosen world size.

Pure Python (no torch): rows come from ``memory_model``; ``print_estimate`` renders them with rich.
"""

from __future__ import annotations

from typing import Any

from shardscope.config import Comparison
from shardscope.profiling import memory_model


def fmt_bytes(n: float | None) -> str:
    """Human-readable bytes in binary units ("1.5 GiB"); "-" for None."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def estimate_table(comparison: Comparison, world_size: int, device_memory_bytes: int | None = None) -> list[dict[str, Any]]:
    """Return one row per run with predicted per-rank bytes at ``world_size``.

    Each row is ``memory_model.predict_run``'s dict plus ``fits`` (True/False against
    ``device_memory_bytes``, None without it), ``headroom_bytes`` and ``note`` (why a run cannot be
    laid out at that world size, e.g. tp does not divide it). Raises KeyError for an unknown strategy.
    """
    rows = []
    for run in comparison.runs:
        row = memory_model.predict_run(comparison, run, world_size)
        note = ""
        if world_size % row["tp"]:
            note = f"world size {world_size} is not a multiple of tp = {row['tp']}"
        elif comparison.global_batch % (row["dp"] * comparison.grad_accum):
            note = f"global_batch {comparison.global_batch} not divisible by dp {row['dp']} x grad_accum {comparison.grad_accum}"
        row["note"] = note
        if device_memory_bytes:
            row["fits"] = row["total_bytes"] <= device_memory_bytes
            row["headroom_bytes"] = device_memory_bytes - row["total_bytes"]
        else:
            row["fits"], row["headroom_bytes"] = None, None
        rows.append(row)
    return rows


def render_table(rows: list[dict[str, Any]], world_size: int, device_memory_bytes: int | None = None) -> Any:
    """Return a rich Table of ``estimate_table`` rows."""
    from rich.table import Table

    title = f"Predicted memory per rank at world size {world_size}"
    if device_memory_bytes:
        title += f" (device: {fmt_bytes(device_memory_bytes)})"
    table = Table(title=title, title_justify="left")
    table.add_column("run", no_wrap=True)
    table.add_column("strategy", no_wrap=True)
    for col in ("dp×tp", "params", "grads", "optim", "states", "gathered", "activ.", "total"):
        table.add_column(col, justify="right", no_wrap=True)
    if device_memory_bytes:
        table.add_column("fits", justify="center")
    for r in rows:
        cells = [r["run"], r["strategy"], f"{r['dp']}×{r['tp']}", fmt_bytes(r["param_bytes"]),
                 fmt_bytes(r["grad_bytes"]), fmt_bytes(r["optim_bytes"]), fmt_bytes(r["model_state_bytes"]),
                 fmt_bytes(r["gathered_unit_bytes"]), fmt_bytes(r["activation_bytes"]), fmt_bytes(r["total_bytes"])]
        if device_memory_bytes:
            cells.append("[green]yes[/]" if r["fits"] else "[red]no[/]")
        table.add_row(*cells)
    return table


def print_estimate(comparison: Comparison, world_size: int, device_memory_bytes: int | None = None) -> list[dict[str, Any]]:
    """Print the estimate table (and notes) to the terminal; return the rows."""
    from rich.console import Console

    rows = estimate_table(comparison, world_size, device_memory_bytes)
    console = Console()
    if not console.is_terminal:  # pipes and CI logs: do not squeeze the table into 80 columns
        console = Console(width=140)
    console.print(render_table(rows, world_size, device_memory_bytes))
    first = rows[0] if rows else None
    if first:
        console.print(f"{first['param_count']:,} parameters; micro-batch {first['micro_batch']} per rank at dp = "
                      f"{first['dp']}; AdamW states in fp32; activations per Korthikanti et al. (fused attention).")
    for r in rows:
        if r["note"]:
            console.print(f"[yellow]{r['run']}: {r['note']}[/]")
    return rows
