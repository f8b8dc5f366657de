"""What every room asks of a run's model, answered the same way for every kind (torch-free).

A model's figures come from one of two places: shardscope's own models (the built-in transformer, the ViT, a
built-in Hugging Face architecture in ``hf_archs``) are known from the preset's keys; the user's (a Hugging Face
config or model directory, a module of their own) from the description the model check made of the real module
on the meta device (``ModelSpec.described``, written by ``engines/describe.py``, kept in comparison.json). The
functions here read whichever applies, so no caller branches on the kind for the vocabulary, the depth, the width
or the attention heads.
"""

from __future__ import annotations

from typing import Any

from shardscope.core.hf_archs import ARCHS


def is_described(m: Any) -> bool:
    """True for a model whose shapes come from the model check: a Hugging Face model from a path, or a module."""
    return m.kind == "module" or (m.kind == "hf" and bool(m.path))


def description(m: Any) -> dict[str, Any]:
    """The model check's description of ``m``; raises ValueError when a model that needs one has none (a
    Comparison built by hand, or loaded without its check)."""
    if not m.described:
        where = m.path if m.kind == "hf" else m.entry
        raise ValueError(f"model.kind = {m.kind!r} ({where}): not described; load it through config.load_preset, "
                         "which runs the model check")
    return m.described


def _arch(m: Any) -> dict[str, Any]:
    return ARCHS[m.hf_arch]


def hf_layers(m: Any) -> int:
    """Decoder layers a built-in Hugging Face architecture keeps: ``hf_layers``, or all of them for 0."""
    return m.hf_layers or int(_arch(m)["num_hidden_layers"])


def vocab_size(m: Any) -> int:
    """Token ids the model takes (0 for an image model)."""
    if is_described(m):
        return int(description(m).get("vocab_size") or 0)
    if m.kind == "hf":
        return int(_arch(m)["vocab_size"])
    return 0 if m.kind == "vit" else int(m.vocab_size)


def inputs(m: Any) -> str:
    """What the model's forward takes: "tokens" or "images"."""
    if m.kind == "vit":
        return "images"
    return m.inputs if m.kind == "module" else "tokens"


def layers(m: Any) -> int:
    """The model's blocks: the units FSDP wraps and tensor parallelism splits."""
    if is_described(m):
        return int(description(m)["n_blocks"])
    return hf_layers(m) if m.kind == "hf" else int(m.n_layers)


def hidden_size(m: Any) -> int:
    """Width of the residual stream (0 where the model check could not tell: a module without a config)."""
    if is_described(m):
        return int(description(m).get("hidden_size") or 0)
    return int(_arch(m)["hidden_size"]) if m.kind == "hf" else int(m.d_model)


def heads(m: Any) -> tuple[int, int]:
    """(query heads, key/value heads); (0, 0) where unknown."""
    if is_described(m):
        d = description(m)
        return int(d.get("heads") or 0), int(d.get("kv_heads") or d.get("heads") or 0)
    if m.kind == "hf":
        a = _arch(m)
        return int(a["num_attention_heads"]), int(a["num_key_value_heads"])
    return int(m.n_heads), int(m.n_heads)


def ffn_size(m: Any) -> int:
    """Width of the feed-forward layer (0 where unknown)."""
    if is_described(m):
        return int(description(m).get("ffn_size") or 0)
    return int(_arch(m)["intermediate_size"]) if m.kind == "hf" else int(m.d_ff)


