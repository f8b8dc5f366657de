"""summary.json's ``prediction`` section and report.md's "Predicted beside measured": every run of the
comparison predicted from its own baseline run (or from other comparisons of this machine), set beside
what it measured, with the error. The baseline's own row is the calibration's fit error, not a
prediction. Pure Python, no torch; never raises (a section that cannot be made says why).
"""

from __future__ import annotations

import statistics
from typing import Any

from shardscope.config import Comparison
from shardscope.core.numbers import fmt_bytes, median_rate, relative_spread, timed_rates
from shardscope.analysis.predict import predictor as predict
from shardscope.analysis.predict.work import NotPredicted


def section(c: Comparison, states: dict[str, Any], out_dir: str, calibrate_dirs: list[str] | None = None,
            model: Any = None, probes: dict[str, Any] | None = None) -> dict[str, Any]:
    """Predicted beside measured for every run of ``c``: ``{"calibrated_on", "probed", "runs": {name: row +
    measured_tokens_per_s (or measured_samples_per_s: an image model's), measured_step_time_s, measured_spread,
    error, calibration_run}, "assumptions", "fit_error"}`` or ``{"why": reason}``.
    ``measured_spread``: the run's own step-to-step spread (half-IQR / median of its timed rates, as ``diff``'s
    noise; None below 4 timed steps): an error inside it is the machine's noise as much as the model's.
    ``model`` (fitted on ``calibrate_dirs``) and ``probes`` (``predict_probe.probe_runs`` of ``c``): as
    ``predict --probe`` makes them, in place of a fit here."""
    baseline = c.baseline or (c.runs[0].name if c.runs else "")
    try:
        if calibrate_dirs:
            model = model or predict.calibrate(list(calibrate_dirs))
            source = ", ".join(calibrate_dirs)
        else:
            model = predict.calibrate([out_dir], only=[baseline])
            source = f"{baseline} (this comparison's baseline run)"
    except NotPredicted as err:
        return {"why": f"no calibration: {err}"}
    except (OSError, ValueError, KeyError, ZeroDivisionError) as err:
        return {"why": f"no calibration: {err!r}"}
    runs: dict[str, Any] = {}
    for run in (r for r in c.runs if not r.control_of):  # the A/A control is the baseline again: nothing new to predict
        try:
            row = predict.predict_run(c, run, model, probed=(probes or {}).get(run.name))
        except (KeyError, ValueError, ZeroDivisionError) as err:
            row = {"name": run.name, "strategy": run.strategy, "why": f"{err!r}", "notes": []}
        st = states.get(run.name)
        rate = median_rate(st.throughput) if st is not None and st.unit == predict.unit(row) else None
        steps = [t for s, t in (st.step_times if st else []) if s > 0]
        row["measured_tokens_per_s"] = rate if predict.unit(row) == "tokens/s" else None
        row["measured_samples_per_s"] = rate if predict.unit(row) == "samples/s" else None
        row["measured_spread"] = relative_spread(timed_rates(st.throughput)) if rate is not None else None
        row["measured_step_time_s"] = statistics.median(steps) if steps else None
        got = predict.rate(row)
        row["error"] = got / rate - 1 if got and rate else None
        row["calibration_run"] = not calibrate_dirs and run.name == baseline
        runs[run.name] = row
    return {"calibrated_on": source, "probed": bool(probes), "runs": runs,
            "assumptions": predict.assumptions(model) + ([PROBED] if probes else []), "fit_error": model.fit_error}


PROBED = ("compute and framework overhead per run measured by a one-rank probe of the run (predict/probe.py), not "
          "carried over from the calibration: the prediction whose error benchmarks/predict_accuracy.py measures")


def _how(sec: dict[str, Any]) -> str:
    """How each run's compute was had: probed, or carried over from the calibration per FLOP."""
    if sec.get("probed"):
        return ", each run's compute measured by a one-rank probe"
    return (", each run's compute carried over from the calibration per FLOP (`shardscope report DIR --calibrate "
            "CAL --probe` measures it, the prediction whose error benchmarks/RESULTS.md gives)")


def _rate(v: Any) -> str:
    return "-" if v is None else f"{v:,.0f}"


UNREADABLE = "not shown: its figures in the comparison's summary are not numbers"
FIGURES = ("tokens_per_s", "samples_per_s", "measured_tokens_per_s", "measured_samples_per_s", "error",
           "measured_spread", "step_time_s", "compute_s", "exposed_comm_s", "rest_s")


