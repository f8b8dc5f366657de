"""The command line: ``shardscope`` opens the app; ``shardscope run --headless`` runs without it.

Exit codes (DESIGN.md): 0 every run ok; 1 a run failed, was stopped, or a requested check
failed; 2 bad usage or input, with one line on stderr and no traceback. Nothing here imports
torch: the app must open fast, and a broken torch must not break ``presets`` or ``report``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import click

from shardscope import config
from shardscope.config import ConfigError
from shardscope.explainview import explain_cmd
from shardscope.numbers import read_json
from shardscope.recommendview import (
    parse_device_memory,
    print_recommendation,
    recommend_cmd,
    refit,
)
from shardscope.sizes import parse_size

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def fail_usage(message: str) -> None:
    """Print one error line on stderr and exit with code 2."""
    click.echo(f"shardscope: error: {message}", err=True)
    sys.exit(EXIT_USAGE)


def say_adjustments(comparison: config.Comparison, err: bool = False) -> None:
    """Print, one line each, what loading the preset changed for the user (e.g. the global batch)."""
    for line in comparison.adjustments:
        click.echo(f"shardscope: note: {line}", err=err)


def default_preset(device: str) -> str:
    """The preset used when none is named: ``smoke`` without a GPU, ``ddp-vs-fsdp`` with one."""
    return "ddp-vs-fsdp" if device == "cuda" else "smoke"


def _launch_overrides(device: str | None, nnodes: int | None, node_rank: int | None, rdzv: str | None,
                      **strings: str | None) -> list[str]:
    out = [f"launch.{key}={json.dumps(value)}" for key, value in strings.items() if value]
    if device:
        out.append(f"launch.device={json.dumps(device)}")
    if nnodes is not None:
        out.append(f"launch.nnodes={nnodes}")
    if node_rank is not None:
        out.append(f"launch.node_rank={node_rank}")
    if rdzv:
        out.append(f"launch.rdzv_endpoint={json.dumps(rdzv)}")
    return out


def resolve(preset: str | None, overrides: list[str]) -> tuple[config.Comparison, str]:
    """Load and validate a preset for this machine; return (comparison, device). Exits 2 on bad input."""
    from shardscope.orchestrator import devices

    try:
        requested = "auto"
        for item in overrides:
            keys, value = config.parse_override(item)
            if keys == ["launch", "device"]:
                requested = str(value)
        if requested not in config.DEVICES:
            raise ConfigError(f"--set launch.device = {requested!r}: allowed: {', '.join(config.DEVICES)}")
        device = devices.resolve_device(requested)
        name = preset or default_preset(device)
        comparison = config.load_preset(name, overrides, host=devices.host_info(device))
    except ConfigError as err:
        fail_usage(str(err))
        raise  # unreachable; keeps type checkers calm
    return comparison, device


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="shardscope")
@click.pass_context
def main(ctx: click.Context) -> None:
    """Run PyTorch's parallel training strategies side by side and see how they differ.

    With no command, opens the terminal app.
    """
    if ctx.invoked_subcommand is None:
        _open_app(preset=None)


main.add_command(explain_cmd)
main.add_command(recommend_cmd)


def _terminate_on(signals: tuple[int, ...], handler: Any) -> None:
    for sig in signals:
        try:
            signal.signal(sig, handler)
        except (ValueError, OSError):  # not the main thread, or a signal this platform lacks
            pass


def _kill_runs_and_exit(signum: int, frame: Any) -> None:
    """SIGTERM/SIGHUP while the app runs: stop every torchrun job this process started, then exit."""
    from shardscope.orchestrator.session import terminate_all

    terminate_all()
    os._exit(128 + signum)


def _open_app(**kwargs: Any) -> None:
    try:
        from shardscope.tui.app import build_app
    except ImportError as err:
        fail_usage(f"the terminal app is unavailable ({err}); use `shardscope run --headless`")
    app = build_app(**kwargs)
    _terminate_on((signal.SIGTERM, signal.SIGHUP), _kill_runs_and_exit)
    code = app.run()
    sys.exit(code if isinstance(code, int) else EXIT_OK)


@main.command("presets")
def presets_cmd() -> None:
    """List built-in presets with their descriptions."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="built-in presets (shardscope run --preset NAME)")
    table.add_column("name", style="bold")
    table.add_column("description")
    for name, desc in config.list_presets():
        table.add_row(name, desc)
    Console().print(table)


