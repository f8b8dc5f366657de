"""Why's module probe: on the steps up to a re-run's ``probe_step``, every module's forward output and the
gradients of its own parameters, each as a norm, two random projections and an exact hash.

Installed by the worker only when a run's ``probe_step`` >= 0 (``shardscope why``'s re-runs of the baseline and
of the run it explains); otherwise no hook exists and the loop tests ``cfg.probe is None`` once per step.

- Forward outputs are this rank's (its slice of the batch, made whole when a DTensor): the record carries its
  data- and tensor-parallel ranks and the analysis compares rank with rank (same world size, same slices). Only
  what runs inside ``forward()`` is recorded, so activation checkpointing's recomputation in backward is not.
- Gradients are full tensors as the optimizer will use them (reduced, before clipping), read the way the registry
  declares for the strategy (``probe_grads``): "tensors" (``.grad``, a DTensor made whole) right after backward,
  "summon" (FSDP1's ``summon_full_params(with_grads=True)``) right after backward, "deepspeed" (gathered with
  ``safe_get_full_grad``) right after DeepSpeed's reduction inside its step. Every rank
  computes them (gathering is a collective); rank 0 writes them.
- A fingerprint: the L2 norm, projections on two fixed pseudo-random vectors (the same in both runs: a difference
  ``e`` moves a projection by about ``|e|``, where two norms can agree while the tensors differ) and a blake2b
  hash of the bytes (bitwise equality). Micro-batches add up (squares, projections) and chain (hash).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from typing import Any, Iterator

import torch
from torch import nn

from shardscope.core import events
from shardscope.engines.api import Prepared, RankContext
from shardscope.engines.comm_count import instrumentation
from shardscope.engines.global_grad import full_value
from shardscope.engines.norms import strip_wrappers

PROBE_BACK = 7  # steps probed before probe_step: probe_step - 7 .. probe_step
PROJECTIONS = 2
SEED = 20240521
FLAT_SHARDS = "not probed: this strategy keeps its gradients in flat shards (probe_grads in the registry)"


class Fingerprint:
    """A tensor's (or several tensors') norm, projections and hash, added up over micro-batches."""

    def __init__(self) -> None:
        self.squares = 0.0
        self.projections = [0.0] * PROJECTIONS
        self.digest = hashlib.blake2b(digest_size=8)
        self.numel = 0
        self.dtype = ""

    def add(self, tensor: torch.Tensor) -> None:
        """Fold in one tensor (a DTensor is made whole first: a collective)."""
        t = full_value(tensor.detach())
        x = t.float().reshape(-1)
        gen = torch.Generator(device=x.device)
        gen.manual_seed(SEED + self.numel)  # by position: both runs draw the same vectors for the same elements
        vectors = torch.randn(PROJECTIONS, x.numel(), generator=gen, device=x.device)
        values = torch.cat([x.pow(2).sum().reshape(1), vectors @ x]).tolist()  # one host sync
        self.squares += values[0]
        self.projections = [a + b for a, b in zip(self.projections, values[1:])]
        self.digest.update(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
        self.numel += x.numel()
        self.dtype = str(t.dtype).replace("torch.", "")

    def entry(self, name: str) -> list[Any]:
        """``[name, norm, [projections], hash, numel, dtype]``, as the probe record carries it."""
        return [name, math.sqrt(self.squares), self.projections, self.digest.hexdigest(), self.numel, self.dtype]


def probed_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module of ``model`` but the root, keyed by its name without wrapper parts; the outermost of modules that
    share a key (a checkpoint or FSDP wrapper and what it wraps) stands for them."""
    seen: set[str] = set()
    out = []
    for name, module in model.named_modules():
        key = strip_wrappers(name)
        if key and key not in seen:
            seen.add(key)
            out.append((key, module))
    return out


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


class ModuleProbe:
    """Hooks on every module of a prepared model, recording on the probed steps only (``begin_step`` decides)."""

    def __init__(self, prep: Prepared, ctx: RankContext, *, probe_step: int, grads: str) -> None:
        self.ctx, self.mode = ctx, grads
        self.steps = range(max(0, probe_step - PROBE_BACK), probe_step + 1)
        self.modules = probed_modules(prep.model)
        self.recording = self.in_forward = False
        self.outputs: dict[str, Fingerprint] = {}
        self.grads: list[list[Any]] | None = None
        self.note = ""
        self.model = prep.model
        self.engine = prep.model if grads == "deepspeed" else None
        self._arm = None
        if self.engine is not None:
            from shardscope.engines.deepspeed_measure import after_reduction

            self._arm = after_reduction(self.engine, self._capture_grads)
        for key, module in self.modules:
            module.register_forward_hook(self._hook(key))

    def _hook(self, key: str) -> Any:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            tensor = _first_tensor(output) if self.in_forward else None
            if tensor is not None:
                with instrumentation():  # a DTensor output is gathered: shardscope's collective, not the strategy's
                    self.outputs.setdefault(key, Fingerprint()).add(tensor)
        return record

    def begin_step(self, step: int) -> None:
        """Start a step: record it when it is one of the probed steps."""
        self.recording = step in self.steps
        self.outputs, self.grads, self.note = {}, None, ""

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """The loop's forward pass of one micro-batch: module outputs are recorded inside it only."""
        self.in_forward = self.recording
        try:
            yield
        finally:
            self.in_forward = False

    def before_step(self, step: int) -> None:
        """Between backward and the optimizer step: read the gradients now, or arm DeepSpeed's reduction for them."""
        if not self.recording:
            return
        if self.mode == "tensors":
            self._capture_grads()
        elif self.mode == "summon":  # FSDP1 (use_orig_params): the original parameters, gathered with their grads
            from torch.distributed.fsdp import FullyShardedDataParallel

            try:
                with instrumentation(), FullyShardedDataParallel.summon_full_params(self.model, writeback=False,
                                                                                      with_grads=True):
                    self._capture_grads()
            except (AssertionError, ValueError, RuntimeError) as err:  # use_orig_params off: flat parameters only
                self.note = f"not probed: {err}".splitlines()[0][:200]
        elif self._arm is not None:
            self._arm()

    def _capture_grads(self) -> None:
        unscale = 1.0
        if self.engine is not None:
            from deepspeed.utils import safe_get_full_grad

            from shardscope.engines.deepspeed_measure import grad_unscale

            unscale = grad_unscale(self.engine)
        entries = []
        with instrumentation():
            for key, module in self.modules:
                found = Fingerprint()
                for _, p in module.named_parameters(recurse=False):
                    grad = safe_get_full_grad(p) if self.engine is not None else p.grad
                    if grad is not None:
                        found.add(grad * unscale if unscale != 1.0 else grad)
                if found.numel:
                    entries.append(found.entry(key))
        self.grads = entries

    def end_step(self, step: int, writer: events.RecordWriter) -> None:
        """Write this rank's ``probe`` record of a probed step (rank 0 adds the gradients)."""
        if not self.recording:
            return
        fields: dict[str, Any] = {"dp_rank": self.ctx.dp_rank, "tp_rank": self.ctx.tp_rank,
                                  "forward": [fp.entry(key) for key, fp in self.outputs.items()]}
        if self.ctx.rank == 0:
            if self.grads is not None:
                fields["grads"] = self.grads
            else:
                fields["grads_note"] = self.note or (FLAT_SHARDS if not self.mode else
                                                     "not probed: the step reduced no gradients")
        writer.write(events.PROBE, step=step, **fields)
        self.recording = False
