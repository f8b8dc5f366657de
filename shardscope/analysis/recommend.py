"""A recommendation computed from one comparison's measured runs (summary.json, report.md, headless output).

``recommend(...)`` is pure: it takes summary.json's runs, each run's step-to-step spread of throughput
and, optionally, a device memory and the memory model's smallest world size at which each run would
fit; it returns the section written to summary.json as ``recommendation`` with the sentences views
print. ``section(...)`` gathers those inputs from a comparison's run states. Every sentence is built
from this run's numbers: the fastest run that fits, what each other run saves in memory per rank and
costs in throughput against the baseline, which runs would not fit the named device memory, and
"no clear difference" when runs differ by less than their own spread.
"""

from __future__ import annotations

from typing import Any

from shardscope.core.numbers import fmt_bytes, relative_spread, timed_rates, within_noise

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


def _tied(rate: float, reference: float, spread: float | None, reference_spread: float | None) -> bool | None:
    """The one noise rule (``numbers.within_noise``): True when ``rate`` is within the two runs'
    spreads of ``reference``; None when a spread is not measured."""
    return within_noise(rate, reference, spread, reference_spread)


def recommend(summary: dict[str, Any], spreads: dict[str, float | None], device: str,
              device_memory_bytes: int | None = None,
              fits_at: dict[str, int | None] | None = None) -> dict[str, Any]:
    """Return the recommendation section for ``summary`` (its ``runs`` and ``baseline``).

    ``spreads``: each run's relative step-to-step spread of throughput (half-IQR / median; None when
    fewer than 4 timed steps). ``device``: "cpu" or "cuda" (a CPU comparison gets the gloo caveat).
    ``fits_at``: the smallest world size the memory model predicts each run fits ``device_memory_bytes``
    at (None: at none up to 4096). Keys: ``fastest``, ``no_clear_difference``, ``runs`` (per run:
    status, fits, saves, costs), ``lines`` (sentences, in order) and ``caveats``.
    """
    runs = summary.get("runs", [])
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
    for r in runs:
        if r["status"] != "ok":
            lines.append(f"{r['name']} {r['status']}: left out of the recommendation"
                         + (f" ({str(r['error'])[:100]})" if r.get("error") else ""))
    fastest, tied = None, []
    if usable:
        ranked = sorted(usable, key=_rate, reverse=True)
        fastest = ranked[0]["name"]
        top = _rate(ranked[0])
        # A run joins the group only when it is within the noise of every member already in it, so any
        # two runs named together are within each other's noise under the same rule the lines below use.
        for other in ranked[1:]:
            group = [ranked[0], *(by_name[n] for n in tied)]
            if all(_tied(_rate(other), _rate(m), spreads.get(other["name"]), spreads.get(m["name"]))
                   for m in group):
                tied.append(other["name"])
        fits_note = " that fits" if device_memory_bytes else ""
        if tied:
            spread = max(spreads[n] or 0 for n in [fastest, *tied])
            lines.append(f"no clear difference in throughput between {', '.join([fastest, *tied])}: they differ by "
                         f"less than their own step-to-step spread (up to ±{_pct(spread)}); choose by memory")
        else:
            second = ranked[1] if len(ranked) > 1 else None
            why = (f", {top / _rate(second):.2f}x {second['name']}" if second else "")
            unknown = second and _tied(_rate(second), top, spreads.get(second["name"]), spreads.get(fastest)) is None
            lines.append(f"fastest run{fits_note}: {fastest} ({top:,.0f} {unit}{why})"
                         + (" — spread not measured (fewer than 4 timed steps), so the margin is untested"
                            if unknown else ""))
    elif runs:
        lines.append("no run finished ok" + (" within the device memory" if device_memory_bytes else "")
                     + ": nothing to recommend")
    if base is not None and _rate(base):
        for r in runs:
            if r is base or r["status"] != "ok" or not _rate(r):
                continue
            entry = per_run[r["name"]]
            ratio = _rate(r) / _rate(base)
            entry["throughput_ratio"] = ratio
            noisy = _tied(_rate(r), _rate(base), spreads.get(r["name"]), spreads.get(base["name"]))
            entry["within_noise_of_baseline"] = noisy
            cost = ("throughput within the noise" if noisy else (f"costs {_pct(1 - ratio)} throughput" if ratio < 1
                                                                 else f"gains {_pct(ratio - 1)} throughput"))
            if noisy is None:
                cost += " (spread not measured: fewer than 4 timed steps, so not tested against noise)"
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
            lines.append(f"{r['name']} vs {base['name']}: {mem}, {cost} ({_rate(r):,.0f} vs {_rate(base):,.0f} {unit})")
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
    caveats = [GPU_CAVEAT] if device == "cpu" else []
    return {"device": device, "device_memory_bytes": device_memory_bytes, "unit": unit, "fastest": fastest,
            "no_clear_difference": [fastest, *tied] if tied else [], "runs": per_run, "lines": lines,
            "caveats": caveats}


def smallest_fitting_world_size(c: Any, run: Any, device_memory_bytes: int) -> int | None:
    """The smallest world size (a power of two, a multiple of the run's tp, up to 4096) at which the
    memory model's total per rank fits ``device_memory_bytes``; None if none does."""
    from shardscope.profiling import memory_model

    for ws in SCALE_SIZES:
        layout = memory_model.layout_for(c, run, ws)
        if ws % layout.tp or c.global_batch % max(1, (ws // layout.tp) * c.grad_accum):
            continue
        if memory_model.predict_run(c, run, ws)["total_bytes"] <= device_memory_bytes:
            return ws
    return None


def section(c: Any, states: dict[str, Any], summary: dict[str, Any],
            device_memory_bytes: int | None = None) -> dict[str, Any]:
    """The recommendation for a comparison ``c`` whose runs are folded into ``states`` (``RunState``s)."""
    spreads = {name: relative_spread(timed_rates(st.throughput)) for name, st in states.items()}
    devices = {str((st.start.get(0) or {}).get("device", "")) for st in states.values()}
    device = "cpu" if devices == {"cpu"} else ("cuda" if any(d.startswith("cuda") for d in devices) else "unknown")
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