def tolerance_options(fn: Any) -> Any:
    """Add the diff gate's --loss-tol/--speed-tol/--mem-tol options (defaults from profiling.diff)."""
    from shardscope.profiling.diff import DEFAULT_LOSS_TOL, DEFAULT_MEM_TOL, DEFAULT_SPEED_TOL

    fn = click.option("--mem-tol", type=float, default=DEFAULT_MEM_TOL, show_default=True,
                      help="Fail when a run's peak memory grows by more than this fraction.")(fn)
    fn = click.option("--speed-tol", type=float, default=DEFAULT_SPEED_TOL, show_default=True,
                      help="Fail when a run's median throughput falls by more than this fraction and by more "
                      "than the noise band of the two runs' step-to-step spread.")(fn)
    return click.option("--loss-tol", type=float, default=DEFAULT_LOSS_TOL, show_default=True,
                        help="Fail when |Δloss| at a common step exceeds this (a non-finite loss on either "
                        "side always fails).")(fn)


def _gate(old: str, new: str, maps: tuple[str, ...], loss_tol: float, speed_tol: float, mem_tol: float,
          as_json: bool = False, plots_dir: str | None = None) -> int:
    from shardscope import diffview
    from shardscope.profiling.diff import DiffInputError, Tolerances

    for name, value in (("--loss-tol", loss_tol), ("--speed-tol", speed_tol), ("--mem-tol", mem_tol)):
        if not value >= 0:
            fail_usage(f"{name} {value}: must be a number >= 0")
    try:
        return diffview.report(old, new, maps, Tolerances(loss_tol, speed_tol, mem_tol), as_json=as_json,
                               plots_dir=plots_dir)
    except DiffInputError as err:
        fail_usage(str(err))
        raise


@main.command("diff")
@click.argument("old", type=click.Path(file_okay=False))
@click.argument("new", type=click.Path(file_okay=False))
@click.option("--map", "maps", multiple=True, metavar="OLD_RUN=NEW_RUN",
              help="Compare runs whose names differ (repeatable); other runs are matched by name.")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON instead of tables.")
@click.option("--plots", "plots_dir", default=None, type=click.Path(file_okay=False),
              help="Where to write one loss PNG per run (default NEW/diff).")
@tolerance_options
def diff_cmd(old: str, new: str, maps: tuple[str, ...], as_json: bool, plots_dir: str | None, loss_tol: float,
             speed_tol: float, mem_tol: float) -> None:
    """Compare two comparison directories run by run: loss, throughput, memory, bytes, settings.

    Exit 0 when every matched run is the same within tolerance, 1 when a difference passes a
    tolerance or a new run did not end ok, 2 on bad input. Runs on one side only are listed.
    """
    sys.exit(_gate(old, new, maps, loss_tol, speed_tol, mem_tol, as_json, plots_dir))


@main.command("run")
@click.option("--preset", "-p", default=None, help="Built-in preset name or path to a .toml file.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a preset key (dotted): steps=50, model.n_layers=2, runs.fsdp2.options.reshard_after_forward=false.")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False), help="Run directory (default ./shardscope-runs/<time>-<preset>).")
@click.option("--headless", is_flag=True, help="No app: a live table, then the comparison table.")
@click.option("--dry-run", is_flag=True, help="Print the resolved settings and torchrun commands; launch nothing.")
@click.option("--device", type=click.Choice(config.DEVICES), default=None, help="Force cpu or cuda (default auto).")
@click.option("--nnodes", type=int, default=None, help="Number of nodes (torchrun rendezvous).")
@click.option("--node-rank", type=int, default=None, help="This node's rank when --nnodes > 1.")
@click.option("--rdzv-endpoint", default=None, help="host:port of node 0's rendezvous for several nodes "
              "(run i of the comparison uses port + i).")
