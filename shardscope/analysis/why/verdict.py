"""``shardscope why DIR RUN``: why a run's loss leaves the baseline's, proven by controlled re-runs.

``load_plan`` reads a finished comparison: the run's loss gap (summary.json), its first divergent step, the
re-runs' window and the suspects (``why_variants``). The orchestrator (``orchestrator/why_runs.py``) runs each
round as a real comparison under ``DIR/why/<run>/round<k>/``: the baseline, the run as it is (both with the module
probe on) and one variant per suspect; pairs in a second round when no single change closes the gap.
``measure`` reads a round's files back and ``result`` names the cause: the change that brings the run back within
the comparison's loss tolerance, a pair when no single change does, or none ("no tested change explains it").
``markdown`` writes a result for report.md and the app. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from shardscope.config import Comparison
from shardscope.core.numbers import fmt_sig, read_json
from shardscope.analysis import divergence, fold, summary
from shardscope.analysis.why import probe as why_probe
from shardscope.profiling.state import OK
from shardscope.analysis.why.variants import Variant, estimate_s, suspects, window
from shardscope.core.rundir import SUMMARY, RunDir, load_summary


class WhyError(ValueError):
    """Input why cannot work from, in one line (the command exits 2)."""


@dataclass
class Plan:
    """What a why of one run will do, read from the finished comparison."""

    out_dir: str
    run: str
    baseline: str
    tolerance: float
    comparison: Comparison
    original: dict[str, Any]  # the run's gap in the comparison: max_abs, mean_abs, steps
    within: bool
    first_step: int | None  # first step whose |Δloss| is beyond tolerance
    steps: int  # the re-runs' length
    singles: list[Variant] = field(default_factory=list)
    noted: list[str] = field(default_factory=list)  # what differs between the start records
    estimate: dict[str, Any] = field(default_factory=dict)
    init_sha256: str | None = None  # the original baseline's initial weights (its start record)


def load_plan(out_dir: str, run: str) -> Plan:
    """Read ``out_dir`` and plan the why of ``run``; raises WhyError naming what is missing or wrong."""
    try:
        comparison = fold.load_comparison(out_dir)
        data = load_summary(out_dir)
    except (OSError, ValueError) as err:
        raise WhyError(f"{out_dir}: not a finished shardscope run directory ({err}); "
                       f"`shardscope report {out_dir}` writes {SUMMARY}") from None
    entries = {r.get("name"): r for r in data["runs"] if isinstance(r, dict)}
    baseline = data.get("baseline") or comparison.baseline
    if run not in entries:
        raise WhyError(f"{out_dir} has no run {run!r}; its runs: {', '.join(map(str, entries))}")
    if run == baseline:
        raise WhyError(f"{run} is the baseline of {out_dir}: name another run to compare with it")
    tolerance = float(data.get("loss_tolerance", comparison.loss_tolerance))
    entry = entries[run]
    if entry.get("loss_max_abs_diff") is None:
        raise WhyError(f"{run} has no step in common with the baseline {baseline}: no loss to compare "
                       f"(status {entry.get('status')}{': ' + entry['error'] if entry.get('error') else ''})")
    gap = {"max_abs": entry["loss_max_abs_diff"], "mean_abs": entry.get("loss_mean_abs_diff"),
           "steps": entry.get("loss_steps_compared")}
    within = entry.get("within_tolerance")
    within = bool(gap["max_abs"] <= tolerance) if within is None else bool(within)
    states = fold.replay_states(out_dir)
    base_state, run_state = states[baseline], states[run]
    first = divergence.first_loss_divergence(base_state.losses, run_state.losses, tolerance)
    first_step = first["step"] if first else None
    if first_step is None and not within:
        raise WhyError(f"{SUMMARY} says {run} leaves the baseline by {gap['max_abs']:.3g} but its rank files do not: "
                       f"`shardscope report {out_dir}` writes the summary again")
    steps = window(first_step, comparison.steps) if first_step is not None else 0
    starts = base_state.start.get(0, {}), run_state.start.get(0, {})
    singles = suspects(comparison, comparison.run(run), comparison.run(baseline), *starts)
    return Plan(out_dir, run, baseline, tolerance, comparison, gap, within, first_step, steps, singles,
                divergence.likely_causes(*starts) if all(starts) else [],
                estimate_s(states, baseline, run, 2 + len(singles), steps), starts[0].get("init_sha256"))


def layer_gap(base: dict[int, dict[str, Any]], run: dict[int, dict[str, Any]]) -> tuple[float | None, str]:
    """The largest relative per-layer gradient-norm difference at common steps, and its layer (None, "" without
    ``layers`` records); a non-finite norm on one side is an infinite difference."""
    worst, where = None, ""
    for step in sorted(set(base) & set(run)):
        theirs = run[step].get("grad_norms") or {}
        for layer, a in (base[step].get("grad_norms") or {}).items():
            b = theirs.get(layer)
            if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
                continue
            rel = abs(a - b) / max(abs(a), abs(b), 1e-30) if math.isfinite(a) and math.isfinite(b) else math.inf
            if worst is None or rel > worst:
                worst, where = rel, layer
    return worst, where


def measure(round_dir: str, baseline: str) -> dict[str, dict[str, Any]]:
    """Every run of a round against the round's baseline: status, error, max/mean |Δloss| and the number of
    common steps, the worst per-layer gradient-norm gap and its layer."""
    states = fold.replay_states(round_dir)
    out = RunDir(round_dir)
    base_layers = divergence.read_layers(out.run(baseline).path)
    gaps = {}
    for name, st in states.items():
        max_abs, mean_abs, common = summary.loss_diffs(st, states[baseline])
        grad, layer = layer_gap(base_layers, divergence.read_layers(out.run(name).path))
        gaps[name] = {"status": st.status, "error": st.error, "max_abs": max_abs, "mean_abs": mean_abs,
                      "steps": common, "grad_rel": grad, "grad_layer": layer,
                      "init_sha256": (st.start.get(0) or {}).get("init_sha256")}
    return gaps


def closes(gap: dict[str, Any] | None, tolerance: float) -> bool:
    """True when a re-run ended ok with its loss within ``tolerance`` of the baseline's at every common step."""
    return bool(gap and gap["status"] == OK and gap["max_abs"] is not None and gap["max_abs"] <= tolerance)


