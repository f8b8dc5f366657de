"""Sizes typed by users (``--device-memory 80GiB``)."""

from __future__ import annotations


def parse_size(text: str) -> int:
    """Parse ``80GiB``, ``80GB``, ``512MiB`` or a byte count; raises ValueError."""
    import re

    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError("expected a size like 80GiB, 40GB or 512MiB")
    value, unit = float(match.group(1)), match.group(2).upper().rstrip("B")
    powers = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "KI": 1, "MI": 2, "GI": 3, "TI": 4}
    if unit not in powers:
        raise ValueError("unknown unit; use KiB, MiB, GiB, TiB (or KB, MB, GB, TB)")
    base = 1024 if unit.endswith("I") or unit == "" else 1000
    return int(value * base ** powers[unit])
