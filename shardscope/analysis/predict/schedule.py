"""One optimizer step played out on a compute thread and communication channels, per strategy schedule.

``simulate`` walks a step in program order: per micro-batch, forward unit by unit, backward unit by unit
in reverse, then the optimizer. Compute advances the compute thread; a collective is issued onto a
channel (one at a time per channel, in issue order) and is either waited for at once (blocking) or
later (asynchronous). The step's exposed communication is the time the compute thread spent waiting.

How each schedule is modelled (``predict_work.Traits`` says which applies to a strategy):

- **Replicated with torch's reducer (DDP)**: gradients fill buckets in reverse parameter order (the
  first capped at 1 MiB, then ``bucket_cap_mb``); a bucket is all-reduced asynchronously as soon as the
  unit that completes it finishes its backward, overlapping the backward of the units before it; the
  step waits for the last bucket at the end of backward. Only the last micro-batch reduces (no_sync).
  Module buffers are broadcast, blocking, before the first forward.
- **Replicated without a reducer (FSDP1 NO_SHARD)**: each unit all-reduces its gradients after its
  backward (asynchronous on GPU streams, blocking on gloo).
- **Partitioned (ZeRO-1/2)**: DeepSpeed with ``overlap_comm`` off reduces every gradient bucket on the
  compute stream: blocking, at the end of backward (every micro-batch for ZeRO-2); after the optimizer
  step the updated partitions are all-gathered, blocking.
- **Fully sharded (FSDP1, FSDP2, ZeRO-3, the hand-written FSDP)**: each unit is all-gathered before its
  forward and, when it reshards after forward (and is not a root kept gathered), again before its
  backward; its gradients are reduce-scattered after its backward (then all-reduced across replicas
  under hybrid sharding). On GPUs (NCCL streams) a prefetching strategy issues the next unit's
  all-gather before this unit's compute, in forward (the CPU runs ahead of the GPU) and in backward
  (explicit prefetch), and reduce-scatters on its own stream, waited for at the end of backward. On
  gloo (CPU) torch's FSDP unshards synchronously (``unshard_async_op`` is off by default) and reduces
  synchronously, so every collective blocks; the hand-written FSDP blocks everywhere by design.
- **Tensor parallel**: two activation all-reduces per layer in forward and one per column-parallel
  linear in backward, each on the critical path (blocking), on top of its data-parallel schedule.
- **DeepSpeed ZeRO-3** gathers runs of units in one coalesced call up to its bucket (``bucket_mb``),
  keeps a model within its live limit gathered into backward, and reduce-scatters a bucket of gradients at
  a time (blocking, ``overlap_comm`` off).
- A sharded or tensor-parallel strategy all-reduces the global gradient norm (one scalar, blocking) in
  the optimizer phase, a tensor-parallel one twice (over the world and over dp); a replicated one computes
  it locally.

Bytes per collective type add up to ``comm_theory.expected_comm`` exactly (each op's share follows the
elements it moves); only the gradient norm's scalar is added. Pure Python, no torch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from shardscope.analysis.predict.work import DDP_FIRST_BUCKET_BYTES, NORM_ALLREDUCE_BYTES, Work

PHASES = ("forward", "backward", "optimizer")
CommTime = Callable[[str, float, int], float]  # (collective type, bytes, group size) -> seconds


@dataclass
class StepTiming:
    """A simulated step: wall time and exposed communication per phase, and all communication time."""

    phase_s: dict[str, float]
    exposed_s: dict[str, float]
    comm_s: float
    bytes_by_type: dict[str, float] = field(default_factory=dict)
    calls_by_type: dict[str, int] = field(default_factory=dict)  # collectives issued, per type

    @property
    def step_s(self) -> float:
        """Forward + backward + optimizer wall time."""
        return sum(self.phase_s.values())

    @property
    def exposed_comm_s(self) -> float:
        """Time the compute thread waited for communication."""
        return sum(self.exposed_s.values())


class _Sim:
    """The compute thread and the channels; in the first pass (``comm`` None) it only sums op weights."""

    def __init__(self, comm: CommTime | None, scale: dict[str, float], overlap: bool,
                 exact_comm: CommTime | None = None) -> None:
        self.comm, self.scale, self.overlap, self.exact_comm = comm, scale, overlap, exact_comm
        self.weights: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.t = 0.0
        self.free: dict[str, float] = defaultdict(float)
        self.pending: dict[object, float] = {}
        self.issued: set[object] = set()
        self.phase = PHASES[0]
        self.start = {p: 0.0 for p in PHASES}
        self.wall = {p: 0.0 for p in PHASES}
        self.computed = {p: 0.0 for p in PHASES}
        self.comm_s = 0.0

    def enter(self, phase: str) -> None:
        """Start ``phase`` (forward, backward or optimizer) at the compute thread's time."""
        self._close()
        self.phase = phase
        self.start[phase] = self.t

    def _close(self) -> None:
        self.wall[self.phase] += self.t - self.start[self.phase]
        self.start[self.phase] = self.t

    def compute(self, seconds: float) -> None:
        """Advance the compute thread by ``seconds`` of work."""
        self.t += seconds
        self.computed[self.phase] += seconds

    def issue(self, key: object, kind: str, weight: float, group: int, exact: bool = False,
              alone: bool = False) -> None:
        """Put a collective on its channel; ``weight`` is its share of the type's bytes, or its bytes if ``exact``.
        A group of one rank makes no call unless ``alone`` (FSDP1's all-reduce across a single replica)."""
        if (group <= 1 and not alone) or weight <= 0 or key in self.issued:
            return
        self.issued.add(key)
        if self.comm is None:
            if not exact:
                self.weights[kind] += weight
            return
        size = weight if exact else weight * self.scale.get(kind, 0.0)
        if size <= 0:
            return
        self.bytes[kind] += size
        self.calls[kind] += 1
        seconds = (self.exact_comm if exact and self.exact_comm else self.comm)(kind, size, group)
        # On GPUs gathers and reductions run on separate streams; gloo runs a group's collectives one at a time.
        channel = ("gather" if kind == "all_gather" else "reduce") if self.overlap else "gloo"
        begin = max(self.t, self.free[channel])
        self.free[channel] = begin + seconds
        self.pending[key] = begin + seconds
        self.comm_s += seconds

    def wait(self, key: object) -> None:
        """Block the compute thread until collective ``key`` has finished (nothing when never issued)."""
        end = self.pending.pop(key, None)
        if end is not None and end > self.t:
            self.t = end

    def blocking(self, kind: str, weight: float, group: int, exact: bool = False) -> None:
        """Issue a collective and wait for it at once."""
        key = object()
        self.issue(key, kind, weight, group, exact)
        self.wait(key)

    def wait_all(self) -> None:
        """Wait for every collective still in flight."""
        for key in list(self.pending):
            self.wait(key)