@click.option("--rdzv-id", default=None, help="Prefix of each run's rendezvous id; unique per job (several nodes).")
@click.option("--slurm-task", is_flag=True, help="One task of an sbatch job (`shardscope slurm`): node rank from "
              "SLURM_NODEID; exit 0 once this orchestrator finished, whatever the runs' verdicts.")
@click.option("--check-parity", is_flag=True, help="Exit 1 if a like-for-like run's loss differs from the baseline by more than loss_tolerance.")
@click.option("--against", default=None, type=click.Path(file_okay=False),
              help="With --headless: afterwards, gate this comparison against a stored one (as `shardscope diff`).")
@click.option("--device-memory", default=None, help="With --headless: the recommendation says which runs would "
              "not fit this device memory (e.g. 80GiB) and from which world size they would.")
@tolerance_options
def run_cmd(preset: str | None, overrides: tuple[str, ...], out_dir: str | None, headless: bool, dry_run: bool,
            device: str | None, nnodes: int | None, node_rank: int | None, rdzv_endpoint: str | None,
            rdzv_id: str | None, slurm_task: bool, check_parity: bool, against: str | None, device_memory: str | None,
            loss_tol: float, speed_tol: float, mem_tol: float) -> None:
    """Run a comparison: every run of the preset, one after another, as real torchrun jobs."""
    limit = parse_device_memory(device_memory)
    if slurm_task:
        node_rank = _slurm_node_rank(node_rank)
    all_overrides = list(overrides) + _launch_overrides(device, nnodes, node_rank, rdzv_endpoint, rdzv_id=rdzv_id)
    comparison, dev = resolve(preset, all_overrides)
    from shardscope.orchestrator.session import Session, default_out_dir

    out = out_dir or default_out_dir(comparison.name)
    say_adjustments(comparison, err=not dry_run)
    if dry_run:
        _print_dry_run(comparison, dev, out)
        return
    if against and not (headless and os.path.isfile(os.path.join(against, "comparison.json"))):
        fail_usage(f"--against {against}: " + ("needs --headless" if not headless else
                                               "not a shardscope run directory (no comparison.json)"))
    from shardscope.orchestrator.preflight import check_space
    from shardscope.orchestrator.replay import used_out_dir_error

    if comparison.launch.node_rank == 0 and used_out_dir_error(out):  # before the app opens, too
        fail_usage(f"--out {used_out_dir_error(out)}")
    short = check_space(comparison, out)  # traces dominate: refuse a directory that cannot hold them
    if short:
        fail_usage(short)
    if not headless:
        _open_app(preset=comparison.source, overrides=all_overrides, out_dir=out, autostart=True)
        return
    session = Session(comparison, out, device=dev)
    # SIGTERM (a scheduler, `timeout`, `kill`) and SIGHUP take the same path as Ctrl-C: runs are
    # stopped, marked stopped, and the summary is still written.
    _terminate_on((signal.SIGTERM, signal.SIGHUP), signal.default_int_handler)
    code = _run_headless(session, limit)
    summary = _load_summary(out)
    if check_parity and summary is not None and code == EXIT_OK:
        code = _check_parity(summary)
    if against and summary is not None:
        code = max(code, _gate(against, out, (), loss_tol, speed_tol, mem_tol))
    if slurm_task:  # finished: the verdict is in the summary; a non-zero exit would make srun kill other nodes
        click.echo(f"shardscope: node {comparison.launch.node_rank} finished (exit {code} without --slurm-task)")
        code = EXIT_OK
    sys.exit(code)


