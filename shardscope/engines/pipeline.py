"""Pipeline parallelism on ``torch.distributed.pipelining``: the model split into stages across the ranks of a
pipeline, a step's micro-batches run by one of torch's schedules (GPipe, 1F1B, interleaved 1F1B, interleaved zero
bubble), gradients averaged across the pipelines' replicas after each schedule step.

The split is ``core/pipeline_layout.split``: contiguous units (embeddings, each block, the head), balanced by
parameters, looped over the ranks (stage s on pipeline rank s mod pp), so the memory model and the communication
theory predict from the same split. Each stage is a view of the built model (its modules, not copies), so the
comparison's shared initial weights carry over unchanged.

Fair by construction: the step's micro-batches (the loop's, concatenated: the rank's whole share of the global
batch) are split into ``microbatches`` equal chunks; the loss of a chunk is its summed cross entropy over the rank's
token count (``scale_grads=False``), so the gradients are those of the mean loss over the rank's batch whatever
``microbatches`` is, as in every other strategy (a mean per chunk scaled by the schedule would divide a weight
shared by two stages twice: benchmarks/RESULTS.md, pipeline schedules).

What it measures for the step record (``pp_*``): each stage action's compute time (``forward_one_chunk``,
``backward_one_chunk``, ``backward_weight_one_chunk``, timed around the call: the wait for an input happens before
it, in the schedule) and the schedule's span, whose difference is the rank's bubble. The step clock's forward and
backward laps close at the end of each action, so the wait before an action counts in that action's phase.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules

from shardscope.core import pipeline_layout, registry
from shardscope.engines import memory_accounting, norms, pipeline_stages, settings_code
from shardscope.engines.api import Prepared, RankContext, TrainSettings
from shardscope.engines.comm_count import instrumentation
from shardscope.engines.global_grad import full_value
from shardscope.engines.optim import make_optimizer
from shardscope.engines.settings_code import Code, Name, call

SCHEDULES = {  # registry schedule -> (torch class, whether it takes every stage of the rank)
    "gpipe": ("ScheduleGPipe", False),
    "1f1b": ("Schedule1F1B", False),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", True),
    "zero-bubble": ("ScheduleInterleavedZeroBubble", True),
}


class StageTimer:
    """Compute seconds of a rank's stage actions in the current step, each action's interval (for the timeline),
    and the step clock's laps at their ends."""

    def __init__(self) -> None:
        self.forward_s = self.backward_s = 0.0
        self.clock: Any = None
        self.t0 = 0.0  # the schedule's start, for the actions' offsets
        self.actions: list[list[Any]] = []  # [kind, stage, micro-batch, start ms, end ms] of this step

    def begin(self, clock: Any) -> None:
        """Start a step's schedule."""
        self.forward_s = self.backward_s = 0.0
        self.clock, self.actions, self.t0 = clock, [], time.perf_counter()

    def wrap(self, stage: PipelineStage) -> None:
        """Time ``stage``'s compute entry points (wrapped on the instance)."""
        for method, phase in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                              ("backward_weight_one_chunk", "backward")):
            setattr(stage, method, self._timed(getattr(stage, method), phase, method, stage.stage_index))

    def _timed(self, fn: Callable[..., Any], phase: str, method: str, stage_index: int) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                if phase == "forward":
                    self.forward_s += t1 - t0
                else:
                    self.backward_s += t1 - t0
                chunk = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id", -1))
                kind = {"forward_one_chunk": "F", "backward_weight_one_chunk": "W"}.get(
                    method, "B" if kwargs.get("full_backward", True) else "I")
                self.actions.append([kind, stage_index, int(chunk), round((t0 - self.t0) * 1e3, 3),
                                     round((t1 - self.t0) * 1e3, 3)])
                if self.clock is not None:
                    self.clock.lap(phase)
        return timed


def release_other_stages(model: nn.Module, kept: list[torch.Tensor]) -> None:
    """Free the storage of every parameter of ``model`` that none of this rank's stages holds (the worker built
    the whole model, and still refers to it): a rank's memory is then its stages', as the memory model says."""
    mine = {id(p) for p in kept}
    for p in model.parameters():
        if id(p) not in mine:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def shard_stages(modules: list[nn.Module], ctx: RankContext) -> None:
    """FSDP2 on each stage across the pipelines (torchtitan's PP x FSDP): ``fully_shard`` over the data-parallel mesh
    on each block, then on the stage. Blocks are not resharded after forward (torchtitan's default under pipeline
    parallelism): a step gathers each unit once, not once per micro-batch; torch's ``PipelineStage`` defers the
    gradients' reduce-scatter to each stage's last backward."""
    from torch.distributed.fsdp import fully_shard

    mesh = ctx.mesh["dp"]
    for mod in modules:
        for block in mod.stage_blocks():
            fully_shard(block, mesh=mesh, reshard_after_forward=False)
        fully_shard(mod, mesh=mesh, reshard_after_forward=False)


