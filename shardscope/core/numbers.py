"""The numbers every layer shares, computed and written one way.

How shardscope writes numbers that are not ordinary (non-finite values, tiny differences, figures
never measured, byte sizes), and the few sums that the rank side and the analysis both make: the
median throughput (the loop's end record, summary.json, the app's live table, ``diff``) and the loss
difference at common steps (summary, divergence, ``diff``, the app's difference chart). One place,
so summary.json, report.md, the headless tables, the plots and the app say the same thing. Pure
Python (no torch, no textual): the schema layer, importable from the ranks and the views alike.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterable
from typing import Any

NOT_MEASURED = "not measured"

# Non-finite floats in summary.json: quoted, so the file stays strict JSON (bare NaN is not JSON)
# while a measured NaN never turns into null, which means "not measured".
_JSON_NONFINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def is_finite(x: Any) -> bool:
    """Return True for an int or a finite float (False for None, nan, +-inf and non-numbers)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def json_ready(value: Any) -> Any:
    """Return ``value`` with every non-finite float replaced by "NaN", "Infinity" or "-Infinity"
    (recursively through dicts, lists and tuples), so that ``json.dump`` writes strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return _JSON_NONFINITE[str(value)]
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def not_measured(reason: str) -> str:
    """Return the text shown where a figure was not measured: ``not measured (reason)``."""
    return f"{NOT_MEASURED} ({reason})" if reason else NOT_MEASURED


def fmt_sig(x: float | None, digits: int = 3, missing: str = "-") -> str:
    """Return ``x`` with ``digits`` significant digits: scientific notation below 1e-3 and from 1e6
    in magnitude (``1.19e-07``, not ``0.000000119``), plain otherwise; ``nan``/``inf`` as such;
    ``missing`` for None."""
    if x is None:
        return missing
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    if abs(x) < 1e-3 or abs(x) >= 1e6:
        return f"{x:.{max(digits - 1, 0)}e}"
    return f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:,.0f}"


_FROM_JSON = {text: float(key) for key, text in _JSON_NONFINITE.items()}


def from_json(value: Any) -> Any:
    """Reverse ``json_ready``: return ``value`` with "NaN", "Infinity" and "-Infinity" strings turned
    back into floats (recursively through dicts and lists)."""
    if isinstance(value, str):
        return _FROM_JSON.get(value, value)
    if isinstance(value, dict):
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


MAX_JSON_BYTES = 256 << 20  # a run directory's JSON files (summary.json of many runs is a few MiB)


def _bounded_int(text: str) -> int:
    if len(text) > 40:  # no figure shardscope writes; float() of 500 digits overflows where it is read
        raise ValueError("an integer of more than 40 digits")
    return int(text)


def read_json(path: str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Return the JSON document at ``path`` (written by ``config.dump_json``) with its non-finite
    floats restored; raises OSError or ValueError, also for a file over ``max_bytes`` (not read), nesting
    deeper than the decoder takes or an integer of more than 40 digits (a damaged or crafted file)."""
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size > max_bytes:
            raise ValueError(f"{path}: over {max_bytes >> 20} MiB")
        try:
            return from_json(json.loads(fh.read(max_bytes + 1), parse_int=_bounded_int))
        except RecursionError:
            raise ValueError(f"{path}: nested too deeply") from None


def fmt_bytes(n: float | None, sig: int | None = None, missing: str = "-") -> str:
    """Return ``n`` bytes in binary units: ``"512 B"``, ``"1.5 GiB"`` (one decimal), or with ``sig``
    significant digits (``"1.502 MiB"``, where predicted and measured sizes must be told apart);
    ``missing`` for None."""
    if n is None:
        return missing
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{value:.0f} B"
    return f"{value:.{sig}g} {unit}" if sig else f"{value:.1f} {unit}"


def timed_rates(points: Iterable[tuple[int, float]]) -> list[float]:
    """Return the rates of (step, rate) points that count towards the median throughput: every step
    but step 0 (warm-up: one-off set-up costs), or step 0 alone when no later step was timed."""
    pts = list(points)
    return [rate for step, rate in pts if step > 0] or [rate for _, rate in pts]