def _measured(r: dict[str, Any]) -> Any:
    return r.get("measured_tokens_per_s") or r.get("measured_samples_per_s")


def _unit(sec: dict[str, Any]) -> str:
    """The section's throughput unit: tokens/s, samples/s (image models), or both named."""
    units = {predict.unit(r) for r in sec["runs"].values() if isinstance(r, dict) and not r.get("why")}
    return " or ".join(sorted(units)) or "tokens/s"


def _readable(r: Any) -> bool:
    """A row read back from a run directory's summary.json is input: every figure present is a number or null."""
    return isinstance(r, dict) and all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
                                       for k, v in r.items() if k in FIGURES)


def _spread(v: Any) -> str:
    return "not measured: under 4 timed steps" if v is None else f"±{v:.1%}"


def markdown(sec: dict[str, Any]) -> str:
    """report.md's "Predicted beside measured" section (empty without a section)."""
    if not sec:
        return ""
    out = ["## Predicted beside measured\n"]
    if sec.get("why"):
        return "\n".join(out + [f"Not predicted: {sec['why']}.\n"])
    out.append(f"Calibrated on {sec['calibrated_on']}{_how(sec)} (`shardscope predict` explains the model). "
               f"The error is predicted / measured median {_unit(sec)} - 1; beside it, the run's own spread (half the "
               f"interquartile range of its steps' {_unit(sec)} over their median): an error inside it is this machine's "
               "noise as much as the model's.\n")
    rows, notes = [], []
    for name, r in sec["runs"].items():
        if not _readable(r):
            rows.append(f"| {name} | - | {UNREADABLE} | - | - | - | - |")
            continue
        if r.get("why"):
            rows.append(f"| {name} | {r.get('strategy', '')} | not predicted | {_rate(_measured(r))} "
                        "| - | - | - |")
            notes.append(f"- {name}: not predicted: {r['why']}")
            continue
        err = "-" if r["error"] is None else f"{r['error']:+.1%}" + (" (calibration run: fit error)"
                                                                     if r.get("calibration_run") else "")
        if r["error"] is not None and "measured_spread" in r:  # a summary written before it was kept has none
            err += f" (own spread {_spread(r.get('measured_spread'))})"
        split = " / ".join(f"{r[k] * 1e3:,.1f}" for k in ("compute_s", "exposed_comm_s", "rest_s"))
        rows.append(f"| {name} | {r['strategy']} | {'≤ ' if r.get('bound') else ''}{_rate(predict.rate(r))} | "
                    f"{_rate(_measured(r))} | "
                    f"{err} | {r['step_time_s'] * 1e3:,.1f} ({split}) | {fmt_bytes(r.get('peak_mem_bytes'))} |")
        notes += [f"- {name}: {n}" for n in r.get("notes", [])]
    out.append(f"| run | strategy | predicted {_unit(sec)} | measured | error | predicted step ms (compute / exposed comm / "
               "rest) | peak mem (model) |\n|---|---|---|---|---|---|---|")
    out += rows
    out.append("")
    out += notes
    out += ["", "Assumptions:", *(f"- {a}" for a in sec.get("assumptions", []))]
    return "\n".join(out) + "\n"


def plain_lines(sec: dict[str, Any]) -> list[str]:
    """The section as short sentences, for the app's report screen: each run predicted beside measured."""
    if not sec:
        return []
    if sec.get("why"):
        return [f"not predicted: {sec['why']}"]
    lines = [f"calibrated on {sec['calibrated_on']}{_how(sec)}; error = predicted / measured median {_unit(sec)} - 1"]
    for name, r in sec["runs"].items():
        if not _readable(r):
            lines.append(f"{name}: {UNREADABLE}")
            continue
        if r.get("why"):
            lines.append(f"{name}: not predicted: {r['why']}")
            continue
        err = "error not measured" if r.get("error") is None else f"{r['error']:+.1%}"
        if r.get("error") is not None and "measured_spread" in r:
            err += f"; its own spread {_spread(r.get('measured_spread'))}"
        lines.append(f"{name}: predicted {'≤ ' if r.get('bound') else ''}{_rate(predict.rate(r))} {predict.unit(r)}, "
                     f"measured {_rate(_measured(r))} ({err}"
                     + (", the calibration run: its fit error)" if r.get("calibration_run") else ")"))
    return lines
