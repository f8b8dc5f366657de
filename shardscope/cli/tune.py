"""``shardscope tune``: the fastest configuration of a preset that fits, searched by prediction, proven by real runs.

The search itself is ``analysis/tune/search`` (calibration, pruning, the proving comparison, the verdict); this
command checks the options, runs each comparison with the headless live table (its progress) and prints the table of
every candidate and the answer. ``--device`` on a machine without that GPU is ``tune_what_if``. Torch-free.
"""

from __future__ import annotations

import json
import os
from typing import Any

import click

from shardscope import config
from shardscope.cli.common import EXIT_FAILED, EXIT_OK, fail_usage, resolve, trust_code_option
from shardscope.cli.recommendview import parse_device_memory
from shardscope.core.numbers import fmt_bytes
from shardscope.core.rundir import RunDir
from shardscope.core.text import clean



def parse_budget(text: str) -> float:
    """``10m``, ``90s``, ``1h`` or seconds as a number; exits 2 with one line otherwise."""
    units = {"s": 1, "m": 60, "h": 3600}
    raw = text.strip().lower()
    try:
        value = float(raw[:-1]) * units[raw[-1]] if raw and raw[-1] in units else float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value > 7 * 86400:
        fail_usage(f"--budget {text!r}: expected a duration such as 90s, 10m or 1h (at most a week)")
    return value


def _run_quietly(c: config.Comparison, out: str, dev: str, deadline: float | None = None) -> int:
    """Run comparison ``c`` into ``out`` with the headless view (its live table is the progress)."""
    from shardscope.cli.headless_run import run_headless
    from shardscope.orchestrator.session import Session

    return run_headless(Session(config.validate(c), out, device=dev), deadline=deadline)


def _table(cands: list[Any], answer: dict[str, Any], unit: str) -> Any:
    from rich.table import Table

    from shardscope.analysis.tune import choose
    from shardscope.cli.headless import cell, fmt_rate

    table = Table(title="shardscope tune: every candidate")
    for col in ("candidate", "predicted ms/step", "predicted mem/rank", "measured " + unit, "outcome"):
        table.add_column(col, justify="left" if col in ("candidate", "outcome") else "right", overflow="fold")
    for x in choose.in_table_order(cands):
        if x.refused:  # listed by reason under the table (refused_lines): hundreds of rows said the same few things
            continue
        table.add_row(cell(x.name), "-" if x.predicted_step_s is None else f"{x.predicted_step_s * 1e3:.1f}",
                      "-" if x.predicted_mem_bytes is None else fmt_bytes(x.predicted_mem_bytes),
                      fmt_rate(x.measured.get("tokens_per_s")) if x.measured else "-", cell(choose.outcome(x, answer)))
    return table


def refused_lines(cands: list[Any], shown: int = 4) -> list[str]:
    """The candidates the comparison's checks refused, one line per reason: how many, the reason, the first names."""
    by: dict[str, list[str]] = {}
    for x in cands:
        if x.refused:
            by.setdefault(x.refused, []).append(x.name)
    out = []
    for reason, names in sorted(by.items(), key=lambda item: -len(item[1])):
        more = f" and {len(names) - shown} more" if len(names) > shown else ""
        out.append(f"  cannot run here ({len(names)}): {reason}: {', '.join(names[:shown])}{more}")
    return out


def _print_table(console: Any, cands: list[Any], answer: dict[str, Any], unit: str) -> None:
    console.print(_table(cands, answer, unit))
    for line in refused_lines(cands):
        click.echo(clean(line))


@click.command("tune")
@click.option("--preset", "-p", required=True, help="Built-in preset name or path to a .toml file: its model, data, "
              "global batch and precision are kept; its runs are replaced by the search.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a preset key (as `run`).")
@click.option("--world-size", "-n", type=int, default=None, help="Ranks of every candidate (default: the preset's).")
@click.option("--device", "device_name", default=None, metavar="GPU", help="A what-if on this GPU kind (A100, H100, "
              "H200, B200) at --world-size: predicted only, nothing runs (measured when this machine has that GPU).")
@click.option("--device-memory", default=None, help="Memory per rank to fit in (e.g. 80GiB): candidates the memory "
              "model puts above it are out.")
@click.option("--budget", default="10m", show_default=True, help="Time for the proving runs (90s, 10m, 1h).")
@click.option("--steps", type=int, default=12, show_default=True, help="Steps of each proving run.")
@click.option("--rounds", "max_rounds", type=click.IntRange(1, 5), default=3, show_default=True, help="Rounds of the "
              "proof at most: after the first, the winner runs again beside the candidates within its noise (or the "
              "runner-up), the order reversed, while the budget allows.")
@click.option("--keep-within", type=float, default=0.4, show_default=True, help="Keep candidates predicted within "
              "this fraction of the best step time (the predictor's worst error on a loaded 2-core machine was 37%: "
              "docs/predict.md).")
@click.option("--allow", multiple=True, type=click.Choice(["precision"]), help="Also try what changes the "
              "mathematics: precision (bf16-autocast, and FSDP2's reduce_dtype bf16). Such candidates are marked.")
@click.option("--strategies", default="", metavar="A,B", help="Search only these strategies (default: every "
              "registered one that can run the model).")
