"""The stage modules of a pipeline: units ``[start, end)`` of a model (0: embeddings, 1..L: blocks, L+1: head),
holding the model's own modules under their own names, so per-layer norms and the shared initial weights match
every other strategy's.

- ``TransformerStage``: the built-in transformer (``tok_emb``, ``pos_emb``, ``layers``, ``norm``, ``lm_head``).
- ``module_pipeline.module_stage``: a user's module that defines ``pre_blocks`` and ``post_blocks``.
- ``hf_pipeline.HFStage``: any Hugging Face decoder the model check described (a config or model directory).
- ``HFStage``: a built-in Hugging Face architecture (``hf_archs``), laid out as Llama is (``model.embed_tokens``,
  ``model.layers``, ``model.rotary_emb``, ``model.norm``, ``lm_head``). Each stage computes the rotary position
  embeddings itself (a buffer, no parameters) and calls its decoder layers as the base model does, with no
  attention mask: SDPA then masks causally, which is the base model's mask for a full-length batch without padding
  and without a sliding window shorter than the sequence. ``presets/pipeline_checks`` admits only the families
  built and tested that way (``HF_FAMILIES``), untied, with SDPA; tests/test_pipeline_user_models.py checks parity with DDP.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from shardscope.core import pipeline_layout
from shardscope.engines import hf_pipeline, module_pipeline
from shardscope.engines.parallelize import BLOCKS_ATTR

_NULL = contextlib.nullcontext()  # reusable: nullcontext holds no state


def _autocast(x: torch.Tensor, dtype: torch.dtype | None) -> Any:
    return torch.autocast(x.device.type, dtype=dtype) if dtype else _NULL


class TransformerStage(nn.Module):
    """Units ``[start, end)`` of the built-in transformer (``layers.<i>`` kept)."""

    def __init__(self, model: nn.Module, start: int, end: int, autocast: torch.dtype | None) -> None:
        super().__init__()
        n_layers = len(model.layers)
        self.first, self.last, self.autocast = start == 0, end == n_layers + 2, autocast
        if self.first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        self.layers = nn.ModuleDict({str(u - 1): model.layers[u - 1] for u in range(max(1, start), min(end, n_layers + 1))})
        if self.last:
            self.norm, self.lm_head = model.norm, model.lm_head

    def stage_blocks(self) -> list[nn.Module]:
        """The stage's blocks, in order."""
        return list(self.layers.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _autocast(x, self.autocast):
            if self.first:
                x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
            for block in self.layers.values():
                x = block(x)
            return self.lm_head(self.norm(x)) if self.last else x


class HFStage(nn.Module):
    """Units ``[start, end)`` of a Llama-layout Hugging Face causal LM (``model.layers.<i>`` kept)."""

    def __init__(self, model: nn.Module, start: int, end: int, autocast: torch.dtype | None) -> None:
        super().__init__()
        base = model.model
        n_layers = len(base.layers)
        self.first, self.last, self.autocast = start == 0, end == n_layers + 2, autocast
        self.model = nn.Module()
        if self.first:
            self.model.embed_tokens = base.embed_tokens
        self.model.layers = nn.ModuleDict({str(u - 1): base.layers[u - 1]
                                           for u in range(max(1, start), min(end, n_layers + 1))})
        self.model.rotary_emb = base.rotary_emb
        if self.last:
            self.model.norm, self.lm_head = base.norm, model.lm_head

    def stage_blocks(self) -> list[nn.Module]:
        """The stage's decoder layers, in order."""
        return list(self.model.layers.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _autocast(x, self.autocast):
            if self.first:
                x = self.model.embed_tokens(x)
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            rotary = self.model.rotary_emb(x, positions)
            for layer in self.model.layers.values():
                out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rotary)
                x = out[0] if isinstance(out, tuple) else out
            return self.lm_head(self.model.norm(x)) if self.last else x


def hf_facts(model: nn.Module) -> dict[str, Any] | None:
    """A described Hugging Face model's pipeline facts (engines/hf_pipeline.py), None for the others."""
    return getattr(model, hf_pipeline.FACTS_ATTR, None)


def tied(model: nn.Module) -> list[str]:
    """Parameters the first and the last stage both hold (tied input and output embeddings)."""
    f = hf_facts(model)
    return list(f["tied"]) if f is not None else []


def is_hf(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face causal LM (``model.model.layers``) rather than the built-in transformer."""
    return hasattr(model, "model") and hasattr(model.model, "layers")


def module_facts(model: nn.Module) -> dict[str, Any] | None:
    """A user's module's pipeline facts (engines/module_pipeline.py), None for the models built in."""
    return getattr(model, module_pipeline.FACTS_ATTR, None)


def units(model: nn.Module) -> list[pipeline_layout.Unit]:
    """The model's units, in order (core/pipeline_layout.py): a user's module's from its description."""
    names = [(n, p.numel()) for n, p in model.named_parameters()]
    hf = hf_facts(model)
    if hf is not None:  # a tied weight's unit is the embeddings': the last stage holds it besides
        return pipeline_layout.units_of(names, pipeline_layout.unit_names(
            [n for n, _ in names], blocks=hf["blocks"], last=set(hf["last"]) - set(hf["tied"])))
    facts = module_facts(model)
    if facts is None:
        return pipeline_layout.units_of(names)
    return pipeline_layout.units_of(names, pipeline_layout.unit_names([n for n, _ in names], blocks=blocks_path(model),
                                                                      last=set(facts["last"])))


def blocks_path(model: nn.Module) -> str:
    """A user's module's blocks' attribute path (engines/user_module.py notes it)."""
    return str(getattr(model, BLOCKS_ATTR, ""))


def stage(model: nn.Module, start: int, end: int, autocast: torch.dtype | None, chunk: int) -> nn.Module:
    """The stage module of units ``[start, end)`` of ``model`` (``chunk``: samples per micro-batch)."""
    if hf_facts(model) is not None:
        return hf_pipeline.HFStage(model, start, end, autocast, chunk)
    facts = module_facts(model)
    if facts is not None:
        return module_pipeline.module_stage(model, blocks_path(model), facts, start, end, autocast)
    return (HFStage if is_hf(model) else TransformerStage)(model, start, end, autocast)


def seq_len(model: nn.Module) -> int:
    """Tokens per sequence the model is built for."""
    facts = module_facts(model)
    return int(facts["seq_len"] if facts is not None else model.seq_len)


def widths(model: nn.Module) -> tuple[int, int]:
    """(hidden width of the residual stream, vocabulary) of ``model``."""
    facts = module_facts(model) or hf_facts(model)
    if facts is not None:
        return int(facts["width"]), int(facts["vocab"])
    if is_hf(model):
        return int(model.model.embed_tokens.weight.shape[1]), int(model.lm_head.weight.shape[0])
    return int(model.tok_emb.weight.shape[1]), int(model.lm_head.weight.shape[0])
