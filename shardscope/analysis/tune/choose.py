"""Pruning, proving and the answer of ``shardscope tune``, as pure functions of the candidates, the predictor's
machine model and the proving comparison's summary.

1. **Memory first**: a candidate the memory model puts above the device's memory is out, with both figures.
2. **Predicted step time**: the predictor (calibrated on this machine) times every candidate that fits; those
   within ``keep_within`` of the best predicted time are kept (the predictor's error on this machine is larger
   than the differences it could rank below that), the rest are out "predicted N× slower". A candidate the
   predictor cannot time (a pipeline schedule) is out with that reason, unless nothing else is kept.
3. **Budget**: the kept ones are measured in order of predicted time while each one's predicted cost (its
   start-up, as the calibration run measured it, plus its steps) fits in what is left of the budget.
4. **The answer** comes from the proving comparison's own recommendation (``analysis/recommend``, the noise rule
   of ``core.numbers`` with the A/A control): its fastest run, or a tie when the differences are inside the noise.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from shardscope.analysis.tune.space import Candidate
from shardscope.config import Comparison, RunSpec, resolved_grad_accum, resolved_options
from shardscope.core.numbers import fmt_bytes, read_json
from shardscope.core.rundir import RunDir
from shardscope.core.text import code_block
from shardscope.profiling import memory_model


def prune_by_memory(c: Comparison, cands: list[Candidate], device_memory: int | None) -> None:
    """Predict each runnable candidate's peak memory per rank; out when it exceeds ``device_memory``."""
    for cand in cands:
        if cand.refused:
            continue
        try:
            cand.predicted_mem_bytes = int(memory_model.predict_run(c, cand.run)["total_bytes"])
        except (KeyError, ValueError) as err:
            cand.pruned = f"memory model cannot read it: {err}"
            continue
        if device_memory and cand.predicted_mem_bytes > device_memory:
            cand.pruned = (f"does not fit: {fmt_bytes(cand.predicted_mem_bytes)} per rank predicted > "
                           f"{fmt_bytes(device_memory)}")


def prune_by_prediction(cands: list[Candidate], predicted: dict[str, dict[str, Any]], keep_within: float) -> None:
    """Set each live candidate's predicted step time (``predicted``: predict_run rows by name); out when slower
    than ``1 + keep_within`` times the best, or when it cannot be predicted (unless nothing is predicted)."""
    live = [x for x in cands if not x.refused and not x.pruned]
    for cand in live:
        row = predicted.get(cand.name) or {}
        cand.predicted_step_s = row.get("step_time_s") if isinstance(row.get("step_time_s"), (int, float)) else None
        if cand.predicted_step_s is None:
            cand.pruned = f"not predicted: {row.get('why') or 'no prediction'}"
    timed = [x for x in live if x.predicted_step_s]
    if not timed:
        for cand in live:
            cand.pruned = ""
        return
    best = min(x.predicted_step_s for x in timed)  # type: ignore[type-var]
    for cand in timed:
        ratio = cand.predicted_step_s / best  # type: ignore[operator]
        if ratio > 1 + keep_within:
            cand.pruned = f"predicted {ratio:.2f}x slower than the best ({cand.predicted_step_s * 1e3:.1f} ms per step)"


def mark_presets_runs(c: Comparison, cands: list[Candidate]) -> list[str]:
    """Mark the candidates that are the preset's own runs (the same strategy, options with their defaults, loop
    accumulation, checkpointing and precision; at the search's world size) and keep them whatever their prediction:
    the winner is measured against them. Returns the preset's runs that are not among the candidates (refused here,
    or with options outside the space), each with the reason."""
    def key(run: Any) -> tuple:
        return (run.strategy, tuple(sorted(resolved_options(run).items())), resolved_grad_accum(c, run),
                run.activation_checkpointing, run.precision or c.precision)

    by_key = {key(x.run): x for x in cands}
    missing = []
    for run in c.runs:
        if run.control_of:
            continue
        cand = by_key.get(key(run))
        if cand is None or cand.refused:
            missing.append(f"{run.name}: " + (cand.refused if cand is not None else "its options are outside the search"))
            continue
        cand.of_preset = cand.of_preset or run.name
        if cand.pruned.startswith(("predicted", "not predicted")):
            cand.pruned = ""
    return missing


