"""An sbatch script that runs a comparison across SLURM nodes, on any SLURM cluster.

One task per node runs ``shardscope run --headless --slurm-task``: one orchestrator per node, whose node
rank is ``SLURM_NODEID``. Every run is a torchrun job on each node joining one rendezvous hosted by node 0
(``launcher.torchrun_argv``). What the script makes sure of, and why:

- **CPU or GPU nodes.** The GPU variant asks ``--gpus-per-node``; the CPU variant asks none (sbatch rejects
  a GPU request on a cluster without GPUs) and forces ``launch.device = "cpu"``. Both ask CPUs per task,
  because a task-affinity plugin otherwise pins every rank of a node to one CPU.
- **Quoting.** The command is a bash array written element by element with ``shlex.quote``; only
  ``$OUT`` and the head address are expanded, inside double quotes. No nested ``bash -c`` string, so any
  ``--set`` value and any working directory survive.
- **An address, not a name.** The rendezvous host is node 0's ``NodeAddr`` from ``scontrol show node``
  (the address slurmctld itself reaches the node at), falling back to its name.
- **One rendezvous per job.** The ports and the rendezvous id derive from ``SLURM_JOB_ID``, so two jobs
  sharing a node never join each other's rendezvous; each run gets its own port (``endpoint_for_run``).
- **An exit contract srun can act on.** A task exits 0 once its orchestrator finished, whatever the runs'
  verdicts (those are in node 0's summary); only an orchestrator that crashed exits non-zero, and then
  ``--kill-on-bad-exit`` stops the other nodes instead of leaving them waiting at a rendezvous.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Any
from dataclasses import dataclass

from shardscope.core.rundir import SUMMARY

# Ports of a job: 21000 + 32 * (job id mod 300), below Linux's ephemeral range (32768+). The first is kept
# for node 0's record server (records over TCP, not built yet); run i's rendezvous uses the next plus i.
PORT_BASE, PORT_SLOTS, PORTS_PER_JOB = 21000, 300, 32


@dataclass(frozen=True)
class NodeShape:
    """What the job asks of each node: ranks per node, GPUs or CPUs, CPUs per rank."""

    ranks_per_node: int
    gpus: bool
    cpus_per_rank: int

    @property
    def cpus_per_task(self) -> int:
        """CPUs for the one task (orchestrator + torchrun + ranks) on each node."""
        return self.ranks_per_node * self.cpus_per_rank


def node_shape(device: str, world_size: int, nodes: int, *, gpus_per_node: int | None,
               cpus_per_node: int | None, cpus_per_rank: int | None) -> NodeShape:
    """Return the node shape from explicit options, else from the preset's device and world size.

    ``--gpus-per-node G`` gives G GPU ranks per node; ``--cpus-per-node C`` gives C CPU ranks per node.
    Without either, the preset's world size is split over the nodes, on GPUs unless its
    ``launch.device`` is "cpu". Raises ValueError naming the option at fault.
    """
    if nodes < 1:
        raise ValueError(f"--nodes {nodes}: must be >= 1")
    if gpus_per_node is not None and cpus_per_node is not None:
        raise ValueError("--gpus-per-node and --cpus-per-node: give one (GPU nodes or CPU nodes), not both")
    for option, value in (("--gpus-per-node", gpus_per_node), ("--cpus-per-node", cpus_per_node),
                          ("--cpus-per-rank", cpus_per_rank)):
        if value is not None and value < 1:
            raise ValueError(f"{option} {value}: must be >= 1")
    if gpus_per_node is not None:
        per_node, gpus = gpus_per_node, True
    elif cpus_per_node is not None:
        per_node, gpus = cpus_per_node, False
    else:
        if world_size % nodes:
            raise ValueError(f"--nodes {nodes}: the preset's world size {world_size} is not a multiple; "
                             "give --gpus-per-node or --cpus-per-node")
        per_node, gpus = world_size // nodes, device != "cpu"
    return NodeShape(per_node, gpus, cpus_per_rank or (4 if gpus else 1))


def refuse_control(preset: str, overrides: list[str] | tuple[str, ...]) -> None:
    """Raise ValueError (one line) for a preset path or ``--set`` value holding a control character: a newline would
    end the job script's comment line, and the next line would run when the job runs."""
    for what, value in (("--preset", preset), *(("--set", item) for item in overrides)):
        bad = next((ch for ch in value if ord(ch) < 32 or ord(ch) == 127), None)
        if bad is not None:
            raise ValueError(f"{what} {value!r}: holds the control character {bad!r}; a path or value in a job "
                             "script must have none")