def _buckets(w: Work, bytes_per_element: float) -> dict[int, float]:
    """DDP's buckets: {position in backward order after which the bucket is complete: elements}, filled in
    reverse parameter order: the head's gradients first (with the root's backward), the blocks from last
    to first, the embeddings last (position ``len(units)``: after the whole backward)."""
    root = next((n for u, _, n in w.units if u == "root"), None)
    order = ([max(0, root - w.emb_elements)] if root is not None else []) + \
        [n for u, _, n in reversed(w.units) if u != "root"] + [min(root or 0, w.emb_elements)]
    out: dict[int, float] = {}
    filled, first = 0.0, True
    for i, n in enumerate(order):
        filled += n
        cap = DDP_FIRST_BUCKET_BYTES if first else w.traits.bucket_bytes
        if filled and (filled * bytes_per_element >= cap or i == len(order) - 1):
            out[i] = filled
            filled, first = 0.0, False
    return out


def _gather_groups(units: list[tuple[str, float, int]], bucket: int) -> list[int]:
    """The index of the first unit of the all-gather each unit is fetched in: its own (``bucket`` 0), or the
    first of a run of units whose elements fit in ``bucket`` (DeepSpeed ZeRO-3's coalesced prefetch)."""
    starts, filled = [], 0
    for i, (_, _, numel) in enumerate(units):
        if not starts or not bucket or filled + numel > bucket:
            starts.append(i)
            filled = 0
        else:
            starts.append(starts[-1])
        filled += numel
    return starts


