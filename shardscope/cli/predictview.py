"""``shardscope predict --calibrate DIR --preset P``: step time, tokens/s and peak memory of every run of a
preset, predicted from a finished comparison of this machine (or, with ``--device``, as a what-if on GPUs).

The figures come from ``profiling.predict``; this module only loads the preset for the machine the
prediction is for and prints: names, notes and reasons from presets and run directories as text (table cells are
``Text``, lines print with markup off and control characters spelled ``\\xNN``). No torch is imported.
"""

from __future__ import annotations

import dataclasses
import os
import json
import sys
from typing import Any

import click

from shardscope.cli.common import trust_code_option
from shardscope.presets import trust

from shardscope import config
from shardscope.config import ConfigError
from shardscope.core.numbers import fmt_bytes, json_ready
from shardscope.core.text import clean


def _fail(message: str) -> None:
    click.echo(clean(f"shardscope: error: {message}"), err=True)
    sys.exit(2)


def _text(value: Any) -> Any:
    """A table cell or title from outside (a run, a strategy, a preset's path): text, never markup."""
    from rich.text import Text

    return Text(clean(str(value)))


def load_for(preset: str, overrides: list[str], backend: str | None, what_if: bool) -> config.Comparison:
    """The preset as it would run on the predicted machine: full size for a GPU what-if or a GPU calibration,
    shrunk by its ``cpu_overrides`` for a CPU calibration. Any world size is accepted (it is a prediction).
    Raises ConfigError."""
    if what_if or backend == "nccl":
        host = config.HostInfo("cuda", 1 << 20, "predicted GPUs")
    else:
        host = dataclasses.replace(config.cpu_host(), max_ranks_per_node=1 << 20)
    return config.load_preset(preset, overrides, host=host)


def what_if(world_size: int | None, device: str | None, option: str = "--world-size") -> tuple[str | None, str]:
    """The what-if a ``--world-size``/``--device`` pair names: (the GPU kind from the datasheet table, or None for
    this machine; the first line of the output). A world size this machine cannot host needs a ``--device``: a GPU
    from the table, or ``cpu`` for ranks sharing this machine's cores, a scenario said in the first line. Exits 2
    with one line otherwise."""
    from shardscope.analysis.predict.devices import DEVICES
    from shardscope.orchestrator import devices as machine

    kind = (device or "").strip().upper()
    if device and kind != "CPU" and kind not in DEVICES:
        _fail(f"--device {device!r}: known: {', '.join(DEVICES)}, or cpu (ranks sharing this machine's cores)")
    here = machine.host_info(machine.resolve_device("auto"))
    hosts = here.max_ranks_per_node if here.device == "cuda" else os.cpu_count() or 1
    if world_size and world_size > hosts and not device:
        kinds = "GPUs" if here.device == "cuda" else "cores"
        _fail(f"{option} {world_size}: this machine has {hosts} {kinds} ({here.detail}); name the what-if: --device "
              f"{next(iter(DEVICES))} (or another GPU of the table: {', '.join(DEVICES)}), or --device cpu for {world_size} "
              f"ranks sharing this machine's {os.cpu_count() or 1} cores")
    if kind == "CPU":
        cores = os.cpu_count() or 1
        ranks = world_size or 0
        return None, (f"what-if: {ranks} ranks sharing this machine's {cores} cores ({ranks / cores:g} per core)"
                      if ranks else f"this machine's {cores} cores")
    if kind:
        return kind, f"what-if: {world_size or 'the preset’s'} ranks on {kind} GPUs (datasheet figures, not measured here)"
    return None, ""


def checked_calibrations(dirs: tuple[str, ...] | list[str]) -> list[str]:
    """``--calibrate DIR`` of ``run`` and ``report``: each a finished comparison this machine can be calibrated on
    (as ``predict --calibrate`` reads them); exits 2 with one line otherwise. Returns the directories."""
    from shardscope.analysis.predict import predictor as predict
    from shardscope.analysis.predict.work import NotPredicted

    try:
        predict.calibrate(list(dirs))
    except NotPredicted as err:
        _fail(f"--calibrate {' '.join(dirs)}: cannot calibrate on it: {err}")
    except (OSError, ValueError) as err:
        _fail(f"--calibrate: not a finished shardscope run directory ({err})")
    return list(dirs)


def refuse_untrusted(dirs: tuple[str, ...] | list[str]) -> None:
    """Before a probe builds the models of ``dirs``' runs: exit 2 with one line when one names code (a module) that
    this command line did not trust (``--trust-code``, presets/trust.py)."""
    from shardscope.analysis import fold

    for d in dirs:
        refused = trust.refusal(fold.load_comparison(d))
        if refused:
            _fail(refused)


