"""The command line: ``shardscope`` opens the app; ``shardscope run --headless`` runs without it.

Exit codes (DESIGN.md): 0 every run ok; 1 a run failed, was stopped, or a requested check
failed; 2 bad usage or input, with one line on stderr and no traceback. Nothing here imports
torch: the app must open fast, and a broken torch must not break ``presets`` or ``report``.

This module holds the entry point (``main``), the app and the ``run`` and ``open`` commands;
``cli_common`` what commands share, ``headless_run`` the headless path, ``report_commands`` the
commands that read or plan (presets, diff, report, estimate, slurm).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import click

from shardscope import config
import shardscope.cli.headless_run as headless_run
from shardscope.cli.common import (  # noqa: F401  (EXIT_USAGE: importable from cli as before)
    EXIT_FAILED, EXIT_OK, EXIT_USAGE, fail_usage, gate, launch_overrides, resolve, say_adjustments, terminate_on,
    tolerance_options, trust_code_option,
)
from shardscope.cli.explainview import explain_cmd
from shardscope.cli.predictview import checked_calibrations, predict_cmd, print_beside, refuse_untrusted, repredict
from shardscope.cli.recommendview import parse_device_memory, recommend_cmd
from shardscope.cli.report_commands import diff_cmd, estimate_cmd, presets_cmd, report_cmd, slurm_cmd
from shardscope.cli.tune import tune_cmd
from shardscope.cli.whyview import why_cmd
from shardscope.core.rundir import COMPARISON, RunDir


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="shardscope")
@click.pass_context
def main(ctx: click.Context) -> None:
    """Run PyTorch's parallel training strategies side by side and see how they differ.

    With no command, opens the terminal app.
    """
    if ctx.invoked_subcommand is None:
        _open_app(preset=None)

for _command in (explain_cmd, recommend_cmd, presets_cmd, diff_cmd, report_cmd, estimate_cmd, slurm_cmd, predict_cmd,
                 why_cmd, tune_cmd):
    main.add_command(_command)


def _kill_runs_and_exit(signum: int, frame: Any) -> None:
    """SIGTERM/SIGHUP while the app runs: stop every torchrun job this process started, then exit."""
    from shardscope.orchestrator.session import terminate_all

    terminate_all()
    os._exit(128 + signum)


def _open_app(**kwargs: Any) -> None:
    """Open the terminal app (built by ``tui.app.build_app``) and exit with its code."""
    try:
        from shardscope.tui.app import build_app
    except ImportError as err:
        fail_usage(f"the terminal app is unavailable ({err}); use `shardscope run --headless`")
    app = build_app(**kwargs)
    terminate_on((signal.SIGTERM, signal.SIGHUP), _kill_runs_and_exit)
    code = app.run()
    sys.exit(code if isinstance(code, int) else EXIT_OK)

def check_records_secret() -> None:
    """Records over TCP need the comparison's secret on every node (record_wire): exit 2 without it."""
    from shardscope.core import record_secret

    try:
        secret = record_secret.secret_from_env()
    except (OSError, ValueError) as err:
        fail_usage(f"--records-endpoint: the records secret: {err}")
    if secret is None:
        fail_usage(f"--records-endpoint: records over TCP need this comparison's secret on every node: "
                   f"`shardscope records-secret FILE` makes one (mode 0600); copy FILE to each node and set "
                   f"{record_secret.SECRET_FILE_ENV}=FILE (or {record_secret.SECRET_ENV} to its content)")


@main.command("records-secret")
@click.argument("path", type=click.Path(dir_okay=False))
def records_secret_cmd(path: str) -> None:
    """Write a new secret for records over TCP to PATH (mode 0600; an existing file is refused)."""
    from shardscope.core import record_secret

    try:
        record_secret.write_secret(path, record_secret.new_secret())
    except OSError as err:
        fail_usage(f"{path}: {err.strerror or err}")
    click.echo(f"wrote a new records secret to {path} (mode 0600); on every node: "
               f"export {record_secret.SECRET_FILE_ENV}={os.path.abspath(path)}")


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
@click.option("--records-endpoint", default=None, help="Several nodes without a shared filesystem: host:port where "
              "node 0 receives the other nodes' records over TCP (every node passes the same value).")
@click.option("--rdzv-id", default=None, help="Prefix of each run's rendezvous id; unique per job (several nodes).")
@click.option("--slurm-task", is_flag=True, help="One task of an sbatch job (`shardscope slurm`): node rank from "
              "SLURM_NODEID; exit 0 once this orchestrator finished, whatever the runs' verdicts.")
@click.option("--check-parity", is_flag=True, help="With --headless: exit 1 if a like-for-like run's loss differs from the baseline by more than loss_tolerance.")
@click.option("--against", default=None, type=click.Path(file_okay=False),
              help="With --headless: afterwards, gate this comparison against a stored one (as `shardscope diff`).")
@click.option("--device-memory", default=None, help="With --headless: the recommendation says which runs would "
              "not fit this device memory (e.g. 80GiB) and from which world size they would.")
@click.option("--calibrate", "calibrate_dirs", multiple=True, type=click.Path(file_okay=False), metavar="DIR",
              help="With --headless: the report sets each run beside its prediction from this finished comparison "
              "of this machine (as `shardscope predict --calibrate`) instead of from the baseline run. Repeatable.")
