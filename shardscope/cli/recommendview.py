"""The recommendation in the terminal: after ``run --headless``, and ``shardscope recommend DIR --device-memory``.

The figures come from ``profiling.recommend``; this module only prints, every line from a run directory's files
as text (markup off, control characters spelled ``\\xNN``). No torch is imported.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from shardscope.core.rundir import load_summary
from shardscope.core.sizes import parse_size
from shardscope.core.text import clean

# What folding or reading a run directory's files of the wrong shape raises (a crafted or damaged file).
DATA_ERRORS = (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError)


def _fail(message: str) -> None:
    click.echo(clean(f"shardscope: error: {message}"), err=True)
    sys.exit(2)


def print_recommendation(summary: dict[str, Any], console: Any) -> None:
    """Print the answer (``analysis.answer``: speed, memory, fit, loss, noise), then the recommendation's other
    lines (each run against the baseline); nothing when the summary has no recommendation."""
    from shardscope.analysis import answer

    rec = summary.get("recommendation")
    if not rec:
        return
    said = answer.lines(summary)
    console.print("[bold]answer[/]")
    for line in said:
        console.print(clean(f"  {line}"), highlight=False, markup=False)
    rest = [line for line in rec["lines"] if not any(line in s for s in said)]
    if rest:
        console.print("[bold]each run against the baseline[/]")
        for line in rest:
            console.print(clean(f"  {line}"), highlight=False, markup=False)


def refit(out_dir: str, device_memory_bytes: int) -> dict[str, Any] | None:
    """Recompute a finished run directory's recommendation against ``device_memory_bytes`` (which runs
    would not fit, and from which world size the memory model says they would), write it into
    summary.json and report.md, and return the summary (None when the directory has no summary)."""
    from shardscope.analysis import fold
    from shardscope.analysis import recommend
    from shardscope.cli.common import rewrite_summary

    try:
        comparison = fold.load_comparison(out_dir)
        summary = load_summary(out_dir)
    except (OSError, ValueError):
        return None
    summary["recommendation"] = recommend.section(comparison, fold.replay_states(out_dir), summary,
                                                  device_memory_bytes)
    rewrite_summary(out_dir, summary)
    return summary


def parse_device_memory(text: str | None) -> int | None:
    """``--device-memory`` as bytes (None when not given); exits 2 with one line on a bad size."""
    if not text:
        return None
    try:
        return parse_size(text)
    except ValueError as err:
        _fail(f"--device-memory {text!r}: {err}")
        raise  # unreachable


def print_at_scale(out_dir: str, world_size: int, device: str | None, limit: int | None, console: Any) -> None:
    """Print the recommendation predicted at ``world_size`` ranks (``analysis.recommend_scale``); exits 2 with one
    line when ``device`` is unknown and says why when the comparison cannot calibrate a prediction."""
    from shardscope.analysis import recommend_scale
    from shardscope.analysis.predict.devices import device_spec
    from shardscope.analysis.predict.work import NotPredicted
    from shardscope.cli.predictview import what_if

    device, first_line = what_if(world_size, device)
    from rich.markup import escape

    said = f"(shardscope predict, calibrated on {out_dir})" + (f": {first_line}" if first_line else "")
    console.print(f"[bold]predicted at {world_size} ranks[/] " + escape(clean(said)), highlight=False)
    try:
        result = recommend_scale.at_scale(out_dir, world_size, device_spec(device) if device else None, limit)
    except NotPredicted as err:
        console.print(clean(f"  not predicted: {err}"), highlight=False, markup=False)
        return
    except DATA_ERRORS as err:  # a file of the wrong shape
        console.print(clean(f"  not predicted: {out_dir} unreadable ({type(err).__name__}: {err})"), highlight=False,
                      markup=False)
        return
    for line in [*result["notes"], *result["lines"]]:
        console.print(clean(f"  {line}"), highlight=False, markup=False)
    console.print("  assumptions:", highlight=False)
    for line in result["assumptions"]:
        console.print(clean(f"    - {line}"), highlight=False, markup=False)


@click.command("recommend")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--device-memory", default=None, help="Device memory to check each run against, e.g. 80GiB.")
@click.option("--world-size", "-n", type=int, default=None,
              help="Also rank the runs as predicted at this many ranks (calibrated on OUT_DIR; see shardscope predict).")
@click.option("--device", default=None, metavar="NAME",
              help="With --world-size: a what-if on GPUs of this kind (A100, H100, H200, B200).")
def recommend_cmd(out_dir: str, device_memory: str | None, world_size: int | None, device: str | None) -> None:
    """Recommend a run of a finished run directory: the fastest that fits, what each saves and costs; with
    --world-size, which would be fastest at that scale, as predicted, with the error measured here."""
    from rich.console import Console

    from shardscope.analysis import fold
    from shardscope.analysis import recommend

    limit = parse_device_memory(device_memory)
    if world_size is not None and world_size < 1:
        _fail(f"--world-size {world_size}: must be >= 1")
    if device and world_size is None:
        _fail("--device: give --world-size too (the what-if is a prediction at a world size)")
    if world_size is not None:  # a world size this machine cannot host must name its what-if, before any output
        from shardscope.cli.predictview import what_if

        what_if(world_size, device)
    try:
        comparison = fold.load_comparison(out_dir)
        summary = load_summary(out_dir)
    except (OSError, ValueError) as err:
        _fail(f"{out_dir}: not a finished shardscope run directory ({err})")
    try:
        summary["recommendation"] = recommend.section(comparison, fold.replay_states(out_dir), summary, limit)
    except DATA_ERRORS as err:  # a file of the wrong shape: one line, never a traceback
        _fail(f"{out_dir}: unreadable ({type(err).__name__}: {err})")
    console = Console()
    try:
        print_recommendation(summary, console)
    except DATA_ERRORS as err:
        _fail(f"{out_dir}: its summary is unreadable ({type(err).__name__}: {err})")
    if world_size is not None:
        print_at_scale(out_dir, world_size, device, limit, console)
