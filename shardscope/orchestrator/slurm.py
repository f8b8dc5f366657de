"""An sbatch script that runs a comparison across SLURM nodes.

Each node runs one ``shardscope run --headless`` with ``--nnodes``/``--node-rank`` and a shared
c10d rendezvous endpoint on the first node; torchrun on every node joins the same rendezvous
for each run in turn. Node 0 writes the shared initial weights and the reports; other nodes wait
for the weights and write only their ranks' records into the shared run directory.
"""

from __future__ import annotations

import shlex


def sbatch_script(preset: str, *, nodes: int, gpus_per_node: int, time_limit: str, overrides: list[str],
                  port: int = 29500) -> str:
    """Return the text of an sbatch script for ``preset`` on ``nodes`` x ``gpus_per_node`` GPUs."""
    sets = " ".join(f"--set {shlex.quote(o)}" for o in overrides)
    world = nodes * gpus_per_node
    return f"""#!/bin/bash
#SBATCH --job-name=shardscope-{preset}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus_per_node}
#SBATCH --time={time_limit}
#SBATCH --output=shardscope-%j.log
set -euo pipefail
# The run directory must be on a filesystem every node sees.
OUT=${{OUT:-$PWD/shardscope-runs/slurm-$SLURM_JOB_ID-{preset}}}
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun --kill-on-bad-exit=1 bash -c 'shardscope run --preset {shlex.quote(preset)} --headless \\
  --set world_size={world} --nnodes {nodes} --node-rank $SLURM_NODEID \\
  --rdzv-endpoint '"$HEAD"':{port} --out '"$OUT"' {sets}'
"""
