"""``shardscope estimate``: predicted per-rank memory of each run of a preset at a chosen world size.

Pure Python (no torch): rows come from ``memory_model``; ``print_estimate`` renders them with rich.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from shardscope import config
from shardscope.core.numbers import fmt_bytes
from shardscope.core.bounded import child_env
from shardscope.config import Comparison, resolved_grad_accum
from shardscope.core import registry
from shardscope.profiling import memory_model


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
        elif comparison.global_batch % (row["dp"] * (accum := resolved_grad_accum(comparison, run))):
            note = f"global_batch {comparison.global_batch} not divisible by dp {row['dp']} x grad_accum {accum}"
        row["note"] = note
        if device_memory_bytes:
            row["fits"] = row["total_bytes"] <= device_memory_bytes
            row["headroom_bytes"] = device_memory_bytes - row["total_bytes"]
        else:
            row["fits"], row["headroom_bytes"] = None, None
        rows.append(row)
    return rows


def traced_estimates(comparison: Comparison, world_size: int, timeout_s: float = 600.0) -> dict[str, dict[str, Any]]:
    """Trace rank 0 of every traceable run at ``world_size`` (``engines.traced_estimate`` in a
    subprocess each: fake process group, fake tensors, torch's memory tracker over two steps).

    Returns {run name: the tracer's dict} for runs that traced, {run name: {"error": text}} for runs
    whose strategy is not traceable or whose trace failed.
    """
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="shardscope-trace-") as tmp:
        for run in comparison.runs:
            if not registry.get(run.strategy).traceable:
                traceable = ", ".join(n for n in registry.names() if registry.get(n).traceable)
                out[run.name] = {"error": f"not traceable (fake tensors run only {traceable})"}
                continue
            at_size = dataclasses.replace(run, world_size=world_size)
            payload = config.run_spec_payload(comparison, at_size, out_dir=tmp, device="cpu")
            spec = os.path.join(tmp, f"{run.name}.json")
            config.dump_json(spec, payload)
            try:
                proc = subprocess.run([sys.executable, "-m", "shardscope.engines.traced_estimate", spec],
                                      capture_output=True, text=True, timeout=timeout_s, env=child_env())
            except subprocess.TimeoutExpired:
                out[run.name] = {"error": f"trace took over {timeout_s:.0f} s"}
                continue
            lines = proc.stdout.strip().splitlines()
            if proc.returncode != 0 or not lines:
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                out[run.name] = {"error": f"trace failed: {last[:200]}"}
                continue
            out[run.name] = json.loads(lines[-1])
    return out


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
    traced = any("traced" in r for r in rows)
    if traced:
        table.add_column("traced states", justify="right", no_wrap=True)
        table.add_column("traced peak", justify="right", no_wrap=True)
    for r in rows:
        cells = [r["run"], r["strategy"], memory_model.layout_label(r), fmt_bytes(r["param_bytes"]),
                 fmt_bytes(r["grad_bytes"]), fmt_bytes(r["optim_bytes"]), fmt_bytes(r["model_state_bytes"]),
                 fmt_bytes(r["gathered_unit_bytes"]), fmt_bytes(r["activation_bytes"]), fmt_bytes(r["total_bytes"])]
        if device_memory_bytes:
            cells.append("[green]yes[/]" if r["fits"] else "[red]no[/]")
        if traced:
            t = r.get("traced") or {}
            cells += [fmt_bytes(t.get("model_state_bytes")), fmt_bytes(t.get("peak_bytes"))]
        table.add_row(*cells)
    return table


def print_estimate(comparison: Comparison, world_size: int, device_memory_bytes: int | None = None,
                   traced: bool = False) -> list[dict[str, Any]]:
    """Print the estimate table (and notes) to the terminal; return the rows. With ``traced``, each
    traceable run is also traced (``traced_estimates``) and shown beside the analytic figures."""
    from rich.console import Console

    rows = estimate_table(comparison, world_size, device_memory_bytes)
    if traced:
        with Console(stderr=True).status(f"tracing {len(rows)} run(s) at world size {world_size} on fake tensors"):
            found = traced_estimates(comparison, world_size)
        for r in rows:
            r["traced"] = found.get(r["run"], {})
    console = Console()
    if not console.is_terminal:  # pipes and CI logs: do not squeeze the table into 80 columns
        console = Console(width=190 if traced else 140)
    console.print(render_table(rows, world_size, device_memory_bytes))
    first = rows[0] if rows else None
    if first:
        console.print(f"{first['param_count']:,} parameters; micro-batch {first['micro_batch']} per rank at dp = "
                      f"{first['dp']}; AdamW states in fp32; {memory_model.activation_basis(comparison)}.")
    for r in rows:
        if r["note"]:
            console.print(f"[yellow]{r['run']}: {r['note']}[/]")
    for r in rows:
        t = r.get("traced")
        if t is None:
            continue
        if "error" in t:
            console.print(f"[dim]{r['run']}: traced: {t['error']}[/]")
            continue
        diff = (t["model_state_bytes"] - r["model_state_bytes"]) / max(1, r["model_state_bytes"])
        console.print(f"{r['run']}: traced on rank 0 of a fake {world_size}-rank group: model states "
                      f"{fmt_bytes(t['model_state_bytes'])} ({diff:+.2%} vs analytic), peak {fmt_bytes(t['peak_bytes'])} "
                      f"(analytic total {fmt_bytes(r['total_bytes'])}; the peak adds temporaries and gathered copies)")
    return rows