def relative_spread(rates: list[float]) -> float | None:
    """Half the interquartile range of a run's per-step rates over their median (None below 4 steps)."""
    if len(rates) < 4:
        return None
    q1, _, q3 = statistics.quantiles(rates, n=4)
    med = statistics.median(rates)
    return (q3 - q1) / 2 / med if med > 0 else None


def noise_factor(spread: float | None, other_spread: float | None) -> float | None:
    """The factor two median rates may differ by and still be noise: each run's relative step-to-step
    spread is a multiplicative wobble (1 + spread), and two wobbles compose by multiplying. For small
    spreads this is ~1 + the spreads added; unlike the sum it never admits a ratio of 0 (a band of
    100% or more would call any slowdown noise). None when either spread is not measured."""
    if spread is None or other_spread is None:
        return None
    return (1 + spread) * (1 + other_spread)


def within_noise(rate: float, other: float, spread: float | None, other_spread: float | None) -> bool | None:
    """The one noise rule every throughput comparison uses (recommendation, diff): two median rates
    are indistinguishable when the larger is at most ``noise_factor`` times the smaller (symmetric;
    for a slowdown this is ``new/old >= 1 / factor``). None when either spread is not measured
    (fewer than 4 timed steps)."""
    factor = noise_factor(spread, other_spread)
    if factor is None:
        return None
    lo, hi = sorted((rate, other))
    return hi <= lo * factor


def move_of(rate: float, other: float) -> float:
    """How far apart two positive rates are, symmetric: the larger over the smaller, minus 1 (0.1 = 10% apart)."""
    lo, hi = sorted((rate, other))
    return hi / lo - 1 if lo > 0 else math.inf


def speed_verdict(rate: float, reference: float, spread: float | None, reference_spread: float | None,
                  between: float | None) -> dict[str, Any]:
    """The one rule every throughput verdict uses (the answer, the recommendation, ``diff``, ``--against``, the app).

    The band two rates may differ by and still be the same is the larger of the runs' own step-to-step wobble
    (``noise_factor``) and ``1 + between``, how far a run moved when nothing about it changed (the A/A control, on
    this machine, now). Returns ``verdict``: "faster" or "slower" (``rate`` against ``reference``) outside the band,
    "tie" inside it, "untested" when neither noise was measured; ``ratio`` (rate / reference), ``band`` (the factor)
    and ``interval`` (the ratio divided and multiplied by the band: where the true ratio may lie)."""
    ratio = rate / reference if reference else math.inf
    factors = [f for f in (noise_factor(spread, reference_spread), None if between is None else 1 + between) if f]
    if not factors:
        return {"verdict": "untested", "ratio": ratio, "band": None, "interval": None, "between": between}
    band = max(factors)
    verdict = "tie" if 1 / band <= ratio <= band else ("faster" if ratio > 1 else "slower")
    return {"verdict": verdict, "ratio": ratio, "band": band, "interval": [ratio / band, ratio * band],
            "between": between}


def median_rate(points: Iterable[tuple[int, float]]) -> float | None:
    """Return the median throughput of (step, tokens/s or samples/s) points over ``timed_rates``
    (the lower and upper middle averaged for an even count); None without points. Callers pass the
    steps outside the profiler window only (profiled steps run slower)."""
    rates = timed_rates(points)
    return statistics.median(rates) if rates else None


def common_steps(run: Iterable[tuple[int, float]],
                 base: Iterable[tuple[int, float]]) -> list[tuple[int, float, float]]:
    """Return (step, run value, base value) for every step of ``run`` that ``base`` also has, in
    ``run``'s order (a step ``base`` repeats takes its last value)."""
    base_at = dict(base)
    return [(step, value, base_at[step]) for step, value in run if step in base_at]


def loss_difference(a: float, b: float) -> float:
    """Return |a - b|, or inf when either side is non-finite: a NaN or an inf is never "equal"."""
    return abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf


def loss_differences(run: Iterable[tuple[int, float]], base: Iterable[tuple[int, float]]) -> list[tuple[int, float]]:
    """Return (step, ``loss_difference``) at the common steps of two (step, loss) series, in ``run``'s order."""
    return [(step, loss_difference(a, b)) for step, a, b in common_steps(run, base)]


def dotted_get(record: dict[str, Any], dotted: str) -> Any:
    """The value at ``a.b.c`` in nested dicts (a start record's ``spec.options.stage``), or None where a part is
    missing or not a dict."""
    value: Any = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value
