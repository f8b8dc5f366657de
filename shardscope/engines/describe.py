"""The model check: a user's model described from the real module with fake tensors, before anything starts.

``python -m shardscope.engines.describe`` reads ``{"model": <[model] table>, "seed": S}`` as JSON on standard
input and prints one JSON object: ``{"described": {...}}`` or ``{"error": "one line"}``. The command line runs it
once per model (``core/model_check.py``; it stays torch-free and never imports the user's code); the ranks build
the same module for real.

What it finds, with nothing allocated (torch's ``FakeTensorMode``: shapes and dtypes, no storage):
- every parameter's name and shape (shared tensors once), the unit it belongs to (``layers.<i>.`` for the i-th
  block, ``root`` otherwise), its tensor-parallel split from the model's own plan, the embeddings and tied names;
- the blocks (a Hugging Face model's ``_no_split_modules`` class, a module's declared ``ModuleList``);
- the model's own tensor-parallel plan, or why shardscope cannot apply it;
- one training step at batch 1 (forward, the loop's loss, backward): the output's shape checked against what the
  loop needs, FLOPs per sample counted by ``torch.utils.flop_counter.FlopCounterMode``, and the bytes of the
  tensors autograd saves for backward (parameters left out), with and without per-block recomputation;
- for a Hugging Face directory with ``*.safetensors``: every weight the config needs is in the checkpoint with the
  config's shape (read from the files' headers, no tensor loaded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from shardscope.config import ModelSpec
from shardscope.engines import hf_model, hf_pipeline, tp_plan
from shardscope.engines.module_pipeline import pipeline_facts
from shardscope.engines.user_module import UserModelError, build_model as build_user_module, find_blocks

# DeepSpeed AutoTP's parity with DDP and its exact memory and communication counts, proven per Hugging Face
# model_type by tests/test_user_models.py (Llama, Gemma 2) and tests/test_layout_matrix.py (Qwen2); any other
# architecture is refused before the start with that reason.
AUTOTP_CHECKED = ("llama", "mistral", "gemma2", "qwen2")
AUTOTP_HEADS = ("lm_head", "embed_out")  # DeepSpeed 0.19's default lm_head_patterns


# Mixture-of-experts layers on fake tensors: transformers' default ``grouped_mm`` has a meta kernel that refuses
# fp32 (its CPU and CUDA kernels take it) and ``eager`` calls ``nonzero`` (a data-dependent shape), so the model
# check runs the experts as ``batched_mm``: the same parameters and the same matmul FLOPs, the experts' weights
# gathered per token. Those gathers are parameters' copies, not activations: ``_Gathers`` leaves them out of the
# saved bytes, as ``grouped_mm`` (what the ranks run) saves the weights themselves.
MOE_FAKE = "batched_mm"


class _Gathers(TorchFunctionMode):
    """Notes the storage of every tensor indexed out of a parameter (an expert's weight picked per token)."""

    def __init__(self, params: set[int], into: set[int]) -> None:
        super().__init__()
        self.ids, self.into = params, into

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.__getitem__ and args and id(args[0]) in self.ids and isinstance(out, torch.Tensor):
            self.into.add(out.untyped_storage()._cdata)
        return out


class DescribeError(ValueError):
    """A model that cannot be described; ``str(err)`` is one line."""


def build_fake(spec: ModelSpec, seed: int) -> nn.Module:
    """The model for ``spec`` built under ``FakeTensorMode`` (``fake_mode()``): every tensor has its shape, dtype and
    device but no storage, so a 7B model costs nothing. (Fake rather than meta tensors: transformers' mask code
    takes a fake tensor for tracing and skips its data-dependent checks, which a meta tensor fails.)"""
    if spec.kind == "hf":
        depth = int(hf_model.config_values(spec).get("num_hidden_layers") or 0)
        if spec.hf_layers > depth:
            raise DescribeError(f"model.hf_layers = {spec.hf_layers}: the config has {depth} decoder layers")
        config = hf_model.hf_config(spec)
        if MOE_FAKE:  # routed experts with static shapes on fake tensors (see MOE_FAKE); the same parameters
            with contextlib.suppress(AttributeError, ValueError, TypeError):
                config._experts_implementation = MOE_FAKE
        return hf_model.causal_lm_class(config)(config).eval()  # as the ranks build it: dropout off
    # a "package.module:build" entry is found from the folder the command runs in, named here explicitly: this
    # interpreter keeps the working directory off sys.path (core/bounded.SAFE_PATH); the ranks use the same folder
    return build_user_module(dataclasses.replace(spec, described={"import_root": os.getcwd()}), seed)


def fake_mode() -> Any:
    """The fake-tensor mode the model is built and stepped in."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def _units(named: list[tuple[str, torch.Tensor]], blocks_path: str, n_blocks: int) -> dict[str, str]:
    out = {}
    for name, _ in named:
        unit = "root"
        if name.startswith(blocks_path + "."):
            index = name[len(blocks_path) + 1:].split(".", 1)[0]
            if index.isdigit() and int(index) < n_blocks:
                unit = f"layers.{index}."
        out[name] = unit
    return out


def _split(name: str, plan: dict[str, str]) -> str:
    module, _, leaf = name.rpartition(".")
    for pattern, style in plan.items():
        if tp_plan._matches(pattern, module):
            style = tp_plan.STYLES.get(style, style)
            if style == tp_plan.ROWWISE:
                return "" if leaf == "bias" else "row"
            return "col"
    return ""


def _sample(spec: ModelSpec) -> tuple[torch.Tensor, str]:
    if spec.kind == "module" and spec.inputs == "images":
        return torch.zeros(1, spec.channels, spec.image_size, spec.image_size), "images"
    return torch.zeros(1, spec.seq_len, dtype=torch.long), "tokens"


class _Saved:
    """Bytes of the tensors autograd saves for backward, each storage once, parameters left out; those saved
    while no block runs are counted apart (they stay when blocks are recomputed)."""

    def __init__(self, model: nn.Module, blocks: nn.ModuleList) -> None:
        self.params = {p.untyped_storage()._cdata for p in model.parameters()}
        self.total: dict[int, int] = {}
        self.outside: dict[int, int] = {}
        self.block_inputs = 0
        self.width = 0  # the last dimension of the first block's input: the residual stream's width
        self.depth = 0
        self.handles = []
        for block in blocks:
            self.handles.append(block.register_forward_pre_hook(self._enter))
            self.handles.append(block.register_forward_hook(self._leave))

    def _enter(self, module: nn.Module, args: Any) -> None:
        if self.depth == 0:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if first is not None:
                self.block_inputs += first.numel() * first.element_size()
                self.width = self.width or int(first.shape[-1])
        self.depth += 1

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.params:
            self.total[key] = storage.nbytes()
            if self.depth == 0:
                self.outside[key] = storage.nbytes()
        return t

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _attention_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
    """FLOPs of attention's two matmuls (QK^T and the weights times V), for every query head (grouped key/value
    heads are shared, not fewer matmuls), causal masking not subtracted: as torch counts its other SDPA kernels."""
    b, heads, s_q, d = query_shape[0], query_shape[1], query_shape[-2], query_shape[-1]
    return 2 * b * heads * s_q * key_shape[-2] * (d + value_shape[-1])


def _attention_backward_flops(grad_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                              **kwargs: Any) -> int:
    """Backward of attention: four matmuls of the forward's sizes (dV, dP, dQ, dK), twice its FLOPs."""
    return 2 * _attention_flops(query_shape, key_shape, value_shape)


