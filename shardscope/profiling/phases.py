"""The communication of one optimizer step, phase by phase: forward, backward, step.

Two sides, both pure Python (no torch), for the explainers and report.md:

- ``theory_phases``: what the strategy sends in each phase, from the memory model's layout and units
  (one FSDP/ZeRO-3 unit per block plus the root) and the bytes of the communication theory
  (``comm_theory.expected_comm``'s per-collective totals, split over the phases, so the phases add up
  to the theory exactly).
- ``measured_phases``: the collectives of the first profiled step of one rank's trace
  (``traces.load_rank_trace``), each put in the phase whose marker encloses its launch (the training
  loop wraps forward, backward and the optimizer step in ``PHASE_MARKERS``; a collective outside them,
  like the loss all-reduce of a step an fp16 scaler skipped, belongs to the step), and labelled with the layer whose annotation
  encloses it (FSDP2 names ``layers.N``); ``timeline`` draws them as text.
"""

from __future__ import annotations

import re
from typing import Any

from shardscope.core.events import PHASE_MARKERS
from shardscope.core.numbers import fmt_bytes

PHASES = ("forward", "backward", "step")
_LAYER = re.compile(rb"layers\.(\d+)")
_ROOT = re.compile(rb"^FSDP::[a-z_]+( \(\))?$")  # FSDP2's root unit: an annotation without a module name
GLYPH = {"all_gather": "G", "reduce_scatter": "S", "all_reduce": "R", "broadcast": "B", "all_to_all": "A"}


def _row(phase: str, kind: str, count: int | None, total: float, what: str) -> dict[str, Any]:
    return {"phase": phase, "type": kind, "count": count, "bytes": total,
            "bytes_each": total / count if count else None, "what": what}