def tokens_per_sample(m: Any) -> int:
    """Positions a sample carries through the blocks: its sequence, or an image's patches (a ViT has no class
    token); a module taking images: the positions its description counted (0 when it could not tell)."""
    if m.kind == "vit":
        return (m.image_size // m.patch_size) ** 2
    if inputs(m) == "images":
        return int(description(m).get("tokens_per_sample") or 0)
    return int(m.seq_len)


def tied_embeddings(m: Any) -> bool:
    """True when the output layer shares the input embedding's weight."""
    if is_described(m):
        return bool(description(m).get("tied"))
    return m.kind == "hf" and bool(_arch(m).get("tie_word_embeddings", False))


def hf_config_value(m: Any, key: str) -> Any:
    """A Hugging Face model's config value as the model check read it (``model_type``, ``sliding_window``,
    ``attention``), or a built-in architecture's; None for another kind or a key it does not hold."""
    if m.kind != "hf":
        return None
    return description(m).get(key) if is_described(m) else _arch(m).get(key)


def untied_head(m: Any) -> str:
    """The output layer's weight when it is a parameter of its own ("lm_head.weight"), "" when tied or absent (a
    Hugging Face model described by the model check; the built-in architectures are tied)."""
    if is_described(m):
        return str(description(m).get("untied_head") or "")
    return ""


def label(m: Any) -> str:
    """One line naming the model, for listings and the report's first lines."""
    if is_described(m):
        d = description(m)
        params = d.get("param_count")
        size = f", {params / 1e6:,.1f} M parameters" if isinstance(params, (int, float)) else ""
        where = m.path if m.kind == "hf" else m.entry
        weights = "its weights" if d.get("weights") else "random init from the seed"
        return f"{d.get('family', m.kind)} from {where} ({d['n_blocks']} blocks{size}, {weights})"
    if m.kind == "hf":
        return f"Hugging Face {m.hf_arch} ({hf_layers(m)} layers, random init from the seed)"
    if m.kind == "vit":
        return (f"built-in ViT ({m.n_layers} layers, {m.d_model} wide, {m.image_size}px images in "
                f"{m.patch_size}px patches, {m.num_classes} classes)")
    return (f"built-in transformer ({m.n_layers} layers, {m.d_model} wide, {m.n_heads} heads, vocabulary "
            f"{m.vocab_size}, sequence {m.seq_len})")


def data_label(d: Any, m: Any) -> str:
    """One line naming the data a comparison reads (the file, its format and content hash where it is a file)."""
    found = d.described or {}
    digest = f", sha256 {str(found['sha256'])[:16]}…" if found.get("sha256") else ""
    if d.kind == "tokens":
        return f"tokens from {d.path} ({found.get('format', '?')}, {int(found.get('tokens', 0)):,} tokens{digest})"
    if d.kind == "text" and d.tokenizer:
        text_digest = f", sha256 {str(found['text_sha256'])[:16]}…" if found.get("text_sha256") else ""
        return (f"text from {d.path}{text_digest} through {d.tokenizer} ({int(found.get('tokens', 0)):,} tokens, "
                f"vocabulary {found.get('tokenizer_vocab', '?')})")
    if d.kind == "text":
        return f"bytes of {d.path} ({int(found.get('tokens', 0)):,} bytes{digest})"
    if d.kind == "images":
        return "synthetic images (a fixed pattern per class plus noise)"
    return f"synthetic tokens (a fixed Markov chain over the model's {vocab_size(m):,} ids)"


def short_label(m: Any, d: Any) -> str:
    """The model and data in a few words, for narrow tables (``shardscope presets``, the app's picker)."""
    if is_described(m):
        desc = description(m)
        model = f"{desc.get('family', m.kind)}, {desc['n_blocks']} blocks"
    elif m.kind == "hf":
        model = f"{m.hf_arch}, {hf_layers(m)} layers"
    elif m.kind == "vit":
        model = f"ViT {m.n_layers}×{m.d_model}, {m.image_size}px"
    else:
        model = f"transformer {m.n_layers}×{m.d_model}, vocab {m.vocab_size:,}"
    where = {"synthetic": "synthetic tokens", "images": "synthetic images"}.get(d.kind)
    if where is None:
        name = d.path.rsplit("/", 1)[-1]
        where = f"{name} ({'tokenizer' if d.tokenizer else 'bytes'})" if d.kind == "text" else f"tokens of {name}"
    seq = f", seq {m.seq_len}" if inputs(m) == "tokens" else ""
    return f"{model}{seq}; {where}"


def pipeline_facts(m: Any) -> dict[str, Any] | None:
    """What a described model (a user's module, a Hugging Face config or directory) runs before and after its
    blocks, as the model check found it (``{"first", "last", "refusal"}`` and, for Hugging Face, ``"tied"``:
    engines/module_pipeline.py, engines/hf_pipeline.py); None for a model whose stages shardscope builds by itself."""
    if not is_described(m):
        return None
    return dict(description(m).get("pipeline") or {"first": [], "last": [], "refusal": "not described for pipeline "
                                                   "stages (a module taking images)"})


def pipeline_units(m: Any, names: list[str]) -> list[str]:
    """The pipeline unit of each of the model's parameters (``names`` in module order): "embeddings", "layers.<i>"
    or "head" (core/pipeline_layout.py), a user's module's from its description."""
    from shardscope.core import pipeline_layout

    facts = pipeline_facts(m)
    if facts is None:
        return pipeline_layout.unit_names(names)
    return pipeline_layout.unit_names(names, blocks=str(description(m)["blocks"]),
                                      last=set(facts["last"]) - set(facts.get("tied") or ()))


def pipeline_tied(m: Any) -> list[str]:
    """Parameters both the first and the last pipeline stage hold (tied embeddings, their gradients summed)."""
    facts = pipeline_facts(m)
    return list(facts.get("tied") or ()) if facts is not None else []
