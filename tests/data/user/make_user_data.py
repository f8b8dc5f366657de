"""Writes the user-model and user-data fixtures beside this script (run once; the outputs are committed).

- ``<family>/config.json``: tiny configs of Llama (tied embeddings, as Llama 3.2 1B), Mistral, Qwen3, Gemma 2, Phi-3 and OLMo 2 (64 wide, 2 layers,
  4 query / 2 key-value heads, a 512-token vocabulary), random init from the comparison's seed;
- ``llama-weights/``: a tinier Llama (16 wide, 1 layer, 128 tokens) with its weights as ``model.safetensors``;
- ``train.bin``: 12,000 uint16 tokens below 512 (nanoGPT's format), from a first-order chain so a model can learn;
- ``shard.bin``: the same tokens as an llm.c shard (256 int32 header: magic 20240520, version 1, count);
- ``tokens.npy``: the same tokens as a uint32 .npy;
- ``corpus.txt`` and ``tokenizer.json``: a small text and a word-level tokenizer trained on it (vocabulary < 512).

    python tests/data/user/make_user_data.py
"""

from __future__ import annotations

import json
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
COMMON = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
          "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
FAMILIES = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": True},  # as Llama 3.2 1B
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 16},
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "head_dim": 16,
               "query_pre_attn_scalar": 16, "tie_word_embeddings": True, "pad_token_id": 0},
    "phi3": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "pad_token_id": 0},
    "olmo2": {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "pad_token_id": 0},
}
WORDS = ("the a model shard gradient rank step loss tensor layer memory bytes gather reduce scatter all each "
         "every parallel data pipeline stage batch token sequence weight optimizer state compute").split()


def chain_tokens(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    """``n`` tokens of a first-order chain (each token has 4 likely successors): learnable, below ``vocab``."""
    rng = np.random.default_rng(seed)
    table = rng.integers(0, vocab, size=(vocab, 4))
    out = np.empty(n, dtype=np.int64)
    out[0] = 0
    for i in range(1, n):
        out[i] = table[out[i - 1], rng.choice(4, p=(0.6, 0.25, 0.1, 0.05))]
    return out


def main() -> None:
    for family, values in FAMILIES.items():
        os.makedirs(os.path.join(HERE, family), exist_ok=True)
        with open(os.path.join(HERE, family, "config.json"), "w", encoding="utf-8") as fh:
            json.dump({**COMMON, **values}, fh, indent=2, sort_keys=True)
    import torch
    from safetensors.torch import save_model
    from transformers import AutoConfig, AutoModelForCausalLM

    small = {**COMMON, **FAMILIES["llama"], "tie_word_embeddings": False, "vocab_size": 128, "hidden_size": 16, "intermediate_size": 32,
             "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    folder = os.path.join(HERE, "llama-weights")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(small, fh, indent=2, sort_keys=True)
    torch.manual_seed(7)
    cfg = AutoConfig.for_model(**{k: v for k, v in small.items() if k != "architectures"})
    save_model(AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16), os.path.join(folder, "model.safetensors"))

    tokens = chain_tokens(12_000, 512)
    tokens.astype(np.uint16).tofile(os.path.join(HERE, "train.bin"))
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240520, 1, len(tokens))
    with open(os.path.join(HERE, "shard.bin"), "wb") as fh:
        fh.write(header.tobytes())
        fh.write(tokens.astype(np.uint16).tobytes())
    np.save(os.path.join(HERE, "tokens.npy"), tokens.astype(np.uint32))

    rng = np.random.default_rng(1)
    text = "\n".join(" ".join(rng.choice(WORDS, size=12)) + "." for _ in range(250))
    with open(os.path.join(HERE, "corpus.txt"), "w", encoding="utf-8") as fh:
        fh.write(text + "\n")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([os.path.join(HERE, "corpus.txt")], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(os.path.join(HERE, "tokenizer.json"))


if __name__ == "__main__":
    main()