def theory_phases(c: Any, run: Any, theory: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows ``{phase, type, count, bytes, bytes_each, what}`` for one optimizer step of ``run`` in ``c``.

    ``theory`` is ``comm_theory.expected_comm``'s dict for the run; each collective type's bytes are
    split over the phases, so the rows of a type add up to ``theory["by_type"][type]``. ``count`` is
    None where the runtime's bucketing decides it (DDP, ZeRO).
    """
    from shardscope.profiling import comm_theory, memory_model
    from shardscope.profiling.run_description import describe_run

    by_type = dict(theory.get("by_type") or {})
    d = describe_run(c, run)  # the model and its layout, read below
    layout, options, quirks, params = d.layout, d.options, d.quirks, list(d.params)
    accum = max(1, layout.accum)
    units = d.unit_numels
    n_units, n_blocks = len(units), len(units) - ("root" in units)
    rows: list[dict[str, Any]] = []
    tp_bytes = 0.0
    if layout.tp > 1 and "all_reduce" in by_type:
        # As the theory counts them: 2 per layer in forward (row-parallel outputs), one per column-parallel
        # linear in backward (its input gradient is a partial sum).
        h, layers, seq = d.model.hidden, d.model.layers, d.model.tokens_per_sample
        compute = memory_model.PRECISION_BYTES.get(layout.precision, (4, 4, 4))[2]
        micro = max(1, c.global_batch // (layout.dp * accum))
        col = comm_theory.column_linears(params)
        one = layers * micro * seq * h * compute * accum
        tp_bytes = min(by_type["all_reduce"], (2 + col) * one)
        rows.append(_row("forward", "all_reduce", 2 * layers * accum, tp_bytes * 2 / (2 + col),
                         f"tensor parallel: 2 per layer × {layers} layers (attention and MLP outputs, {layout.tp} ways)"))
        rows.append(_row("backward", "all_reduce", col * layers * accum, tp_bytes * col / (2 + col),
                         f"tensor parallel: one per column-parallel linear ({col} per layer), input gradients"))
    dp_reduce = by_type.get("all_reduce", 0.0) - tp_bytes
    bucket = options.get("bucket_cap_mb", options.get("bucket_mb"))
    buckets = f"in buckets of up to {bucket} MiB" if bucket else "in buckets"
    if layout.pp > 1:  # a pipeline's step runs as one schedule: its transfers and reduction sit in the step
        stages = layout.pp * layout.v
        for kind in ("send", "recv"):
            rows.append(_row("step", kind, None, by_type.get(kind, 0.0),
                             f"activations forward and gradients back across {stages - 1} stage boundaries, "
                             f"{layout.microbatches} micro-batches each (mean over ranks)"))
        rows.append(_row("step", "all_reduce", None, by_type.get("all_reduce", 0.0),
                         "the gradient norm across the stages" + (f" and each stage's gradients across the "
                                                                  f"{layout.dp} pipelines" if layout.dp > 1 else "")))
        return rows
    if layout.dp > 1 and layout.shards in ("none", "optim", "grads") and dp_reduce > 0:
        rows.append(_row("backward", "all_reduce", None, dp_reduce,
                         f"every gradient, {buckets}" + (", launched as each bucket's gradients are ready"
                                                         if layout.shards == "none" else
                                                         ": each rank keeps the average of its own partition")))
    if layout.dp > 1 and layout.shards in ("optim", "grads"):
        if by_type.get("reduce_scatter"):
            rows.append(_row("backward", "reduce_scatter", None, by_type["reduce_scatter"],
                             f"gradients {buckets}: each rank keeps the average of its own partition"))
        rows.append(_row("step", "all_gather", None, by_type.get("all_gather", 0.0),
                         "each rank's updated parameter partition, to every rank"))
    elif layout.dp > 1 and layout.shards == "all":
        # The theory says whether units are gathered again in backward, and whether the root is.
        regather = "and backward" in str(theory.get("basis", ""))
        kept_per_micro = "live-params-kept" in quirks and not regather  # ZeRO-3: gathered in every micro-batch
        back = {k: n for k, n in units.items() if not ("root-kept" in quirks and k == "root")} if regather else {}
        gathers = by_type.get("all_gather", 0.0)
        fwd = gathers * sum(units.values()) / (sum(units.values()) + sum(back.values()))
        unit_text = f"one per unit: the root and {n_blocks} block(s)" + (
            f", within a shard group of {layout.shard_size}" if layout.hybrid else "")
        rep = accum if regather or kept_per_micro else 1
        rows.append(_row("forward", "all_gather", n_units * rep, fwd,
                         unit_text + (", kept until backward" if not regather else ", each freed after use"
                                      + ("; the root kept" if len(back) < n_units else ""))))
        if back:
            rows.append(_row("backward", "all_gather", len(back) * accum, gathers - fwd,
                             "the units freed after forward, again, in reverse order"
                             + ("; the root stayed gathered" if len(back) < n_units else "")))
        per_micro = accum if "reduces-per-micro-batch" in quirks else 1
        rows.append(_row("backward", "reduce_scatter", n_units * per_micro, by_type.get("reduce_scatter", 0.0),
                         "each unit's gradients as soon as they are computed; each rank keeps its shard"
                         + (f" (within its shard group of {layout.shard_size})" if layout.hybrid else "")))
        if layout.hybrid:
            rows.append(_row("backward", "all_reduce", n_units * per_micro, dp_reduce,
                             f"each unit's gradient shard, right after its reduce-scatter, across the "
                             f"{layout.dp // layout.shard_size} replica(s) of the shard group"))
    if by_type.get("broadcast"):
        rows.append(_row("forward", "broadcast", 1, by_type["broadcast"],
                         "the module's buffers from rank 0, before the step's first forward"))
    if layout.dp > 1:
        rows.append({"phase": "step", "type": "all_reduce", "count": None, "bytes": None, "bytes_each": None,
                     "what": "the loss (one number) and, with clipping, the squared gradient norm: a few bytes, "
                             "outside the theory's totals"})
    return rows


# --- measured --------------------------------------------------------------------------------------


def _enclosing(intervals: list[tuple[float, float, bytes]], ts: float) -> bytes | None:
    """The shortest interval's name that contains ``ts``."""
    best = None
    for start, end, name in intervals:
        if start <= ts <= end and (best is None or end - start < best[1] - best[0]):
            best = (start, end, name)
    return best[2] if best else None


def _phases_from_autograd(events: list[tuple[bytes, ...]], lo: float, hi: float) -> list[tuple[float, float, bytes]]:
    """Phase intervals of a trace written before the loop marked its phases: backward runs from the first
    autograd engine event to the end of the last event named for backward; forward before it."""
    first, last = None, None
    for cat, name, pid, tid, ts, dur in events:
        start = float(ts)
        if not lo <= start <= hi:
            continue
        if name.startswith(b"autograd::engine::evaluate_function") and (first is None or start < first):
            first = start
        if b"backward" in name.lower() or name.startswith(b"autograd::engine"):
            last = max(last or start, start + float(dur))
    if first is None or last is None:
        return []
    return [(lo, first, PHASE_MARKERS["forward"].encode()), (first, last, PHASE_MARKERS["backward"].encode())]


def measured_phases(trace_path: str) -> dict[str, Any]:
    """The collectives of the first profiled step of one rank's trace, in launch order.

    Returns ``{"rank", "step", "step_time_s", "marked", "events": [{phase, type, bytes, layer, start_s,
    dur_s}], "rows": [{phase, type, count, bytes, bytes_each}]}`` (times from the step's start), or
    ``{"why": reason}`` when the trace cannot be read or holds no profiled step.
    """
    from shardscope.profiling import traces

    try:
        trace = traces.load_rank_trace(trace_path)
    except (OSError, ValueError, KeyError) as err:
        return {"why": f"trace unreadable ({err})"}
    if not trace.steps or not trace.marked_steps:
        return {"why": "the trace has no ProfilerStep markers"}
    number, lo, hi = trace.steps[0]
    markers = {m.encode(): p for p, m in PHASE_MARKERS.items()}
    phases: list[tuple[float, float, bytes]] = []
    layers: list[tuple[float, float, bytes]] = []
    for cat, name, pid, tid, ts, dur in trace.events:
        start = float(ts)
        if not lo <= start <= hi:
            continue
        end = start + float(dur)
        if name in markers:
            phases.append((start, end, name))
        elif cat == b"user_annotation":
            match = _LAYER.search(name)
            if match:
                layers.append((start, end, b"layers." + match.group(1)))
            elif _ROOT.match(name):
                layers.append((start, end, b"root"))
    marked = bool(phases)
    if not marked:
        phases = _phases_from_autograd(trace.events, lo, hi)
    events = []
    for col in trace.collectives:
        if col.step != 0:
            continue
        phase = markers.get(_enclosing(phases, col.launch_ts) or b"", "step")
        layer = _enclosing(layers, col.launch_ts)
        events.append({"phase": phase, "type": col.type, "bytes": col.size_bytes,
                       "layer": layer.decode() if layer else None,
                       "start_s": (col.start_us - lo) / 1e6, "dur_s": col.dur_us / 1e6})
    events.sort(key=lambda e: e["start_s"])
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for e in events:
        row = rows.setdefault((e["phase"], e["type"]), {"phase": e["phase"], "type": e["type"], "count": 0, "bytes": 0})
        row["count"] += 1
        # one launch of unknown size makes the row's bytes unknown: a partial sum would look measured
        row["bytes"] = None if row["bytes"] is None or e["bytes"] is None else row["bytes"] + e["bytes"]
    for row in rows.values():
        row["bytes_each"] = None if row["bytes"] is None else row["bytes"] / row["count"]
        if row["bytes"] is None:
            row["why"] = "size unknown: the trace records neither its buffers nor its group"
    ordered = sorted(rows.values(), key=lambda r: (PHASES.index(r["phase"]), r["type"]))
    return {"rank": trace.rank, "step": number, "step_time_s": (hi - lo) / 1e6, "marked": marked,
            "events": events, "rows": ordered}


# --- views -----------------------------------------------------------------------------------------


def _bytes(n: float | None) -> str:
    return fmt_bytes(n, sig=4, missing="?")  # four digits: predicted and measured sizes side by side


def _count(kind: str, count: int | None) -> str:
    name = kind.replace("_", "-")
    if count is None:
        return f"{name}s"
    return f"{count} {name}" + ("s" if count != 1 else "")


def sequence_lines(theory: list[dict[str, Any]], measured: dict[str, Any] | None, why_not: str) -> list[str]:
    """One markdown bullet per (phase, collective): the theory's count and bytes beside the profiled step's."""
    got = {(r["phase"], r["type"]): r for r in (measured or {}).get("rows", [])}
    keys = [(r["phase"], r["type"]) for r in theory]
    keys += [k for k in got if k not in keys]
    keys.sort(key=lambda k: PHASES.index(k[0]))
    predicted = {(r["phase"], r["type"]): r for r in theory}
    lines = []
    for key in keys:
        p, m = predicted.get(key), got.get(key)
        if p is not None and p["bytes"] is None:
            pred = f"{_count(key[1], p['count'])}: {p['what']}"
        elif p is not None:
            each = f" (mean {_bytes(p['bytes_each'])})" if p["bytes_each"] is not None and p["count"] != 1 else ""
            pred = f"{_count(key[1], p['count'])} = {_bytes(p['bytes'])}{each} predicted ({p['what']})"
        else:
            pred = f"no {key[1].replace('_', '-')} predicted"
        if m is not None and m["bytes"] is None:
            meas = f"measured {_count(key[1], m['count'])}, bytes not measured ({m.get('why', 'size unknown')})"
        elif m is not None:
            each = f" (mean {_bytes(m['bytes_each'])})" if m["count"] != 1 else ""
            meas = f"measured {_count(key[1], m['count'])} = {_bytes(m['bytes'])}{each}"
        elif measured and "rows" in measured:
            meas = "none measured"
        else:
            meas = (measured or {}).get("why") and f"not measured ({measured['why']})" or why_not
        lines.append(f"- **{key[0]}**: {pred}; {meas}")
    return lines


def timeline(measured: dict[str, Any], width: int = 60) -> str:
    """A text picture of the profiled step: a phase bar, then one row per collective type marking when
    it ran, then the collectives in launch order with their phase, layer and size."""
    events = measured.get("events") or []
    span = measured.get("step_time_s") or 0.0
    if not events or span <= 0:
        return ""
    col = (lambda t: min(width - 1, max(0, int(t / span * width))))
    phase_bar = [" "] * width
    for e in events:
        phase_bar[col(e["start_s"])] = e["phase"][0].upper()
    kinds = sorted({e["type"] for e in events})
    label = max(len(k) for k in kinds + ["phase"]) + 1
    head = (f"rank {measured['rank']}, profiled step {measured['step']} ({span * 1e3:.1f} ms; F/B/S = launched in "
            f"forward/backward/step)")
    out = [head, f"{'phase':<{label}}|{''.join(phase_bar)}|"]
    for kind in kinds:
        row = [" "] * width
        for e in (x for x in events if x["type"] == kind):
            for i in range(col(e["start_s"]), col(e["start_s"] + e["dur_s"]) + 1):
                row[i] = GLYPH.get(kind, "#")
        out.append(f"{kind:<{label}}|{''.join(row)}|")
    out.append(f"{'':<{label}} 0 ms{'':>{width - 10}}{span * 1e3:.0f} ms")
    shown = events[:24]
    for i, e in enumerate(shown, 1):
        out.append(f"{i:>3}. {e['phase']:<8} {e['type'].replace('_', '-'):<15} {e['layer'] or '-':<10} "
                   f"{_bytes(e['bytes']):>10}  at {e['start_s'] * 1e3:7.2f} ms, {e['dur_s'] * 1e3:.2f} ms")
    if len(events) > len(shown):
        out.append(f"     … {len(events) - len(shown)} more")
    return "\n".join(out)


def run_phases(c: Any, run: Any, theory: dict[str, Any], trace_path: str | None) -> dict[str, Any]:
    """summary.json's per-run ``phases`` entry: the theory's rows, the measured rows and events of one
    rank's first profiled step (``{"why": ...}`` when there is no trace) and the timeline text."""
    measured = measured_phases(trace_path) if trace_path else {"why": "no trace: profiling off, or the run ended "
                                                                      "before its profiled steps"}
    return {"theory": theory_phases(c, run, theory), "measured": measured,
            "timeline": timeline(measured) if "events" in measured else ""}
