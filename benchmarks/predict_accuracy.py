"""How right is ``shardscope predict``? Calibrate on smoke, predict every built-in preset's runs, run them, compare.

1. Run the smoke preset (or take ``--calibrate DIR``) and fit the machine model on it, with collectives of
   four sizes timed at the predicted world size by ``predict --collectives``' short torchrun job (smoke's
   traces hold two sizes per type); a new smoke comparison is run and fitted right before each preset,
   so that calibration and measurement see the machine under the same load (other jobs sharing the
   cores move both); ``--no-fresh`` and ``--no-collectives`` turn these off.
2. For each built-in preset and world size, predict every run first (before anything of it runs); runs
   that cannot be predicted are listed with the reason and not run. Every run is put at that world size, those
   with a world size of their own in the preset too (tensor parallel's tp 2 x dp 2 becomes tp 2 x dp 1 at 2
   ranks), where its layout allows; ``--own-world-sizes`` keeps the preset's.
3. Run the predicted runs (the preset with its other runs left out, shrunk by its ``cpu_overrides`` on
   CPU) through the real command line and read their median tokens/s from summary.json.
   With ``--repeats K`` steps 1-3 are done K times per preset and world size (a fresh calibration and probe each
   time), and each run's median prediction is set against its median measurement: on a shared VM the machine's
   speed moves by as much as the error asked for, in the calibration, the probe and the run alike.
4. Print, per strategy, the median and worst |predicted / measured - 1| of tokens/s, then every run. A run
   predicted as an upper bound (no framework overhead calibrated for its strategy or family) is left out
   of the medians and counted apart: did the bound hold?

    python benchmarks/predict_accuracy.py [--world-sizes 1,2,4] [--presets a,b] [--calibrate DIR[,DIR]]
                                          [--repeats K] [--own-world-sizes] [--out DIR] [--json out.json]

Target on CPU: median |error| <= 15%, worst <= 30% per strategy. Nothing here is tuned on the runs it
predicts: the model is fitted on the calibration only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shardscope import config  # noqa: E402
from shardscope.config import ConfigError  # noqa: E402
from shardscope.cli.predictview import load_for  # noqa: E402
from shardscope.presets.files import PRESET_DIR  # noqa: E402
from shardscope.analysis.predict import predictor as predict  # noqa: E402
from shardscope.analysis.predict.collectives import measure  # noqa: E402
from shardscope.analysis.predict.probe import probe_runs  # noqa: E402
from shardscope.analysis.predict import comm_cost as predict_comm_cost  # noqa: E402
from shardscope.core.rundir import load_summary  # noqa: E402

CLI = [sys.executable, "-m", "shardscope.cli"]


def run_preset(preset: str, out: Path, sets: list[str], timeout: float = 3600) -> int:
    """Run a preset headless into ``out``; return the exit code (1 when a run failed: its figures are left out)."""
    args = [*CLI, "run", "--preset", preset, "--headless", "--out", str(out)]
    for item in sets:
        args += ["--set", item]
    with open(str(out) + ".log", "w") as log:
        return subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False).returncode


def world_size_sets(preset: str, ws: int, backend: str | None, own: bool) -> list[str]:
    """The overrides that put ``preset`` at ``ws`` ranks: ``world_size`` for the comparison and, unless ``own``, for
    every run with a world size of its own too (tensor parallel's tp x dp: at 2 ranks, tp 2 x dp 1), so that no run
    is measured with more ranks than asked (4 ranks on 2 cores wait for a core half the time). A run whose layout
    cannot take ``ws`` ranks (tp 2 at 1 rank) keeps its own world size. Raises ConfigError."""
    base = [f"world_size={ws}"]
    if own:
        return base
    sets = list(base)
    for run in load_for(preset, base, backend, False).runs:
        if not run.world_size or run.world_size == ws:
            continue
        try:
            load_for(preset, [*base, f"runs.{run.name}.world_size={ws}"], backend, False)
        except ConfigError:
            continue
        sets.append(f"runs.{run.name}.world_size={ws}")
    return sets


def only_runs(preset: str, names: set[str], path: Path) -> Path:
    """A copy of a built-in preset file with only the ``[[runs]]`` tables named in ``names``."""
    text = (PRESET_DIR / f"{preset}.toml").read_text()
    parts = re.split(r"(?m)^(?=\[)", text)
    kept = []
    for part in parts:
        if part.startswith("[[runs]]"):
            name = re.search(r'(?m)^name\s*=\s*"([^"]+)"', part)
            if not name or name.group(1) not in names:
                continue
        kept.append(part)
    path.write_text("".join(kept))
    return path


SECOND: list[str] = []  # --second: the overrides of a second smoke comparison (another model size) to calibrate on
LAST: list[Path] = []  # the directories the latest calibration was fitted on


def calibrate(where: list[Path], run_it: bool, collectives_at: int = 0) -> "predict.MachineModel":
    """Run smoke into ``where[0]`` (when ``run_it``; with ``--second``, smoke at that size too) and fit the machine
    model on them, plus collectives timed by ``predict --collectives``' job at ``collectives_at`` ranks (>= 2)."""
    if run_it:
        code = run_preset("smoke", where[0], [])
        assert code == 0, f"calibration run failed: see {where[0]}.log"
        if SECOND:
            where = [where[0], where[0].with_name(where[0].name + "-second")]
            assert run_preset("smoke", where[1], SECOND) == 0, f"calibration run failed: see {where[1]}.log"
    LAST[:] = where
    points = measure(collectives_at) if collectives_at >= 2 else None
    model = predict.calibrate([str(w) for w in where], collectives=points)
    print(f"calibrated on {', '.join(w.name for w in where)}: fit error (step time predicted back) "
          + ", ".join(f"{k} {v['error']:+.1%}" for k, v in model.fit_error["runs"].items()), flush=True)
    return model


def machine() -> str:
    """One line naming this machine and its load."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    import torch

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, torch {torch.__version__}, "
            f"load average {load}")


def main() -> int:
    """Run the benchmark; print the tables; return 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", default="1,2,4")
    ap.add_argument("--presets", default="")
    ap.add_argument("--calibrate", default="", help="finished comparisons to calibrate on (comma-separated) "
                    "instead of a smoke run; leave the presets they ran out of --presets")
    ap.add_argument("--out", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--no-fresh", dest="fresh", action="store_false",
                    help="calibrate once, not again before each preset")
    ap.add_argument("--no-collectives", dest="collectives", action="store_false",
                    help="fit collectives on the calibration's traces only (no short torchrun job per world size)")
    ap.add_argument("--probe", action="store_true", help="measure each run's compute and framework overhead "
                    "in a one-rank probe at its world size (predict --probe) instead of carrying the calibration's over")
    ap.add_argument("--no-comm-cost", dest="comm_cost", action="store_false",
                    help="with --probe: no communication cost factor (predict_comm_cost) measured on the calibration")
    ap.add_argument("--own-world-sizes", action="store_true", help="runs with a world size of their own in the "
                    "preset (tensor parallel at tp x dp = 4) keep it instead of running at each of --world-sizes")
    ap.add_argument("--repeats", type=int, default=1, help="predict and run each preset this many times, "
                    "interleaved, and compare the median prediction with the median measurement of each run")
    ap.add_argument("--second", default="", help="calibrate on a second smoke comparison at another model size "
                    "too, these overrides separated by ';' (e.g. 'model.d_model=192;model.d_ff=768')")
    args = ap.parse_args()
    SECOND[:] = [x for x in args.second.split(";") if x]
    out = Path(args.out or tempfile.mkdtemp(prefix="predict-accuracy-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}\nstarted {time.strftime('%Y-%m-%d %H:%M')}, output under {out}", flush=True)
    presets = [p for p in args.presets.split(",") if p] or [name for name, _ in config.list_presets()]
    rows, skipped, fits = [], [], {}
    given = [Path(d) for d in args.calibrate.split(",") if d]
    state = {"model": calibrate(given or [out / "calibration-smoke"], not given), "measured_any": False}
    fits["first"] = state["model"].fit_error
    for preset in presets:
        for ws in [int(x) for x in args.world_sizes.split(",")]:
            for rep in range(args.repeats):
                tag = f"{preset}-ws{ws}" + (f"-r{rep + 1}" if args.repeats > 1 else "")
                got = one_round(args, preset, ws, tag, out, given, state, fits, skipped if rep == 0 else [])
                if got is None:
                    break
                rows += [{**r, "repeat": rep + 1} for r in got]
    report(combine(rows) if args.repeats > 1 else rows, skipped, args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "rows": rows, "skipped": skipped,
                                               "fit_error": fits}, indent=2))
    return 0


