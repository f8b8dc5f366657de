"""Ranks forked from a preloaded agent on CUDA (``launch.start_method = fork``): nothing the agent does before
torchrun forks the ranks may leave them unable to use the GPU, and a forked rank must train as a new interpreter
does. Needs a GPU (skipped without one: CI has none)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shardscope.core import events, registry
from shardscope.orchestrator import launcher, prestart

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

# What an agent does before torchrun forks a rank: import torchrun and the preloaded modules, build torchrun's
# LaunchConfig (which asks torch.cuda.is_available()); then a fork that uses the GPU, as a rank does.
AGENT_THEN_FORK = """
import importlib, os, sys
import torch, torch.distributed.run
from torch.distributed.launcher.api import LaunchConfig
for m in sys.argv[1:]:
    importlib.import_module(m)
LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1)
pid = os.fork()
if pid == 0:
    try:
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        os._exit(0)
    except Exception as err:
        print(err, flush=True)
        os._exit(3)
print("child", os.waitpid(pid, 0)[1] >> 8, "initialised", torch.cuda.is_initialized())
"""


def _agent_then_fork(env_extra):
    modules = [*prestart.RANK_MODULES] + sorted({registry.get(n).entry.partition(":")[0] for n in registry.names()
                                                 if not registry.get(n).needs_deepspeed})
    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", AGENT_THEN_FORK, *modules], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_ranks_forked_after_the_agents_imports_and_torchruns_checks_can_use_the_gpu():
    """With the ranks' environment (``launcher.worker_env``) a child forked after everything the agent does uses
    the GPU; with torch's runtime-based availability check (the variable off) the same child cannot: the
    variable is what makes forking on CUDA work."""
    assert "child 0 initialised False" in _agent_then_fork(launcher.worker_env("cuda"))
    broken = _agent_then_fork({**launcher.worker_env("cuda"), launcher.NVML_CHECK_ENV: "0"})
    assert "child 3" in broken and "forked subprocess" in broken


def _run(tmp_path, method):
    out = tmp_path / method
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "run", "--preset", "smoke", "--headless",
                           "--out", str(out), "--set", "world_size=1", "--set", "steps=8",
                           "--set", "launch.device='cuda'", "--set", f"launch.start_method='{method}'"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


def test_a_forked_rank_trains_on_cuda_as_a_new_interpreter_does(tmp_path):
    """The smoke comparison on the GPU, ranks forked and ranks exec'd: every run passes, the start records say
    which, and each step's loss agrees to 1e-5 between the two launches (same weights, tokens, device)."""
    forked, execd = _run(tmp_path, "fork"), _run(tmp_path, "exec")
    for out, was_forked in ((forked, True), (execd, False)):
        for run in ("ddp", "fsdp2"):
            records, _ = events.read_records(out / run / "metrics" / "rank0.jsonl")
            start = records[0]
            assert start["forked"] is was_forked and str(start["device"]).startswith("cuda"), start
    for run in ("ddp", "fsdp2"):
        got = [{r["step"]: r["local_loss"] for r in events.read_records(out / run / "metrics" / "rank0.jsonl")[0]
                if r["kind"] == "step"} for out in (forked, execd)]
        assert got[0].keys() == got[1].keys() and len(got[0]) == 8
        for step, loss in got[0].items():
            assert loss == pytest.approx(got[1][step], rel=1e-5, abs=1e-6), (run, step)