def _gathers(sim: _Sim, tag: str, m: int, units: list[tuple[str, float, int]], i: int, starts: list[int],
             group: int, ahead: bool, skip: Callable[[int], bool]) -> None:
    """Before unit ``i``'s compute: its all-gather (the first unit of its bucket issues it, covering the bucket's
    elements), the next bucket's too when prefetching ``ahead``, then wait for it. ``skip(j)``: unit j is kept."""
    def issue(j: int) -> None:
        if not skip(j):
            numel = sum(units[k][2] for k in range(len(units)) if starts[k] == starts[j] and not skip(k))
            sim.issue((tag, m, starts[j]), "all_gather", numel, group)  # nothing when issued already

    issue(i)
    later = next((j for j in range(i + 1, len(units)) if starts[j] != starts[i]), None)
    if ahead and later is not None:
        issue(later)
    sim.wait((tag, m, starts[i]))


def _program(w: Work, sim: _Sim, fwd_s: float, bwd_s: float, opt_s: float) -> None:
    t, by_type = w.traits, w.by_type
    dp, group = w.dp, w.shard_group
    replicas = dp // group if group and dp % group == 0 else 1
    units = w.units
    blocks = [u for u in units if u[0] != "root"]
    backward_units = [u for u in units if u[0] == "root"] + list(reversed(blocks))
    sharded = w.shards == "all"
    partitioned = w.shards in ("optim", "grads")
    tp_fwd, tp_bwd = w.tp_layer_bytes
    calls_fwd, calls_bwd = w.tp_layer_calls
    dp_allreduce = by_type.get("all_reduce", 0) - (tp_fwd + tp_bwd) * len(blocks) * w.accum
    micro_f, micro_b = fwd_s / w.accum, bwd_s / w.accum
    overlap = sim.overlap
    bpe = dp_allreduce / max(1, sum(n for _, _, n in units))
    forward_starts = _gather_groups(units, t.gather_bucket)
    backward_starts = _gather_groups(backward_units, t.gather_bucket)

    def kept(j: int) -> bool:
        return backward_units[j][0] == "root" and t.root_kept
    for m in range(w.accum):
        last = m == w.accum - 1
        sim.enter("forward")
        if m == 0 and by_type.get("broadcast"):
            sim.blocking("broadcast", 1.0, dp)
        gathered = sharded and (m == 0 or t.regather or t.gather_bucket > 0 or not t.kept_through_no_sync)
        ahead = overlap and t.prefetch
        for i, (name, share, numel) in enumerate(units):
            if gathered:
                _gathers(sim, "ag", m, units, i, forward_starts, group, ahead, lambda j: False)
            sim.compute(micro_f * share)
            if name != "root" and tp_fwd:
                for _ in range(calls_fwd):
                    sim.blocking("all_reduce", tp_fwd / calls_fwd, w.tp, exact=True)
        sim.enter("backward")
        regather = sharded and t.regather
        reduce_now = last or t.reduces_per_micro
        buckets = _buckets(w, bpe) if t.bucketed and last and dp_allreduce > 0 else {}
        unreduced = 0.0  # gradient elements waiting for the next bucketed reduce-scatter
        for i, (name, share, numel) in enumerate(backward_units):
            if regather and not (name == "root" and t.root_kept):
                _gathers(sim, "bg", m, backward_units, i, backward_starts, group, ahead, kept)
            sim.compute(micro_b * share)
            if name != "root" and tp_bwd:
                for _ in range(calls_bwd):
                    sim.blocking("all_reduce", tp_bwd / calls_bwd, w.tp, exact=True)
            if sharded and reduce_now and t.reduce_bucket:
                unreduced += numel
                if unreduced >= t.reduce_bucket or i == len(backward_units) - 1:
                    sim.blocking("reduce_scatter", unreduced, group)
                    unreduced = 0.0
            elif sharded and reduce_now:
                key = ("rs", m, i)
                sim.issue(key, "reduce_scatter", numel, group)
                if replicas > 1 or t.hybrid:  # hybrid sharding: the shard is all-reduced across the replicas (FSDP1: even one)
                    sim.wait(key)
                    sim.issue(("hr", m, i), "all_reduce", numel, replicas, alone=t.hybrid)
                if not (overlap and t.async_reduce):
                    sim.wait(key)
                    sim.wait(("hr", m, i))
            elif w.shards == "none" and last and not t.bucketed:
                sim.issue(("ar", i), "all_reduce", numel, dp)
                if not overlap:
                    sim.wait(("ar", i))
            if i in buckets:
                sim.issue(("bucket", i), "all_reduce", buckets[i], dp)
        if len(backward_units) in buckets:
            sim.issue(("bucket", "emb"), "all_reduce", buckets[len(backward_units)], dp)
        if partitioned and (last or t.reduces_per_micro) and dp_allreduce > 0:
            sim.blocking("all_reduce", 1.0, dp)
        if partitioned and by_type.get("reduce_scatter"):
            sim.blocking("reduce_scatter", 1.0, dp)
        sim.wait_all()
    sim.enter("optimizer")
    if t.norm_allreduce and w.world_size > 1:
        sim.blocking("all_reduce", NORM_ALLREDUCE_BYTES, w.world_size, exact=True)
        if w.tp > 1:  # and again over dp: FSDP2 + TP's dp-sharded tensors (total_norm), DeepSpeed's second group
            sim.blocking("all_reduce", NORM_ALLREDUCE_BYTES, w.dp, exact=True)
    sim.compute(opt_s)
    if partitioned:
        sim.blocking("all_gather", 1.0, dp)


