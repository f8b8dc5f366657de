"""A user's module in pipeline stages: which of its parameters come before the blocks and which after, found once
by the model check, and the stage modules built from that on every rank.

The contract (docs/user-models.md): besides ``forward(tokens) -> logits``, the module defines
``pre_blocks(tokens) -> hidden`` (everything before its first block) and ``post_blocks(hidden) -> logits``
(everything after its last), such that ``forward`` is ``post_blocks`` of the blocks, called in order as
``block(hidden)``, of ``pre_blocks``. Which parameters each touches is seen, not declared: the model check
(``engines/describe.py``) calls both on fake tensors under a ``TorchFunctionMode`` that notes every parameter a
torch function receives. A parameter either side of the blocks that both touch (tied input and output embeddings)
is refused with the reason: its two gradients would live on two ranks and are not summed across them here.

``ModuleStage`` holds units ``[start, end)`` of the module (0: what ``pre_blocks`` touches, 1..L: the blocks, L+1:
what ``post_blocks`` touches) under their own names, so per-layer norms and the shared initial weights match every
other strategy's. It is an instance of a subclass of the user's own class (made without calling its ``__init__``),
so that ``pre_blocks`` and ``post_blocks`` run as the user wrote them, with ``self`` holding only the stage's part:
the containers on the way to each parameter are empty modules of the same class carrying the original's plain
attributes and buffers. Written here: ``torch.distributed.pipelining``'s own splitter traces the model with
``torch.export``, which renames every parameter and does not accept every module a user writes.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

PRE, POST = "pre_blocks", "post_blocks"  # the methods a module defines to run in pipeline stages
# set by engines/user_module.py from the description: {"first", "last", "seq_len", "width", "vocab"}
FACTS_ATTR = "_shardscope_pipeline"
_NULL = contextlib.nullcontext()


class _Touched(TorchFunctionMode):
    """Notes the parameters (by id) that any torch function receives while active."""

    def __init__(self, ids: dict[int, str]) -> None:
        super().__init__()
        self.ids, self.seen = ids, set()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        for leaf in tree_flatten((args, kwargs or {}))[0]:
            name = self.ids.get(id(leaf))
            if name is not None:
                self.seen.add(name)
        return func(*args, **(kwargs or {}))


def pipeline_facts(model: nn.Module, blocks_path: str, blocks: nn.ModuleList, sample: torch.Tensor,
                   logits_shape: tuple[int, ...]) -> dict[str, Any]:
    """``{"first": [names], "last": [names], "refusal": ""}``: the parameters outside the blocks that
    ``pre_blocks`` and ``post_blocks`` touch on ``sample`` (fake tensors), or the reason the module cannot run in
    stages. ``logits_shape``: what ``forward(sample)`` returned."""
    missing = [m for m in (PRE, POST) if not callable(getattr(model, m, None))]
    if missing:
        return {"first": [], "last": [], "refusal": f"{type(model).__name__} defines no {' or '.join(missing)}: a module "
                "runs in pipeline stages when it defines pre_blocks(tokens) -> hidden and post_blocks(hidden) -> logits "
                "(docs/user-models.md)"}
    ids = {id(p): n for n, p in model.named_parameters()}
    inside = {n for n in ids.values() if n.startswith(blocks_path + ".")}
    try:  # the user's code: whatever it raises refuses pipeline stages only, never the model's other runs
        with torch.no_grad():
            with _Touched(ids) as pre:
                hidden = getattr(model, PRE)(sample)
            x = hidden
            for block in blocks:
                x = block(x)
            with _Touched(ids) as post:
                out = getattr(model, POST)(x)
    except Exception as err:  # noqa: BLE001
        first = (str(err).strip().splitlines() or [""])[0][:200]
        return {"first": [], "last": [], "refusal": f"pre_blocks, the blocks and post_blocks raised "
                f"{type(err).__name__}: {first}"}
    if not isinstance(hidden, torch.Tensor) or not isinstance(out, torch.Tensor) or tuple(out.shape) != logits_shape:
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return {"first": [], "last": [], "refusal": f"post_blocks(blocks(pre_blocks(tokens))) gave {got}, forward gave "
                f"{list(logits_shape)}: they must compute the same logits"}
    both = sorted((pre.seen & post.seen) - inside)
    if both:
        return {"first": [], "last": [], "refusal": f"{both[0]} is used both before and after the blocks (tied or shared "
                "weights): the first and last stages would each hold it, and its two gradients are not summed across "
                "them here; untie it"}
    blocks_used = sorted((pre.seen | post.seen) & inside)
    if blocks_used:
        return {"first": [], "last": [], "refusal": f"{blocks_used[0]} (a block's) is used by pre_blocks or post_blocks: "
                "a block's parameters live on its own stage"}
    outside = [n for n in ids.values() if n not in inside]
    last = [n for n in outside if n in post.seen]
    first = [n for n in outside if n not in post.seen]  # untouched ones stay with the embeddings (no gradient anyway)
    return {"first": first, "last": last, "refusal": ""}


def _shell(real: nn.Module, cls: type) -> nn.Module:
    """An empty module of class ``cls`` (its ``__init__`` not called) with ``real``'s plain attributes and buffers."""
    shell = cls.__new__(cls)
    nn.Module.__init__(shell)
    for key, value in vars(real).items():
        if not key.startswith("_") and key != "training":
            object.__setattr__(shell, key, value)
    for key, buf in real.named_buffers(recurse=False):
        shell.register_buffer(key, buf, persistent=key not in real._non_persistent_buffers_set)
    shell.train(real.training)
    return shell


