"""The commands that read or plan rather than run: ``presets``, ``diff``, ``report``, ``estimate``, ``slurm``.

Torch-free at import; ``estimate --traced`` loads torch when asked. Paths, names and preset text are printed as
text: control characters spelled ``\\xNN`` (``core.text.clean``), table cells as ``Text`` (never markup).
"""

from __future__ import annotations

import shlex
import sys

import click

from shardscope import config
from shardscope.cli.common import EXIT_FAILED, fail_usage, gate, say_adjustments, tolerance_options, trust_code_option
from shardscope.config import ConfigError
from shardscope.core.rundir import COMPARISON, SUMMARY, RunDir, read_summary
from shardscope.core.sizes import parse_size
from shardscope.core.text import clean

# What folding or reading a run directory's files of the wrong shape raises (a crafted or damaged file).
DATA_ERRORS = (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError)


@click.group("presets", invoke_without_command=True)
@click.pass_context
def presets_cmd(ctx: click.Context) -> None:
    """List built-in presets with the question each answers and their model and data; `show` prints one, `copy`
    writes one to a file of yours to edit."""
    if ctx.invoked_subcommand is None:
        _list_presets()


def _gpu_here() -> bool:
    from shardscope.orchestrator.devices import resolve_device

    try:
        return resolve_device("auto") == "cuda"
    except ConfigError:
        return False


@presets_cmd.command("show")
@click.argument("name")
def presets_show_cmd(name: str) -> None:
    """Print preset NAME's TOML, and which of its [cpu_overrides] apply on this machine."""
    try:
        path = config.preset_path(name)
        text = path.read_text(encoding="utf-8")
        config.read_preset(path)  # the same checks as a run: one line when it is not a preset
    except (ConfigError, OSError) as err:
        fail_usage(clean(str(err)))
        return
    click.echo(clean(f"# {path}"))
    click.echo(clean(text.rstrip("\n")))  # a preset file's bytes: no control reaches the terminal
    shrink = config.cpu_overrides(name)
    if shrink and not _gpu_here():
        click.echo(clean("\n# here (no GPU) its [cpu_overrides] apply: "
                         + ", ".join(f"{k} = {v!r}" for k, v in shrink.items())))
    elif shrink:
        click.echo("\n# a GPU is here: the sizes above are used as written ([cpu_overrides] apply without one)")


@presets_cmd.command("copy")
@click.argument("name")
@click.argument("file", type=click.Path(dir_okay=False))
def presets_copy_cmd(name: str, file: str) -> None:
    """Write preset NAME to FILE (a new file: an existing one is never overwritten), to edit and run with
    ``shardscope run --preset FILE``."""
    try:
        path = config.preset_path(name)
        text = path.read_text(encoding="utf-8")
        config.read_preset(path)
    except (ConfigError, OSError) as err:
        fail_usage(clean(str(err)))
        return
    try:
        with open(file, "x", encoding="utf-8") as fh:  # exclusive: refuses a file that exists, never follows one
            fh.write(text)
    except FileExistsError:
        fail_usage(clean(f"{file}: already exists; choose a new file (shardscope never overwrites it)"))
    except OSError as err:
        fail_usage(clean(f"{file}: cannot write: {err.strerror or err}"))
    click.echo(clean(f"wrote {file} (preset {name}); run it with: shardscope run --preset {shlex.quote(file)}"))


