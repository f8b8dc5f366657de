"""Any Hugging Face decoder in pipeline stages: what runs before its first decoder layer and after its last, found
from the real module, and the stage modules built from that on every rank.

No list of layouts. The model check (``engines/describe.py``) runs the model's own forward once on fake tensors and
notes, by module and parameter, what runs before the first block (token and position embeddings, an embedding norm
or projection: ``pre``), inside the blocks, and after the last block (final norm, output layer, logit scaling:
``post``). A parameter both sides touch is a tied embedding: the first and the last stage each hold it and its
gradient is summed between them every step, as Megatron-LM runs tied embeddings (``engines/pipeline.py``). Refused,
with the reason: blocks that are not called once each, in order; decoder layers that take, besides the hidden
states, a tensor computed from parameters outside them (it would be missing on a later stage).

``HFStage`` runs the model's own ``forward`` on every stage, so masks, rotary or ALiBi position terms, embedding
scales and soft-capping are the model's own (sliding windows included). What is not this stage's is skipped:
- on a stage after the first, the modules of ``pre`` return zeros of their output's shape (noted once, before the
  other stages' parameters are freed) and the stage's input replaces the hidden states its first block receives;
- decoder layers before the stage's first block pass their input through; after its last block (but on the last
  stage) the hidden states leave the forward (``_StageOut``) before the final norm and head run.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from shardscope.engines import module_pipeline

_NULL = contextlib.nullcontext()
FACTS_ATTR = "_shardscope_hf_pipeline"  # set by engines/hf_model.py from the description's "pipeline" facts
_ACTIVE = "_shardscope_active_stage"  # on the model: the stage whose forward is running, else None
_TEMPLATES = "_shardscope_pre_outputs"  # on the model: {pre module name: zeros like its output}, noted once


class _Phases(TorchFunctionMode):
    """Notes, per phase ("pre", "blocks", "post"), the parameters (by name) any torch function receives."""

    def __init__(self, ids: dict[int, str]) -> None:
        super().__init__()
        self.ids, self.phase = ids, "pre"
        self.seen: dict[str, set[str]] = {"pre": set(), "blocks": set(), "post": set()}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        for leaf in tree_flatten((args, kwargs or {}))[0]:
            name = self.ids.get(id(leaf))
            if name is not None:
                self.seen[self.phase].add(name)
        return func(*args, **(kwargs or {}))


def hidden_of(args: tuple, kwargs: dict) -> Any:
    """The hidden states a decoder layer is called with: its first positional argument or ``hidden_states``."""
    return args[0] if args else kwargs.get("hidden_states")


def facts(model: nn.Module, blocks_path: str, blocks: nn.ModuleList, sample: torch.Tensor) -> dict[str, Any]:
    """``{"first", "last", "tied", "pre_modules", "returns", "refusal"}`` of a Hugging Face causal LM (fake tensors,
    grad on): the parameters outside the blocks the forward touches before its first block (and those it never
    touches) and after its last, the parameters both touch, the modules owning parameters that run before the
    blocks, what a block returns ("tensor" or a tuple's length), or the reason its stages cannot be built."""
    ids = {id(p): n for n, p in model.named_parameters()}
    inside = {n for n in ids.values() if n.startswith(blocks_path + ".")}
    calls: list[int] = []
    foreign: list[str] = []
    returns: list[Any] = []
    pre_modules: list[str] = []
    index = {id(b): i for i, b in enumerate(blocks)}
    mode = _Phases(ids)

    def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
        calls.append(index[id(module)])
        mode.phase = "blocks"
        hidden = hidden_of(args, kwargs)
        for leaf in tree_flatten((args, kwargs))[0]:
            if isinstance(leaf, torch.Tensor) and leaf is not hidden and leaf.requires_grad and not foreign:
                foreign.append(f"{type(leaf).__name__} of shape {list(leaf.shape)}")

    def leave(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        if not returns:
            returns.append("tensor" if isinstance(out, torch.Tensor) else len(out) if isinstance(out, tuple) else "?")
        if index[id(module)] == len(blocks) - 1:
            mode.phase = "post"

    owners = {id(m): name for name, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))}

    def ran(module: nn.Module, args: tuple, out: Any) -> None:
        name = owners.get(id(module))
        outside = name is not None and not name.startswith(blocks_path + ".")
        if mode.phase == "pre" and outside and name not in pre_modules:
            pre_modules.append(name)

    handles = [b.register_forward_pre_hook(enter, with_kwargs=True) for b in blocks]
    handles += [b.register_forward_hook(leave, with_kwargs=True) for b in blocks]
    handles += [m.register_forward_hook(ran) for m in model.modules() if id(m) in owners]
    try:
        with mode:
            out = model(sample)
    except Exception as err:  # noqa: BLE001 - the model's own code: it refuses pipeline stages only
        return _refused(f"its forward raised {type(err).__name__} when traced for stages: "
                        f"{(str(err).strip().splitlines() or [''])[0][:200]}")
    finally:
        for h in handles:
            h.remove()
    if calls != list(range(len(blocks))):
        return _refused(f"its forward calls the blocks at {blocks_path} as {calls[:8]}, not once each in order")
    if foreign:
        return _refused(f"its decoder layers take {foreign[0]} computed from parameters outside them (per-layer "
                        "inputs from the embeddings), which a later stage would not have")
    if returns[0] == "?" or not isinstance(out, torch.Tensor):
        return _refused("a decoder layer returns neither a tensor nor a tuple")
    pre, post = mode.seen["pre"] - inside, mode.seen["post"] - inside
    used = sorted((pre | post) & inside)
    if used:
        return _refused(f"{used[0]} (a block's) is used outside the blocks")
    outside = [n for n in ids.values() if n not in inside]
    tied = sorted(pre & post)
    return {"first": [n for n in outside if n not in post or n in tied], "last": [n for n in outside if n in post],
            "tied": tied, "pre_modules": pre_modules, "returns": returns[0], "refusal": ""}


