"""The entry point of every rank: ``torchrun ... -m shardscope.engines.worker <run_dir>/spec.json`` (a rank forked
from a preloaded agent runs it through ``engines/rank.py``).

Reads the spec (``config.run_spec_payload``), initialises the process group (gloo on CPU, NCCL on
CUDA) and the device mesh (1-D ``dp`` or 2-D ``dp x tp``), builds the model, loads the shared
initial weights, applies the strategy looked up lazily through the registry, runs the shared loop
and writes records to ``<run_dir>/metrics/rank<R>.jsonl``.

Any exception becomes an ``error`` record (one-line message and full traceback) and an ``end``
record with status "failed", then a non-zero exit. SIGTERM becomes ``end`` status "stopped".
The process group is always destroyed.
"""

from __future__ import annotations

import time

_T_ENTRY = time.time()  # before the imports: where a rank's start-up goes (the start record's ``startup``)

import datetime
import importlib.metadata
import json
import os
import platform
import signal
import socket
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from shardscope.core import events, record_secret, record_wire
from shardscope.config import Comparison
from shardscope.core import registry
from shardscope.engines.api import RankContext, TrainSettings
from shardscope.engines import failure, settings_code
from shardscope.engines.data import build_batches
from shardscope.engines.faults import Fault
from shardscope.engines.init_weights import content_sha256, ensure_init
from shardscope.engines.loop import LoopConfig, train
from shardscope.engines.module_probe import ModuleProbe
from shardscope.engines.model import build_model, count_parameters, resolve
from shardscope.engines.precision import policy_for
from shardscope.engines.watchdog import OrchestratorWatch, wait_for_previous_run, wait_for_warm_agent
from shardscope.engines.comm_count import CountWindow
from shardscope.engines.capture import ProfilerWindow
from shardscope.engines.stall_dump import StallDump
from shardscope.core.rundir import SPEC, RunFiles

_T_IMPORTED = time.time()
EXIT_FAILED, EXIT_STOPPED = 1, 143
SPARE_BYTES = 64 << 10  # room for the last records (error + end with a traceback) on a full disk


class Stopped(BaseException):
    """Raised in the main thread by the SIGTERM handler (BaseException: no ``except Exception`` eats it)."""


_STOP_REQUESTED = False


def _on_sigterm(signum: int, frame: Any) -> None:
    global _STOP_REQUESTED
    _STOP_REQUESTED = True
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills outright
    raise Stopped()


