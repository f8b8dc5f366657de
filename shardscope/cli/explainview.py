"""``shardscope explain STRATEGY [--preset P | DIR]``: a strategy's explainer, filled with numbers, printed with rich.

With ``--preset`` (default: smoke) the figures are the memory model's and the communication theory's for
that preset's model and world size; with a run directory they are predicted beside measured, from its
summary.json. No torch is imported.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from shardscope import config
from shardscope.config import ConfigError
from shardscope.core import registry
from shardscope.core.rundir import SUMMARY, load_summary
from shardscope.core.text import clean
from shardscope.analysis import explain


def _fail(message: str) -> None:
    click.echo(clean(f"shardscope: error: {message}"), err=True)  # it may quote a file: no control gets through
    sys.exit(2)


def explain_dir(out_dir: str, strategy: str | None, run_name: str | None) -> dict[str, Any]:
    """Explain a run of the run directory ``out_dir`` (``run_name``, else the first run of ``strategy``).

    Raises ExplainError when the directory has no readable comparison.json or summary.json, or no such run.
    """
    from shardscope.analysis import fold

    try:
        comparison = fold.load_comparison(out_dir)
        summary = load_summary(out_dir)
    except (OSError, ValueError) as err:
        raise explain.ExplainError(f"{out_dir}: not a finished shardscope run directory ({err}); "
                                   f"`shardscope report {out_dir}` writes {SUMMARY}") from None
    if run_name is None:
        mine = [r.name for r in comparison.runs if r.strategy == strategy]
        if not mine:
            raise explain.ExplainError(f"{out_dir} has no run of strategy {strategy!r}; its runs: "
                                       + ", ".join(f"{r.name} ({r.strategy})" for r in comparison.runs))
        run_name = mine[0]
    try:
        return explain.explain_summary(comparison, summary, run_name)
    except explain.ExplainError:
        raise
    except (TypeError, KeyError, AttributeError, IndexError, ValueError) as err:  # a summary.json of another shape
        raise explain.ExplainError(f"{out_dir}: {SUMMARY} unreadable ({type(err).__name__}: {err})") from None


def print_explanation(result: dict[str, Any], console: Any = None) -> None:
    """Print an explanation (``explain.explain_preset``/``explain_summary``'s dict) as rich markdown (markdown is
    never markup; names and figures from a run directory with their control characters spelled)."""
    from rich.console import Console
    from rich.markdown import Markdown
    from rich.markup import escape

    console = console or Console()
    console.print(Markdown(clean(result["text"])))
    for note in result.get("notes", []):
        console.print(f"[yellow]note:[/] {escape(clean(str(note)))}", highlight=False)


def _sizing_host() -> config.HostInfo:
    """This machine's device kind, without a limit on ranks: explain uses the sizes a run here would use (a CPU
    machine shrinks presets through ``[cpu_overrides]``) but may describe more ranks than the machine holds."""
    from shardscope.orchestrator.devices import resolve_device

    try:
        device = resolve_device("auto")
    except ConfigError:
        device = "cpu"
    return config.HostInfo(device, 1 << 20, "any number of ranks")


@click.command("explain")
@click.argument("strategy", metavar="STRATEGY")
@click.argument("out_dir", required=False, type=click.Path(file_okay=False), metavar="[DIR]")
@click.option("--preset", "-p", default=None, help="Fill in this preset's model and world size [default: smoke].")
@click.option("--run", "run_name", default=None, help="Which run of the preset or directory (default: the first "
              "run of STRATEGY).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a preset key.")
def explain_cmd(strategy: str, out_dir: str | None, preset: str | None, run_name: str | None,
                overrides: tuple[str, ...]) -> None:
    """Explain a strategy: what it shards, what it sends when, memory per rank, when to use it, its options.

    Filled with a preset's predicted figures, or a run directory's predicted and measured ones.
    """
    if strategy not in registry.STRATEGIES:
        _fail(f"explain STRATEGY = {strategy!r}: allowed: {', '.join(registry.names())}")
    if out_dir and (preset or overrides):
        _fail("explain: give a run directory or --preset/--set, not both")
    try:
        if out_dir:
            result = explain_dir(out_dir, strategy, run_name)
        else:
            comparison = config.load_preset(preset or "smoke", list(overrides), host=_sizing_host())
            if comparison.size_profile == "cpu":
                click.echo(clean(f"sizes as a run of {comparison.name} on this machine uses them (no GPU: the "
                                 "preset's [cpu_overrides] applied)"))
            result = explain.explain_preset(comparison, strategy, run_name)
    except (ConfigError, explain.ExplainError) as err:
        _fail(str(err))
    print_explanation(result)