def _slurm_node_rank(given: int | None) -> int:
    """This task's node rank: ``SLURM_NODEID`` (exits 2 when it is missing or disagrees with --node-rank)."""
    raw = os.environ.get("SLURM_NODEID", "")
    if not raw.isdigit():
        fail_usage(f"--slurm-task: SLURM_NODEID = {raw!r}: expected a node index (run this under srun)")
    if given is not None and given != int(raw):
        fail_usage(f"--node-rank {given}: differs from SLURM_NODEID = {raw}; give one")
    return int(raw)


def _print_dry_run(comparison: config.Comparison, device: str, out: str) -> None:
    from shardscope.orchestrator.session import Session

    resolved = comparison.to_dict()
    click.echo(f"# preset {comparison.name} ({comparison.source}) on {device}; run directory {out}")
    click.echo(json.dumps(resolved, indent=2))
    for plan in Session(comparison, out, device=device).plans():
        click.echo(f"# run {plan.run}")
        click.echo(plan.shell_line())


def _run_headless(session, device_memory_bytes: int | None = None) -> int:
    from rich.console import Console

    from shardscope.headless import HeadlessView, comparison_table, loss_table, rank_timing_table

    console = Console()
    if not console.is_terminal:  # logs and pipes: wide enough for the comparison table
        console = Console(width=max(console.width, 160))
    view = HeadlessView(console, session.run_names)
    session.subscribe(view)
    session.start()
    interrupted = False

    def wait_step() -> bool:
        nonlocal interrupted
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
    summary = _load_summary(session.out_dir)
    if summary is not None and device_memory_bytes and session.comparison.launch.node_rank == 0:
        summary = refit(session.out_dir, device_memory_bytes) or summary
    if summary is not None:
        console.print(comparison_table(summary))
        console.print(loss_table(summary))
        timing = rank_timing_table(summary)
        if timing is not None:
            console.print(timing)
        for entry in (summary.get("stragglers") or {}).values():
            for flag in entry.get("flagged", []):
                console.print(f"[bold yellow]{flag['line']}[/]", highlight=False)
    for notice in view.notices:
        if notice.level != "info":
            console.print(f"[yellow]{notice.level}:[/] {notice.text}", markup=True, highlight=False)
    if session.comparison.launch.node_rank > 0:
        console.print(f"node {session.comparison.launch.node_rank}: node 0 writes the summary and reports in "
                      f"{session.out_dir}", highlight=False)
        return code
    console.print("written:")
    for label, path in sorted((session.paths or {}).items()):
        console.print(f"  {label}: {path}", highlight=False)
    print_recommendation(summary or {}, console)
    return code


def _load_summary(out: str) -> dict[str, Any] | None:
    try:
        return read_json(os.path.join(out, "summary.json"))
    except (OSError, ValueError):
        return None


def _check_parity(summary: dict[str, Any]) -> int:
    tol = float(summary.get("loss_tolerance", 1e-5))
    bad = []
    for r in summary.get("runs", []):
        if r.get("fairness_flags"):
            click.echo(f"parity: {r['name']} skipped (not like-for-like: {'; '.join(r['fairness_flags'])})")
            continue
        diff = r.get("loss_max_abs_diff")
        if diff is not None and diff > tol:
            bad.append(f"{r['name']} max |Δloss| {diff:.3e} > {tol:g}")
    for line in bad:
        click.echo(f"parity check failed: {line}", err=True)
    return EXIT_FAILED if bad else EXIT_OK


@main.command("report")
@click.argument("out_dir", type=click.Path(file_okay=False))
def report_cmd(out_dir: str) -> None:
    """Regenerate summary.json, report.md and plots from a run directory alone."""
    from shardscope.profiling import fold
    from shardscope.profiling.report import write_reports

    try:
        comparison = fold.load_comparison(out_dir)
    except (OSError, ValueError) as err:
        fail_usage(f"{out_dir}: not a shardscope run directory (comparison.json: {err})")
    states = fold.replay_states(out_dir)
    paths = write_reports(out_dir, comparison, states)
    for label, path in sorted(paths.items()):
        click.echo(f"{label}: {path}")