def average_across_pipelines(params: list[torch.Tensor], group: Any, dp: int) -> None:
    """Average the stages' gradients across the pipelines' replicas: one all-reduce of one flat buffer after the
    schedule. Not DDP: DDP's hooks fire in backward and miss the gradients a zero-bubble schedule computes in its
    separate weight pass (with DDP, ``pp-zero-bubble`` at 2 pipelines left DDP's loss by 0.077 in 8 steps and
    reduced 140,932 of 473,860 expected bytes: 2026-11-28, torch 2.13.0, gloo); one flat all-reduce is exact for
    every schedule, at the cost of no overlap with backward."""
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(dp)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def tied_pairs(model: nn.Module, modules: list[nn.Module], ctx: RankContext, n_stages: int) -> tuple[Any, list[Any]]:
    """The group of this pipeline's first- and last-stage ranks and the tied parameters this rank holds there, or
    (None, []) when the model ties none or this rank holds neither stage. Every rank makes every pipeline's group, in
    the same order (``new_group`` is collective)."""
    names = pipeline_stages.tied(model)
    if not names:
        return None, []
    first = dist.get_global_rank(ctx.pp_group, pipeline_layout.stage_ranks(n_stages, ctx.pp_size)[0])
    last = dist.get_global_rank(ctx.pp_group, pipeline_layout.stage_ranks(n_stages, ctx.pp_size)[n_stages - 1])
    pairs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pairs, (first, last))
    mine = None
    for pair in sorted(set(pairs)):
        group = dist.new_group(list(pair))
        if dist.get_rank() in pair:
            mine = group
    wanted = set(names)
    on_stages = {id(q) for mod in modules for q in mod.parameters()}
    held = [p for n, p in model.named_parameters() if n in wanted and id(p) in on_stages]
    return (mine, held) if held else (None, [])


def sum_tied(params: list[torch.Tensor], group: Any) -> None:
    """Sum a tied weight's gradients of the first and the last stage (Megatron-LM's embedding all-reduce), so both
    copies take the same step: one all-reduce of one flat buffer."""
    local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    if not local:
        return
    flat = torch.cat([g.reshape(-1) for g in local])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in local:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def grid_of(schedule: Any) -> dict[int, list[tuple[str, int, int]]]:
    """The schedule's action grid as ``{rank: [(kind, stage, microbatch)]}`` (compute actions only)."""
    out: dict[int, list[tuple[str, int, int]]] = {}
    for rank, actions in schedule.pipeline_order.items():
        flat = []
        for a in actions:
            for sub in (getattr(a, "sub_actions", None) or (a,)) if a is not None else ():
                kind = str(sub.computation_type.value if hasattr(sub.computation_type, "value") else sub.computation_type)
                if kind in ("F", "B", "I", "W"):
                    flat.append((kind, int(sub.stage_index), int(sub.microbatch_index)))
        out[int(rank)] = flat
    return out


