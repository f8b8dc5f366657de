"""The view of ``shardscope diff`` (and ``shardscope run --against``): a rich table, JSON, plots.

The figures come from ``profiling.diff``; this module only lays them out and picks the exit code
(0 passed, 1 a difference beyond tolerance, 2 bad input — the caller prints that line). Names, statuses, paths
and reasons come from the directories' files: table cells are ``Text`` and printed lines have markup off, with
their control characters spelled ``\\xNN`` (``core.text.clean``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from shardscope.cli.headless import cell, fmt_num, say
from shardscope.config import MAX_NAME, NAME_RE
from shardscope.core.text import clean
from shardscope.core.numbers import fmt_bytes
from shardscope.analysis import diff, plots
from shardscope.core.rundir import COMPARISON, RunDir, plot_file

NOT_MEASURED = "not measured"


def _ratio(x: float | None, noise: list[float] | None = None) -> str:
    if x is None:
        return NOT_MEASURED
    return f"{x:.3f}x" + (f" (noise {noise[0]:.2f}-{noise[1]:.2f}x)" if noise else "")


def _mem_cell(mem: dict[str, Any], mixed: bool) -> str:
    """new/old peak memory; where runs' figures are of different kinds, each cell names its own."""
    if mem.get("reason", "").startswith("not comparable"):
        return mem["reason"]
    return _ratio(mem["ratio"]) + (f" ({mem.get('kind')})" if mixed and mem["ratio"] is not None else "")


def _loss_cell(loss: dict[str, Any]) -> str:
    if not loss["steps_compared"]:
        return "no common step"
    text = f"max {fmt_num(loss['max_abs_diff'], '.2e')} mean {fmt_num(loss['mean_abs_diff'], '.2e')}"
    if loss["nonfinite_steps"]:
        text += f"; non-finite at {len(loss['nonfinite_steps'])} step(s)"
    first = loss["first_beyond"]
    return text + (f"; beyond from step {first['step']}" if first else "")


def _comm_cell(comm: dict[str, Any]) -> str:
    if comm.get("reason"):
        return NOT_MEASURED
    return "; ".join(f"{k} {fmt_bytes(v['old'])}→{fmt_bytes(v['new'])}" for k, v in comm["per_type"].items())


def diff_table(result: dict[str, Any]) -> Table:
    """Return the per-run table of a ``diff.diff_dirs`` result."""
    table = Table(title=cell(f"diff {result['old']} → {result['new']}"))  # paths: "[" in them is no markup
    kinds = {r["memory"].get("kind") for r in result["runs"]}
    mem_col = "peak RSS new/old" if kinds == {"process RSS"} else "peak mem new/old"  # CPU: the process's RSS
    for col in ("run", "status", "loss |Δ|", "throughput new/old", mem_col, "bytes/step", "verdict"):
        table.add_column(col, justify="left" if col in ("run", "status", "loss |Δ|", "bytes/step", "verdict")
                         else "right", overflow="fold")
    for r in result["runs"]:
        label = r["old_run"] if r["old_run"] == r["new_run"] else f"{r['old_run']}→{r['new_run']}"
        # every cell holding a name, a status or a reason from the files is text
        table.add_row(cell(label), cell(f"{r['old_status']}→{r['new_status']}"), cell(_loss_cell(r["loss"])),
                      cell(_ratio(r["speed"]["ratio"], r["speed"]["noise_range"])),
                      cell(_mem_cell(r["memory"], len(kinds) > 1)), cell(_comm_cell(r["communication"])),
                      "[red]differs[/]" if r["failures"] else "[green]same within tolerance[/]")
    for name in result["only_old"]:
        table.add_row(cell(name), "only in old", "-", "-", "-", "-", "[yellow]not compared[/]")
    for name in result["only_new"]:
        table.add_row(cell(name), "only in new", "-", "-", "-", "-", "[yellow]not compared[/]")
    return table


def _value(v: Any) -> str:
    text = json.dumps(v) if not isinstance(v, str) else v
    return text if len(text) <= 60 else text[:57] + "..."