@main.command("open")
@click.argument("out_dir", type=click.Path(file_okay=False))
def open_cmd(out_dir: str) -> None:
    """Open a finished or interrupted run directory in the app."""
    if not os.path.isfile(os.path.join(out_dir, "comparison.json")):
        fail_usage(f"{out_dir}: not a shardscope run directory (no comparison.json)")
    _open_app(replay_dir=out_dir)


@main.command("estimate")
@click.option("--preset", "-p", required=True, help="Built-in preset name or path.")
@click.option("--world-size", "-n", type=int, required=True, help="World size to predict for.")
@click.option("--device-memory", default=None, help="Device memory to check against, e.g. 80GiB.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a preset key.")
@click.option("--traced", is_flag=True, help="Also run one rank of each traceable run on a fake process group "
              "with fake tensors (torch's memory tracker) and show its measured bytes.")
def estimate_cmd(preset: str, world_size: int, device_memory: str | None, overrides: tuple[str, ...],
                 traced: bool) -> None:
    """Predict per-rank memory of each run at a world size this machine may not have."""
    try:
        comparison = config.load_preset(preset, [*overrides, f"world_size={world_size}"])
        from shardscope.profiling import estimate
    except ConfigError as err:
        fail_usage(str(err))
    except ImportError as err:
        fail_usage(f"memory estimates are unavailable: {err}")
    limit = None
    if device_memory:
        try:
            limit = parse_size(device_memory)
        except ValueError as err:
            fail_usage(f"--device-memory {device_memory!r}: {err}")
    say_adjustments(comparison)
    estimate.print_estimate(comparison, world_size, limit, traced=traced)


@main.command("slurm")
@click.option("--preset", "-p", required=True, help="Built-in preset name or path.")
@click.option("--nodes", type=int, default=1, show_default=True)
@click.option("--gpus-per-node", type=int, default=None, help="GPU nodes: ranks (GPUs) per node.")
@click.option("--cpus-per-node", type=int, default=None, help="CPU nodes: ranks per node (gloo on CPU).")
@click.option("--cpus-per-rank", type=int, default=None, help="CPUs asked per rank [default: 1 on CPU, 4 on GPU].")
@click.option("--time", "time_limit", default="01:00:00", show_default=True)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE")
def slurm_cmd(preset: str, nodes: int, gpus_per_node: int | None, cpus_per_node: int | None,
              cpus_per_rank: int | None, time_limit: str, overrides: tuple[str, ...]) -> None:
    """Print an sbatch script that runs the preset across SLURM nodes (submit it with sbatch).

    Without --gpus-per-node or --cpus-per-node, the preset's world size is split over the nodes, on GPUs
    unless the preset (or --set launch.device) says "cpu".
    """
    from shardscope.orchestrator.slurm import node_shape, sbatch_script

    try:
        comparison = config.load_preset(preset, list(overrides))
        shape = node_shape(comparison.launch.device, comparison.world_size, nodes, gpus_per_node=gpus_per_node,
                           cpus_per_node=cpus_per_node, cpus_per_rank=cpus_per_rank)
        at_size = config.load_preset(preset, [*overrides, f"world_size={nodes * shape.ranks_per_node}",
                                              f"launch.nnodes={nodes}"])
    except (ConfigError, ValueError) as err:
        fail_usage(str(err))
    say_adjustments(at_size, err=True)  # stdout is the script
    click.echo(sbatch_script(preset, nodes=nodes, shape=shape, time_limit=time_limit, overrides=list(overrides)),
               nl=False)


if __name__ == "__main__":  # pragma: no cover
    main()
