"""The training loop shared by every strategy: same schedule, accumulation, clipping, precision
handling and records, so a difference in results is a difference of strategy, not of loop.

Per step: set the lr, run ``grad_accum`` micro-batches (``no_sync`` on all but the last; loss
scaled by 1/grad_accum), clip by the global norm and step (``Prepared.clip_and_step``), then
write a ``step`` record. Reading the norm back (a float) is the one host sync per step, which the
step time needs anyway.

No collective is added for the reported loss: each rank records ``local_loss`` (the mean over its
own micro-batches) and the fold (``profiling/state.py``) averages the ranks' values into the
run's loss. The stop-on-divergence verdict must be the same on every rank, so it reads only what
every rank shares: the global gradient norm and whether the step was skipped. Only where those do
not carry it (a step an fp16 loss scaler skipped, whose norm is inf by design, or a strategy that
cannot measure the norm) is the loss all-reduced, and that record carries the global ``loss``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import psutil
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import record_function

from shardscope.core import events
from shardscope.core.numbers import median_rate
from shardscope.engines.api import Prepared, RankContext, TrainSettings
from shardscope.engines.data import Batch
from shardscope.engines.faults import Fault
from shardscope.engines.optim import LossScaler, lr_at
from shardscope.engines.precision import loop_autocast_dtype
from shardscope.engines.step_clock import CudaStepClock, StepClock, step_clock
from shardscope.engines.comm_count import CountWindow, instrumentation, instrumentation_spent
from shardscope.engines.capture import ProfilerWindow
from shardscope.engines.module_probe import ModuleProbe
from shardscope.engines import stack_room
from shardscope.core.events import PHASE_MARKERS


@dataclass
class LoopConfig:
    """What the loop needs beyond the strategy's Prepared and the TrainSettings."""

    global_batch: int
    tokens_per_sample: int  # 0 = image model: report samples/s
    min_lr_ratio: float
    parity: bool = False
    log_every: int = 1
    fault: Fault | None = None
    profiler: ProfilerWindow | None = None
    counter: CountWindow | None = None  # in-rank collective byte count over the profiled window (opt-in)
    probe: ModuleProbe | None = None  # shardscope why's re-runs only: module outputs and gradients (module_probe.py)
    stop_on_nonfinite: bool = True  # preset on_nonfinite = "stop": end the run diverged at the first inf/nan
    steps_completed: int = 0  # updated after every step, read by the worker when a run fails or stops


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy in fp32 over all positions (tokens) or samples (images)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def device_memory(device: torch.device) -> dict[str, int]:
    """Return allocator figures on CUDA (alloc, peak, reserved) or process RSS and peak RSS on CPU."""
    if device.type == "cuda":
        return {
            "mem_alloc_bytes": torch.cuda.memory_allocated(device),
            "mem_peak_bytes": torch.cuda.max_memory_allocated(device),
            "mem_reserved_bytes": torch.cuda.memory_reserved(device),
        }
    # ru_maxrss is in KiB on Linux: the peak resident set of this process.
    return {"rss_bytes": rss_bytes(), "mem_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def rss_bytes() -> int:
    """This process's resident set size. On Linux one ``pread`` of ``/proc/self/statm`` through a
    descriptor opened once (psutil opens, reads and closes the file on every call: three system
    calls on the step's path); elsewhere psutil."""
    fd = _statm_fd(os.getpid())  # keyed by pid: a forked child must not read its parent's figures
    if fd is None:
        return int(_this_process().memory_info().rss)
    return int(os.pread(fd, 128, 0).split()[1]) * _PAGE


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@functools.lru_cache(maxsize=4)
def _statm_fd(pid: int) -> int | None:
    try:
        return os.open(f"/proc/{pid}/statm", os.O_RDONLY)
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def _this_process() -> psutil.Process:
    """This rank's process handle, made once: building one per step costs syscalls on the hot path."""
    return psutil.Process()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(prep: Prepared, ctx: RankContext, settings: TrainSettings, cfg: LoopConfig,
          micro_batches: Callable[[int], list[Batch]], writer: events.RecordWriter) -> int:
    """Train for ``settings.steps`` steps, writing step/memory/layers/trace records; return the
    number of steps completed. Exceptions propagate (the worker records them). The steps run with room on
    CPython's frame stack (``stack_room``): how deep the caller is (a forked rank or a new interpreter) must not
    decide what a step costs."""
    return stack_room.call(_train, prep, ctx, settings, cfg, micro_batches, writer)


def _train(prep: Prepared, ctx: RankContext, settings: TrainSettings, cfg: LoopConfig,
           micro_batches: Callable[[int], list[Batch]], writer: events.RecordWriter) -> int:
    trainer = Trainer(prep, ctx, settings, cfg, micro_batches, writer)
    for step in range(settings.steps):
        if trainer.step(step):
            break
    return trainer.finish()


class Trainer:
    """The loop, one step at a time (``train`` runs it; ``benchmarks/overhead.py`` interleaves its steps
    with a bare loop's). ``step(i)`` trains step ``i`` and returns True when the run must stop there;
    ``finish()`` writes the end records and returns the number of steps completed."""

    def __init__(self, prep: Prepared, ctx: RankContext, settings: TrainSettings, cfg: LoopConfig,
                 micro_batches: Callable[[int], list[Batch]], writer: events.RecordWriter) -> None:
        self.prep, self.ctx, self.settings, self.cfg = prep, ctx, settings, cfg
        self.micro_batches, self.writer = micro_batches, writer
        self.autocast_dtype = loop_autocast_dtype(settings.precision, prep.handles_precision)
        # fp16 loss scaling in the loop, unless the strategy does its own (DeepSpeed) or has no torch optimizer.
        scaled = settings.precision.loss_scaling and prep.optimizer is not None and not prep.handles_precision
        self.scaler = LossScaler() if scaled else None
        self.tokens = cfg.global_batch * cfg.tokens_per_sample
        self.rates: list[tuple[int, float]] = []  # (step, rate) outside the profiler window
        self.diverged: dict[str, Any] = {}  # first_nonfinite_step and nonfinite, once a step's loss or norm is inf/nan
        self.clock = step_clock(ctx.device)
        assert prep.set_lr is not None and prep.zero_grad is not None

    def step(self, step: int) -> bool:
        """Train one step and write its records; return True when the run must stop (non-finite)."""
        prep, ctx, settings, cfg, clock, writer = self.prep, self.ctx, self.settings, self.cfg, self.clock, self.writer
        clock.begin()
        profiled = cfg.profiler is not None and cfg.profiler.in_window(step)
        if cfg.profiler is not None:
            cfg.profiler.begin_step(step)
        if cfg.counter is not None:
            cfg.counter.begin_step(step)
        micro = self.micro_batches(step)  # generated on CPU, outside the timed step
        spent0 = instrumentation_spent()[0]
        t0 = time.perf_counter()
        clock.lap("data")
        if cfg.fault is not None:  # inside the timed step: a "slow" rank's extra work is step time
            cfg.fault.maybe_fire(ctx.rank, step, ctx.device)
        lr = lr_at(step, lr=settings.lr, warmup_steps=settings.warmup_steps,
                   total_steps=settings.schedule_steps or settings.steps, min_lr_ratio=cfg.min_lr_ratio)
        prep.set_lr(lr)  # type: ignore[misc]  (checked in __init__)
        prep.zero_grad()  # type: ignore[misc]
        if cfg.probe is not None:
            cfg.probe.begin_step(step)
        loss_sum = _forward_backward(prep, ctx, micro, self.autocast_dtype, self.scaler, clock, profiled,
                                     cfg.probe, 1 if settings.grad_accum_loss == "sum" else len(micro))
        finite = _unscale(prep, self.scaler)  # before the layer norms, so that they are true gradients
        if cfg.probe is not None:
            cfg.probe.before_step(step)  # gradients as the optimizer will see them (DeepSpeed: armed for its step)
        layer_record = None
        if cfg.parity and prep.layer_norms is not None:
            with instrumentation():  # shardscope's own collectives, set apart from the strategy's
                layer_record = prep.layer_norms()
        with _marker("step", profiled):
            grad_norm, skipped = (_norm(prep.clip_and_step(settings.grad_clip)), False) if finite else (float("inf"), True)
        # A strategy with its own fp16 loss scaler (DeepSpeed) says whether it skipped the step: not divergence.
        skipped = skipped or (prep.step_applied is not None and not prep.step_applied())
        local_loss = loss_sum.item() / settings.grad_accum
        # skipped and "norm not measured" are the same on every rank, so all of them take this branch or none.
        loss = _global_loss(loss_sum, ctx, settings.grad_accum) if skipped or grad_norm is None else None
        clock.lap("optimizer")
        _sync(ctx.device)  # the norm's read-back already waited for the step; this covers the optimizer tail
        # Parity mode's norms are shardscope's, not the strategy's: their time is reported apart, not as step time.
        aside_wall = instrumentation_spent()[0] - spent0
        dt = time.perf_counter() - t0 - aside_wall  # the clock's phases leave it out too (step_clock.py)
        if cfg.profiler is not None:
            for trace in cfg.profiler.end_step(step):
                writer.write(events.TRACE, **trace)
        counted = cfg.counter.end_step(step) if cfg.counter is not None else None
        if counted is not None:
            writer.write(events.COMM, **counted)
        rate = (self.tokens or cfg.global_batch) / dt
        if not profiled:  # profiled steps run slower; median_rate leaves out step 0 (set-up costs)
            self.rates.append((step, rate))
        # The verdict reads only values every rank shares (the global norm, skipped, the global loss
        # where it was reduced), so all ranks stop at the same step: none is left waiting in a collective.
        # A non-finite local loss makes non-finite gradients, hence a non-finite global norm.
        nonfinite = events.nonfinite_fields({"loss": loss, "grad_norm": grad_norm, "skipped": skipped})
        if nonfinite and not self.diverged:  # named with this rank's own loss too, when it was not reduced
            named = events.nonfinite_fields({"loss": local_loss if loss is None else loss, "grad_norm": grad_norm,
                                             "skipped": skipped})
            self.diverged = {"first_nonfinite_step": step, "nonfinite": named}
        stop_now = bool(nonfinite) and cfg.stop_on_nonfinite
        if step % cfg.log_every == 0 or step == settings.steps - 1 or stop_now:
            record: dict[str, Any] = {"local_loss": local_loss, "grad_norm": grad_norm, "lr": lr, "step_time_s": dt}
            if loss is not None:
                record["loss"] = loss
            if self.tokens:
                record.update(tokens=self.tokens, tokens_per_s=rate)
            else:
                record.update(samples=cfg.global_batch, samples_per_s=rate)
            if aside_wall > 0:
                record["instrumentation_s"] = aside_wall
            if profiled:
                record["profiled"] = True
            if skipped:
                record["skipped"] = True  # fp16 overflow: no optimizer step
            record.update(clock.fields())
            if prep.step_fields is not None:
                record.update(prep.step_fields())
            writer.write(events.STEP, step=step, **record, **device_memory(ctx.device))
        if cfg.probe is not None:
            cfg.probe.end_step(step, writer)
        if layer_record:  # empty when a strategy that fills it inside step (DeepSpeed) did not reduce
            writer.write(events.LAYERS, step=step, grad_norms=layer_record["grad"], param_norms=layer_record["param"])
        if step == 0:
            write_memory(prep, ctx, writer, step, "after_first_step")
        cfg.steps_completed = step + 1
        return stop_now

    def finish(self) -> int:
        """Write the end-of-run memory and ``end`` records; return the number of steps completed."""
        cfg, rates = self.cfg, self.rates
        write_memory(self.prep, self.ctx, self.writer, cfg.steps_completed - 1, "end")
        extra = {"compiled_graphs": compiled_graph_count()} if self.settings.compile else {}
        self.writer.write(events.END, status="diverged" if self.diverged else "ok", steps_completed=cfg.steps_completed,
                          **self.diverged, **extra,
                          median_tokens_per_s=median_rate(rates) if self.tokens else None,
                          median_samples_per_s=median_rate(rates) if not self.tokens else None)
        return cfg.steps_completed


def _global_loss(loss_sum: torch.Tensor, ctx: RankContext, grad_accum: int) -> float:
    """The mean loss over the data-parallel group (every dp rank holds the same number of samples, so
    the mean of the ranks' means): one blocking all-reduce, only on steps whose verdict needs it."""
    total = loss_sum.clone()
    dist.all_reduce(total, group=ctx.dp_group)
    return total.item() / (grad_accum * ctx.dp_size)


def _norm(value: float | None) -> float | None:
    """The global gradient norm as a float; None when the strategy could not measure it (never a NaN,
    which would read as divergence)."""
    return None if value is None else float(value)


def compiled_graph_count() -> int:
    """Return how many graphs torch.compile (dynamo) has compiled in this process: > 0 proves that
    a ``compile = true`` run really ran compiled code, whichever way its strategy compiles."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _marker(phase: str, profiled: bool) -> ContextManager[Any]:
    """The phase's profiler annotation in a profiled step (the trace analysis reads it); nothing otherwise,
    since outside the profiler window an annotation is a dispatcher call per phase that nothing reads."""
    return record_function(PHASE_MARKERS[phase]) if profiled else _NULL


# One reusable no-op context for the step's optional contexts (nullcontext holds no state), not one built per use.
_NULL: ContextManager[Any] = contextlib.nullcontext()


def _forward_backward(prep: Prepared, ctx: RankContext, micro: list[Batch], autocast_dtype: torch.dtype | None,
                      scaler: LossScaler | None, clock: StepClock | CudaStepClock, profiled: bool,
                      probe: ModuleProbe | None = None, loss_divisor: int = 1) -> torch.Tensor:
    """Run every micro-batch forward and backward, each loss divided by ``loss_divisor`` (grad_accum: the gradient
    of the mean loss) before backward; return the detached sum of their undivided losses."""
    if prep.run_micro_batches is not None:  # a pipeline schedule runs them all, lapping the clock per action
        loss_sum = prep.run_micro_batches(micro, loss_divisor, clock)
        clock.lap("backward")  # the schedule's tail after its last action (its last sends, DDP's last reduce)
        return loss_sum
    losses: list[torch.Tensor] = []
    for i, (inputs, targets) in enumerate(micro):
        inputs = inputs.to(ctx.device, non_blocking=True)
        targets = targets.to(ctx.device, non_blocking=True)
        last = i == len(micro) - 1
        with _NULL if last else prep.no_sync():
            autocast = torch.autocast(ctx.device.type, dtype=autocast_dtype) if autocast_dtype is not None else _NULL
            # The phase markers let the trace analysis tell forward, backward and step collectives apart.
            with _marker("forward", profiled), probe.forward() if probe is not None else _NULL:
                with autocast:
                    logits = prep.model(inputs)
                loss = loss_fn(logits, targets)
                # Not held through backward (torchtitan's `del pred`): the step's largest activation, which autograd
                # does not keep (cross entropy saves its own output); held, it raised the backward's peak by its size.
                del logits
            clock.lap("forward")
            scaled = loss / loss_divisor
            with _marker("backward", profiled):
                prep.backward(scaler.scale_loss(scaled) if scaler is not None else scaled)
            clock.lap("backward")
        losses.append(loss.detach())
    # One micro-batch (the common case) adds no op to the step; several are summed once, after the last backward.
    return losses[0] if len(losses) == 1 else torch.stack(losses).sum()


def _unscale(prep: Prepared, scaler: LossScaler | None) -> bool:
    """With fp16 loss scaling, unscale the gradients, update the scale and return whether they are
    finite on every rank (False: skip this step). Without a scaler, return True."""
    if scaler is None:
        return True
    assert prep.optimizer is not None
    finite = scaler.unscale_and_check(prep.optimizer)
    scaler.update(finite)
    return finite


def write_memory(prep: Prepared, ctx: RankContext, writer: events.RecordWriter, step: int, when: str) -> None:
    """Write a ``memory`` record: exact local model-state bytes plus allocator/RSS figures."""
    states = prep.model_state_bytes()
    total = sum(states.get(k, 0) for k in ("param_bytes", "grad_bytes", "optim_bytes"))
    writer.write(events.MEMORY, step=step, when=when, **states, model_state_bytes=total, **device_memory(ctx.device))