def _refused(reason: str) -> dict[str, Any]:
    return {"first": [], "last": [], "tied": [], "pre_modules": [], "returns": "tensor", "refusal": reason}


class _StageOut(Exception):
    """Carries a stage's output hidden states out of the model's forward, before what runs after its last block."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


def _patch(model: nn.Module, blocks: nn.ModuleList, pre_modules: list[str]) -> None:
    """Route each block's and each pre module's forward through the running stage (once per model)."""
    if hasattr(model, _ACTIVE):
        return
    object.__setattr__(model, _ACTIVE, None)
    for i, block in enumerate(blocks):
        real = block.forward

        def forward(*args: Any, _i: int = i, _real: Callable[..., Any] = real, **kwargs: Any) -> Any:
            stage = getattr(model, _ACTIVE)
            return _real(*args, **kwargs) if stage is None else stage.layer(_i, _real, args, kwargs)
        block.forward = forward  # type: ignore[method-assign]
    for name in pre_modules:
        module = model.get_submodule(name)
        real = module.forward

        def pre(*args: Any, _name: str = name, _real: Callable[..., Any] = real, **kwargs: Any) -> Any:
            stage = getattr(model, _ACTIVE)
            if stage is None or stage.first:
                return _real(*args, **kwargs)
            return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t,
                            getattr(model, _TEMPLATES)[_name])
        module.forward = pre  # type: ignore[method-assign]


def _note_pre_outputs(model: nn.Module, pre_modules: list[str], chunk: int, seq: int, device: torch.device,
                      autocast: torch.dtype | None) -> None:
    """Zeros like each pre module's output at a micro-batch's shape, from one run of the model's prefix (once)."""
    if hasattr(model, _TEMPLATES):
        return
    templates: dict[str, Any] = {}
    handles = []
    for name in pre_modules:
        def keep(module: nn.Module, args: tuple, out: Any, _name: str = name) -> None:
            templates[_name] = tree_map(lambda t: torch.zeros_like(t) if isinstance(t, torch.Tensor) else t, out)
        handles.append(model.get_submodule(name).register_forward_hook(keep))

    class _Stop(Exception):
        pass

    def stop(module: nn.Module, args: tuple) -> None:
        raise _Stop

    blocks = model.get_submodule(getattr(model, FACTS_ATTR)["blocks"])
    handles.append(blocks[0].register_forward_pre_hook(stop))
    ids = torch.zeros(chunk, seq, dtype=torch.long, device=device)
    try:
        with torch.no_grad(), (torch.autocast(device.type, dtype=autocast) if autocast else _NULL):
            model(ids)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    object.__setattr__(model, _TEMPLATES, templates)