def module_finding(round_dir: str, plan: Plan) -> dict[str, Any]:
    """Where the probed baseline and run first differ module by module, at the noise tolerance of their precisions."""
    out = RunDir(round_dir)
    rtol = divergence.layer_rtol_for(plan.comparison.run(plan.baseline).precision or plan.comparison.precision,
                                     plan.comparison.run(plan.run).precision or plan.comparison.precision)
    found = why_probe.first_difference(why_probe.read_probes(out.run(plan.baseline).path),
                                       why_probe.read_probes(out.run(plan.run).path), rtol)
    return {**found, "rtol": rtol}


def nothing_to_explain(plan: Plan) -> dict[str, Any]:
    """The result of a run already within tolerance: nothing re-run."""
    g = plan.original
    return _base(plan, "nothing to explain", f"nothing to explain: within tolerance (max |Δloss| "
                 f"{fmt_sig(g['max_abs'])} <= {plan.tolerance:g} over {g.get('steps') or 'the'} common steps)")


def _base(plan: Plan, status: str, message: str) -> dict[str, Any]:
    return {"run": plan.run, "baseline": plan.baseline, "dir": plan.out_dir, "status": status, "cause": None,
            "change": None, "message": message, "tolerance": plan.tolerance, "original_gap": plan.original,
            "first_divergent_step": plan.first_step, "steps": plan.steps, "gap_before": plan.original,
            "gap_after": None, "variants": [], "module": None, "rounds": [], "noted": plan.noted}