def flop_counter() -> Any:
    """torch's ``FlopCounterMode``, also counting the CPU flash-attention kernel SDPA dispatches to on CPU (torch
    2.13 counts the CUDA kernels only; without this a model's attention FLOPs would be missing)."""
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    mapping = {}
    for name, fn in (("_scaled_dot_product_flash_attention_for_cpu", _attention_flops),
                     ("_scaled_dot_product_flash_attention_for_cpu_backward", _attention_backward_flops)):
        op = getattr(aten, name, None)
        if op is not None:
            mapping[op] = fn  # the overload packet: FlopCounterMode looks ops up by packet
    return FlopCounterMode(display=False, custom_mapping=mapping)


def training_step(model: nn.Module, spec: ModelSpec, blocks: nn.ModuleList) -> dict[str, Any]:
    """One step at batch 1 with fake tensors: the output checked, FLOPs counted, saved bytes measured."""
    x, kind = _sample(spec)
    saved = _Saved(model, blocks)
    try:
        stacked = {id(p) for p in model.parameters() if p.dim() == 3}  # experts' weights, stacked: only they gather
        gathers = _Gathers(stacked, saved.params) if stacked else contextlib.nullcontext()
        with flop_counter() as counter, torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), gathers:
            out = model(x)
            if not isinstance(out, torch.Tensor):
                raise DescribeError(f"forward returned a {type(out).__name__}; it must return the logits tensor")
            if kind == "tokens" and (out.dim() != 3 or tuple(out.shape[:2]) != (1, spec.seq_len)):
                raise DescribeError(f"forward(tokens [1, {spec.seq_len}]) returned shape {list(out.shape)}; it must "
                                    f"return logits [1, {spec.seq_len}, vocab]")
            if kind == "images" and (out.dim() != 2 or out.shape[0] != 1):
                raise DescribeError(f"forward(images [1, {spec.channels}, {spec.image_size}, {spec.image_size}]) "
                                    f"returned shape {list(out.shape)}; it must return logits [1, classes]")
            if not out.is_floating_point():
                raise DescribeError(f"forward returned {out.dtype} values; logits must be floating point")
            target = torch.zeros(out.shape[:-1], dtype=torch.long)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), target.reshape(-1))
            loss.backward()
    finally:
        saved.close()
    classes = int(out.shape[-1])
    return {
        "vocab_size": classes if kind == "tokens" else 0,
        "num_classes": classes if kind == "images" else 0,
        "train_flops_per_sample": float(counter.get_total_flops()),
        "saved_bytes_per_sample": sum(saved.total.values()),
        # per-block recomputation keeps each block's input and what is saved outside the blocks
        "checkpointed_bytes_per_sample": sum(saved.outside.values()) + saved.block_inputs,
        "logits_bytes_per_sample": out.numel() * 4,
        "block_width": saved.width,
    }


