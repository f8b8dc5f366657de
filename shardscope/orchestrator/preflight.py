"""Before launching: does the output directory have room for what the comparison will write, and this host's
memory for what its ranks will hold?"""

from __future__ import annotations

from shardscope.core import outspace
from shardscope.config import Comparison, resolved_world_size
from shardscope.core.numbers import fmt_bytes
from shardscope.profiling import memory_model
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


# What a CPU rank holds besides the model: the interpreter, torch and its libraries, the loop. The peak RSS of a rank
# of a 140k-parameter model was 324-352 MiB in every run of tests/test_architectures.py (2026-12-02, torch 2.13.0):
# the floor below which no rank runs, so it is counted, not guessed at.
RANK_RUNTIME_BYTES = 300 * 2**20


def check_memory(comparison: Comparison, device: str, available: int | None = None) -> str | None:
    """One line when the ranks this host runs at once need more memory than it has ``available`` (psutil's, by
    default), else None. Each rank: the memory model's model states, activations at its micro-batch and the unit it
    gathers, or the whole model in fp32 while it is built before sharding, whichever is more, plus the runtime
    (``RANK_RUNTIME_BYTES``). Only where ranks hold their states in host memory (``device`` "cpu"); off with
    ``launch.check_memory = false``."""
    if device != "cpu" or not comparison.launch.check_memory:
        return None
    if available is None:
        import psutil

        available = int(psutil.virtual_memory().available)
    try:
        predicted = {p["run"]: p for p in memory_model.predict_comparison(comparison)}
        built = 4 * param_count(comparison.model)
    except (KeyError, ValueError):
        return None  # a model the memory model cannot size: the runs will say
    needs = []
    for run in comparison.runs:
        p = predicted.get(run.name)
        if p is None:
            continue
        ranks = max(1, resolved_world_size(comparison, run) // max(1, comparison.launch.nnodes))
        per_rank = max(int(p["total_bytes"]), built) + RANK_RUNTIME_BYTES
        needs.append((ranks * per_rank, run.name, ranks, per_rank))
    if not needs:
        return None
    need, name, ranks, per_rank = (sum(n[0] for n in needs), "together", 0, 0) if comparison.launch.concurrent \
        else max(needs, key=lambda n: n[0])  # the first run of the largest need
    if need <= available:
        return None
    how = (f"run {name}: {ranks} ranks x {fmt_bytes(per_rank)}" if ranks else "the runs at once (launch.concurrent)")
    return (f"{how} need about {fmt_bytes(need)} of this host's memory (model states, activations at the run's "
            f"micro-batch, the model built whole in fp32, {fmt_bytes(RANK_RUNTIME_BYTES)} of runtime per rank); "
            f"{fmt_bytes(available)} is available: lower global_batch, seq_len or the model's size, use fewer ranks, "
            "or --set launch.check_memory=false")
