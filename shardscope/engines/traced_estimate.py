"""Traced memory estimate: one rank of a run at any world size, on a fake process group, with fake tensors.

``shardscope estimate --traced`` runs this module once per run (a subprocess, so the command
line stays torch-free). It does what a real rank would do, with nothing real allocated: torch's
fake process group (``backend="fake"``: collectives return at once) stands in for the other
ranks, ``FakeTensorMode`` gives every tensor a shape, dtype and device but no storage; the
registered strategy's own ``apply`` shards the model; two training steps (forward, loss,
backward, optimizer step) run under torch's ``MemTracker`` (``FSDPMemTracker`` for FSDP2
modules), which counts every tensor alive by category. The result is rank 0's model-state
bytes and its peak, split by category, at a world size this machine does not have.

Where it applies: strategies whose ``apply`` runs on a fake process group with fake tensors
(the registry's ``traceable`` flag). Clipping is left out of the traced steps (the global norm is
read back as a number, which fake tensors do not have); its temporaries are one scalar per tensor.

    python -m shardscope.engines.traced_estimate SPEC.json      # prints one JSON object
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardscope.config import Comparison
from shardscope.core import registry
from shardscope.engines.api import RankContext
from shardscope.engines.data import build_batches
from shardscope.engines.loop import loss_fn, loop_autocast_dtype
from shardscope.engines.model import build_model, resolve
from shardscope.engines.worker import train_settings


def rank0_context(world_size: int, tp: int, device: str = "cpu", backend: str = "fake") -> RankContext:
    """Initialise a process group of ``world_size`` as rank 0 and return its RankContext (the same mesh layout as
    ``worker.init_distributed``: ("dp",) or ("dp", "tp")) on ``device`` ("cpu", or "cuda": the compute probe on a
    GPU). ``backend`` "fake": torch's fake group, whose collectives return at once; "gloo" or "nccl" at world size
    1: a real group of one (the compute probe's one-rank runs: their collectives cost what the run's own do)."""
    if backend == "fake":
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    elif world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        raise ValueError(f"a real {backend} group stands in for a run of world size 1 only, not {world_size}")
    if device == "cuda":
        torch.cuda.set_device(0)
    dp = world_size // tp
    if tp > 1:
        mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))
        dp_group, tp_group = mesh.get_group("dp"), mesh.get_group("tp")
        _ = mesh["dp"], mesh["tp"]  # slice now: slicing computes coordinates, which fake tensors cannot
    else:
        mesh = init_device_mesh(device, (dp,), mesh_dim_names=("dp",))
        dp_group, tp_group = mesh.get_group("dp"), None
    where = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    return RankContext(rank=0, world_size=world_size, local_rank=0, device=where, backend=backend,
                       dp_size=dp, dp_rank=0, tp_size=tp, tp_rank=0, mesh=mesh, dp_group=dp_group, tp_group=tp_group)


def _tracker(model: torch.nn.Module, optimizer: Any) -> Any:
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return FSDPMemTracker(model, optimizer)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, *([optimizer] if optimizer is not None else []))
    return tracker


def _by_category(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for per_device in snapshot.values():
        for key, value in per_device.items():
            name = getattr(key, "value", str(key))
            out[name] = out.get(name, 0) + int(value)
    return out


# Tracker categories -> shardscope's model-state terms (FSDP2's sharded figures are what stays resident).
_STATE_TERMS = {
    "param_bytes": ("Parameter", "Sharded Param"),
    "grad_bytes": ("Gradient", "Sharded Grad"),
    "optim_bytes": ("Optstate", "OptState"),
}


def trace(spec: dict[str, Any]) -> dict[str, Any]:
    """Trace two training steps of ``spec``'s run on rank 0 of a fake process group; return
    ``{"steady": {...}, "peak": {...}, "param_bytes", "grad_bytes", "optim_bytes",
    "model_state_bytes", "peak_bytes"}`` (bytes by tracker category, then shardscope's terms)."""
    comparison = Comparison.from_dict({**spec["comparison"], "runs": []})
    run = spec["run"]
    ctx = rank0_context(int(run["world_size"]), int(run["tp"]))
    settings = train_settings(comparison, run, ctx.dp_size)
    micro_batches, _ = build_batches(comparison, ctx.dp_size, ctx.dp_rank)
    real_inputs, real_targets = micro_batches(0)[0]
    # Non-fake inputs allowed: the device mesh holds a real (tiny) tensor of rank ids.
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        model = build_model(comparison.model, comparison.seed)
        prep = resolve(registry.get(run["strategy"]).entry)(model, ctx, settings, dict(run["options"]))
        autocast_dtype = loop_autocast_dtype(settings.precision, prep.handles_precision)
        inputs, targets = mode.from_tensor(real_inputs), mode.from_tensor(real_targets)
        tracker = _tracker(prep.model, prep.optimizer)
        if hasattr(tracker, "track_inputs"):  # FSDPMemTracker counts the batch as "Inputs"
            tracker.track_inputs((inputs,))
        with tracker:
            for step in range(2):  # the second step holds optimizer state from the start: the steady state
                if prep.zero_grad is not None:
                    prep.zero_grad()
                autocast = torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None)
                with autocast:
                    logits = prep.model(inputs)
                loss = loss_fn(logits, targets)
                del logits  # as the training loop does: not held through backward
                prep.backward(loss)
                if prep.optimizer is not None:
                    prep.optimizer.step()
                if step == 0:
                    tracker.reset_mod_stats()
            steady = _by_category(tracker.get_tracker_snapshot("current"))
        peak = _by_category(tracker.get_tracker_snapshot("peak"))
    out: dict[str, Any] = {"steady": steady, "peak": peak}
    for term, keys in _STATE_TERMS.items():
        out[term] = sum(steady.get(k, 0) for k in keys)
    out["model_state_bytes"] = out["param_bytes"] + out["grad_bytes"] + out["optim_bytes"]
    out["peak_bytes"] = peak.get("Total", sum(peak.values()))
    dist.destroy_process_group()
    return out


def spec_main(argv: list[str] | None, fn: Callable[..., dict[str, Any]]) -> int:
    """The entry point of a one-rank helper (this module, ``compute_probe``): read the spec JSON named by
    ``argv[0]`` (``sys.argv`` when None), call ``fn(spec, *argv[1:])`` and print its result as one JSON line."""
    args = sys.argv[1:] if argv is None else argv
    with open(args[0], encoding="utf-8") as fh:
        spec = json.load(fh)
    print(json.dumps(fn(spec, *args[1:])))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: trace the spec in ``argv[0]`` and print the result as one JSON line."""
    return spec_main(argv, trace)


if __name__ == "__main__":
    sys.exit(main())