def sbatch_script(preset: str, *, nodes: int, shape: NodeShape, time_limit: str, overrides: list[str],
                  python: str = sys.executable) -> str:
    """Return the text of an sbatch script that runs ``preset`` on ``nodes`` nodes of ``shape``.

    The run directory must be on a filesystem every node sees (ranks of every node append their record
    files there, and other nodes wait there for node 0's initial weights).
    """
    refuse_control(preset, overrides)
    world = nodes * shape.ranks_per_node
    kind = f"{shape.ranks_per_node} GPU{'s' if shape.ranks_per_node > 1 else ''}" if shape.gpus else \
        f"{shape.ranks_per_node} CPU rank{'s' if shape.ranks_per_node > 1 else ''}"
    static = [[python, "-m", "shardscope.cli", "run", "--headless", "--slurm-task"], ["--preset", preset],
              ["--nnodes", str(nodes)], ["--set", f"world_size={world}"]]
    if not shape.gpus:
        static.append(["--device", "cpu"])
    static += [["--set", item] for item in overrides]
    lines = [" ".join(shlex.quote(a) for a in words) for words in static]
    dynamic = ['--rdzv-endpoint "$HEAD_ADDR:$((PORT + 1))"', '--rdzv-id "shardscope-$SLURM_JOB_ID"', '--out "$OUT"']
    command = "\n  ".join(lines + dynamic)
    gres = f"#SBATCH --gpus-per-node={shape.ranks_per_node}\n" if shape.gpus else ""
    out_comment = "# The run directory: on a filesystem every node sees."
    return f"""#!/bin/bash
# shardscope: preset {shlex.quote(preset)} on {nodes} node(s) x {kind} (world size {world}).
#SBATCH --job-name={shlex.quote(f"shardscope-{_safe(preset)}")}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task={shape.cpus_per_task}
{gres}#SBATCH --time={time_limit}
#SBATCH --output=shardscope-%j.log
set -euo pipefail
{out_comment}
OUT="${{OUT:-$PWD/shardscope-runs/slurm-$SLURM_JOB_ID-{_safe(preset)}}}"
# Node 0 hosts the rendezvous: its address as slurmctld knows it (NodeAddr), else its name.
# (sed -n 1p reads all its input: `head` would leave the writer a SIGPIPE, fatal under pipefail)
HEAD_NAME=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
HEAD_ADDR=$(scontrol show node "$HEAD_NAME" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p' | sed -n 1p)
HEAD_ADDR=${{HEAD_ADDR:-$HEAD_NAME}}
# A rendezvous port and id of this job alone, so jobs sharing a node never join each other's rendezvous.
PORT=$(( {PORT_BASE} + {PORTS_PER_JOB} * (SLURM_JOB_ID % {PORT_SLOTS}) ))
CMD=(
  {command}
)
echo "shardscope: $SLURM_JOB_NUM_NODES nodes, rendezvous at $HEAD_ADDR from port $((PORT + 1)), run directory $OUT"
# Each orchestrator exits 0 when it finished (the runs' verdicts are in $OUT/{SUMMARY}); only one that
# crashed exits non-zero, and then srun stops the other nodes rather than leave them at a rendezvous.
srun --kill-on-bad-exit=1 --label --cpus-per-task={shape.cpus_per_task} "${{CMD[@]}}"
# Every node has finished: the job's own state follows the comparison (FAILED when a run did not end ok).
{shlex.quote(python)} -c {shlex.quote(_JOB_VERDICT)} "$OUT/{SUMMARY}"
"""


# The job's exit status from summary.json: 0 when every run ended ok, else 1 with the runs named on stderr.
_JOB_VERDICT = ('import json, sys; s = json.load(open(sys.argv[1])); '
                'bad = [r["name"] + " " + r["status"] for r in s["runs"] if r["status"] != "ok"]; '
                'bad and print("shardscope: runs not ok: " + ", ".join(bad), file=sys.stderr); '
                'sys.exit(1 if bad else 0)')


NODE_LOCAL = ("/tmp", "/var/tmp", "/dev/shm", "/run")  # a folder the nodes of a cluster rarely share


def node_local_paths(comparison: Any) -> list[str]:
    """``key = path`` of each file the preset names (model.path, model.entry's file, data.path, data.tokenizer) that
    lies where other nodes may not see it: under /tmp-like folders or a home directory (shared on some clusters,
    not on others)."""
    found = []
    m, d = comparison.model, comparison.data
    entry = m.entry.rpartition(":")[0] if m.kind == "module" and m.entry else ""
    for key, path in (("model.path", m.path if m.kind == "hf" else ""), ("model.entry", entry),
                      ("data.path", d.path if d.kind in ("text", "tokens") else ""), ("data.tokenizer", d.tokenizer)):
        if not path or not os.path.isabs(path):
            continue
        home = os.path.expanduser("~")
        if any(path == p or path.startswith(p + "/") for p in NODE_LOCAL) or path.startswith(home + "/"):
            found.append(f"{key} = {path}")
    return found


def _safe(name: str) -> str:
    """The preset name as a path component that needs no quoting (a path's stem, odd characters replaced)."""
    stem = name.rsplit("/", 1)[-1].removesuffix(".toml")
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in stem) or "preset"