def versions() -> dict[str, str]:
    """Return the versions of Python, torch and the optional libraries present (without importing them)."""
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for dist_name in ("deepspeed", "transformers", "safetensors"):
        try:
            out[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def device_name(device: torch.device) -> str:
    """Return the accelerator's marketing name (for MFU's peak table), or the CPU model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def init_distributed(spec: dict[str, Any]) -> RankContext:
    """Initialise the process group and device mesh from torchrun's environment; return the RankContext.

    Raises ValueError when the launched world size differs from the spec's, or dp x tp does not match.
    """
    run, comparison = spec["run"], spec["comparison"]
    cuda = spec["device"] == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    # Long enough for slow first steps (compile, big all-gathers); a hung peer is the orchestrator's
    # stall timeout to catch, this only bounds how long a surviving rank blocks in a collective.
    timeout = datetime.timedelta(seconds=max(300.0, 2 * float(comparison.get("stall_timeout_s", 120))))
    dist.init_process_group(backend, timeout=timeout, device_id=device if cuda else None)
    world, rank = dist.get_world_size(), dist.get_rank()
    tp, dp, pp = int(run["tp"]), int(run["dp"]), int(run.get("pp", 1))
    if world != run["world_size"] or dp * tp * pp != world:
        raise ValueError(f"launched world size {world} does not match the spec: world_size {run['world_size']}, "
                         f"dp {dp} x tp {tp} x pp {pp}")
    if pp > 1:  # consecutive ranks form one pipeline; the dp dimension joins the same stage of every pipeline
        mesh = init_device_mesh(device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
        return RankContext(rank=rank, world_size=world, local_rank=local_rank, device=device, backend=backend,
                           dp_size=dp, dp_rank=mesh.get_local_rank("dp"), mesh=mesh, dp_group=mesh.get_group("dp"),
                           pp_size=pp, pp_rank=mesh.get_local_rank("pp"), pp_group=mesh.get_group("pp"))
    if tp > 1:
        mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
        dp_group, tp_group = mesh.get_group("dp"), mesh.get_group("tp")
        dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    else:
        mesh = init_device_mesh(device.type, (dp,), mesh_dim_names=("dp",))
        dp_group, tp_group, dp_rank, tp_rank = mesh.get_group("dp"), None, rank, 0
    return RankContext(rank=rank, world_size=world, local_rank=local_rank, device=device, backend=backend,
                       dp_size=dp, dp_rank=dp_rank, tp_size=tp, tp_rank=tp_rank, mesh=mesh,
                       dp_group=dp_group, tp_group=tp_group)


def train_settings(comparison: Comparison, run: dict[str, Any], dp: int) -> TrainSettings:
    """Return the TrainSettings for ``run`` in ``comparison`` (micro-batch = global / (dp x accum))."""
    return TrainSettings(
        lr=comparison.lr, weight_decay=comparison.weight_decay, grad_clip=comparison.grad_clip,
        grad_accum=comparison.grad_accum, micro_batch_size=comparison.global_batch // (dp * comparison.grad_accum),
        steps=comparison.steps, warmup_steps=comparison.warmup_steps, precision=policy_for(run["precision"]),
        activation_checkpointing=bool(run.get("activation_checkpointing")), compile=bool(run.get("compile")),
        schedule_steps=comparison.schedule_steps,
        grad_accum_loss=str(run["options"].get("grad_accum_loss", registry.LOOP_OPTIONS["grad_accum_loss"].default)),
    )


def process_start_time(pid: int | str = "self") -> float | None:
    """Process ``pid``'s start (epoch seconds; this process by default), from the kernel; None where it
    cannot be read.

    ``/proc/<pid>/stat``'s start time counts clock ticks since boot; its distance from now on the boot clock
    places it in epoch seconds to a tick. (psutil adds the ticks to ``/proc/stat``'s boot time, which is in
    whole seconds: its start time is up to 1 s early, and the start record's ``process`` stage read 0.45 s
    that Python's own start-up never took.)"""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            ticks = int(fh.read().rsplit(b")", 1)[1].split()[19])
        since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since_start
    except (OSError, ValueError, IndexError, AttributeError):  # no procfs (or no boot clock): not measured
        return None


def run_rank(spec: dict[str, Any], ctx: RankContext, writer: events.RecordWriter, cfg: LoopConfig,
             marks: dict[str, float | None] | None = None) -> None:
    """Build, load, apply the strategy and train on this rank, filling in ``cfg``. Exceptions propagate.

    ``marks`` (epoch seconds by stage: process start, imports done, process group ready) gets the model,
    strategy and batch stages added and goes into the start record as ``startup``."""
    marks = dict(marks or {})
    comparison = Comparison.from_dict({**spec["comparison"], "runs": []})
    run = spec["run"]
    torch.manual_seed(comparison.seed)  # any runtime randomness is identical across runs
    settings = train_settings(comparison, run, ctx.dp_size)
    model = build_model(comparison.model, comparison.seed)
    # identical on every rank and in every run; the first run's local rank 0 writes them
    ensure_init(model, comparison, spec["init_path"], write=ctx.local_rank == 0, barrier=dist.barrier)
    init_sha256 = content_sha256(model)  # of the values, before any strategy touches them
    n_params = count_parameters(model)
    model.to(ctx.device)
    marks["model"] = time.time()
    info = registry.get(run["strategy"])
    blocks = settings_code.blocks_of_model(model)  # where its blocks sit, before a strategy wraps it
    # The loop's options (registry.LOOP_OPTIONS) are the loop's: the strategy gets its own.
    prep = resolve(info.entry)(model, ctx, settings,
                               {k: v for k, v in run["options"].items() if k not in registry.LOOP_OPTIONS})
    if int(run.get("probe_step", -1)) >= 0:  # shardscope why's re-runs only: no hook exists otherwise
        cfg.probe = ModuleProbe(prep, ctx, probe_step=int(run["probe_step"]), grads=info.probe_grads)
    marks["strategy"] = time.time()
    micro_batches, source = build_batches(comparison, ctx.dp_size, ctx.dp_rank, ahead=True)  # no step waits for data
    marks["batches"] = time.time()
    if wait_for_previous_run():  # launched while the previous run tore down: train once it is gone
        marks["previous_run_gone"] = time.time()
    ready = wait_for_warm_agent()  # the next run's agent, started beside this start-up: train once it sleeps
    if ready is not None:
        marks["next_agent_ready"] = ready
    prof = comparison.profile
    window = ProfilerWindow(spec["run_dir"], ctx.rank, enabled=prof.enabled, start_step=prof.start_step,
                            steps=prof.steps, total_steps=comparison.steps, record_shapes=prof.record_shapes,
                            cuda=ctx.device.type == "cuda", profile_memory=prof.profile_memory)
    writer.write(events.START, spec=run, world_size=ctx.world_size, device=str(ctx.device), backend=ctx.backend,
                 device_name=device_name(ctx.device), host=socket.gethostname(), init_sha256=init_sha256,
                 versions=versions(), precision=settings.precision.describe(), params=n_params,
                 dp=ctx.dp_size, tp=ctx.tp_size, **({"pp": ctx.pp_size} if ctx.pp_size > 1 else {}),
                 micro_batch_size=settings.micro_batch_size,
                 grad_accum=settings.grad_accum, notes=prep.notes,
                 **settings_code.start_field(prep, settings, strategy=run["strategy"], blocks=blocks, ctx=ctx),
                 straggler={"threshold": comparison.straggler_threshold, "window": comparison.straggler_window},
                 startup=marks, forked=bool(marks.get("process")) and _T_IMPORTED < marks["process"])
    cfg.global_batch, cfg.tokens_per_sample = comparison.global_batch, source.tokens_per_sample
    cfg.min_lr_ratio, cfg.parity, cfg.log_every = comparison.min_lr_ratio, comparison.parity, comparison.log_every
    fault = Fault.parse(run.get("fault", ""), writer)
    cfg.fault, cfg.profiler = fault.prepare() if fault else None, window
    cfg.counter = CountWindow(enabled=window.enabled and prof.count_collectives, start_step=prof.start_step,
                              steps=prof.steps, total_steps=comparison.steps)
    cfg.stop_on_nonfinite = comparison.on_nonfinite == "stop"
    try:
        train(prep, ctx, settings, cfg, micro_batches, writer)
    except BaseException:
        try:  # a profiler that cannot stop cleanly must not hide why training ended
            window.close()
            cfg.counter.close()
        except Exception:  # noqa: BLE001
            pass
        raise
    window.close()


def write_failure(writer: events.RecordWriter, exc: BaseException, rank: int, steps_completed: int) -> None:
    """Print the traceback to stderr and write the ``error`` and ``end`` (failed) records.

    The message names out of memory (with rank and step) and a full or unwritable disk (with the
    path) rather than the exception type alone; on a disk fault the writer's spare is freed first,
    so that these last records fit. A console that cannot be written either is not an error.
    """
    message, cause = failure.describe(exc, rank, steps_completed)
    text = traceback.format_exc()
    if cause == failure.DISK:
        writer.release_spare()
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:
        pass
    try:
        writer.write(events.ERROR, message=message, cause=cause, step=steps_completed, traceback=text,
                     host=socket.gethostname())
        writer.write(events.END, status="failed", steps_completed=steps_completed)
    except OSError:  # nothing more can be recorded; the orchestrator diagnoses the output directory
        pass


def write_stopped(writer: events.RecordWriter, steps_completed: int, watch: OrchestratorWatch) -> None:
    """Write ``end`` stopped; its reason says when the orchestrator was lost. A full disk is not an error."""
    reason = {"reason": events.ORCHESTRATOR_LOST} if watch.lost() else {}
    try:
        writer.write(events.END, status="stopped", steps_completed=steps_completed, **reason)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    """Run one rank; return its exit code (0 ok, 1 failed, 143 stopped, 2 bad usage)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: torchrun ... -m shardscope.engines.worker <run_dir>/{SPEC}", file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8") as fh:
        spec = json.load(fh)
    rank = int(os.environ.get("RANK", "0"))
    signal.signal(signal.SIGTERM, _on_sigterm)
    watch = OrchestratorWatch()
    watch.start(exit_code=EXIT_STOPPED)  # a rank never outlives its orchestrator
    writer = events.RecordWriter(RunFiles(spec["run_dir"]).rank_file(rank), spec["run"]["name"],
                                 rank, spare_bytes=SPARE_BYTES)
    code = 0
    cfg = LoopConfig(global_batch=0, tokens_per_sample=0, min_lr_ratio=0.0)  # filled in by run_rank
    stall = StallDump(RunFiles(spec["run_dir"]).stall_request, lambda **f: writer.write(events.STALL, **f),
                      lambda: cfg.steps_completed)
    stall.start()  # a stalled run's orchestrator asks every rank where it is
    try:
        if os.environ.get(record_wire.ENV):  # a node without node 0's filesystem: records also go over TCP
            writer.forward_to(os.environ[record_wire.ENV],  # the secret bound to this comparison, as node 0 binds it
                              secret=record_secret.comparison_key(record_secret.secret_from_env(), spec["comparison"]))
        # "agent": torchrun's agent (this rank's parent), which started ahead of its run when prestarted
        # A rank forked from a preloaded agent (engines/rank.py) imported nothing itself: its entry is its start.
        started = process_start_time() or 0.0
        marks = {"agent": process_start_time(os.getppid()), "process": started or None,
                 "entry": max(_T_ENTRY, started), "imported": max(_T_IMPORTED, started)}
        ctx = init_distributed(spec)
        marks["process_group"] = time.time()
        run_rank(spec, ctx, writer, cfg, marks)
    except (Stopped, KeyboardInterrupt):  # SIGTERM from the orchestrator or torchrun; Ctrl-C in a terminal
        write_stopped(writer, cfg.steps_completed, watch)
        code = EXIT_STOPPED
    except BaseException as exc:  # noqa: BLE001 - recorded, then the rank exits non-zero
        # A peer stopped first (or the orchestrator is gone) and broke our collective: a stop, not a failure.
        if _STOP_REQUESTED or watch.lost():
            write_stopped(writer, cfg.steps_completed, watch)
            code = EXIT_STOPPED
        else:
            write_failure(writer, exc, rank, cfg.steps_completed)
            code = EXIT_FAILED
    finally:
        stall.stop()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # do not interrupt the cleanup
        if dist.is_initialized():
            dist.destroy_process_group()
        writer.close()
    return code


def exit_now(code: int) -> None:
    """Leave without interpreter finalization, once records are flushed and the process group is gone.

    gloo's C++ worker threads can still be alive while the interpreter tears down; destroying them then
    aborts the process (SIGABRT, "terminate called without an active exception") after a run that had
    finished and written its ``end`` record (seen here intermittently with torch 2.13 and gloo; see
    pytorch/pytorch#179291). Skipping finalization keeps a finished run finished.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a console on a full disk
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())

