"""The user's model and data, checked when a preset loads, before anything starts (torch-free).

``check_inputs`` describes a model shardscope cannot know by itself (a Hugging Face config or model directory, a
module of the user's: ``core/model_check.py``, a subprocess) and checks the data against it: a token file's ids
and length (``core/token_files.py``), a tokenizer's vocabulary, a text file that is really tokens. The
descriptions go into the Comparison (``ModelSpec.described``, ``DataSpec.described``), so the ranks, the memory
model and every later command read the same facts. Every failure is one ``ConfigError`` line naming the file, the
key, the value and what is allowed.

``model_refusal`` says why a strategy cannot run the described model (no tensor-parallel plan it can apply, an
architecture AutoTP is not checked on); ``validate`` leaves such a run out, with that line, and runs the others.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from shardscope.core import model_facts, token_files
from shardscope.core.model_check import ModelCheckError, describe
from shardscope.core.registry import StrategyInfo
from shardscope.core.token_files import DataCheckError
from shardscope.presets.files import ConfigError
from shardscope.presets.schema import Comparison

KIND_NAMES = {"hf": "Hugging Face", "module": "nn.Module", "transformer": "built-in transformer", "vit": "ViT"}
BYTE_VOCAB = 256  # data.kind = "text" without a tokenizer: one token per byte


def check_inputs(c: Comparison) -> Comparison:
    """``c`` with its model and data described and checked; raises ConfigError (one line)."""
    src = c.source or "preset"
    m, d = c.model, c.data
    try:
        if model_facts.is_described(m):
            m = dataclasses.replace(m, described=describe(m, c.seed))
        vocab = model_facts.vocab_size(m) if model_facts.inputs(m) == "tokens" else 0
        window = m.seq_len + 1
        if d.kind == "tokens":
            d = dataclasses.replace(d, described=token_files.describe_tokens(d.path, d.dtype, vocab, c.global_batch,
                                                                             window))
        elif d.kind == "text":
            d = _text(d, vocab, c.global_batch, window)
    except (ModelCheckError, DataCheckError) as err:
        raise ConfigError(f"{src}: {err}") from None
    return dataclasses.replace(c, model=m, data=d)


def _text(d: Any, vocab: int, windows: int, window: int) -> Any:
    """A text file: through its tokenizer into a token cache, or as bytes; a token file given as text is refused."""
    if not os.path.isfile(d.path):
        raise DataCheckError(f"data.path = {d.path!r}: no such text file")
    if token_files.is_binary(d.path):
        raise DataCheckError(f"data.path = {d.path!r}: not UTF-8 text; a file of token ids is data.kind = 'tokens' "
                             "(nanoGPT .bin, llm.c shard, .npy)")
    if not d.tokenizer:
        if vocab < BYTE_VOCAB:
            raise DataCheckError(f"data.kind = 'text' without data.tokenizer reads bytes (ids 0..255): the model's "
                                 f"vocabulary is {vocab}; it must be at least {BYTE_VOCAB}")
        size = os.path.getsize(d.path)
        if size < window:
            raise DataCheckError(f"data.path = {d.path!r}: {size} bytes, need at least seq_len + 1 = {window}")
        return dataclasses.replace(d, described={"format": "bytes", "path": d.path, "tokens": size,
                                                 "sha256": token_files.content_hash(d.path)[0]})
    cache, tokenizer_vocab = token_files.tokenize_text(d.path, d.tokenizer)
    if tokenizer_vocab > vocab:
        raise DataCheckError(f"data.tokenizer = {d.tokenizer!r}: its vocabulary has {tokenizer_vocab:,} tokens, more "
                             f"than the model's {vocab:,}")
    described = token_files.describe_tokens(cache, "uint32", vocab, windows, window)
    text_hash = token_files.content_hash(d.path)[0]
    return dataclasses.replace(d, described={**described, "text": d.path, "text_sha256": text_hash,
                                             "tokenizer": d.tokenizer, "tokenizer_vocab": tokenizer_vocab})


def model_refusal(c: Comparison, info: StrategyInfo) -> str:
    """Why ``info``'s strategy cannot run the comparison's described model ("" when it can, or when the model is
    one of shardscope's own, whose limits validation states as errors)."""
    if not model_facts.is_described(c.model):
        return ""
    d = model_facts.description(c.model)
    if c.model.kind not in info.models:
        return f"it runs {' and '.join(KIND_NAMES.get(k, k) for k in info.models)} models only"
    for need in info.model_needs:
        reason = str(d.get(f"{need}_refusal") or "")
        if reason:
            return reason
    return ""
