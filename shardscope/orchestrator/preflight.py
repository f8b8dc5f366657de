"""Before launching: does the output directory have room for what the comparison will write?"""

from __future__ import annotations

from shardscope import outspace
from shardscope.config import Comparison, resolved_world_size
from shardscope.profiling.memory_model import param_count


def check_space(comparison: Comparison, out_dir: str) -> str | None:
    """One line when ``out_dir`` cannot hold what ``comparison`` will write (``outspace.estimate``), else None."""
    try:
        weights = 4 * param_count(comparison.model)  # init.safetensors holds fp32 weights
    except (KeyError, ValueError):
        weights = 0
    sizes = [resolved_world_size(comparison, run) for run in comparison.runs]
    return outspace.shortfall(out_dir, outspace.estimate(comparison, sizes, weights))