def _list_presets() -> None:
    """The table of built-in presets."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from shardscope.core import model_facts

    gpu = _gpu_here()

    table = Table(title="built-in presets (shardscope run --preset NAME)")
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("the question it answers")
    table.add_column("model; data (" + ("as written" if gpu else "here, no GPU: its \\[cpu_overrides] applied") + ")")
    host = config.HostInfo("cuda" if gpu else "cpu", 1 << 16)
    for name, desc in config.list_presets():
        try:
            c = config.load_preset(name, host=host)
            what = model_facts.short_label(c.model, c.data)
        except ConfigError as err:
            what = f"does not load: {err}"
        table.add_row(*(Text(clean(x)) for x in (name, desc, what)))  # a preset's words: text, never markup
    Console().print(table)
    click.echo("shardscope presets show NAME prints one; shardscope presets copy NAME FILE writes it to a file to edit. "
               "Your own model and data: model.kind = \"hf\" (model.path) or \"module\" (model.entry), data.kind = "
               "\"tokens\" or \"text\" (README: Your model and your data).")


@click.command("diff")
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
    sys.exit(gate(old, new, maps, loss_tol, speed_tol, mem_tol, as_json, plots_dir))


@click.command("report")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--calibrate", "calibrate_dirs", multiple=True, type=click.Path(file_okay=False), metavar="DIR",
              help="Predict each run from this finished comparison of this machine (as `shardscope predict "
              "--calibrate`), not from the comparison's own baseline run, beside what it measured. Repeatable.")
@click.option("--probe", is_flag=True, help="With --calibrate: measure each run's compute in a one-rank probe "
              "(as `shardscope predict --probe`; a subprocess per run) instead of carrying it over per FLOP.")
@trust_code_option
def report_cmd(out_dir: str, calibrate_dirs: tuple[str, ...], probe: bool) -> None:
    """Regenerate summary.json, report.md and plots from a run directory alone (exit 1 when the full report
    fails: the core summary is then written and the failure named in one line)."""
    from shardscope.analysis import fold
    from shardscope.analysis.report import write_reports
    from shardscope.cli.predictview import checked_calibrations, print_beside, refuse_untrusted, repredict

    try:
        comparison = fold.load_comparison(out_dir)
    except (OSError, ValueError) as err:
        fail_usage(clean(f"{out_dir}: not a shardscope run directory ({COMPARISON}: {err})"))
    if probe and not calibrate_dirs:
        fail_usage("--probe needs --calibrate DIR (a finished comparison of this machine; DIR itself will do)")
    calibrations = checked_calibrations(calibrate_dirs) if calibrate_dirs else []
    if probe:  # probes build each run's model: code named in these directories only when named again
        refuse_untrusted([out_dir, *calibrations])
    try:
        held = RunDir(out_dir).lock()
    except OSError as err:
        held = f"{out_dir}: cannot be locked: {err.strerror or err}"
    if held:  # a comparison still writing here: its own end writes the reports
        fail_usage(clean(held))
    try:
        states = fold.replay_states(out_dir)
    except DATA_ERRORS as err:  # a file of the wrong shape: one line, never a traceback
        fail_usage(clean(f"{out_dir}: unreadable ({type(err).__name__}: {err})"))
    before = {r.get("name"): r for r in (read_summary(out_dir) or {}).get("runs", [])
              if isinstance(r, dict) and isinstance(r.get("name"), str)}
    poorer = []
    for name, st in states.items():
        if not st.start and not st.steps_completed:
            click.echo(clean(f"{name}: no records (nothing readable under {RunDir(out_dir).run(name).metrics})"), err=True)
        had = before.get(name, {}).get("steps_completed")  # bool is an int: a file's true is no count
        had = None if isinstance(had, bool) else had
        if isinstance(had, int) and had > st.steps_completed:
            poorer.append(f"{name} ({had} steps in {SUMMARY}, {st.steps_completed} readable now)")
    if poorer:  # the summary may be the only copy of those figures: never replace it with less
        click.echo(clean(f"{SUMMARY} kept: its runs hold more than the records now readable: {', '.join(poorer)}"),
                   err=True)
        sys.exit(EXIT_FAILED)
    try:
        paths = write_reports(out_dir, comparison, states)
    except DATA_ERRORS as err:
        fail_usage(clean(f"{out_dir}: unreadable ({type(err).__name__}: {err})"))
    for label, path in sorted(paths.items()):
        click.echo(clean(f"{label}: {path}"))  # a path with a control character: spelled, never sent
    if calibrations and not paths.failed:
        print_beside(repredict(out_dir, calibrations, probe) or {})
    if paths.failed:  # write_reports named it on stderr; a report that failed is a failed command
        sys.exit(EXIT_FAILED)


@click.command("estimate")
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
    if config.cpu_overrides(preset):  # the user may have seen the shrunk sizes in a CPU run: say which these are
        click.echo(f"sizes: {comparison.name}'s full sizes (its [cpu_overrides] shrink only runs on a machine "
                   "without a GPU; an estimate is for the devices you name)")
    estimate.print_estimate(comparison, world_size, limit, traced=traced)


@click.command("slurm")
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
    from shardscope.orchestrator.slurm import node_local_paths, node_shape, refuse_control, sbatch_script

    try:
        refuse_control(preset, overrides)  # up front: before the preset is even read
        comparison = config.load_preset(preset, list(overrides))
        shape = node_shape(comparison.launch.device, comparison.world_size, nodes, gpus_per_node=gpus_per_node,
                           cpus_per_node=cpus_per_node, cpus_per_rank=cpus_per_rank)
        at_size = config.load_preset(preset, [*overrides, f"world_size={nodes * shape.ranks_per_node}",
                                              f"launch.nnodes={nodes}"])
    except (ConfigError, ValueError) as err:
        fail_usage(str(err))
    say_adjustments(at_size, err=True)  # stdout is the script
    for item in node_local_paths(at_size):
        click.echo(f"shardscope: warning: {clean(str(item))}: every node reads it; this folder is often local to one node "
                   "(copy it to a filesystem the nodes share, or to the same path on every node)", err=True)
    click.echo(sbatch_script(preset, nodes=nodes, shape=shape, time_limit=time_limit, overrides=list(overrides)),
               nl=False)

