"""``shardscope tune --device GPU``: the search as a what-if on a GPU kind of the device table that this machine is
not: every candidate's memory from the memory model against the GPU's datasheet memory (or ``--device-memory``), its
step time from the predictor's what-if (FLOPs at a fraction of the datasheet peak, collectives at NVLink or
InfiniBand bandwidth: ``analysis/predict/devices.py``), nothing run. Every line says it is predicted; the winner's
preset and launch line are written for the user to run (and prove) on such a machine. On a machine that has that GPU,
``tune`` measures as it does without ``--device``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from typing import Any

import click

from shardscope import config
from shardscope.cli.common import fail_usage
from shardscope.core.numbers import fmt_bytes
from shardscope.core.text import clean

CLOSE_SHOWN = 5  # candidates predicted close to the winner named on the terminal (tune.md lists every one)


def what_if(preset: str, sets: list[str], spec: Any, world_size: int | None, limit: int | None, keep_within: float,
            allow: tuple[str, ...], strategies: str, out_dir: str | None, as_json: bool, dry_run: bool) -> None:
    """Predict every candidate of ``preset`` at ``world_size`` GPUs of kind ``spec`` (default: the preset's world
    size); print and write the answer (``out_dir``, default a new directory as ``tune`` makes)."""
    from shardscope.analysis.predict import predictor
    from shardscope.analysis.tune import choose, space
    from shardscope.orchestrator.session import default_out_dir

    host = config.HostInfo("cuda", max(world_size or 8, 8), f"{world_size or 8} {spec.name} GPUs (what-if)")
    try:
        comparison = config.load_preset(preset, list(sets), host=host)
        only = tuple(x.strip() for x in strategies.split(",") if x.strip())
        for name in only:
            config.registry.get(name)
    except config.ConfigError as err:
        fail_usage(str(err))
        raise  # unreachable
    except KeyError as err:
        fail_usage(f"--strategies {strategies}: {err.args[0]}")
        raise  # unreachable
    world_size = world_size or comparison.world_size
    out = out_dir or default_out_dir(f"{comparison.name}-tune")
    if not dry_run and os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        fail_usage(f"--out {out}: exists and is not an empty directory (tune writes winner.toml and tune.md there)")
    memory = limit or int(spec.memory_bytes)
    head = (f"WHAT-IF on {world_size} x {spec.name} ({fmt_bytes(memory)} each): predicted only, nothing runs on this "
            "machine; prove the winner on such a machine")
    click.echo(clean(head), err=as_json)
    cands = space.candidates(comparison, world_size=world_size, allow=allow, host=host, only=only)
    choose.prune_by_memory(comparison, cands, memory)
    predictor.read_grids_for((dataclasses.replace(comparison, runs=[x.run], baseline=x.name), x.run)
                             for x in cands if not x.refused and not x.pruned)
    rows = {x.name: predictor.predict_run(dataclasses.replace(comparison, runs=[x.run], baseline=x.name), x.run, None,
                                          device=spec)
            for x in cands if not x.refused and not x.pruned}
    choose.prune_by_prediction(cands, rows, keep_within)
    kept = sorted((x for x in cands if not x.refused and not x.pruned and x.predicted_step_s),
                  key=lambda x: x.predicted_step_s)
    winner = kept[0] if kept else None
    answer: dict[str, Any] = {
        "what_if": True, "device": spec.name, "world_size": world_size, "device_memory_bytes": memory,
        "winner": winner.name if winner else None, "predicted_close": [x.name for x in kept[1:]],
        "assumptions": predictor.assumptions(None, spec)}
    if winner is not None and not dry_run:
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, "winner.toml")
        config.write_atomic(path, lambda fh: fh.write(choose.winner_toml(comparison, winner, comparison.source or preset,
                                                                         predicted_on=spec.name)))
        answer.update(preset=path, launch=f"shardscope run --preset {shlex.quote(path)} --headless",
                      tokens_per_s=rows[winner.name].get("tokens_per_s"))
        answer["report"] = os.path.join(out, "tune.md")
        config.write_atomic(answer["report"], lambda fh: fh.write(_markdown(cands, answer, comparison.name, head)))
    if as_json:
        click.echo(json.dumps({**answer, "candidates": [choose.as_dict(x) for x in cands]}, indent=2, default=str))
        return
    for x in sorted(cands, key=lambda x: (bool(x.refused), bool(x.pruned), x.predicted_step_s or 1e9)):
        click.echo(clean(f"  predicted  {x.name:<40} {_step(x):>12} {_mem(x):>12}  {_outcome(x, winner)}"))
    if winner is None:
        click.echo("no winner: no candidate fits and is predicted")
        return
    close = answer["predicted_close"]
    click.echo(clean(f"predicted winner on {spec.name}: {winner.name} ({winner.run.strategy}, options "
                     f"{winner.run.options or 'default'}); not measured"
                     + (f"; {len(close)} more within {keep_within:.0%} of it by prediction, to measure there too: "
                        f"{', '.join(close[:CLOSE_SHOWN])}" + (", ... (every one in tune.md)" if len(close) > CLOSE_SHOWN
                                                               else "") if close else "")))
    if not dry_run:
        click.echo(clean(f"  preset: {answer['preset']}\n  launch (on {spec.name}s): {answer['launch']}\n"
                         f"  report: {answer['report']}"))


def _step(x: Any) -> str:
    return "-" if x.predicted_step_s is None else f"{x.predicted_step_s * 1e3:.2f} ms"


def _mem(x: Any) -> str:
    return "-" if x.predicted_mem_bytes is None else fmt_bytes(x.predicted_mem_bytes)


def _outcome(x: Any, winner: Any) -> str:
    if winner is not None and x.name == winner.name:
        text = "WINNER (predicted)"
    elif x.refused:
        text = f"cannot run: {x.refused}"
    else:
        text = x.pruned or "kept: predicted close to the winner"
    return text + (" [changes the mathematics: --allow precision]" if x.changes_math else "")


def _markdown(cands: list[Any], answer: dict[str, Any], name: str, head: str) -> str:
    """``tune.md`` of a what-if: the answer, its assumptions and every candidate, all predicted."""
    def cell(text: Any) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    winner = next((x for x in cands if x.name == answer["winner"]), None)
    out = [f"# shardscope tune: {cell(name)} — {cell(head)}\n",
           f"**Predicted winner: {cell(answer['winner'])}** (not measured). Preset: `{cell(answer['preset'])}`; launch "
           f"on the device: `{cell(answer['launch'])}`.\n", "Assumptions:\n"]
    out += [f"- {cell(a)}" for a in answer["assumptions"]]
    out += ["", "| candidate | predicted ms/step | predicted memory per rank | outcome (predicted) |", "|---|---|---|---|"]
    out += [f"| {cell(x.name)} | {_step(x)} | {_mem(x)} | {cell(_outcome(x, winner))} |" for x in cands]
    return "\n".join(out) + "\n"