def one_round(args: argparse.Namespace, preset: str, ws: int, tag: str, out: Path, given: list[Path], state: dict,
              fits: dict, skipped: list[str]) -> list[dict] | None:
    """Predict the runs of ``preset`` at ``ws`` ranks (a fresh calibration first, as asked), then run them; return a
    row per run (None when the preset cannot run at ``ws`` or none of its runs can be predicted)."""
    model = state["model"]
    try:
        sets = world_size_sets(preset, ws, model.backend, args.own_world_sizes)
        c = load_for(preset, sets, model.backend, False)
    except ConfigError as err:
        skipped.append(f"{preset} at {ws}: {err}")
        return None
    probes = (probe_runs(c, progress=lambda t: print(t, flush=True), device=model.device) if args.probe
              else None)
    anything = any(r["why"] is None for r in predict.predict_comparison(c, model, probes=probes)["runs"])
    if anything and args.fresh and not given and state["measured_any"]:
        model = calibrate([out / f"calibration-before-{tag}"], True, ws if args.collectives else 0)
        fits[tag] = model.fit_error
    elif anything and args.collectives:
        model = calibrate(given or list(LAST), False, ws)
    state["model"] = model
    plain = None  # with --probe on CPU: the same probes predicted without the factor, side by side
    if args.probe and args.comm_cost and model.backend == "gloo":
        plain = {r["name"]: r for r in predict.predict_comparison(c, model, probes=probes)["runs"]}
        model = predict_comm_cost.measure(model, [str(d) for d in (given or list(LAST))], probe_runs,
                                          predict.predict_run, progress=lambda t: print(f"calibration: {t}", flush=True))
        print(f"communication cost factor: {model.comm_cost.get('factor', 'none')} at "
              f"{model.comm_cost.get('world_size', '-')} ranks", flush=True)
    predicted = {r["name"]: r for r in predict.predict_comparison(c, model, probes=probes)["runs"]}
    if args.collectives:  # a run at another world size (tensor parallel's dp x tp) gets collectives timed there
        for other in sorted({r["world_size"] for r in predicted.values() if not r["why"]} - {ws}):
            at = calibrate(given or list(LAST), False, other)
            for run in c.runs:
                if predicted[run.name]["world_size"] == other:
                    predicted[run.name] = predict.predict_run(c, run, at, probed=(probes or {}).get(run.name))
    for r in predicted.values():
        if r["why"]:
            skipped.append(f"{preset}/{r['name']} at {r['world_size'] or ws}: not predicted: {r['why']}")
    names = {n for n, r in predicted.items() if not r["why"]}
    if not names:
        return None
    where = out / tag
    t0 = time.time()
    code = run_preset(str(only_runs(preset, names, out / f"{tag}.toml")), where,
                      [x for x in sets if not x.startswith("runs.") or x.split(".")[1] in names])
    summary = load_summary(str(where))
    state["measured_any"] = True
    print(f"{tag}: ran {len(names)} runs in {time.time() - t0:.0f} s (exit {code})", flush=True)
    rows = []
    for m in summary["runs"]:
        p = predicted.get(m["name"])
        if p is None or p["why"]:
            continue
        # an image model (vit) is predicted and measured in samples/s, a language model in tokens/s
        measured = (m.get("median_tokens_per_s") or m.get("median_samples_per_s")) if m["status"] == "ok" else None
        got = p.get("tokens_per_s") or p.get("samples_per_s")
        rows.append({"preset": preset, "world_size": m["world_size"], "run": m["name"],
                     "strategy": m["strategy"], "predicted": got, "measured": measured,
                     "error": got / measured - 1 if measured and got else None,
                     "split_ms": [round(p[k] * 1e3, 1) for k in ("compute_s", "exposed_comm_s", "rest_s")],
                     "bound": p.get("bound"), "status": m["status"],
                     "predicted_no_factor": predict.rate(plain[m["name"]]) if plain and m["name"] in plain else None,
                     "predicted_whole_factor": _whole_factor(plain.get(m["name"]) if plain else None, model)})
    return rows


