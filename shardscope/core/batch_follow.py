"""The global batch follows the world size when the user changes only the world size.

A preset sets ``global_batch`` for its ``world_size``: each data-parallel rank trains on
``global_batch / (dp x grad_accum)`` sequences per micro-batch. When the user changes the world
size alone (``--set world_size=N``, ``estimate --world-size N``, ``slurm --nodes/--gpus-per-node``),
the global batch is scaled by the same factor, so every run that follows the comparison's world
size keeps the micro-batch per rank the preset set (``dp`` scales with the world size at a fixed
tensor-parallel degree). A ``global_batch`` the user sets explicitly is kept and validated as is.

Runs that fix their own ``world_size`` in the preset keep their dp, so their micro-batch grows with
the shared global batch (the batch is shared so that every run sees the same tokens); the note says so.
Pure Python, no torch.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, Iterable

# Comparison's defaults (config.Comparison uses these), for presets that leave these keys out.
DEFAULT_WORLD_SIZE = 2
DEFAULT_GLOBAL_BATCH = 8


def follow_world_size(preset: dict[str, Any], raw: dict[str, Any], override_keys: Iterable[list[str]]) -> list[str]:
    """Scale ``raw["global_batch"]`` when the overrides changed ``world_size`` but not ``global_batch``.

    ``preset`` is the top-level table as the preset set it (after its cpu_overrides, before the
    user's overrides); ``raw`` is the same table after the overrides and is changed in place;
    ``override_keys`` are the dotted key parts of every override. Returns one line describing the
    change for the user, or [] when nothing changed (the world size was not changed alone, or
    the scaled batch would not be a whole number; validation then explains what is allowed).
    """
    keys = {tuple(k) for k in override_keys}
    if ("world_size",) not in keys or ("global_batch",) in keys:
        return []
    old_ws, new_ws = preset.get("world_size", DEFAULT_WORLD_SIZE), raw.get("world_size")
    old_gb = preset.get("global_batch", DEFAULT_GLOBAL_BATCH)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (old_ws, new_ws, old_gb)):
        return []  # validation reports the bad value
    scaled = Fraction(old_gb * new_ws, old_ws)
    if new_ws == old_ws or scaled.denominator != 1:
        return []
    raw["global_batch"] = int(scaled)
    note = (f"global_batch {old_gb} -> {int(scaled)}: follows world_size {old_ws} -> {new_ws} so each rank's "
            f"micro-batch stays what the preset set (set global_batch to choose it yourself)")
    fixed = [str(r.get("name")) for r in raw.get("runs", []) if isinstance(r, dict) and r.get("world_size")]
    if fixed:
        note += f"; runs with their own world_size ({', '.join(fixed)}) keep their dp, so their micro-batch changes"
    return [note]
