"""The next run's torchrun agent, started ahead of its run (``launch.prestart``, on by default).

A run's launch pays torchrun's own start-up first: its agent imports torch before it spawns a rank (1.5-2.5 s on
a 2-core VM, the same on every run). ``Warm`` starts ``python -m shardscope.engines.agent`` early, with the
environment a launch would give it; the agent imports torchrun, creates its ready file and sleeps. When the run
is due, ``Warm.launch`` writes the launch plan's torchrun arguments, environment, directory and console file to
the agent's standard input and the agent calls ``torch.distributed.run.main`` with them: the same torchrun job a
cold launch starts, only without the wait for the import.

When: ``worth_starting`` says whether the next run's agent may start beside this launch. Beside a cold launch,
its import takes a core that this run's own agent leaves idle (the ranks do not exist yet); beside a launch that
used an agent started ahead, the ranks spawn at once, so only where the machine has a core more than this node's
ranks. Never beside measured steps: this run's ranks wait for the agent's ready file before their first step
(``engines.watchdog.wait_for_warm_agent``), and afterwards the agent only sleeps.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from dataclasses import dataclass

import psutil

from shardscope.config import Comparison
from shardscope.core.bounded import child_env
from shardscope.core import model_facts, registry
from shardscope.core.events import WARM_AGENT_ENV
from shardscope.orchestrator import launcher, lifeline

AGENT_MODULE = "shardscope.engines.agent"
# What a forked rank needs of any strategy: torch's compiler front end (imported by every torch optimizer's and
# DDP's or FSDP's constructor: 1.3-1.8 s on a 2-core VM) and the worker with its own imports.
RANK_MODULES = ("torch._dynamo", "shardscope.engines.worker", "shardscope.engines.rank")


def fork_ranks(start_method: str, device: str, deepspeed: bool = False) -> bool:
    """Whether torchrun forks the ranks from a preloaded agent (``launch.start_method``): ``fork``; ``exec``
    (each rank a new interpreter); ``auto``, fork, except a DeepSpeed run (``deepspeed``) on CUDA: forked torch
    ranks were checked on an H200 (``tests/test_fork_cuda.py``), DeepSpeed's were not (not on that machine)."""
    return start_method == "fork" or (start_method == "auto" and not (deepspeed and device != "cpu"))


def forks(comparison: Comparison, run: str, device: str) -> bool:
    """Whether ``run``'s ranks are forked from its agent (``fork_ranks`` for its strategy)."""
    info = registry.get(comparison.run(run).strategy)
    return fork_ranks(comparison.launch.start_method, device, info.needs_deepspeed)


# What a forked rank needs to build a Hugging Face model: transformers' model classes (1.0-1.3 s a rank on a 2-core
# VM, 2026-11-29), then the family's own module (``hf_family``).
HF_MODULES = ("transformers.modeling_utils", "transformers.models.auto.modeling_auto")
# torch.compile's back end, which ``torch.compile`` imports when first called: by a run with ``compile = true``, and
# by ``deepspeed.initialize`` whatever the run (its Muon optimizer's module decorates functions with it): 1.1-2.2 s a
# rank on a 2-core VM (2026-11-29)
COMPILER_MODULES = ("torch._inductor.compile_fx",)


def hf_family(comparison: Comparison) -> str:
    """The modeling module of the comparison's Hugging Face family where the preset names it (a built-in
    ``hf_arch``, or the model check's description of a config.json), else ""."""
    kind = model_facts.hf_config_value(comparison.model, "model_type")
    return f"transformers.models.{kind}.modeling_{kind}" if isinstance(kind, str) and kind.isidentifier() else ""


def preload_for(comparison: Comparison, run: str, device: str) -> list[str] | None:
    """The modules an agent imports for the ranks it will fork for ``run``: ``RANK_MODULES``, the model's
    (``HF_MODULES`` and its family for a Hugging Face model), the compiler's where the run calls it
    (``COMPILER_MODULES``) and its strategy's own. DeepSpeed's only on CPU: its
    import probes the accelerator, which forked ranks on CUDA must do themselves (and DeepSpeed's ranks are not forked
    there unless the preset says so). A module that fails to import is the rank's to import and report. None where
    ranks are not forked (``fork_ranks``)."""
    if not forks(comparison, run, device):
        return None
    spec = comparison.run(run)
    info = registry.get(spec.strategy)
    own = [] if info.needs_deepspeed and device != "cpu" else [info.entry.partition(":")[0]]
    model = [*HF_MODULES, *filter(None, [hf_family(comparison)])] if comparison.model.kind == "hf" else []
    compiler = list(COMPILER_MODULES) if spec.compile or (own and info.needs_deepspeed) else []
    return [*RANK_MODULES, *model, *compiler, *own]


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, which a cgroup or taskset narrows), else the count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def worth_starting(*, cold: bool, local_ranks: int, cpus: int) -> bool:
    """Whether the next run's agent may start beside this run's launch (see the module docstring)."""
    return cpus >= 2 if cold else cpus > local_ranks