def _whole_factor(plain: dict | None, model) -> float | None:
    """the 2026-11-27 prediction, for comparison: the same probe with the whole exposed communication (not only its
    latency part) multiplied by what the calibration's steps paid over the fit."""
    cc = model.comm_cost if model is not None else None
    if not plain or plain.get("why") or not cc or cc.get("world_size") != plain.get("world_size") or not plain["step_time_s"]:
        return None
    step = plain["step_time_s"] + (cc["paid_s"] / cc["predicted_s"] - 1.0) * plain["exposed_comm_s"]
    units = (plain.get("tokens_per_s") or plain.get("samples_per_s")) * plain["step_time_s"]
    return units / step if step > 0 else None


def combine(rows: list[dict]) -> list[dict]:
    """One row per run from its repeats: the median prediction against the median measurement (each repeat
    predicted from its own fresh calibration and probe, then run), with every repeat's own error kept beside it.
    The machine's speed moves by +-15-25% over seconds on a shared VM (RESULTS, 2026-11-26), in predictions and
    measurements alike; medians over interleaved repeats compare the predictor with the run, not with that noise."""
    by_run: dict[tuple, list[dict]] = {}
    for r in rows:
        by_run.setdefault((r["preset"], r["world_size"], r["run"]), []).append(r)
    out = []
    for group in by_run.values():
        measured = [r["measured"] for r in group if r["measured"]]
        pred = statistics.median(r["predicted"] for r in group)
        meas = statistics.median(measured) if measured else None
        plain = [r["predicted_no_factor"] for r in group if r.get("predicted_no_factor")]
        whole = [r["predicted_whole_factor"] for r in group if r.get("predicted_whole_factor")]
        out.append({**group[0], "predicted": pred, "measured": meas,
                    "predicted_no_factor": statistics.median(plain) if plain else None,
                    "predicted_whole_factor": statistics.median(whole) if whole else None,
                    "error": pred / meas - 1 if meas else None,
                    "repeat_errors": [r["error"] for r in group],
                    "measured_spread": max(measured) / min(measured) if measured else None})
    return out