@click.option("--probe", is_flag=True, help="With --calibrate: each run's compute measured by a one-rank probe "
              "(as `shardscope predict --probe`) instead of carried over per FLOP.")
@tolerance_options
@trust_code_option
def run_cmd(preset: str | None, overrides: tuple[str, ...], out_dir: str | None, headless: bool, dry_run: bool,
            device: str | None, nnodes: int | None, node_rank: int | None, rdzv_endpoint: str | None,
            records_endpoint: str | None, rdzv_id: str | None, slurm_task: bool, check_parity: bool, against: str | None, device_memory: str | None,
            calibrate_dirs: tuple[str, ...], probe: bool, loss_tol: float, speed_tol: float, mem_tol: float) -> None:
    """Run a comparison: every run of the preset, one after another, as real torchrun jobs."""
    limit = parse_device_memory(device_memory)
    if slurm_task:
        node_rank = headless_run.slurm_node_rank(node_rank)
    flags = launch_overrides(device, nnodes, node_rank, rdzv_endpoint, rdzv_id=rdzv_id,
                             records_endpoint=records_endpoint)
    all_overrides = list(overrides) + flags
    comparison, dev = resolve(preset, all_overrides, flags)
    comparison = config.with_control(comparison)  # the A/A control: the baseline again, last (between-run noise)
    from shardscope.orchestrator.session import Session, default_out_dir

    out = out_dir or default_out_dir(comparison.name)
    say_adjustments(comparison, err=not dry_run)
    from shardscope.orchestrator.preflight import check_memory

    over = check_memory(comparison, dev)  # judged before the start, --dry-run included: nothing launched
    if over:
        fail_usage(over)
    if dry_run:
        headless_run.print_dry_run(comparison, dev, out)
        return
    if comparison.launch.records_endpoint and comparison.launch.nnodes > 1:
        check_records_secret()
    if check_parity and not headless:  # the app shows the loss differences; only the headless exit code gates
        fail_usage("--check-parity needs --headless (the app has no exit code to fail; it shows the loss "
                   "difference of every run)")
    if against and not (headless and RunDir(against).holds_comparison()):
        fail_usage(f"--against {against}: " + ("needs --headless" if not headless else
                                               f"not a shardscope run directory (no {COMPARISON})"))
    if calibrate_dirs and not headless:
        fail_usage(f"--calibrate {' '.join(calibrate_dirs)}: needs --headless (after a run in the app: "
                   "`shardscope report DIR --calibrate CAL`)")
    if probe and not calibrate_dirs:
        fail_usage("--probe needs --calibrate DIR (a finished comparison of this machine)")
    calibrations = checked_calibrations(calibrate_dirs) if calibrate_dirs else []
    if probe:  # on CPU the calibration's runs are probed too: their code only when this command line trusts it
        refuse_untrusted(calibrations)
    from shardscope.orchestrator.preflight import check_space, claim_out_dir

    short = check_space(comparison, out)  # traces dominate: refuse a directory that cannot hold them
    if short:
        fail_usage(short)
    claimed = claim_out_dir(out, comparison.launch.node_rank, [r.name for r in comparison.runs])  # before the app opens, too; held until exit
    if claimed:
        fail_usage(f"--out {claimed}")
    if not headless:
        _open_app(preset=comparison.source, overrides=all_overrides, out_dir=out, autostart=True)
        return
    session = Session(comparison, out, device=dev)
    # SIGTERM (a scheduler, `timeout`, `kill`) and SIGHUP take the same path as Ctrl-C: runs are
    # stopped, marked stopped, and the summary is still written. SIGINT too, explicitly: a process
    # started in the background by a non-interactive shell inherits SIGINT ignored, and
    # `kill -INT` must still stop it cleanly.
    terminate_on((signal.SIGINT, signal.SIGTERM, signal.SIGHUP), signal.default_int_handler)
    code = headless_run.run_headless(session, limit)
    summary = headless_run.load_summary(out)
    if calibrations and summary is not None and comparison.launch.node_rank == 0:
        try:
            summary = repredict(out, calibrations, probe) or summary
            print_beside(summary)
        except KeyboardInterrupt:  # summary.json and report.md are replaced whole or not at all
            click.echo("interrupted: the report keeps its prediction from the baseline run", err=True)
            code = max(code, EXIT_FAILED)
    if check_parity and summary is not None:  # a verdict line per run, whatever the others' status
        code = max(code, headless_run.check_parity(summary))
    if against and summary is not None:
        code = max(code, gate(against, out, (), loss_tol, speed_tol, mem_tol))
    if slurm_task:  # finished: the verdict is in the summary; a non-zero exit would make srun kill other nodes
        click.echo(f"shardscope: node {comparison.launch.node_rank} finished (exit {code} without --slurm-task)")
        code = EXIT_OK
    sys.exit(code)

@main.command("open")
@click.argument("out_dir", type=click.Path(file_okay=False))
@trust_code_option
def open_cmd(out_dir: str) -> None:
    """Open a finished or interrupted run directory in the app."""
    if not RunDir(out_dir).holds_comparison():
        fail_usage(f"{out_dir}: not a shardscope run directory (no {COMPARISON})")
    _open_app(replay_dir=out_dir)

if __name__ == "__main__":  # pragma: no cover
    main()
