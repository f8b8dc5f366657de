"""``shardscope why DIR RUN``: why a run's loss differs from the baseline's, proven by controlled re-runs.

Prints what it will run and an estimate first (``--dry-run`` stops there), one line per re-run as it starts
and ends, then a rich table (per re-run: max and mean |Δloss| to the baseline, per-layer gradient-norm gap),
the cause and where the two runs first differ module by module. ``--json`` prints the result as JSON (progress
on stderr). Exit 0: explained, or nothing to explain; 1: not explained, not reproduced or a re-run failed;
2: bad input. The analysis is ``analysis/why/verdict.py``, the re-runs ``orchestrator/why_runs.py``; no torch here.
"""

from __future__ import annotations

import json
import signal
import sys
from typing import Any

import click

from shardscope.cli.common import EXIT_FAILED, EXIT_OK, fail_usage, terminate_on, trust_code_option
from shardscope.core.numbers import json_ready
from shardscope.core.text import clean
from shardscope.analysis.why import verdict as why
from shardscope.analysis.why.verdict import WhyError

GOOD = ("explained", "nothing to explain")


def print_result(res: dict[str, Any], console: Any = None) -> None:
    """Print a why result: the re-runs' table, the cause (or why none) and the module comparison."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    if console is None:
        console = Console(soft_wrap=True)  # one line a sentence, in a terminal and in a log
        if not console.is_terminal:  # logs and pipes: wide enough for the table
            console = Console(soft_wrap=True, width=max(console.width, 160))
    if res.get("cached"):
        console.print(clean(f"(from an earlier `shardscope why` of {res['run']}; --again runs it again)"),
                      highlight=False, markup=False)
    if res.get("variants") or res["status"] not in GOOD:
        table = Table(title=Text(clean(f"why {res['run']} differs from {res['baseline']} (tolerance "
                                       f"{res['tolerance']:g}, {res['steps']} steps)")))
        for i, name in enumerate(why.HEADER):
            table.add_column(name, justify="right" if i >= 3 else "left", overflow="fold")
        for row in why.rows(res):  # settings and values from the runs' files: text, never markup
            table.add_row(*(Text(clean(str(c))) for c in row))
        console.print(table)
    style = "green" if res["status"] in GOOD else "yellow"
    console.print(f"[{style}]{escape(clean(str(res['message'])))}[/]", highlight=False)
    if res.get("quirk"):
        console.print(clean(f"known quirk: {res['quirk']}"), highlight=False, markup=False)
    module = res.get("module") or {}
    if module.get("finding"):
        console.print(clean(f"module by module: {module['finding']}"), highlight=False, markup=False)
    if res.get("same_initial_weights") is False:
        console.print("[yellow]note:[/] the re-runs' initial weights differ from the original's", highlight=False)


@click.command("why")
@click.argument("out_dir", type=click.Path(file_okay=False), metavar="DIR")
@click.argument("run_name", metavar="RUN")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (progress lines on stderr).")
@click.option("--dry-run", is_flag=True, help="List the re-runs and the estimate; start nothing.")
@click.option("--again", is_flag=True, help="Run again even when DIR/why/RUN holds an earlier result.")
@trust_code_option
def why_cmd(out_dir: str, run_name: str, as_json: bool, dry_run: bool, again: bool) -> None:
    """Why RUN's loss differs from the baseline's: short controlled re-runs, each changing one suspect back.

    Names the change that brings RUN back within the comparison's loss_tolerance (a pair when no single one
    does), or says that no tested change explains it; compares the two runs module by module at the first
    divergent step. A run within tolerance has nothing to explain and nothing is re-run.
    """
    from shardscope.orchestrator.why_runs import WhyRunner, describe_plan

    say = (lambda line: click.echo(clean(line), err=True)) if as_json else (lambda line: click.echo(clean(line)))
    try:
        plan = why.load_plan(out_dir, run_name)
    except WhyError as err:
        fail_usage(clean(str(err)))
    runner = WhyRunner(plan, progress=say)
    for line in describe_plan(plan):
        say(line)
    if dry_run:
        say("dry run: nothing started" if not plan.within else why.nothing_to_explain(plan)["message"])
        return
    terminate_on((signal.SIGINT, signal.SIGTERM, signal.SIGHUP), signal.default_int_handler)
    try:
        res = runner.run(again=again)
    except WhyError as err:
        fail_usage(clean(str(err)))
    except KeyboardInterrupt:
        click.echo("shardscope: interrupted: the re-runs were stopped", err=True)
        sys.exit(EXIT_FAILED)
    if as_json:
        click.echo(json.dumps(json_ready(res), indent=2))
    else:
        print_result(res)
    sys.exit(EXIT_OK if res["status"] in GOOD else EXIT_FAILED)
