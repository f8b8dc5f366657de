"""The recommendation in the terminal: after ``run --headless``, and ``shardscope recommend DIR --device-memory``.

The figures come from ``profiling.recommend``; this module only prints. No torch is imported.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from shardscope.core.rundir import RunDir, load_summary
from shardscope.core.sizes import parse_size


def _fail(message: str) -> None:
    click.echo(f"shardscope: error: {message}", err=True)
    sys.exit(2)


def print_recommendation(summary: dict[str, Any], console: Any) -> None:
    """Print summary.json's ``recommendation`` section (nothing when it has none)."""
    rec = summary.get("recommendation")
    if not rec:
        return
    console.print("[bold]recommendation[/]")
    for line in rec["lines"]:
        console.print(f"  {line}", highlight=False, markup=False)
    for caveat in rec["caveats"]:
        console.print(f"  [yellow]caveat:[/] {caveat}", highlight=False)


def refit(out_dir: str, device_memory_bytes: int) -> dict[str, Any] | None:
    """Recompute a finished run directory's recommendation against ``device_memory_bytes`` (which runs
    would not fit, and from which world size the memory model says they would), write it into
    summary.json and report.md, and return the summary (None when the directory has no summary)."""
    from shardscope.config import dump_json, write_atomic
    from shardscope.analysis import fold
    from shardscope.analysis import recommend
    from shardscope.analysis.report import render_markdown

    try:
        comparison = fold.load_comparison(out_dir)
        summary = load_summary(out_dir)
    except (OSError, ValueError):
        return None
    summary["recommendation"] = recommend.section(comparison, fold.replay_states(out_dir), summary,
                                                  device_memory_bytes)
    dump_json(RunDir(out_dir).summary, summary)
    markdown = render_markdown(summary)
    write_atomic(RunDir(out_dir).report, lambda fh: fh.write(markdown))  # never through a link out of the directory
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


@click.command("recommend")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--device-memory", default=None, help="Device memory to check each run against, e.g. 80GiB.")
def recommend_cmd(out_dir: str, device_memory: str | None) -> None:
    """Recommend a run of a finished run directory: the fastest that fits, what each saves and costs."""
    from rich.console import Console

    from shardscope.analysis import fold
    from shardscope.analysis import recommend

    limit = parse_device_memory(device_memory)
    try:
        comparison = fold.load_comparison(out_dir)
        summary = load_summary(out_dir)
    except (OSError, ValueError) as err:
        _fail(f"{out_dir}: not a finished shardscope run directory ({err})")
    summary["recommendation"] = recommend.section(comparison, fold.replay_states(out_dir), summary, limit)
    print_recommendation(summary, Console())
