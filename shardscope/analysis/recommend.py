"""A recommendation computed from one comparison's measured runs (summary.json, report.md, headless output).

``recommend(...)`` is pure: it takes summary.json's runs, each run's step-to-step spread of throughput
and, optionally, a device memory and the memory model's smallest world size at which each run would
fit; it returns the section written to summary.json as ``recommendation`` with the sentences views
print. ``section(...)`` gathers those inputs from a comparison's run states. Every sentence is built
from this run's numbers: the fastest run that fits, what each other run saves in memory per rank and
costs in throughput against the baseline, which runs would not fit the named device memory, and
"no clear difference" when runs differ by less than the noise: their own step-to-step spread or, larger, how far
the A/A control moved (``numbers.speed_verdict``, the one rule).
"""

from __future__ import annotations

from typing import Any

from shardscope.analysis import noise
from shardscope.core.numbers import fmt_bytes, move_of, relative_spread, speed_verdict, timed_rates

GPU_CAVEAT = ("these runs used gloo on CPU: their timings do not predict GPU (NCCL) behaviour — the memory "
              "figures of model states carry over, the throughput ranking may not")
SCALE_SIZES = tuple(2 ** k for k in range(13))  # world sizes the memory model is asked about, up to 4096


def _rate(run: dict[str, Any]) -> float | None:
    return run.get("median_tokens_per_s") or run.get("median_samples_per_s")


def _model_states(summary: dict[str, Any], name: str) -> int | None:
    run = ((summary.get("memory") or {}).get("runs") or {}).get(name) or {}
    return (run.get("measured") or {}).get("model_state_bytes")


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _between(summary: dict[str, Any], busy: bool = False) -> float | None:
    """How far the A/A control moved from its baseline (``noise.between``; on busy CPU time per token when ``busy``)."""
    between = (summary.get("noise") or {}).get("between") or {}
    if not between.get("measured"):
        return None
    return noise.busy_move(summary.get("noise") or {}) if busy else between.get("moved")


