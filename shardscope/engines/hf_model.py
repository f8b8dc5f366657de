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
from shardscope.engines.hf_pipeline import FACTS_ATTR
from shardscope.engines.parallelize import BLOCKS_ATTR, declared_blocks
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
    # transformers' own class with only forward narrowed: its checkpoint conversions (key renames such as GPT-NeoX's
    # embed_out -> lm_head, merged expert tensors) apply to it, which transformers skips for classes defined elsewhere
    LogitsOnly.__module__ = base.__module__
    return LogitsOnly


def build_model(spec: Any, seed: int) -> nn.Module:
    """Return the causal LM for ``spec`` in fp32 on CPU, initialised from ``seed``, or holding the weights of the
    ``*.safetensors`` files beside ``spec.path``'s config. Raises FileNotFoundError or ValueError for weights that
    do not fit the config (the model check names them before the start)."""
    config = hf_config(spec)
    files = weight_files(spec.path) if spec.path else []
    if files:
        model = load_weights(spec, config, seed)
    else:
        # transformers initialises from torch's global generator; fork it so building a model
        # neither depends on nor disturbs anyone else's random state.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = causal_lm_class(config)(config)
    if any(p.dtype != torch.float32 for p in model.parameters()):
        model.float()  # (skipped when already fp32: fake tensors, as in estimate --traced, cannot be swapped)
    model.eval()  # dropout off, as transformers' from_pretrained leaves a model: every strategy computes one function
    blocks = find_blocks(model, getattr(spec, "blocks", ""))[0]
    setattr(model, BLOCKS_ATTR, blocks)
    described = getattr(spec, "described", None) or {}
    facts = described.get("pipeline")
    if facts and not facts.get("refusal"):  # for pipeline stages (engines/hf_pipeline.py)
        setattr(model, FACTS_ATTR, {**facts, "blocks": blocks, "vocab": int(described.get("vocab_size") or 0),
                                    "width": int(described.get("block_width") or described.get("hidden_size") or 0)})
    if spec.path:  # a config of the user's: tensor parallelism follows its own plan (tp_plan.plan_of), or refuses
        setattr(model, TP_PLAN_ATTR, dict(getattr(model, "_tp_plan", None) or {}))
    model.seq_len = int(spec.seq_len)  # as the built-in transformer carries it: pipeline stages size their buffers by it
    return model


def find_blocks(model: nn.Module, declared: str = "") -> tuple[str, nn.ModuleList]:
    """(attribute path, ModuleList) of a Hugging Face model's decoder layers, held by identity before anything wraps
    the model: ``declared`` (the preset's ``model.blocks``) when given; else the outermost ``ModuleList`` whose every
    element is of a ``_no_split_modules`` class (its own decoder layers: ``model.layers``, ``transformer.h``,
    ``gpt_neox.layers``, ``model.decoder.layers``, ``backbone.layers``, ...); else the ``ModuleList`` holding the most
    parameters. Raises ValueError (one line) when there is none."""
    if declared:
        return declared, declared_blocks(model, declared)
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    for name, module in lists:  # module order: outermost first
        if no_split and all(any(c.__name__ in no_split for c in type(b).__mro__) for b in module):
            return name, module
    sized = [(sum(p.numel() for p in m.parameters()), -i, name, m) for i, (name, m) in enumerate(lists)]
    if not sized or max(sized)[0] == 0:
        raise ValueError(f"{type(model).__name__} holds no nn.ModuleList of decoder layers; give model.blocks, the "
                         "attribute path of its layers (e.g. \"model.layers\")")
    _, _, name, module = max(sized, key=lambda t: (t[0], t[1]))
    return name, module


INDEX = "model.safetensors.index.json"


def weight_files(path: str) -> list[str]:
    """The checkpoint beside a model's config: the files its ``model.safetensors.index.json`` lists (a sharded
    checkpoint), else every ``*.safetensors`` in the folder; [] for a config alone."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh).get("weight_map") or {}
        names = sorted({str(f) for f in weight_map.values()})
        outside = [f for f in names if os.path.basename(f) != f or f in ("", ".", "..")]
        if outside:  # every file read stays inside the folder the user named
            raise ValueError(f"{INDEX} names {outside[0]!r}, a file outside the model's folder; its shards must be "
                             "file names in that folder")
        return [os.path.join(folder, f) for f in names]
    return sorted(glob.glob(os.path.join(glob.escape(folder), "*.safetensors")))


def load_weights(spec: Any, config: Any, seed: int) -> nn.Module:
    """The causal LM for ``config`` holding the checkpoint beside ``spec.path``, loaded by transformers'
    ``from_pretrained`` (its key renames, merged tensors and tied weights; layers beyond the config's depth are left
    unread, nothing is fetched). Raises ValueError naming a missing weight or a shape that differs from the config's."""
    cls = causal_lm_class(config)
    folder = spec.path if os.path.isdir(spec.path) else os.path.dirname(os.path.abspath(spec.path))
    import transformers

    verbosity, bars = transformers.logging.get_verbosity(), transformers.utils.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()  # its table of the deeper layers left unread is not the user's error
    transformers.utils.logging.disable_progress_bar()  # nor is a progress bar in every rank's log
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model, info = cls.from_pretrained(folder, config=config, dtype=torch.float32, local_files_only=True,
                                              use_safetensors=True, output_loading_info=True,
                                              ignore_mismatched_sizes=True,  # then named below, with both shapes
                                              attn_implementation=config._attn_implementation)
    except (OSError, RuntimeError) as err:
        raise ValueError(f"the checkpoint in {folder} could not be loaded: {_first_line(err)}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()
    mismatched = sorted(info.get("mismatched_keys") or (), key=str)
    if mismatched:
        first = mismatched[0]
        if isinstance(first, (tuple, list)) and len(first) == 3:
            name, got, want = first
            raise ValueError(f"{name} has shape {list(got)}, the config gives {list(want)}")
        raise ValueError(f"the checkpoint's {first} has another shape than the config gives")
    missing = sorted(set(info.get("missing_keys") or ()) - tied_names(model) - non_persistent(model))
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} weights the config needs, e.g. {missing[0]}")
    return model


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0][:300] if lines else type(err).__name__


def tied_names(model: nn.Module) -> set[str]:
    """State-dict names that share a tensor with an earlier one (tied output and input embeddings): a checkpoint
    holds them once."""
    seen: set[int] = set()
    out = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            out.add(name)
        seen.add(id(p))
    return out


def checkpoint_names(model: nn.Module) -> Any:
    """A function from a checkpoint key to (the model's name for it, whether a converter builds it from several
    keys), as transformers renames keys when it loads (``conversion_mapping``); the identity on a transformers
    without conversions."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:
        return lambda key: (key, False)
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    wanted = {n: True for n in model.state_dict()}
    prefix = getattr(model, "base_model_prefix", None) or None

    def rename(key: str) -> tuple[str, bool]:
        name, converted = rename_source_key(key, renamings, converters, prefix, wanted)
        return name, converted is not None
    return rename


def non_persistent(model: nn.Module) -> set[str]:
    """State-dict names a checkpoint need not hold: buffers the model computes itself (rotary frequencies)."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return {n for n in model.state_dict() if n not in params}