def simulate(w: Work, fwd_s: float, bwd_s: float, opt_s: float, comm: CommTime, overlap: bool,
             exact_comm: CommTime | None = None) -> StepTiming:
    """Play one optimizer step of ``w`` with these compute times (per rank, whole step; ``bwd_s`` includes any
    recomputation) and ``comm(type, bytes, group)`` per collective. ``overlap``: collectives can run beside
    compute on their own streams (NCCL); False on gloo, where only DDP's reducer works asynchronously.
    ``exact_comm``: the price of the calls of exact bytes (tensor-parallel activations, the gradient norm) when
    not ``comm``'s (``predict_in_step``)."""
    first = _Sim(None, {}, overlap)
    _program(w, first, fwd_s, bwd_s, opt_s)
    scale = {}
    for kind, weight in first.weights.items():
        target = w.by_type.get(kind, 0.0)
        if kind == "all_reduce":
            target -= sum(w.tp_layer_bytes) * sum(1 for u in w.units if u[0] != "root") * w.accum
        scale[kind] = max(0.0, target) / weight if weight else 0.0
    sim = _Sim(comm, scale, overlap, exact_comm)
    _program(w, sim, fwd_s, bwd_s, opt_s)
    sim._close()
    exposed = {p: max(0.0, sim.wall[p] - sim.computed[p]) for p in PHASES}
    return StepTiming(dict(sim.wall), exposed, sim.comm_s, dict(sim.bytes), dict(sim.calls))


def untimed_types(w: Work) -> list[str]:
    """Collective types the theory moves bytes in that the schedule places nowhere (should be none)."""
    first = _Sim(None, {}, False)
    _program(w, first, 1.0, 1.0, 1.0)
    return sorted(k for k, v in w.by_type.items() if v > 0 and k not in first.weights
                  and not (k == "all_reduce" and sum(w.tp_layer_bytes) > 0))