def probed(comparison: config.Comparison, dirs: list[str], model: Any) -> tuple[Any, dict[str, Any]]:
    """``--probe``: each run of ``comparison`` probed (a one-rank subprocess each, progress on stderr), and on CPU
    ``model`` given what the calibration's own real steps paid for their collectives. Returns (model, probes)."""
    from shardscope.analysis.predict import predictor as predict
    from shardscope.analysis.predict.probe import probe_runs

    probes = probe_runs(comparison, progress=lambda text: click.echo(text, err=True), device=model.device)
    if model.backend == "gloo":
        from shardscope.analysis.predict import comm_cost as predict_comm_cost

        model = predict_comm_cost.measure(model, dirs, probe_runs, predict.predict_run,
                                          progress=lambda text: click.echo(f"calibration: {text}", err=True))
    return model, probes


def repredict(out_dir: str, dirs: list[str], probe: bool = False) -> dict[str, Any] | None:
    """Set each run of the finished comparison ``out_dir`` beside its prediction from the calibration ``dirs``
    (instead of from its own baseline run; with ``probe``, each run's compute probed as ``predict --probe``
    does): rewrite summary.json's ``prediction`` and report.md, return the summary (None when the directory has
    no summary). Not remembered: ``report DIR`` alone calibrates on the baseline again."""
    from shardscope.analysis import fold
    from shardscope.analysis.predict import predictor as predict, report as predict_report
    from shardscope.cli.common import rewrite_summary
    from shardscope.core.rundir import load_summary

    try:
        comparison = fold.load_comparison(out_dir)
        summary = load_summary(out_dir)
    except (OSError, ValueError):
        return None
    model, probes = None, None  # the section fits (and says why it cannot) when no model is given
    if probe:
        from shardscope.analysis.predict.work import NotPredicted

        try:
            model = predict.calibrate(dirs)
        except (NotPredicted, OSError, ValueError):  # the directories changed since they were checked
            model = None
        if model is not None:
            model, probes = probed(comparison, dirs, model)
    summary["prediction"] = predict_report.section(comparison, fold.replay_states(out_dir), out_dir, dirs, model, probes)
    rewrite_summary(out_dir, summary)
    return summary


def print_beside(summary: dict[str, Any]) -> None:
    """Print summary.json's predicted-beside-measured section as short lines (as the app's report screen)."""
    from shardscope.analysis import noise
    from shardscope.analysis.predict import report as predict_report

    lines = predict_report.plain_lines(summary.get("prediction") or {}, noise.line(summary.get("noise") or {}) if summary.get("noise") else "")
    if lines:
        click.echo("predicted beside measured")
    for line in lines:
        click.echo(clean(f"  {line}"))


def _ms(seconds: Any) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def method_of(name: str, probes: dict[str, Any] | None, datasheet: bool, collectives: bool) -> str:
    """How a run's figure was had, printed beside it: its compute probed on this machine, taken from a GPU's
    datasheet, or carried over from the calibration per FLOP (``--quick``); collectives timed or fitted."""
    how = "probed" if (probes or {}).get(name) else "datasheet" if datasheet else "per-FLOP"
    return how + (" + timed collectives" if collectives and not datasheet else "")