class _Measure:
    """What runs are ranked by: median tokens/s, or on a CPU whose cores the runs waited for, tokens per busy CPU
    second (``noise.busy_per_token``), which the wait does not distort."""

    def __init__(self, summary: dict[str, Any], device: str, spreads: dict[str, float | None], usable: list[dict]):
        noise = summary.get("noise") or {}
        busy = noise.get("busy_per_token") or {}
        self.contended = [n for n in noise.get("contended") or [] if n in {r["name"] for r in summary["runs"]}]
        self.busy = bool(device == "cpu" and self.contended and usable and all(busy.get(r["name"]) for r in usable))
        self.per_token = busy
        self.spreads = spreads
        self.between = _between(summary, self.busy)

    def of(self, run: dict[str, Any]) -> float | None:
        if self.busy:
            b = self.per_token.get(run["name"])
            return 1 / b if b else None
        return _rate(run)

    def verdict(self, run: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
        """``numbers.speed_verdict`` of ``run`` against ``reference`` on this measure (busy time has no step spread)."""
        spreads = (None, None) if self.busy else (self.spreads.get(run["name"]), self.spreads.get(reference["name"]))
        return speed_verdict(self.of(run), self.of(reference), *spreads, self.between)


def untested_reason(busy: bool) -> str:
    """Why a verdict was not tested against noise: no A/A control, and no step-to-step spread to fall back on."""
    return ("busy CPU time per token is one figure per run, with no step-to-step spread, and no A/A control ran"
            if busy else "fewer than 4 timed steps and no A/A control")


def verdict_text(v: dict[str, Any], busy: bool = False) -> str:
    """A verdict in words, with its interval or the reason it cannot tell."""
    what = "throughput per busy CPU second" if busy else "throughput"
    ratio = v["ratio"]
    if v["verdict"] == "untested":
        return f"{what} {ratio:.2f}x, not tested against noise ({untested_reason(busy)})"
    lo, hi = v["interval"]
    if v["verdict"] == "tie":
        moved = f"A/A moved {v['between']:.1%}" if v.get("between") is not None else "between-run noise not measured"
        return (f"{what} not distinguishable on this machine now ({ratio:.2f}x, band ±{v['band'] - 1:.1%}: {moved})")
    change = f"gains {_pct(ratio - 1)}" if ratio > 1 else f"costs {_pct(1 - ratio)}"
    return f"{change} {what} ({ratio:.2f}x, {lo:.2f}x-{hi:.2f}x with the noise)"


def _versus(v: dict[str, Any], name: str, busy: bool = False) -> str:
    """The winner's margin over the runner-up: ``1.43x fsdp (1.30x-1.57x with the noise)``."""
    if v["verdict"] == "untested":
        return f"{v['ratio']:.2f}x {name} — not tested against noise ({untested_reason(busy)})"
    lo, hi = v["interval"]
    return f"{v['ratio']:.2f}x {name}, {lo:.2f}x-{hi:.2f}x with the noise"


def recommend(summary: dict[str, Any], spreads: dict[str, float | None], device: str,
              device_memory_bytes: int | None = None,
              fits_at: dict[str, int | None] | None = None) -> dict[str, Any]:
    """Return the recommendation section for ``summary`` (its ``runs``, ``baseline`` and ``noise``).

    ``spreads``: each run's relative step-to-step spread of throughput (half-IQR / median; None when
    fewer than 4 timed steps). ``device``: "cpu" or "cuda" (a CPU comparison gets the gloo caveat).
    ``fits_at``: the smallest world size the memory model predicts each run fits ``device_memory_bytes``
    at (None: at none up to 4096). Every throughput verdict follows ``numbers.speed_verdict``, against the A/A
    control's movement (summary.json's ``noise``); the control itself is not ranked. Keys: ``fastest``,
    ``no_clear_difference``, ``ranked_by``, ``runs`` (per run: status, fits, saves, verdict), ``lines`` and
    ``caveats``.
    """
    runs = [r for r in summary.get("runs", []) if not r.get("control_of")]
    by_name = {r["name"]: r for r in runs}
    base = by_name.get(summary.get("baseline", ""))
    unit = "tokens/s" if any(r.get("median_tokens_per_s") for r in runs) else "samples/s"
    lines: list[str] = []
    per_run: dict[str, dict[str, Any]] = {}
    for r in runs:
        entry: dict[str, Any] = {"status": r["status"], "spread": spreads.get(r["name"]), "rate": _rate(r),
                                 "peak_mem_bytes": r.get("peak_mem_bytes"), "fits": None}
        if device_memory_bytes and r.get("peak_mem_bytes") is not None:
            entry["fits"] = r["peak_mem_bytes"] <= device_memory_bytes
        per_run[r["name"]] = entry
    usable = [r for r in runs if r["status"] == "ok" and _rate(r) and per_run[r["name"]]["fits"] is not False]
    measure = _Measure({**summary, "runs": runs}, device, spreads, usable)
    for r in runs:
        if r["status"] != "ok":
            lines.append(f"{r['name']} {r['status']}: left out of the recommendation"
                         + (f" ({str(r['error'])[:100]})" if r.get("error") else ""))
    if measure.busy:
        waits = (summary.get("noise") or {}).get("core_wait") or {}
        lines.append("ranks waited for a core (" + ", ".join(f"{n} {waits[n]:.0%}" for n in measure.contended)
                     + " of the time they were ready to run): wall-clock tokens/s measure this machine's load as much "
                       "as the strategy, so runs are ranked by tokens per busy CPU second, which the wait does not "
                       "distort; for wall-clock figures use fewer ranks or a quieter machine")
    fastest, tied = None, []
    if usable:
        ranked = sorted(usable, key=measure.of, reverse=True)
        fastest = ranked[0]["name"]
        # A run joins the group only when it is within the noise of every member already in it, so any
        # two runs named together are within each other's noise under the same rule the lines below use.
        for other in ranked[1:]:
            group = [ranked[0], *(by_name[n] for n in tied)]
            if all(measure.verdict(other, m)["verdict"] == "tie" for m in group):
                tied.append(other["name"])
        fits_note = " that fits" if device_memory_bytes else ""
        if tied:
            lines.append(f"no clear difference in {'busy-time ' if measure.busy else ''}throughput between "
                         f"{', '.join([fastest, *tied])}: not distinguishable on this machine now; choose by memory")
        else:
            second = ranked[1] if len(ranked) > 1 else None
            top = ranked[0]
            how = f"{_rate(top):,.0f} {unit}" if not measure.busy else f"{measure.of(top):,.0f} tokens per busy CPU s"
            versus = f", {_versus(measure.verdict(top, second), second['name'], measure.busy)}" if second else ""
            lines.append(f"fastest run{fits_note}: {fastest} ({how}{versus})")
    elif runs:
        lines.append("no run finished ok" + (" within the device memory" if device_memory_bytes else "")
                     + ": nothing to recommend")
    if base is not None and _rate(base):
        for r in runs:
            if r is base or r["status"] != "ok" or not _rate(r):
                continue
            entry = per_run[r["name"]]
            v = measure.verdict(r, base)
            entry["throughput_ratio"] = _rate(r) / _rate(base)
            entry["verdict"] = v
            entry["within_noise_of_baseline"] = None if v["verdict"] == "untested" else v["verdict"] == "tie"
            cost = verdict_text(v, measure.busy)
            saved = None
            states = _model_states(summary, r["name"]), _model_states(summary, base["name"])
            # A summary from before peak_mem_kind existed compared peaks: read it as it was written.
            gpu = "process RSS" not in (r.get("peak_mem_kind"), base.get("peak_mem_kind"))
            if gpu and r.get("peak_mem_bytes") is not None and base.get("peak_mem_bytes") is not None:
                saved = base["peak_mem_bytes"] - r["peak_mem_bytes"]
                what = "allocator peak memory"
            elif not gpu and None not in states:  # process RSS is not comparable: rank by what is
                saved, what = states[1] - states[0], "model-state memory (counted exactly; process RSS not compared)"
            entry["mem_saved_bytes"] = saved
            mem = ("memory not measured" if saved is None else
                   (f"saves {fmt_bytes(saved)} of {what} per rank" if saved >= 0
                    else f"uses {fmt_bytes(-saved)} more {what} per rank"))
            if None not in states:
                entry["model_states_saved_bytes"] = states[1] - states[0]
                if gpu:
                    mem += f" (model states {fmt_bytes(states[1])} -> {fmt_bytes(states[0])}, counted exactly)"
            # the bracketed figures on the ratio's own basis: a run with more wall-clock tokens/s is never said to cost
            shown = ((measure.of(r), measure.of(base), "tokens per busy CPU s") if measure.busy
                     else (_rate(r), _rate(base), unit))
            figures = (f" ({shown[0]:,.0f} vs {shown[1]:,.0f} {shown[2]})"
                       if shown[0] is not None and shown[1] is not None else "")
            lines.append(f"{r['name']} vs {base['name']}: {mem}, {cost}{figures}")
    if device_memory_bytes:
        for r in runs:
            entry = per_run[r["name"]]
            at = (fits_at or {}).get(r["name"])
            entry["fits_at_world_size"] = at
            scale = ("the memory model (model states, gathered units and activations; not the runtime's or the "
                     "allocator's own memory) predicts it " + (f"fits from world size {at}" if at
                                                               else "does not fit at any world size up to 4096"))
            if entry["fits"] is False:
                lines.append(f"{r['name']} would not fit {fmt_bytes(device_memory_bytes)}: peak "
                             f"{fmt_bytes(r['peak_mem_bytes'])} per rank at the measured batch; {scale}")
            elif entry["fits"] is None:
                lines.append(f"{r['name']}: fit in {fmt_bytes(device_memory_bytes)} not measured (no peak memory)")
    if summary.get("noise"):
        lines.append(noise.line(summary["noise"], measure.busy))
    caveats = [GPU_CAVEAT] if device == "cpu" else []
    return {"device": device, "device_memory_bytes": device_memory_bytes, "unit": unit, "fastest": fastest,
            "no_clear_difference": [fastest, *tied] if tied else [], "runs": per_run, "lines": lines,
            "ranked_by": "tokens per busy CPU second" if measure.busy else unit, "caveats": caveats}


def smallest_fitting_world_size(c: Any, run: Any, device_memory_bytes: int) -> int | None:
    """The smallest world size (a power of two, a multiple of the run's tp, up to 4096) at which the
    memory model's total per rank fits ``device_memory_bytes``; None if none does."""
    from shardscope.profiling import memory_model

    for ws in SCALE_SIZES:
        d = memory_model.describe_run(c, run, ws)
        layout = d.layout
        if ws % layout.tp or c.global_batch % max(1, (ws // layout.tp) * layout.accum):
            continue
        if memory_model.predict_run(c, run, ws, described=d)["total_bytes"] <= device_memory_bytes:
            return ws
    return None


def device_of(states: dict[str, Any]) -> str:
    """"cpu", "cuda" or "unknown": what the runs that started ran on. A run with no start record (it failed before
    its first record) names no device and changes nothing: the ranking's basis never follows a failure."""
    devices = {str((st.start.get(0) or {}).get("device", "")) for st in states.values()} - {""}
    if devices and all(d == "cpu" for d in devices):
        return "cpu"
    return "cuda" if any(d.startswith("cuda") for d in devices) else "unknown"


def section(c: Any, states: dict[str, Any], summary: dict[str, Any],
            device_memory_bytes: int | None = None) -> dict[str, Any]:
    """The recommendation for a comparison ``c`` whose runs are folded into ``states`` (``RunState``s)."""
    spreads = {name: relative_spread(timed_rates(st.throughput)) for name, st in states.items()}
    device = device_of(states)
    fits_at = ({r.name: smallest_fitting_world_size(c, r, device_memory_bytes) for r in c.runs}
               if device_memory_bytes else None)
    return recommend(summary, spreads, device, device_memory_bytes, fits_at)


def plain_lines(rec: dict[str, Any]) -> list[str]:
    """The recommendation's sentences, then its caveats ("caveat: ..."), for plain-text views."""
    return list(rec.get("lines") or []) + [f"caveat: {c}" for c in rec.get("caveats") or []]


def markdown(rec: dict[str, Any]) -> str:
    """report.md's recommendation section."""
    if not rec:
        return ""
    body = "\n".join(f"- {line}" for line in rec["lines"] + [f"**Caveat**: {c}" for c in rec["caveats"]])
    return f"## Recommendation\n\n{body}\n"
