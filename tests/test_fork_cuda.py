"""Ranks forked from a preloaded agent on CUDA (``launch.start_method = fork``): the agent's imports must not
initialise CUDA (a child forked from a process that did cannot use the GPU), and a forked rank must train as a new
interpreter does. Needs a GPU (skipped without one: CI has none)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardscope.core import events
from shardscope.orchestrator import prestart

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def test_the_agents_preload_leaves_cuda_uninitialised():
    """What an agent imports before torchrun forks the ranks (torchrun, dynamo, the worker, every torch strategy's
    module) in a fresh interpreter: CUDA is not initialised afterwards."""
    from shardscope.core import registry

    modules = [*prestart.RANK_MODULES] + sorted({registry.get(n).entry.partition(":")[0] for n in registry.names()
                                                 if not registry.get(n).needs_deepspeed})
    code = ("import importlib, sys, torch.distributed.run, torch\n"
            "for m in sys.argv[1:]: importlib.import_module(m)\n"
            "print(torch.cuda.is_available(), torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False"], (modules, out.stdout)


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
