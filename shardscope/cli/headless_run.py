"""``shardscope run --headless`` (and ``--dry-run``): the live table, the final tables, the parity
check and the SLURM task's node rank. Torch-free: the session is imported when a run starts.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import click

from shardscope import config
from shardscope.cli.common import EXIT_FAILED, EXIT_OK, fail_usage
from shardscope.cli.recommendview import print_recommendation, refit
from shardscope.core.rundir import RunDir, read_json_or_none
from shardscope.core.text import clean


def slurm_node_rank(given: int | None) -> int:
    """This task's node rank: ``SLURM_NODEID`` (exits 2 when it is missing or disagrees with --node-rank)."""
    raw = os.environ.get("SLURM_NODEID", "")
    if not raw.isdigit():
        fail_usage(f"--slurm-task: SLURM_NODEID = {raw!r}: expected a node index (run this under srun)")
    if given is not None and given != int(raw):
        fail_usage(f"--node-rank {given}: differs from SLURM_NODEID = {raw}; give one")
    return int(raw)


def print_dry_run(comparison: config.Comparison, device: str, out: str) -> None:
    """``--dry-run``: print the resolved settings and each run's torchrun command line."""
    from shardscope.orchestrator.session import Session

    from shardscope.presets.schema import resolved_options, resolved_precision, resolved_world_size

    resolved = comparison.shown()
    for run, shown in zip(comparison.runs, resolved.get("runs", [])):  # what each run will use, not "inherit"
        shown.update(world_size=resolved_world_size(comparison, run), precision=resolved_precision(comparison, run),
                     options=resolved_options(run))
    click.echo(clean(f"# dry run: nothing is written or launched. preset {comparison.name} ({comparison.source}) on "
                     f"{device}; a real run would write {out}"))
    click.echo(json.dumps(resolved, indent=2))  # JSON spells every control character
    for plan in Session(comparison, out, device=device).plans():
        click.echo(f"# run {plan.run}: would write its spec and launch")
        click.echo(clean(plan.shell_line()))  # a path or value with a control character: spelled, never sent


def run_headless(session, device_memory_bytes: int | None = None, deadline: float | None = None) -> int:
    """Drive ``session`` with the live table, then print the final tables; return the exit code. ``deadline`` (a
    ``time.monotonic()`` instant, ``tune``'s budget): every run still going then is stopped, queued ones too, and
    the summary is written from what ran."""
    from rich.console import Console

    from rich.markup import escape

    from shardscope.cli.headless import (HeadlessView, comparison_table, loss_table, pipeline_table, rank_timing_table,
                                         say)

    console = Console()
    if not console.is_terminal:  # logs and pipes: wide enough for the comparison table
        console = Console(width=max(console.width, 160))
    view = HeadlessView(console, session.run_names)
    session.subscribe(view)
    session.start()
    interrupted = False

    def wait_step() -> bool:
        nonlocal interrupted
        if deadline is not None and not interrupted and time.monotonic() >= deadline:
            interrupted = True
            console.print("[yellow]the budget is spent: stopping every run still going (summary still written)[/]")
            session.stop_all()
        try:
            return session.wait(0.25) is not None
        except KeyboardInterrupt:
            if not interrupted:
                interrupted = True
                console.print("[yellow]interrupted: stopping every run (summary still written)...[/]")
                session.stop_all()
            return False

    while True:
        try:
            view.run_live(wait_step)
            break
        except KeyboardInterrupt:  # a Ctrl-C that landed outside wait_step
            if not interrupted:
                interrupted = True
                session.stop_all()
    code = session.exit_code if session.exit_code is not None else EXIT_FAILED
    summary = load_summary(session.out_dir)
    if summary is not None and device_memory_bytes and session.comparison.launch.node_rank == 0:
        summary = refit(session.out_dir, device_memory_bytes) or summary
    if summary is not None:
        console.print(comparison_table(summary))
        piped = pipeline_table(summary)
        if piped is not None:
            console.print(piped)
        console.print(loss_table(summary))
        timing = rank_timing_table(summary)
        if timing is not None:
            console.print(timing)
        for entry in (summary.get("stragglers") or {}).values():
            for flag in entry.get("flagged", []):
                say(console, str(flag["line"]), style="bold yellow")  # hosts from the ranks' records: text
    for notice in view.notices:
        if notice.level != "info":
            console.print(f"[yellow]{notice.level}:[/] {escape(clean(notice.text))}", markup=True, highlight=False)
    if session.comparison.launch.node_rank > 0:
        launch = session.comparison.launch
        where = ("its own --out, sent over TCP to " + launch.records_endpoint if launch.records_endpoint
                 else "the shared run directory")
        say(console, f"node {launch.node_rank}: this node's files are in {session.out_dir}; node 0 writes the "
                     f"summary and reports in {where}")
        return code
    console.print("written:")
    for label, path in sorted((session.paths or {}).items()):
        say(console, f"  {label}: {path}")  # a path is text: "[" in it is no markup
    print_recommendation(summary or {}, console)
    return code


def load_summary(out: str) -> dict[str, Any] | None:
    """The run directory's summary, or None when it is missing or unreadable."""
    return read_json_or_none(RunDir(out).summary)


def check_parity(summary: dict[str, Any]) -> int:
    """``--check-parity``: exit 1 when a like-for-like run's loss left the baseline by more than loss_tolerance."""
    tol = float(summary.get("loss_tolerance", 1e-5))
    baseline = summary.get("baseline", "")
    bad = []
    for r in summary.get("runs", []):
        name, diff = clean(str(r.get("name", "?"))), r.get("loss_max_abs_diff")
        if r.get("name") == baseline:
            click.echo(f"parity: {name} is the baseline")
        elif r.get("fairness_flags"):
            click.echo(clean(f"parity: {name} skipped (not like-for-like: {'; '.join(map(str, r['fairness_flags']))})"))
        elif r.get("status") != "ok":
            click.echo(clean(f"parity: {name} not checked: it ended {r.get('status')}"))
        elif diff is None:
            click.echo(clean(f"parity: {name} not checked: no loss at steps it shares with {baseline}"))
        elif diff > tol:
            bad.append(name)
            click.echo(f"parity: {name} FAILED: max |Δloss| {diff:.3e} > loss_tolerance {tol:g}", err=True)
        else:
            click.echo(f"parity: {name} ok: max |Δloss| {diff:.3e} <= loss_tolerance {tol:g}")
    return EXIT_FAILED if bad else EXIT_OK

