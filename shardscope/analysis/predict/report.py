"""summary.json's ``prediction`` section and report.md's "Predicted beside measured": every run of the
comparison predicted from the comparison's other runs (leave one out: a run is never its own calibration), or
from other comparisons of this machine (``--calibrate``), set beside what it measured, with the error. A
prediction that is only a bound (no framework overhead calibrated for its strategy) is shown as a bound that
held or broke, never as an error; when no run gets more than a bound the section is one line saying so.
Pure Python, no torch; never raises (a section that cannot be made says why).
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
    own = [r for r in c.runs if not r.control_of]  # the A/A control is the baseline again: nothing new to predict
    models: dict[str, Any] = {}
    try:
        if calibrate_dirs:
            model = model or predict.calibrate(list(calibrate_dirs))
            source = ", ".join(calibrate_dirs)
            models = {r.name: model for r in own}
        elif len(own) < 2:
            return {"why": "one run: nothing else of this comparison to predict it from (`shardscope report DIR "
                           "--calibrate CAL` predicts it from another comparison of this machine)"}
        else:
            source = LEAVE_ONE_OUT
            for r in own:
                try:
                    models[r.name] = predict.calibrate([out_dir], only=[o.name for o in own if o.name != r.name])
                except NotPredicted as err:
                    models[r.name] = err
    except NotPredicted as err:
        return {"why": f"no calibration: {err}"}
    except (OSError, ValueError, KeyError, ZeroDivisionError) as err:
        return {"why": f"no calibration: {err!r}"}
    runs: dict[str, Any] = {}
    for run in own:
        try:
            fitted = models[run.name]
            if isinstance(fitted, NotPredicted):
                raise ValueError(f"calibration on the other runs unusable: {fitted}")
            row = predict.predict_run(c, run, fitted, probed=(probes or {}).get(run.name))
        except (KeyError, ValueError, ZeroDivisionError) as err:
            row = {"name": run.name, "strategy": run.strategy, "why": str(err), "notes": []}
        st = states.get(run.name)
        rate = median_rate(st.throughput) if st is not None and st.unit == predict.unit(row) else None
        steps = [t for s, t in (st.step_times if st else []) if s > 0]
        row["measured_tokens_per_s"] = rate if predict.unit(row) == "tokens/s" else None
        row["measured_samples_per_s"] = rate if predict.unit(row) == "samples/s" else None
        row["measured_spread"] = relative_spread(timed_rates(st.throughput)) if rate is not None else None
        row["measured_step_time_s"] = statistics.median(steps) if steps else None
        got = predict.rate(row)
        row["error"] = got / rate - 1 if got and rate else None
        row["calibration_run"] = False  # never: each run is predicted from runs other than itself
        runs[run.name] = row
    usable = [m for m in models.values() if not isinstance(m, NotPredicted)]
    if not usable:
        return {"why": f"no calibration: {next(iter(models.values()))}"}
    return {"calibrated_on": source, "probed": bool(probes), "runs": runs,
            "assumptions": predict.assumptions(usable[0]) + ([PROBED] if probes else []),
            "fit_error": usable[0].fit_error if calibrate_dirs else None}


LEAVE_ONE_OUT = "this comparison's other runs (each run predicted from all the others, never from itself)"


def bound_text(r: dict[str, Any]) -> str:
    """A bound's verdict beside the measurement: it held (by how much) or broke — never an error."""
    got, measured = predict.rate(r), _measured(r)
    if not got or not measured:
        return "upper bound (nothing measured to set it against)"
    if measured <= got:
        return f"upper bound, held: measured {1 - measured / got:.0%} below it"
    return f"upper bound, broken: measured {measured / got:.2f}x it (the machine's load moved between the runs)"


def useful(sec: dict[str, Any]) -> bool:
    """Whether the section predicts anything: a run with a prediction that is not only a bound (an older summary's
    calibration run, its own fit, does not count)."""
    return any(isinstance(r, dict) and not r.get("why") and not r.get("bound") and not r.get("calibration_run")
               for r in (sec.get("runs") or {}).values())


def left_out(sec: dict[str, Any]) -> str:
    """The one line a section that predicts nothing is reduced to."""
    return ("only upper bounds: no framework overhead calibrated for these strategies (a calibration with runs of "
            "their families, `shardscope report DIR --calibrate CAL --probe`, predicts them)")


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


def markdown(sec: dict[str, Any], noise_line: str = "") -> str:
    """report.md's "Predicted beside measured" section (empty without a section); ``noise_line``: the sitting's
    between-run noise (``noise.line``), set beside the errors."""
    if not sec:
        return ""
    out = ["## Predicted beside measured\n"]
    if sec.get("why"):
        return "\n".join(out + [f"Not predicted: {sec['why']}.\n"])
    if not useful(sec):
        return "\n".join(out + [f"Not shown: {left_out(sec)}.\n"])
    out.append(f"Calibrated on {sec['calibrated_on']}{_how(sec)} (`shardscope predict` explains the model). "
               f"The error is predicted / measured median {_unit(sec)} - 1; beside it, the run's own spread (half the "
               f"interquartile range of its steps' {_unit(sec)} over their median): an error inside it is this machine's "
               "noise as much as the model's." + (f" In this sitting, {noise_line}." if noise_line else "") + "\n")
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
        if r.get("bound"):
            err = bound_text(r)
        elif r["error"] is not None and "measured_spread" in r:  # a summary written before it was kept has none
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


def plain_lines(sec: dict[str, Any], noise_line: str = "") -> list[str]:
    """The section as short sentences, for the app's report screen: each run predicted beside measured, and the
    sitting's between-run noise (``noise_line``) beside them."""
    if not sec:
        return []
    if sec.get("why"):
        return [f"not predicted: {sec['why']}"]
    if not useful(sec):
        return [f"not shown: {left_out(sec)}"]
    lines = [f"calibrated on {sec['calibrated_on']}{_how(sec)}; error = predicted / measured median {_unit(sec)} - 1"]
    for name, r in sec["runs"].items():
        if not _readable(r):
            lines.append(f"{name}: {UNREADABLE}")
            continue
        if r.get("why"):
            lines.append(f"{name}: not predicted: {r['why']}")
            continue
        err = "error not measured" if r.get("error") is None else f"{r['error']:+.1%}"
        if r.get("bound"):
            err = bound_text(r)
        elif r.get("error") is not None and "measured_spread" in r:
            err += f"; its own spread {_spread(r.get('measured_spread'))}"
        lines.append(f"{name}: predicted {'≤ ' if r.get('bound') else ''}{_rate(predict.rate(r))} {predict.unit(r)}, "
                     f"measured {_rate(_measured(r))} ({err}"
                     + (", the calibration run: its fit error)" if r.get("calibration_run") else ")"))
    if noise_line:
        lines.append(f"in this sitting, {noise_line}")
    return lines
