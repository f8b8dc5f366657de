"""The code a user pastes into their own training script to set a strategy up as a run set it up: "the settings".

Each strategy writes its part from the very values it passed to the library (the keyword arguments of
``fully_shard``, ``FSDP``, ``DistributedDataParallel``, the ds_config handed to ``deepspeed.initialize``), never
from a second description of them, into ``Prepared.code``; ``script`` adds what the shared loop and
``parallelize`` did around it (activation checkpointing, compile, autocast, micro-batches). The worker writes the
text in the rank's ``start`` record (``code``); summary.json carries rank 0's, and ``shardscope tune`` prints the
winner's.

Written here because no library prints a call back as source (``repr`` of torch's policies is not code).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import pprint
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardscope.engines.api import TrainSettings

WIDTH = 100  # a call longer than this is written one argument per line


class Name(str):
    """A name of the user's script (``model``, ``mesh``, ``block``), written as is."""


def literal(value: Any) -> str:
    """``value`` as Python source: dtypes as ``torch.bfloat16``, enums as ``Class.MEMBER``, classes by name."""
    if isinstance(value, Name):
        return str(value)
    if isinstance(value, torch.dtype):
        return "torch." + str(value).replace("torch.", "")
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, type):
        return value.__name__
    if isinstance(value, torch.device):
        return f"torch.device({str(value)!r})"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a policy: its fields apart from defaults
        changed = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)
                   if f.default is dataclasses.MISSING or getattr(value, f.name) != f.default}
        return call(type(value).__name__, **changed)
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(literal(v) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{literal(k)}: {literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(literal(v) for v in value) + ("," if isinstance(value, tuple) and len(value) == 1 else "")
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return repr(value)


def call(func: str, *args: Any, indent: str = "", **kwargs: Any) -> str:
    """``func(args, key=value, ...)`` as source, one argument per line when longer than ``WIDTH``."""
    parts = [literal(a) for a in args] + [f"{k}={literal(v)}" for k, v in kwargs.items()]
    one = f"{indent}{func}({', '.join(parts)})"
    if len(one) <= WIDTH:
        return one
    return f"{indent}{func}(\n" + "".join(f"{indent}    {p},\n" for p in parts) + f"{indent})"


@dataclass
class Code:
    """A strategy's part: its imports, what it does before activation checkpointing (tensor parallelism), and its
    wrapping or sharding calls."""

    imports: list[str] = field(default_factory=list)
    first: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    compiled: list[str] | None = None  # how the strategy compiles, after its calls (None: per block, before them)
    per_step: str = ""  # what a step's batch is, when the strategy splits it itself (pipeline schedules)
    clips_itself: bool = False  # its config clips the gradients (DeepSpeed's gradient_clipping)


def blocks_path(model: nn.Module, blocks: nn.Module) -> str:
    """Where ``blocks`` sits in ``model`` as source (``model.layers``, ``model.model.layers``)."""
    for name, module in model.named_modules():
        if module is blocks and name:
            return "model." + name
    return "model.layers"


def mesh(device_type: str, mesh: Any, name: str = "mesh") -> str:
    """The line that builds ``mesh`` (a DeviceMesh) over every rank: its shape and dimension names."""
    dims = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    return call(f"{name} = init_device_mesh", device_type, tuple(mesh.shape), **({"mesh_dim_names": dims} if dims else {}))


def devices(ctx: Any) -> dict[str, Any]:
    """DDP's ``device_ids`` and process group as the run passed them: the local GPU on CUDA (none on CPU), the
    data-parallel group when it is not the whole world."""
    out: dict[str, Any] = {}
    if ctx.device.type == "cuda":
        out["device_ids"] = Name("[local_rank]")
    if ctx.dp_size != ctx.world_size:
        out["process_group"] = Name("dp_group")
    return out


def optimizer(settings: TrainSettings, params: str = "model.parameters()") -> str:
    """The AdamW the run stepped (``optim.make_optimizer``'s arguments)."""
    return call("optimizer = torch.optim.AdamW", Name(params), lr=settings.lr, betas=settings.betas,
                eps=settings.eps, weight_decay=settings.weight_decay)


def ds_config(config: dict[str, Any]) -> str:
    """The ds_config ``deepspeed.initialize`` was given, as a Python dict (the same keys a ds_config.json holds)."""
    return "ds_config = " + pprint.pformat(json.loads(json.dumps(config, default=str)), width=WIDTH, sort_dicts=True)


def script(code: Code, settings: TrainSettings, *, strategy: str, blocks: str, loop_autocast: torch.dtype | None,
           device: str, dp: int) -> str:
    """The whole snippet: the strategy's imports and calls in ``parallelize``'s order (tensor parallel,
    activation checkpointing, compile, data parallel), then the loop's precision and micro-batches."""
    imports = ["import torch", *code.imports]
    body = [f"# shardscope: strategy {strategy} as this run set it up (model = your nn.Module, already on its device)",
            *code.first]
    if settings.activation_checkpointing:
        imports += ["import functools", "from torch.utils.checkpoint import checkpoint"]
        body += [f"for block in {blocks}:  # recompute each block's activations in backward",
                 "    block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)"]
    if settings.compile and code.compiled is None:
        body += [f"for block in {blocks}:", "    block.compile()"]
    body += code.lines
    if settings.compile and code.compiled:
        body += code.compiled
    body.append(code.per_step or f"# per rank and optimizer step: {settings.grad_accum} micro-batch(es) of "
                f"{settings.micro_batch_size} sample(s), gradients accumulated, over {dp} data-parallel rank(s)")
    if loop_autocast is not None:
        body.append(f"# each forward under: with torch.autocast({device!r}, dtype={literal(loop_autocast)}):")
    if settings.grad_clip > 0 and not code.clips_itself:
        body.append(f"# before each optimizer step, gradients clipped to a global norm of {settings.grad_clip} "
                    "(torch.nn.utils.clip_grad_norm_; FSDP1: model.clip_grad_norm_)")
    body.append(f"# learning rate: {settings.lr} after a linear warm-up of {settings.warmup_steps} step(s), then a "
                "cosine decay")
    return "\n".join(dict.fromkeys(imports)) + "\n\n" + "\n".join(body) + "\n"


def blocks_of_model(model: nn.Module) -> str:
    """Where ``model``'s blocks sit as source (``parallelize.blocks_of``), read before a strategy wraps it;
    ``model.layers`` for a model without blocks (its strategies say what they wrap)."""
    from shardscope.engines.parallelize import blocks_of

    try:
        return blocks_path(model, blocks_of(model))
    except (TypeError, AttributeError):
        return "model.layers"


def start_field(prep: Any, settings: TrainSettings, *, strategy: str, blocks: str, ctx: Any) -> dict[str, str]:
    """``{"code": the snippet}`` for the rank's start record (``{}`` for a strategy that writes none)."""
    from shardscope.engines.precision import loop_autocast_dtype

    if not isinstance(prep.code, Code):
        return {}
    return {"code": script(prep.code, settings, strategy=strategy, blocks=blocks, device=ctx.device.type,
                           loop_autocast=loop_autocast_dtype(settings.precision, prep.handles_precision),
                           dp=ctx.dp_size)}