def result(plan: Plan, rounds: list[tuple[str, list[Variant]]], gaps: dict[str, dict[str, Any]],
           module: dict[str, Any] | None) -> dict[str, Any]:
    """The why's result from the rounds run (each its directory and variants) and their ``measure`` gaps (one
    dict over every round's runs; the baseline and the run as they are from round 1)."""
    tol = plan.tolerance
    before, base = gaps.get(plan.run), gaps.get(plan.baseline)
    variants = [{**v.to_dict(), "round": k, **gaps.get(v.name, {"status": "not run"}),
                 "within": closes(gaps.get(v.name), tol)} for k, (_, vs) in enumerate(rounds, 1) for v in vs]
    out = {**_base(plan, "", ""), "gap_before": before, "variants": variants, "module": module,
           "rounds": [d for d, _ in rounds], "same_initial_weights": None if not (base and plan.init_sha256 and
                                                                               base.get("init_sha256")) else
           base["init_sha256"] == plan.init_sha256}
    for name, gap in (("baseline", base), ("run as it is", before)):
        if not gap or gap["status"] != OK or gap["max_abs"] is None:
            why = (gap or {}).get("error") or (gap or {}).get("status") or "not run"
            return {**out, "status": "failed", "message": f"the re-run of the {name} did not finish: {why}"}
    if before["max_abs"] <= tol:
        return {**out, "status": "not reproduced", "message": (
            f"not reproduced: the run as it is stayed within tolerance over the {plan.steps}-step re-run (max "
            f"|Δloss| {fmt_sig(before['max_abs'])} <= {tol:g}); the original differs by {fmt_sig(plan.original['max_abs'])}")}
    fixed = sorted((v for v in variants if v["within"]), key=lambda v: (len(v["settings"]), v["max_abs"]))
    if fixed:
        cause = fixed[0]
        return {**out, "status": "explained", "cause": " + ".join(cause["settings"]), "change": cause["describe"],
                "quirk": cause["quirk"], "gap_after": gaps[cause["name"]],
                "also": [v["name"] for v in fixed[1:] if len(v["settings"]) == len(cause["settings"])],
                "message": (f"cause: {' + '.join(cause['settings'])} ({cause['describe']}): max |Δloss| "
                            f"{fmt_sig(before['max_abs'])} -> {fmt_sig(cause['max_abs'])} (tolerance {tol:g})")}
    if not variants:
        return {**out, "status": "not explained", "message": (
            f"no tested change explains it: no setting of {plan.run} differs from {plan.baseline}'s but the "
            f"strategy (max |Δloss| {fmt_sig(before['max_abs'])} > {tol:g}); what is left is the strategies' own "
            "arithmetic (reduction order, kernels)")}
    ran = [v for v in variants if v["max_abs"] is not None]
    closest = min(ran, key=lambda v: v["max_abs"]) if ran else None
    left = f"; the closest, {closest['name']}, leaves max |Δloss| {fmt_sig(closest['max_abs'])}" if closest else ""
    return {**out, "status": "not explained", "message": (
        f"no tested change explains it: none of {len(variants)} variants brings max |Δloss| "
        f"{fmt_sig(before['max_abs'])} within {tol:g}{left}")}


def _gap_cells(g: dict[str, Any] | None) -> list[str]:
    if not g:
        return ["not run", "-", "-", "-"]
    grad = f"{fmt_sig(g.get('grad_rel'))} ({g['grad_layer']})" if g.get("grad_layer") else "not recorded"
    return [str(g.get("status")), fmt_sig(g.get("max_abs")), fmt_sig(g.get("mean_abs")), grad]


def rows(res: dict[str, Any]) -> list[list[str]]:
    """Table rows: the run as it is, then every variant: name, change, status, max/mean |Δloss|, gradient gap,
    within tolerance."""
    out = [["as it is (before)", "-", *_gap_cells(res.get("gap_before")), "no" if res.get("variants") else "-"]]
    for v in res.get("variants", []):
        out.append([f"{v['name']} (round {v['round']})", v["describe"], *_gap_cells(v if "max_abs" in v else None),
                    "yes" if v["within"] else "no"])
    return out


HEADER = ["re-run", "change towards the baseline", "status", "max |Δloss|", "mean |Δloss|", "grad-norm gap (layer)",
          "within tolerance"]


def markdown(res: dict[str, Any]) -> str:
    """One why result as a markdown section (report.md, the app)."""
    out = [f"## Why {res['run']} differs from {res['baseline']}\n", f"**{res['message']}**\n"]
    if res.get("quirk"):
        out.append(f"Known quirk: {res['quirk']}.\n")
    if res.get("variants") or res.get("gap_before") and res["status"] != "nothing to explain":
        out.append(f"Re-runs of {res['steps']} steps (first divergent step {res['first_divergent_step']}), same "
                   f"initial weights and tokens, tolerance {res['tolerance']:g}:\n")
        head = "| " + " | ".join(HEADER) + " |\n|" + "---|" * len(HEADER) + "\n"
        out.append(head + "".join("| " + " | ".join(c.replace("|", "\\|") for c in r) + " |\n" for r in rows(res)))
    module = res.get("module") or {}
    if module.get("finding"):
        out.append(f"Module by module: {module['finding']}.\n")
    for note in res.get("noted", [])[:4]:
        out.append(f"- noted: {note}")
    if res.get("rounds"):
        out.append("\nRe-runs in " + ", ".join(f"`{d}`" for d in res["rounds"]) + " (`shardscope open` shows them).\n")
    return "\n".join(out) + "\n"


def report_section(out_dir: str) -> str:
    """report.md's section: every why result written under ``out_dir`` ("" when none, or no directory given)."""
    found: list[str] = []
    if not out_dir:
        return ""
    for path in RunDir(out_dir).why_results():
        try:
            found.append(markdown(read_json(path)))
        except (OSError, ValueError, KeyError, TypeError) as err:
            found.append(f"- {path}: unreadable ({err})\n")
    return "".join(found)
