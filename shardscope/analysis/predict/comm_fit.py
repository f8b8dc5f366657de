"""Collectives of a machine: one time per call, fitted as latency per ring step + bytes x bus factor / bus
bandwidth (nccl-tests' factors, ``traces.BUS_FACTORS``), for ``predict_fit``; and the small non-negative
least-squares solver both fits use. Pure Python, no torch.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from shardscope.profiling.traces import BUS_FACTORS

DERIVABLE = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")  # the types comm_theory moves
Call = tuple[str, float, float, int]  # (type, bytes, seconds, group size): one collective, its fastest rank


def ring_steps(kind: str, n: int) -> float:
    """Latency steps of a ring collective over ``n`` ranks (an all-reduce is two passes)."""
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) if kind == "all_reduce" else (math.ceil(math.log2(n)) if kind == "broadcast" else n - 1.0)


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' busbw / algbw factor of ``kind`` over ``n`` ranks (1 for unknown types)."""
    factor = BUS_FACTORS.get(kind)
    return factor(n) if factor and n > 1 else 1.0


@dataclass
class CollectiveFit:
    """time = step_latency_s x ring_steps(n) + bytes x bus_factor(n) / busbw_Bps."""

    kind: str
    step_latency_s: float  # per ring step at ``group``: its own type's when every type was timed at 3+ sizes, else shared
    busbw_Bps: float
    group: int  # the group size it was measured at
    points: int  # collectives measured (each the fastest rank's time of one call)
    sizes: int  # distinct message sizes seen
    rel_rms_error: float | None
    source: str  # "measured" | "derived from <type>"
    # per ring step at each group size timed at 3+ sizes apart from ``group`` (predict --collectives on CPU times
    # the world's subgroups too: with more ranks than cores a pair's call costs more than the ring steps say)
    latency_by_group: dict[int, float] = field(default_factory=dict)

    def seconds(self, nbytes: float, n: int) -> float:
        """Predicted seconds for one collective of ``nbytes`` over ``n`` ranks."""
        if n <= 1:
            return 0.0
        return self.latency_seconds(n) + nbytes * bus_factor(self.kind, n) / self.busbw_Bps

    def latency_seconds(self, n: int) -> float:
        """The latency part of one collective over ``n`` ranks: what a call costs whatever its size."""
        if n <= 1:
            return 0.0
        return self.latency_by_group.get(n, self.step_latency_s) * ring_steps(self.kind, n)


