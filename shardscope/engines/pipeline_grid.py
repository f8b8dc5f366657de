"""A multi-stage pipeline schedule's action grid, read from torch's own schedule object, for ``predict``:
``python -m shardscope.engines.pipeline_grid SCHEDULE PP MICROBATCHES STAGES_PER_RANK`` prints
``{rank: [[kind, stage, microbatch], ...]}`` as one JSON line (several quadruples: a line each, in turn).

The schedules that hold several stages per rank (interleaved 1F1B, interleaved zero bubble) compute every rank's
order when they are built; building one needs only its stages' shapes and a process group, so the stages here are
one-feature linears on rank 0 of a fake process group of PP ranks (nothing runs, nothing is sent). The
one-stage-per-rank schedules' orders are written out in ``core/pipeline_layout.single_stage_order`` instead (torch
2.13's 1F1B grid mislabels its last rank's micro-batches). ``predict`` (torch-free) runs this as a subprocess.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from shardscope.core import pipeline_layout


def grid(schedule: str, pp: int, m: int, v: int) -> dict[int, list[tuple[str, int, int]]]:
    """The action grid of the registry's ``schedule`` (its torch class, ``engines.pipeline.SCHEDULES``) at ``pp``
    ranks, ``m`` micro-batches and ``v`` stages per rank."""
    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardscope.engines.pipeline import SCHEDULES, grid_of

    cls_name, looped = SCHEDULES[schedule]
    if not looped:
        return pipeline_layout.single_stage_order(schedule, pp, m)
    dist.init_process_group("fake", rank=0, world_size=pp, store=FakeStore())
    try:
        n = pp * v
        one = torch.zeros(1, 1)
        stages = [PipelineStage(nn.Linear(1, 1), s, n, torch.device("cpu"), input_args=(one,), output_args=(one,))
                  for s in pipeline_layout.stages_of(0, pp, v)]
        built = getattr(schedules, cls_name)(stages, n_microbatches=m, loss_fn=lambda out, target: out.sum())
        return grid_of(built)
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    """Print the grid of each ``schedule pp m v`` in ``argv`` (one or more, in turn) as one JSON line; exit 2 on
    arguments it cannot read. Several in one process import torch once (3-4 s a start on a 2-core VM)."""
    try:
        if not argv or len(argv) % 4:
            raise ValueError(argv)
        specs = [(argv[i], int(argv[i + 1]), int(argv[i + 2]), int(argv[i + 3])) for i in range(0, len(argv), 4)]
    except ValueError:
        print("usage: python -m shardscope.engines.pipeline_grid SCHEDULE PP MICROBATCHES STAGES_PER_RANK [...]",
              file=sys.stderr)
        return 2
    for schedule, pp, m, v in specs:
        print(json.dumps({str(r): [list(a) for a in acts] for r, acts in grid(schedule, pp, m, v).items()}), flush=True)
    return 0


if __name__ == "__main__":
    from shardscope.core.bounded import hold_lifeline

    hold_lifeline()  # ends with the command that started it (core/bounded.run_bounded)
    sys.exit(main(sys.argv[1:]))
