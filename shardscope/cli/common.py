"""What the command line's commands share: exit codes, the one-line usage error, loading a preset
for this machine, signal handling, and the diff gate's tolerances.

Torch-free, like every module the command line loads up front.
"""

from __future__ import annotations

import json
import signal
import sys
from typing import Any

import click

from shardscope import config
from shardscope.config import ConfigError
from shardscope.presets import trust

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def fail_usage(message: str) -> None:
    """Print one error line on stderr and exit with code 2."""
    click.echo(f"shardscope: error: {message}", err=True)
    sys.exit(EXIT_USAGE)


def rewrite_summary(out_dir: str, summary: dict[str, Any]) -> None:
    """Write ``summary`` as ``out_dir``'s summary.json and report.md again (after a section was recomputed)."""
    from shardscope.analysis.report import render_markdown
    from shardscope.core.rundir import RunDir

    config.dump_json(RunDir(out_dir).summary, summary)
    markdown = render_markdown(summary)
    config.write_atomic(RunDir(out_dir).report, lambda fh: fh.write(markdown))  # never through a link out of it


def say_adjustments(comparison: config.Comparison, err: bool = False) -> None:
    """Print, one line each, what loading the preset changed for the user (e.g. the global batch)."""
    for line in comparison.adjustments:
        click.echo(f"shardscope: note: {line}", err=err)


def default_preset(device: str) -> str:
    """The preset used when none is named: ``smoke`` without a GPU, ``ddp-vs-fsdp`` with one."""
    return "ddp-vs-fsdp" if device == "cuda" else "smoke"


def launch_overrides(device: str | None, nnodes: int | None, node_rank: int | None, rdzv: str | None,
                     **strings: str | None) -> list[str]:
    """The ``--set launch.*`` overrides that the run command's launch flags stand for."""
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


_FLAGS = {"launch.device": "--device", "launch.nnodes": "--nnodes", "launch.node_rank": "--node-rank",
          "launch.rdzv_endpoint": "--rdzv-endpoint", "launch.records_endpoint": "--records-endpoint",
          "launch.rdzv_id": "--rdzv-id"}


def _as_flag(message: str, generated: list[str]) -> str:
    """An error about a ``--set`` that a command-line flag stood for names the flag the user typed."""
    for item in generated:
        head = f"--set {item}: "
        if message.startswith(head):
            key, _, value = item.partition("=")
            shown = json.loads(value) if value.startswith('"') else value
            return f"{_FLAGS.get(key, '--set ' + key)} {shown}: {message[len(head):]}"
    return message


def resolve(preset: str | None, overrides: list[str], generated: list[str] | tuple[str, ...] = ()
            ) -> tuple[config.Comparison, str]:
    """Load and validate a preset for this machine; return (comparison, device). Exits 2 on bad input.
    ``generated``: the overrides that ``launch_overrides`` made of flags (errors name the flag)."""
    from shardscope.orchestrator import devices

    try:
        if preset is not None and not preset.strip():  # `--preset ""` is a mistake, not "the default preset"
            config.preset_path(preset)
        requested = "auto"
        for item in overrides:
            keys, value = config.parse_override(item)
            if keys == ["launch", "device"]:
                requested = str(value)
        if requested not in config.DEVICES:
            raise ConfigError(f"--set launch.device = {requested!r}: allowed: {', '.join(config.DEVICES)}")
        if preset and requested == "auto":  # the preset's own launch.device, checked there (no host yet)
            requested = config.load_preset(preset, overrides).launch.device
        device = devices.resolve_device(requested)
        name = preset or default_preset(device)
        comparison = config.load_preset(name, overrides, host=devices.host_info(device))
    except ConfigError as err:
        fail_usage(_as_flag(str(err), list(generated)))
        raise  # unreachable; keeps type checkers calm
    return comparison, device



def terminate_on(signals: tuple[int, ...], handler: Any) -> None:
    """Install ``handler`` for each of ``signals`` where this thread and platform allow it."""
    for sig in signals:
        try:
            signal.signal(sig, handler)
        except (ValueError, OSError):  # not the main thread, or a signal this platform lacks
            pass



def trust_code_option(fn: Any) -> Any:
    """``--trust-code``: the code a run directory on this command line names (a module's entry) may run: re-runs,
    probes (presets/trust.py). Without it such a command says in one line what would run and exits 2."""
    def callback(ctx: Any, param: Any, value: bool) -> bool:
        if value:
            trust.trust_all()
        return value
    return click.option("--trust-code", is_flag=True, expose_value=False, is_eager=True, callback=callback,
                        help="Let the code named by the run directories given here run (a module's model.entry): "
                        "re-runs and probes build that model. Only for directories you trust.")(fn)


def tolerance_options(fn: Any) -> Any:
    """Add the diff gate's --loss-tol/--speed-tol/--mem-tol options (defaults from profiling.diff)."""
    from shardscope.analysis.diff import DEFAULT_LOSS_TOL, DEFAULT_MEM_TOL, DEFAULT_SPEED_TOL

    fn = click.option("--mem-tol", type=float, default=DEFAULT_MEM_TOL, show_default=True,
                      help="Fail when a run's peak memory grows by more than this fraction.")(fn)
    fn = click.option("--speed-tol", type=float, default=DEFAULT_SPEED_TOL, show_default=True,
                      help="Fail when a run's median throughput falls by more than this fraction and by more "
                      "than the noise range of the two runs' step-to-step spread.")(fn)
    return click.option("--loss-tol", type=float, default=DEFAULT_LOSS_TOL, show_default=True,
                        help="Fail when |Δloss| at a common step exceeds this (a non-finite loss on either "
                        "side always fails).")(fn)


def gate(old: str, new: str, maps: tuple[str, ...], loss_tol: float, speed_tol: float, mem_tol: float,
         as_json: bool = False, plots_dir: str | None = None) -> int:
    """Compare run directory ``new`` against ``old`` (as ``shardscope diff``); return the exit code."""
    import shardscope.cli.diffview as diffview
    from shardscope.analysis.diff import DiffInputError, Tolerances

    for name, value in (("--loss-tol", loss_tol), ("--speed-tol", speed_tol), ("--mem-tol", mem_tol)):
        if not value >= 0:
            fail_usage(f"{name} {value}: must be a number >= 0")
    try:
        return diffview.report(old, new, maps, Tolerances(loss_tol, speed_tol, mem_tol), as_json=as_json,
                               plots_dir=plots_dir)
    except DiffInputError as err:
        fail_usage(str(err))
        raise