@dataclass
class Warm:
    """A torchrun agent waiting for its launch order."""

    popen: subprocess.Popen
    ready_path: str
    create_time: float

    def gate_env(self) -> dict[str, str]:
        """Environment that makes the run going on wait, before its first step, until this agent is ready."""
        return {WARM_AGENT_ENV: f"{self.popen.pid}:{self.create_time:.3f}:{self.ready_path}"}

    def launch(self, plan: launcher.LaunchPlan) -> launcher.RunProcess | None:
        """Start ``plan``'s torchrun job in this agent; None when the agent is gone (start it cold instead).

        The plan's command must be ``python -m torch.distributed.run ARGS``: the agent runs exactly ARGS."""
        args = torchrun_args(plan.argv)
        order = {"args": list(args), "env": launcher.launch_env(plan), "cwd": plan.cwd,
                 "console": plan.console_path}
        if self.popen.poll() is not None:  # it died (its import failed, a kill): the caller starts it cold
            self.discard()
            return None
        try:
            os.makedirs(os.path.dirname(plan.console_path), exist_ok=True)
            with open(plan.console_path, "ab") as log:  # the line a cold launch writes: the command to run by hand
                log.write(f"$ {plan.shell_line()}\n".encode())
        except OSError:  # a full disk, say: the caller's verdict; this agent goes now, not with the session
            self.discard()
            raise
        try:
            assert self.popen.stdin is not None
            self.popen.stdin.write((json.dumps(order) + "\n").encode())
            self.popen.stdin.close()
        except (BrokenPipeError, OSError):
            self.discard()
            return None
        self._forget_ready()
        return launcher.RunProcess(plan=plan, popen=self.popen)

    def discard(self) -> None:
        """End an agent that will not be used (it never started a rank: nothing to stop gracefully)."""
        try:
            if self.popen.stdin is not None and not self.popen.stdin.closed:
                self.popen.stdin.close()
        except OSError:
            pass
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        self._forget_ready()

    def _forget_ready(self) -> None:
        _remove(self.ready_path)


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):  # gone already, or never written
        os.remove(path)


def torchrun_args(argv: tuple[str, ...]) -> tuple[str, ...]:
    """The arguments after ``python -m torch.distributed.run`` in a launch plan's command."""
    head = ("-m", "torch.distributed.run")
    if tuple(argv[1:3]) != head:
        raise ValueError(f"not a torchrun command: {argv[:3]}")
    return tuple(argv[3:])


def start(python: str, ready_path: str, env: dict[str, str], cwd: str, modules: list[str] | tuple = ()) -> Warm:
    """Start an agent ahead of its run, with ``env`` added to this process's environment; it imports ``modules``
    after torchrun (``preload_for``, for ranks it forks).

    Call it from the thread that launches runs: like torchrun, the agent gets its parent-death signal when
    that thread ends (``lifeline.die_with_parent``); it also ends at the end of its input."""
    _remove(ready_path)  # one left by an orchestrator that was killed: not this agent's
    popen = subprocess.Popen(
        [python, "-m", AGENT_MODULE, ready_path, *modules],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=cwd,
        env=child_env({**os.environ, **env, **lifeline.rank_env()}),
        start_new_session=True,  # its own process group, as a cold launch's torchrun
        preexec_fn=lifeline.die_with_parent(),
    )
    try:
        created = psutil.Process(popen.pid).create_time()
    except psutil.Error:  # gone already: the gate lets the run train (no such process)
        created = 0.0
    return Warm(popen=popen, ready_path=ready_path, create_time=created)


def launch_cold(plan: launcher.LaunchPlan, python: str, ready_path: str, modules: list[str]) -> launcher.RunProcess:
    """Start ``plan`` now through an agent that preloads ``modules`` for the ranks torchrun forks (its order is
    written at once; it reads it once its imports are done). Where no agent runs it, torchrun is started as such."""
    try:
        warm = start(python, ready_path, plan.env, plan.cwd, modules)
    except OSError:  # no process to spare for it: torchrun itself, whose ranks then import what they need
        return launcher.start(plan)
    try:
        return warm.launch(plan) or launcher.start(plan)
    except BaseException:
        warm.discard()
        raise
