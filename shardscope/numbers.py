"""How shardscope writes numbers that are not ordinary: non-finite values, tiny differences and
figures that were never measured. One place, so summary.json, report.md, the headless tables, the
plots and the app say the same thing. Pure Python (no torch, no textual).
"""

from __future__ import annotations

import json
import math
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


def read_json(path: str) -> Any:
    """Return the JSON document at ``path`` (written by ``config.dump_json``) with its non-finite
    floats restored; raises OSError or ValueError."""
    with open(path, encoding="utf-8") as fh:
        return from_json(json.load(fh))