def apply(model: nn.Module, ctx: RankContext, settings: TrainSettings, options: dict[str, Any], *,
          strategy: str) -> Prepared:
    """Split ``model`` into this rank's pipeline stages, build the ``strategy``'s schedule; return the Prepared the
    loop drives. Options: ``pp`` (ranks per pipeline), ``microbatches`` (m), ``stages_per_rank`` (v)."""
    info = registry.get(strategy)
    pp, m, v = ctx.pp_size, int(options["microbatches"]), int(options["stages_per_rank"])
    n_stages = pp * v
    units = pipeline_stages.units(model)
    ranges = pipeline_layout.split([u.numel for u in units], n_stages)
    mine = pipeline_layout.stages_of(ctx.pp_rank, pp, v)
    policy = settings.precision
    autocast = policy.compute_dtype if policy.autocast else None
    batch = settings.micro_batch_size * settings.grad_accum  # this pipeline's share of the global batch
    modules = [pipeline_stages.stage(model, *ranges[s], autocast, batch // m) for s in mine]
    sharded = options.get("dp_shard") == "fsdp2"
    if sharded:  # before the stages are built: PipelineStage looks at whether its module is an FSDP module
        shard_stages(modules, ctx)
    chunk, seq = batch // m, pipeline_stages.seq_len(model)
    width, vocab = pipeline_stages.widths(model)
    act = dict(dtype=torch.float32, device=ctx.device)
    stages = []
    for s, mod in zip(mine, modules):
        first, last = s == 0, s == n_stages - 1
        inp = (torch.zeros(chunk, seq, dtype=torch.long, device=ctx.device) if first
               else torch.zeros(chunk, seq, width, requires_grad=True, **act))
        out = (torch.zeros(chunk, seq, vocab, requires_grad=True, dtype=autocast or torch.float32, device=ctx.device)
               if last else torch.zeros(chunk, seq, width, requires_grad=True, **act))
        stages.append(PipelineStage(mod, s, n_stages, ctx.device, input_args=(inp,), output_args=(out,),
                                    group=ctx.pp_group))
    timer = StageTimer()
    for stage in stages:
        timer.wrap(stage)
    tokens = batch * seq
    factor = {"value": 1.0}  # grad_accum_loss = "sum": the gradient of grad_accum times the mean loss

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        summed = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum")
        return summed * (factor["value"] / tokens)

    cls_name, looped = SCHEDULES[info.schedule]
    cls = getattr(schedules, cls_name)
    kwargs = {"n_microbatches": m, "scale_grads": False}
    schedule = cls(stages if looped else stages[0], loss_fn=loss_fn, **kwargs)
    stage_rank = pipeline_layout.stage_ranks(n_stages, pp)
    theory = pipeline_layout.bubble_theory(info.schedule, pp, m, v)
    # Only where no formula holds (zero bubble): torch 2.13's 1F1B grid labels its last rank's forwards F1..Fm.
    grid = pipeline_layout.grid_bubble(grid_of(schedule), stage_rank) if theory is None else None
    has_first, has_last = any(st.is_first for st in stages), any(st.is_last for st in stages)
    last_rank = dist.get_global_rank(ctx.pp_group, stage_rank[n_stages - 1])
    spans = {"span_s": 0.0, "steps": 0}

    def run_micro_batches(micro: list[Any], divisor: int, clock: Any = None) -> torch.Tensor:
        inputs = torch.cat([x for x, _ in micro]).to(ctx.device)
        targets = torch.cat([y for _, y in micro]).to(ctx.device)
        factor["value"] = len(micro) / divisor
        losses: list[torch.Tensor] = []
        timer.begin(clock)
        t0 = timer.t0
        args = (inputs,) if has_first else ()
        if has_last:
            schedule.step(*args, target=targets, losses=losses)
        else:
            schedule.step(*args)
        spans["span_s"] = time.perf_counter() - t0
        if ctx.dp_size > 1 and not sharded:  # FSDP2 on the stages reduce-scatters the gradients itself
            average_across_pipelines(params, ctx.dp_group, ctx.dp_size)
        if tied_group is not None:
            sum_tied(tied_params, tied_group)
        timer.clock = None
        mean = (torch.stack([x.detach() for x in losses]).sum() / factor["value"] if has_last
                else torch.zeros((), device=ctx.device))
        with instrumentation():  # the loss, for the record, from the stage that computed it: shardscope's own
            dist.broadcast(mean, src=last_rank, group=ctx.pp_group)
        return mean * len(micro)

    params = list({id(p): p for mod in modules for p in mod.parameters()}.values())
    tied_group, tied_params = tied_pairs(model, modules, ctx, n_stages)
    release_other_stages(model, params)
    optimizer = make_optimizer(params, settings)

    # a tied weight's (summed) gradient counts once in the global norm: on the first stage's rank
    once = {id(p) for p in tied_params} if tied_params and not has_first else set()

    def clip_and_step(max_norm: float) -> float:
        grads = [p.grad for p in params if p.grad is not None and id(p) not in once]
        local = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros((), device=ctx.device)
        square = (full_value(local).float() ** 2).reshape(1)  # sharded stages: the stage's norm across the pipelines
        dist.all_reduce(square, group=ctx.pp_group)  # every stage's share of the global norm
        norm = square.sqrt()[0]
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, norm)
        optimizer.step()
        return float(norm)

    named = [(n, p) for mod in modules for n, p in mod.named_parameters()]

    def layer_norms() -> dict[str, dict[str, float]]:
        local = norms.param_and_grad_norms(named)
        gathered: list[Any] = [None] * pp
        dist.all_gather_object(gathered, local, group=ctx.pp_group)
        return {k: {layer: value for part in gathered for layer, value in part[k].items()} for k in ("grad", "param")}

    def step_fields() -> dict[str, Any]:
        span = spans["span_s"]
        compute = timer.forward_s + timer.backward_s
        out: dict[str, Any] = {"pp_forward_s": timer.forward_s, "pp_backward_s": timer.backward_s, "pp_span_s": span}
        if span > 0:
            out["pp_bubble"] = max(0.0, 1.0 - compute / span)
        spans["steps"] += 1
        if spans["steps"] == min(2, settings.steps):  # one step's timeline, after the first (its set-up)
            out["pp_timeline"] = timer.actions
        return out

    notes = {"pp": pp, "microbatches": m, "stages_per_rank": v, "schedule": info.schedule,
             "stages": mine, "units": [[units[i].name for i in range(*ranges[s])] for s in mine],
             "stage_params": [sum(units[i].numel for i in range(*ranges[s])) for s in mine],
             "bubble_theory": theory if theory is not None else grid,
             "bubble_formula": pipeline_layout.FORMULAS[info.schedule], "chunk": chunk}
    return Prepared(
        model=nn.ModuleList(modules), optimizer=optimizer, clip_and_step=clip_and_step,
        model_state_bytes=lambda: memory_accounting.model_state_bytes(params, optimizer),
        layer_norms=layer_norms, handles_precision=True, run_micro_batches=run_micro_batches,
        step_fields=step_fields, notes=notes, code=_code(cls_name, looped, kwargs, notes, sharded, settings, ctx))


def _code(cls_name: str, looped: bool, kwargs: dict[str, Any], notes: dict[str, Any], sharded: bool, settings: TrainSettings,
          ctx: RankContext) -> Code:
    """The stages and the schedule as the run built them (``settings_code``), for this rank (rank 0's is kept)."""
    n = notes["pp"] * notes["stages_per_rank"]
    lines = [f"# this rank's stage(s) {notes['stages']} of {n}, split by parameter count: {notes['units']}",
             "# stage_modules: your model's parts for those stages; loss_fn(logits, targets) sums the cross entropy "
             f"and divides by the tokens of a step ({notes['chunk']} samples per micro-batch)"]
    if sharded:
        lines += ["for part in stage_modules:  # FSDP2 on each stage across the pipelines",
                  "    for block in <the part's blocks>:",
                  '        fully_shard(block, mesh=world_mesh["dp"], reshard_after_forward=False)',
                  '    fully_shard(part, mesh=world_mesh["dp"], reshard_after_forward=False)']
    device = "torch.device('cuda', local_rank)" if ctx.device.type == "cuda" else f"torch.device({ctx.device.type!r})"
    lines += [f"stages = [PipelineStage(part, index, {n}, {device}, group=pp_group)",
              f"          for index, part in zip({notes['stages']}, stage_modules)]",
              call(f"schedule = {cls_name}", Name("stages" if looped else "stages[0]"),
                   loss_fn=Name("loss_fn"), **kwargs),
              settings_code.optimizer(settings, "(p for part in stage_modules for p in part.parameters())")]
    imports = [f"from torch.distributed.pipelining import PipelineStage, {cls_name}"]
    if sharded:
        imports.append("from torch.distributed.fsdp import fully_shard")
    per_step = (f"# per pipeline and optimizer step: {settings.micro_batch_size * settings.grad_accum} sample(s), "
                f"split by the schedule into {kwargs['n_microbatches']} micro-batches of {notes['chunk']}, over "
                f"{ctx.dp_size} pipeline(s)")
    return Code(imports, lines=lines, per_step=per_step)


def _entry(strategy: str) -> Callable[..., Prepared]:
    def entry(model: nn.Module, ctx: RankContext, settings: TrainSettings, options: dict[str, Any]) -> Prepared:
        return apply(model, ctx, settings, options, strategy=strategy)
    entry.__doc__ = f"``apply`` with the {strategy} schedule (the registry's entry for it)."
    return entry


apply_gpipe = _entry("pp-gpipe")
apply_1f1b = _entry("pp-1f1b")
apply_interleaved = _entry("pp-interleaved")
apply_zero_bubble = _entry("pp-zero-bubble")