def within_budget(cands: list[Candidate], budget_s: float, startup_s: float, steps: int,
                  fallback_step_s: float, what: str = "the budget") -> list[Candidate]:
    """The kept candidates, the preset's own runs first, then in order of predicted step time, while their predicted
    cost fits ``budget_s`` (the first always); the others are out "over the budget" (``what``: how the reason names
    that budget)."""
    live = sorted((x for x in cands if not x.refused and not x.pruned),
                  key=lambda x: (not x.of_preset, x.predicted_step_s or fallback_step_s))
    chosen, spent = [], 0.0
    for cand in live:
        cost = startup_s + steps * (cand.predicted_step_s or fallback_step_s)
        if chosen and spent + cost > budget_s:
            cand.pruned = f"over {what}: {budget_s - spent:.0f} s left, about {cost:.0f} s to measure"
            continue
        chosen.append(cand)
        spent += cost
    return chosen


def proving_comparison(c: Comparison, chosen: list[Candidate], steps: int) -> Comparison:
    """The comparison that measures ``chosen`` side by side: the same model, data, global batch and seed, ``steps``
    steps each, no profiler (every step counts), the best-predicted candidate as the baseline."""
    runs = [dataclasses.replace(x.run) for x in chosen]
    return dataclasses.replace(c, name=f"{c.name}-tune", runs=runs, baseline=runs[0].name, steps=steps,
                               warmup_steps=min(c.warmup_steps, max(0, steps - 2)), schedule_steps=0,
                               profile=dataclasses.replace(c.profile, enabled=False), parity=False,
                               description=f"shardscope tune: {len(runs)} candidates of {c.name}, {steps} steps each")


def verdict(summary: dict[str, Any], cands: list[Candidate]) -> dict[str, Any]:
    """The answer from the proving comparison's summary: ``winner`` (a run name or None), ``tie`` (names within
    the noise of the winner), ``lines`` (the recommendation's own), and each measured candidate's figures."""
    rec = summary.get("recommendation") or {}
    runs = {r.get("name"): r for r in summary.get("runs", []) if isinstance(r, dict)}
    by_name = {x.name: x for x in cands}
    for name, r in runs.items():
        if name in by_name:
            by_name[name].measured = {"status": r.get("status"), "tokens_per_s": r.get("median_tokens_per_s")
                                      or r.get("median_samples_per_s"), "peak_mem_bytes": r.get("peak_mem_bytes"),
                                      "speedup": r.get("speedup"), "error": r.get("error"),
                                      **({"code": r["code"]} if isinstance(r.get("code"), str) else {})}
    winner = rec.get("fastest") if rec.get("fastest") in by_name else None
    tie = [n for n in rec.get("no_clear_difference") or [] if n in by_name and n != winner]
    return {"winner": winner, "tie": tie, "lines": list(rec.get("lines") or []), "unit": rec.get("unit", "tokens/s")}


def winner_toml(c: Comparison, cand: Candidate, source: str, predicted_on: str = "") -> str:
    """A preset file of the winner alone: the comparison's own settings (its file, with the winner's run in place
    of its runs), so ``shardscope run --preset FILE`` reproduces it. ``predicted_on``: the GPU kind of a what-if
    (the winner was predicted there, not measured)."""
    run = cand.run
    how = f"predicted fastest on {predicted_on} (a what-if, not measured)" if predicted_on else "measured fastest"
    lines = [f"# shardscope tune's winner for {source}: {run.name}",
             f'description = "shardscope tune: the configuration {how} for {c.name}"']
    shown = c.shown()
    for key in ("steps", "global_batch", "grad_accum", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "grad_clip",
                "precision", "seed", "world_size", "loss_tolerance"):
        if key in shown:
            lines.append(f"{key} = {_toml(shown[key])}")
    for table in ("model", "data"):
        values = {k: v for k, v in (shown.get(table) or {}).items() if v not in ("", None, {}, []) and k != "described"}
        lines.append(f"\n[{table}]")
        lines += [f"{k} = {_toml(v)}" for k, v in values.items()]
    lines += ["\n[[runs]]", f'name = "{run.name}"', f'strategy = "{run.strategy}"', f"world_size = {run.world_size}"]
    if run.precision:
        lines.append(f'precision = "{run.precision}"')
    if run.activation_checkpointing:
        lines.append("activation_checkpointing = true")
    if run.options:
        lines.append("options = { " + ", ".join(f"{k} = {_toml(v)}" for k, v in run.options.items()) + " }")
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    """A TOML value (strings quoted with JSON's escapes, which TOML's basic strings share)."""
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value))