def differs_table(result: dict[str, Any]) -> Table | None:
    """Return the table of settings that differ between matched runs, or None when nothing does."""
    rows = [(r["old_run"], d) for r in result["runs"] for d in r["differs"]]
    if not rows:
        return None
    table = Table(title=f"what differs (start records, {COMPARISON})")
    for col in ("run", "key", "old", "new"):
        table.add_column(col, overflow="fold")
    for run, d in rows:  # values come from the directories' files: text, never markup, never a terminal control
        table.add_row(*(Text(clean(str(x))) for x in (run, d["key"], _value(d["old"]), _value(d["new"]))))
    return table


def write_plots(result: dict[str, Any], plots_dir: str) -> dict[str, str]:
    """Write one PNG per matched pair with both loss curves (and new − old below); return run -> path."""
    os.makedirs(plots_dir, exist_ok=True)
    out = {}
    for (a, b), (old_losses, new_losses) in result["_losses"].items():
        if not NAME_RE.match(b) or len(b) > MAX_NAME:  # a name that would leave the directory: no file made of it
            continue
        path = plot_file(plots_dir, f"diff_loss_{b}")
        made = plots.loss_plot({f"old {a}": old_losses, f"new {b}": new_losses}, f"old {a}", path)
        if made:
            out[b] = made
    return out


def _jsonable(value: Any) -> Any:
    """Non-finite floats as strings ("nan", "inf"): strict JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def report(old_dir: str, new_dir: str, maps: list[str] | tuple[str, ...], tol: diff.Tolerances, *,
           as_json: bool = False, plots_dir: str | None = None, console: Console | None = None) -> int:
    """Compare the directories, print the table (or JSON) and write plots; return 0 or 1.

    Raises ``diff.DiffInputError`` on input that cannot be compared (the caller exits 2).
    """
    if console is None:
        console = Console()
        if not console.is_terminal:  # logs and pipes: wide enough for the table
            console = Console(width=max(console.width, 160))
    try:
        result = diff.diff_dirs(old_dir, new_dir, diff.parse_map(maps), tol)
    except diff.DiffInputError as err:
        raise diff.DiffInputError(clean(str(err))) from None  # it may quote a path: no control gets through
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError) as err:
        # a record or summary of the wrong shape (a crafted or damaged file): the one line of bad input, exit 2
        raise diff.DiffInputError(clean(f"unreadable run directory ({type(err).__name__}: {err})")) from None
    where = plots_dir or RunDir(new_dir).diff
    if plots_dir is None and os.path.lexists(where) and not RunDir(new_dir).contains(where):
        print(clean(f"shardscope: diff: {where} is a link out of {new_dir}: plots not written"), file=sys.stderr)
        plot_paths: dict[str, str] = {}
    else:
        plot_paths = write_plots(result, where)
    public = {k: v for k, v in result.items() if not k.startswith("_")}
    public["plots"] = plot_paths
    if as_json:
        console.print_json(json.dumps(_jsonable(public)))
        return 0 if result["passed"] else 1
    console.print(diff_table(result))
    extra = differs_table(result)
    if extra is not None:
        console.print(extra)
    for r in result["runs"]:
        for key, part in (("throughput", r["speed"]), ("memory", r["memory"]), ("bytes/step", r["communication"])):
            if part.get("reason"):
                say(console, f"{r['new_run']}: {key} {part['reason']}")
    for name in result["only_old"] + result["only_new"]:
        side = "old" if name in result["only_old"] else "new"
        say(console, f"{name}: only in the {side} directory, not compared")
    for line in result["failures"]:
        say(console, f"diff: {line}", style="red")
    tols = result["tolerances"]
    say(console, f"{'passed' if result['passed'] else 'FAILED'} (loss-tol {tols['loss']:g}, speed-tol "
                 f"{tols['speed']:g}, mem-tol {tols['mem']:g}); plots: {', '.join(plot_paths.values()) or 'none'}")
    return 0 if result["passed"] else 1