def solve(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """Least squares with non-negative coefficients (a column whose coefficient comes out negative, or that is
    all zero, is left at 0 and the rest refitted); None when no column is left or the system is singular."""
    active = [i for i in range(len(rows[0])) if any(r[i] for r in rows)]  # an all-zero column stays 0
    while active:
        k = len(active)
        a = [[sum(r[i] * r[j] for r in rows) for j in active] + [sum(r[i] * y for r, y in zip(rows, ys))] for i in active]
        for col in range(k):  # Gaussian elimination with partial pivoting
            pivot = max(range(col, k), key=lambda i: abs(a[i][col]))
            if abs(a[pivot][col]) < 1e-300:
                return None
            a[col], a[pivot] = a[pivot], a[col]
            for i in range(k):
                if i != col:
                    f = a[i][col] / a[col][col]
                    a[i] = [x - f * y for x, y in zip(a[i], a[col])]
        coef = [a[i][k] / a[i][i] for i in range(k)]
        if all(x >= 0 for x in coef):
            out = [0.0] * len(rows[0])
            for i, x in zip(active, coef):
                out[i] = x
            return out
        active.pop(min(range(k), key=lambda i: coef[i]))
    return None


def rel_rms(pred: list[float], ys: list[float]) -> float | None:
    """Root mean square of (predicted - measured) / measured over the measured values above 0; None without."""
    errs = [(p - y) / y for p, y in zip(pred, ys) if y > 0]
    return math.sqrt(statistics.fmean(e * e for e in errs)) if errs else None


def fit_collectives(calls: list[Call], notes: list[str]) -> dict[str, CollectiveFit]:
    """One ``CollectiveFit`` per type measured, plus types derived from the best-measured one.

    One least-squares fit over every call: a latency per ring step shared by all types (on one machine it
    is the same wake-up and handshake whatever the type) and a bus bandwidth per type, each call weighted
    by its own time, so that a 100-byte all-reduce and a 10 MB one count alike (relative error)."""
    points = [p for p in calls if p[3] > 1 and p[2] > 0]  # a call timed at 0 or less (noise) says nothing
    kinds = sorted({k for k, _, _, _ in points})
    fits: dict[str, CollectiveFit] = {}
    if not points:
        return fits
    sizes = {kind: len({round(b) for k, b, _, _ in points if k == kind}) for kind in kinds}
    # A latency per type when every type was timed at 3 sizes or more (predict --collectives): on CPU a call's
    # fixed cost differs by type (gloo's algorithms, wake-ups per ring step), which one shared figure fits badly
    # (an in-step reduce-scatter of 4 KiB at 4 ranks on 2 cores: 7.6 ms, a broadcast 0.8 ms). Otherwise one
    # latency per ring step shared by all types (on one machine, the same wake-up and handshake whatever the type).
    # With several group sizes timed (the world and its subgroups), a latency per type and group size.
    pairs = sorted({(k, n) for k, _, _, n in points})
    own = min(len({round(b) for k, b, _, n in points if (k, n) == pair}) for pair in pairs) >= 3
    lat: list[tuple[str, int]] = pairs if own else [("*", 0)]
    rows = [[ring_steps(k, n) / t if own is False or (k, n) == key else 0.0 for key in lat]
            + [b * bus_factor(k, n) / t if k == kind else 0.0 for kind in kinds] for k, b, t, n in points]
    if len({(k, round(b)) for k, b, _, _ in points}) <= len(kinds):  # one size per type: latency not separable
        notes.append("collectives: one message size per type measured: latency not separable, all their time "
                     "charged to bandwidth (predict --collectives times several sizes)")
        rows = [[0.0] * len(lat) + r[len(lat):] for r in rows]
    coef = solve(rows, [1.0] * len(points))
    if coef is None:
        notes.append("collectives: the fit is singular; no collective timing")
        return fits
    latencies, coef = dict(zip(lat, coef[:len(lat)])), [0.0] + coef[len(lat):]
    for i, kind in enumerate(kinds, 1):
        mine = [p for p in points if p[0] == kind]
        group = statistics.mode(n for _, _, _, n in mine)
        by_group = {n: x for (k, n), x in latencies.items() if k == kind} if own else {}
        latency = by_group.get(group, latencies.get(("*", 0), 0.0))

        def lat_of(n: int) -> float:
            return by_group.get(n, latency)

        if coef[i] <= 0:  # all of its time went to latency: its bandwidth is not measurable here
            per_byte = sum(max(0.0, t - lat_of(n) * ring_steps(k, n)) for k, _, t, n in mine) / sum(
                b * bus_factor(k, n) for k, b, _, n in mine)
            coef[i] = per_byte or 1e-12
        fit = CollectiveFit(kind, latency, 1.0 / coef[i], group, len(mine), len({round(b) for _, b, _, _ in mine}),
                            None, "measured", {n: x for n, x in by_group.items() if n != group})
        fit.rel_rms_error = rel_rms([fit.seconds(b, n) for _, b, _, n in mine], [t for _, _, t, _ in mine])
        fits[kind] = fit
    weak = [f"{f.kind} ({f.points} calls, {f.sizes} sizes, rms error {f.rel_rms_error:.0%})" for f in fits.values()
            if f.sizes < 3 or (f.rel_rms_error or 0) > 0.5]
    if weak:
        notes.append("collective fits resting on few sizes or scattered calls: " + ", ".join(weak)
                     + "; predict --collectives times four sizes of every type")
    base = max(fits.values(), key=lambda f: f.points)  # a derived type takes its latency and bandwidth
    for kind in DERIVABLE:
        if kind not in fits:
            fits[kind] = CollectiveFit(kind, base.step_latency_s, base.busbw_Bps, base.group, 0, 0, None,
                                       f"derived from {base.kind}")
    return fits