def _hf_dims(model: nn.Module) -> dict[str, Any]:
    cfg = model.config
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    return {
        "model_type": str(cfg.model_type),
        "config_layers": int(getattr(cfg, "num_hidden_layers", 0) or 0),
        "hidden_size": hidden,
        "heads": heads,
        "kv_heads": int(getattr(cfg, "num_key_value_heads", 0) or heads),
        "head_dim": int(getattr(cfg, "head_dim", 0) or (hidden // heads if heads else 0)),
        "ffn_size": int(getattr(cfg, "intermediate_size", 0) or 0),
        "sliding_window": int(getattr(cfg, "sliding_window", 0) or 0),
        "attention": str(getattr(cfg, "_attn_implementation", "") or ""),
    }


def check_weights(model: nn.Module, spec: ModelSpec) -> dict[str, Any] | None:
    """The checkpoint beside a Hugging Face config, checked against the model from its headers: None for a config
    alone. Raises DescribeError naming a missing weight or a shape that differs from the config's."""
    from safetensors import safe_open

    try:
        files = hf_model.weight_files(spec.path)
    except ValueError as err:  # an index naming files outside the folder: refused before any is read
        raise DescribeError(str(err)) from None
    if not files:
        return None
    wanted = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    rename = hf_model.checkpoint_names(model)  # as transformers renames a checkpoint's keys when it loads them
    found: dict[str, tuple[int, ...] | None] = {}
    for path in files:
        if not os.path.isfile(path):
            raise DescribeError(f"{hf_model.INDEX} lists {os.path.basename(path)}, which is not in the folder")
        try:
            with safe_open(path, framework="pt") as fh:
                for key in fh.keys():
                    name, converted = rename(key)
                    if name in wanted:  # a converter's target is built from several keys: its shape is theirs combined
                        found[name] = None if converted else tuple(fh.get_slice(key).get_shape())
        except Exception as err:  # a damaged or foreign file: one line
            raise DescribeError(f"{os.path.basename(path)}: not a readable safetensors file ({err})") from None
    for name, shape in found.items():
        if shape is not None and shape != wanted[name]:
            raise DescribeError(f"weights do not match the config: {name} has shape {list(shape)} in the checkpoint, "
                                f"{list(wanted[name])} from the config")
    missing = sorted(set(wanted) - set(found) - hf_model.tied_names(model) - hf_model.non_persistent(model))
    if missing:
        raise DescribeError(f"weights do not match the config: the checkpoint lacks {len(missing)} weights the model "
                            f"needs, e.g. {missing[0]}")
    return {"files": [os.path.basename(f) for f in files], "bytes": sum(os.path.getsize(f) for f in files)}


def autotp_refusal(model_type: str, tp_refusal: str) -> str:
    """Why DeepSpeed AutoTP cannot be compared on this architecture ("" when it can). AutoTP follows the model's own
    tensor-parallel plan (DeepSpeed 0.19 rejects one with other styles than column and row splits); parity with DDP
    is checked on the families in ``AUTOTP_CHECKED``."""
    if tp_refusal:
        return f"DeepSpeed AutoTP follows the model's own tensor-parallel plan, and {tp_refusal}"
    if model_type not in AUTOTP_CHECKED:
        return f"DeepSpeed AutoTP is checked on {', '.join(AUTOTP_CHECKED)}, not on {model_type}"
    return ""


def _untied_head(model: nn.Module, kept: set[str]) -> str:
    """The weight of an output layer with its own parameter, named as DeepSpeed AutoTP finds it (lm_head, embed_out:
    in training it splits that layer by vocabulary and gathers the logits); "" when tied or named otherwise."""
    for name, module in model.named_modules():
        if name.split(".")[-1] in AUTOTP_HEADS and isinstance(module, nn.Linear) and f"{name}.weight" in kept:
            return f"{name}.weight"
    return ""


def describe(spec: ModelSpec, seed: int) -> dict[str, Any]:
    """The description of the model ``spec`` names (see the module's docstring). Raises DescribeError,
    UserModelError, OSError or ValueError with a one-line message."""
    with fake_mode():
        return _describe(spec, seed)


def _describe(spec: ModelSpec, seed: int) -> dict[str, Any]:
    model = build_fake(spec, seed)
    if spec.kind == "hf":
        try:
            blocks_path, blocks = hf_model.find_blocks(model, spec.blocks)
        except ValueError as err:
            raise DescribeError(str(err)) from None
        dims = _hf_dims(model)
        declared = tp_plan.declared_plan(model)
    else:
        blocks_path, blocks = find_blocks(model, spec.blocks)
        dims = {}  # a module has no config: its width is what its blocks take (the training step finds it)
        declared = tp_plan.declared_plan(model)
    named = list(model.named_parameters())
    all_names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    kept = {n for n, _ in named}
    modules = [n for n, _ in model.named_modules()]
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    plan, tp_refusal = tp_plan.usable_plan(declared, modules, linears)
    tp_refusal = tp_refusal.replace("the model declares", "this model declares")
    units = _units(named, blocks_path, len(blocks))
    embeddings = sorted(f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Embedding)
                        and f"{n}.weight" in kept)
    params = [[n, list(p.shape), units[n], _split(n, plan)] for n, p in named]
    step = training_step(model, spec, blocks)
    out: dict[str, Any] = {
        "family": type(model).__name__,
        "params": params,
        "param_count": sum(p.numel() for _, p in named),
        "blocks": blocks_path,
        "block_class": type(blocks[0]).__name__,
        "n_blocks": len(blocks),
        "embeddings": embeddings,
        "tied": sorted(set(all_names) - kept),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
        "tp_plan": plan,
        "tp_plan_refusal": tp_refusal,
        "inputs": "images" if spec.kind == "module" and spec.inputs == "images" else "tokens",
        **dims,
        **step,
    }
    out["hidden_size"] = out.get("hidden_size") or out["block_width"]
    if out["inputs"] == "tokens":
        out["tokens_per_sample"] = spec.seq_len
    if spec.kind == "hf":
        out["autotp_refusal"] = autotp_refusal(dims["model_type"], tp_refusal)
        out["untied_head"] = _untied_head(model, kept)
        out["weights"] = check_weights(model, spec)
        out["pipeline"] = hf_pipeline.facts(model, blocks_path, blocks, _sample(spec)[0])
    else:
        out["autotp_refusal"] = "DeepSpeed AutoTP needs a Hugging Face model"
        out["weights"] = None
        out["import_root"] = os.getcwd()
        if out["inputs"] == "tokens":  # what pre_blocks and post_blocks touch, for pipeline stages
            out["pipeline"] = pipeline_facts(model, blocks_path, blocks, _sample(spec)[0],
                                             (1, spec.seq_len, out["vocab_size"]))
    return out


def main() -> int:
    """Read the request on standard input, print the description (or the error) as one JSON object."""
    request = json.load(sys.stdin)
    names = {f.name for f in dataclasses.fields(ModelSpec)}
    spec = ModelSpec(**{k: v for k, v in request["model"].items() if k in names})
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the user's prints never reach the JSON
            result: dict[str, Any] = {"described": describe(spec, int(request.get("seed", 0)))}
    except (DescribeError, UserModelError) as err:
        result = {"error": str(err)}
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, AttributeError, ImportError) as err:
        text = str(err).strip().splitlines()
        result = {"error": f"{type(err).__name__}: {text[0][:300] if text else ''}"}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
