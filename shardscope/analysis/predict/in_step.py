"""Blocking calls between compute priced at what the collective job measured at their size (gloo, ``--probe``).

``predict --collectives`` times each collective type at a few sizes as what one call adds to a loop of
[a burst of matmuls; the call], every rank in lockstep (``predict_collectives.in_step_seconds``). That loop is
the pattern of a tensor-parallel layer's activation all-reduces and of the gradient norm's all-reduce: a
blocking call right after a stretch of compute, the same on every rank. The latency + bandwidth line fitted
over all sizes misses single sizes by 40-50% rms on a 2-core VM, so these calls are priced at the job's own
figure at their size (interpolated between the sizes it timed, log-log), and the calibration's latency factor
(``predict_comm_cost``), measured on the data-parallel calls of smoke's runs, is not put on them.

Why (``benchmarks/RESULTS.md``, 2026-11-28): on the 2-core VM parity's AutoTP step at tp 2 (19 blocking all-reduces,
most of 64 KiB) paid 0.8-1.4 ms a call in all (its forward and backward phases less the probe's). The fitted line
gave 0.7 ms; the factor, fitted on smoke's calls (FSDP2's paid about 2.5 ms each), took it to about 2.3 ms, and
AutoTP came out 33-44% slow. The job's long loops time that call at 1.2-1.7 ms. This pricing still leaves the
tensor-parallel runs predicted fast (AutoTP +5% to +86%, FSDP2+TP -6% to +41% per repeat): what else their real
steps pay is not found yet.

Pure Python, no torch.
"""

from __future__ import annotations

import bisect
import math
import statistics
from typing import Any, Callable

from shardscope.analysis.predict.comm_fit import bus_factor

Table = dict[str, dict[str, list[list[float]]]]  # type -> group size (str, JSON) -> [[bytes, seconds]] by bytes


def table(rows: list[tuple[str, float, float, int]]) -> Table:
    """The job's calls ``(type, bytes, seconds, group)`` as the median seconds per type, group and size."""
    cells: dict[tuple[str, int, float], list[float]] = {}
    for kind, nbytes, seconds, group in rows:
        cells.setdefault((kind, int(group), float(nbytes)), []).append(float(seconds))
    out: Table = {}
    for (kind, group, nbytes), times in sorted(cells.items()):
        out.setdefault(kind, {}).setdefault(str(group), []).append([nbytes, statistics.median(times)])
    return out


def seconds(tab: Table, kind: str, nbytes: float, n: int, busbw_Bps: float | None = None) -> float | None:
    """One call of ``kind`` moving ``nbytes`` over ``n`` ranks, from the job's figures at that group size:
    log-log between the two sizes around it; below the smallest size, the smallest's time (latency-bound);
    above the largest, the largest's time plus the extra bytes at ``busbw_Bps`` (or in proportion without it).
    None when the job timed no ``kind`` over ``n`` ranks; 0 for one rank."""
    if n <= 1:
        return 0.0
    points = tab.get(kind, {}).get(str(n))
    if not points:
        return None
    sizes = [p[0] for p in points]
    if nbytes <= sizes[0]:
        return points[0][1]
    if nbytes >= sizes[-1]:
        last_b, last_s = points[-1]
        if busbw_Bps:
            return last_s + (nbytes - last_b) * bus_factor(kind, n) / busbw_Bps
        return last_s * nbytes / last_b
    (b0, s0), (b1, s1) = points[bisect.bisect_left(sizes, nbytes) - 1:][:2]  # every figure > 0: the job drops the rest
    return math.exp(math.log(s0) + math.log(nbytes / b0) / math.log(b1 / b0) * math.log(s1 / s0))


CommTime = Callable[[str, float, int], float]


def comm_fn(tab: Table, fallback: CommTime, fits: dict[str, Any]) -> CommTime:
    """A ``CommTime`` for blocking calls: the job's figure at the call's size, else ``fallback`` (the fit)."""
    def priced(kind: str, nbytes: float, n: int) -> float:
        """One blocking call's seconds (the job's in-step figure, else the fit's)."""
        fit = fits.get(kind)
        got = seconds(tab, kind, nbytes, n, getattr(fit, "busbw_Bps", None))
        return fallback(kind, nbytes, n) if got is None else got
    return priced


NOTE = ("tensor-parallel and gradient-norm all-reduces (blocking, right after compute: the collective job's own "
        "pattern) priced at the job's in-step time at their size, without the latency factor (predict/in_step.py)")