@click.option("--calibrate", "calibrate_dirs", multiple=True, type=click.Path(file_okay=False), metavar="DIR",
              help="A finished comparison of this machine to calibrate on (default: a short run of the baseline).")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False), help="Where the calibration, the "
              "proving comparison and the winner's preset go (default ./shardscope-runs/<time>-<preset>-tune).")
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON (after the runs' progress).")
@click.option("--dry-run", is_flag=True, help="List the candidates, what cannot run and what does not fit; "
              "calibrate, predict and launch nothing.")
@trust_code_option
def tune_cmd(preset: str, overrides: tuple[str, ...], world_size: int | None, device_name: str | None,
             device_memory: str | None, budget: str, steps: int, keep_within: float, allow: tuple[str, ...],
             strategies: str, calibrate_dirs: tuple[str, ...], out_dir: str | None, as_json: bool,
             dry_run: bool, max_rounds: int) -> None:
    """Search the fastest configuration of a preset's model that fits, by prediction, and prove it by real runs."""
    from shardscope.analysis.tune import choose, space
    from shardscope.orchestrator import devices
    from shardscope.orchestrator.session import default_out_dir

    limit, budget_s = parse_device_memory(device_memory), parse_budget(budget)
    if steps < 3:
        fail_usage(f"--steps {steps}: at least 3 (the first step is left out of the median)")
    if not 0 < keep_within <= 10:
        fail_usage(f"--keep-within {keep_within}: a fraction between 0 and 10")
    sets = [*overrides, *([f"world_size={world_size}"] if world_size else [])]
    spec = _device(device_name)
    if spec is not None and spec.name.lower() not in devices.host_info(devices.resolve_device("auto")).detail.lower():
        from shardscope.cli.tune_what_if import what_if

        what_if(preset, sets, spec, world_size, limit, keep_within, allow, strategies, out_dir, as_json, dry_run)
        return
    comparison, dev = resolve(preset, sets)
    ws = world_size or comparison.world_size
    out = out_dir or default_out_dir(f"{comparison.name}-tune")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        fail_usage(f"--out {out}: exists and is not an empty directory (tune writes calibration/, proof/ and "
                   "winner.toml there)")
    only = tuple(x.strip() for x in strategies.split(",") if x.strip())
    try:
        for name in only:
            config.registry.get(name)
    except KeyError as err:
        fail_usage(f"--strategies {strategies}: {err.args[0]}")
    if dry_run:
        cands = space.candidates(comparison, world_size=ws, allow=allow, host=devices.host_info(dev), only=only)
        choose.prune_by_memory(comparison, cands, limit)
        click.echo(clean(f"# dry run: tune would calibrate, predict and measure the runnable candidates of "
                         f"{comparison.name} at world size {ws} within {budget_s:.0f} s; nothing is launched"))
        if as_json:
            click.echo(json.dumps([choose.as_dict(x) for x in cands], indent=2, default=str))
        else:
            from rich.console import Console

            _print_table(Console(width=160), cands, {}, "tokens/s")
        return
    from shardscope.analysis.tune import search

    given = ()
    if calibrate_dirs:
        from shardscope.cli.predictview import checked_calibrations

        given = tuple(checked_calibrations(calibrate_dirs))
    req = search.Request(comparison, ws, out, budget_s=budget_s, steps=steps, keep_within=keep_within, allow=allow,
                         only=only, device_memory=limit, calibrate_dirs=given, host=devices.host_info(dev),
                         max_rounds=max_rounds)
    try:
        cands, answer = search.search(req, lambda c, where, deadline: _run_quietly(c, where, dev, deadline),
                                      lambda line: click.echo(clean(line)))
    except search.CannotCalibrate as err:
        click.echo(clean(f"shardscope tune: {err}"), err=True)
        raise SystemExit(EXIT_FAILED) from None
    winner = next((x for x in cands if x.name == answer["winner"]), None)
    proof_s, where = answer["proof_s"], answer["proof_dir"]
    code = EXIT_OK if winner is not None else EXIT_FAILED
    if as_json:
        click.echo(json.dumps({**answer, "candidates": [choose.as_dict(x) for x in cands]}, indent=2, default=str))
    else:
        from rich.console import Console

        console = Console()
        if not console.is_terminal:
            console = Console(width=max(console.width, 160))
        _print_table(console, cands, answer, answer.get("unit", "tokens/s"))
        for line in answer["lines"]:  # the answer's own lines; each run against the baseline is in the report
            if " vs " not in line:
                click.echo(clean(f"  {line}"))
        click.echo(clean(f"  every measured run against {answer['proof_baseline']}: {RunDir(where).report}"))
        if winner is not None:
            click.echo(clean(f"winner: {winner.name} ({winner.run.strategy}, options {winner.run.options or 'default'}"
                             f"{', activation checkpointing' if winner.run.activation_checkpointing else ''})"
                             + (f"; not distinguishable from {', '.join(answer['tie'])} on this machine now"
                                if answer["tie"] else "")))
            if answer.get("against_preset"):
                click.echo(clean(f"  {answer['against_preset']}"))
            click.echo(clean(f"  preset: {answer['preset']}\n  launch: {answer['launch']}\n  report: {answer['report']}"))
            snippet = (answer.get("settings") or {}).get("code")
            if snippet:
                click.echo("  the settings to paste into your own training script, as the winner's rank 0 set it up:")
                click.echo(clean("\n".join(f"    {line}" for line in snippet.rstrip().splitlines())))
        else:
            click.echo("no winner: no candidate was measured ok")
        over = f", {proof_s - budget_s:.0f} s over: runs cost more than the calibration said" if proof_s > budget_s else ""
        click.echo(f"tune took {answer['elapsed_s']:.0f} s; the proving runs {proof_s:.0f} s of a {budget_s:.0f} s "
                   f"budget{over}")
    raise SystemExit(code)


def _device(name: str | None) -> Any:
    """The device table's entry for ``--device`` (None without one); exits 2 naming the known ones."""
    if not name:
        return None
    from shardscope.analysis.predict.devices import device_spec

    try:
        return device_spec(name)
    except KeyError as err:
        fail_usage(str(err.args[0]))