def _place(root: nn.Module, model: nn.Module, path: str, keep: set[str]) -> None:
    """Put ``model``'s parameter ``path`` into ``root`` under the same name: the whole owning module when every
    parameter under it is kept, else an empty shell of it holding that parameter."""
    parts = path.split(".")
    here, real = root, model
    for i, part in enumerate(parts[:-1]):
        child = getattr(real, part)
        prefix = ".".join(parts[: i + 1])
        if all(f"{prefix}.{n}" in keep for n, _ in child.named_parameters()):
            if part not in here._modules:
                here.add_module(part, child)
            return
        if part not in here._modules:
            here.add_module(part, _shell(child, type(child)))
        here, real = here._modules[part], child
    here.register_parameter(parts[-1], getattr(real, parts[-1]))


def _put(root: nn.Module, dotted: str, module: nn.Module, model: nn.Module) -> None:
    """Set ``module`` at attribute path ``dotted`` of ``root``, making shells of ``model``'s containers on the way."""
    parts = dotted.split(".")
    here, real = root, model
    for part in parts[:-1]:
        real = getattr(real, part)
        if part not in here._modules:
            here.add_module(part, _shell(real, type(real)))
        here = here._modules[part]
    here.add_module(parts[-1], module)


class _StageMixin:
    """The stage's forward and blocks, ahead of the user's class in the stage's method order."""

    def stage_blocks(self) -> list[nn.Module]:
        """The stage's blocks, in order."""
        return list(self._ss_blocks.values()) if self._ss_blocks is not None else []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Units ``[start, end)``: ``pre_blocks`` on the first stage, the blocks, ``post_blocks`` on the last."""
        with torch.autocast(x.device.type, dtype=self._ss_autocast) if self._ss_autocast else _NULL:
            if self._ss_first:
                x = getattr(self, PRE)(x)
            for block in self.stage_blocks():
                x = block(x)
            return getattr(self, POST)(x) if self._ss_last else x


def module_stage(model: nn.Module, blocks_path: str, facts: dict[str, Any], start: int, end: int,
                 autocast: torch.dtype | None) -> nn.Module:
    """The stage module of units ``[start, end)`` of the user's ``model`` (``facts``: ``pipeline_facts``)."""
    blocks = model.get_submodule(blocks_path)
    n = len(blocks)
    cls = type(f"{type(model).__name__}Stage", (_StageMixin, type(model)), {})
    stage = _shell(model, cls)
    first, last = start == 0, end == n + 2
    keep = set(facts["first"] if first else ()) | set(facts["last"] if last else ())
    for name in [n_ for n_, _ in model.named_parameters() if n_ in keep]:
        _place(stage, model, name, keep)
    mine = nn.ModuleDict({str(u - 1): blocks[u - 1] for u in range(max(1, start), min(end, n + 1))})
    _put(stage, blocks_path, mine, model)
    object.__setattr__(stage, "_ss_blocks", mine)  # not a second registration: the blocks sit at blocks_path
    object.__setattr__(stage, "_ss_first", first)
    object.__setattr__(stage, "_ss_last", last)
    object.__setattr__(stage, "_ss_autocast", autocast)
    return stage
