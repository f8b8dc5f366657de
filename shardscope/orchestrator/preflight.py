"""Before launching: does the output directory have room for what the comparison will write?"""

from __future__ import annotations

from shardscope.core import outspace
from shardscope.config import Comparison, resolved_world_size
from shardscope.profiling.memory_model import param_count
from shardscope.core.rundir import RunDir


def claim_out_dir(out_dir: str, node_rank: int = 0, run_names: list[str] | tuple[str, ...] = ()) -> str:
    """Make ``out_dir`` this comparison's alone; "" when claimed, else one line why not (nothing written).

    Node 0 refuses a directory that already holds a comparison (a new one would reuse its weights and mix
    its files) or that holds anything else (a user's files); every node then takes its exclusive lock, so
    two commands started together into one directory cannot both run (other nodes of a comparison on a
    shared filesystem lock their own node's lock file beside node 0's, and what they write before node 0
    looks, under ``run_names`` among others, is not a user's)."""
    out = RunDir(out_dir)
    if node_rank == 0:
        if out.holds_comparison():
            return (f"{out_dir}: already holds a comparison; choose a new directory (or open it with "
                    "`shardscope open`)")
        foreign = out.foreign_entries(run_names)
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            return f"{out_dir}: not empty and not a shardscope run directory (holds {shown}); choose an empty or new directory"
    try:
        held = out.lock(node_rank)
    except OSError as err:
        return f"{out_dir}: cannot be locked for this comparison: {err.strerror or err}"
    if held:
        return held
    if node_rank == 0 and out.holds_comparison():  # another command finished writing one before we locked
        return f"{out_dir}: already holds a comparison; choose a new directory"
    return ""


def check_space(comparison: Comparison, out_dir: str) -> str | None:
    """One line when ``out_dir`` cannot hold what ``comparison`` will write (``outspace.estimate``), else None."""
    try:
        weights = 4 * param_count(comparison.model)  # init.safetensors holds fp32 weights
    except (KeyError, ValueError):
        weights = 0
    sizes = [resolved_world_size(comparison, run) for run in comparison.runs]
    return outspace.shortfall(out_dir, outspace.estimate(comparison, sizes, weights))
