"""The user's own ``nn.Module``: ``model.kind = "module"``, ``model.entry = "pkg.mod:build"`` or
``"/abs/path/mymodel.py:build"`` (a preset's relative path was made absolute when it loaded).

``build(model_table, seed)`` gets the ``[model]`` table as a dict (``args`` holds the user's own keys) and the
comparison's seed and returns the module, built in fp32 on CPU from that seed (torch's global generator is seeded
and restored around the call, so a builder that never reads the seed is still reproducible). Its forward takes
tokens ``[b, s]`` (int64) or images ``[b, c, h, w]`` (``model.inputs``) and returns logits ``[b, s, vocab]`` or
``[b, classes]``. Its blocks are the ``nn.ModuleList`` at ``model.blocks`` (an attribute path) or, when that is
empty, the only ``ModuleList`` it holds; ``parallelize.blocks_of`` finds them through ``BLOCKS_ATTR``. A module
may declare a tensor-parallel plan as an attribute ``tp_plan``: ``{"layers.*.attn.q_proj": "colwise", ...}``.

User code is imported only here: in the ranks and in the model check's subprocess (``engines/describe.py``),
never in the app or the command line.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from typing import Any, Callable

import torch
from torch import nn

from shardscope.engines.module_pipeline import FACTS_ATTR
from shardscope.engines.parallelize import BLOCKS_ATTR, declared_blocks  # the blocks' attribute path, noted on the instance
from shardscope.engines.tp_plan import TP_PLAN_ATTR  # the module's own tensor-parallel plan, noted on the instance


class UserModelError(ValueError):
    """The user's entry or module is not usable; ``str(err)`` is one line."""


def load_entry(entry: str, import_root: str = "") -> Callable[..., Any]:
    """Return the function ``entry`` names (``"pkg.mod:fn"`` or ``"/path/file.py:fn"``); ``import_root`` (the
    directory the preset was loaded from) is searched for a module name first. Raises UserModelError."""
    target, sep, attr = entry.rpartition(":")
    if not sep or not target or not attr:
        raise UserModelError(f"model.entry = {entry!r}: expected 'package.module:function' or './file.py:function'")
    try:
        if target.endswith(".py") or os.sep in target:
            if not os.path.isfile(target):
                raise UserModelError(f"model.entry = {entry!r}: no such file {target}")
            name = f"shardscope_user_{abs(hash(target)):x}"
            spec = importlib.util.spec_from_file_location(name, target)
            module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
            sys.modules[name] = module
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            if import_root and import_root not in sys.path:
                sys.path.insert(0, import_root)
            module = importlib.import_module(target)
    except UserModelError:
        raise
    except Exception as err:  # the user's import raised: say what, in one line
        raise UserModelError(f"model.entry = {entry!r}: importing {target} failed: {type(err).__name__}: "
                             f"{_one_line(err)}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserModelError(f"model.entry = {entry!r}: {target} has no function {attr!r}")
    return fn


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else ""


def model_table(spec: Any) -> dict[str, Any]:
    """The ``[model]`` table handed to the user's build function (without shardscope's own description)."""
    table = dataclasses.asdict(spec)
    table.pop("described", None)
    return table


def find_blocks(model: nn.Module, path: str) -> tuple[str, nn.ModuleList]:
    """(attribute path, ModuleList) of the model's blocks: ``path`` when given, else the only ModuleList.
    Raises UserModelError."""
    if path:
        try:
            return path, declared_blocks(model, path)
        except ValueError as err:
            raise UserModelError(str(err)) from None
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    outer = [(n, m) for n, m in lists if not any(n != o and n.startswith(o + ".") for o, _ in lists)]
    if len(outer) != 1:
        found = ", ".join(n for n, _ in outer) or "none"
        raise UserModelError(f"model.blocks: give the attribute path of the blocks' nn.ModuleList ({type(model).__name__}"
                             f" holds {len(outer)} outermost ModuleLists: {found})")
    return outer[0]


def build_model(spec: Any, seed: int) -> nn.Module:
    """Return the user's module for ``spec`` in fp32, built from ``seed``, its blocks (and its own tensor-parallel
    plan, if it declares one) noted on the instance. Raises UserModelError."""
    import_root = str((spec.described or {}).get("import_root") or "")
    build = load_entry(spec.entry, import_root)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = build(model_table(spec), seed)
        except Exception as err:
            raise UserModelError(f"model.entry = {spec.entry!r}: build raised {type(err).__name__}: "
                                 f"{_one_line(err)}") from None
    if not isinstance(model, nn.Module):
        raise UserModelError(f"model.entry = {spec.entry!r}: build returned a {type(model).__name__}, not an "
                             "nn.Module")
    if any(p.dtype != torch.float32 for p in model.parameters()) and not any(p.is_meta for p in model.parameters()):
        model.float()
    path, _ = find_blocks(model, spec.blocks)
    setattr(model, BLOCKS_ATTR, path)
    facts = (spec.described or {}).get("pipeline")
    if facts and not facts.get("refusal"):  # for pipeline stages (engines/module_pipeline.py)
        setattr(model, FACTS_ATTR, {**facts, "seq_len": int(spec.seq_len),
                                    "width": int(spec.described.get("hidden_size") or 0),
                                    "vocab": int(spec.described.get("vocab_size") or 0)})
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict):
        setattr(model, TP_PLAN_ATTR, {str(k): str(v) for k, v in plan.items()})
    return model