def markdown(cands: list[Candidate], answer: dict[str, Any], preset: str) -> str:
    """``tune.md``: the answer and every candidate with what happened to it, predicted beside measured."""
    def cell(text: Any) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    winner = answer.get("winner")
    out = [f"# shardscope tune: {cell(preset)}\n"]
    if winner:
        out.append(f"**Winner: {cell(winner)}**" + (f", not distinguishable from {cell(', '.join(answer['tie']))} on "
                                                    "this machine now" if answer.get("tie") else "") + ".\n")
        if answer.get("against_preset"):
            out.append(f"{cell(answer['against_preset'])}.\n")
        out.append(f"Preset: `{cell(answer.get('preset', ''))}`; launch: `{cell(answer.get('launch', ''))}`.\n")
        code = (answer.get("settings") or {}).get("code")
        if isinstance(code, str) and code:
            out.append("The winner's settings to paste into your own training script, as its rank 0 set it up:\n\n"
                       + code_block(code) + "\n")
    else:
        out.append("No winner: no candidate was measured ok.\n")
    out += [f"- {cell(line)}" for line in answer.get("lines", []) if " vs " not in line]
    out.append(f"\nThe proving runs took {answer.get('proof_s', 0):.0f} s of a {answer.get('budget_s', 0):.0f} s budget.\n")
    out.append("| candidate | predicted ms/step | predicted memory per rank | measured tokens/s | outcome |")
    out.append("|---|---|---|---|---|")
    for x in cands:
        outcome = ("winner" if x.name == winner else "measured: " + str(x.measured.get("status")) if x.measured
                   else f"cannot run: {x.refused}" if x.refused else x.pruned or "candidate")
        rate = x.measured.get("tokens_per_s") if x.measured else None
        out.append(f"| {cell(x.name)} | {'-' if x.predicted_step_s is None else f'{x.predicted_step_s * 1e3:.1f}'} | "
                   f"{'-' if x.predicted_mem_bytes is None else fmt_bytes(x.predicted_mem_bytes)} | "
                   f"{'-' if not isinstance(rate, (int, float)) else f'{rate:,.0f}'} | {cell(outcome)}"
                   + (" (changes the mathematics)" if x.changes_math else "") + " |")
    return "\n".join(out) + "\n"


def against_preset(cands: list[Candidate], answer: dict[str, Any]) -> str:
    """One line: the winner against the preset's own runs, measured side by side with it ("" when none ran)."""
    ran = {x.name: x for x in cands if x.of_preset and x.measured.get("status") == "ok"}
    winner = next((x for x in cands if x.name == answer.get("winner")), None)
    if winner is None or not ran:
        return ""
    if winner.of_preset:
        return (f"the preset's own run {winner.of_preset} measured fastest: no configuration searched was faster beyond "
                "the noise")
    tied = [ran[n].of_preset for n in answer.get("tie", []) if n in ran]
    names = ", ".join(sorted(x.of_preset for x in ran.values()))
    if tied:
        return (f"{winner.name} is not distinguishable from the preset's own run(s) {', '.join(tied)} on this machine "
                f"now (measured beside {names})")
    return f"{winner.name} measured faster than every run of the preset beside it ({names}), beyond the noise"


