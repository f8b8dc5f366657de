"""A Hugging Face causal LM built from a config (never downloaded), returning logits.

``build_model(spec, seed)`` builds the causal LM the config's ``architectures`` names (Llama, Mistral, Qwen2/3,
Gemma 2, Phi-3, OLMo 2, ...) from ``spec.path`` (a local model directory or its config.json) or from a built-in
architecture (``hf_archs.ARCHS[spec.hf_arch]``), with ``num_hidden_layers = spec.hf_layers`` (0: all),
initialised from ``seed``. With ``*.safetensors`` beside the config (one file, or sharded with
``model.safetensors.index.json``) it loads those weights, reading only the first ``hf_layers`` decoder layers.

The model keeps Hugging Face's module layout (``model.embed_tokens``, ``model.layers``,
``lm_head``), so strategies find its blocks at ``model.model.layers`` and DeepSpeed AutoTP
recognises it; only ``forward`` is narrowed to ``forward(input_ids) -> logits``.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch
from torch import nn

from shardscope.core.hf_archs import ARCHS
from shardscope.engines.tp_plan import TP_PLAN_ATTR


def config_values(spec: Any) -> dict[str, Any]:
    """The config's values: a built-in architecture's (``hf_archs``), or the JSON of ``spec.path`` (a model
    directory's config.json, or the file itself). Raises OSError or ValueError for a file that cannot be read."""
    if not spec.path:
        return dict(ARCHS[spec.hf_arch])
    file = config_file(spec.path)
    with open(file, encoding="utf-8") as fh:
        values = json.load(fh)
    if not isinstance(values, dict):
        raise ValueError(f"{file}: not a JSON object")
    return values


def config_file(path: str) -> str:
    """The config.json a ``model.path`` names: the file itself, or ``config.json`` in the directory."""
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def hf_config(spec: Any) -> Any:
    """Return the ``transformers`` config for ``spec``: its values with ``num_hidden_layers`` cut to
    ``hf_layers`` (0 keeps them all).

    Attention runs through SDPA where the architecture supports it (no flash-attention build needed on CPU), else
    eager; the KV cache is off (training). Raises KeyError for an unknown ``hf_arch``, ValueError for a config transformers does not know.
    """
    from transformers import AutoConfig

    values = config_values(spec)
    if spec.hf_layers:
        values["num_hidden_layers"] = spec.hf_layers
    values.pop("torch_dtype", None)  # the engines build fp32 and let the precision policy decide
    values.pop("dtype", None)
    values.pop("quantization_config", None)  # trained here in the run's precision, never quantized
    model_type = values.pop("model_type", None)
    if not model_type:
        raise ValueError("config has no model_type")
    config = AutoConfig.for_model(model_type, **values)
    config.use_cache = False
    # SDPA where the architecture has it (no flash-attention build needed on CPU), else transformers' eager attention
    config._attn_implementation = "sdpa" if getattr(causal_lm_base(config), "_supports_sdpa", False) else "eager"
    return config


def causal_lm_base(config: Any) -> type[nn.Module]:
    """The causal-LM class for ``config``: the first of its ``architectures`` that transformers has and that ends in
    ``ForCausalLM``, else the one ``AutoModelForCausalLM`` maps its config class to. Raises ValueError naming the
    architecture when transformers has no causal LM for it."""
    import transformers

    names = [str(n) for n in (getattr(config, "architectures", None) or [])]
    for name in names:
        cls = getattr(transformers, name, None)
        if cls is not None and name.endswith("ForCausalLM"):
            return cls
    try:
        return transformers.AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise ValueError(f"architectures {names or '(none)'} (model_type {config.model_type!r}): transformers "
                         f"{transformers.__version__} has no causal LM for it; shardscope trains decoder-only causal "
                         "LMs (LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM, ...)") from None


def causal_lm_class(config: Any) -> type[nn.Module]:
    """Return a subclass of the config's causal-LM class whose ``forward(input_ids)`` returns logits."""
    base = causal_lm_base(config)

    class LogitsOnly(base):  # type: ignore[misc, valid-type]
        """``forward(input_ids [b, s]) -> logits [b, s, vocab]`` (the loop computes the loss)."""

        def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
            return super().forward(input_ids=input_ids, use_cache=False, **kwargs).logits

    LogitsOnly.__name__ = LogitsOnly.__qualname__ = base.__name__
    return LogitsOnly


def build_model(spec: Any, seed: int) -> nn.Module:
    """Return the causal LM for ``spec`` in fp32 on CPU, initialised from ``seed``, or holding the weights of the
    ``*.safetensors`` files beside ``spec.path``'s config. Raises FileNotFoundError or ValueError for weights that
    do not fit the config (the model check names them before the start)."""
    config = hf_config(spec)
    # transformers initialises from torch's global generator; fork it so building a model
    # neither depends on nor disturbs anyone else's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = causal_lm_class(config)(config)
    if any(p.dtype != torch.float32 for p in model.parameters()):
        model.float()  # (skipped when already fp32: fake tensors, as in estimate --traced, cannot be swapped)
    files = weight_files(spec.path) if spec.path else []
    if files:
        load_weights(model, files)
    if spec.path:  # a config of the user's: tensor parallelism follows its own plan (tp_plan.plan_of), or refuses
        setattr(model, TP_PLAN_ATTR, dict(getattr(model, "_tp_plan", None) or {}))
    model.seq_len = int(spec.seq_len)  # as the built-in transformer carries it: pipeline stages size their buffers by it
    return model


INDEX = "model.safetensors.index.json"


def weight_files(path: str) -> list[str]:
    """The checkpoint beside a model's config: the files its ``model.safetensors.index.json`` lists (a sharded
    checkpoint), else every ``*.safetensors`` in the folder; [] for a config alone."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh).get("weight_map") or {}
        return [os.path.join(folder, f) for f in sorted(set(weight_map.values()))]
    return sorted(glob.glob(os.path.join(glob.escape(folder), "*.safetensors")))


def load_weights(model: nn.Module, files: list[str]) -> None:
    """Load the tensors ``model`` needs from ``files`` (layers beyond the model's depth are never read).
    Raises ValueError naming a missing weight or a shape that differs from the config's."""
    from safetensors import safe_open

    wanted = model.state_dict()
    loaded: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as fh:
            for name in fh.keys():
                if name in wanted:
                    tensor = fh.get_tensor(name)
                    if tuple(tensor.shape) != tuple(wanted[name].shape):
                        raise ValueError(f"{os.path.basename(path)}: {name} has shape {list(tensor.shape)}, the "
                                         f"config gives {list(wanted[name].shape)}")
                    loaded[name] = tensor.float()
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(wanted) - set(loaded) - tied - non_persistent(model))
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} weights the config needs, e.g. {missing[0]}")
    model.load_state_dict(loaded, strict=False)
    if tied:
        model.tie_weights()


def non_persistent(model: nn.Module) -> set[str]:
    """State-dict names a checkpoint need not hold: buffers the model computes itself (rotary frequencies)."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return {n for n in model.state_dict() if n not in params}