class HFStage(nn.Module):
    """Units ``[start, end)`` of a Hugging Face causal LM (0: what runs before the blocks, 1..L: the blocks, L+1: what
    runs after), holding the model's own modules under their own names; its forward is the model's own."""

    def __init__(self, model: nn.Module, start: int, end: int, autocast: torch.dtype | None, chunk: int) -> None:
        super().__init__()
        f = getattr(model, FACTS_ATTR)
        blocks = model.get_submodule(f["blocks"])
        n = len(blocks)
        self.first, self.last = start == 0, end == n + 2
        self.a, self.b = max(0, start - 1), min(n, end - 1)  # this stage's blocks: [a, b)
        self.n, self.returns, self.autocast = n, f["returns"], autocast
        if not self.first:
            _note_pre_outputs(model, f["pre_modules"], chunk, int(model.seq_len), next(model.parameters()).device,
                              autocast)
        _patch(model, blocks, f["pre_modules"])
        keep_ids = {id(p) for name, p in model.named_parameters()
                    if (self.first and name in f["first"]) or (self.last and name in f["last"])}
        names = [name for name, p in model.named_parameters(remove_duplicate=False) if id(p) in keep_ids]
        keep = set(names)
        for name in names:  # in the model's order, every name of a tied weight included
            module_pipeline._place(self, model, name, keep)
        mine = nn.ModuleDict({str(i): blocks[i] for i in range(self.a, self.b)})
        module_pipeline._put(self, f["blocks"], mine, model)
        object.__setattr__(self, "_ss_blocks", mine)
        object.__setattr__(self, "_ss_model", model)
        self._input: torch.Tensor | None = None

    def stage_blocks(self) -> list[nn.Module]:
        """The stage's decoder layers, in order."""
        return list(self._ss_blocks.values())

    def _pack(self, hidden: torch.Tensor) -> Any:
        return hidden if self.returns == "tensor" else (hidden,) + (None,) * (int(self.returns) - 1)

    def layer(self, i: int, real: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Block ``i``'s call inside the model's forward, as this stage runs it."""
        hidden = hidden_of(args, kwargs)
        if i < self.a:
            return self._pack(self._input if not self.first and self.a == self.n and i == self.n - 1 else hidden)
        if i >= self.b:  # past the stage's blocks, the stage not the last: its output is this input
            raise _StageOut(hidden)
        if i == self.a and not self.first:  # the stage's input replaces what the skipped prefix computed
            if args:
                args = (self._input,) + tuple(args[1:])
            else:
                kwargs = {**kwargs, "hidden_states": self._input}
        out = real(*args, **kwargs)
        if i == self.b - 1 and not self.last:
            raise _StageOut(out if isinstance(out, torch.Tensor) else out[0])
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model = self._ss_model
        ids = x if self.first else torch.zeros(x.shape[:2], dtype=torch.long, device=x.device)
        self._input = None if self.first else x
        object.__setattr__(model, _ACTIVE, self)
        try:
            with torch.autocast(x.device.type, dtype=self.autocast) if self.autocast else _NULL:
                out = model(ids)
        except _StageOut as done:
            return done.hidden.float()
        finally:
            object.__setattr__(model, _ACTIVE, None)
            self._input = None
        return out
