"""A short calibration of collectives: all-reduce, all-gather, reduce-scatter and broadcast at a few sizes,
timed on this machine in one small torchrun job (``shardscope predict --collectives``).

Used when the calibration comparison lacks a collective type (a DDP-only comparison does all-reduces only)
or measured it at one size only (its latency not separable from its bandwidth), or to measure at the world
size being predicted. The parent side (``measure``) is torch-free: it starts torchrun in a process group of
its own, kills the group if it outlives ``timeout_s``, and reads the one JSON file rank 0 writes. The rank
side (``python -m shardscope.analysis.predict.collectives OUT``) imports torch inside ``main``.

On a GPU each call is timed on every rank after a barrier; the call's cost is its fastest rank's time (a
rank that arrives late makes the others wait inside the collective), as the traces are read in
``predict_fit``. On CPU (gloo) that figure is too low for a training step: there a rank reaches each
collective after compute, wakes its peers through the kernel and shares its cores with their compute and
gloo's threads, so a call costs a step more than a back-to-back call after a barrier (``benchmarks/RESULTS.md``,
2026-11-26: 9 all-gathers of 256 KiB between matmuls added 10-16 ms a step at 2 ranks, barrier-timed 0.4 ms each).
So on CPU a call's cost is what it adds to a loop of compute: rounds of [a fixed burst of matmuls; the
call] against rounds of the burst alone, alternated, the median of the differences per call (at least
the barrier-timed fastest rank's time).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

from shardscope.core.bounded import run_bounded

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
SIZES = (4 << 10, 64 << 10, 1 << 20, 8 << 20)  # bytes, nccl-tests' sizes: a collective's whole buffer
# 15 timed calls per type and size, not 5 (2026-11-27): on the 2-core VM five jobs in a row gave fits whose time at 16 KiB
# moved 1.9-3.3x between jobs with 5, 1.3-1.9x with 15 (RESULTS.md); the job takes ~12 s instead of ~7 s.
REPEATS, WARMUP = 15, 2
ROUNDS, BURST_MATMULS, BURST_DIM = 4, 4, 256  # CPU: rounds per timed loop; the compute burst before each call
# Small all-reduces: 32 rounds a loop (2026-11-28). With 4, five jobs within 30 minutes timed a 64 KiB all-reduce at
# 0.80-3.36 ms, while a steady loop of 32 rounds moved 1.19-1.66 ms over 3 minutes (RESULTS.md); ~8 s more a job.
SMALL_ROUNDS, SMALL_BYTES = 32, 64 << 10


def measure(world_size: int, backend: str = "gloo", timeout_s: float = 300.0) -> list[tuple[str, float, float, int]]:
    """Run the job over ``world_size`` local ranks; return (type, bytes, seconds, group) per timed call.

    Raises RuntimeError naming the cause when the job fails or runs past ``timeout_s`` (nothing is left running).
    """
    if world_size < 2:
        raise RuntimeError("--collectives needs a world size of 2 or more: one rank does no collective")
    with tempfile.TemporaryDirectory(prefix="shardscope-collectives-") as tmp:
        out = os.path.join(tmp, "collectives.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
               "-m", "shardscope.analysis.predict.collectives", out, backend]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = run_bounded(cmd, timeout_s, env, merge_stderr=True)
        if proc is None:
            raise RuntimeError(f"the collective calibration ran past {timeout_s:.0f} s and was stopped")
        console = proc.stdout
        if proc.returncode != 0 or not os.path.exists(out):
            tail = " / ".join(console.strip().splitlines()[-3:])
            raise RuntimeError(f"the collective calibration failed (exit {proc.returncode}): {tail}")
        with open(out, encoding="utf-8") as fh:
            return [(k, float(b), float(s), int(n)) for k, b, s, n in json.load(fh)]


def _one(dist: Any, torch: Any, kind: str, nbytes: int, world: int, device: Any, group: Any = None) -> Any:
    """The tensors of one collective of ``nbytes`` (nccl-tests' size) over ``world`` ranks (``group``, default
    all of them) and the call that runs it."""
    n = max(world, nbytes // 4 // world * world)
    if kind == "all_reduce":
        t = torch.ones(n, device=device)
        return lambda: dist.all_reduce(t, group=group)
    if kind == "broadcast":
        t = torch.ones(n, device=device)
        return lambda: dist.broadcast(t, group_src=0, group=group)
    full, part = torch.ones(n, device=device), torch.ones(n // world, device=device)
    if kind == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, part, group=group)
    return lambda: dist.reduce_scatter_tensor(part, full, group=group)


def in_step_seconds(dist: Any, torch: Any, call: Any, rounds: int = ROUNDS) -> list[float]:
    """What ``call`` adds to a CPU loop of compute, per call: REPEATS times, ``rounds`` rounds of [burst; call]
    and ``rounds`` of [burst] alone (which goes first alternates), their difference over ``rounds``. Every rank
    runs the same rounds, so each call meets peers that just computed, as in a step."""
    import time

    a = torch.randn(BURST_DIM, BURST_DIM)

    def loop(with_call: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(rounds):
            for _ in range(BURST_MATMULS):
                torch.mm(a, a)
            if with_call:
                call()
        dist.barrier()  # both loops end on a barrier: the slowest rank's time, as a step's
        return time.perf_counter() - t0

    loop(True)  # warm-up
    out = []
    for i in range(REPEATS):
        first = i % 2 == 0
        x = loop(first)
        y = loop(not first)
        with_call, alone = (x, y) if first else (y, x)
        out.append((with_call - alone) / rounds)
    return out


def _rounds(kind: str, nbytes: int) -> int:
    """Rounds per timed loop: SMALL_ROUNDS for the all-reduces of the sizes tensor parallelism's and the norm's
    blocking calls take (``predict_in_step`` prices those calls from these figures alone), ROUNDS elsewhere."""
    return SMALL_ROUNDS if kind == "all_reduce" and nbytes <= SMALL_BYTES else ROUNDS


def _calls(everyone: list[Any]) -> list[tuple[str, float, float, int]]:
    """(type, bytes, seconds, group) per timed call from every rank's (type, bytes, seconds, how, group) list: a
    "barrier" call is its fastest rank's time; where "in_step" figures exist (CPU), those are taken instead,
    each the median over ranks and at least the median barrier-timed fastest time of its type, size and group
    (not the small all-reduces', timed in long loops: ``_rounds``); a call whose figure is not above 0 (a
    subgroup's lost in the noise, with no barrier-timed floor) is dropped."""
    import statistics

    rows = everyone[0]
    fastest = [(k, b, min(r[i][2] for r in everyone), g) for i, (k, b, _, how, g) in enumerate(rows) if how == "barrier"]
    in_step = [(k, b, statistics.median(r[i][2] for r in everyone), g)
               for i, (k, b, _, how, g) in enumerate(rows) if how == "in_step"]
    if not in_step:
        return fastest
    keys = {(k, b, g) for k, b, _, g in fastest}
    floors = {key: statistics.median(t for k, b, t, g in fastest if (k, b, g) == key) for key in keys}
    # The long loops of small all-reduces stand on their own: a barrier-timed median of 3.7 ms for a 4 KiB call
    # (a job of 2026-11-28, where its in-step loops gave 1.3-1.5 ms in the jobs around it) is no floor for them.
    out = [(k, b, t if _rounds(k, int(b)) == SMALL_ROUNDS else max(t, floors.get((k, b, g), 0.0)), g)
           for k, b, t, g in in_step]
    return [c for c in out if c[2] > 0]  # a subgroup's call lost in the noise (no barrier-timed floor) is dropped


def main(out_path: str, backend: str) -> None:
    """Rank side: time every type at every size; rank 0 writes [(type, bytes, seconds, group)] to ``out_path``."""
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mine: list[tuple[str, float, float, str, int]] = []
    for kind in KINDS:
        for size in SIZES:
            call = _one(dist, torch, kind, size, world, device)
            for i in range(WARMUP + REPEATS):
                dist.barrier()
                t0 = time.perf_counter()
                call()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= WARMUP:
                    mine.append((kind, float(size), time.perf_counter() - t0, "barrier", world))
            if device.type == "cpu":
                mine += [(kind, float(size), x, "in_step", world)
                         for x in in_step_seconds(dist, torch, call, _rounds(kind, size))]
    if device.type == "cpu":
        # Groups smaller than the world (a tensor-parallel pair, the data-parallel replicas of a 2-D mesh), all of
        # them at once as in a step: on a CPU with fewer cores than ranks a pair's call waits for cores the other
        # ranks hold, which a world of that size alone would not show.
        for size_of_group in [g for g in range(2, world) if world % g == 0]:
            sub, _ = dist.new_subgroups(group_size=size_of_group)
            for kind in KINDS:
                for size in SIZES:
                    call = _one(dist, torch, kind, size, size_of_group, device, sub)
                    mine += [(kind, float(size), x, "in_step", size_of_group)
                             for x in in_step_seconds(dist, torch, call, _rounds(kind, size))]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        calls = _calls(everyone)
        with open(out_path, "w", encoding="utf-8") as fh:
            json.dump(calls, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "gloo")
