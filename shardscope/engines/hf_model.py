"""A Hugging Face causal LM built from a config (never downloaded), returning logits.

``build_model(spec, seed)`` builds ``Qwen2ForCausalLM`` (or whatever ``architectures`` names)
from ``hf_archs.ARCHS[spec.hf_arch]`` with ``num_hidden_layers = spec.hf_layers``, initialised
from ``seed``. With ``spec.weights_dir`` it loads real weights from the ``*.safetensors`` files
there, keeping only the first ``hf_layers`` decoder layers.

The model keeps Hugging Face's module layout (``model.embed_tokens``, ``model.layers``,
``lm_head``), so strategies find its blocks at ``model.model.layers`` and DeepSpeed AutoTP
recognises it; only ``forward`` is narrowed to ``forward(input_ids) -> logits``.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch
from torch import nn

from shardscope.core.hf_archs import ARCHS


def hf_config(spec: Any) -> Any:
    """Return the ``transformers`` config for ``spec`` (``hf_arch`` values, ``hf_layers`` layers).

    Attention runs through SDPA (no flash-attention build needed on CPU); the KV cache is off
    (training). Raises KeyError for an unknown ``hf_arch``.
    """
    from transformers import AutoConfig

    values = dict(ARCHS[spec.hf_arch])
    values["num_hidden_layers"] = spec.hf_layers
    values.pop("torch_dtype", None)  # the engines build fp32 and let the precision policy decide
    model_type = values.pop("model_type")
    config = AutoConfig.for_model(model_type, **values)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    return config


def causal_lm_class(config: Any) -> type[nn.Module]:
    """Return a subclass of the config's causal-LM class whose ``forward(input_ids)`` returns logits."""
    import transformers

    base = getattr(transformers, config.architectures[0])

    class LogitsOnly(base):  # type: ignore[misc, valid-type]
        """``forward(input_ids [b, s]) -> logits [b, s, vocab]`` (the loop computes the loss)."""

        def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
            return super().forward(input_ids=input_ids, use_cache=False, **kwargs).logits

    LogitsOnly.__name__ = LogitsOnly.__qualname__ = base.__name__
    return LogitsOnly


def build_model(spec: Any, seed: int) -> nn.Module:
    """Return the causal LM for ``spec`` in fp32 on CPU, initialised from ``seed`` or loaded from
    ``spec.weights_dir``. Raises FileNotFoundError when ``weights_dir`` holds no safetensors file
    and ValueError when it lacks a weight the model needs."""
    config = hf_config(spec)
    # transformers initialises from torch's global generator; fork it so building a model
    # neither depends on nor disturbs anyone else's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = causal_lm_class(config)(config)
    if any(p.dtype != torch.float32 for p in model.parameters()):
        model.float()  # (skipped when already fp32: fake tensors, as in estimate --traced, cannot be swapped)
    if spec.weights_dir:
        load_weights(model, spec.weights_dir)
    return model


def load_weights(model: nn.Module, weights_dir: str) -> None:
    """Load the ``*.safetensors`` files in ``weights_dir`` into ``model`` (layers beyond the model's
    depth are skipped). Raises FileNotFoundError or ValueError (missing weights)."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(weights_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"model.weights_dir = {weights_dir!r}: no *.safetensors files")
    wanted = model.state_dict()
    loaded: dict[str, torch.Tensor] = {}
    for path in files:
        for name, tensor in load_file(path).items():
            if name in wanted:
                loaded[name] = tensor.float()
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(wanted) - set(loaded) - tied)
    if missing:
        raise ValueError(f"model.weights_dir = {weights_dir!r}: missing {len(missing)} weights, e.g. {missing[0]}")
    model.load_state_dict(loaded, strict=False)
    if tied:
        model.tie_weights()