def report(rows: list[dict], skipped: list[str], repeats: int = 1) -> None:
    """Print the per-strategy table and every run (with repeats: medians, and each repeat's own error)."""
    print(f"\nfinished {time.strftime('%Y-%m-%d %H:%M')}, load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    full = [r for r in rows if not r.get("bound")]
    # the A/B of the communication cost factor: the same probes predicted without it, and with the 2026-11-27 factor on
    # the whole exposed communication instead of on its latency part
    others = [k for k in ("predicted_no_factor", "predicted_whole_factor") if any(r.get(k) for r in full)]
    head = "".join({"predicted_no_factor": " without the factor: median / worst |",
                    "predicted_whole_factor": " factor on all communication (2026-11-27): median / worst |"}[k] for k in others)
    print(f"\n| strategy | runs | median abs error | worst abs error | within 15% / 30% |{head}\n|---|---|---|---|---|"
          + "---|" * len(others))

    def tail(mine: list[dict]) -> str:
        cells = []
        for k in others:
            errs = [abs(r[k] / r["measured"] - 1) for r in mine if r.get(k)]
            cells.append(f" {statistics.median(errs):.1%} / {max(errs):.1%} |" if errs else " - |")
        return "".join(cells)

    for s in sorted({r["strategy"] for r in full}):
        mine = [r for r in full if r["strategy"] == s and r["error"] is not None]
        if not mine:
            continue
        errs = [abs(r["error"]) for r in mine]
        print(f"| {s} | {len(errs)} | {statistics.median(errs):.1%} | {max(errs):.1%} | "
              f"{sum(e <= 0.15 for e in errs)} / {sum(e <= 0.30 for e in errs)} |{tail(mine)}")
    mine = [r for r in full if r["error"] is not None]
    errs = [abs(r["error"]) for r in mine]
    if errs:
        print(f"| all | {len(errs)} | {statistics.median(errs):.1%} | {max(errs):.1%} | "
              f"{sum(e <= 0.15 for e in errs)} / {sum(e <= 0.30 for e in errs)} |{tail(mine)}")
    bounds = [r for r in rows if r.get("bound") and r["error"] is not None]
    if bounds:
        held = sum(r["error"] >= 0 for r in bounds)
        print(f"\nupper bounds (no framework overhead calibrated for the strategy or its family): {len(bounds)}, "
              f"held (measured <= predicted) in {held}; per strategy: " + ", ".join(
                  f"{s} {sum(r['error'] >= 0 for r in bounds if r['strategy'] == s)}/"
                  f"{sum(r['strategy'] == s for r in bounds)}" for s in sorted({r["strategy"] for r in bounds})))
    extra = (" each repeat's error | measured max / min |", "---|---|") if repeats > 1 else ("", "")
    if repeats > 1:
        print(f"\n{repeats} repeats per run, each predicted from its own fresh calibration (and probe) and then run; "
              "a row is the median prediction against the median measurement")
    print("\n| preset | ranks | run | strategy | predicted tokens/s (vit: samples/s) | measured | error | predicted ms compute / "
          f"exposed comm / rest |{extra[0]}")
    print(f"|---|---|---|---|---|---|---|---|{extra[1]}")
    for r in rows:
        err = "-" if r["error"] is None else f"{r['error']:+.1%}"
        meas = f"{r['measured']:,.0f}" if r["measured"] else f"({r['status']})"
        more = ""
        if repeats > 1:
            each = ", ".join("-" if e is None else f"{e:+.0%}" for e in r["repeat_errors"])
            more = f" {each} | {r['measured_spread']:.2f} |" if r["measured_spread"] else f" {each} | - |"
        print(f"| {r['preset']} | {r['world_size']} | {r['run']} | {r['strategy']} | "
              f"{'≤ ' if r.get('bound') else ''}{r['predicted']:,.0f} | {meas} | "
              f"{err} | {' / '.join(str(x) for x in r['split_ms'])} |{more}")
    if skipped:
        print("\nnot predicted (not run):")
        for line in skipped:
            print(f"- {line}")


if __name__ == "__main__":
    sys.exit(main())