def in_table_order(cands: list[Candidate]) -> list[Candidate]:
    """The candidates as the tables list them: runnable before refused, kept before pruned, fastest measured first,
    then by predicted step time."""
    return sorted(cands, key=lambda x: (bool(x.refused), bool(x.pruned), -(x.measured.get("tokens_per_s") or 0),
                                        x.predicted_step_s or 1e9))


def outcome(x: Candidate, answer: dict[str, Any]) -> str:
    """What happened to candidate ``x`` in one line (the table of the command line and of the app)."""
    if x.name == answer.get("winner"):
        text = "WINNER" + (f" (tie within noise: {', '.join(answer['tie'])})" if answer.get("tie") else "")
    elif x.measured.get("status") == "queued":
        text = "queued: to be measured"
    elif x.measured:
        text = ("measured: within the noise of the winner" if x.name in answer.get("tie", [])
                else f"measured: {x.measured.get('status')}") + (f" ({x.measured['error']})" if x.measured.get("error") else "")
    else:
        text = x.refused and f"cannot run: {x.refused}" or x.pruned or "candidate"
    if x.measured.get("rounds"):  # measured again (analysis/tune/rounds): its ratio to the reference in each round
        text += " (ratio per round " + " / ".join(f"{r:.3f}" for r in x.measured["rounds"]) + ")"
    return (text + (f" (the preset's run {x.of_preset})" if x.of_preset else "")
            + (" [changes the mathematics: --allow precision]" if x.changes_math else ""))


def as_dict(x: Candidate) -> dict[str, Any]:
    """A candidate as ``--json`` prints it."""
    return {"name": x.name, "strategy": x.run.strategy, "options": x.run.options,
            "activation_checkpointing": x.run.activation_checkpointing, "precision": x.run.precision,
            "refused": x.refused or None, "pruned": x.pruned or None, "changes_math": x.changes_math,
            "predicted_step_s": x.predicted_step_s, "predicted_mem_bytes": x.predicted_mem_bytes,
            "measured": x.measured or None, "of_preset": x.of_preset or None}


def from_dict(d: dict[str, Any]) -> Candidate:
    """A candidate as ``as_dict`` wrote it (tune.json); raises TypeError or ValueError for one that is not."""
    def text(key: str) -> str:
        value = d.get(key) or ""
        if not isinstance(value, str):
            raise TypeError(f"{key}: not text")
        return value

    def number(key: str) -> float | None:
        value = d.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise TypeError(f"{key}: not a number")
        return value

    measured = d.get("measured") or {}
    options = d.get("options") or {}
    if not isinstance(measured, dict) or not isinstance(options, dict):
        raise TypeError("measured, options: not tables")
    run = RunSpec(name=text("name"), strategy=text("strategy"), options=options,
                  activation_checkpointing=bool(d.get("activation_checkpointing")), precision=text("precision"))
    mem = number("predicted_mem_bytes")
    return Candidate(run, refused=text("refused"), changes_math=bool(d.get("changes_math")),
                     predicted_step_s=number("predicted_step_s"), predicted_mem_bytes=None if mem is None else int(mem),
                     pruned=text("pruned"), measured=measured, of_preset=text("of_preset"))


def report_section(out_dir: str) -> str:
    """report.md's section in a tune's proving comparison (its ``tune.json``): the search it proved, every candidate
    with what happened to it; "" in any other run directory."""
    path = RunDir(out_dir).tune_result if out_dir else ""
    if not path or not os.path.isfile(path):
        return ""
    try:
        data = read_json(path)
        if not isinstance(data.get("answer"), dict) or not isinstance(data.get("candidates"), list):
            raise TypeError("answer, candidates: not a table and a list")
        cands = [from_dict(x) for x in data["candidates"]]
        body = markdown(cands, data["answer"], str(data.get("preset", "")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"## The search this comparison proved (shardscope tune)\n\n{path}: unreadable ({type(err).__name__})\n"
    return "## The search this comparison proved (shardscope tune)\n\n" + body.split("\n", 1)[1]