def print_prediction(result: dict[str, Any], console: Any) -> None:
    """Print ``predict.predict_comparison``'s dict: the runs table, notes, assumptions and the calibration's fit."""
    from rich.table import Table

    from shardscope.analysis.predict import predictor as predict

    what_if = result["what_if"]
    title = (f"WHAT-IF on {result['device']} GPUs (not measured here): {result['preset']}" if what_if
             else f"predicted for this machine: {result['preset']}")
    table = Table(title=_text(title), title_justify="left")
    units = {predict.unit(r) for r in result["runs"] if not r["why"]}
    for name, justify in (("run", "left"), ("strategy", "left"), ("ranks", "right"), (" or ".join(sorted(units)) or "tokens/s", "right"),
                          ("step ms", "right"), ("compute", "right"), ("exposed comm", "right"), ("rest", "right"),
                          ("peak mem (model)", "right"), ("method", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in result["runs"]:
        ranks = str(r["world_size"] or "-")
        mem = fmt_bytes(r["peak_mem_bytes"])
        if r["why"]:
            table.add_row(_text(r["name"]), _text(r["strategy"]), ranks, "[yellow]not predicted[/]", "", "", "", "", mem, "")
            continue
        table.add_row(_text(r["name"]), _text(r["strategy"]), ranks,
                      ("≤ " if r.get("bound") else "") + f"{predict.rate(r):,.0f}",
                      ("≥ " if r.get("bound") else "") + _ms(r["step_time_s"]),
                      _ms(r["compute_s"]), _ms(r["exposed_comm_s"]), _ms(r["rest_s"]), mem, _text(r.get("method", "")))
    console.print(table)
    runs = result["runs"]
    whys = {r["why"] for r in runs}
    if len(runs) > 1 and len(whys) == 1 and None not in whys:  # one reason for all: said once
        console.print(clean(f"  every run: not predicted: {whys.pop()}"), highlight=False, markup=False)
        whys = set()
    shared = set.intersection(*(set(r["notes"]) for r in runs)) if len(runs) > 1 else set()
    for note in sorted(shared):
        console.print(clean(f"  every run: {note}"), highlight=False, markup=False)
    for r in runs:
        if r["why"] and whys:
            console.print(clean(f"  {r['name']}: not predicted: {r['why']}"), highlight=False, markup=False)
        for note in r["notes"]:
            if note not in shared:
                console.print(clean(f"  {r['name']}: {note}"), highlight=False, markup=False)
    if result["assumptions"]:
        console.print("[bold]assumptions[/]")
    for line in result["assumptions"]:
        console.print(clean(f"  - {line}"), highlight=False, markup=False)
    if not what_if:  # a GPU what-if is priced from the datasheet: this machine's collective fits say nothing of it
        _print_fit(result.get("calibration"), result.get("fit_error"), console)


def _print_fit(calibration: dict[str, Any] | None, fit_error: dict[str, Any] | None, console: Any) -> None:
    from rich.table import Table

    if not calibration:
        return
    from rich.markup import escape

    console.print("[bold]calibration[/]: " + escape(clean(f"{', '.join(map(str, calibration['runs']))} "
                                                        f"({calibration['backend']}, {calibration['cores']} cores)")),
                  highlight=False)
    fits = Table(title="collectives: time = latency x ring steps + bytes x bus factor / bus bandwidth",
                 title_justify="left")
    for name in ("type", "source", "latency/step µs", "bus GB/s", "calls", "fit |error| (rms)"):
        fits.add_column(name, justify="left" if name in ("type", "source") else "right")
    for kind, f in sorted(calibration["collectives"].items()):
        err = f["rel_rms_error"]
        fits.add_row(_text(kind), _text(f["source"]), _latencies(f), f"{f['busbw_Bps'] / 1e9:.3g}",
                     str(f["points"]), "-" if err is None else f"{err:.0%}")
    if calibration["collectives"]:
        console.print(fits)
    runs = (fit_error or {}).get("runs") or {}
    if runs:
        back = Table(title="the calibration's runs predicted back (its own fit error)", title_justify="left")
        for name in ("run", "predicted step ms", "measured step ms", "error"):
            back.add_column(name, justify="left" if name == "run" else "right")
        for name, e in runs.items():
            back.add_row(_text(name), _ms(e["predicted_step_s"]), _ms(e["measured_step_s"]), f"{e['error']:+.1%}")
        console.print(back)


def _latencies(f: dict[str, Any]) -> str:
    """A collective fit's latency per ring step in µs; with subgroups timed apart (``predict --collectives`` on
    CPU), each group size's own: "2 ranks: 900  4 ranks: 2,100"."""
    by_group = {int(n): s for n, s in (f.get("latency_by_group") or {}).items()}
    if not by_group:
        return f"{f['step_latency_s'] * 1e6:,.0f}"
    by_group.setdefault(int(f["group"]), f["step_latency_s"])
    return "  ".join(f"{n} ranks: {s * 1e6:,.0f}" for n, s in sorted(by_group.items()))


def _with_collectives(dirs: list[str], backend: str, world_size: int) -> Any:
    """The machine model refitted with collectives timed by a short torchrun job; exits 1 when the job fails."""
    from shardscope.analysis.predict import predictor as predict
    from shardscope.analysis.predict.collectives import measure

    click.echo(f"timing collectives at {world_size} ranks ({backend}) ...", err=True)
    try:
        points = measure(world_size, backend)
    except RuntimeError as err:
        click.echo(f"shardscope: error: {err}", err=True)
        sys.exit(1)
    return predict.calibrate(dirs, collectives=points)


def _retime_other_world_sizes(result: dict[str, Any], comparison: config.Comparison, dirs: list[str],
                              backend: str, timed: int, probes: dict[str, Any] | None) -> None:
    """Runs whose ranks differ from the ``timed`` world size (tensor parallelism's dp x tp) predicted again with
    collectives timed at their own world size, in place in ``result["runs"]``."""
    from shardscope.analysis.predict import predictor as predict

    by_name = {run.name: run for run in comparison.runs}
    rows = result["runs"]
    for other in sorted({r["world_size"] for r in rows if not r["why"] and r["world_size"]} - {timed}):
        model = _with_collectives(dirs, backend, other)
        for i, r in enumerate(rows):
            if not r["why"] and r["world_size"] == other:
                rows[i] = predict.predict_run(comparison, by_name[r["name"]], model,
                                              probed=(probes or {}).get(r["name"]))
                rows[i]["notes"].append(f"collectives timed at its own {other} ranks")


@click.command("predict")
@click.option("--calibrate", "calibrate_dirs", multiple=True, required=True, type=click.Path(file_okay=False),
              metavar="DIR", help="A finished comparison run on this machine (give it twice, with two model sizes, "
              "to fit a per-layer-and-token cost).")
@click.option("--preset", "-p", required=True, help="Built-in preset name or path whose runs to predict.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a preset key.")
@click.option("--world-size", "-n", type=int, default=None, help="World size to predict at [default: the preset's].")
@click.option("--device", default=None, metavar="NAME", help="What-if on GPUs of this kind (A100, H100, H200, B200).")
@click.option("--collectives", is_flag=True, help="Also time collectives of a few sizes in a short torchrun job "
              "at the predicted world size (for types or sizes the calibration lacks).")
@click.option("--probe/--quick", default=None, help="--probe (the default on this machine, the method whose accuracy "
              "benchmarks/RESULTS.md gives): measure each run's compute and framework overhead in a few steps of one "
              "rank on a fake process group at the predicted world size (a subprocess per run; on CPU the "
              "calibration's runs are probed too, for what their real steps paid for communication). --quick: carry "
              "the calibration's per-FLOP compute and overhead over to this model and strategy instead (seconds, "
              "less accurate; the only method for a --device what-if).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@trust_code_option
def predict_cmd(calibrate_dirs: tuple[str, ...], preset: str, overrides: tuple[str, ...], world_size: int | None,
                device: str | None, collectives: bool, probe: bool | None, as_json: bool) -> None:
    """Predict step time, tokens/s and peak memory of every run of a preset from a finished comparison."""
    from shardscope.analysis.predict import predictor as predict
    from shardscope.analysis.predict.devices import device_spec
    from shardscope.analysis.predict.work import NotPredicted

    if world_size is not None and world_size < 1:
        _fail(f"--world-size {world_size}: must be >= 1")
    device, first_line = what_if(world_size, device)
    if probe and device:
        _fail("--probe with --device: a probe measures this machine's compute, a --device what-if takes it from the "
              "device's table: give one of them")
    probe = not device if probe is None else probe  # the accurate method unless asked for --quick
    spec = device_spec(device) if device else None
    model, why = None, ""
    try:
        model = predict.calibrate(list(calibrate_dirs))
    except NotPredicted as err:
        why = f"calibration unusable: {err}"
    except (OSError, ValueError) as err:
        _fail(f"--calibrate: not a finished shardscope run directory ({err})")
    sets = [*overrides, *([f"world_size={world_size}"] if world_size else [])]
    try:
        comparison = load_for(preset, sets, model.backend if model else None, spec is not None)
    except ConfigError as err:
        _fail(str(err))
    timed = world_size or comparison.world_size
    if collectives and model is not None:
        model = _with_collectives(list(calibrate_dirs), model.backend, timed)
    probes = None
    if probe and model is not None and spec is None:
        try:
            model, probes = probed(comparison, list(calibrate_dirs), model)
        except trust.UntrustedCode as err:  # the calibration's runs are someone's code: said, nothing built
            _fail(str(err))
    result = predict.predict_comparison(comparison, model, spec, probes)
    if collectives and model is not None and spec is None:
        _retime_other_world_sizes(result, comparison, list(calibrate_dirs), model.backend, timed, probes)
    result["calibrated_on"] = list(calibrate_dirs)
    for row in result["runs"]:
        row["method"] = method_of(row["name"], probes, spec is not None, collectives)
    if why:
        for row in result["runs"]:
            if not spec:
                row.update(dict.fromkeys(predict.FIGURES), why=why)
    if as_json:
        click.echo(json.dumps(json_ready(result), indent=2, default=str))
        return
    from rich.console import Console

    if first_line:
        click.echo(clean(first_line))
    for line in comparison.adjustments:
        click.echo(clean(f"shardscope: note: {line}"))
    console = Console()
    if not console.is_terminal:  # pipes and logs: the tables keep their columns, as `run` does
        console = Console(width=max(console.width, 160))
    print_prediction(result, console)
